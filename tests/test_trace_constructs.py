"""The trace side of issue 27, in one process: one module instance shared by several layers,
custom autograd Functions kept whole with their own backward, grad and autocast regions
inlined, and the strict rule's pieces. The multi-rank checks of the same models are in
``test_plain_suite.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

import plain_models_library as library
import plain_models_structure as structure
from general_models import _Tanh  # a hand-written backward that is the forward's derivative
from autotp.analysis import function_checks
from autotp.analysis.layers import num_layers
from autotp.analysis.trace import trace
from autotp.analysis.trace_regions import NON_REENTRANT_GENERATOR, REGIONS, checkpointed_layers
from autotp.ir import ops
from autotp.report.strict_rule import StrictResult, check_on_rank, combine, matmul_weights


_SET_GRAD_ENABLED = torch._C._set_grad_enabled


def _targets(name: str) -> list[Any]:
    gm = trace(structure.build(name), structure.example_inputs(name))
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _equal_in_one_process(name: str) -> StrictResult:
    """tp=1, pp=1: the traced graph run with the model's weights against the model itself."""
    return check_on_rank(structure.build(name), structure.example_inputs(name), tp=1, loss_fn=structure.loss_fn(name))


class _Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.linspace(0.5, 1.5, 64)[:, None].expand(64, 32).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cache[: x.shape[1]]


class _Layer(nn.Module):
    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.rope, self.q, self.o = rope, nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(self.rope(self.q(x)))


class _SharedRopeLM(nn.Module):
    """The issue's repro: two layers built with the same ``Rope()`` instance."""

    def __init__(self) -> None:
        super().__init__()
        rope = _Rope()
        self.embed, self.layers, self.head = nn.Embedding(64, 32), nn.ModuleList([_Layer(rope), _Layer(rope)]), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_shared_module_buffer_is_bound_under_every_name() -> None:
    import autotp

    torch.manual_seed(0)
    model = _SharedRopeLM()
    ids = torch.randint(0, 64, (2, 8))
    result = check_on_rank(model, {"input_ids": ids, "labels": ids}, tp=1)
    assert result.passed, result.reason
    pm = autotp.parallelize(_SharedRopeLM(), tp=1, example_inputs={"input_ids": ids, "labels": ids})
    reads = [n for n in pm.graph_for(input_ids=ids, labels=ids).graph.nodes if n.op == "get_attr" and "rope" in str(n.target)]
    assert reads
    for node in reads:
        held = pm.graph_for(input_ids=ids, labels=ids).get_buffer(str(node.target))
        assert not isinstance(held, torch._subclasses.fake_tensor.FakeTensor), node.target


def test_function_with_its_own_backward_is_one_node_that_runs_it() -> None:
    """RoundSTE's derivative is zero almost everywhere, its backward the identity: equal grads
    mean the graph ran the Function's backward. The elementwise ones are pointwise nodes, the
    router (softmax over the experts) a whole node, and a Function whose backward is its
    forward's derivative is traced through."""
    for name in ("ste_activation", "clipped_ste", "quantized_weights"):
        targets = _targets(name)
        assert ops.ELEMENTWISE_FUNCTION in targets and ops.FUNCTION not in targets, name
        assert torch.Tag.pointwise in ops.ELEMENTWISE_FUNCTION.tags
        result = _equal_in_one_process(name)
        assert result.passed, f"{name}: {result.reason}"
    assert ops.FUNCTION in _targets("router_backward") and ops.ELEMENTWISE_FUNCTION not in _targets("router_backward")
    assert _equal_in_one_process("router_backward").passed


class _SplitSTE(torch.autograd.Function):
    """Two outputs, a non-tensor argument, a backward that is not the derivative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.round(x[..., :at]), torch.round(x[..., at:])

    @staticmethod
    def backward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat((a, b), dim=-1), None


class _FunctionLM(nn.Module):
    def __init__(self, act: Any) -> None:
        super().__init__()
        self.embed, self.up, self.down, self.head = nn.Embedding(64, 32), nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 64)
        self.act = act

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.down(self.act(self.up(self.embed(input_ids)))))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _split(x: torch.Tensor) -> torch.Tensor:
    a, b = _SplitSTE.apply(x, 24)
    return torch.cat((b, a), dim=-1)


_round_ste = structure.RoundSTE.apply  # bound before the trace: the trace sees the call through forward


class _DampedTanh(_Tanh):
    """``_Tanh``'s forward, inherited, with a backward of its own (half the derivative): checked as
    itself, not as its base, whose backward is the forward's derivative."""

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return _Tanh.backward(ctx, grad * 0.5)


class _SometimesRecomputed(torch.autograd.Function):
    """Triples its input, under no_grad when asked (its backward then recomputes nothing, but
    matches only the derivative taken with grad left on): one call a recomputation, the other a
    derivative, so no one way of tracing fits both and it is kept whole."""

    @staticmethod
    def forward(ctx, x, without_grad):  # type: ignore[no-untyped-def]
        with torch.set_grad_enabled(not without_grad and torch.is_grad_enabled()):
            return x * 3

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * 3, None


def _both_kinds(x: torch.Tensor) -> torch.Tensor:
    return _SometimesRecomputed.apply(_SometimesRecomputed.apply(x, True), False)


@pytest.mark.parametrize(("act", "node"), [(_Tanh.apply, None), (_split, ops.FUNCTION), (_round_ste, ops.ELEMENTWISE_FUNCTION),
                                           (_DampedTanh.apply, ops.ELEMENTWISE_FUNCTION), (_both_kinds, ops.ELEMENTWISE_FUNCTION)])  # fmt: skip
def test_functions_traced_through_or_kept(act: Any, node: Any) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    targets = [n.target for n in trace(_FunctionLM(act), {"input_ids": ids, "labels": ids}).graph.nodes]
    assert (ops.FUNCTION in targets or ops.ELEMENTWISE_FUNCTION in targets) == (node is not None)
    if node is not None:
        assert node in targets
    result = check_on_rank(_FunctionLM(act), {"input_ids": ids, "labels": ids}, tp=1)
    assert result.passed, result.reason


def test_function_too_large_to_check_is_kept_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(function_checks, "_CHECK_NUMEL", 1)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    targets = [n.target for n in trace(_FunctionLM(_Tanh.apply), {"input_ids": ids, "labels": ids}).graph.nodes]
    assert ops.ELEMENTWISE_FUNCTION in targets


@pytest.mark.parametrize("name", ["fp32_qk_norm", "fp32_final_norm", "no_grad_scale"])
def test_grad_and_autocast_regions_are_inlined(name: str) -> None:
    targets = _targets(name)
    assert not set(targets) & REGIONS
    if name == "no_grad_scale":
        assert torch.ops.aten.detach.default in targets
    result = _equal_in_one_process(name)
    assert result.passed, result.reason


@pytest.mark.parametrize("name", ["checkpoint_reentrant", "checkpoint_nonreentrant", "checkpoint_by_hand"])
def test_activation_checkpointing_is_traced_as_the_call_and_carried(name: str) -> None:
    """Reentrant checkpointing runs its block under no_grad and recomputes it in backward:
    traced as it is, no parameter of the block would get a gradient. torch's two variants and a
    Function written by hand (handed the block's bound method and its parameters) are traced as
    the call, their nodes marked, and the plan recomputes the layers holding them."""
    import torch.utils.checkpoint as checkpoint_module

    model, inputs = library.build(name), library.example_inputs(name)
    generator = getattr(checkpoint_module, NON_REENTRANT_GENERATOR)
    gm = trace(model, inputs)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.detach.default not in targets
    assert not {ops.FUNCTION, ops.ELEMENTWISE_FUNCTION} & set(targets)
    assert "apply" not in CheckpointFunction.__dict__  # Function.apply again after the trace
    assert torch._C._set_grad_enabled is _SET_GRAD_ENABLED
    assert getattr(checkpoint_module, NON_REENTRANT_GENERATOR) is generator
    assert checkpointed_layers(gm) == tuple(range(num_layers(gm)))
    result = check_on_rank(model, inputs, tp=1)
    assert result.passed, result.reason


def test_inlined_autocast_region_is_refused_under_autocast() -> None:
    import autotp

    inputs = structure.example_inputs("fp32_final_norm")
    pm = autotp.parallelize(structure.build("fp32_final_norm"), tp=1, example_inputs=inputs)
    pm(**inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"Fp32FinalNormLM.*plain_models_structure.py.*torch.autocast"):
        pm(**inputs)


class _Bf16Island(nn.Module):
    """A bf16 autocast region: autocast changes the linear's dtype there, so the region stays."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mid, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.mid(h)
        logits = self.head(h.float())
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_autocast_region_that_changes_dtypes_is_kept() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    targets = [n.target for n in trace(_Bf16Island(), {"input_ids": ids, "labels": ids}).graph.nodes]
    assert torch.ops.higher_order.wrap_with_autocast in targets
    result = check_on_rank(_Bf16Island(), {"input_ids": ids, "labels": ids}, tp=1)
    assert result.passed, result.reason


def test_matmul_weights_are_the_weights_matmuls_read() -> None:
    gm = trace(structure.build("quantized_weights"), structure.example_inputs("quantized_weights"))
    weights = matmul_weights(gm)
    layer = {f"layers.0.{w}.weight" for w in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.up", "ffn.down")}
    assert layer <= weights  # ffn.up/down through the fake-quantization Function
    assert not {n for n in weights if n.endswith("bias") or "norm" in n} and "embed.weight" not in weights
    moe = trace(structure.build("moe_einsum_dispatch"), structure.example_inputs("moe_einsum_dispatch"))
    assert {"layers.0.ffn.w_in", "layers.0.ffn.w_out", "layers.0.ffn.gate.weight"} <= matmul_weights(moe)  # einsum reads


def test_strict_result_names_each_failure() -> None:
    ok = StrictResult(share=0.5, limit=0.65)
    assert ok.passed and ok.reason == ""
    heavy = StrictResult(share=0.7, limit=0.65, unexplained=("a.weight",))
    assert not heavy.passed and "70%" in heavy.reason and "a.weight" in heavy.reason
    both = combine([ok, heavy, StrictResult(mismatch="grad of b: differs", share=0.4, limit=0.65)])
    assert (both.share, both.unexplained, both.reason) == (0.7, ("a.weight",), "numerics: grad of b: differs")


class _EntropyWeightedLM(nn.Module):
    """Tokens weighted by the entropy of a distribution over a small head's logits, built with
    ``torch.distributions`` (BLT's patcher), whose argument checks branch on values."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mid, self.scorer, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 8), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.mid(self.embed(input_ids))
        entropy = torch.distributions.Categorical(logits=self.scorer(h)).entropy()
        logits = self.head(h * entropy[..., None])
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_distribution_argument_checks_are_left_out_of_the_trace() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    validating = torch.distributions.Distribution._validate_args
    trace(_EntropyWeightedLM(), {"input_ids": ids, "labels": ids})
    assert torch.distributions.Distribution._validate_args == validating  # restored after the trace
    result = check_on_rank(_EntropyWeightedLM(), {"input_ids": ids, "labels": ids}, tp=1)
    assert result.passed, result.reason


class _RunTimeSliceLM(nn.Module):
    """An MLP over the first tokens, how many known only at run time (``x[:, :k]`` with a
    tensor ``k``: BLT's patch lengths): a slice bound the trace holds as a node."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.up, self.down, self.head = nn.Embedding(64, 32), nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        u = self.up(h)[:, : (input_ids[:, 0] % 4).max() + 1]
        h = h + F.pad(self.down(F.gelu(u)), (0, 0, 0, h.shape[1] - u.shape[1]))
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _run_time_slice_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _run_time_slice_on_rank(rank: int, world: int) -> StrictResult:
    torch.manual_seed(0)
    return check_on_rank(_RunTimeSliceLM(), _run_time_slice_inputs(), tp=world)


def test_slice_bounds_known_at_run_time_leave_the_other_dims_split() -> None:
    from autotp.cost_model.tensor_parallel import plan_tensor_parallel
    from distributed import run_on_ranks

    torch.manual_seed(0)
    gm = trace(_RunTimeSliceLM(), _run_time_slice_inputs())
    assert any(isinstance(a, torch.fx.Node) for n in gm.graph.nodes if n.target == torch.ops.aten.slice.Tensor for a in n.args[2:])
    kinds = {p.name: p.kind for p in plan_tensor_parallel(gm, 2).params}
    assert kinds["up.weight"] == "column" and kinds["down.weight"] == "row", kinds
    result = combine(run_on_ranks(_run_time_slice_on_rank, 2, timeout_s=120))
    assert result.passed, result.reason


# ---- control flow on run-time values (autotp/analysis/trace_control_flow.py) -----------------


def test_loop_over_the_experts_hit_is_unrolled_with_the_spare_class_asserted_away() -> None:
    """``for e in expert_hit`` (a nonzero result) traces; ``gate_up[e]`` for the spare
    one-hot class is out of range, so that iteration becomes a run-time assertion."""
    import plain_models_wild as wild

    gm = trace(wild.build("expert_hit_loop"), wild.example_inputs("expert_hit_loop"))
    asserts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_async.msg]
    assert len(asserts) == 2 and all("index (4,)" in n.args[1] for n in asserts), [n.args for n in asserts]  # one per layer
    for name in ("expert_hit_loop", "argwhere_experts", "expert_hit_skip_empty", "reference_moe_counts"):
        result = check_on_rank(wild.build(name), wild.example_inputs(name), tp=1)
        assert result.passed, (name, result.reason)


class _MaskedWritesLM(nn.Module):
    """A loop over the channels whose mean is positive, whose body writes whether or not
    the channel is in the list: a dense ``add_``, a ``__setitem__`` and a ``mul_``. Unrolled
    over every channel, only the predicate keeps the channels not in the list from writing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.proj, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def positive(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(dim=(0, 1))[:8] > 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        out = self.proj(h)
        for c in self.positive(h).nonzero():
            out.add_(h * self.scale[c])
            out[:, 0] = out[:, 0] * 0.5
            out.mul_(1.25)
        logits = self.head(out)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_unrolled_iterations_not_in_the_list_write_nothing() -> None:
    torch.manual_seed(0)
    model, ids = _MaskedWritesLM(), torch.randint(0, 64, (2, 8))
    hit = model.positive(model.embed(ids))
    assert 0 < int(hit.sum()) < 8  # some iterations run, some must not
    result = check_on_rank(model, {"input_ids": ids, "labels": ids}, tp=1)
    assert result.passed, result.reason


class _LoopLM(nn.Module):
    """A body in each of the forms the unrolling refuses (``form``)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.embed, self.head = form, nn.Embedding(64, 32), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        out, ys = torch.zeros_like(h), []
        hit = (h.mean(dim=(0, 1)) > 0).nonzero()
        if self.form == "python values":
            for c in [int(c) for c in hit]:
                out[..., c] += h[..., c]
        else:
            for c in hit:
                if self.form == "break" and int(c) > 3:
                    break
                y = h * c
                ys.append(y)
                out += y
            if self.form == "escaping tensor":
                out = out + torch.stack(ys).sum(0)
        logits = self.head(out)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


@pytest.mark.parametrize(("form", "words"), [("break", "leaves it early"), ("escaping tensor", "is read after it"), ("python values", "writes no tensor in place")])
def test_loops_the_unrolling_cannot_keep_exact_are_refused(form: str, words: str) -> None:
    from autotp.ir.errors import UserInputError

    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(UserInputError, match=words) as raised:
        trace(_LoopLM(form), {"input_ids": ids, "labels": ids})
    assert "test_trace_constructs.py" in str(raised.value)  # the loop's line


class _NarrowExpertsLM(nn.Module):
    """Experts looped over the experts hit whose hidden size (6) tp=4 does not divide."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.router, self.head = nn.Embedding(32, 8), nn.Linear(8, 4), nn.Linear(8, 32)
        self.gate_up, self.down = nn.Parameter(torch.randn(4, 12, 8) * 0.3), nn.Parameter(torch.randn(4, 8, 6) * 0.3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids).flatten(0, 1)
        weights, chosen = self.router(x).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=4).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, rows = torch.where(mask[e[0]])
            gate, up = F.linear(x[rows], self.gate_up[e[0]]).chunk(2, -1)
            out.index_add_(0, rows, F.linear(F.silu(gate) * up, self.down[e[0]]) * weights[rows, slot, None])
        logits = self.head(x + out)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels.flatten())}


class _RowCountBranchLM(nn.Module):
    """A loop over the tokens present, each adding its rows unless it has ``skip`` rows:
    a branch on a row count inside an unrolled iteration."""

    def __init__(self, skip: int) -> None:
        super().__init__()
        self.skip, self.embed, self.head = skip, nn.Embedding(8, 16), nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids).flatten(0, 1)
        out = torch.zeros_like(h)
        for token in (F.one_hot(input_ids.flatten(), 8).sum(0) > 0).nonzero():
            rows = torch.where(input_ids.flatten() == token[0])[0]
            if rows.numel() == self.skip:
                continue
            out.index_add_(0, rows, h[rows] * 2)
        logits = self.head(h + out)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels.flatten())}


@pytest.mark.parametrize("skip", [0, 1])
def test_a_branch_skipping_an_iteration_is_traced_on_its_working_side(skip: int) -> None:
    """``if rows.numel() == skip: continue`` is traced on the side that goes on; its writes
    are masked by the branch's condition at run time, so the tokens that occur once are
    skipped (``skip=1``) as the model skips them."""
    ids = torch.tensor([[0, 1, 1, 2, 2, 2, 3, 3]])
    torch.manual_seed(0)
    result = check_on_rank(_RowCountBranchLM(skip), {"input_ids": ids, "labels": ids}, tp=1)
    assert result.passed, result.reason


class _BranchLM(nn.Module):
    """A branch on a row count, in each form the tracing takes (``form``) or refuses."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.embed, self.head = form, nn.Embedding(8, 16), nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids).flatten(0, 1)
        rows = torch.where(input_ids.flatten() < 2)[0]
        if self.form == "body":
            if rows.numel():
                h.mul_(1.5)
        elif self.form == "both sides":
            if rows.numel() > 0:
                h = h * 2
            else:
                h = h * 3
        elif self.form == "and":
            for k in range(2):
                if rows.numel() == 0 and k == 0:
                    continue
                h.add_(1.0)
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels.flatten())}


def test_a_branch_whose_body_works_is_masked_by_its_condition() -> None:
    ids = torch.tensor([[0, 1, 5, 6], [7, 5, 6, 7]])
    torch.manual_seed(0)
    assert check_on_rank(_BranchLM("body"), {"input_ids": ids, "labels": ids}, tp=1).passed
    torch.manual_seed(0)
    none = torch.tensor([[2, 3, 5, 6], [7, 5, 6, 7]])  # no rows: the body's write masked
    assert check_on_rank(_BranchLM("body"), {"input_ids": none, "labels": none}, tp=1).passed


class _SpecialTokensLM(nn.Module):
    """Tabular models' special tokens: where any id is negative, those tokens' embeddings are
    replaced by a rebinding, ``h = torch.where(special, table(ids), h)``, inside the branch;
    ``view`` rebinds ``h`` to a view of a tensor made before the branch instead, which cannot
    be written in place, and ``listed`` also appends the new ``h`` to a list: both refused."""

    def __init__(self, rebind: str = "where") -> None:
        super().__init__()
        self.rebind, self.embed, self.special, self.head = rebind, nn.Embedding(8, 16), nn.Embedding(2, 16), nn.Linear(16, 8)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        special = input_ids < 0
        h = self.embed(input_ids.clamp_min(0))
        both, kept = torch.stack([h, 2 * h]), [h]
        if special.any():
            if self.rebind == "view":
                h = both[1]
            elif self.rebind == "listed":
                h = h * 2
                kept.append(h)
            else:
                h = torch.where(special[..., None], self.special((input_ids + 1).abs().clamp_max(1)), h)
        logits = self.head(torch.stack(kept).mean(0) if self.rebind == "listed" else h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


@pytest.mark.parametrize("ids", [[[0, -1, 5, 6], [7, -2, 6, 7]], [[0, 1, 5, 6], [7, 5, 6, 7]]])
def test_a_name_rebound_in_a_branch_reads_what_the_run_takes(ids: list[list[int]]) -> None:
    """Traced once on the working side, the rebound ``h`` is written in place with
    ``where(any special, new, before)``: equal to the model with and without special tokens
    in the batch, in values and gradients (the special table gets none without them)."""
    ids_t = torch.tensor(ids)
    labels = ids_t.clamp_min(0)
    torch.manual_seed(0)
    result = check_on_rank(_SpecialTokensLM(), {"input_ids": ids_t, "labels": labels}, tp=1)
    assert result.passed, result.reason


@pytest.mark.parametrize("rebind", ["view", "listed"])
def test_a_name_rebound_in_a_branch_to_a_view_or_also_listed_is_still_refused(rebind: str) -> None:
    """A view of a tensor made before the branch cannot be written in place; a tensor the branch
    also appends to a list would stay in the list where the run skips the branch."""
    from autotp.ir.errors import UserInputError

    ids = torch.tensor([[0, -1, 5, 6]])
    with pytest.raises(UserInputError, match="is read after it"):
        trace(_SpecialTokensLM(rebind), {"input_ids": ids, "labels": ids.clamp_min(0)})


@pytest.mark.parametrize("form", ["both sides", "and"])
def test_branches_without_an_idle_side_or_with_combined_tests_still_fail_the_trace(form: str) -> None:
    from autotp.ir.errors import UserInputError

    ids = torch.tensor([[0, 1, 5, 6]])
    with pytest.raises(UserInputError, match="GuardOnDataDependentSymNode"):
        trace(_BranchLM(form), {"input_ids": ids, "labels": ids})


def test_a_conditional_expression_on_a_run_time_value_still_fails_the_trace() -> None:
    from autotp.ir.errors import UserInputError

    class SkipsEmpty(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = torch.where(x > 0)[0]
            return x if rows.numel() == 0 else x.index_add(0, rows, x[rows])

    with pytest.raises(UserInputError, match="GuardOnDataDependentSymNode"):
        trace(SkipsEmpty(), {"x": torch.randn(4)})


def test_counts_of_router_indices_have_the_experts_size() -> None:
    """``bincount(topk indices, minlength=E)`` has E entries (the indices are below E), so it
    is traced at that size; counts of other values keep the size the values give."""
    import plain_models_wild as wild

    gm = trace(wild.build("reference_moe_counts"), wild.example_inputs("reference_moe_counts"))
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.bincount.default not in targets and torch.ops.aten.scatter_add_.default in targets

    class CountsIds(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.bincount(ids.flatten(), minlength=4).float().sum()

    gm = trace(CountsIds(), {"ids": torch.tensor([[1, 7]])})
    assert torch.ops.aten.bincount.default in {n.target for n in gm.graph.nodes}


def _written_copy_on_rank(rank: int, world: int) -> StrictResult:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    return check_on_rank(_NarrowExpertsLM(), {"input_ids": ids, "labels": ids}, tp=world)


def test_an_accumulator_written_in_place_after_f_equals_the_model() -> None:
    """With gate_up whole, each rank adds its slice of the accumulator in place; f
    (``copy_to_tp``) returns its input as is, so it is cloned before that write."""
    from distributed import run_on_ranks

    result = combine(run_on_ranks(_written_copy_on_rank, 4, timeout_s=300))
    assert result.equal, result.reason


# ---- size-oblivious questions on sizes known only at run time (autotp/analysis/trace_sizes.py) ---


def _documents_on_rank(rank: int, world: int) -> tuple[StrictResult, str]:
    import plain_models_idioms as idioms
    from autotp.api import parallelize

    name = "document_loop_attention"
    result = check_on_rank(idioms.build(name), idioms.example_inputs(name), tp=world)
    pm = parallelize(idioms.build(name), tp=world, example_inputs=idioms.example_inputs(name))
    try:
        pm(**{**idioms.example_inputs(name), "cu_seqlens": torch.tensor([0, 5, 5, 16])})
    except RuntimeError as e:
        return result, str(e)
    return result, ""


def test_a_run_time_size_an_op_asks_about_is_assumed_nonzero_and_asserted() -> None:
    """``F.scaled_dot_product_attention`` on ``q[:, :, a:b]`` (bounds from ``cu_seqlens.tolist()``)
    asks whether the slice is empty: the trace answers no, once per slice, and the graph asserts it
    with the line; at tp=2 the model's numbers, and an empty document fails naming that line."""
    import plain_models_idioms as idioms

    gm = trace(idioms.build("document_loop_attention"), idioms.example_inputs("document_loop_attention"))
    attention = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(attention) == 6  # 3 documents x 2 layers: the calls that asked leave no node behind
    assumed = {n.args[1] for n in gm.graph.nodes if n.target == torch.ops.aten._assert_scalar.default and "nonzero" in n.args[1]}
    assert assumed and all("plain_models_idioms.py:" in m and "F.scaled_dot_product_attention(q[:, :, a:b]" in m for m in assumed)
    from distributed import run_on_ranks

    results = run_on_ranks(_documents_on_rank, 2, timeout_s=300)
    assert combine([r for r, _ in results]).passed, combine([r for r, _ in results]).reason
    for _, error in results:
        assert "plain_models_idioms.py:" in error and "is nonzero" in error and "this run's is 0" in error, error


@torch.library.custom_op("autotp_test::rows_unless", mutates_args=())
def _rows_unless(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.clone() if x.shape[0] != n else x[0].clone()


@_rows_unless.register_fake
def _(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape) if x.shape[0] != n else x.new_empty(x.shape[1:])


class _RowsUnless(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        a, b = bounds.tolist()
        return _rows_unless(x[a:b], self.n).sum()


def test_a_kernel_asking_whether_a_run_time_size_is_one_traces_it_as_not_one() -> None:
    """A kernel that asks whether a slice at run-time bounds has 1 row: the trace takes the
    size-oblivious side (not 1) and asserts it; asked about another number, it still fails."""
    from autotp.ir.errors import UserInputError

    inputs = {"x": torch.randn(8, 4), "bounds": torch.tensor([2, 6])}
    gm = trace(_RowsUnless(1), inputs)
    assert any("is not 1" in str(n.args[1]) for n in gm.graph.nodes if n.target == torch.ops.aten._assert_scalar.default)
    with pytest.raises(UserInputError, match="GuardOnDataDependentSymNode"):
        trace(_RowsUnless(4), inputs)


class _OnceInitializedCodebook(nn.Module):
    """A codebook that initializes itself from the first batch it sees (vector-quantize-pytorch's
    k-means init): ``if self.initted: return`` tests a buffer before the initialization."""

    def __init__(self, initted: bool) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(8, 16), nn.Linear(16, 8)
        self.codebook = nn.Parameter(torch.randn(4, 16))
        self.register_buffer("initted", torch.tensor(initted))

    def _init_codebook(self, h: torch.Tensor) -> None:
        if self.initted:
            return
        with torch.no_grad():
            self.codebook.copy_(h[:4])
        self.initted.fill_(True)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids).flatten(0, 1)
        self._init_codebook(h)
        q = self.codebook[torch.cdist(h, self.codebook).argmin(-1)]
        logits = self.head(h + (q - h).detach())
        return {"logits": logits, "loss": F.cross_entropy(logits, labels.flatten())}


def test_a_branch_on_a_buffer_takes_the_side_its_value_says_and_asserts_it() -> None:
    """The trace could not decide ``if self.initted:`` (a tensor's truth); the buffer's value at
    trace time decides it now, and the graph asserts it at every call. A model whose buffer sends
    it down the initialization is refused there (it writes a parameter)."""
    from autotp import parallelize
    from autotp.ir.errors import UserInputError

    ids = torch.tensor([[0, 1, 5, 6], [7, 5, 6, 7]])
    torch.manual_seed(0)
    assert check_on_rank(_OnceInitializedCodebook(True), {"input_ids": ids, "labels": ids}, tp=1).passed
    pm = parallelize(_OnceInitializedCodebook(True), tp=1, example_inputs={"input_ids": ids, "labels": ids})
    pm.get_buffer("initted").fill_(False)
    with pytest.raises(RuntimeError, match=r"test_trace_constructs.py:\d+ \(if self.initted:\) was traced with its test on buffers initted = True"):
        pm(input_ids=ids, labels=ids)
    with pytest.raises(UserInputError, match="codebook"):
        parallelize(_OnceInitializedCodebook(False), tp=1, example_inputs={"input_ids": ids, "labels": ids})


class _RecomputedTables(nn.Module):
    """RoPE tables a forward recomputes when it finds them zeroed (MiniMind's guard against a meta-device
    init: ``if self.freqs_cos[0, 0] == 0:``): a branch on a value computed from a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(16, 32), nn.ModuleList(nn.Linear(32, 32) for _ in range(2)), nn.Linear(32, 16)
        self.register_buffer("cos", self._tables(), persistent=False)

    @staticmethod
    def _tables() -> torch.Tensor:
        return torch.cos(torch.arange(64.0)[:, None] / 10 ** torch.linspace(0, 2, 32))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        if self.cos[0, 0] == 0:
            self.cos = self._tables()
        for layer in self.mix:
            h = h + layer(h * self.cos[: h.shape[1]]).relu()
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _recomputed_tables_on_rank(rank: int, world: int, tp: int, pp: int) -> tuple[bool, str, tuple[str, ...]]:
    from autotp import parallelize

    ids = torch.tensor([[0, 1, 5, 6], [7, 5, 6, 7]])
    torch.manual_seed(0)
    result = check_on_rank(_RecomputedTables(), {"input_ids": ids, "labels": ids}, tp=tp, pp=pp)
    torch.manual_seed(0)
    pm = parallelize(_RecomputedTables(), tp=tp, pp=pp, example_inputs={"input_ids": ids, "labels": ids})
    return result.passed, result.reason, pm.plan.branch_buffers


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_branch_on_a_value_computed_from_buffers_takes_their_side(tp: int, pp: int) -> None:
    """The tested element is computed from the buffer; the trace takes the side its value gives,
    and a pipeline's microbatch trace (from the copy the model keeps) does too."""
    from distributed import run_on_ranks

    assert run_on_ranks(_recomputed_tables_on_rank, tp * pp, tp, pp, timeout_s=300) == [(True, "", ("cos",))] * (tp * pp)


def test_a_branch_on_a_value_computed_from_buffers_is_asserted_at_run_time() -> None:
    from autotp import parallelize

    ids = torch.tensor([[0, 1, 5, 6], [7, 5, 6, 7]])
    pm = parallelize(_RecomputedTables(), tp=1, example_inputs={"input_ids": ids, "labels": ids})
    pm.get_buffer("cos").zero_()
    with pytest.raises(RuntimeError, match=r"\(if self.cos\[0, 0\] == 0:\) was traced with its test on buffers cos = False"):
        pm(input_ids=ids, labels=ids)


class _HostReadLengths(nn.Module):
    """A mask sized by host reads of values the forward makes from its input's shape and a buffer
    (E2-TTS's ``max_seq_len = seq_len.max().item()`` of ``torch.full((batch,), seq_len)``, a margin
    read by ``int(self.margin)``): export would make the ``arange`` size a run-time value."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(16, 32), nn.ModuleList(nn.Linear(32, 32) for _ in range(2)), nn.Linear(32, 16)
        self.register_buffer("margin", torch.tensor(1))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        lens = torch.full((input_ids.shape[0],), input_ids.shape[1])
        keep = torch.arange(lens.max().item()) < (lens - int(self.margin))[:, None]
        h = self.embed(input_ids) * keep[..., None]
        for layer in self.mix:
            h = h + layer(h).relu()
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _host_read_lengths_on_rank(rank: int, world: int) -> tuple[bool, str, tuple[str, ...]]:
    from autotp import parallelize

    ids = torch.tensor([[0, 1, 5, 6], [7, 5, 6, 7]])
    torch.manual_seed(0)
    result = check_on_rank(_HostReadLengths(), {"input_ids": ids, "labels": ids}, tp=world)
    pm = parallelize(_HostReadLengths(), tp=world, example_inputs={"input_ids": ids, "labels": ids})
    return result.passed, result.reason, pm.plan.branch_buffers


def test_a_host_read_of_a_value_made_from_constants_and_buffers_is_that_value() -> None:
    from distributed import run_on_ranks

    assert run_on_ranks(_host_read_lengths_on_rank, 2, timeout_s=300) == [(True, "", ("margin",))] * 2


def test_a_host_read_of_a_buffer_is_asserted_at_run_time() -> None:
    from autotp import parallelize

    ids = torch.tensor([[0, 1, 5, 6], [7, 5, 6, 7]])
    pm = parallelize(_HostReadLengths(), tp=1, example_inputs={"input_ids": ids, "labels": ids})
    pm.get_buffer("margin").fill_(2)
    with pytest.raises(RuntimeError, match=r"the value read at .*test_trace_constructs.py:\d+ \(keep = .*\) was traced as buffers margin = 1"):
        pm(input_ids=ids, labels=ids)


_ROTARY_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}  # speechbrain's habit: rotary tables memoized by length


def _rotary_table(length: int, device: torch.device) -> torch.Tensor:
    if (length, device) not in _ROTARY_TABLES:
        positions = torch.arange(length, device=device, dtype=torch.float32)
        _ROTARY_TABLES[(length, device)] = torch.outer(positions, torch.linspace(0.1, 1.0, 8, device=device))
    return _ROTARY_TABLES[(length, device)]


class _MemoizedRotaryLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.qk, self.v, self.o, self.head = (nn.Embedding(32, 32), nn.Linear(32, 64), nn.Linear(32, 32),
                                                           nn.Linear(32, 32), nn.Linear(32, 32))  # fmt: skip

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        x = self.embed(input_ids)
        q, k = self.qk(x).view(b, s, 2, 4, 8).unbind(2)
        angles = _rotary_table(s, x.device)[:, None]
        q, k = q * angles.cos() + q.roll(1, -1) * angles.sin(), k * angles.cos() + k.roll(1, -1) * angles.sin()
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), self.v(x).view(b, s, 4, 8).transpose(1, 2), is_causal=True)
        logits = self.head(x + self.o(y.transpose(1, 2).reshape(b, s, 32)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _memoized_tables_on_rank(rank: int, world: int) -> list[str]:
    import copy

    from autotp import parallelize

    torch.manual_seed(0)
    model = _MemoizedRotaryLM()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    pm = parallelize(model, tp=world, example_inputs={"input_ids": ids, "labels": ids})
    fake = [key for key, t in _ROTARY_TABLES.items() if isinstance(t, torch._subclasses.FakeTensor)]
    mismatches = [f"fake tables left by the trace: {fake}"] if fake else []
    for length in (16, 12):  # the second length is traced again, and computes its own table
        batch = {"input_ids": ids[:, :length], "labels": ids[:, :length]}
        if not torch.allclose(pm(**batch), reference(**batch), rtol=1e-5, atol=1e-6):
            mismatches.append(f"loss at length {length}")
    return mismatches


def test_a_module_level_cache_the_trace_fills_is_left_as_it_was() -> None:
    """A memo of rotary tables at module level, keyed by length (speechbrain's RoPE): tracing filled
    it with fake tensors, so the unmodified model raised afterwards and the trace of a second
    length read the first trace's fake table as a constant ("reads ... which this rank does not
    hold"). Tracing now undoes its writes to the model's modules' global state."""
    from distributed import run_on_ranks

    for mismatches in run_on_ranks(_memoized_tables_on_rank, 2):
        assert not mismatches, mismatches


def _attrs_output_on_rank(rank: int, world: int) -> tuple[bool, str, str]:
    import attr

    @attr.define
    class ModelOutput:  # ESM 3's outputs are attrs classes, not dataclasses
        logits: torch.Tensor
        hidden: torch.Tensor | None = None

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mix, self.head = nn.Embedding(16, 32), nn.Linear(32, 64), nn.Linear(64, 16)

        def forward(self, input_ids: torch.Tensor) -> ModelOutput:
            h = self.mix(self.embed(input_ids)).relu()
            return ModelOutput(logits=self.head(h), hidden=h)

    from autotp import parallelize

    ids = torch.tensor([[0, 1, 5, 6], [7, 5, 6, 7]])
    torch.manual_seed(0)
    result = check_on_rank(Tagger(), {"input_ids": ids}, tp=2, loss_fn=lambda out: out.logits.square().mean())
    torch.manual_seed(0)
    out = parallelize(Tagger(), tp=2, example_inputs={"input_ids": ids})(input_ids=ids)
    return result.passed, result.reason, type(out).__name__


def test_a_forward_returning_an_attrs_class_is_traced_and_returns_it() -> None:
    from distributed import run_on_ranks

    assert run_on_ranks(_attrs_output_on_rank, 2, timeout_s=300) == [(True, "", "ModelOutput")] * 2
