"""A forward that sets ``requires_grad`` of parameters (Flamingo's forward freezes its language
model whenever media are passed, and unfreezes it otherwise): each rank's parameters take the
values the forward leaves (``ParallelPlan.requires_grad_set``), so a part it freezes gets no
gradient, as in the unmodified model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.ir.plan import ParallelPlan
from distributed import run_on_ranks

VOCAB, DIM = 32, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class AdaptedLM(nn.Module):
    """A language model with an adapter mixing media features in: the forward trains only the
    adapter when media are passed (its other parameters frozen in the forward), all of it otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.adapter = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, media: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        for name, p in self.named_parameters():
            p.requires_grad = media is None or name.startswith("adapter.")
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0 and media is not None:
                h = h + self.adapter(media).tanh()
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _inputs(media: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, 8), generator=gen), "labels": torch.randint(0, VOCAB, (2, 8), generator=gen)}
    return inputs | ({"media": torch.randn(2, 8, DIM, generator=gen)} if media else {})


def _strict(rank: int, world: int, tp: int, pp: int, media: bool) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    return check_on_rank(AdaptedLM(), _inputs(media), tp=tp, pp=pp).reason


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parameters_the_forward_freezes_get_no_gradient(tp: int, pp: int) -> None:
    assert run_on_ranks(_strict, tp * pp, tp, pp, True) == [""] * (tp * pp)


def test_the_plan_records_the_flags_the_forward_leaves() -> None:
    torch.manual_seed(0)
    pm = autotp.parallelize(AdaptedLM(), tp=1, example_inputs=_inputs(media=True))
    frozen = dict(pm.plan.requires_grad_set)
    assert frozen and not any(frozen.values()) and not any(name.startswith("adapter.") for name in frozen)
    assert ParallelPlan.from_json(pm.plan.to_json()).requires_grad_set == pm.plan.requires_grad_set
    assert {n for n, p in pm.named_parameters() if p.requires_grad} == {"adapter.weight", "adapter.bias"}
    pm(**_inputs(media=True))["loss"].backward()
    assert pm.get_parameter("embed.weight").grad is None and pm.get_parameter("adapter.weight").grad is not None


def test_a_model_frozen_before_and_unfrozen_by_its_forward_trains_whole() -> None:
    torch.manual_seed(0)
    model = AdaptedLM().requires_grad_(False)
    pm = autotp.parallelize(model, tp=1, example_inputs=_inputs(media=False))
    assert all(dict(pm.plan.requires_grad_set).values())
    assert all(p.requires_grad for p in pm.parameters())
