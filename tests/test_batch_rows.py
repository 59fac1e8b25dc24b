"""A forward whose rows depend on other rows of the batch is found (``analysis.batch_rows``)
and ``train_step`` refuses to split its batch; forwards that keep rows apart are not."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.analysis.batch_rows import batch_mixing_node
from autotp.analysis.trace import trace
from autotp.ir.errors import UserInputError

DIM, VOCAB, TOKENS = 16, 32, 8


class ExpertChoice(nn.Module):
    """Each expert takes its best tokens of the whole batch (``topk`` over the tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.expert = nn.Linear(DIM, 2, bias=False), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        weights, chosen = self.gate(tokens).softmax(-1).t().topk(TOKENS // 2, dim=-1)
        y = self.expert(tokens[chosen]) * weights.unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, chosen.reshape(-1), y.reshape(-1, DIM)).view(x.shape)


class TokenChoice(nn.Module):
    """Each token picks its expert (``topk`` over the experts) and attends within its row."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.qkv = nn.Linear(DIM, 2, bias=False), nn.Linear(DIM, 3 * DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        weight, chosen = self.gate(x).softmax(-1).topk(1, dim=-1)
        return x + sum(e(x) * weight * (chosen == i) for i, e in enumerate(self.experts))


class BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


class ScaledByBatchAmax(nn.Module):
    """Dynamic quantization's scale: the activation over its own ``amax()``, which the rows share."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h / h.detach().abs().amax().clamp(min=1e-6)


class BatchNormByHand(nn.Module):
    """``(x - mean) / std`` over the batch and sequence dims, written with ``mean`` and ``var``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(dim=(0, 1), keepdim=True)) * torch.rsqrt(x.var(dim=(0, 1), keepdim=True) + 1e-5)


class PerRowStatistics(nn.Module):
    """Statistics over each row's own tokens, and a mean over the rows that only reaches the
    loss (an auxiliary term): the rows stay apart."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h / h.abs().amax(dim=(1, 2), keepdim=True) - h.mean(dim=1, keepdim=True)


class LM(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.embed, self.mixer, self.head = nn.Embedding(VOCAB, DIM), mixer, nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.mixer(self.embed(input_ids)))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randint(0, VOCAB, (2, TOKENS), generator=gen) for name in ("input_ids", "labels")}


@pytest.mark.parametrize(
    ("mixer", "training", "mixing_op"),
    [(ExpertChoice, False, "topk"), (TokenChoice, False, ""), (BatchNormed, True, "batch_norm"), (BatchNormed, False, ""),
     (ScaledByBatchAmax, False, "statistic over the batch's rows (node 'amax'"), (BatchNormByHand, False, "statistic over the batch's rows (node 'mean'"),
     (PerRowStatistics, False, "")],  # fmt: skip
)
def test_ops_that_weigh_rows_against_each_other_are_found(mixer: type[nn.Module], training: bool, mixing_op: str) -> None:
    model = LM(mixer()).train(training)
    found = batch_mixing_node(trace(model, _inputs()), batch=2)
    if mixing_op:
        assert mixing_op in found and "mixer" in found, found
    else:
        assert found == ""


class RowsMixedBy(nn.Module):
    """``x`` [batch, tokens, dim] through ``fn``: an op that reads other rows than its own."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.proj, self.fn = nn.Linear(DIM, DIM), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.proj(x))


@pytest.mark.parametrize(
    ("fn", "mixing_op"),
    [
        (lambda x: x + torch.roll(x, 1, dims=0), "roll"),  # each row paired with the next (shifted negatives)
        (lambda x: x + x.flip(0), "flip"),
        (lambda x: 0.7 * x + 0.3 * x[torch.tensor([1, 0])], "index"),  # mixup by a fixed permutation
        (lambda x: 0.7 * x + 0.3 * x[torch.randperm(x.shape[0])], "index"),
        (lambda x: x + torch.cdist(x.mean(1), x.mean(1)).mean(-1)[:, None, None], "cdist"),
        (lambda x: x + (x.mean(1)[:, None] - x.mean(1)[None]).pow(2).sum(-1).mean(-1)[:, None, None], "sub"),
        (lambda x: x + F.cosine_similarity(x.mean(1)[:, None], x.mean(1)[None], dim=-1).sum(-1)[:, None, None], "cosine_similarity"),
        (lambda x: x.cumsum(0), "cumsum"),
        (lambda x: x + x[torch.arange(x.shape[0]), -1][:, None], ""),  # each row's last token: its own row
        (lambda x: x + torch.cdist(x, torch.ones(4, DIM)).softmax(-1) @ torch.ones(4, DIM), ""),  # distances to a codebook
        # pieces of the rows taken by slicing (``analysis.row_pieces``)
        (lambda x: x + torch.cat([x[1:], x[:1]]), "cat"),  # a shift by slices and cat
        (lambda x: x + torch.cat([x.narrow(0, 1, 1), x.narrow(0, 0, 1)]), "cat"),
        (lambda x: torch.cat(list(x.split(1))[::-1]), "cat"),
        (lambda x: torch.stack(list(reversed(x.unbind(0)))), "stack"),
        (lambda x: x - x[0], "sub"),  # every row against the first
        (lambda x: x - x[:1], "sub"),
        (lambda x: torch.cat([a * b for a, b in [x.chunk(2)]] * 2), "mul"),  # rows paired by halves
        (lambda x: torch.stack([x[b] * x.new_ones(DIM).cumsum(0)[b] for b in range(x.shape[0])]), "stack"),  # by the row's position
        (lambda x: torch.roll(torch.stack([u * 2 for u in x.unbind(0)]), 1, 0), "roll"),  # rows found again after a loop
        (lambda x: torch.stack([x[b].softmax(-1) for b in range(x.shape[0])]), ""),  # a loop over the rows
        (lambda x: torch.cat([x[b : b + 1].softmax(-1) for b in range(x.shape[0])]), ""),
        (lambda x: torch.cat([c.softmax(-1) for c in x.chunk(2)]), ""),
        (lambda x: x + torch.zeros_like(x[0]), ""),  # the first row's shape only
        (lambda x: x + x[: x.shape[0]], ""),
        # writes by a permutation, windows, padding and convolutions along the rows
        (lambda x: torch.zeros_like(x).index_put((torch.tensor([1, 0]),), x), "index_put"),
        (lambda x: torch.zeros_like(x).index_copy(0, torch.tensor([1, 0]), x), "index_copy"),
        (lambda x: torch.zeros_like(x).scatter(0, torch.tensor([1, 0])[:, None, None].expand_as(x), x), "scatter"),
        (lambda x: torch.take(x, torch.arange(x.numel()).flip(0)).view_as(x), "take"),
        (lambda x: x.unfold(0, 2, 1).mean(-1).repeat(2, 1, 1), "unfold"),
        (lambda x: F.pad(x, (0, 0, 0, 0, 1, 0))[:-1], "pad"),
        (lambda x: x + F.conv1d(x.mean(1).t()[None], torch.ones(DIM, 1, 2), padding=1, groups=DIM)[0, :, :2].t()[:, None], "conv1d"),
        (lambda x: F.pad(x, (0, 0, 1, 0))[:, :-1], ""),  # a shift along the sequence
        (lambda x: x + x.movedim(0, 1).cumsum(0).movedim(1, 0), ""),
        (lambda x: x + x.movedim(0, 1).cumsum(1).movedim(1, 0), "cumsum"),
        # order statistics and norms over the rows
        (lambda x: x - x.median(0, keepdim=True).values, "median"),
        (lambda x: x - torch.quantile(x, 0.5, dim=0, keepdim=True), "quantile"),
        (lambda x: x - x.round().mode(0, keepdim=True).values, "mode"),
        (lambda x: x.sort(0).values, "sort"),
        (lambda x: x - torch.var_mean(x, 0, keepdim=True)[1], "sub"),  # var_mean.dim, the overload with ``unbiased``
        (lambda x: F.layer_norm(x.transpose(0, 2), (2,)).transpose(0, 2), "layer_norm"),
        (lambda x: F.group_norm(x.transpose(0, 1), 1).transpose(0, 1), "group_norm"),
        (lambda x: F.instance_norm(x.transpose(0, 1)).transpose(0, 1), ""),  # over each row's features
        # rows of a 1-D tensor through unsqueeze(-1), and of one_hot (twelfth round)
        (lambda x: x - x.amax(-1).flatten().unsqueeze(-1).mean(0).view(1, 1, 1), "sub"),
        (lambda x: x * F.one_hot(x.argmax(-1), DIM).float().mean((0, 1)), "mul"),
        (lambda x: x * F.one_hot(x.argmax(-1), DIM).float(), ""),  # each row's own
        (lambda x: x @ (x.flatten(0, 1).t() @ x.flatten(0, 1)) / 16, "matmul"),  # a Gram matrix over the rows meets them
        (lambda x: x + (x.flatten(0, 1).t() @ x.flatten(0, 1)).sum(), "add"),
    ],
)
def test_ops_that_read_other_rows_are_found(fn: Callable[[torch.Tensor], torch.Tensor], mixing_op: str) -> None:
    """Before, the walk lost the rows at each of these ops and stopped looking: a split batch
    computed other numbers, silently."""
    found = batch_mixing_node(trace(LM(RowsMixedBy(fn)), _inputs()), batch=2)
    if mixing_op:
        assert f"({mixing_op}." in found and "mixer" in found, found
    else:
        assert found == ""


class ChunkedLoss(nn.Module):
    """The loss summed chunk by chunk over the tokens (Liger's idiom), the chunks' losses
    stacked first, or the loss of the first row only."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.embed, self.head, self.form = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB), form

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.form == "first_row":
            return {"loss": F.cross_entropy(self.head(self.embed(input_ids))[0], labels[0])}
        h, flat = self.embed(input_ids).flatten(0, 1), labels.flatten()
        chunks = [F.cross_entropy(self.head(h[rows]), flat[rows], reduction="sum") for rows in (slice(0, 6), slice(6, 12), slice(12, 16))]
        loss = torch.stack(chunks).sum() if self.form == "stacked" else sum(chunks, h.new_zeros(()))
        return {"loss": loss / flat.numel()}


@pytest.mark.parametrize(("form", "mixing_op"), [("summed", ""), ("stacked", ""), ("first_row", "select")])
def test_a_loss_over_pieces_of_the_rows_must_cover_every_row(form: str, mixing_op: str) -> None:
    found = batch_mixing_node(trace(ChunkedLoss(form), _inputs()), batch=2)
    assert (f"({mixing_op}." in found) if mixing_op else found == "", found


def test_train_step_refuses_to_split_a_batch_whose_rows_mix() -> None:
    torch.manual_seed(0)
    model = LM(ExpertChoice()).eval()
    pm = autotp.parallelize(model, tp=1, example_inputs=_inputs())
    assert "topk" in pm.plan.batch_mixing
    with pytest.raises(UserInputError, match=r"mixes the rows of its batch at node 'topk'.*num_microbatches=1"):
        pm.train_step(**_inputs(), num_microbatches=2)
    loss = pm.train_step(**_inputs(), num_microbatches=1)
    assert torch.allclose(loss, model(**_inputs())["loss"], rtol=1e-5, atol=1e-6)


def test_the_given_model_is_freed_by_reference_counting() -> None:
    """The walks store the conflicts they meet; a conflict's traceback would hold the frames of
    ``parallelize`` and so the caller's model until the garbage collector runs (GiBs on a GPU)."""
    model = LM(TokenChoice())
    weight = weakref.ref(model.embed.weight)
    gc.collect()
    gc.disable()
    try:
        pm = autotp.parallelize(model, tp=1, example_inputs=_inputs())
        del model
        assert weight() is None
    finally:
        gc.enable()
    assert pm.plan.batch_mixing == ""


class ConvTokens(nn.Module):
    """A convolution stem in eval mode whose feature map becomes tokens (``flatten(2).transpose(1, 2)``, as LeViT)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.randn(8))
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.bn(self.conv(x)).flatten(2).transpose(1, 2)
        return self.head((tokens * self.scale).mean(1))  # its backward hands the norm a channels-last gradient


def test_a_split_step_of_single_samples_through_a_batch_norm_equals_the_whole_batch() -> None:
    """torch's CPU batch-norm backward reads a gradient with channels-last strides as if it were contiguous when the
    batch has one sample (torch 2.11 and 2.13; CUDA is right): a step split into microbatches of one got the stem's
    gradients wrong. The rank graph hands the norm a contiguous gradient (``passes/contiguous_norm_grads``)."""
    torch.manual_seed(0)
    model = ConvTokens().eval()
    x = torch.randn(2, 3, 8, 8)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:  # every sample's class is 3: the same loss whatever the rows
        return F.cross_entropy(out, torch.full((out.shape[0],), 3))

    reference = copy.deepcopy(model)
    loss_fn(reference(x)).backward()
    pm = autotp.parallelize(model, tp=1, example_inputs={"x": x})
    pm.train_step(x=x, loss_fn=loss_fn, num_microbatches=2)
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


class NormThenInplaceActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu_(self.bn(self.conv(x))).mean()


def test_a_norm_output_written_in_place_trains() -> None:
    torch.manual_seed(0)
    model = NormThenInplaceActivation().eval()
    x = torch.randn(2, 3, 4, 4)
    reference = copy.deepcopy(model)
    reference(x).backward()
    pm = autotp.parallelize(model, tp=1, example_inputs={"x": x})
    pm.train_step(x=x, loss_fn=lambda out: out, num_microbatches=2)
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
