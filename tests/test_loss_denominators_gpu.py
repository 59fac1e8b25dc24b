"""Split steps on GPUs (``autotp.ir.batch_denominators``): microbatches on one GPU, eager,
``compile=True`` and ``cuda_graphs=True``, and dp=2 over NCCL, with padded labels, against the
unmodified model on the whole batch (fp32; skipped without the GPUs)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from autotp.runtime.processes.launcher import spawn_ranks
from small_models import build, vocab_size

pytestmark = pytest.mark.gpu
RTOL, ATOL = 1e-4, 1e-5  # fp32 on the GPU, reductions in another order than the reference's


def _padded_batch(model: torch.nn.Module, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab_size(model), (8, 32), generator=gen)
    labels = ids.clone()
    labels[:4, 6:] = -100  # the first half of the batch: short sequences, padded
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def _split_step(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    import autotp

    torch.cuda.set_device(rank)
    model = build("llama").cuda()
    reference = copy.deepcopy(model)
    batch = _padded_batch(model, "cuda")
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()}, **options)
    assert pm.plan.dp == world
    loss = pm.train_step(**batch, num_microbatches=2)
    expected = reference(**batch).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    bad = [n for n, p in reference.named_parameters() if not torch.allclose(grads[n], p.grad, rtol=RTOL, atol=ATOL)]
    return {"loss": loss.item(), "expected": expected.item(), "bad": bad}


@pytest.mark.parametrize("options", [{}, {"compile": True}, {"cuda_graphs": True}], ids=["eager", "compile", "cuda_graphs"])
def test_microbatches_on_one_gpu_compute_the_whole_batch(options: dict[str, Any]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    result = _split_step(0, 1, options)
    assert not result["bad"], result


def test_dp_ranks_on_nccl_compute_the_whole_batch() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    for result in spawn_ranks(_split_step, 2, {}, backend="nccl", timeout_s=300):
        assert not result["bad"], result
