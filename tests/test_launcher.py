import os

import pytest
import torch.distributed as dist

from autotp.launcher import init_distributed, launch


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
