import os
import threading
import time

import pytest
import torch.distributed as dist

from autotp.runtime.processes import launcher
from autotp.runtime.processes.launcher import init_distributed, launch


def _check_env(rank: int, world_size: int) -> None:
    assert os.environ["RANK"] == os.environ["LOCAL_RANK"] == str(rank)
    assert os.environ["WORLD_SIZE"] == str(world_size)
    assert dist.get_backend() == "gloo"
    assert dist.get_rank() == rank


def test_launch_sets_torchrun_env() -> None:
    launch(_check_env, 2, backend="gloo", timeout_s=120)


def test_init_distributed_without_env_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        init_distributed()


def _report_then_never_exit(rank: int, world_size: int) -> int:
    # A non-daemon thread keeps the process alive after it reported, as a teardown that hangs would.
    threading.Thread(target=time.sleep, args=(3600,)).start()
    return rank


def test_ranks_that_reported_but_do_not_exit_are_killed_after_a_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_EXIT_GRACE_S", 2.0)
    start = time.monotonic()
    assert launcher.spawn_ranks(_report_then_never_exit, 2, backend="gloo", timeout_s=120) == [0, 1]
    assert time.monotonic() - start < 60


def _preloaded(rank: int, world_size: int) -> tuple[int, bool]:
    import sys

    return dist.get_rank(), "transformers" in sys.modules  # this test module does not import it: the server did


def test_preload_forks_ranks_from_a_server_that_imported_the_modules() -> None:
    results = launcher.spawn_ranks(_preloaded, 2, backend="gloo", timeout_s=120, preload=("transformers",))
    assert results == [(0, True), (1, True)]
