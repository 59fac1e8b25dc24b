"""Sync-free MoE dispatch on GPUs (skipped without CUDA): at ep=1 the whole bf16 model, MoE
layers included, is one CUDA-graph region (HF's experts call ``aten._grouped_mm``, which
reads the offsets on the device; in fp32 they call a fallback that reads them on the host),
and its captured training steps equal the eager ones; with two GPUs, expert parallelism over
NCCL matches the unmodified model."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch

from autotp.runtime.processes.launcher import spawn_ranks
from small_models import build, train_side_by_side, vocab_size

TOLERANCE = 1e-6


def _captured_vs_eager(rank: int, world: int, dispatch: str, dtype: torch.dtype) -> dict[str, Any]:
    import autotp
    from autotp.cost_model.cudagraphs import ALWAYS
    from autotp.report.cudagraphs import cudagraph_report

    torch.cuda.set_device(rank)
    model = build("mixtral").to("cuda", dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size(model), (2, 32), generator=gen).cuda()
    batch = {"input_ids": ids, "labels": ids}
    options: dict[str, Any] = {"moe_dispatch": dispatch, "moe_capacity_factor": 2.0} if dispatch == "sync_free" else {}
    eager = autotp.parallelize(copy.deepcopy(model), example_inputs=batch, **options)
    plan = replace(eager.plan, cudagraph_policy=ALWAYS)
    graphed = autotp.parallelize(model, example_inputs=batch, plan=plan, cuda_graphs=True)
    worst = train_side_by_side(eager, graphed, batch)
    report = cudagraph_report(graphed.graph_for(**batch), graphed.plan)
    return {**worst, "regions": len(report["cudagraph_regions"]), "blockers": [b["reason"] for b in report["blockers"]],
            "drops": graphed.moe_drop_counts()}  # fmt: skip


@pytest.mark.gpu
def test_sync_free_moe_captures_whole_and_matches_eager() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (r,) = spawn_ranks(_captured_vs_eager, 1, "sync_free", torch.bfloat16, backend="nccl", timeout_s=300)
    print(r)
    assert r["regions"] == 1 and r["blockers"] == [], r
    assert r["loss"] <= TOLERANCE and r["grad"] <= TOLERANCE, r
    assert all(dropped == 0 for dropped, _ in r["drops"].values()), r


@pytest.mark.gpu
def test_dropless_fp32_moe_is_blocked_where_it_syncs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (r,) = spawn_ranks(_captured_vs_eager, 1, "dropless", torch.float32, backend="nccl", timeout_s=300)
    assert any("grouped_mm_fallback" in b for b in r["blockers"]), r
    assert r["loss"] <= TOLERANCE and r["grad"] <= TOLERANCE, r


def _ep_on_gpus(rank: int, world: int) -> float:
    import autotp

    torch.cuda.set_device(rank)
    model = build("mixtral").cuda()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size(model), (4, 32), generator=gen).cuda()
    pm = autotp.parallelize(model, example_inputs={"input_ids": ids[:2], "labels": ids[:2]}, ep=world,
                            moe_dispatch="sync_free", moe_capacity_factor=2.0)  # fmt: skip
    loss = pm.train_step(input_ids=ids, labels=ids)
    expected = torch.stack([reference(input_ids=i, labels=i).loss for i in ids.chunk(world)]).mean()
    expected.backward()
    grads = pm.unshard_grads()
    worst = (loss - expected).abs().item()
    for name, p in reference.named_parameters():
        worst = max(worst, (grads[name] - p.grad).abs().max().item())
    return worst


@pytest.mark.gpu
def test_ep2_over_nccl_matches_unmodified_model() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    assert max(spawn_ranks(_ep_on_gpus, 2, backend="nccl", timeout_s=300)) <= 1e-5
