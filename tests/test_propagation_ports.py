"""Constructs of the seventh round of issue 27 (``tests/plain_models_ports.py``): the layouts
the planner gives them in one process, the pieces a split step cuts, the refusals, and the
numerics on ranks. ``test_plain_suite`` checks the whole models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.analysis.batch_rows import batch_mixing_node, batch_size
from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.errors import UserInputError
from autotp.runtime.execution.batch_pieces import microbatches
from distributed import run_on_ranks
from plain_models_ports import CHARS, FEATURES, FRAMES_AUDIO, TARGET, CtcSpeech, build, example_inputs


def _layouts(name: str, tp: int) -> dict[str, tuple[str, int | None]]:
    plan = plan_tensor_parallel(trace(build(name), example_inputs(name)), tp)
    return {p.name: (p.kind, p.dim) for p in plan.params}


def test_a_bilinear_weight_is_column_parallel_over_its_outputs() -> None:
    """``nn.Bilinear``'s weight [out, in1, in2] splits its outputs and its bias follows; the down
    projection behind it goes row-parallel (it was read whole: 98% of the model on a rank)."""
    layouts = _layouts("bilinear_context", 2)
    assert layouts["layers.0.feed_forward.bilinear.weight"] == ("column", 0)
    assert layouts["layers.0.feed_forward.bilinear.bias"] == ("bias", 0)
    assert layouts["layers.0.feed_forward.down.weight"][0] == "row"


def test_transposed_convolutions_split_their_stored_output_and_input_channels() -> None:
    """``ConvTranspose1d`` stores its weight [in, out, k]: the first upsampler splits its outputs
    (dim 1), the second its inputs (dim 0, row-parallel, its bias added after the all-reduce)."""
    layouts = _layouts("conv_transpose_decoder", 4)
    assert layouts["up1.weight"] == ("column", 1) and layouts["up1.bias"] == ("bias", 0)
    assert layouts["up2.weight"] == ("row", 0) and "up2.bias" not in layouts


def test_a_lookup_with_frequency_scaled_gradients_mixes_the_batch() -> None:
    """``scale_grad_by_freq`` divides each table row's gradient by its id's count in the whole
    batch: microbatches would count their own ids, so a split step is refused."""
    found = batch_mixing_node(trace(build("scale_grad_by_freq"), example_inputs("scale_grad_by_freq")), batch=2)
    assert "embedding" in found, found
    assert batch_mixing_node(trace(build("odd_ffn_width"), example_inputs("odd_ffn_width")), batch=2) == ""


def test_a_split_step_cuts_only_the_tensors_of_the_batch_rows() -> None:
    """gpt-fast's ``input_pos`` [S] is every row's: each microbatch gets it whole (it was cut
    along its dim 0 like the batch, and the microbatch's trace failed)."""
    inputs = example_inputs("gpt_fast_input_pos", batch=4)
    assert batch_size(inputs) == 4
    pieces = microbatches(inputs, dp=1, dp_rank=0, m=2, batch_is_local=False)
    assert [tuple(p["idx"].shape) for p in pieces] == [(2, 16), (2, 16)]
    assert all(torch.equal(p["input_pos"], inputs["input_pos"]) for p in pieces)
    assert torch.equal(pieces[1]["labels"], inputs["labels"][2:])


def test_an_ffn_width_tp_does_not_divide_is_split_with_padding() -> None:
    """170 channels at tp=4: blocks of 43, the last rank's 41 wide plus 2 of padding (refused
    naming tp=2 before padded splits); the attention's heads split evenly as before."""
    plan = plan_tensor_parallel(trace(build("odd_ffn_width"), example_inputs("odd_ffn_width")), 4)
    layouts = {p.name: p for p in plan.params}
    for name in ("w1.weight", "w2.weight", "w3.weight"):
        sharding = layouts[f"layers.0.feed_forward.{name}"].sharding
        assert sharding.padded and sharding.local_size(4) == 43
    assert not layouts["layers.0.attention.c_attn.weight"].sharding.padded and not [k for k in plan.kept_whole if k.name.endswith("proj.weight")]


def test_an_op_whose_output_shape_depends_on_the_data_is_named_with_the_fix() -> None:
    with pytest.raises(UserInputError, match=r"aten\._ctc_loss\S* makes an output whose shape depends on the values .* compute it on the outputs"):
        trace(CtcSpeech().eval(), _ctc_inputs())


class _CtcLogits(nn.Module):
    """The CTC model returning its logits; the loss is computed on the parallel model's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = CtcSpeech()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.inner.frontend(features.transpose(1, 2)).transpose(1, 2)
        for layer in self.inner.layers:
            x = layer(x)
        return self.inner.ctc_head(self.inner.norm(x))


def _ctc_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"features": torch.randn(2, FRAMES_AUDIO, FEATURES, generator=gen), "feature_lengths": torch.tensor([FRAMES_AUDIO, FRAMES_AUDIO - 6]),
            "targets": torch.randint(1, CHARS, (2, TARGET), generator=gen), "target_lengths": torch.tensor([TARGET, TARGET - 2])}  # fmt: skip


def _ctc_loss(logits: torch.Tensor) -> torch.Tensor:
    data = _ctc_inputs()
    frames = (data["feature_lengths"] + 1) // 2
    return F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), data["targets"], frames, data["target_lengths"], zero_infinity=True)


def _ctc_on_rank(rank: int, world: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    return check_on_rank(_CtcLogits().eval(), {"features": _ctc_inputs()["features"]}, tp=world, loss_fn=_ctc_loss).reason


def test_a_ctc_loss_on_the_outputs_of_the_parallel_model_equals_the_unmodified_one() -> None:
    assert run_on_ranks(_ctc_on_rank, 2) == ["", ""]


def test_a_bag_table_is_column_parallel_over_its_features() -> None:
    """A product-key memory's ``EmbeddingBag`` (sum, ``per_sample_weights``) splits its value table's
    features, and the projection reading the bags goes row-parallel (the table was read whole:
    67% of the model on a rank at tp=2)."""
    layouts = _layouts("product_key_memory", 4)
    assert layouts["layers.0.feed_forward.values.weight"] == ("column", 1)
    assert layouts["layers.0.feed_forward.out.weight"][0] == "row"


def test_documents_split_at_lengths_read_from_values_trace_and_an_empty_one_is_refused() -> None:
    """Packed documents attended in a loop over ``split(lengths.tolist())``: SDPA asks whether each
    document is empty, answered no (its size-oblivious answer) and asserted at run time. Other
    lengths give the model's numbers; an empty document fails naming the line."""
    from autotp.api import parallelize

    pm = parallelize(build("varlen_document_loop"), tp=1, example_inputs=example_inputs("varlen_document_loop"))
    model = build("varlen_document_loop")
    for lengths in ([1, 14, 1], [16]):
        inputs = {**example_inputs("varlen_document_loop"), "lengths": torch.tensor(lengths)}
        torch.testing.assert_close(pm(**inputs)["logits"], model(**inputs)["logits"], rtol=0, atol=0)
    empty = {**example_inputs("varlen_document_loop"), "lengths": torch.tensor([5, 0, 11])}
    with pytest.raises(RuntimeError, match=r"plain_models_ports\.py:\d+ .*scaled_dot_product_attention was traced assuming dim 2 of its input, a size known only at run time, is nonzero"):
        pm(**empty)


def _verbalizer_in_float64(rank: int, world: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    return check_on_rank(build("verbalizer_head").double(), example_inputs("verbalizer_head"), tp=world, rtol=1e-9, atol=1e-11).reason


def test_the_verbalizer_at_tp4_is_the_unmodified_model_in_float64() -> None:
    """Its fp32 logits differ at tp=4 by rounding alone (the suite's ``FP32_ROUNDING``): in float64
    the parallel model equals the unmodified one."""
    assert run_on_ranks(_verbalizer_in_float64, 4) == [""] * 4


def test_a_buffer_the_forward_moves_from_its_own_value_refuses_a_split_step() -> None:
    """Aux-loss-free balancing written into the forward reads its routing bias, then moves it:
    split into microbatches, the second would route with the bias the first moved (the loss was
    1.3e-4 off at pp=2, silently). A KV cache filled by slice assignment before it is read is not
    refused (the reference Llama's)."""
    from plain_models_frameworks import build as build_framework, example_inputs as framework_inputs

    found = batch_mixing_node(trace(build("bias_balanced_moe"), example_inputs("bias_balanced_moe")), batch=2)
    assert "updates buffer layers.0.feed_forward.expert_bias from its value before the forward" in found, found
    cache = "llama_reference_kv_cache"
    assert batch_mixing_node(trace(build_framework(cache), framework_inputs(cache)), batch=2) == ""


def test_pooling_and_interpolation_keep_the_channel_split() -> None:
    """Keys and values average-pooled along the sequence and a branch brought back by
    ``F.interpolate``: each channel's plane is pooled alone, so the projections keep Megatron's
    layout (the ops were opaque: the projections' outputs were gathered around them)."""
    plan = plan_tensor_parallel(trace(build("pooled_kv_attention"), example_inputs("pooled_kv_attention")), 4)
    layouts = {p.name: (p.kind, p.dim) for p in plan.params}
    assert layouts["layers.0.attention.kv.weight"] == ("column", 0) and layouts["layers.0.attention.out.weight"] == ("row", 1)
    assert plan.gathered == ()


def test_einsums_with_an_ellipsis_keep_the_heads_split() -> None:
    """``einsum("...id,...jd->...ij")`` over ``[B, H, S, D]``: the ellipsis stands for the leading
    dims, heads among them, as letters of their own (it was opaque: q/k/v gathered before it)."""
    plan = plan_tensor_parallel(trace(build("ellipsis_einsum_attention"), example_inputs("ellipsis_einsum_attention")), 4)
    layouts = {p.name: (p.kind, p.dim) for p in plan.params}
    assert layouts["layers.0.attention.qkv.weight"] == ("column", 0) and layouts["layers.0.attention.out.weight"] == ("row", 1)
    assert plan.gathered == ()


def _strict_at_tp(rank: int, world: int, names: list[str]) -> list[str]:
    from autotp.report.strict_rule import check_on_rank

    return [check_on_rank(build(name), example_inputs(name), tp=world).reason for name in names]


def test_frequency_scaled_and_frozen_tables_at_tp2_equal_the_unmodified_model() -> None:
    """The vocab-parallel lookup keeps ``scale_grad_by_freq`` (every gradient was 7x off) and
    finds a frozen teacher's table behind ``detach`` (the rewrite failed an assertion)."""
    assert run_on_ranks(_strict_at_tp, 2, ["scale_grad_by_freq", "ema_teacher"]) == [["", ""], ["", ""]]
