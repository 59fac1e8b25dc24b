"""Fourier transforms keep the splits of the dims they do not transform (Autoformer's auto-correlation:
``irfft(rfft(q) * conj(rfft(k)))`` over the time steps of each head), at tp=4 under the strict rule; and a
transform along the batch's rows mixes them."""

from __future__ import annotations

import torch
from torch import nn

from distributed import run_on_ranks

BATCH, SEQ, DIM, HEADS = 2, 16, 32, 4


class AutoCorrelation(nn.Module):
    """Each head's queries correlated with its keys over all lags by FFT, weighting its values."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = (p(x).view(b, length, HEADS, -1).permute(0, 2, 3, 1) for p in (self.q, self.k, self.v))  # [B, H, E, L]
        corr = torch.fft.irfft(torch.fft.rfft(q, dim=-1) * torch.conj(torch.fft.rfft(k, dim=-1)), n=length, dim=-1)
        out = torch.softmax(corr, -1) * v
        return self.o(out.permute(0, 3, 1, 2).reshape(b, length, DIM))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AutoCorrelation() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _strict(rank: int, world: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    return check_on_rank(Stack(), {"x": x}, tp=4, loss_fn=lambda out: out.square().mean()).reason


def test_auto_correlation_keeps_its_heads_split_at_tp4() -> None:
    assert run_on_ranks(_strict, 4) == [""] * 4


def test_auto_correlation_needs_no_gather() -> None:
    """Without a rule the transform's inputs were gathered whole (or the projections kept whole)."""
    from autotp.analysis.trace import trace
    from autotp.cost_model.tensor_parallel import plan_tensor_parallel

    plan = plan_tensor_parallel(trace(Stack(), {"x": torch.randn(BATCH, SEQ, DIM)}), 4)
    assert plan.gathered == () and not [k.name for k in plan.kept_whole if k.name.endswith("weight")]
    kinds = {p.name: p.kind for p in plan.params}
    assert all(kinds[f"layers.{i}.{w}.weight"] == "column" for i in range(2) for w in "qkv")


class SpectralPool(nn.Module):
    """An FFT over the batch dim: each sample's output depends on every other sample."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(self.proj(x), dim=0).abs()


def test_a_transform_along_the_rows_mixes_them() -> None:
    from autotp.analysis.batch_rows import batch_mixing_node
    from autotp.analysis.trace import trace

    gm = trace(SpectralPool(), {"x": torch.randn(BATCH, SEQ, DIM)})
    assert "fft_rfft" in batch_mixing_node(gm, BATCH)
