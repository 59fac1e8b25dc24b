"""Communication overlap on GPUs through NCCL (skipped without 2 GPUs): the symmetric-memory
fused ops and the P2P ring against the plain collective and GEMM, and a sequence-parallel
Llama and Mixtral with overlap against the unmodified model on the same GPU (fp32), forward and backward."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from autotp.runtime.processes.launcher import spawn_ranks
from small_models import build, vocab_size
from test_tp_overlap import ops_on_rank


def _need_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["symm_mem", "ring"])
def test_ops_match_the_plain_collective_and_gemm_on_nccl(impl: str) -> None:
    _need_gpus()
    spawn_ranks(_ops_on_device, 2, impl, backend="nccl", timeout_s=600)


def _ops_on_device(rank: int, world: int, impl: str) -> None:
    torch.cuda.set_device(rank)
    ops_on_rank(rank, world, f"cuda:{rank}", impl)


def _model_on_device(rank: int, world: int, compile: bool, name: str = "llama") -> float:
    import autotp

    torch.cuda.set_device(rank)
    model = build(name).cuda()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, vocab_size(model), (4, 32), generator=torch.Generator().manual_seed(3)).cuda()
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": ids, "labels": ids}, sequence_parallel=True,
                            tp_overlap=True, compile=compile)  # fmt: skip
    assert pm.plan.tp_overlap_impl == "symm_mem"
    out, expected = pm(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    out.loss.backward()
    expected.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-4, atol=1e-5)
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")
    return out.loss.item()


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_sequence_parallel_llama_with_overlap_matches_on_nccl(compile: bool) -> None:
    _need_gpus()
    losses = spawn_ranks(_model_on_device, 2, compile, backend="nccl", timeout_s=900)
    assert losses[0] == losses[1]


@pytest.mark.gpu
def test_sequence_parallel_moe_with_its_router_loss_matches_on_nccl() -> None:
    """Mixtral with its load-balancing loss: the MoE block's backward reduce-scatter (no all-reduce)
    sums the router's partial gradients and its tp-divided whole ones on NCCL too."""
    _need_gpus()
    losses = spawn_ranks(_model_on_device, 2, False, "mixtral_aux", backend="nccl", timeout_s=900)
    assert losses[0] == losses[1]
