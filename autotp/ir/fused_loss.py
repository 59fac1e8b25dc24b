"""``autotp::linear_cross_entropy``: the lm_head GEMM and the cross entropy, ``chunk`` tokens at a
time, both gradients computed in the forward (schema in ``autotp.ir.ops``).

For each chunk of c tokens (h: [c, H], this rank's weight rows W: [V_l, H], columns
``vocab_start ...`` of the class dim):

* ``logits = h @ W.T`` in the weight's dtype (what the unfused ``linear`` computes), then in
  float32 this rank's log-sum-exp and target logit; over the tp ranks the log-sum-exp is the
  ``logsumexp`` of the ranks' and the target logit their sum (one ``all_gather`` of both per
  chunk). Padded vocabulary columns count as ``-inf``.
* each token's loss is ``lse - target_logit``; the gradient of its logits for a loss gradient
  of 1 is ``(softmax - onehot) · w``, w = 1/(valid tokens) for the mean, 1 for the sum, 0 for
  an ignored token, in the weight's dtype;
* ``grad_hidden[chunk] = g @ W`` (this rank's partial sum: the ``copy_to_tp`` before the
  lm_head all-reduces it backward) and ``grad_weight += g.T @ h``.

At most one chunk of logits and its gradient are alive (the elementwise steps work in place on
one float32 copy), and no GEMM runs twice: the backward only scales the two saved gradients by
the loss's gradient. The op is ``CompositeImplicitAutograd`` around an ``autograd.Function``, so
``torch.compile`` traces the chunks and fuses each one's elementwise work.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.library import Library

from autotp.ir import ops

_MEAN = 1


def _stats(logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, group_size: int, group: str,
           whole: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per token of the chunk: log-sum-exp over the whole vocabulary and the target's logit (float32)."""
    in_range, local_target = ops.target_in_range(target, vocab_start, logits.shape[-1])
    picked = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float().masked_fill(~in_range, 0.0)
    x = ops.local_logits(logits, vocab_start, vocab_size)
    x = x.clone() if x is logits else x  # float32 logits: work on a copy
    row_max = x.amax(dim=-1, keepdim=True)
    lse = x.sub_(row_max).exp_().sum(dim=-1).log_().add_(row_max.squeeze(-1))
    if whole:
        return lse, picked
    every = ops.ALL_GATHER(torch.stack([lse, picked]), 0, group_size, group).view(group_size, 2, -1)
    return every[:, 0].logsumexp(dim=0), every[:, 1].sum(dim=0)


def _logit_grad(logits: Tensor, target: Tensor, lse: Tensor, weight: Tensor, vocab_start: int, vocab_size: int) -> Tensor:
    """``(softmax - onehot(target)) * weight`` per token on this rank's columns, in the logits' dtype."""
    x = ops.local_logits(logits, vocab_start, vocab_size)
    x = x.clone() if x is logits else x
    g = x.sub_(lse.unsqueeze(-1)).exp_()
    in_range, local_target = ops.target_in_range(target, vocab_start, x.shape[-1])
    g.scatter_add_(-1, local_target.unsqueeze(-1), -in_range.to(g.dtype).unsqueeze(-1))
    return g.mul_(weight.unsqueeze(-1)).to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, target: Tensor, vocab_start: int, vocab_size: int,  # type: ignore[override]
                ignore_index: int, reduction: int, chunk: int, group_size: int, group: str) -> Tensor:  # fmt: skip
        h = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1)
        valid = t != ignore_index
        ops.check_ids(t, vocab_size, "labels (other than ignore_index)", skip=~valid)
        token_weight = valid.float() / valid.sum() if reduction == _MEAN else valid.float()
        whole = vocab_start == 0 and weight.shape[0] >= vocab_size  # a replicated lm_head: nothing to combine
        losses, grads_hidden = [], []
        grad_weight = torch.zeros_like(weight)
        for start in range(0, h.shape[0], chunk):
            hc, tc, wc = h[start : start + chunk], t[start : start + chunk], token_weight[start : start + chunk]
            logits = hc @ weight.t()
            lse, picked = _stats(logits, tc, vocab_start, vocab_size, group_size, group, whole)
            losses.append((lse - picked) * wc)
            g = _logit_grad(logits, tc, lse, wc, vocab_start, vocab_size)
            del logits
            grads_hidden.append(g @ weight)
            grad_weight.addmm_(g.t(), hc)
        ctx.save_for_backward(torch.cat(grads_hidden).view_as(hidden), grad_weight)
        return torch.cat(losses).sum()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_needs, weight_needs = ctx.needs_input_grad[:2]
        return (grad_hidden * grad.to(grad_hidden.dtype) if hidden_needs else None,
                grad_weight * grad.to(grad_weight.dtype) if weight_needs else None,
                None, None, None, None, None, None, None, None)  # fmt: skip


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, vocab_start: int, vocab_size: int, ignore_index: int,
                         reduction: int, chunk: int, group_size: int, group: str) -> Tensor:  # fmt: skip
    """The op's implementation; ``reduction`` is aten's code, mean (1) or sum (2)."""
    return _LinearCrossEntropy.apply(hidden, weight, target, vocab_start, vocab_size, ignore_index, reduction, chunk, group_size, group)


_KERNELS = Library(ops.NAMESPACE, "IMPL")
_KERNELS.impl(ops.LINEAR_CROSS_ENTROPY._schema.name.split("::")[1], linear_cross_entropy, "CompositeImplicitAutograd")
