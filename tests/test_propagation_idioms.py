"""Constructs of the tenth round of issue 27 (``tests/plain_models_idioms.py``): a weight plus
a delta made from the activations (fast weights) splits with its parameter; a weight rebuilt in
the forward from parameters and factories (per-channel fake quantization) counts as matmul work
when the pipeline is cut; messages scattered from a graph's edges into its nodes mix the rows
of a split batch; a head padded past the vocabulary, sliced before the loss, splits in its two
parts. ``test_plain_suite`` checks the whole models."""

from __future__ import annotations

import pytest
import torch

import plain_models_idioms
from autotp.analysis.batch_rows import batch_mixing_node, batch_size
from autotp.analysis.trace import trace
from autotp.cost_model.pipeline import plan_pipeline
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.op_facts import is_pointwise
from distributed import run_on_ranks
from plain_models_idioms import build, example_inputs


def test_a_fast_weight_splits_with_the_parameter_it_adds_to() -> None:
    """``w1.weight + delta(x)`` read by ``F.linear``: the hint that splits a weight computed from
    parameters now also follows one that reads the activations, so w1 (read whole before,
    38% of the model on a rank at tp=4) splits column-wise and its delta's rows with it."""
    name = "functional_call_fast_weights"
    layouts = {p.name: (p.kind, p.dim) for p in plan_tensor_parallel(trace(build(name), example_inputs(name)), 4).params}
    assert layouts["layers.0.feed_forward.ffn.w1.weight"] == ("column", 0)
    assert layouts["layers.0.feed_forward.ffn.w2.weight"] == ("row", 1)


def test_fake_quantized_weights_count_as_the_layers_work_in_the_pipeline_cut() -> None:
    """The quantizer's zero points come from ``torch.zeros`` (a factory, no inputs): the weight
    it made was not seen as computed from parameters, so the layers' matmuls cost nothing and
    both layers went to the first stage, the lm_head alone to the second (92% of the
    parameters on a rank at pp=2)."""
    name = "per_channel_fake_quant"
    cuts = plan_pipeline(trace(build(name), example_inputs(name)), 2, 1)
    assert cuts.layer_chunks == (0, 1)


def test_messages_scattered_into_a_graphs_nodes_mix_the_rows() -> None:
    """The edges are the batch's rows (most inputs have their length), and each node's softmax
    and sum run over its incoming edges (``scatter_reduce`` amax, ``index_add``) into tensors of
    the nodes. Before, nothing marked this, and pp=2 split the edges into microbatches: the loss
    was 0.025 off."""
    name = "graph_message_passing"
    inputs = example_inputs(name)
    found = batch_mixing_node(trace(build(name), inputs), batch_size(inputs))
    assert "layers.0" in found and "scatter_reduce" in found, found


@pytest.mark.parametrize(("padded", "tp"), [(136, 4), (134, 2), (134, 4)])
def test_a_head_padded_past_the_vocabulary_splits_in_its_real_and_padding_rows(padded: int, tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``logits[..., :vocab]`` cuts the head's rows into the vocabulary and the padding, and
    the vocabulary-parallel loss marks the first part padded-if-needed. Before, resolving a
    padded part of a segmented dim raised out of the planner (a crash at tp=2 and tp=4); then
    tp split each part where it divided both and kept the head whole where not (6 rows at tp=4);
    now each part is split with padding at its own end where tp does not divide it."""
    monkeypatch.setattr(plain_models_idioms, "PADDED_VOCAB", padded)
    name = "padded_vocab_slice"
    plan = plan_tensor_parallel(trace(build(name), example_inputs(name)), tp)
    head = {p.name: p for p in plan.params}["output.weight"]
    assert (head.kind, head.dim, head.sharding.segments) == ("column", 0, (128, padded - 128))
    assert head.sharding.padded == bool((padded - 128) % tp)


def test_composites_that_only_move_data_take_the_rules_of_their_views() -> None:
    """``movedim``, ``swapaxes``, ``tensor_split`` and ``narrow`` have no rule and no DTensor
    strategy (they are CompositeImplicitAutograd): the walk kept the fused QKV whole at them.
    The trace now replaces each by its decomposition, which is only views, so the heads split."""
    name = "moved_axes_attention"
    model = build(name)
    gm = trace(model, example_inputs(name))
    left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"} & {"aten.movedim.int", "aten.swapaxes.default", "aten.tensor_split.sections", "aten.narrow.default"}
    assert not left
    plan = plan_tensor_parallel(gm, 4)
    layouts = {p.name: (p.kind, p.dim) for p in plan.params}
    linears = {f"{path}.weight" for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears <= set(layouts), linears - set(layouts)
    assert layouts["layers.0.attention.qkv.weight"] == ("column", 0) and layouts["layers.0.attention.o.weight"] == ("row", 1)


def test_ops_decomposed_into_pointwise_ops_are_pointwise() -> None:
    """``hardswish`` and ``_prelu_kernel`` carry no ``torch.Tag.pointwise``; their decompositions
    are pointwise ops alone, so they split like one (before, the FFN's hidden units were
    all-gathered in front of them). Reductions and softmaxes are not."""
    aten = torch.ops.aten
    assert is_pointwise(aten.hardswish.default) and is_pointwise(aten._prelu_kernel.default)
    assert not any(is_pointwise(op) for op in (aten.sum.default, aten._softmax.default, aten.glu.default, aten.mse_loss.default))
    name = "hardswish_prelu_ffn"
    plan = plan_tensor_parallel(trace(build(name), example_inputs(name)), 4)
    layouts = {p.name: (p.kind, p.dim) for p in plan.params}
    assert not plan.gathered
    assert layouts["layers.0.feed_forward.up.weight"] == ("column", 0) and layouts["layers.0.feed_forward.down.weight"] == ("row", 1)


def _check(rank: int, world: int, name: str) -> str:
    from autotp.report.strict_rule import check_on_rank

    return check_on_rank(build(name), example_inputs(name), tp=world).reason


def _hf_experts_on_rank(rank: int, world: int, implementation: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from autotp.report.strict_rule import check_on_rank

    config = AutoConfig.for_model("mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    result = check_on_rank(model, {"input_ids": ids, "labels": ids}, tp=world)
    return result.reason or f"{result.share:.2f}"


@pytest.mark.parametrize("implementation", ["grouped_mm", pytest.param("batched_mm", marks=pytest.mark.slow)])
def test_transformers_expert_implementations_split_their_experts(implementation: str) -> None:
    """The expert kernels transformers offers besides its loop (``experts_implementation``), in
    fp32 at tp=2: equal to the unmodified model, the experts split."""
    assert run_on_ranks(_hf_experts_on_rank, 2, implementation) == ["0.50", "0.50"]


@pytest.mark.slow  # the plain suite's sweep checks this model at every degree; this is the same check at tp=2
def test_fast_weights_at_tp2_equal_the_unmodified_model() -> None:
    assert run_on_ranks(_check, 2, "functional_call_fast_weights") == ["", ""]
