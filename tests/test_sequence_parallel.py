"""Sequence parallelism: loss, logits and every grad equal the unmodified model (gloo, CPU,
fp32), and each decoder layer runs 2 reduce-scatters + 2 all-gathers and no all-reduce on
its residual path."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import autotp
from autotp.analysis.layers import layer_of
from autotp.cli.main import main
from autotp.cost_model.graph_costs import build_report
from autotp.cost_model.hardware import CPU, save_profile
from autotp.report.graph_report import explain_table
from autotp.ir import meta_keys, ops
from distributed import run_on_ranks
from small_models import build, vocab_size

RTOL, ATOL = 1e-4, 1e-6
BATCH, SEQ = 4, 16


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _data(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    vocab = vocab_size(model)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=gen), torch.randint(0, vocab, (BATCH, SEQ), generator=gen)


def _sp_on_rank(rank: int, world: int, names: list[str], tp: int, pp: int, tp_overlap: bool = False) -> dict[str, float]:
    return {name: _compare(name, tp, pp, tp_overlap) for name in names}


def _compare(name: str, tp: int, pp: int, tp_overlap: bool = False) -> float:
    model = build(name, layers=4 if pp > 1 else 2)
    reference = copy.deepcopy(model)
    ids, labels = _data(model)
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs={"input_ids": ids[:2], "labels": labels[:2]},
                            sequence_parallel=True, tp_overlap=tp_overlap)  # fmt: skip
    assert pm.plan.sequence_parallel and bool(pm.plan.tp_overlap) == tp_overlap
    if tp_overlap:  # the decomposed ops replace the plain ones in the graph that runs
        targets = {n.target for n in pm.graph_for(input_ids=ids, labels=labels).graph.nodes}
        assert {ops.ALL_GATHER_MATMUL, ops.MATMUL_REDUCE_SCATTER} <= targets, f"{name}: nothing was overlapped"
    if pp == 1:
        out, expected = pm(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
        _close(out.logits, expected.logits, "logits")
        _close(out.loss, expected.loss, "loss")
        out.loss.backward()
        expected.loss.backward()
        loss = out.loss.detach()
    else:
        loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=2)
        losses = [reference(input_ids=i, labels=l).loss for i, l in zip(ids.chunk(2), labels.chunk(2))]
        expected_loss = torch.stack(losses).mean()
        expected_loss.backward()
        _close(loss, expected_loss, "loss")
    grads = pm.unshard_grads()
    for pname, p in reference.named_parameters():
        assert grads[pname] is not None, f"no grad for {pname}"
        _close(grads[pname], p.grad, f"grad of {pname}")
    return loss.item()


MODELS = ["llama", "gpt2", "mixtral", "bert"]


def check_on_ranks(names: list[str], tp: int, pp: int, tp_overlap: bool = False) -> None:
    """Loss, logits (pp = 1) and every grad of each model equal the unmodified one on tp·pp gloo ranks."""
    results = run_on_ranks(_sp_on_rank, tp * pp, names, tp, pp, tp_overlap, timeout_s=600)
    for name in names:
        assert len({round(r[name], 6) for r in results}) == 1, f"{name}: ranks disagree on the loss: {results}"


def test_sequence_parallel_matches_unmodified_model_tp2() -> None:
    check_on_ranks(MODELS, 2, 1)


def test_moe_layers_match_without_a_backward_all_reduce_tp2() -> None:
    """Mixtral with its router's load-balancing loss in the loss (a whole gradient meets the
    experts' partial ones in the router) and Qwen2-MoE (a shared expert behind a sigmoid gate)."""
    check_on_ranks(["mixtral_aux", "qwen2_moe"], 2, 1)


def test_an_all_reduce_that_must_stay_is_kept_and_explained(capsys: pytest.CaptureFixture[str]) -> None:
    """A gate adds what the normed and the raw residual stream give (both gathered tokens), then
    scales the row-parallel output: the gradients of the two gathers meet in that add, so neither
    gather's reduce-scatter could sum them. The f's stay, the numbers match and ``autotp explain``
    says why."""
    model = build("two_input_gate")
    ids = torch.randint(0, vocab_size(model), (2, SEQ))
    compiled = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids, "labels": ids}, sequence_parallel=True)
    kept = [n for n in compiled.graph.graph.nodes if meta_keys.KEPT_ALL_REDUCE in n.meta]
    assert len(kept) == 4 and all(n.target is ops.COPY_TO_TP for n in kept)  # per layer: the up projection's, the gate's
    assert not any(n.target is ops.PARTIAL_GRAD for n in compiled.graph.graph.nodes)
    text = explain_table(build_report(compiled.graph, compiled.plan, 0), "two_input_gate")
    assert "kept under sequence parallelism: 'add' reads both the tokens gathered at 'gather_from_tp_1' and 'linear_1'" in text
    check_on_ranks(["two_input_gate"], 2, 1)
    assert main(["explain", "llama-tiny", "--tp", "2", "--seq", "32", "--sequence-parallel"]) == 0
    assert "this plan: 0 + " in capsys.readouterr().out  # no forward all-reduce is left: reduce-scatters instead


def _plain_model_on_rank(rank: int, world: int, module_name: str, name: str) -> str:
    import importlib

    from autotp.report.strict_rule import check_on_rank
    from test_plain_suite import _inputs

    module = importlib.import_module(module_name)
    return check_on_rank(module.build(name), _inputs(module, name), tp=world, sequence_parallel=True).reason


@pytest.mark.parametrize(("module_name", "name"), [("plain_models_research", "vq_bottleneck"), ("plain_models_novel", "swin")])
def test_plain_models_that_crashed_under_sequence_parallelism(module_name: str, name: str) -> None:
    """A VQ bottleneck's ``cdist`` broadcasts its operands (``broadcast_tensors``, two outputs)
    between the gathered tokens and the next f: the whole gradient leaving by a getitem is now
    divided there (``partial_grad`` was put on the tuple itself). Swin's relative-position bias,
    a table lookup permuted to ``[1, heads, S, S]`` before its all-reduce, was taken for tokens
    (its heads for the sequence) and split, and the attention's values were taken for a weight;
    a g now opens a region only where the features stay last, and a matmul joins one only
    where its other operand is the same for every token."""
    assert run_on_ranks(_plain_model_on_rank, 2, module_name, name) == ["", ""]


@pytest.mark.slow
def test_sequence_parallel_matches_unmodified_model_tp4() -> None:
    check_on_ranks(MODELS, 4, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_sequence_parallel_matches_unmodified_model_tp2_pp2(name: str) -> None:
    check_on_ranks([name], 2, 2)


def profile_without_host_costs(folder: Path) -> Path:
    """The CPU profile without per-op, per-collective and latency costs: there sequence parallelism
    and overlap win by their compute alone (a JSON path for ``AUTOTP_HARDWARE``)."""
    path = folder / "no_host_costs.json"
    save_profile(replace(CPU, name="CPU without host costs", op_overhead_s=0.0, backward_op_overhead_s=0.0,
                         collective_host_s=0.0, collective_latency_s=0.0), path)  # fmt: skip
    return path


def _per_layer(gm: torch.fx.GraphModule) -> dict[int, Counter[str]]:
    counts: dict[int, Counter[str]] = {}
    for n in gm.graph.nodes:
        if meta_keys.COLLECTIVE not in n.meta or n.args[0].op == "get_attr":
            continue  # f on a norm weight or bias: its grad (this rank's tokens) is summed backward
        # an all-gather belongs to the layer that reads it (post-norm BERT computes its input in the layer before)
        layer = layer_of(next(iter(n.users)) if n.target is ops.ALL_GATHER else n)
        if layer is not None:
            counts.setdefault(layer, Counter())[n.target._schema.name.split("::")[1]] += 1
    return counts


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral", "mixtral_aux", "qwen2_moe", "bert"])
def test_collectives_per_decoder_layer(name: str) -> None:
    model = build(name)
    ids = torch.randint(0, vocab_size(model), (2, SEQ))
    compiled = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids}, sequence_parallel=True)
    per_layer = _per_layer(compiled.graph)
    assert len(per_layer) == model.config.num_hidden_layers
    for layer, counts in per_layer.items():
        # forward: 2 reduce-scatters, 2 all-gathers, no all-reduce
        assert counts["reduce_scatter"] == 2, (layer, counts)
        assert counts["all_gather"] + counts["gather_from_tp"] == 2, (layer, counts)
        assert counts["reduce_from_tp"] == 0, (layer, counts)
        # backward: the duals (reduce-scatter, all-gather), no all-reduce of activations (MoE's included)
        assert counts["all_gather"] == 2 and counts["copy_to_tp"] == 0, (layer, counts)
    off = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids}, sequence_parallel=False)
    assert not any(n.target in (ops.REDUCE_SCATTER, ops.ALL_GATHER) for n in off.graph.graph.nodes)


def test_auto_decides_by_the_cost_model_and_odd_sequences_are_refused(monkeypatch, tmp_path) -> None:
    model = build("llama")
    even = torch.randint(0, 100, (2, 16))
    # the CPU profile's per-call host costs outweigh norms on half of 32 tokens; without them it is the other way
    monkeypatch.setenv("AUTOTP_HARDWARE", "cpu")
    assert not autotp.compile_rank(model, tp=2, example_inputs={"input_ids": even}, sequence_parallel="auto").plan.sequence_parallel
    monkeypatch.setenv("AUTOTP_HARDWARE", str(profile_without_host_costs(tmp_path)))
    auto = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": even}, sequence_parallel="auto", tp_overlap="auto")
    assert auto.plan.sequence_parallel and auto.plan.tp_overlap == ("all_gather", "reduce_scatter")
    odd = torch.randint(0, 100, (2, 15))
    assert not autotp.compile_rank(model, tp=2, example_inputs={"input_ids": odd}, sequence_parallel="auto").plan.sequence_parallel
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 2"):
        autotp.compile_rank(model, tp=2, example_inputs={"input_ids": odd}, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel must be"):
        autotp.compile_rank(model, tp=2, example_inputs={"input_ids": even}, sequence_parallel="yes")
