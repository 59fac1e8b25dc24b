"""Pipelines on 2 GPUs through NCCL (batched asynchronous P2P, reused receive buffers):
every schedule, eager and compiled, matches the unmodified model in fp32 (skipped without 2 GPUs)."""

from __future__ import annotations

import copy

import pytest
import torch

from autotp.runtime.processes.launcher import spawn_ranks
from small_models import build, vocab_size

REL_TOL = 1e-4  # fp32 without TF32: only the order of sums differs


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / (expected.float().norm() + 1e-12)).item()


def _pipeline_on_gpu(rank: int, world: int, schedule: str, vpp: int, compile: bool) -> dict:
    import autotp

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build("llama", layers=4).cuda()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab_size(model), (8, 64), generator=gen).cuda()
    labels = torch.randint(0, vocab_size(model), (8, 64), generator=gen).cuda()
    pm = autotp.parallelize(model, pp=2, vpp=vpp, compile=compile, example_inputs={"input_ids": ids[:2], "labels": labels[:2]})
    for _ in range(3):  # later steps run on the first step's receive buffers
        pm.zero_grad(set_to_none=True)
        loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=4, schedule=schedule)
    expected = torch.stack([reference(input_ids=i, labels=l).loss for i, l in zip(ids.chunk(4), labels.chunk(4))]).mean()
    expected.backward()
    grads = pm.unshard_grads()
    worst = max((_rel_err(grads[n], p.grad), n) for n, p in reference.named_parameters())
    return {"loss": _rel_err(loss, expected), "grad": worst[0], "param": worst[1], "backend": torch.distributed.get_backend()}


CASES = [("gpipe", 1, False), ("1f1b", 1, False), ("interleaved", 2, False), ("zbh1", 1, False),
         ("1f1b", 1, True), ("interleaved", 2, True)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("schedule", "vpp", "compile"), CASES, ids=[f"{s}-{'compiled' if c else 'eager'}" for s, _, c in CASES])
def test_nccl_pipeline_matches_unmodified_model(schedule: str, vpp: int, compile: bool) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    for r in spawn_ranks(_pipeline_on_gpu, 2, schedule, vpp, compile, backend="nccl", timeout_s=600):
        print(schedule, vpp, compile, r)
        assert r["backend"] == "nccl"
        assert r["loss"] < REL_TOL and r["grad"] < REL_TOL, r
