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


def _logit_mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.logits.float().square().mean()


def _last_token_similarity(out: torch.Tensor) -> torch.Tensor:
    """Each sequence's last logits against every other sequence's: a loss over the batch's rows together."""
    last = out.logits[:, -1].float()
    return (last @ last.t()).logsumexp(-1).mean()



def _loss_fn_on_gpu(rank: int, world: int, mixing: bool) -> dict:
    import autotp

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build("llama", layers=4).cuda()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, vocab_size(model), (8, 64), generator=torch.Generator().manual_seed(3)).cuda()
    pm = autotp.parallelize(model, pp=2, example_inputs={"input_ids": ids[:2]})
    if mixing:
        try:
            pm.train_step(input_ids=ids, loss_fn=_last_token_similarity, num_microbatches=4)
            return {"refusal": ""}
        except Exception as e:  # noqa: BLE001 - the refusal, on the last stage or as its peer's failure
            return {"refusal": f"{type(e).__name__}: {e}", "untouched": all(p.grad is None for p in pm.parameters())}
    loss = pm.train_step(input_ids=ids, loss_fn=_logit_mean_square, num_microbatches=4)
    expected = torch.stack([_logit_mean_square(reference(input_ids=i)) for i in ids.chunk(4)]).mean()
    expected.backward()
    grads = pm.unshard_grads()
    return {"loss": _rel_err(loss, expected), "grad": max(_rel_err(grads[n], p.grad) for n, p in reference.named_parameters())}


@pytest.mark.gpu
def test_nccl_pipeline_refuses_a_loss_fn_mixing_rows_on_every_rank_and_trains_a_mean() -> None:
    """``analysis.loss_fn_rows`` on CUDA outputs: the last stage refuses before any backward, its peer hears why;
    a mean over the rows trains as the unmodified model's microbatches do."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    for r in spawn_ranks(_loss_fn_on_gpu, 2, True, backend="nccl", timeout_s=600):
        print(r)
        assert "loss_fn" in r["refusal"] and "mixes the rows of its batch" in r["refusal"] and r["untouched"], r
    for r in spawn_ranks(_loss_fn_on_gpu, 2, False, backend="nccl", timeout_s=600):
        print(r)
        assert r["loss"] < REL_TOL and r["grad"] < REL_TOL, r
