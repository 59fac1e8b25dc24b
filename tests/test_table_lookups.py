"""Tables read by an integer index and attention written as einsums over 3-D weights, in
models of our own (fp32, gloo, the strict rule of ``autotp.report.strict_rule``):

* a learned position table read by ``weight[position_ids]`` (``index``) or
  ``index_select(weight, 0, positions)``: an embedding lookup, so the table is
  vocab-parallel as ``nn.Embedding``'s is (rows split, the lookup a partial sum);
* a relative-position bias table ``[buckets, heads]`` read by ``table[buckets]``: the same;
* q/k/v as ``einsum("bsh,hnd->bsnd", x, w)`` with ``w`` of ``[hidden, heads, head_dim]``:
  column-parallel over the heads (the outer of the weight's two output letters), the
  output projection ``einsum("bsnd,hnd->bsh")`` row-parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.report.strict_rule import StrictResult, check_on_rank, combine
from distributed import run_on_ranks

DIM, HEADS, HEAD_DIM, VOCAB, SEQ, POSITIONS, BUCKETS = 32, 4, 8, 128, 8, 512, 128


class LinearAttention(nn.Module):
    """Causal attention over ``nn.Linear`` projections, with an optional additive bias per head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.o = nn.Linear(DIM, DIM)

    def scores_bias(self, s: int) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        bias = torch.zeros(s, s, device=x.device).masked_fill(~mask, float("-inf"))
        extra = self.scores_bias(s)
        bias = bias if extra is None else bias + extra
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o(out.transpose(1, 2).reshape(b, s, DIM))


class RelativeBiasAttention(LinearAttention):
    """A learned bias per head and relative distance, T5-style but read by ``table[buckets]``;
    a negative distance reads its row from the end of the table, as Python indexing does."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.randn(BUCKETS, HEADS) * 0.1)

    def scores_bias(self, s: int) -> torch.Tensor:
        pos = torch.arange(s, device=self.rel.device)
        buckets = (pos[None, :] - pos[:, None]).clamp(-(BUCKETS // 2), BUCKETS // 2 - 1)
        return self.rel[buckets].permute(2, 0, 1)  # [heads, s, s]


class EinsumAttention(nn.Module):
    """Attention whose projections are einsums with ``[hidden, heads, head_dim]`` weights (XLNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Parameter(torch.randn(DIM, HEADS, HEAD_DIM) * DIM**-0.5) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.einsum("bsh,hnd->bsnd", x, w) for w in (self.q, self.k, self.v))
        scores = torch.einsum("bind,bjnd->bnij", q, k) * HEAD_DIM**-0.5
        s = x.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = torch.einsum("bnij,bjnd->bind", scores.softmax(-1), v)
        return torch.einsum("bind,hnd->bih", out, self.o)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, attention: type[nn.Module]) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = attention(), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Token embedding plus a learned position table of ``POSITIONS`` rows (the largest
    parameter: kept whole, a rank would hold more than its share at tp=4), read by
    ``positions``: ``index`` (``weight[position_ids]``, Whisper's decoder) or ``index_select``;
    ``rows`` that tp does not divide pad the table's split."""

    def __init__(self, attention: type[nn.Module], positions: str, rows: int = POSITIONS) -> None:
        super().__init__()
        self.positions = positions
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(rows, DIM) * 0.1)
        self.layers = nn.ModuleList(Block(attention) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        if self.positions == "index":
            x = x + self.pos[position_ids.expand_as(input_ids)]
        else:
            x = x + torch.index_select(self.pos, 0, position_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


MODELS = {
    "position_index": (LinearAttention, "index"),
    "position_index_select": (LinearAttention, "index_select", POSITIONS - 2),
    "relative_bias_index": (RelativeBiasAttention, "index"),
    "einsum_attention": (EinsumAttention, "index"),
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return Decoder(*MODELS[name]).eval()


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_tables_and_einsum_weights_are_split(name: str, tp: int) -> None:
    model = _build(name)
    plan = plan_tensor_parallel(trace(model, _inputs()), tp)
    split = {p.name: (p.kind, p.dim) for p in plan.params}
    assert split["pos"] == ("vocab", 0), split
    if name == "relative_bias_index":
        assert split["layers.0.attn.rel"] == ("vocab", 0), split
    if name == "einsum_attention":
        assert all(split[f"layers.1.attn.{w}"] == ("column", 1) for w in "qkv") and split["layers.1.attn.o"] == ("row", 1), split
    tables = {n for n, p in model.named_parameters() if p.dim() > 1}
    assert not [k for k in plan.kept_whole if k.name in tables], plan.kept_whole


class RouterPickedRows(nn.Module):
    """A row of a ``[choices, hidden]`` table per token, picked by the argmax of a projection:
    an index the model computes from its parameters, not a lookup by data."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, POSITIONS, bias=False)
        self.rows = nn.Parameter(torch.randn(POSITIONS, DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.rows[self.router(x).argmax(-1)]


def test_rows_picked_by_the_model_are_not_a_lookup() -> None:
    plan = plan_tensor_parallel(trace(RouterPickedRows(), {"x": torch.randn(2, SEQ, DIM)}), 2)
    assert "rows" not in {p.name for p in plan.params}


def _strict_on_rank(rank: int, world: int, name: str) -> StrictResult:
    return check_on_rank(_build(name), _inputs(), tp=world, pp=1)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_models_pass_the_strict_rule(tp: int) -> None:
    for name in MODELS:
        result = combine(run_on_ranks(_strict_on_rank, tp, name, timeout_s=400))
        assert result.passed, f"{name} at tp={tp}: {result.reason}"
