"""pm.clip_grad_norm_ (gloo, CPU, fp32): the global norm counts every parameter once across tp
shards and replicas, pipeline stages (a tied embedding) and dp, and clips like
torch.nn.utils.clip_grad_norm_ on the unmodified model; check_replicas finds a replicated
weight that drifted on one tp rank."""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_on_ranks
from small_models import build, vocab_size

MAX_NORM = 0.3


def _clip(rank: int, world: int, name: str, tp: int, pp: int) -> dict:
    import autotp

    model = build(name)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    ids, labels = (torch.randint(0, vocab_size(model), (4, 10), generator=gen) for _ in range(2))
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs={"input_ids": ids[:2], "labels": labels[:2]})
    microbatches = 2
    pm.train_step(input_ids=ids, labels=labels, num_microbatches=microbatches)
    norm = pm.clip_grad_norm_(MAX_NORM)
    parts = pm.plan.dp * microbatches
    torch.stack([reference(input_ids=i, labels=l).loss for i, l in zip(ids.chunk(parts), labels.chunk(parts))]).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    grads = pm.unshard_grads()
    for pname, p in reference.named_parameters():
        torch.testing.assert_close(grads[pname], p.grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"clipped grad of {pname}: {m}")
    diverged_before = pm.check_replicas()
    if tp > 1:
        norm_weight = next(n for n, p in pm.named_parameters() if p.dim() == 1 and pm.plan.layout_of(n) is None)
        if pm._coords.tp_rank == 1:
            with torch.no_grad():
                pm.get_parameter(norm_weight).add_(1e-4)
        return {"norm": norm.item(), "expected": expected.item(), "before": diverged_before, "after": pm.check_replicas(), "name": norm_weight}
    return {"norm": norm.item(), "expected": expected.item(), "before": diverged_before}


@pytest.mark.parametrize(("name", "tp", "pp"), [("llama", 2, 1), ("gpt2", 1, 2)], ids=["llama-tp2", "gpt2-tied-pp2"])
def test_clip_counts_each_parameter_once(name: str, tp: int, pp: int) -> None:
    results = run_on_ranks(_clip, 2, name, tp, pp)
    assert results[0]["norm"] > MAX_NORM  # clipping was active
    assert len({r["norm"] for r in results}) == 1
    assert all(r["before"] == [] for r in results)
    if tp > 1:
        assert all(any(r["name"] in d for d in r["after"]) for r in results)


def test_segments_replicated_on_some_ranks_count_once() -> None:
    """A fused q|k|v weight at tp=2 with one KV head: q is split, k and v are held by both ranks."""
    from autotp.ir.dim_sharding import DimSharding
    from autotp.ir.plan import ParallelPlan, ParamLayout
    from autotp.runtime.gradients.grad_norm import NormCounting

    layout = ParamLayout("qkv.weight", "column", 0, DimSharding(48, (32, 8, 8), (4, 1, 1)))
    plan = ParallelPlan(tp=2, params=(layout,))
    layouts = {"qkv.weight": layout, "norm.weight": None}
    first, second = (NormCounting(plan, r, 0, None, layouts, {}) for r in (0, 1))
    assert first.ranges("qkv.weight", 32) == [(0, 32)]
    assert second.ranges("qkv.weight", 32) == [(0, 16)]
    assert first.ranges("norm.weight", 64) == [(0, 64)] and second.ranges("norm.weight", 64) == []
    mask = second.mask("qkv.weight", (32, 4), torch.device("cpu"))
    assert isinstance(mask, torch.Tensor) and int(mask.sum()) == 16 * 4 and bool(mask[: 16 * 4].all())
    assert first.mask("qkv.weight", (32, 4), torch.device("cpu")) is True
    assert second.mask("norm.weight", (64,), torch.device("cpu")) is False
    # dp replicas of an all-reduced gradient count on dp rank 0 only; a tied weight on its first stage
    assert NormCounting(plan, 0, 0, 1, layouts, {}).ranges("norm.weight", 64) == []
    assert NormCounting(plan, 0, 1, None, layouts, {"norm.weight": [0, 1]}).ranges("norm.weight", 64) == []


def _drift_then_step(rank: int, world: int) -> list[str]:
    import logging

    import autotp

    warnings: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("autotp").addHandler(Record(logging.WARNING))
    model = build("llama")
    ids = torch.randint(0, vocab_size(model), (2, 8), generator=torch.Generator().manual_seed(3))
    pm = autotp.parallelize(model, tp=2, example_inputs={"input_ids": ids, "labels": ids})
    pm.check_replicas_every = 2
    if rank == 1:  # what torch.nn.utils.clip_grad_norm_(pm.parameters()) does to a replicated weight
        with torch.no_grad():
            pm.get_parameter("model.norm.weight").mul_(0.5)
    for _ in range(4):
        pm.train_step(input_ids=ids, labels=ids)
    return [w for w in warnings if "replicated over the tp ranks differ" in w]


def test_train_step_checks_the_replicas_every_n_steps() -> None:
    # Without pm.clip_grad_norm_ nothing compared the replicas: they drifted silently.
    for warnings in run_on_ranks(_drift_then_step, 2):
        assert len(warnings) == 2, warnings  # steps 1 and 3 of 4, with check_replicas_every = 2
        assert all("model.norm.weight" in w for w in warnings)
