"""Small plain-PyTorch models written with einops, the way lucidrains' libraries (x-transformers,
vit-pytorch, rotary-embedding-torch, mlp-mixer) write them (issue 27, thirteenth round).

``rearrange`` splitting heads out of a fused projection and merging them back, ``einops.einsum``
with named axes for the scores, ``repeat`` making grouped-query key heads (``(h g)``), the
interleaved rotary embedding (``'... (d r) -> ... d r'``), ViT's patch embedding as a
``Rearrange`` layer, its class token by ``repeat`` and joined by ``pack``/``unpack``, mean pooling
by ``reduce``, memory tokens packed in front of the sequence, ``EinMix`` layers (an einsum
whose weight has named axes) for the feed-forward and for mixing tokens, and the loss over
logits rearranged to ``b c n``.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``, ``loss_fn(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, pack, rearrange, reduce, repeat, unpack
from einops.layers.torch import EinMix, Rearrange
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, KV_HEADS, LAYERS, VOCAB, PreNormBlock
from plain_models_frontier import decoder_of

SEQ = 16
IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10
MEMORY = 4


class EinopsAttention(nn.Module):
    """x-transformers' attention: heads split and merged by ``rearrange``, scores by ``einsum``,
    a causal mask filled with ``-finfo.max``."""

    def __init__(self, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.to_qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=HEADS) for t in self.to_qkv(x).chunk(3, dim=-1))
        sim = einsum(q, k, "b h i d, b h j d -> b h i j") / math.sqrt(HEAD_DIM)
        if self.causal:
            i, j = sim.shape[-2:]
            future = torch.ones(i, j, dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(future, -torch.finfo(sim.dtype).max)
        out = einsum(sim.softmax(dim=-1), v, "b h i j, b h j d -> b h i d")
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """rotary-embedding-torch's interleaved pairs ``(x1, x2) -> (-x2, x1)``."""
    x1, x2 = rearrange(x, "... (d r) -> ... d r", r=2).unbind(dim=-1)
    return rearrange(torch.stack((-x2, x1), dim=-1), "... d r -> ... (d r)")


class EinopsGQAAttention(nn.Module):
    """Grouped-query attention: key/value heads repeated over their query group by
    ``repeat(k, 'b h n d -> b (h g) n d')``; interleaved rotary on q and k; SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.to_kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        freqs = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        angles = repeat(torch.outer(torch.arange(SEQ).float(), freqs), "n d -> n (d r)", r=2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        q = rearrange(self.to_q(x), "b n (h d) -> b h n d", h=HEADS)
        k, v = rearrange(self.to_kv(x), "b n (kv h d) -> kv b h n d", kv=2, h=KV_HEADS)
        cos, sin = self.cos[:n], self.sin[:n]
        q, k = (t * cos + rotate_half(t) * sin for t in (q, k))
        k, v = (repeat(t, "b h n d -> b (h g) n d", g=HEADS // KV_HEADS) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class EinMixFeedForward(nn.Module):
    """A GELU feed-forward of two ``EinMix`` layers (weights ``d h`` and ``h d``, with biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = EinMix("b n d -> b n h", weight_shape="d h", bias_shape="h", d=DIM, h=4 * DIM)
        self.down = EinMix("b n h -> b n d", weight_shape="h d", bias_shape="d", d=DIM, h=4 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class EinMixTokenMixer(nn.Module):
    """MLP-Mixer's token mixing as ``EinMix`` over the positions (weight ``n m``), then a channel
    ``EinMix`` into heads, merged by ``rearrange``."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = EinMix("b n d -> b m d", weight_shape="n m", n=SEQ, m=SEQ)
        self.channels = EinMix("b n d -> b n h e", weight_shape="d h e", h=HEADS, e=HEAD_DIM, d=DIM)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.channels(self.tokens(x))
        return self.out(rearrange(F.silu(h), "b n h e -> b n (h e)"))


class MemoryTokensAttention(EinopsAttention):
    """Memory tokens (x-transformers' ``num_memory_tokens``) packed in front of the sequence by
    ``pack`` and cut off by ``unpack``; attention is not causal over them."""

    def __init__(self) -> None:
        super().__init__(causal=False)
        self.memory = nn.Parameter(torch.randn(MEMORY, DIM) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mem = repeat(self.memory, "m d -> b m d", b=x.shape[0])
        joined, shapes = pack((mem, x), "b * d")
        _, out = unpack(super().forward(joined), shapes, "b * d")
        return out


class EinopsViT(nn.Module):
    """vit-pytorch's ViT: ``Rearrange`` patches, a class token by ``repeat`` joined by ``pack``,
    pre-norm encoder blocks, mean pooling by ``reduce`` and a 10-class head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        patch_dim = CHANNELS * PATCH * PATCH
        self.to_patch_embedding = nn.Sequential(
            Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=PATCH, p2=PATCH),
            nn.LayerNorm(patch_dim),
            nn.Linear(patch_dim, DIM),
            nn.LayerNorm(DIM),
        )
        patches = (IMAGE // PATCH) ** 2
        self.pos_embedding = nn.Parameter(torch.randn(1, patches + 1, DIM) * 0.02)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.layers = nn.ModuleList(PreNormBlock(EinopsAttention(causal=False), EinMixFeedForward()) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.mlp_head = nn.Linear(DIM, CLASSES)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.to_patch_embedding(img)
        cls_tokens = repeat(self.cls_token, "1 1 d -> b 1 d", b=x.shape[0])
        x, shapes = pack((cls_tokens, x), "b * d")
        x = x + self.pos_embedding
        for layer in self.layers:
            x = layer(x)
        cls_out, patch_out = unpack(x, shapes, "b * d")
        pooled = reduce(patch_out, "b n d -> b d", "mean") + rearrange(cls_out, "b 1 d -> b d")
        return self.mlp_head(self.norm(pooled))


class ClassFirstLossLM(nn.Module):
    """lucidrains' language-model loss: the embedding tied to the head, the logits rearranged to
    ``b c n`` so that ``F.cross_entropy`` takes the class dim second, padding (id 0) ignored, and
    a per-token loss (``reduction="none"``) weighted by position before its mean."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = decoder_of(EinopsAttention)()
        self.decoder.output.weight = self.decoder.embed.weight
        nn.init.normal_(self.decoder.embed.weight, std=0.02)  # PaLM's init of the tied table

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.decoder.logits(self.decoder.hidden(input_ids))
        classes_second = rearrange(logits, "b n c -> b c n")
        loss = F.cross_entropy(classes_second, labels, ignore_index=0)
        per_token = F.cross_entropy(classes_second, labels, reduction="none")
        weights = torch.linspace(0.5, 1.5, labels.shape[1])
        return {"logits": logits, "loss": loss + (per_token * weights).mean()}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "einops_attention": decoder_of(EinopsAttention),
    "einops_gqa_rotary": decoder_of(EinopsGQAAttention),
    "einmix_feed_forward": decoder_of(EinopsAttention, EinMixFeedForward),
    "einmix_token_mixer": decoder_of(EinMixTokenMixer),
    "einops_memory_tokens": decoder_of(MemoryTokensAttention),
    "einops_vit": EinopsViT,
    "einops_class_first_loss": ClassFirstLossLM,
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "einops_vit":
        return {"img": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen)}
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    return {"input_ids": ids, "labels": labels}


def _class_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross entropy against class 3 for every image (a mean over images, so microbatches agree)."""
    return F.cross_entropy(logits, torch.full((logits.shape[0],), 3))


def loss_fn(name: str) -> Callable[[Any], torch.Tensor] | None:
    return _class_loss if name == "einops_vit" else None
