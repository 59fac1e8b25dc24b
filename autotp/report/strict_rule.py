"""The strict rule: does a parallelized model count as passing?

A model passes at a given (tp, pp, sequence parallelism) only if, on every rank,

1. **numerics are equal**: the loss, the logits and every parameter's gradient of the
   parallel model match the unmodified model's on the same inputs (``RTOL``, ``ATOL``;
   fp32 on the CPU is where they are meant);
2. **the rank holds a shard**: at most ``SLACK / (tp * pp)`` of the model's parameters
   (counted once per tensor; padding rows count);
3. **no weight is kept whole silently**: every weight (two or more dims) that a matmul
   reads (dense or grouped, through views, casts and elementwise ops of it alone) is sharded by the plan or has a
   ``ParallelPlan.kept_whole`` entry saying why (only checked with tp > 1).

``check_on_rank`` runs on each rank of a process group of ``tp * pp`` ranks (as
``autotp.parallelize`` needs); ``combine`` folds the ranks' results into one. The registry
sweep (``benchmarks/sweep_registry.py``) and the plain-PyTorch suite (``tests/``) use it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from autotp.analysis.loss_fn_rows import loss_fn_refusal
from autotp.analysis.trace_guards import one_process_view
from autotp.ir.op_facts import is_alias, is_matmul, is_pointwise
from autotp.api import parallelize
from autotp.compiler import example_kwargs
from autotp.runtime.execution.batch_pieces import microbatches
from autotp.runtime.execution.model_loss import returned_logits, returned_loss

RTOL, ATOL = 1e-4, 1e-6
SLACK = 1.3
"""A rank may hold at most ``SLACK / (tp * pp)`` of the parameters."""
RNG_SEED = 0  # both sides draw the same random numbers (a forward that samples: masks, noise)

LossFn = Callable[[Any], torch.Tensor]
_CASTS = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.type_as.default,
          torch.ops.aten.clone.default, torch.ops.aten.contiguous.default}  # fmt: skip


@dataclass(frozen=True)
class StrictResult:
    """One rank's verdict (or all ranks', after ``combine``)."""

    error: str = ""  # parallelize or a step raised: the exception's first line
    mismatch: str = ""  # the first value that differs from the unmodified model's
    share: float = 0.0  # this rank's fraction of the model's parameters (the largest, combined)
    limit: float = 1.0  # SLACK / (tp * pp)
    unexplained: tuple[str, ...] = ()  # matmul weights kept whole without a kept_whole entry
    kept_whole: tuple[str, ...] = ()  # those with one
    heaviest: tuple[str, ...] = ()  # the largest parameters the rank holds whole, with their share and why

    @property
    def equal(self) -> bool:
        return not self.error and not self.mismatch

    @property
    def passed(self) -> bool:
        return self.equal and self.share <= self.limit and not self.unexplained

    @property
    def reason(self) -> str:
        """Why it fails ('' when it passes)."""
        if self.error:
            return self.error
        if self.mismatch:
            return f"numerics: {self.mismatch}"
        parts = []
        if self.share > self.limit:
            largest = f"; largest held whole: {', '.join(self.heaviest)}" if self.heaviest else ""
            parts.append(f"a rank holds {self.share:.0%} of the parameters (at most {self.limit:.0%}){largest}")
        if self.unexplained:
            names = ", ".join(self.unexplained[:3]) + (f" and {len(self.unexplained) - 3} more" if len(self.unexplained) > 3 else "")
            parts.append(f"kept whole without a plan entry: {names}")
        return "; ".join(parts)


def combine(results: list[StrictResult]) -> StrictResult:
    """The ranks' results as one: the first error and mismatch, the largest share, every weight named."""
    return StrictResult(
        error=next((r.error for r in results if r.error), ""),
        mismatch=next((r.mismatch for r in results if r.mismatch), ""),
        share=max(r.share for r in results),
        limit=results[0].limit,
        heaviest=max(results, key=lambda r: r.share).heaviest,
        unexplained=tuple(sorted({n for r in results for n in r.unexplained})),
        kept_whole=tuple(sorted({n for r in results for n in r.kept_whole})),
    )


def check_on_rank(
    model: nn.Module,
    inputs: dict[str, Any],
    *,
    tp: int,
    pp: int = 1,
    sequence_parallel: bool = False,
    loss_fn: LossFn | None = None,
    microbatches: int = 2,
    rtol: float = RTOL,
    atol: float = ATOL,
    **parallelize_kwargs: Any,
) -> StrictResult:
    """Parallelize ``model`` at (tp, pp) on this rank and check the strict rule against an
    unmodified copy. ``loss_fn(outputs)`` is the loss of a model whose outputs hold none
    (else the loss forward returned, as ``train_step`` finds it). Exceptions become ``StrictResult.error``."""
    limit = SLACK / (tp * pp)
    try:
        reference = copy.deepcopy(model)
        pm = parallelize(model, tp=tp, pp=pp, example_inputs=inputs, sequence_parallel=sequence_parallel, **parallelize_kwargs)
        torch.manual_seed(RNG_SEED)
        with one_process_view():  # the unmodified model as one process runs it, as autotp traced it
            ref_out = reference(**example_kwargs(reference, inputs))
            ref_loss, ref_logits = _loss_logits(ref_out, loss_fn)
            # a forward or loss_fn that mixes its batch's rows trains the batch whole, as train_step's refusal asks
            whole = (pp == 1 or pm.plan.batch_mixing or microbatches == 1
                     or bool(loss_fn and loss_fn_refusal(loss_fn, ref_out, pm.plan.output_batch_dims)))  # fmt: skip
            if whole or not pm.plan.batch_statistics:
                ref_loss.backward()
            else:  # a loss term over statistics of the rows: train_step computes it per microbatch, so does the reference
                ref_loss = _per_piece_step(reference, inputs, microbatches, loss_fn, dict(pm.plan.input_batch_dims))
        torch.manual_seed(RNG_SEED)
        if pp == 1:
            out = pm(**inputs)
            loss, logits = _loss_logits(out, loss_fn)
            loss.backward()
        else:
            entry = {name: b.clone() for name, b in pm.named_buffers()}
            with torch.no_grad():
                _, logits = _loss_logits(pm(**inputs), loss_fn)
                for name, b in pm.named_buffers():  # the step starts from the state the one reference forward saw
                    b.copy_(entry[name])
            torch.manual_seed(RNG_SEED)
            split = {"num_microbatches": 1, "schedule": "gpipe"} if whole else {"num_microbatches": microbatches}
            loss = pm.train_step(**inputs, loss_fn=loss_fn, **split)
        mismatch = _first_mismatch(
            [("loss", loss, ref_loss), ("logits", logits, ref_logits)], reference, pm.unshard_grads(), rtol, atol
        )
        facts = _PlanFacts(pm, reference, inputs)
        share = sum(p.numel() for p in pm.parameters()) / max(facts.total, 1)
        unexplained, kept = facts.weights_kept_whole() if tp > 1 else ((), ())
        return StrictResult("", mismatch, share, limit, unexplained, kept, facts.heaviest(pm))
    except Exception as e:  # noqa: BLE001 - the verdict names it
        lines = str(e).strip().splitlines()
        return StrictResult(error=f"{type(e).__name__}: {lines[0] if lines else ''}"[:400], limit=limit)


def _per_piece_step(reference: nn.Module, inputs: dict[str, Any], pieces: int, loss_fn: LossFn | None,
                    batch_dims: dict[str, int]) -> torch.Tensor:  # fmt: skip
    """The mean of the reference's losses over ``pieces`` microbatches of ``inputs``, each
    piece's gradient accumulated with weight 1/pieces (``train_step``'s split step)."""
    losses = []
    for piece in microbatches(inputs, 1, 0, pieces, True, batch_dims):
        loss, _ = _loss_logits(reference(**example_kwargs(reference, piece)), loss_fn)
        (loss / pieces).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def _loss_logits(out: Any, loss_fn: LossFn | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (loss_fn(out) if loss_fn is not None else returned_loss(out)), returned_logits(out)


def _first_mismatch(
    outputs: list[tuple[str, Any, Any]], reference: nn.Module, grads: dict[str, torch.Tensor | None], rtol: float, atol: float
) -> str:
    """The first of the outputs and of the reference's grads that differs ('' if none does)."""

    def differs(got: Any, want: Any) -> str:
        try:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        except AssertionError as e:
            return " ".join(str(e).split())[:300]
        return ""

    for what, got, want in outputs:
        if want is None:
            continue
        if got is None:
            return f"{what}: missing from the parallel model's outputs"
        why = differs(got.detach(), want.detach())
        if why:
            return f"{what}: {why}"
    for name, p in reference.named_parameters():
        got = grads.get(name)
        if p.grad is None:
            if got is not None and got.count_nonzero():
                return f"grad of {name}: the unmodified model has none"
            continue
        if got is None:
            if p.grad.numel() == 0:  # an empty parameter (no memory slots configured): nothing to update either way
                continue
            return f"grad of {name}: missing"
        why = differs(got, p.grad.to_dense() if p.grad.is_sparse else p.grad)  # unshard_grads gives sparse grads dense
        if why:
            return f"grad of {name}: {why}"
    return ""


def matmul_weights(gm: GraphModule) -> set[str]:
    """The weights (parameters of two or more dims) that a matmul of ``gm`` (dense, grouped or
    an ``einsum``) reads, through views, casts and elementwise ops of one tensor."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    found: set[str] = set()
    for node in gm.graph.nodes:
        if not is_matmul(node) and node.target is not torch.ops.aten.einsum.default:
            continue
        stack = list(node.all_input_nodes)
        while stack:
            a = stack.pop()
            if a.op == "get_attr" and str(a.target) in params and params[str(a.target)].dim() >= 2:
                found.add(str(a.target))
            elif is_alias(a) or (a.op == "call_function" and a.target in _CASTS):
                stack.append(a.args[0])
            elif is_pointwise(a.target) and len(a.all_input_nodes) == 1:
                stack.append(a.all_input_nodes[0])  # w * scale, a fake-quantization Function of w
    return found


class _PlanFacts:
    """What the plan and the rank's graph say about the reference model's parameters (by canonical name)."""

    def __init__(self, pm: Any, reference: nn.Module, inputs: dict[str, Any]) -> None:
        names: dict[int, list[str]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        for name, p in reference.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
            self.tensors.setdefault(names[id(p)][0], p)
        self.canonical = {alias: group[0] for group in names.values() for alias in group}
        self.total = sum(p.numel() for p in self.tensors.values())
        plan = pm.plan
        self.tp = plan.tp
        self.sharded = {self._name(p.name) for p in plan.params}
        self.kept = {self._name(k.name): k for k in plan.kept_whole}
        graph = pm.graph_for(**inputs)
        self.read = {self._name(str(n.target)) for n in graph.graph.nodes if n.op == "get_attr" and n.users}
        self.matmul_read = {self._name(n) for n in matmul_weights(graph)}

    def _name(self, name: str) -> str:
        return self.canonical.get(name, name)

    def weights_kept_whole(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(matmul weights kept whole with no plan entry, those with one)."""
        whole = self.matmul_read - self.sharded
        return tuple(sorted(whole - set(self.kept))), tuple(sorted(whole & set(self.kept)))

    def heaviest(self, pm: Any, count: int = 3) -> tuple[str, ...]:
        """The ``count`` largest parameters this rank holds whole: name (share of the model: why)."""
        held = [self._name(n) for n, _ in pm.named_parameters()]
        whole = sorted((n for n in held if n not in self.sharded and n in self.tensors), key=lambda n: -self.tensors[n].numel())
        return tuple(f"{n} ({self.tensors[n].numel() / max(self.total, 1):.0%}: {self._why(n)})" for n in whole[:count])

    def _why(self, name: str) -> str:
        if name not in self.read:
            return "never read by the traced forward"
        kept = self.kept.get(name)
        if kept is None:
            return "no plan entry" if self.tp > 1 else "not split without tp"
        if " in module " not in kept.detail or ": " not in kept.detail:
            return f"{kept.reason}, {kept.detail}" if kept.detail else kept.reason
        return f"{kept.reason}, {kept.detail.rsplit(': ', 1)[-1]} at {kept.detail.split(' in module ')[0]}"
