"""The planner's memory model against the peak live bytes of real CPU training steps (``memory_check``)."""

from __future__ import annotations

import pytest
import torch
from memory_check import Case, measure, predict

from autotp.runtime.live_memory import PeakLiveBytes

TOLERANCE = 0.10

FAST = [Case(), Case(microbatches=2, global_batch=4)]
MATRIX = [
    Case(tp=2),
    pytest.param(
        Case(tp=2, sequence_parallel=True),
        marks=pytest.mark.xfail(strict=True, reason="over-predicts ~11%: the replay sees SP's sequence-sharded tensors whole"),
    ),
    Case(dp=2, global_batch=8),
    Case(dp=2, global_batch=8, distributed_optimizer=True),
    Case(pp=2, microbatches=4, global_batch=8, schedule="1f1b"),
    Case(pp=2, microbatches=4, global_batch=8, schedule="gpipe"),
    pytest.param(
        Case(pp=2, microbatches=4, global_batch=8, schedule="zbh1"),
        marks=pytest.mark.xfail(strict=True, reason="ZB-H1 holds ~15-20% more than its W inputs and output gradients; not modelled yet"),
    ),
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


def _check(case: Case) -> None:
    measured, predicted = measure(case), predict(case)
    error = predicted / measured - 1
    print(f"{case}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, {error:+.1%}")
    assert abs(error) <= TOLERANCE, f"{case}: predicted {predicted} bytes, measured {measured} ({error:+.1%})"


@pytest.mark.parametrize("case", FAST, ids=str)
def test_memory_model_one_rank(case: Case) -> None:
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATRIX, ids=lambda c: str(c) if isinstance(c, Case) else None)
def test_memory_model_every_plan_kind(case: Case) -> None:
    _check(case)
