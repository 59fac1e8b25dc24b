"""A position table that one rotary module, shared by every layer, computes from its parameter
on its first call and caches in a buffer that the later calls read (rotary-embedding-torch's
cache, as FLASH and other libraries use it). At pp=2 the second stage reads the cache that the
first layer's write fills, so it repeats that write and must hold the parameter it reads: a
stage holds every parameter that its chunk's graph reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from block_lm import BlockLm
from distributed import run_on_ranks

VOCAB, DIM, SEQ = 32, 16, 8


class CachedRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.freqs = nn.Parameter(1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM), requires_grad=False)
        self.register_buffer("cached", torch.zeros(64, DIM), persistent=False)
        self.cached_len = 0

    def forward(self, seq_len: int) -> torch.Tensor:
        if seq_len <= self.cached_len:
            return self.cached[:seq_len].detach()
        freqs = torch.einsum("i,f->if", torch.arange(seq_len, dtype=torch.float32), self.freqs).repeat_interleave(2, -1)
        self.cached[:seq_len] = freqs.detach()
        self.cached_len = seq_len
        return freqs


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    return x * freqs.cos() + rotated * freqs.sin()


class Layer(nn.Module):
    def __init__(self, rotary: CachedRotary) -> None:
        super().__init__()
        self.rotary = rotary
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = self.rotary(x.shape[1])
        q, k, v = (t.unflatten(-1, (2, DIM // 2)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        heads = freqs.unflatten(-1, (2, DIM // 2))[:, 0]
        attn = self.out(F.scaled_dot_product_attention(rotate(q, heads), rotate(k, heads), v, is_causal=True).transpose(1, 2).flatten(2))
        return attn + self.down(F.gelu(self.up(x + attn)))


def cached_rotary_lm() -> BlockLm:
    rotary = CachedRotary()  # one module, shared by every layer
    return BlockLm(lambda: Layer(rotary), VOCAB, DIM)


def _strict(rank: int, world: int, tp: int, pp: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen), "labels": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}
    return check_on_rank(cached_rotary_lm(), inputs, tp=tp, pp=pp).reason


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)])
def test_a_table_cached_by_the_first_layer_and_read_by_the_others(tp: int, pp: int) -> None:
    assert run_on_ranks(_strict, tp * pp, tp, pp) == [""] * (tp * pp)
