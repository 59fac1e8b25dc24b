"""The planner weighs sequence parallelism and tp overlap for every candidate with tp > 1,
records its choice in the plan, honours the user's True/False, and the plans it emits run
and match the unmodified model (gloo, CPU, fp32)."""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace

import pytest
import torch

import autotp
from autotp import presets
from autotp.cli.plan import add_plan_command
from autotp.compiler import trace_for_planning
from autotp.cost_model.compute import ModelCosts
from autotp.cost_model.hardware import H100, H200, PCIE
from autotp.cost_model.planner import Cluster, Training, plan, search
from autotp.ir.plan import ParallelPlan
from distributed import run_on_ranks
from small_models import build
from test_sequence_parallel import profile_without_host_costs

BOTH = ("all_gather", "reduce_scatter")


@pytest.fixture(scope="module")
def llama8b() -> ModelCosts:
    return trace_for_planning(presets.model_config("llama3-8b"), 2048)


def _best(costs: ModelCosts, hw, training: Training, tp: int, pp: int, mbs: int):
    return plan(costs, Cluster(8, 8, hw), training, tp=tp, pp=pp, microbatch_size=mbs, top=1)[0]


def test_sequence_parallelism_is_chosen_where_activation_memory_binds(llama8b: ModelCosts) -> None:
    # tp=4 x pp=2 with 8 samples of 2048 tokens per microbatch: whole activations between the tp regions do not fit
    with pytest.raises(ValueError, match="does not fit"):
        _best(llama8b, H100, Training(64, sequence_parallel=False), 4, 2, 8)
    chosen = _best(llama8b, H100, Training(64), 4, 2, 8)
    assert chosen.plan.sequence_parallel and chosen.mem_bytes_per_gpu <= H100.usable_memory_bytes
    # overlap is weighed on top, and left out where it is slower: 8 samples per microbatch make the
    # fused ops copy every operand into the sequence's order (``overlap_overheads``)
    plain = _best(llama8b, H100, Training(64, tp_overlap=False), 4, 2, 8)
    overlapped = _best(llama8b, H100, Training(64, tp_overlap=True), 4, 2, 8)
    assert plain.plan.sequence_parallel and plain.plan.tp_overlap == ()
    assert chosen.plan.tp_overlap == () and chosen.step_s == plain.step_s < overlapped.step_s
    # over PCIe the transfers it hides outweigh those copies: kept
    slow = _best(llama8b, PCIE, Training(64), 4, 2, 8)
    assert slow.plan.tp_overlap == BOTH and slow.step_s < _best(llama8b, PCIE, Training(64, tp_overlap=False), 4, 2, 8).step_s
    # the plan records the choice, and its JSON carries it
    row = slow.to_json()
    assert (row["sequence_parallel"], row["tp_overlap"]) == (True, list(BOTH))
    assert ParallelPlan.from_json(slow.plan.to_json()) == slow.plan
    assert any("sequence parallelism on, all_gather and reduce_scatter overlapped" in n for n in slow.plan.notes)


def test_sequence_parallelism_is_chosen_where_it_is_faster(llama8b: ModelCosts) -> None:
    # 4 samples per microbatch on H200: both fit; norms and adds on 1/4 of the tokens outweigh the extra calls
    auto = _best(llama8b, H200, Training(64), 4, 2, 4)
    off = _best(llama8b, H200, Training(64, sequence_parallel=False), 4, 2, 4)
    plain = _best(llama8b, H200, Training(64, tp_overlap=False), 4, 2, 4)
    assert off.mem_bytes_per_gpu <= H200.usable_memory_bytes and not off.plan.sequence_parallel
    assert plain.plan.sequence_parallel and plain.step_s < off.step_s
    assert auto.plan.sequence_parallel and auto.step_s <= plain.step_s
    # 1 sample per microbatch: the host issues the extra collectives slower than the GPU saves
    small = _best(llama8b, H100, Training(64), 4, 2, 1)
    forced = _best(llama8b, H100, Training(64, sequence_parallel=True), 4, 2, 1)
    assert not small.plan.sequence_parallel and small.plan.tp_overlap == ()
    assert forced.plan.sequence_parallel and small.step_s < forced.step_s


def test_the_users_choice_is_kept(llama8b: ModelCosts) -> None:
    cluster = Cluster(8, 8, H200)
    for training, sp, overlap in (
        (Training(64, sequence_parallel=False), False, ()),
        (Training(64, sequence_parallel=True, tp_overlap=False), True, ()),
        (Training(64, tp_overlap=True), True, BOTH),
    ):
        plans = plan(llama8b, cluster, training, top=20)
        sharded = [e for e in plans if e.plan.tp > 1]
        assert sharded and all((e.plan.sequence_parallel, e.plan.tp_overlap) == (sp, overlap) for e in sharded)
        assert all(not e.plan.sequence_parallel and e.plan.tp_overlap == () for e in plans if e.plan.tp == 1)
    with pytest.raises(ValueError, match="tp_overlap=True overlaps"):
        Training(64, sequence_parallel=False, tp_overlap=True)


def test_a_sequence_that_tp_does_not_split_runs_without() -> None:
    tiny = trace_for_planning(presets.model_config("llama-tiny"), 30)  # 30 tokens: split by 2, not by 4
    cluster = Cluster(4, 4, H100)
    found = search(tiny, cluster, Training(4), top=100)
    assert {e.plan.tp for e in found.plans} >= {4} and not found.refused_tp
    assert not any(e.plan.sequence_parallel for e in found.plans if e.plan.tp == 4)
    forced = search(tiny, cluster, Training(4, sequence_parallel=True), top=100)
    assert 4 not in {e.plan.tp for e in forced.plans} and "pad the sequence to a multiple of 4" in forced.refused_tp[4]
    assert all(e.plan.sequence_parallel for e in forced.plans if e.plan.tp == 2)
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 4"):
        plan(tiny, cluster, Training(4, sequence_parallel=True), tp=4)


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="autotp")
    add_plan_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_plan_command_shows_the_choice_per_row(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("plan", "llama3-8b", "--gpus", "8", "--hardware", "h100", "--global-batch", "64", "--seq", "2048", "--tp", "4")
    assert _run(*base, "--pp", "2", "--top", "3") == 0
    lines = capsys.readouterr().out.splitlines()
    assert "sequence parallelism auto, tp overlap auto" in lines[0]
    assert lines[1].split()[-3:] == ["SP", "overlap", "recomp"]
    assert lines[2].split()[-3:] == ["on", "no", "no"]  # activations bind at tp=4 x pp=2 on H100; overlap copies outweigh
    assert _run(*base, "--sequence-parallel", "off", "--format", "json", "--top", "3") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["sequence_parallel"] is False and r["plan"]["sequence_parallel"] is False for r in rows)
    assert _run(*base, "--tp-overlap", "on", "--format", "json", "--top", "3") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["sequence_parallel"] and r["tp_overlap"] == list(BOTH) for r in rows)
    with pytest.raises(ValueError, match="tp_overlap=True overlaps"):
        _run(*base, "--sequence-parallel", "off", "--tp-overlap", "on")


def _auto_on_rank(rank: int, world: int) -> tuple[str, str]:
    model = build("llama")
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, 128, (4, 16), generator=gen) for _ in range(2))
    pm = autotp.parallelize(model, tp=2, plan="auto", example_inputs={"input_ids": ids, "labels": labels})
    out, expected = pm(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-4, atol=1e-6)
    out.loss.backward()
    expected.loss.backward()
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")
    kept = autotp.compile_rank(build("llama"), tp=2, plan="auto", example_inputs={"input_ids": ids, "labels": labels},
                               sequence_parallel=False)  # fmt: skip
    return pm.plan.to_json(), kept.plan.to_json()


def test_parallelize_auto_runs_the_planned_sequence_parallelism(monkeypatch, tmp_path) -> None:
    """A profile without host costs makes sequence parallelism and overlap the faster plan for a
    small Llama at tp=2; the plan that parallelize(plan="auto") emits runs them and matches."""
    monkeypatch.setenv("AUTOTP_HARDWARE", str(profile_without_host_costs(tmp_path)))
    for planned, kept in run_on_ranks(_auto_on_rank, 2):
        chosen, off = ParallelPlan.from_json(planned), ParallelPlan.from_json(kept)
        assert (chosen.tp, chosen.sequence_parallel, chosen.tp_overlap) == (2, True, BOTH)
        assert (off.sequence_parallel, off.tp_overlap) == (False, ())  # the caller's False overrides the planner


def test_search_stays_with_the_fixed_flag_for_every_candidate(llama8b: ModelCosts) -> None:
    """Every plan of a search is one of the variants it weighed: sequence parallelism only with tp > 1."""
    for e in plan(llama8b, Cluster(8, 8, replace(H100, memory_capacity_bytes=40e9)), Training(64), top=30):
        assert e.plan.tp > 1 or not (e.plan.sequence_parallel or e.plan.tp_overlap)
        assert e.plan.sequence_parallel or not e.plan.tp_overlap
