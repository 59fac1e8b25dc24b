"""A None passed for a forward parameter that has no None default (MeshGPT's ``MeshTransformer.forward(*, vertices,
faces, codes=None)``, called with the codes and ``vertices=None, faces=None``) is an argument the call needs, not an
absent input: autotp keeps it in the call (it dropped every None, and the trace refused the inputs as unbound)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from distributed import run_on_ranks

VOCAB, DIM = 32, 16


class CodesLM(nn.Module):
    """Tokenizes its raw inputs unless it is given the codes; the raw inputs are required keywords."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, *, raw: torch.Tensor | None, codes: torch.Tensor | None = None) -> torch.Tensor:
        if codes is None:
            codes = raw.long() % VOCAB
        h = self.embed(codes)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), codes.roll(-1, 1).flatten())


def _inputs() -> dict[str, torch.Tensor | None]:
    return {"codes": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1)), "raw": None}


def test_a_none_for_a_required_keyword_reaches_the_forward() -> None:
    torch.manual_seed(0)
    model = CodesLM()
    pm = autotp.parallelize(model, tp=1, example_inputs=_inputs())
    torch.testing.assert_close(pm(**_inputs()), model(**_inputs()), rtol=0, atol=0)


def _strict(rank: int, world: int, tp: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    return check_on_rank(CodesLM(), _inputs(), tp=tp, pp=world // tp, loss_fn=lambda out: out).reason


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "pp2"])
def test_a_none_for_a_required_keyword_passes_the_strict_rule(tp: int) -> None:
    assert run_on_ranks(_strict, 2, tp) == [""] * 2

