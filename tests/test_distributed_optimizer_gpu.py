"""autotp.DistributedOptimizer on GPUs through NCCL (skipped without 2 GPUs): the CPU test's
5 AdamW steps in fp32 against the unmodified model on the same GPU, tp=1 x dp=2 and tp=2 x dp=1,
with the parameters' all-gather overlapped with the next forward (the default: the graph's
waits order the compute stream after NCCL's) and without."""

from __future__ import annotations

import pytest
import torch

from autotp.runtime.processes.launcher import spawn_ranks
from test_distributed_optimizer import _check, _train


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "tp", "bucket_bytes", "overlap"),
                         [("llama", 1, 4096, None), ("llama", 1, 4096, False), ("mixtral", 1, None, None), ("llama", 2, None, None)],
                         ids=["llama-dp2-small-buckets", "llama-dp2-no-overlap", "mixtral-dp2", "llama-tp2-dp1"])  # fmt: skip
def test_nccl_matches_adamw_on_the_unmodified_model(name: str, tp: int, bucket_bytes: int | None, overlap: bool | None) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    _check(spawn_ranks(_train, 2, name, tp, 1, 2, bucket_bytes, "cuda", overlap, backend="nccl", timeout_s=600))
