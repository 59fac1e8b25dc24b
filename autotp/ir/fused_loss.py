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

With ``fp8`` = ``"tensorwise"`` (``plan.fp8_linears`` lists the lm_head weight with that recipe;
off by default) the three GEMMs run in FP8 as ``autotp.ir.fp8``'s tensorwise recipe does: h
and W quantized once (E4M3, one scale each, W's amax max-reduced over the tp group that splits
the vocabulary), each chunk's logit gradient g in E5M2 with its own scale (its amax
max-reduced over the group: g is split on the vocabulary), ``dh = g8 · W8`` and
``dW += g8ᵀ · h8`` reading the FP8 copies transposed.

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

from autotp.ir import fp8, ops
from autotp.ir.vocab_logits import check_ids, local_logits, loss_dtype, target_in_range

_MEAN = 1


class _HeadGemms:
    """The fused loss's three GEMMs per chunk, in the weight's dtype or (``recipe``) in FP8."""

    def __init__(self, h: Tensor, weight: Tensor, recipe: str, vocab_split: bool, group: str) -> None:
        self.h, self.weight = h, weight
        self.recipe = fp8.RECIPES[recipe] if recipe else None
        self.vocab_split, self.group = vocab_split, group
        if self.recipe is None:
            return
        assert self.recipe.name == fp8.TENSORWISE, "the fused loss runs tensorwise FP8 only"
        h_amax, w_amax = fp8.group_amaxes([(h, fp8.WHOLE, False, False), (weight, fp8.WHOLE, vocab_split, False)], group)
        self.h8, self.sh = fp8.cast(h, h_amax, fp8.E4M3, fp8.WHOLE, False)
        self.w8, self.sw = fp8.cast(weight, w_amax, fp8.E4M3, fp8.WHOLE, False)
        self.wt8 = self.w8.t().contiguous()  # [H, V]: dgrad's second operand
        self.m_multiple = fp8.CUDA_DIM_MULTIPLE if h.device.type == "cuda" else 1

    def logits(self, start: int, stop: int) -> Tensor:
        if self.recipe is None:
            return self.h[start:stop] @ self.weight.t()
        return fp8.scaled_gemm(self.h8[start:stop], self.sh, fp8.WHOLE, self.w8, self.sw, fp8.WHOLE, self.weight.dtype,
                               self.recipe.fast_accum_forward)  # fmt: skip

    def backward(self, g: Tensor, start: int, stop: int, grad_weight: Tensor) -> Tensor:
        """This chunk's ``g @ W``; adds ``gᵀ @ h`` to ``grad_weight``."""
        if self.recipe is None:
            grad_weight.addmm_(g.t(), self.h[start:stop])
            return g @ self.weight
        (g_amax,) = fp8.group_amaxes([(g, fp8.WHOLE, False, self.vocab_split)], self.group)
        g8, sg = fp8.cast(g, g_amax, self.recipe.grad_dtype, fp8.WHOLE, False)
        gt8 = fp8.pad_fp8_cols(g8.t().contiguous(), self.m_multiple)
        ht8 = fp8.pad_fp8_cols(self.h8[start:stop].t().contiguous(), self.m_multiple)
        grad_weight.add_(fp8.scaled_gemm(gt8, sg, fp8.WHOLE, ht8, self.sh, fp8.WHOLE, grad_weight.dtype, False))
        return fp8.scaled_gemm(g8, sg, fp8.WHOLE, self.wt8, self.sw, fp8.WHOLE, g.dtype, False)


def _stats(logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, group_size: int, group: str,
           whole: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per token of the chunk: log-sum-exp over the whole vocabulary and the target's logit (in ``vocab_logits.loss_dtype``)."""
    in_range, local_target = target_in_range(target, vocab_start, logits.shape[-1])
    picked = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).to(loss_dtype(logits.dtype)).masked_fill(~in_range, 0.0)
    x = local_logits(logits, vocab_start, vocab_size)
    x = x.clone() if x is logits else x  # logits already in the loss dtype: work on a copy
    row_max = x.amax(dim=-1, keepdim=True)
    lse = x.sub_(row_max).exp_().sum(dim=-1).log_().add_(row_max.squeeze(-1))
    if whole:
        return lse, picked
    every = ops.ALL_GATHER(torch.stack([lse, picked]), 0, group_size, group).view(group_size, 2, -1)
    return every[:, 0].logsumexp(dim=0), every[:, 1].sum(dim=0)


def _logit_grad(logits: Tensor, target: Tensor, lse: Tensor, weight: Tensor, vocab_start: int, vocab_size: int) -> Tensor:
    """``(softmax - onehot(target)) * weight`` per token on this rank's columns, in the logits' dtype."""
    x = local_logits(logits, vocab_start, vocab_size)
    x = x.clone() if x is logits else x
    g = x.sub_(lse.unsqueeze(-1)).exp_()
    in_range, local_target = target_in_range(target, vocab_start, x.shape[-1])
    g.scatter_add_(-1, local_target.unsqueeze(-1), -in_range.to(g.dtype).unsqueeze(-1))
    return g.mul_(weight.unsqueeze(-1)).to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, target: Tensor, vocab_start: int, vocab_size: int,  # type: ignore[override]
                ignore_index: int, reduction: int, chunk: int, group_size: int, group: str, fp8_recipe: str) -> Tensor:  # fmt: skip
        h = hidden.reshape(-1, hidden.shape[-1])
        t = target.reshape(-1)
        valid = t != ignore_index
        check_ids(t, vocab_size, "labels (other than ignore_index)", skip=~valid)
        counted = valid.to(loss_dtype(hidden.dtype))
        token_weight = counted / valid.sum() if reduction == _MEAN else counted
        whole = vocab_start == 0 and weight.shape[0] >= vocab_size  # a replicated lm_head: nothing to combine
        losses, grads_hidden = [], []
        grad_weight = torch.zeros_like(weight)
        gemms = _HeadGemms(h, weight, fp8_recipe, not whole, "" if whole else group)
        for start in range(0, h.shape[0], chunk):
            stop = start + chunk
            tc, wc = t[start:stop], token_weight[start:stop]
            logits = gemms.logits(start, stop)
            lse, picked = _stats(logits, tc, vocab_start, vocab_size, group_size, group, whole)
            losses.append((lse - picked) * wc)
            g = _logit_grad(logits, tc, lse, wc, vocab_start, vocab_size)
            del logits
            grads_hidden.append(gemms.backward(g, start, min(stop, h.shape[0]), grad_weight))
        ctx.save_for_backward(torch.cat(grads_hidden).view_as(hidden), grad_weight)
        return torch.cat(losses).sum()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_needs, weight_needs = ctx.needs_input_grad[:2]
        return (grad_hidden * grad.to(grad_hidden.dtype) if hidden_needs else None,
                grad_weight * grad.to(grad_weight.dtype) if weight_needs else None,
                None, None, None, None, None, None, None, None, None)  # fmt: skip


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, vocab_start: int, vocab_size: int, ignore_index: int,
                         reduction: int, chunk: int, group_size: int, group: str, fp8_recipe: str = "") -> Tensor:  # fmt: skip
    """The op's implementation; ``reduction`` is aten's code, mean (1) or sum (2)."""
    return _LinearCrossEntropy.apply(hidden, weight, target, vocab_start, vocab_size, ignore_index, reduction, chunk, group_size,
                                     group, fp8_recipe)  # fmt: skip


_KERNELS = Library(ops.NAMESPACE, "IMPL")
_KERNELS.impl(ops.LINEAR_CROSS_ENTROPY._schema.name.split("::")[1], linear_cross_entropy, "CompositeImplicitAutograd")
