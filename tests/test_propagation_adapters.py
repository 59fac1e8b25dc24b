"""Constructs of the ninth round of issue 27 (``tests/plain_models_adapters.py``): variances
over a sharded dim, RNN cells decomposed so their weights split, the check that keeps a
decomposition whose writes would be seen, and checks on the data traced as run-time
assertions. ``test_plain_suite`` checks the whole models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from autotp import parallelize
from autotp.analysis.trace import trace
from autotp.analysis.trace_decompose import _out_of_place
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.errors import UserInputError
from autotp.ir.plan import ParallelPlan
from distributed import run_on_ranks
from plain_models_adapters import DIM, VOCAB, build, example_inputs


def _plan(name: str, tp: int) -> ParallelPlan:
    return plan_tensor_parallel(trace(build(name), example_inputs(name)), tp)


def test_a_weight_standardized_over_a_sharded_dim_takes_a_reduced_variance() -> None:
    """``w.var(dim=1)`` of a row-parallel weight reduces over its split input dim: a tp-reduced
    mean and sum of squares, so the FFN splits (``var`` needed its dim whole: the FFN was kept
    whole, 79% of the model on a rank at tp=2)."""
    layouts = {p.name: (p.kind, p.dim) for p in _plan("weight_standardization", 4).params}
    assert layouts["layers.0.feed_forward.down.weight"] == ("row", 1)
    assert layouts["layers.0.feed_forward.gate.weight"] == ("column", 0)


def test_var_mean_and_std_mean_over_all_heads_keep_the_projection_split() -> None:
    """Before: ``var_mean`` had no rule and ``std_mean`` needed its dim whole, so qkv stayed whole."""
    split = {p.name for p in _plan("moment_qk_norm", 2).params}
    assert {"layers.0.attention.qkv.weight", "layers.0.attention.o.weight"} <= split


def test_a_gru_cell_is_decomposed_and_its_gates_split_per_hidden_unit() -> None:
    """``aten.gru_cell`` has no rule; its decomposition (which writes to the pieces of its own
    split in place) becomes out-of-place ops, and the weights split in three segments."""
    gm = trace(build("gru_gated_residual"), example_inputs("gru_gated_residual"))
    assert not any(n.target is torch.ops.aten.gru_cell.default for n in gm.graph.nodes)
    layouts = {p.name: p for p in plan_tensor_parallel(gm, 2).params}
    for name in ("weight_ih", "weight_hh"):
        p = layouts[f"layers.0.gates.0.{name}"]
        assert (p.kind, p.dim, p.sharding.segments) == ("column", 0, (64, 64, 64))


def test_a_decomposition_that_reads_a_value_after_writing_it_stays_whole() -> None:
    def writes_then_reads(x: torch.Tensor) -> torch.Tensor:
        parts = (x * 2).split(2)
        first = parts[0].sigmoid_()
        return first + parts[1]

    x = torch.randn(4)
    body = make_fx(writes_then_reads)(x)
    assert _out_of_place(body)
    torch.testing.assert_close(body(x), writes_then_reads(x), rtol=0, atol=0)
    assert not any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in body.graph.nodes)

    def reads_the_old_value(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        z = y[:2]
        z.sigmoid_()
        return y + 1  # sees the write through the view

    body = make_fx(reads_the_old_value)(torch.randn(4))
    assert not _out_of_place(body)
    assert any(n.target is torch.ops.aten.sigmoid_.default for n in body.graph.nodes)

    def writes_its_input(x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)

    assert not _out_of_place(make_fx(writes_its_input)(torch.randn(4)))


def _check(rank: int, world: int, name: str) -> str:
    from autotp.report.strict_rule import check_on_rank

    return check_on_rank(build(name), example_inputs(name), tp=world).reason


@pytest.mark.slow  # the plain suite's sweep checks these models at every degree; this is the same check at tp=2
def test_standardized_weights_and_gru_residuals_at_tp2_equal_the_unmodified_model() -> None:
    for name in ("weight_standardization", "gru_gated_residual"):
        assert run_on_ranks(_check, 2, name) == ["", ""], name


class _CheckedLM(nn.Module):
    """Input validation on the data: ``if ...: raise`` and ``assert``, which export cannot
    decide; and a branch on a tensor's truth that skips work."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.up, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, VOCAB)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if (input_ids >= VOCAB).any():
            raise ValueError("token ids out of range")
        assert (labels >= 0).all(), "negative labels"
        h = self.embed(input_ids)
        boost = torch.zeros_like(h)
        if (labels == 0).any():  # the work this branch does is masked where the run skips it
            boost += 0.5 * h
        h = h + boost + self.down(F.gelu(self.up(h)))
        return {"loss": F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())}


def test_checks_on_the_data_become_run_time_assertions() -> None:
    """Both checks used to fail the trace (a data-dependent guard); the trace holds one
    ``_assert_async`` each, no host read (``item``), and the branch runs masked."""
    inputs = example_inputs("forgetting_attention")
    gm = trace(_CheckedLM(), inputs)
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.aten._assert_async.msg) == 2
    assert torch.ops.aten.item.default not in targets
    pm = parallelize(_CheckedLM(), tp=1, example_inputs=inputs)
    reference = _CheckedLM()
    for labels in (inputs["labels"], torch.zeros_like(inputs["labels"])):
        got = pm(input_ids=inputs["input_ids"], labels=labels)["loss"]
        torch.testing.assert_close(got, reference(inputs["input_ids"], labels)["loss"], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"the check at .*\(if \(input_ids >= VOCAB\)\.any\(\):\) failed: raise ValueError\(.token ids out of range.\)"):
        pm(input_ids=inputs["input_ids"] + VOCAB, labels=inputs["labels"])
    with pytest.raises(RuntimeError, match=r"the check at .*assert \(labels >= 0\)\.all\(\).* failed: .negative labels."):
        pm(input_ids=inputs["input_ids"], labels=-inputs["labels"] - 1)


class _InnerGradientMemory(nn.Module):
    """A test-time memory (Titans): one gradient step of an associative loss in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.memory, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x, w = self.embed(input_ids), self.memory.weight
        (grad,) = torch.autograd.grad(((x @ w.t() - x) ** 2).mean(), w, create_graph=True)
        x = x + x @ (w - 0.1 * grad).t()
        return {"loss": F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())}


def test_a_gradient_taken_in_the_forward_is_refused_naming_the_line() -> None:
    """export computed it once on the trace's fake values and kept it as a constant: the
    parallel model returned fake tensors."""
    with pytest.raises(UserInputError, match=r"torch\.autograd\.grad\(.*the forward takes a gradient"):
        trace(_InnerGradientMemory(), example_inputs("forgetting_attention"))


class _WritesItsInput(nn.Module):
    """FSMT's habit: the forward cleans its ``input_ids`` in place before reading them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.up, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        input_ids.masked_fill_(input_ids == VOCAB - 1, 0)
        logits = self.head(F.gelu(self.up(self.embed(input_ids))))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _check_written_input(rank: int, world: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    inputs = example_inputs("forgetting_attention")
    inputs["input_ids"][:, ::3] = VOCAB - 1
    result = check_on_rank(_WritesItsInput(), inputs, tp=1, pp=world)
    assert not (inputs["input_ids"] == VOCAB - 1).any()  # the step wrote the caller's tensor, as the model does
    return result.reason


def test_a_forward_writing_its_input_trains_in_microbatches() -> None:
    """The microbatches were views of one tensor: the second one's write bumped the version
    counter the first one's saved ids share, and its backward failed (found on FSMT at pp=2)."""
    assert run_on_ranks(_check_written_input, 2) == ["", ""]
