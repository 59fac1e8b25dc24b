"""A ``loss_fn`` that the pieces of a split batch cannot average is refused (``analysis.loss_fn_rows``);
one that is a mean over the rows trains as the whole batch does."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.ir.errors import UserInputError

DIM, ROWS = 8, 4


class TwoTowers(nn.Module):
    """CLIP's shape: normalized features of two inputs, and a learned temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1), self.scale.exp()


class PooledTowers(nn.Module):
    """Image features pooled by a learned query attending to each image's patches (CoCa's attention pooler),
    returned features first (``[D, B]``), so that only the walk can find their rows."""

    def __init__(self) -> None:
        super().__init__()
        self.patches, self.text = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.query = nn.Parameter(torch.randn(1, 1, DIM))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        patches = self.patches(image.view(image.shape[0], 2, DIM // 2).repeat(1, 1, 2)).unsqueeze(1)
        pooled = F.scaled_dot_product_attention(self.query.expand(image.shape[0], 1, 1, DIM), patches, patches)
        return pooled.flatten(1).t(), self.text(text), torch.tensor(2.0)


class SequenceFirst(nn.Module):
    """Outputs whose rows lie on dim 1 (``[S, B, D]``, as labml's transformers)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).transpose(0, 1)


def contrastive(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    image, text, scale = out
    logits = scale * image @ text.t()
    target = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"image": torch.randn(ROWS, DIM, generator=gen), "text": torch.randn(ROWS, DIM, generator=gen)}


@pytest.mark.parametrize("loss_fn, why", [
    (contrastive, "mixes the rows of its batch at node 'matmul'"),
    (lambda out: (out[0] * out[1]).sum(), "sums over the rows of its batch"),
    (lambda out: (out[0] * out[1]).sum() / 16, "sums over the rows of its batch"),
    (lambda out: ((out[0] - out[1]).square().sum(-1) * (out[0][:, 0] > 0)).sum() / (out[0][:, 0] > 0).sum(),
     "divides by a statistic of its batch's rows"),
    (lambda out: F.cross_entropy(out[0], (out[1][:, 0] > 0).long(), ignore_index=0),
     "divides by a statistic of its batch's rows at node 'cross_entropy_loss'"),
    # targets numbered across the batch (MusicGen's sweep loss at pp=2 was 0.86% off, silently)
    (lambda out: F.cross_entropy(out[0], torch.arange(out[0].shape[0]) % DIM), "numbers the positions of its batch's rows at node 'arange'"),
])  # fmt: skip
def test_a_loss_fn_the_pieces_cannot_average_is_refused_naming_why(loss_fn, why: str) -> None:
    torch.manual_seed(0)
    pm = autotp.parallelize(TwoTowers(), tp=1, example_inputs=_inputs())
    assert pm.plan.output_batch_dims == (0, 0, None)
    with pytest.raises(UserInputError, match=rf"loss_fn \(.*test_loss_fn_rows.py:\d+\) {why}.*num_microbatches=1"):
        pm.train_step(**_inputs(), loss_fn=loss_fn, num_microbatches=2)
    assert all(p.grad is None for p in pm.parameters())  # refused before any backward
    whole = pm.train_step(**_inputs(), loss_fn=loss_fn, num_microbatches=1)
    reference = TwoTowers()
    reference.load_state_dict(pm.unshard_state_dict())
    assert torch.allclose(whole, loss_fn(reference(**_inputs())), rtol=1e-5, atol=1e-6)


def test_rows_a_broadcast_query_gathers_from_each_row_are_found() -> None:
    """Before, attention kept rows only where the query held them too: the pooled features seemed every row's."""
    pm = autotp.parallelize(PooledTowers(), tp=1, example_inputs=_inputs())
    assert pm.plan.output_batch_dims == (1, 0, None)
    with pytest.raises(UserInputError, match=r"loss_fn \(.*\) mixes the rows of its batch"):
        pm.train_step(**_inputs(), loss_fn=lambda out: contrastive((out[0].t(), *out[1:])), num_microbatches=2)


def test_a_mean_over_the_rows_trains_split_as_the_whole_batch() -> None:
    torch.manual_seed(0)
    model = TwoTowers()
    reference = TwoTowers()
    reference.load_state_dict(model.state_dict())
    pm = autotp.parallelize(model, tp=1, example_inputs=_inputs())

    def mean_loss(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
        made_targets = torch.zeros(out[0].shape[0], dtype=torch.long)  # the same count in every piece
        return ((out[0] - out[1]).square().sum(-1).mean() * out[2] + (out[0] * out[1]).sum() / out[0].shape[0]
                + F.cross_entropy(out[0], made_targets))  # fmt: skip

    loss = pm.train_step(**_inputs(), loss_fn=mean_loss, num_microbatches=2)
    expected = mean_loss(reference(**_inputs()))
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_rows_on_a_later_dim_of_the_outputs_are_found() -> None:
    x = torch.randn(ROWS, 3, DIM, generator=torch.Generator().manual_seed(1))
    pm = autotp.parallelize(SequenceFirst(), tp=1, example_inputs={"x": x})
    assert pm.plan.output_batch_dims == (1,)
    with pytest.raises(UserInputError, match=r"loss_fn \(.*\) mixes the rows of its batch"):
        pm.train_step(x=x, loss_fn=lambda out: out.softmax(1).square().mean(), num_microbatches=2)
    pm.train_step(x=x, loss_fn=lambda out: out.softmax(0).square().mean(), num_microbatches=2)


class Reduced:
    """A loss object whose reduction is its own setting: two of one class may differ."""

    def __init__(self, reduction: str) -> None:
        self.reduction = reduction

    def __call__(self, out: tuple[torch.Tensor, ...]) -> torch.Tensor:
        distance = (out[0] - out[1]).square().sum(-1)
        return distance.mean() if self.reduction == "mean" else distance.sum()


def test_loss_objects_are_checked_one_by_one_and_not_kept() -> None:
    pm = autotp.parallelize(TwoTowers(), tp=1, example_inputs=_inputs())
    mean = Reduced("mean")
    pm.train_step(**_inputs(), loss_fn=mean, num_microbatches=2)
    with pytest.raises(UserInputError, match="sums over the rows of its batch"):
        pm.train_step(**_inputs(), loss_fn=Reduced("sum"), num_microbatches=2)
    held = weakref.ref(mean)
    del mean
    assert held() is None
