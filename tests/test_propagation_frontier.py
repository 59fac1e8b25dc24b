"""Constructs of the eighth round of issue 27 (``tests/plain_models_frontier.py``): the layouts
the planner gives them in one process, the pieces a split step cuts, the refusals, and the
numerics on ranks. ``test_plain_suite`` checks the whole models."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from autotp.analysis.trace import input_batch_dims, trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir import ops
from autotp.ir.errors import UserInputError
from autotp.ir.plan import ParallelPlan
from autotp.runtime.execution.batch_pieces import microbatches
from distributed import run_on_ranks
from plain_models_attention import DIM, HEADS, DecoderLM, NanoGPTAttention, PreNormBlock
from plain_models_frontier import ELASTIC_ACTIVE, ELASTIC_HIDDEN, build, example_inputs


def _plan(name: str, tp: int) -> ParallelPlan:
    return plan_tensor_parallel(trace(build(name), example_inputs(name)), tp)


def test_tensordot_projections_are_column_and_row_parallel() -> None:
    """JAX's ``DenseGeneral`` ported as ``tensordot`` against ``[C, H, D]`` weights splits their
    heads, and the ``[H, D, C]`` output weight contracted over heads goes row-parallel (the op had
    no rule: every projection was read whole, 67% of the model on a rank at tp=2)."""
    layouts = {p.name: (p.kind, p.dim) for p in _plan("dense_general_tensordot", 4).params}
    for name in ("w_q", "w_k", "w_v"):
        assert layouts[f"layers.0.attention.{name}"] == ("column", 1)
    assert layouts["layers.0.attention.w_o"] == ("row", 0)


def test_a_weight_sliced_in_the_forward_splits_the_range_it_keeps() -> None:
    """MatFormer's ``weight[:k]``: the kept rows are one segment of the weight's out features and
    the rest another, each split over the ranks, so a rank's slice is its part of the kept range
    (the slice read the weights whole: 79% of the model on a rank at tp=2)."""
    layouts = {p.name: p for p in _plan("elastic_width_ffn", 4).params}
    up, down = layouts["layers.0.feed_forward.up.weight"], layouts["layers.0.feed_forward.down.weight"]
    assert (up.kind, up.dim, up.sharding.segments) == ("column", 0, (ELASTIC_ACTIVE, ELASTIC_HIDDEN - ELASTIC_ACTIVE))
    assert (down.kind, down.dim, down.sharding.segments) == ("row", 1, (ELASTIC_ACTIVE, ELASTIC_HIDDEN - ELASTIC_ACTIVE))


class _MiddleRows(nn.Module):
    """The FFN's middle rows ``[64:192)`` and, beside them, the whole FFN (two granularities)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        middle = F.linear(F.gelu(F.linear(x, self.up.weight[64:192])), self.down.weight[:, 64:192])
        return middle + self.down(F.gelu(self.up(x)))


def test_slices_of_a_weight_past_its_start_and_the_whole_weight_share_one_split() -> None:
    model = DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), _MiddleRows())).eval()
    plan = plan_tensor_parallel(trace(model, example_inputs("gated_attention_output")), 4)
    layouts = {p.name: p for p in plan.params}
    up, down = layouts["layers.0.feed_forward.up.weight"], layouts["layers.0.feed_forward.down.weight"]
    assert (up.kind, up.dim, up.sharding.segments) == ("column", 0, (64, 128, 64))
    assert (down.kind, down.dim, down.sharding.segments) == ("row", 1, (64, 128, 64))


def test_a_cond_traces_and_its_branch_weights_stay_whole_with_a_note() -> None:
    """``torch.cond`` failed to trace: dynamo, capturing the branches, met autotp's own hooks. It
    traces now; the weight a branch reads stays whole, with the plan entry naming the ``cond``."""
    plan = _plan("cond_refinement", 2)
    kept = {k.name: k for k in plan.kept_whole}
    assert kept["layers.0.feed_forward.refine.weight"].op == "cond"
    assert {p.name for p in plan.params} >= {"layers.0.feed_forward.mlp.w1.weight", "layers.0.feed_forward.mlp.w2.weight"}


def test_an_input_with_its_rows_on_dim_1_is_cut_there() -> None:
    """Qwen2-VL's ``position_ids`` [3, B, S]: a symbolic trace finds its dim 1 equal to the batch,
    and a split step cuts it there (it went whole to every microbatch, whose trace then failed)."""
    name = "multimodal_rotary_sections"
    inputs = example_inputs(name, batch=4)
    dims = input_batch_dims(build(name), inputs, "cpu")
    assert dims == {"['position_ids']": 1}
    pieces = microbatches(inputs, dp=1, dp_rank=0, m=2, batch_is_local=False, batch_dims=dims)
    assert [tuple(p["position_ids"].shape) for p in pieces] == [(3, 2, 16), (3, 2, 16)]
    assert torch.equal(pieces[1]["position_ids"], inputs["position_ids"][:, 2:])
    assert input_batch_dims(build("gated_attention_output"), example_inputs("gated_attention_output"), "cpu") == {}


def test_an_input_whose_rows_cannot_be_found_refuses_a_split() -> None:
    inputs = example_inputs("multimodal_rotary_sections", batch=4)
    with pytest.raises(UserInputError, match=r"input \['position_ids'\] has a dim of the batch's size \(4\) past dim 0"):
        microbatches(inputs, dp=1, dp_rank=0, m=2, batch_is_local=False, batch_dims={"['position_ids']": -1})
    (whole,) = microbatches(inputs, dp=1, dp_rank=0, m=1, batch_is_local=False, batch_dims={"['position_ids']": -1})
    assert all(torch.equal(whole[k], inputs[k]) for k in inputs)


def test_a_forward_that_renormalizes_its_table_in_place_is_refused_naming_it() -> None:
    with pytest.raises(UserInputError, match=r"writes its parameter embed\.weight in place \(aten\.embedding_renorm_"):
        trace(build("embedding_max_norm"), example_inputs("embedding_max_norm"))


def _check(rank: int, world: int, name: str, tp: int, pp: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    return check_on_rank(build(name), example_inputs(name), tp=tp, pp=pp).reason


def test_multimodal_positions_split_over_microbatches_equal_the_unmodified_model() -> None:
    assert run_on_ranks(_check, 2, "multimodal_rotary_sections", 1, 2) == ["", ""]


def test_a_sliced_weight_at_tp2_equals_the_unmodified_model() -> None:
    assert run_on_ranks(_check, 2, "elastic_width_ffn", 2, 1) == ["", ""]


def _attention_op(name: str) -> torch._ops.OpOverload:
    """A custom op computing causal attention over [B, H, S, D] (a fused kernel's registration:
    a fake kernel and an autograd formula of its own)."""

    @torch.library.custom_op(f"autotp_test::{name}", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    @attention.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q)

    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)  # type: ignore[attr-defined]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(out, (q, k, v), grad)

    attention.register_autograd(backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
    return getattr(torch.ops.autotp_test, name).default


OPAQUE_ATTENTION = _attention_op("opaque_attention")
SHARDED_ATTENTION = _attention_op("sharded_attention")


@register_sharding(SHARDED_ATTENTION)
def _heads_apart(q: object, k: object, v: object) -> list:
    """What a kernel library registers for DTensor: the heads (dim 1) split alike, or all whole."""
    return [([Shard(1)], [Shard(1)] * 3), ([Replicate()], [Replicate()] * 3)]


class _OpAttention(nn.Module):
    def __init__(self, op: torch._ops.OpOverload) -> None:
        super().__init__()
        self.op = op
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(self.op(q, k, v).transpose(1, 2).reshape(b, s, DIM))


def _op_model(op: torch._ops.OpOverload) -> nn.Module:
    torch.manual_seed(0)
    return DecoderLM(lambda: PreNormBlock(_OpAttention(op))).eval()


def test_a_custom_op_with_a_dtensor_sharding_keeps_the_heads_split() -> None:
    """An opaque custom op has q, k and v gathered before it; one whose library registered a
    DTensor sharding (``register_sharding``) gets its rule from it: Megatron's layout through it."""
    inputs = example_inputs("gated_attention_output")
    opaque = plan_tensor_parallel(trace(_op_model(OPAQUE_ATTENTION), inputs), 2)
    assert opaque.gathered
    sharded = plan_tensor_parallel(trace(_op_model(SHARDED_ATTENTION), inputs), 2)
    layouts = {p.name: (p.kind, p.dim) for p in sharded.params}
    assert layouts["layers.0.attention.qkv.weight"] == ("column", 0) and layouts["layers.0.attention.proj.weight"] == ("row", 1)
    assert sharded.gathered == ()


def _check_op_model(rank: int, world: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    return check_on_rank(_op_model(SHARDED_ATTENTION), example_inputs("gated_attention_output"), tp=world).reason


def test_a_custom_op_sharded_by_its_dtensor_rule_equals_the_unmodified_model() -> None:
    assert run_on_ranks(_check_op_model, 2) == ["", ""]


class _HookedMLP(nn.Module):
    """A gradient changed by a hook registered in the forward on the FFN's hidden units, which
    the FFN reads once before the registration and once after."""

    def __init__(self, hook: Callable[[torch.Tensor], torch.Tensor | None], remove: bool = False, in_region: bool = False) -> None:
        super().__init__()
        self.hook, self.remove, self.in_region = hook, remove, in_region
        self.up, self.down = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        gate = torch.sigmoid(h)
        with torch.autocast("cpu", enabled=False) if self.in_region else contextlib.nullcontext():
            handle = h.register_hook(self.hook)
        if self.remove:
            handle.remove()
        return self.down(F.gelu(h) * gate)


def _hooked(hook: Callable[[torch.Tensor], torch.Tensor | None], remove: bool = False, in_region: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), _HookedMLP(hook, remove, in_region))).eval()


def _hook_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target in (ops.FUNCTION, ops.ELEMENTWISE_FUNCTION) and "register_hook" in n.args[2]]


def test_a_gradient_hook_is_one_node_after_its_tensor_that_all_uses_read() -> None:
    """The hook gets the gradient of every use of its tensor, those before its registration too:
    its node comes right after the tensor, which nothing else reads. An elementwise hook runs on
    shards, one reading the whole gradient on replicated inputs; a removed hook is gone. So for a
    hook registered inside an autocast region, which export keeps as a subgraph."""
    inputs = example_inputs("gated_attention_output")
    for in_region in (False, True):
        hooks = _hook_nodes(trace(_hooked(lambda g: g * 0.5, in_region=in_region), inputs))
        assert [n.target for n in hooks] == [ops.ELEMENTWISE_FUNCTION] * 2
        for hook in hooks:
            (tensor,) = hook.args[0]
            assert tensor.target is torch.ops.aten.linear.default and list(tensor.users) == [hook] and tensor.next is hook
            assert {u.target for u in hook.users} == {torch.ops.aten.sigmoid.default, torch.ops.aten.gelu.default}
    assert [n.target for n in _hook_nodes(trace(_hooked(lambda g: g / g.norm()), inputs))] == [ops.FUNCTION] * 2
    assert _hook_nodes(trace(_hooked(lambda g: g * 0.5, remove=True), inputs)) == []


def _check_hooked(rank: int, world: int) -> list[str]:
    from autotp.report.strict_rule import check_on_rank

    inputs = example_inputs("gated_attention_output")
    seen: list[tuple[int, ...]] = []
    hooks = [lambda g: g.clamp(-1e-3, 1e-3), lambda g: g / (g.norm() + 1e-6), lambda g: seen.append(tuple(g.shape))]
    reasons = [check_on_rank(_hooked(hook), inputs, tp=world).reason for hook in hooks]
    return [*reasons, str(sorted(set(seen)))]


def test_gradient_hooks_at_tp2_equal_the_unmodified_model() -> None:
    """A clip of the gradient (on shards), a normalization by its norm (the whole gradient) and a
    hook that only records: the gradients are the unmodified model's with its hooks; the recording
    hook sees this rank's piece of the gradient (the FFN's hidden units split in two) and the
    reference's whole gradient."""
    hidden = 2 * DIM
    pieces = f"[(2, 16, {hidden // 2}), (2, 16, {hidden})]"
    assert run_on_ranks(_check_hooked, 2) == [["", "", "", pieces]] * 2


class _LeafHookMLP(nn.Module):
    def __init__(self, post_accumulate: bool) -> None:
        super().__init__()
        self.post_accumulate = post_accumulate
        self.up, self.down = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_accumulate:
            self.up.weight.register_post_accumulate_grad_hook(lambda p: None)
        else:
            self.up.weight.register_hook(lambda g: g * 0.5)
        return self.down(F.gelu(self.up(x)))


def test_hooks_the_graph_cannot_hold_are_refused_naming_where_they_are() -> None:
    """A hook on a parameter, a post-accumulate-grad hook and a module's backward hook change
    gradients where the traced graph does not run them: the parallel model's gradients would
    differ silently."""
    inputs = example_inputs("gated_attention_output")
    for post_accumulate, found in ((False, r"parameter or an input \(a leaf tensor, register_hook\)"), (True, r"register_post_accumulate_grad_hook")):
        model = DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), _LeafHookMLP(post_accumulate))).eval()
        with pytest.raises(UserInputError, match=rf"module layers\.0\.feed_forward \(_LeafHookMLP\) at .*{found}.*torch\.autograd\.Function"):
            trace(model, inputs)
    model = build("gated_attention_output")
    model.layers[1].feed_forward.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))
    with pytest.raises(UserInputError, match=r"module layers\.1\.feed_forward \(SwiGLU\) has a backward hook"):
        trace(model, inputs)


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    logits: torch.Tensor


class _DataclassLM(nn.Module):
    """Research code's output: a plain ``@dataclass``, not a dict or HF's ModelOutput."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build("gated_attention_output")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> _Output:
        out = self.inner(input_ids, labels)
        return _Output(out["loss"], out["logits"])


def _check_dataclass(rank: int, world: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    return check_on_rank(_DataclassLM().eval(), example_inputs("gated_attention_output"), tp=world, loss_fn=lambda out: out.loss).reason


def test_a_dataclass_output_traces_and_equals_the_unmodified_model() -> None:
    assert run_on_ranks(_check_dataclass, 2) == ["", ""]


class _ItemCountLM(nn.Module):
    """nanoGPT-style code normalizing the loss by a Python count of the labelled tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build("gated_attention_output")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.inner(input_ids)["logits"]
        count = max(1, int((labels != -100).sum().item()))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count}


def test_a_python_number_read_from_a_tensor_is_refused_with_the_tensor_form() -> None:
    with pytest.raises(UserInputError, match=r"at .*int\(\(labels != -100\)\.sum\(\)\.item\(\)\).*keep such a value a tensor \(a token count as mask\.sum\(\)\.clamp\(min=1\)"):
        trace(_ItemCountLM().eval(), example_inputs("gated_attention_output"))
