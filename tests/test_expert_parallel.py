"""Expert parallelism (issue 29): MoE layers found from the graph, rows dispatched to the ranks
holding their experts (dropless and sync-free), numerics equal to the unmodified model (fp32,
gloo ranks on CPU), each rank holding only its experts, bad input refused."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import transformers

import moe_models
from distributed import run_on_ranks
from general_models import MODELS as GENERAL_MODELS
from small_models import build as build_small

RTOL, ATOL = 1e-4, 1e-6
OURS = dict(GENERAL_MODELS, **moe_models.MODELS)


def deepseek_v3() -> torch.nn.Module:
    """A tiny DeepSeek-V3: sigmoid router with a (non-zero) correction bias, group-limited
    top-2 over 8 experts, a shared expert, a dense first layer."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.linspace(-0.3, 0.3, buffer.numel()))
    return model


def build(name: str) -> torch.nn.Module:
    if name == "deepseek_v3":
        return deepseek_v3()
    if name in OURS:
        torch.manual_seed(0)
        return OURS[name]().eval()
    return build_small(name)


def vocab(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return config.vocab_size if config is not None else 64


def _out(out: object, key: str) -> torch.Tensor:
    return out[key] if isinstance(out, dict) else getattr(out, key)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# ---- recognition (one process) -------------------------------------------------------------


def _layers(name: str):  # type: ignore[no-untyped-def]
    from autotp.analysis.moe import find_moe_layers
    from autotp.analysis.trace import trace

    model = build(name)
    ids = torch.randint(0, vocab(model), (2, 8))
    kwargs = {"input_ids": ids, "labels": ids, **({"use_cache": False} if hasattr(model, "config") else {})}
    return find_moe_layers(trace(model, kwargs, "cpu"))


RECOGNISED = {
    # name: (form, experts, router, a shared-expert parameter or "", layers)
    "mixtral": ("grouped", 4, "top-2 over softmax", "", 2),
    "qwen2_moe": ("grouped", 4, "top-2 over softmax", "model.layers.0.mlp.shared_expert.up_proj.weight", 2),
    "deepseek_v3": ("grouped", 8, "top-2 over sigmoid + bias model.layers.1.mlp.gate.e_score_correction_bias group-limited",
                    "model.layers.1.mlp.shared_experts.up_proj.weight", 1),
    "fused_index_add": ("grouped", 4, "top-2 over softmax", "", 2),
    "expert_loop": ("loop", 4, "top-1 over softmax", "", 2),
    "loop_sigmoid": ("loop", 4, "top-2 over sigmoid + bias blocks.0.correction", "blocks.0.shared.0.weight", 2),
}  # fmt: skip


@pytest.mark.parametrize("name", list(RECOGNISED))
def test_moe_layers_are_recognised_from_the_graph(name: str) -> None:
    form, experts, router, shared, count = RECOGNISED[name]
    layers = _layers(name)
    assert len(layers) == count
    first = layers[0]
    assert (first.form, first.num_experts, first.blocker) == (form, experts, "")
    assert first.router is not None and first.router.describe() == router
    assert not shared or shared in first.shared_params
    assert all(p not in first.shared_params for p in first.expert_params)
    if form == "loop":
        assert [e.index for e in first.experts] == list(range(experts))
        assert all(first.expert_of(p) == e.index for e in first.experts for p in e.params)


def test_expert_computation_that_mixes_rows_is_named() -> None:
    (first, _) = _layers("row_mixing")
    assert "'mean'" in first.blocker and "not row-wise" in first.blocker


def test_expert_choice_without_a_router_is_named() -> None:
    (first, _) = _layers("hash_routed")
    assert first.router is None and "not from a router's topk" in first.blocker


# ---- sync-free dispatch, one rank --------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "fused_index_add"])
def test_sync_free_at_ep1_matches_and_counts_drops(name: str) -> None:
    import autotp
    from autotp.ir import moe_ops

    model = build(name)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, vocab(model), (2, 16), generator=gen) for _ in range(2))
    # capacity factor E/top_k: an expert can take every token, nothing is dropped
    pm = autotp.parallelize(model, example_inputs={"input_ids": ids, "labels": labels}, moe_dispatch="sync_free",
                            moe_capacity_factor=2.0)  # fmt: skip
    pm.moe_drop_counts(reset=True)
    out, expected = pm(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    _close(_out(out, "loss"), _out(expected, "loss"), "loss")
    _close(_out(out, "logits"), _out(expected, "logits"), "logits")
    _out(out, "loss").backward()
    _out(expected, "loss").backward()
    grads = pm.unshard_grads()
    for pname, p in reference.named_parameters():
        if p.grad is not None:
            _close(grads[pname], p.grad, f"grad of {pname}")
    counts = pm.moe_drop_counts(reset=True)
    assert counts and all(dropped == 0 and routed == 2 * 32 for dropped, routed in counts.values()), counts
    graph = pm.graph_for(input_ids=ids, labels=labels).graph
    targets = [n.target for n in graph.nodes]
    assert targets.count(moe_ops.MOE_TO_EXPERTS) == targets.count(moe_ops.MOE_FROM_EXPERTS) == 2
    local_offsets = {u for n in graph.nodes if n.target is moe_ops.MOE_ROUTE for u in n.users if u.args[1] == 1}
    grouped = [n for n in graph.nodes if "grouped_mm" in str(n.target)]
    assert grouped and all(set(n.all_input_nodes) & local_offsets for n in grouped), \
        "sync-free experts stay grouped matmuls over the received rows, at the received counts' offsets"
    # a capacity below the load drops rows, counted per layer; the loss moves
    small = autotp.parallelize(copy.deepcopy(reference), example_inputs={"input_ids": ids, "labels": labels},
                               moe_dispatch="sync_free", moe_capacity_factor=0.5)  # fmt: skip
    dropped_loss = _out(small(input_ids=ids, labels=labels), "loss")
    counts = small.moe_drop_counts(reset=True)
    assert all(dropped >= 32 for dropped, _ in counts.values()), counts  # capacity 8 per expert: at most 32 of 64 rows kept
    assert not torch.allclose(dropped_loss, _out(expected, "loss"))


def test_sync_free_layer_has_no_capture_blocker_dropless_has() -> None:
    import autotp
    from autotp.ir import meta_keys

    # bf16: HF's experts call aten._grouped_mm (device offsets); in fp32 they call its
    # fallback, which reads the offsets on the host and is a blocker of its own (not the dispatch's)
    model = build("mixtral").to(torch.bfloat16)
    blocked = {}
    for mode in ("sync_free", "dropless"):
        compiled = autotp.compile_rank(model, tp=1, ep=2 if mode == "dropless" else 1, moe_dispatch=mode,
                                       cuda_graphs=True, device="meta")  # fmt: skip
        blocked[mode] = [n.meta[meta_keys.CUDAGRAPH_BLOCKER].reason for n in compiled.graph.graph.nodes
                         if n.meta.get(meta_keys.CUDAGRAPH_BLOCKER)]  # fmt: skip
        if mode == "sync_free":
            assert compiled.plan.cudagraph_regions == (0,), "the whole model, MoE layers included, is one region"
    assert blocked["sync_free"] == []
    assert any("dropless expert dispatch reads the rows per expert on the host" in r for r in blocked["dropless"])


def test_explain_reports_padded_all_to_alls_and_unpadded_compute() -> None:
    import autotp
    from autotp.report.moe import moe_dispatch_report, moe_dispatch_table

    model = build("mixtral")
    ids = torch.randint(0, vocab(model), (2, 8))
    compiled = autotp.compile_rank(model, tp=1, ep=2, moe_dispatch="sync_free", moe_capacity_factor=2.0, device="meta",
                                   example_inputs={"input_ids": ids})  # fmt: skip
    entries = moe_dispatch_report(compiled.graph, compiled.plan)
    assert len(entries) == len(compiled.plan.moe_layers) > 0
    for e in entries:
        rows = 2 * 8 * e["top_k"]
        assert e["rows_sent_per_rank"] == e["rows_computed_per_rank"] == rows, e  # the grouped matmuls skip the padding
        assert e["capacity"] == 2 * rows // e["experts"] and e["host_syncs_per_step"] == 0, e
        hidden = model.config.hidden_size
        assert e["bytes_to_experts"] >= e["experts"] * e["capacity"] * hidden * 4, e  # padded static buffers move
    assert "capacity" in moe_dispatch_table(entries)


# ---- bad input --------------------------------------------------------------------------------


def _error(name: str, **kwargs: object) -> str:
    import autotp

    model = build(name)
    ids = torch.randint(0, vocab(model), (2, 8))
    with pytest.raises(ValueError) as info:
        autotp.compile_rank(model, tp=1, device="meta", example_inputs={"input_ids": ids}, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


def test_bad_expert_parallel_input_says_how_to_fix() -> None:
    assert "ep=3 does not divide the 4 experts of model.layers.0.mlp" in _error("mixtral", ep=3)
    assert "promises every row reaches its expert" in _error("mixtral", ep=2, moe_capacity_factor=1.0)
    assert "moe_dispatch must be one of dropless, sync_free" in _error("mixtral", moe_dispatch="capacity")
    assert "loops over expert modules" in _error("loop_sigmoid", moe_dispatch="sync_free")
    assert "no MoE layer autotp recognises" in _error("llama", ep=2)


def test_degrees_that_do_not_fold_are_refused() -> None:
    import autotp
    from autotp.cost_model.expert_parallel import check_degrees

    model = build("mixtral")
    with pytest.raises(ValueError, match="ep=2 is larger than the world size 1: .*start 2 processes"):
        autotp.parallelize(model, ep=2, example_inputs={"input_ids": torch.randint(0, vocab(model), (2, 8))})

    with pytest.raises(ValueError, match="ep=4 does not divide tp\\*dp = 1\\*2 = 2"):
        check_degrees(4, None, tp=1, dp=2)
    with pytest.raises(ValueError, match="pass etp=1"):
        check_degrees(2, 2, tp=2, dp=1)


def test_unrecognised_router_keeps_tensor_parallel_experts_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    import autotp

    with caplog.at_level(logging.WARNING):
        compiled = autotp.compile_rank(build("hash_routed"), tp=2, ep=2, device="meta",
                                       example_inputs={"input_ids": torch.randint(0, 64, (2, 8))})  # fmt: skip
    assert compiled.plan.moe_layers == ()
    assert "blocks.0 keeps tensor-parallel experts" in caplog.text and "not from a router's topk" in caplog.text
    assert "the expert choice of node 'grouped_mm'" in caplog.text, "the warning names the node"
    assert compiled.plan.layout_of("blocks.0.w_in") is not None  # still sharded over tp


# ---- cost model -------------------------------------------------------------------------------


def test_cost_model_charges_dispatch_imbalance_and_capacity() -> None:
    from autotp.cost_model.hardware import get_profile
    from autotp.cost_model.moe_costs import DROPLESS_SYNC_S, MoeFacts, all_to_all_group_s, expert_parallel_options, imbalance, option
    from autotp.ir.training_step import TrainingStep

    hw = get_profile("h100", calibrated=False)
    facts = MoeFacts(layers=32, num_experts=8, top_k=2, hidden=4096, flops_per_row=2 * 3 * 4096 * 14336,
                     expert_params=8 * 3 * 4096 * 14336, grouped=True)  # fmt: skip
    # inside a node only the NVLink term counts; across nodes the slower link dominates
    inside, across = all_to_all_group_s(2**28, 8, 8, hw), all_to_all_group_s(2**28, 16, 8, hw)
    assert 0 < inside < across
    assert all_to_all_group_s(2**28, 1, 8, hw) == 0.0
    # imbalance of uniform routing shrinks with the rows each rank sends, grows with ep
    assert imbalance(1024, 8) > imbalance(65536, 8) > 1.0 and imbalance(65536, 8) > imbalance(65536, 2)
    plan = dict(tp=1, pp=1, dp=8, microbatch=4, microbatches=2, seq=4096, per_node=8, hw=hw,
                step=TrainingStep("bf16-fp32-grads", True))  # fmt: skip
    dropless = option(facts, ep=8, **plan)
    synced = option(facts, ep=8, dispatch="sync_free", capacity_factor=1.25, **plan)
    assert dropless.saved_bytes > 0 and dropless.saved_bytes == synced.saved_bytes  # 7/8 of the experts' bytes
    # sync-free multiplies only the rows that arrive: the same imbalance, capped by the capacity
    assert synced.imbalance == dropless.imbalance < 1.05
    assert option(facts, ep=8, dispatch="sync_free", capacity_factor=1.01, **plan).imbalance == 1.01
    syncs = 32 * 2 * 4 * DROPLESS_SYNC_S  # dropless: 4 host reads per layer and microbatch
    assert synced.dispatch_s > dropless.dispatch_s - syncs  # sync-free moves 25% more bytes (the padding), reads nothing
    assert {(o.ep, o.dispatch) for o in expert_parallel_options(facts, **plan)} == {
        (ep, mode) for ep in (2, 4, 8) for mode in ("dropless", "sync_free")}


def test_planned_expert_parallelism_is_a_plan_field() -> None:
    from autotp import presets
    from autotp.compiler import trace_for_planning
    from autotp.cost_model.candidates import Cluster
    from autotp.cost_model.hardware import H100
    from autotp.cost_model.planner import plan
    from autotp.cost_model.step_estimate import Training
    from autotp.ir.plan import ParallelPlan

    costs = trace_for_planning(presets.model_config("mixtral-8x7b"), 4096)
    best = plan(costs, Cluster(8, 8, H100), Training(8), top=1)[0].plan
    assert best.ep > 1 and best.moe_estimate is not None, best
    assert (best.moe_estimate.ep, best.moe_estimate.dispatch) == (best.ep, best.moe_dispatch)
    assert not any("expert parallelism" in note for note in best.notes), "the choice is a field, not free text"
    assert ParallelPlan.from_json(best.to_json()).moe_estimate == best.moe_estimate


# ---- multi-rank numerics -----------------------------------------------------------------------


def _train_on_rank(rank: int, world: int, name: str, kwargs: dict) -> dict:
    import autotp

    microbatches = kwargs.pop("microbatches", 1)
    model = build(name)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, vocab(model), (4 * microbatches, 16), generator=gen) for _ in range(2))
    pm = autotp.parallelize(model, example_inputs={"input_ids": ids[:2], "labels": labels[:2]}, **kwargs)
    pm.moe_drop_counts(reset=True)
    loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=microbatches)
    parts = pm.plan.dp * microbatches
    expected = torch.stack([_out(reference(input_ids=i, labels=l), "loss") for i, l in zip(ids.chunk(parts), labels.chunk(parts))]).mean()
    expected.backward()
    _close(loss, expected, "loss")
    grads = pm.unshard_grads()
    for pname, p in reference.named_parameters():
        if p.grad is not None:
            _close(grads[pname], p.grad, f"grad of {pname}")
    experts = {p for layer in pm.plan.moe_layers for p in layer.params}
    full = sum(p.numel() for n, p in reference.named_parameters() if n in experts)
    held = sum(p.numel() for n, p in pm.named_parameters() if n in experts)
    return {"expert_share": held / max(full, 1), "layers": len(pm.plan.moe_layers), "drops": pm.moe_drop_counts()}


def _check_spread(results: list[dict], share: float) -> None:
    for r in results:
        assert r["layers"] > 0
        assert r["expert_share"] == pytest.approx(share), r


FAST = [("mixtral", {"ep": 2}), ("loop_sigmoid", {"ep": 2}),
        ("fused_index_add", {"ep": 2, "moe_dispatch": "sync_free", "moe_capacity_factor": 2.0})]  # fmt: skip


@pytest.mark.parametrize(("name", "kwargs"), FAST, ids=[f"{n}-{k.get('moe_dispatch', 'dropless')}" for n, k in FAST])
def test_ep2_matches_unmodified_model(name: str, kwargs: dict) -> None:
    results = run_on_ranks(_train_on_rank, 2, name, kwargs, timeout_s=600)
    _check_spread(results, 0.5)
    if kwargs.get("moe_dispatch") == "sync_free":
        assert all(d == 0 and routed > 0 for r in results for d, routed in r["drops"].values())


SLOW = [
    ("mixtral", {"ep": 2, "tp": 2}, 4, 0.5),
    ("mixtral", {"ep": 2, "pp": 2, "microbatches": 2}, 4, 0.25),
    ("loop_sigmoid", {"ep": 2, "tp": 2}, 4, 0.5),
    ("deepseek_v3", {"ep": 2}, 2, 0.5),
    ("qwen2_moe", {"ep": 2, "moe_dispatch": "sync_free", "moe_capacity_factor": 2.0}, 2, 0.5),
    ("qwen2_moe", {"ep": 2, "tp": 2, "moe_dispatch": "sync_free", "moe_capacity_factor": 2.0}, 4, 0.5),
    ("expert_loop", {"ep": 2}, 2, 0.5),
    ("mixtral", {"ep": 4}, 4, 0.25),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "kwargs", "world", "share"), SLOW, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for n, kw, _, _ in SLOW])
def test_expert_parallel_sweep_matches_unmodified_model(name: str, kwargs: dict, world: int, share: float) -> None:
    results = run_on_ranks(_train_on_rank, world, name, dict(kwargs), timeout_s=900)
    _check_spread(results, share)
    if kwargs.get("moe_dispatch") == "sync_free":  # capacity factor E/top_k: no row dropped, at any tp
        assert all(d == 0 and routed > 0 for r in results for d, routed in r["drops"].values()), results


def _drops_on_rank(rank: int, world: int) -> dict:
    import autotp

    model = build("mixtral")
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    pm = autotp.parallelize(model, example_inputs={"input_ids": ids[:2], "labels": ids[:2]}, ep=2,
                            moe_dispatch="sync_free", moe_capacity_factor=0.5)  # fmt: skip
    pm.moe_drop_counts(reset=True)
    loss = pm.train_step(input_ids=ids, labels=ids)
    return {"loss": loss.item(), "drops": pm.moe_drop_counts()}


@pytest.mark.slow
def test_sync_free_drops_are_counted_on_every_rank() -> None:
    results = run_on_ranks(_drops_on_rank, 2, timeout_s=600)
    for r in results:
        assert len(r["drops"]) == 2
        assert all(0 < dropped < routed for dropped, routed in r["drops"].values()), r
    assert results[0]["loss"] == results[1]["loss"]


ADAMW = {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-6}


def _adamw_on_rank(rank: int, world: int, name: str, tp: int) -> dict:
    import autotp

    model = build(name)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    batches = [tuple(torch.randint(0, vocab(model), (8, 12), generator=gen) for _ in range(2)) for _ in range(3)]
    pm = autotp.parallelize(model, tp=tp, example_inputs={"input_ids": batches[0][0][:2], "labels": batches[0][1][:2]}, ep=2)
    dp = pm.plan.dp
    opt = autotp.DistributedOptimizer(pm, torch.optim.AdamW, **ADAMW)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for ids, labels in batches:
        loss = pm.train_step(input_ids=ids, labels=labels)
        norm = opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        expected = torch.stack([_out(reference(input_ids=i, labels=l), "loss") for i, l in zip(ids.chunk(dp), labels.chunk(dp))]).mean()
        expected.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    state = pm.unshard_state_dict()
    for pname, p in reference.named_parameters():
        torch.testing.assert_close(state[pname], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{pname}: {m}")
    experts = {p for layer in pm.plan.moe_layers for p in layer.params}
    mine = sum(p.numel() for n, p in pm.named_parameters() if n in experts)
    return {"expert_share": mine / sum(p.numel() for n, p in reference.named_parameters() if n in experts)}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "tp", "world"), [("mixtral", 1, 2), ("loop_sigmoid", 1, 2), ("mixtral", 2, 4)])
def test_distributed_optimizer_with_ep_matches_adamw(name: str, tp: int, world: int) -> None:
    for r in run_on_ranks(_adamw_on_rank, world, name, tp, timeout_s=900):
        assert r["expert_share"] == pytest.approx(0.5)


def _reshard_on_rank(rank: int, world: int, name: str, saved: dict, loaded: dict, path: str) -> float:
    import autotp

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(5))
    pm = autotp.parallelize(build(name), example_inputs={"input_ids": ids[:2], "labels": ids[:2]}, **saved)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.train_step(input_ids=ids, labels=ids)
    opt.step()
    pm.save_checkpoint(path, optimizer=opt, step=1)
    before = pm.unshard_state_dict()  # after a step: not the fresh model's initial weights
    fresh = autotp.parallelize(build(name), example_inputs={"input_ids": ids[:2], "labels": ids[:2]}, **loaded)
    assert fresh.load_checkpoint(path, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2)) == 1
    after = fresh.unshard_state_dict()
    return max((before[k] - after[k]).abs().max().item() for k in before)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "saved", "loaded"), [("fused_index_add", {"ep": 2}, {"tp": 2}), ("loop_sigmoid", {"tp": 2}, {"ep": 2})])
def test_checkpoints_reshard_across_ep(name: str, saved: dict, loaded: dict, tmp_path: Path) -> None:
    assert max(run_on_ranks(_reshard_on_rank, 2, name, saved, loaded, str(tmp_path / "ckpt"), timeout_s=600)) == 0.0
