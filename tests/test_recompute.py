"""Activation recomputation: ``plan.recompute_layers``, ``passes/recompute_layers``, its cost model
and the planner's choice (``cost_model/recompute``), and a model's own checkpointing carried."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import plain_models_library as library
import small_models
from distributed import run_on_ranks

import autotp
from autotp import presets
from autotp.analysis.trace import trace
from autotp.compiler import model_costs, trace_for_planning
from autotp.cost_model import step_estimate
from autotp.cost_model.candidates import Config
from autotp.cost_model.compute import segment_time
from autotp.cost_model.hardware import H100
from autotp.cost_model.planner import Cluster, Training, plan
from autotp.cost_model.recompute import recomputed
from autotp.ir.errors import UserInputError
from autotp.ir.plan import RECOMPUTE_MEMORY, RECOMPUTE_MODEL, RECOMPUTE_USER, ParallelPlan
from autotp.ir.recompute import run_recomputed
from autotp.report.strict_rule import check_on_rank

TOLERANCE = 0.10  # the liveness model's saved bytes against the measured ones (tests/test_memory_model.py's)


def _saved_bytes(module: nn.Module, inputs: dict[str, Any]) -> int:
    """Bytes of the distinct storages autograd saves in ``module(**inputs)``, parameters and buffers left out."""
    held = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in held:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(**inputs)
    return sum(seen.values())


def _predicted_saved(model: nn.Module, inputs: dict[str, Any]) -> tuple[float, float]:
    """The liveness model's saved bytes of one microbatch at tp=1 (every traced layer), without and with recompute."""
    rc = model_costs(trace(model, inputs)).rank(1)
    at = np.array([1.0, next(iter(inputs.values())).shape[0]])
    ends = sum(float(seg.memory.saved @ at) for seg in (rc.preamble, rc.embedding, rc.head))
    return (ends + sum(float(seg.memory.saved @ at) for seg in rc.layers),
            ends + sum(float(recomputed(seg.memory).saved @ at) for seg in rc.layers))  # fmt: skip


def _batch(seq: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _recomputed_calls(pm: Any, inputs: dict[str, Any]) -> int:
    """How many checkpointed regions the rank program's chunk graphs call."""
    graph = pm.graph_for(**inputs)
    return sum(n.target is run_recomputed for m in graph.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


@pytest.mark.parametrize("recompute", ["full", pytest.param([1, 2], marks=pytest.mark.slow)])
def test_recompute_keeps_every_number_and_saves_less(recompute: Any) -> None:
    model = small_models.build("llama", layers=4 if recompute != "full" else 2)
    inputs = _batch(32)
    result = check_on_rank(copy.deepcopy(model), inputs, tp=1, recompute=recompute)
    assert result.passed, result.reason
    pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=inputs, recompute=recompute)
    layers = (0, 1) if recompute == "full" else (1, 2)
    assert pm.plan.recompute_layers == layers and pm.plan.recompute_reason == RECOMPUTE_USER
    assert _recomputed_calls(pm, inputs) == len(layers)
    kept = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=inputs, recompute="none")
    assert kept.plan.recompute_layers == () and _recomputed_calls(kept, inputs) == 0
    saved, saved_kept = _saved_bytes(pm, inputs), _saved_bytes(kept, inputs)
    assert saved < saved_kept
    if recompute == "full":
        predicted_kept, predicted = _predicted_saved(model, inputs)
        for measured, want in ((saved, predicted), (saved_kept, predicted_kept)):
            assert abs(want - measured) <= TOLERANCE * measured, (want, measured)


def _dropout_runs(tp: int, steps: int, **kwargs: Any) -> list[tuple[list[float], list[torch.Tensor]]]:
    """(losses, gradients) of ``steps`` steps of a GPT-2 with dropout on, without and with recompute."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.3,
                                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).train()  # fmt: skip
    inputs = _batch()
    runs = []
    for recompute in ("none", "full"):
        pm = autotp.parallelize(copy.deepcopy(model), tp=tp, example_inputs=inputs, recompute=recompute, seed=3, **kwargs)
        losses = []
        for _ in range(steps):
            loss = pm(**inputs)["loss"]
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, [p.grad.clone() for p in pm.parameters()]))
    return runs


def _assert_equal_runs(runs: list[tuple[list[float], list[torch.Tensor]]]) -> None:
    (losses, grads), (losses_rc, grads_rc) = runs
    assert losses == losses_rc
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_rc, strict=True))


@pytest.mark.parametrize("compile_backend", [False, pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_recomputed_dropout_draws_the_forward_mask(compile_backend: Any) -> None:
    """The tp RNG streams are replayed in the recomputation (eager) or the masks saved (compiled): two
    steps with recompute equal two without, bit for bit, so the streams also advance alike."""
    runs = _dropout_runs(1, 2, compile=compile_backend)
    _assert_equal_runs(runs)
    assert runs[0][0][0] != runs[0][0][1]  # dropout on: the two steps draw different masks


def test_model_checkpointing_is_carried_into_the_rank_graph() -> None:
    """A model that checkpoints its blocks keeps, under autotp, what it keeps alone: the saved bytes
    drop as the unmodified model's do against its twin without checkpointing."""
    model, inputs = library.build("checkpoint_nonreentrant"), library.example_inputs("checkpoint_nonreentrant")
    twin = library.build("sdpa_enable_gqa")  # the same blocks, not checkpointed
    pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=inputs)
    assert pm.plan.recompute_reason == RECOMPUTE_MODEL and pm.plan.recompute_layers == (0, 1)
    plain = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=inputs, recompute="none")
    assert _saved_bytes(pm, inputs) == _saved_bytes(model, inputs) < _saved_bytes(twin, inputs) == _saved_bytes(plain, inputs)


def test_recompute_arguments_and_plan_fields_are_checked() -> None:
    model, inputs = small_models.build("llama"), _batch()
    with pytest.raises(UserInputError, match=r"decoder layers 0\.\.1"):
        autotp.compile_rank(model, tp=1, example_inputs=inputs, recompute=[5])
    with pytest.raises(UserInputError, match="'none', 'full'"):
        autotp.compile_rank(model, tp=1, example_inputs=inputs, recompute="selective")
    with pytest.raises(UserInputError, match="distinct decoder-layer indices"):
        ParallelPlan(recompute_layers=(1, 1), recompute_reason=RECOMPUTE_USER)
    with pytest.raises(UserInputError, match="recompute_reason"):
        ParallelPlan(recompute_layers=(0,))
    plan = ParallelPlan(recompute_layers=(0, 3), recompute_reason=RECOMPUTE_MEMORY)
    assert ParallelPlan.from_json(plan.to_json()) == plan
    with pytest.raises(UserInputError, match="names layers \\[3\\]"):
        autotp.compile_rank(model, tp=1, example_inputs=inputs, plan=plan)
    with pytest.raises(UserInputError, match="cuda_graphs=True"):
        autotp.compile_rank(model, tp=1, example_inputs=inputs, recompute="full", cuda_graphs=True)


class _Accumulate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor, total: torch.Tensor) -> None:
        total.add_(self.linear(h))


class _WritesOutside(nn.Module):
    """A layer that accumulates into a tensor made before it: recomputing it would write twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layers, self.head = nn.Embedding(128, 32), nn.ModuleList([_Accumulate()]), nn.Linear(32, 128)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        total = torch.zeros_like(h)
        for layer in self.layers:
            layer(h, total)
        logits = self.head(total)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_layer_writing_outside_itself_is_refused() -> None:
    with pytest.raises(UserInputError, match="layer 0 writes in place"):
        autotp.compile_rank(_WritesOutside(), tp=1, example_inputs=_batch(), recompute="full")


def test_recomputed_layer_costs_a_second_forward_and_keeps_its_inputs() -> None:
    rc = model_costs(trace(small_models.build("llama"), _batch())).rank(1)
    seg = rc.layers[0]
    mem = recomputed(seg.memory)
    assert np.array_equal(mem.saved, seg.memory.inputs) and (mem.saved @ [1, 2]) < (seg.memory.saved @ [1, 2])
    assert len(mem.backward) == len(seg.memory.backward) + len(seg.memory.forward)
    plain, again = segment_time(seg, 2, H100, 1), segment_time(seg, 2, H100, 1, recompute=True)
    forward_compute = again.compute_s - plain.compute_s
    assert 0 < forward_compute < plain.compute_s  # the forward, less than forward + backward
    assert again.total_s > plain.total_s and again.host_s > plain.host_s


def test_planner_recomputes_where_nothing_fits_without() -> None:
    """Llama-3-8B at 8192 tokens on one GPU: bf16 states fit, activations do not without recomputing."""
    costs = trace_for_planning(presets.model_config("llama3-8b"), 8192)
    tight = Cluster(1, 1, replace(H100, memory_capacity_bytes=110e9))
    best = plan(costs, tight, Training(4, "bf16-pure", recompute=None), top=1)[0]
    assert best.plan.recompute_layers == tuple(range(32)) and best.plan.recompute_reason == RECOMPUTE_MEMORY
    assert "recomputed" in best.plan.notes[-1]
    with pytest.raises(ValueError, match="does not fit"):
        plan(costs, tight, Training(4, "bf16-pure", recompute=False), top=1)
    roomy = plan(costs, Cluster(1, 1, replace(H100, memory_capacity_bytes=400e9)), Training(4, "bf16-pure", recompute=None), top=1)[0]
    assert roomy.plan.recompute_layers == ()
    config = Config(1, 1, 1, 1, 1, 4)
    without, with_ = (step_estimate.estimate(costs, tight, Training(4, "bf16-pure", recompute=r), config) for r in (False, True))
    assert with_.mem_bytes_per_gpu < without.mem_bytes_per_gpu and with_.step_s > without.step_s


# ---- multi-rank: tp=2 and pp=2, a dense and an MoE model (slow) -----------------------------------


def _strict_worker(rank: int, world: int, name: str, tp: int, pp: int, compile_backend: Any = False) -> str:
    result = check_on_rank(small_models.build(name, layers=4), _batch(), tp=tp, pp=pp, recompute="full", compile=compile_backend)
    return "" if result.passed else result.reason


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mixtral"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_recompute_at_tp2_and_pp2_meets_the_strict_rule(name: str, tp: int, pp: int) -> None:
    assert run_on_ranks(_strict_worker, tp * pp, name, tp, pp) == [""] * (tp * pp)


@pytest.mark.slow
def test_recompute_compiled_at_tp2_meets_the_strict_rule() -> None:
    """Under compile the recomputed layer's tp collectives are AOT autograd's to run again."""
    assert run_on_ranks(_strict_worker, 2, "llama", 2, 1, "aot_eager") == ["", ""]


def _dropout_worker(rank: int, world: int) -> list[tuple[list[float], list[torch.Tensor]]]:
    return _dropout_runs(2, 1)


@pytest.mark.slow
def test_recomputed_tp_dropout_draws_the_forward_mask_at_tp2() -> None:
    for runs in run_on_ranks(_dropout_worker, 2):
        _assert_equal_runs(runs)
