import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks

from autotp.runtime.processes.launcher import RankError


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> torch.Tensor:
    t = torch.full((3,), float(rank + 1) * scale)
    dist.all_reduce(t)
    return t


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one exploded")
    return rank


def _sleep_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_all_reduce_across_four_ranks() -> None:
    results = run_on_ranks(_all_reduce_rank, 4, 2.0, timeout_s=120)
    assert len(results) == 4
    for t in results:
        torch.testing.assert_close(t, torch.full((3,), 20.0))


def test_exception_in_rank_surfaces_with_traceback() -> None:
    with pytest.raises(RankError, match="rank one exploded") as info:
        run_on_ranks(_fail_on_rank_1, 2, timeout_s=120)
    assert info.value.rank == 1
    assert "_fail_on_rank_1" in str(info.value)


def test_hanging_rank_times_out_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        run_on_ranks(_sleep_on_rank_1, 2, timeout_s=12)
    assert time.monotonic() - start < 30
