"""The plain-PyTorch model suite under the strict rule (``autotp.report.strict_rule``).

Every ``tests/plain_models_*.py`` module is picked up. A module provides ``build(name)``
(an ``nn.Module`` in eval mode with fixed weights) and its names (``NAMES``, or the keys of
``MODELS``); optionally ``example_inputs(name)`` (default: ``input_ids`` and ``labels`` of
shape [2, 16] below the module's ``VOCAB``), ``loss_fn(name)`` (None: the outputs hold
``loss``), ``MOE`` (names also run with sequence parallelism) and ``MICROBATCHES`` (name ->
microbatches of its pipeline step, default 2). A name defined by two
modules runs once, from the first file in sorted order.

Each configuration runs every model on one set of gloo ranks (fp32, CPU): tp=2, tp=4, pp=2,
and sequence parallelism at tp=2 for the MoE models. The full sweeps are ``slow``; a few
models at tp=2 run by default. ``python tests/test_plain_suite.py`` prints the table.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed import run_on_ranks

HERE = Path(__file__).parent
CONFIGS = {  # name: (tp, pp, sequence_parallel, MoE models only)
    "tp2": (2, 1, False, False),
    "tp4": (4, 1, False, False),
    "pp2": (1, 2, False, False),
    "sp_tp2": (2, 1, True, True),
}
FAST = ("shared_rope", "ste_activation", "fp32_qk_norm", "vit_loss_fn", "torch_nn_transformer", "as_strided_windows", "checkpoint_by_hand",
        "reversible_blocks")
KNOWN_GAPS: dict[tuple[str, str], str] = {  # (config, model): why it fails today; the sweep fails if it passes or fails otherwise
    # one layer module run LAYERS + 1 times: every stage would hold it whole, so pp saves nothing; refused naming it
    ("pp2", "albert_shared_layer"): "module 'shared' runs 3 times with the same parameters",
    # every layer's weights are slices of one parameter: no module boundary to cut at
    ("pp2", "stacked_layer_weights"): "cuts between the 1 modules the forward runs one after another",
    # unit scaling's gradient scales come from x.numel(), the batch's size: a piece's would not be the whole batch's
    ("pp2", "unit_scaled_mlp"): "computes a number from its batch's size",
    # nn.Embedding(max_norm=...) renormalizes the rows it reads in place: a parameter written by the forward
    **{(c, "embedding_max_norm"): "writes its parameter embed.weight in place" for c in ("tp2", "tp4", "pp2")},
    # PyTorch's meta kernel of grouped_mm takes bf16 only (its CPU kernel fp32 too); the bf16 model splits
    **{(c, "grouped_gemm_moe"): "Expected inputs of BF16 type" for c in ("tp2", "tp4", "pp2", "sp_tp2")},
    # aten.lstm unrolls over the sequence (not decomposed at trace); its weights stay whole, named in the plan
    **{(c, "lstm_layer_mixer"): "lstm.weight_ih_l0" for c in ("tp2", "tp4")},
}
# fp32 rounding only, which depends on the platform's kernels: a mismatch is allowed, nothing else.
# The all-reduced sums of row-parallel projections round otherwise, and Gemma's post-norms and soft
# caps magnify it past 1e-6 on a few logits (2.7e-6 on torch 2.13 CPU); equal in float64
# (test_propagation_research.py::test_gemma_reference_is_the_unmodified_model_in_float64).
# The verbalizer's class logits are dot products that cancel (a logit of 6e-3 from terms near 1):
# 2.1e-6 apart at tp=4, equal in float64 (test_propagation_ports.py).
FP32_ROUNDING = {("tp2", "gemma_reference"), ("tp4", "gemma_reference"), ("tp4", "verbalizer_head")}


def suite() -> dict[str, str]:
    """Every model name -> the module that builds it."""
    found: dict[str, str] = {}
    for path in sorted(HERE.glob("plain_models_*.py")):
        module = importlib.import_module(path.stem)
        names = getattr(module, "NAMES", None) or list(getattr(module, "MODELS", {}))
        for name in names:
            found.setdefault(name, path.stem)
    return found


def _inputs(module: Any, name: str) -> dict[str, torch.Tensor]:
    if hasattr(module, "example_inputs"):
        return module.example_inputs(name)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, module.VOCAB, (2, 16), generator=gen) for _ in range(2))
    return {"input_ids": ids, "labels": labels}


def _check_on_rank(rank: int, world: int, models: list[tuple[str, str]], tp: int, pp: int, sp: bool) -> dict[str, Any]:
    from autotp.report.strict_rule import check_on_rank

    results = {}
    for module_name, name in models:
        module = importlib.import_module(module_name)
        loss_fn = module.loss_fn(name) if hasattr(module, "loss_fn") else None
        microbatches = getattr(module, "MICROBATCHES", {}).get(name, 2)
        results[name] = check_on_rank(
            module.build(name), _inputs(module, name), tp=tp, pp=pp, sequence_parallel=sp, loss_fn=loss_fn, microbatches=microbatches
        )
    return results


def run_config(config: str, names: list[str] | None = None) -> dict[str, Any]:
    """Every model of the suite (or ``names``) at ``config``: name -> combined ``StrictResult``."""
    from autotp.report.strict_rule import combine

    tp, pp, sp, moe_only = CONFIGS[config]
    models = [(m, n) for n, m in suite().items() if names is None or n in names]
    if moe_only:
        models = [(m, n) for m, n in models if n in getattr(importlib.import_module(m), "MOE", ())]
    results = {}
    for module_name in dict.fromkeys(m for m, _ in models):  # fresh ranks per module: one set for all grew slower model by model
        chunk = [(m, n) for m, n in models if m == module_name]
        per_rank = run_on_ranks(_check_on_rank, tp * pp, chunk, tp, pp, sp, timeout_s=3000)
        results.update({n: combine([r[n] for r in per_rank]) for _, n in chunk})
    return results


def _failures(results: dict[str, Any]) -> str:
    return "\n".join(f"{n}: {r.reason}" for n, r in results.items() if not r.passed)


def test_suite_modules_follow_the_protocol() -> None:
    found = suite()
    assert {"shared_rope", "vit_loss_fn", "moe_einsum_dispatch"} <= set(found)
    for name, module_name in found.items():
        module = importlib.import_module(module_name)
        inputs = _inputs(module, name)
        assert all(isinstance(v, torch.Tensor) for v in torch.utils._pytree.tree_leaves(inputs)), name


def test_fast_subset_at_tp2() -> None:
    results = run_config("tp2", list(FAST))
    assert set(results) == set(FAST)
    assert not _failures(results), _failures(results)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a configuration runs every model: over 10 minutes on 2 cores
@pytest.mark.parametrize("config", list(CONFIGS))
def test_suite_under_the_strict_rule(config: str) -> None:
    results = run_config(config)
    assert results
    gaps = {n: why for (c, n), why in KNOWN_GAPS.items() if c == config}
    rounding = {n for c, n in FP32_ROUNDING if c == config and not results[n].error and results[n].share <= results[n].limit and not results[n].unexplained}
    assert not _failures({n: r for n, r in results.items() if n not in gaps and n not in rounding}), _failures(results)
    for name, why in gaps.items():
        assert not results[name].passed and why in results[name].reason, f"{name} at {config}: {results[name].reason or 'passes'}"


def table(all_results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per model, one column per configuration (share of the parameters a rank holds, or why it fails)."""
    configs = list(all_results)
    names = list(dict.fromkeys(n for r in all_results.values() for n in r))
    lines = ["| model | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
    for name in names:
        cells = []
        for c in configs:
            r = all_results[c].get(name)
            cells.append("-" if r is None else (f"yes ({r.share:.0%})" if r.passed else f"**no**: {r.reason[:160]}".replace("|", "/")))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    passed = {c: sum(r.passed for r in all_results[c].values()) for c in configs}
    lines.append("| passed | " + " | ".join(f"{passed[c]}/{len(all_results[c])}" for c in configs) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    chosen = sys.argv[1:] or list(CONFIGS)
    print(table({c: run_config(c) for c in chosen}))
