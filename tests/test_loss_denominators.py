"""A loss normalized by the data, split over microbatches and dp ranks (``autotp.ir.batch_denominators``,
``autotp.analysis.loss_denominators``): ``train_step`` computes the whole batch's loss and
gradients when the pieces count different tokens (padding, ``ignore_index``, class weights, a
mask's sum), and refuses a split it cannot make exact (fp32, CPU)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from distributed import run_on_ranks
from small_models import build, vocab_size
from torch import nn

import autotp
from autotp.analysis.trace import trace
from autotp.ir.batch_denominators import BATCH_DENOMINATOR, whole_batch
from autotp.ir.errors import UserInputError

RTOL, ATOL = 1e-4, 1e-6
VOCAB, DIM = 32, 16
IGNORE = -100


class TinyLM(nn.Module):
    """An embedding and a head whose loss is ``loss(logits, labels)``."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, VOCAB)
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, VOCAB))
        self.loss = loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.mix(self.embed(input_ids))))
        flat, target = logits.reshape(-1, VOCAB), labels.reshape(-1)
        kept = (labels != IGNORE).float()
        per_token = F.cross_entropy(flat, target, reduction="none").view_as(labels)
        losses = {
            "mean": lambda: F.cross_entropy(flat, target),
            "class_weighted": lambda: F.cross_entropy(flat, target, weight=self.class_weight, label_smoothing=0.1),
            "masked_sum": lambda: (per_token * kept).sum() / kept.sum().clamp(min=1),
            "ratio_of_means": lambda: (per_token * kept).mean() / kept.mean(),
            "mean_plus_z_loss": lambda: F.cross_entropy(flat, target) + 1e-3 * logits.logsumexp(-1).pow(2).mean(),
            "by_max": lambda: per_token.sum() / labels.max(),
            "targets_written_in_place": lambda: F.cross_entropy(flat, self.shifted(labels).reshape(-1)),
            "mean_of_row_means": lambda: torch.stack([F.cross_entropy(row, t) for row, t in zip(logits, labels)]).mean(),
            "squared_batch_mean": lambda: F.cross_entropy(flat, target) + 1e-2 * (logits.mean(0) ** 2).sum(),
            "masked_select_mean": lambda: per_token.masked_select(labels != IGNORE).mean(),
            "bool_index_mean": lambda: per_token[labels != IGNORE].mean(),
            # each kept position selects a row of VOCAB losses (E2-TTS's loss[mask].mean() of a [b, n, d] loss)
            "bool_index_rows_mean": lambda: F.binary_cross_entropy_with_logits(
                logits, F.one_hot(target.clamp(min=0), VOCAB).view_as(logits).float(), reduction="none")[labels != IGNORE].mean(),
            "nonzero_index_mean": lambda: per_token[(labels != IGNORE).nonzero(as_tuple=True)].mean(),
            "summed": lambda: F.cross_entropy(flat, target, reduction="sum"),
            "summed_over_constant": lambda: F.cross_entropy(flat, target, reduction="sum") / 64.0,
            "summed_over_numel": lambda: F.cross_entropy(flat, target, reduction="sum") / labels.numel(),  # a mean of the piece
            "summed_over_numel_tensor": lambda: F.cross_entropy(flat, target, reduction="sum") / torch.tensor(float(labels.numel())),
        }
        return {"logits": logits, "loss": losses[self.loss]()}

    @staticmethod
    def shifted(labels: torch.Tensor) -> torch.Tensor:
        """Next-token targets written into a new tensor in place: the count reads the writes."""
        targets = labels.new_full(labels.shape, IGNORE)
        targets[:, :-1] = labels[:, 1:]
        return targets


def _batch(rows: int = 4, seq: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    labels[0, 1:] = IGNORE  # the first microbatch counts far fewer tokens than the second
    labels[1, 4:] = IGNORE
    return {"input_ids": ids, "labels": labels}


def _assert_whole_batch(pm: autotp.ParallelModel, reference: nn.Module, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
    expected = reference(**batch)["loss"]
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"grad of {name}: {m}")


LOSSES = ["mean", "class_weighted", "masked_sum", "ratio_of_means", "mean_plus_z_loss", "targets_written_in_place", "mean_of_row_means",
          "masked_select_mean", "bool_index_mean", "bool_index_rows_mean", "summed", "summed_over_constant", "summed_over_numel",
          "summed_over_numel_tensor"]


@pytest.mark.parametrize("microbatches", [2, 4], ids=["rows2", "rows1"])
@pytest.mark.parametrize("loss", LOSSES)
def test_microbatches_compute_the_whole_batch(loss: str, microbatches: int) -> None:
    """Pieces of two rows, and of one row (whose trace cannot tell a sum over the rows from a
    sum over one row: the rows come from a trace of the batch doubled). A mean of each row's
    own mean (mean_of_row_means) weighs rows alike and must stay as it is."""
    model = TinyLM(loss)
    reference = copy.deepcopy(model)
    batch = _batch()
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()})
    _assert_whole_batch(pm, reference, pm.train_step(**batch, num_microbatches=microbatches), batch)


@pytest.mark.parametrize("loss", ["mean", "class_weighted", "masked_sum"])
def test_a_microbatch_with_nothing_to_count_adds_nothing(loss: str) -> None:
    """Its own mean is NaN (0 / 0); the whole batch's loss and gradients are finite."""
    model = TinyLM(loss)
    reference = copy.deepcopy(model)
    batch = _batch()
    batch["labels"][:2] = IGNORE
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()})
    loss_value = pm.train_step(**batch, num_microbatches=2)
    assert loss_value.isfinite()
    _assert_whole_batch(pm, reference, loss_value, batch)


def test_an_hf_model_with_padded_labels_computes_the_whole_batch() -> None:
    model = build("llama")
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab_size(model), (4, 12), generator=gen)
    labels = ids.clone()
    labels[:2, 3:] = IGNORE  # short sequences, padded, in the first microbatch
    batch = {"input_ids": ids, "labels": labels}
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()})
    _assert_whole_batch(pm, reference, pm.train_step(**batch, num_microbatches=2), batch)


def test_compiled_graphs_take_the_whole_batch_denominator() -> None:
    """``torch.compile``'s graphs call the op each step (its value is set on the host)."""
    model = TinyLM("masked_sum")
    reference = copy.deepcopy(model)
    batch = _batch()
    pm = autotp.parallelize(model, tp=1, compile="aot_eager", example_inputs={k: v[:2] for k, v in batch.items()})
    pm.train_step(**{k: v.flip(0) for k, v in batch.items()}, num_microbatches=2)  # another split: other counts
    pm.zero_grad()
    _assert_whole_batch(pm, reference, pm.train_step(**batch, num_microbatches=2), batch)


def test_only_a_split_step_traces_the_denominators() -> None:
    model, batch = TinyLM("masked_sum"), _batch()
    plain, split = trace(model, batch), trace(model, batch, split_batch=True)
    assert not [n for n in plain.graph.nodes if n.target is BATCH_DENOMINATOR]
    assert len([n for n in split.graph.nodes if n.target is BATCH_DENOMINATOR]) == 1
    count = torch.tensor(7)
    assert BATCH_DENOMINATOR(count, "any").dtype == torch.float32 and BATCH_DENOMINATOR(count, "any").item() == 7.0  # outside a step: d
    with whole_batch({"any": torch.tensor(2.5, dtype=torch.float64)}):
        assert BATCH_DENOMINATOR(count, "any").item() == 2.5 and BATCH_DENOMINATOR(count, "other").item() == 7.0


def test_a_split_step_traces_the_batch_doubled_only_for_a_count_it_may_divide_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's masks start from ``arange(batch)``, a tensor made of no other with the batch's size,
    but no scalar without parameters is computed from it: the rows of such a tensor matter only
    to a loss's denominator, so the piece is traced once."""
    import autotp.analysis.trace as tracing

    doubled = []
    real = tracing._doubled
    monkeypatch.setattr(tracing, "_doubled", lambda *a: doubled.append(1) or real(*a))
    model = build("llama")
    ids = torch.randint(0, vocab_size(model), (2, 16), generator=torch.Generator().manual_seed(0))
    gm = trace(model, {"input_ids": ids, "labels": ids}, split_batch=True)
    assert any(n.target is torch.ops.aten.arange.default and n.meta["val"].shape == (2,) for n in gm.graph.nodes)
    assert doubled == []


@pytest.mark.parametrize(("loss", "named"), [("by_max", "div"), ("nonzero_index_mean", "each piece dividing by its own count")])
def test_a_denominator_that_does_not_split_is_refused(loss: str, named: str) -> None:
    """``per_token.sum() / labels.max()``, and ``loss[mask.nonzero(as_tuple=True)].mean()``, whose
    pieces would each divide by their own count (a wrong loss, silently, before): a split step is
    refused naming the op, a whole one trains."""
    model = TinyLM(loss)
    reference = copy.deepcopy(model)
    batch = _batch()
    pm = autotp.parallelize(model, tp=1, example_inputs=batch)
    assert named in pm.plan.batch_mixing and "statistic of the whole batch" in pm.plan.batch_mixing
    with pytest.raises(UserInputError, match="mixes the rows of its batch"):
        pm.train_step(**batch, num_microbatches=2)
    _assert_whole_batch(pm, reference, pm.train_step(**batch, num_microbatches=1), batch)


def _dp_local_batches(rank: int, world: int, loss: str) -> dict[str, Any]:
    model = TinyLM(loss)
    reference = copy.deepcopy(model)
    batch = _batch(rows=8)
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()})
    assert pm.plan.dp == world
    mine = {k: v[4 * rank : 4 * rank + 4] for k, v in batch.items()}  # rank 0's rows count fewer tokens
    _assert_whole_batch(pm, reference, pm.train_step(**mine, num_microbatches=2, batch_is_local=True), batch)
    return {"ok": True}


@pytest.mark.parametrize("loss", ["class_weighted", "masked_sum"])
def test_dp_ranks_with_their_own_batches_compute_the_whole_batch(loss: str) -> None:
    assert all(r["ok"] for r in run_on_ranks(_dp_local_batches, 2, loss))


def _hf_padded_dp_pp(rank: int, world: int) -> dict[str, Any]:
    model = build("llama")
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab_size(model), (8, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[:3, 5:] = 0  # padded rows, all in the first dp rank's half
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}
    pm = autotp.parallelize(model, tp=1, pp=2, dp=2, example_inputs={k: v[:2] for k, v in batch.items()})
    _assert_whole_batch(pm, reference, pm.train_step(**batch, num_microbatches=2), batch)
    return {"ok": True}


def test_an_hf_model_with_a_padded_batch_at_dp2_pp2_computes_the_whole_batch() -> None:
    """HF's Llama, ``attention_mask`` and ``-100`` on the padding, dp=2 x pp=2 x 2 microbatches:
    at the code before the rescaling the loss was 4.8885 against 4.8909 and every gradient off."""
    assert all(r["ok"] for r in run_on_ranks(_hf_padded_dp_pp, 4))


def test_a_loss_nonlinear_in_a_batch_statistic_is_computed_per_piece_and_said(caplog: pytest.LogCaptureFixture) -> None:
    """A penalty on the square of the mean over the rows (SPLADE's FLOPS regularizer; a
    router's load-balancing loss is a product of two such means): the mean of the pieces'
    penalties is not the whole batch's. The plan names the op, ``train_step`` says once that
    each piece computes it over its own rows, as Megatron computes router losses per
    microbatch, and that is what it computes."""
    model = TinyLM("squared_batch_mean")
    reference = copy.deepcopy(model)
    batch = {k: v.clamp(min=0) for k, v in _batch().items()}
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()})
    assert "pow" in pm.plan.batch_statistics and "mean" in pm.plan.batch_statistics, pm.plan.batch_statistics
    with caplog.at_level("WARNING"):
        loss = pm.train_step(**batch, num_microbatches=2)
    assert sum("computes that term over its own rows" in r.getMessage() for r in caplog.records) == 1
    pieces = [reference(**{k: v[i : i + 2] for k, v in batch.items()})["loss"] for i in (0, 2)]
    (sum(pieces) / 2).backward()
    torch.testing.assert_close(loss, (sum(pieces) / 2).detach(), rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=ATOL)
    assert not autotp.parallelize(TinyLM("mean"), tp=1, example_inputs=batch).plan.batch_statistics


def test_a_loss_over_a_count_the_caller_passes_sums_the_pieces() -> None:
    """HF's ``num_items_in_batch`` (what its Trainer passes under gradient accumulation): the
    loss is the summed token loss over that count, so the whole batch's loss is the sum of the
    pieces' losses. ``train_step`` averages its pieces: before, it returned and trained half the
    loss at two microbatches."""
    model = build("llama")
    reference = copy.deepcopy(model)
    batch = {"input_ids": torch.randint(0, vocab_size(model), (4, 16), generator=torch.Generator().manual_seed(2))}
    batch["labels"] = batch["input_ids"].clone()
    count = torch.tensor(float(4 * 15))
    pm = autotp.parallelize(model, tp=1, example_inputs={**{k: v[:2] for k, v in batch.items()}, "num_items_in_batch": count})
    loss = pm.train_step(**batch, num_items_in_batch=count, num_microbatches=2)
    expected = reference(**batch, num_items_in_batch=count).loss
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"grad of {name}: {m}")
