"""Attention patterns that crashed or gave wrong numbers at tp=2 in the registry sweep
(issue 20), each on a small model of our own (``general_models``): per-head SDPA masks
(doge, granite_swa...), a matmul whose head dim is whole on one side, a per-head bias
looked up in a vocab-parallel table and shared by the layers (cpmant, T5), and attention
sinks concatenated to the scores (gpt_oss)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distributed import run_on_ranks
from general_models import VOCAB, build_general
from test_generality import _check_on_rank

PATTERNS = ["gated_mask", "slope_mask", "position_attention", "relative_bias", "sinks"]


def test_attention_patterns_match_at_tp2_and_hold_a_shard() -> None:
    fractions = run_on_ranks(_check_on_rank, 2, PATTERNS, 2, 1, timeout_s=500)[0]
    for name, fraction in fractions.items():
        assert fraction < 0.6, f"{name}: a rank holds {fraction:.0%} of the parameters"


def test_per_head_tensors_follow_the_heads() -> None:
    import autotp

    ids = torch.randint(0, VOCAB, (2, 16))
    for name in PATTERNS:
        plan = autotp.compile_rank(build_general(name), tp=2, example_inputs={"input_ids": ids, "labels": ids}).plan
        sharded = {p.name for p in plan.params}
        prefix = "lm.blocks" if name == "relative_bias" else "blocks"
        attention = {f"{prefix}.{i}.{w}.weight" for i in range(2) for w in "vo"}
        if name != "position_attention":
            attention |= {f"{prefix}.{i}.{w}.weight" for i in range(2) for w in "qk"}
        assert attention <= sharded, f"{name}: {sorted(attention - sharded)} stay replicated"


SWEEP_TP2_ARCHS = ["doge", "flint", "gpt_oss", "granite_swa", "mimo_v2_flash", "roformer", "granitemoe", "hy_v4"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", SWEEP_TP2_ARCHS)
def test_registry_architectures_match_at_tp2(arch: str) -> None:
    """The tiny HF configs of the registry sweep that crashed at tp=2 on these patterns."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sweep_registry import _check_on_rank as sweep_check

    result = run_on_ranks(sweep_check, 2, arch, "tp2", timeout_s=500)[0]
    assert result.equal, result.reason


@pytest.mark.parametrize(("arch", "share"), [("granitemoe", 0.85), ("hy_v4", 0.25)])
def test_concatenations_of_other_ranks_keep_the_sharding(arch: str, share: float) -> None:
    """cat of operands of another rank than the sharded ones (granitemoe's router, hy_v4's attention) once broke
    the slice invariant or the rule; the plan compiles and shards most of the model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import autotp
    from sweep_registry import _inputs, build

    model = build(arch)
    plan = autotp.compile_rank(model, tp=2, example_inputs=_inputs()).plan
    sharded = {p.name for p in plan.params}
    total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for n, p in model.named_parameters() if n in sharded) / total >= share


def test_a_statistic_choice_holds_for_its_place_in_every_layer() -> None:
    """LongCat-Flash's two latent attentions per layer: the walks first met the query latent's
    norm in one attention only. Flipping that place (no tp-reduced statistic, the latent kept
    whole) must flip it in all four, so every attention keeps its heads split."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from autotp.analysis.trace import trace
    from autotp.cost_model.tensor_parallel import plan_tensor_parallel
    from sweep_registry import _inputs, build

    plan = plan_tensor_parallel(trace(build("longcat_flash"), _inputs()), 4)
    split = {p.name for p in plan.params}
    for layer, attention in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        for proj in ("q_b_proj", "kv_b_proj", "o_proj"):
            assert f"model.layers.{layer}.self_attn.{attention}.{proj}.weight" in split, (layer, attention, proj)
