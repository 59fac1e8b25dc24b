"""Constructs of Time-Series-Library's forecasting models (Informer, TimeMixer), at tp and pp under the
strict rule against the unmodified model:

* heads viewed into the time steps (Informer's ``context.contiguous().view(B, L, -1)`` of a
  ``[B, H, L, D]`` context): the head split lands on the time steps, so the output projection
  after it must not split its out features too (a rank would hold one block of a two-way split
  output; the loss was half the model's): the planner gathers the context or keeps the heads
  whole, and no tensor is split on two dims over one axis;
* ``.squeeze()`` of scores over 4 heads at tp=4 (one head a rank): each ``squeeze`` drops only
  the dims the trace squeezed;
* series flattened batch-major (``reshape(B * N, T, 1)``) added to their time features tiled
  (``repeat(N, 1, 1)``): a row meets another sample's, so the forward mixes its batch's rows and
  a pipeline trains the batch whole (the loss of two microbatches was 2% off)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_on_ranks

BATCH, SEQ, DIM, HEADS, SERIES = 2, 16, 32, 4, 8


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k and v as ``[B, H, L, D]``."""
        return tuple(p(x).view(x.shape[0], x.shape[1], HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))


class HeadsByTime(_Heads):
    """Attention whose ``[B, H, L, D]`` context is viewed as ``[B, L, H * D]`` without moving the heads back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        context = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return self.o(context.contiguous().view(x.shape[0], x.shape[1], -1))


class SqueezedScores(_Heads):
    """Each query's score against its own key, ``(q.unsqueeze(-2) @ k.unsqueeze(-1)).squeeze()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        scores = (q.unsqueeze(-2) @ k.unsqueeze(-1)).squeeze()  # [B, H, L]
        weighted = torch.softmax(scores, -1).unsqueeze(-1) * v
        return self.o(weighted.transpose(1, 2).reshape(x.shape))


class TiledTimeFeatures(nn.Module):
    """Each series embedded apart (channel independence) plus time features repeated per series."""

    def __init__(self) -> None:
        super().__init__()
        self.value, self.time, self.head = nn.Linear(1, DIM), nn.Linear(4, DIM), nn.Linear(SEQ * DIM, 8)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
        b, t, n = x.shape
        h = self.value(x.permute(0, 2, 1).reshape(b * n, t, 1)) + self.time(marks.repeat(n, 1, 1))
        for layer in self.layers:
            h = h + layer(h).relu()
        return self.head(h.reshape(b * n, -1)).reshape(b, n, -1)


MODELS = {"heads_by_time": HeadsByTime, "squeezed_scores": SqueezedScores, "tiled_time_features": TiledTimeFeatures}


def _inputs(name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "tiled_time_features":
        return {"x": torch.randn(BATCH, SEQ, SERIES, generator=gen), "marks": torch.rand(BATCH, SEQ, 4, generator=gen) - 0.5}
    return {"x": torch.randn(BATCH, SEQ, DIM, generator=gen)}


def _strict(rank: int, world: int, name: str, tp: int, pp: int) -> tuple[str, str, str]:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    r = check_on_rank(MODELS[name](), _inputs(name), tp=tp, pp=pp, loss_fn=lambda out: out.square().mean())
    return r.error, r.mismatch, r.reason


@pytest.mark.parametrize(("name", "tp", "pp"), [("heads_by_time", 2, 1), ("heads_by_time", 4, 1), ("squeezed_scores", 4, 1),
                                                ("tiled_time_features", 1, 2)])  # fmt: skip
def test_forecasting_constructs_pass_the_strict_rule(name: str, tp: int, pp: int) -> None:
    results = run_on_ranks(_strict, tp * pp, name, tp, pp)
    assert [r[2] for r in results] == [""] * (tp * pp)


def test_rows_met_in_another_order_mix_the_batch() -> None:
    from autotp.analysis.batch_rows import batch_mixing_node
    from autotp.analysis.trace import trace

    gm = trace(TiledTimeFeatures(), _inputs("tiled_time_features"))
    assert "add" in batch_mixing_node(gm, BATCH)
