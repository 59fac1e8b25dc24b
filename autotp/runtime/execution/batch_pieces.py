"""How ``train_step`` cuts a batch into pieces (dp ranks x microbatches), and what each piece
must know of the whole batch: the whole batch's loss denominators (``autotp.ir.batch_denominators``)
and its random draws (``autotp.ir.batch_draws``)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from autotp.analysis.batch_rows import UNKNOWN_ROWS, batch_size, input_row_dims
from autotp.ir import batch_denominators, batch_draws, meta_keys
from autotp.ir.errors import UserInputError
from autotp.ir.op_facts import mutated_base
from autotp.ir.program import RankProgram
from autotp.runtime.state.parameters import Parameters


def microbatches(batch: dict[str, Any], dp: int, dp_rank: int, m: int, batch_is_local: bool,
                 batch_dims: Mapping[str, int] = MappingProxyType({})) -> list[dict[str, Any]]:  # fmt: skip
    """This dp rank's ``m`` microbatches of ``batch`` (its own shard with ``batch_is_local``):
    every tensor of the batch's rows, nested ones included, cut along the dim holding them
    (``batch_rows.input_row_dims`` under the plan's ``batch_dims``)."""
    shards = 1 if batch_is_local else dp
    if shards * m == 1:  # the whole batch is the one piece
        return [batch]
    size = batch_size(batch, batch_dims)
    if m < 1 or size % (shards * m):
        raise UserInputError(
            f"the {'local' if batch_is_local else 'global'} batch of {size} does not split into "
            f"{'' if batch_is_local else f'dp={dp} x '}{m} microbatches; "
            f"use a batch size that is a multiple of {shards * max(m, 1)}"
        )
    leaves, spec = tree_flatten_with_path(batch)
    dims = input_row_dims(batch, batch_dims)
    if shards * m > 1:
        unknown = [keystr(path) for (path, _), d in zip(leaves, dims) if d == UNKNOWN_ROWS]
        if unknown:
            raise UserInputError(
                f"input {unknown[0]} has a dim of the batch's size ({size}) past dim 0, and the trace could not tell "
                f"whether it holds the batch's rows, so the batch cannot be split over dp={shards} x {m} microbatches; "
                f"put the batch on dim 0 of that input, or train with one microbatch and dp=1"
            )
    step = size // (shards * m)
    first = 0 if batch_is_local else dp_rank * step * m
    return [
        tree_unflatten([v if d is None or d == UNKNOWN_ROWS else v.narrow(d, first + i * step, step) for (_, v), d in zip(leaves, dims)], spec)
        for i in range(m)
    ]


_WRITTEN_INPUTS: weakref.WeakKeyDictionary[GraphModule, frozenset[str]] = weakref.WeakKeyDictionary()


def _written_inputs(graph: GraphModule) -> frozenset[str]:
    """The inputs ``graph`` writes in place (found once per graph, not per step)."""
    if graph not in _WRITTEN_INPUTS:
        nodes = graph.graph.nodes
        _WRITTEN_INPUTS[graph] = frozenset(str(b.target) for n in nodes if (b := mutated_base(n)) is not None and b.op == "placeholder")
    return _WRITTEN_INPUTS[graph]


@contextmanager
def own_written_inputs(program: RankProgram, calls: list[dict[str, Any]]) -> Iterator[None]:
    """For a step of several pieces whose forward writes an input in place (FSMT's
    ``input_ids.masked_fill_``): each piece gets its own copy of that input, written back into
    the caller's tensor when the step is done. The pieces are views of one tensor, which share
    a version counter, so the next piece's write would fail the backward of every piece that
    saved its view (autograd's "modified by an inplace operation")."""
    pairs = []
    if len(calls) > 1:
        written = _written_inputs(program.graph)
        for call in calls:
            for name in written & call.keys():
                if isinstance(call[name], torch.Tensor):
                    view, call[name] = call[name], call[name].clone()
                    pairs.append((view, call[name]))
    yield
    with torch.no_grad():
        for view, own in pairs:
            view.copy_(own)


def whole_batch_denominators(program: RankProgram, calls: list[dict[str, Any]], pieces: int, params: Parameters,
                             device: torch.device, dp_group: Any) -> dict[str, torch.Tensor]:  # fmt: skip
    """The whole batch's value of each ``batch_denominator`` of ``program`` (a split step's) for a
    step of ``pieces`` pieces, of which ``calls`` are this rank's; the other pieces are the
    other ranks' of ``dp_group`` (None: no other). Inside ``step_draws``: a core reads its
    piece's draws, which the forwards then take again."""
    programs = program.graph.meta.get(meta_keys.BATCH_DENOMINATORS, ())
    if not programs:
        return {}
    cores = [p.core for p in programs]
    params.attach(cores)
    try:
        for core in cores:
            for name, t in core.named_buffers():
                if isinstance(t, FakeTensor) or t.device.type == "meta":
                    raise UserInputError(f"the loss divides by a statistic of the batch that reads '{name}', which this "
                                         "rank does not hold; train with dp=1 and num_microbatches=1")  # fmt: skip

        def over_dp(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            if dp_group is not None:
                dist.all_reduce(t, group=dp_group)
            return t

        with torch.no_grad(), batch_draws.handed_out_again():
            return batch_denominators.whole_batch_values(programs, calls, pieces, over_dp)
    finally:
        Parameters.release(cores)


def step_draws(program: RankProgram, pieces: int, first: int, count: int) -> AbstractContextManager[None]:
    """``program``'s random draws made once for a step of ``pieces`` pieces, of which this
    rank runs ``count`` from piece ``first`` on (``batch_draws.step_draws``)."""
    return batch_draws.step_draws(program.graph.meta.get(meta_keys.BATCH_DRAWS, ()), pieces, range(first, first + count))
