"""The planner's memory model against the peak live bytes of real CPU training steps (``memory_check``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from memory_check import Case, measure, predict
from torch.fx.experimental.proxy_tensor import make_fx

from autotp.analysis.local_shapes import global_tensors
from autotp.cost_model.saved_tensors import needs_grad, saved_inputs
from autotp.cost_model.liveness import simulate
from autotp.runtime.execution.live_memory import PeakLiveBytes

TOLERANCE = 0.10

FAST = [Case(), Case(microbatches=4, global_batch=4)]  # grad accumulation: m = 1, 4 (m = 2 with the matrix)
MATRIX = [
    Case(microbatches=2, global_batch=4),
    Case(tp=2),
    Case(tp=2, sequence_parallel=True),
    Case(dp=2, global_batch=8),
    Case(dp=2, global_batch=8, distributed_optimizer=True),
    Case(pp=2, microbatches=4, global_batch=8, schedule="1f1b"),
    Case(pp=2, microbatches=4, global_batch=8, schedule="gpipe"),
    Case(pp=2, microbatches=4, global_batch=8, schedule="zbh1"),
    Case(pp=2, vpp=2, microbatches=4, global_batch=8, schedule="interleaved"),
]


def test_tracker_counts_storages_once_and_frees_them() -> None:
    with PeakLiveBytes() as m:
        start = m.current
        x = torch.empty(1000, dtype=torch.float32)
        view = x.view(10, 100)
        y = x + 1
        assert m.current - start == 8000  # x and y; the view shares x's storage
        del x, view, y
        m.mark("freed")
        z = torch.ones(10)
    assert m.marks[-1][1] == start
    assert m.peak - start == 8000
    assert z.sum() == 10


def _replay(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], batch: int = 4) -> tuple[float, float]:
    """(saved, backward peak) bytes of ``fn``'s graph in the liveness replay, one segment."""
    gm = make_fx(fn)(torch.randn(batch, 8))
    grad = needs_grad(gm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    dependent = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for n in calls:
        if any(a in dependent for a in n.all_input_nodes):
            dependent.add(n)
    tensors = {n: global_tensors(n) for n in gm.graph.nodes}
    saved_by = {n: saved_inputs(n, grad) for n in calls}
    memory = simulate(gm, tensors, dependent, grad, saved_by, dict.fromkeys(calls, 0), batch)[0]
    at = np.array([1.0, batch])
    return float(memory.saved @ at), float(np.max(memory.backward @ at))


def test_outputs_the_loss_does_not_read_get_no_gradient() -> None:
    """Like gathered logits: a second output is dropped after the forward, and the backward from the
    loss never reaches it (its gradient and what its nodes save are not charged)."""
    w = torch.nn.Parameter(torch.randn(16, 8))

    def loss_only(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.tanh(torch.ops.aten.linear(x, w)).sum(),)

    def with_extra_output(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.tanh(torch.ops.aten.linear(x, w))
        return y.sum(), y.exp()

    assert _replay(with_extra_output) == _replay(loss_only)


def _check(case: Case) -> None:
    measured, predicted = measure(case), predict(case)
    error = predicted / measured - 1
    print(f"{case}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, {error:+.1%}")
    assert abs(error) <= TOLERANCE, f"{case}: predicted {predicted} bytes, measured {measured} ({error:+.1%})"


@pytest.mark.parametrize("case", FAST, ids=str)
def test_memory_model_one_rank(case: Case) -> None:
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=str)
def test_memory_model_every_plan_kind(case: Case) -> None:
    _check(case)
