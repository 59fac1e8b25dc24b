"""Random draws of the forward under pipelines and split steps (``autotp.ir.batch_draws``,
``passes/batch_draws``): every stage and every piece takes its part of the numbers one process
draws for the whole batch, and the generator ends the step where that process's forward leaves
it (fp32, CPU, gloo)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_on_ranks
from torch import nn

import autotp
from autotp.compiler import lower_signature
from autotp.ir import meta_keys
from autotp.ir.batch_draws import BATCH_DRAW
from autotp.ir.errors import UserInputError

VOCAB, DIM, SEQ = 32, 16, 6


class NoisyLayer(nn.Module):
    """Every kind of draw the pass replays: noise by size (``randn_like``), units of a tensor of
    probabilities (``bernoulli(p)``), ``normal(mean, std)`` of tensors, a per-sample keep mask
    filled in place (``new_empty(...).bernoulli_(0.8)``), an MAE's shuffle by ``argsort`` of
    ``rand``, and one scalar for the whole batch (``torch.rand(())``)."""

    def __init__(self, units: bool = True) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.units = units

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h + 0.1 * torch.randn_like(h)
        if self.units:
            h = h + torch.bernoulli(torch.sigmoid(h)).detach() * 0.1
        h = torch.normal(h, 0.05 + h.abs().detach() * 0.01)
        keep = x.new_empty(x.shape[0], 1, 1).bernoulli_(0.8)
        order = torch.rand(x.shape[0], x.shape[1], device=x.device).argsort(dim=1)
        shuffled = torch.gather(x, 1, order[..., None].expand_as(x))
        return x + keep * self.down(F.gelu(h)) * (1 + torch.rand(())) + 0.1 * shuffled


class NoisyLM(nn.Module):
    def __init__(self, units: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.layers, self.head = nn.Embedding(VOCAB, DIM), nn.ModuleList(NoisyLayer(units) for _ in range(4)), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class RandomlyMaskedLM(nn.Module):
    """A loss over the tokens two random masks keep, divided by their count: one drawn per token
    (``rand < 0.5``), one an MAE's (``ones(b, n)`` with its first half zeroed, shuffled by
    ``argsort`` of ``rand``). A piece's count reads its own draws."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.layer, self.head = nn.Embedding(VOCAB, DIM), NoisyLayer(units=False), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.layer(self.embed(input_ids)))
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
        kept = (torch.rand(labels.shape, device=labels.device) < 0.5).float()
        shuffled = torch.ones(labels.shape, device=labels.device)
        shuffled[:, : labels.shape[1] // 2] = 0
        kept = kept * torch.gather(shuffled, 1, torch.rand(labels.shape, device=labels.device).argsort(dim=1))
        return {"logits": logits, "loss": (per_token * kept).sum() / kept.sum().clamp(min=1)}


MODELS = {"noisy": NoisyLM, "randomly_masked": RandomlyMaskedLM}


def _batch(rows: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randint(0, VOCAB, (rows, SEQ), generator=gen) for k in ("input_ids", "labels")}


def _reference(model: nn.Module, batch: dict[str, torch.Tensor], seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Loss, grads and the generator's next number after the unmodified model's forward and backward."""
    torch.manual_seed(seed)
    loss = model(**batch)["loss"]
    loss.backward()
    after = torch.rand(4, device=loss.device)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, after


def _step(rank: int, world: int, tp: int, pp: int, microbatches: int, options: dict[str, Any], model_name: str = "noisy") -> dict[str, Any]:
    model, batch = MODELS[model_name]().eval(), _batch()
    reference = copy.deepcopy(model)
    kwargs = dict(options)
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs={k: v[:2] for k, v in batch.items()}, **kwargs)
    loss_ref, grads_ref, after_ref = _reference(reference, batch, seed=5)
    torch.manual_seed(5)
    loss = pm.train_step(**batch, num_microbatches=microbatches)
    after = torch.rand(4)
    grads = pm.unshard_grads()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for name, want in grads_ref.items():  # torch.normal gives the up projections a zero gradient, not none
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(after, after_ref, rtol=0, atol=0)
    if pp > 1:  # a pipelined forward draws as the unmodified forward too
        torch.manual_seed(6)
        with torch.no_grad():
            want = reference(**batch)["logits"]
        torch.manual_seed(6)
        with torch.no_grad():
            torch.testing.assert_close(pm(**batch)["logits"], want, rtol=1e-5, atol=1e-6)
    return {"grads": len([g for g in grads.values() if g is not None])}


@pytest.mark.parametrize(("world", "tp", "pp", "microbatches"), [(1, 1, 1, 4), (2, 1, 2, 2), (2, 2, 1, 2), pytest.param(2, 1, 1, 2, marks=pytest.mark.slow)])
def test_a_split_step_draws_the_whole_batch_s_numbers(world: int, tp: int, pp: int, microbatches: int) -> None:
    """One process with 4 microbatches, pp=2, tp=2 and dp=2 (each with 2 microbatches): the loss,
    every gradient and the generator afterwards equal the unmodified model's on the whole batch."""
    results = run_on_ranks(_step, world, tp, pp, microbatches, {})
    assert all(r["grads"] for r in results)


@pytest.mark.parametrize(("world", "tp", "pp", "microbatches"), [(1, 1, 1, 4), (2, 1, 2, 2), (2, 1, 1, 2)])
def test_a_piece_divides_by_the_whole_batch_s_count_of_its_random_mask(world: int, tp: int, pp: int, microbatches: int) -> None:
    """The count a loss divides by reads random masks: each piece's count is taken from the draws
    its forward takes, and the loss is the whole batch's (not the pieces' counts summed twice)."""
    results = run_on_ranks(_step, world, tp, pp, microbatches, {}, "randomly_masked")
    assert all(r["grads"] for r in results)


@pytest.mark.parametrize("options", [{"compile": "aot_eager"}, {"recompute": "full"}], ids=["compiled", "recomputed"])
def test_compiled_or_recomputed_pieces_draw_the_same_numbers(options: dict[str, Any]) -> None:
    """Compiled graphs call the op as eager ones do; a recomputed layer takes the piece its
    forward took again (the op's hand-out is replayed like the tp RNG streams)."""
    assert all(r["grads"] for r in run_on_ranks(_step, 2, 1, 2, 2, options))


def test_the_draws_become_ops_only_where_the_graph_runs_in_pieces() -> None:
    model, batch = NoisyLM().eval(), _batch(rows=2)
    pm = autotp.parallelize(model, tp=1, example_inputs=batch)
    assert not any(n.target is BATCH_DRAW for n in pm.graph_for(**batch).graph.nodes)
    program = lower_signature(model, batch, pm.plan, tp_rank=0, device=torch.device("cpu"), backend="gloo", split_batch=True)
    programs = program.graph.meta[meta_keys.BATCH_DRAWS]
    assert len(programs) == 4 * 6 and [p.rows for p in programs[:6]] == [0, 0, 0, 0, 0, None]  # torch.rand(()) has no rows


class Sampled(nn.Module):
    """``multinomial`` of the forward's own probabilities: no formula draws it apart from them."""

    def __init__(self, sampled_targets: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.sampled_targets = sampled_targets

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        picked = torch.multinomial(logits.detach().softmax(-1).flatten(0, 1), 1).view_as(labels)
        if self.sampled_targets:  # the loss's mean counts the targets, which the draw picks
            labels = torch.where(picked > VOCAB // 2, labels, picked)
        else:
            logits = logits + 0.1 * picked[..., None].to(logits.dtype)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_a_draw_it_cannot_replay_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model, batch = Sampled(sampled_targets=False).eval(), _batch(rows=4)
    pm = autotp.parallelize(model, tp=1, example_inputs=batch)
    with caplog.at_level("WARNING"):
        pm.train_step(**batch, num_microbatches=2)
    assert "multinomial" in caplog.text and "cannot draw for the whole batch" in caplog.text


def test_a_count_the_loss_divides_by_that_reads_such_a_draw_is_refused() -> None:
    model, batch = Sampled(sampled_targets=True).eval(), _batch(rows=4)
    pm = autotp.parallelize(model, tp=1, example_inputs=batch)
    with pytest.raises(UserInputError, match="multinomial.*num_microbatches=1"):
        pm.train_step(**batch, num_microbatches=2)
