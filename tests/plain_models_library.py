"""Small whole models in plain PyTorch written the way other training libraries and newer
architectures write attention and block structure (issue 27): GQA through SDPA's
``enable_gqa``, ALiBi scores by ``baddbmm`` (BLOOM/MPT), a parallel block with one fused
attention+MLP input projection (GPT-J/PaLM), activation checkpointing (torchtitan,
nanotron, Megatron), Megatron's ``@torch.jit.script`` fusions with ``skip_bias_add`` linears,
weight-norm parametrizations, a torchvision ViT on ``nn.MultiheadAttention``, T5 relative
position buckets, a submodule wrapped by ``torch.compile``, and torchtune's multi-query attention
(the one KV head expanded to every query head) with Gemma's norms.

The suite protocol (``tests/test_plain_suite.py``): ``NAMES``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)`` and ``loss_fn(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import plain_models_structure as structure
from plain_models_structure import CHANNELS, CLASSES, IMAGE, PATCH, VOCAB, lm_loss

DIM, HEADS, KV_HEADS, LAYERS = 64, 8, 2, 2
HEAD_DIM = DIM // HEADS
FFN = 2 * DIM


class RMSNorm(nn.Module):
    def __init__(self, dim: int = DIM, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.linspace(0.9, 1.1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Residual(nn.Module):
    """Pre-norm attention and MLP sublayers, each added to the stream."""

    def __init__(self, attention: nn.Module, mlp: nn.Module | None = None, norm: Callable[[], nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(), norm()
        self.attention, self.mlp = attention, mlp if mlp is not None else SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    """Embedding, ``LAYERS`` blocks (each called through ``call``), final norm, head."""

    def __init__(self, block: Callable[[], nn.Module], call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.call = call

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = self.call(layer, h) if self.call is not None else layer(h)
        logits = self.head(self.norm(h))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- 1. GQA through SDPA's enable_gqa (k/v keep their fewer heads) -------------------------


class EnableGQAAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


# ---- 2. ALiBi (BLOOM): per-head slopes, scores by baddbmm over [B*H, S, D] ------------------


def alibi_slopes(heads: int) -> torch.Tensor:
    start = 2 ** (-(2 ** -(math.log2(heads) - 3)))
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class AlibiAttention(nn.Module):
    """BLOOM: fused ``query_key_value`` laid out per head ``[H, 3, D]``, ALiBi built in the
    forward from a slope buffer, ``baddbmm`` scores, ``bmm`` with the values."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(DIM, 3 * DIM)
        self.dense = nn.Linear(DIM, DIM)
        self.register_buffer("slopes", alibi_slopes(HEADS), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, s, HEADS, 3, HEAD_DIM).unbind(3)
        q = q.transpose(1, 2).reshape(b * HEADS, s, HEAD_DIM)
        k = k.permute(0, 2, 3, 1).reshape(b * HEADS, HEAD_DIM, s)
        v = v.transpose(1, 2).reshape(b * HEADS, s, HEAD_DIM)
        positions = torch.arange(s, device=x.device, dtype=x.dtype)
        alibi = (self.slopes[:, None] * positions[None, :])[None].expand(b, HEADS, s).reshape(b * HEADS, 1, s)
        scores = torch.baddbmm(alibi, q, k, beta=1.0, alpha=1.0 / math.sqrt(HEAD_DIM))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(-1)
        y = torch.bmm(probs, v).view(b, HEADS, s, HEAD_DIM).transpose(1, 2).reshape(b, s, DIM)
        return self.dense(y)


# ---- 3. parallel block (GPT-J / PaLM): one fused projection for q, k, v, gate and up --------


class ParallelBlock(nn.Module):
    """``x + attn(norm(x)) + mlp(norm(x))`` with q, k, v (multi-query: one k/v head) and the
    MLP's gate and up from one ``Linear``, cut by ``split`` into unequal sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes = (HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM, FFN, FFN)
        self.norm = nn.LayerNorm(DIM)
        self.fused = nn.Linear(DIM, sum(self.sizes), bias=False)
        self.attn_out = nn.Linear(DIM, DIM, bias=False)
        self.ff_out = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v, gate, up = self.fused(self.norm(x)).split(self.sizes, dim=-1)
        q = q.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = k[:, None], v[:, None]  # one head, broadcast over the query heads
        y = F.scaled_dot_product_attention(q, k.expand(b, HEADS, s, HEAD_DIM), v.expand(b, HEADS, s, HEAD_DIM), is_causal=True)
        attn = self.attn_out(y.transpose(1, 2).reshape(b, s, DIM))
        return x + attn + self.ff_out(F.silu(gate) * up)


class EinsumMultiQueryBlock(nn.Module):
    """``ParallelBlock`` as PaLM writes its attention: q, one key and one value head, and the
    SwiGLU's gate and up from one ``Linear``; rotary by ``rotate_half`` (``chunk(2)`` and ``cat``),
    the scores and the values contracted by einsum with no heads letter on k and v
    (``"bhid,bjd->bhij"``, ``"bhij,bjd->bhid"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes = (HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM, 2 * FFN)
        self.norm = nn.LayerNorm(DIM)
        self.fused = nn.Linear(DIM, sum(self.sizes), bias=False)
        self.attn_out = nn.Linear(DIM, DIM, bias=False)
        self.ff_out = nn.Linear(FFN, DIM, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v, ff = self.fused(self.norm(x)).split(self.sizes, dim=-1)
        q = q.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        freqs = torch.einsum("i,j->ij", torch.arange(s, dtype=x.dtype), self.inv_freq)
        pos = torch.cat((freqs, freqs), dim=-1)
        q, k = (t * pos.cos() + self.rotate_half(t) * pos.sin() for t in (q, k))
        sim = torch.einsum("bhid,bjd->bhij", q, k) * HEAD_DIM**-0.5
        sim = sim.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -torch.finfo(sim.dtype).max)
        out = torch.einsum("bhij,bjd->bhid", sim.softmax(dim=-1), v)
        up, gate = ff.chunk(2, dim=-1)
        return x + self.attn_out(out.transpose(1, 2).reshape(b, s, DIM)) + self.ff_out(F.silu(gate) * up)


class AdditivePoolingBlock(nn.Module):
    """Additive (Bahdanau) attention pooling: each position's score is ``tanh(W x) @ v`` with a vector
    ``v`` (a matrix-vector ``matmul``), plus ``u @ tanh(W' x)^T`` with the vector on the left; the
    positions' softmax weighs a pooled summary added back to every position."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.key = nn.Linear(DIM, FFN), nn.Linear(DIM, FFN)
        self.v, self.u = nn.Parameter(torch.linspace(-0.5, 0.5, FFN)), nn.Parameter(torch.linspace(0.3, -0.3, FFN))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.tanh(self.proj(x)) @ self.v + self.u @ torch.tanh(self.key(x)).transpose(1, 2)
        pooled = (scores.softmax(dim=-1)[..., None] * x).sum(dim=1, keepdim=True)
        return x + self.out(pooled)


class UnitFactorBlock(nn.Module):
    """A projection viewed as one fraction of one stream (``[b, s, 1, 1, d]``, size-1 factors as
    hyper-connections' ``num_fracs=1`` make them), viewed back and added to itself, then split into
    heads for a per-head gate."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.proj(x)
        y = y + y.view(b, s, 1, DIM).view(b, s, 1, 1, DIM).view(b, s, DIM)
        heads = y.view(b, s, HEADS, HEAD_DIM)
        heads = heads * torch.sigmoid(heads.mean(dim=-1, keepdim=True))
        return x + self.out(heads.reshape(b, s, DIM))


# ---- 4. activation checkpointing around each block -----------------------------------------


def llama_block() -> nn.Module:
    return Residual(EnableGQAAttention())


def checkpointed(use_reentrant: bool) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def call(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(layer, h, use_reentrant=use_reentrant)

    return call


class RecomputingCheckpoint(torch.autograd.Function):
    """An activation checkpoint written by hand, as diffusion repositories write theirs: the forward
    runs ``fn`` without autograd, the backward runs it again and differentiates it against the
    inputs and the ``params`` it is handed (the module's, read by ``fn`` itself)."""

    @staticmethod
    def forward(ctx, fn, n_inputs, *tensors):  # type: ignore[no-untyped-def]
        ctx.fn, ctx.inputs, ctx.params = fn, tensors[:n_inputs], tensors[n_inputs:]
        with torch.no_grad():
            return fn(*ctx.inputs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        inputs = [x.detach().requires_grad_(True) for x in ctx.inputs]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        grads = torch.autograd.grad(out, [*inputs, *ctx.params], grad, allow_unused=True)
        return (None, None, *grads)


def checkpointed_by_hand(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return RecomputingCheckpoint.apply(layer.forward, 1, h, *layer.parameters())


class GroupedConvExperts(nn.Module):
    """Attention experts folded into the groups of 1x1 convolutions (mixture-of-attention's way of
    running its experts at once): ``EXPERTS`` copies of the sequence, each projected by its own
    group of q/kv/out channels, averaged; the attention is one SDPA over [batch, experts, heads,
    tokens, head_dim]. tp=4 does not divide the 2 groups: each rank holds a block of every
    group's heads, SDPA split on its dim 2."""

    EXPERTS = 2

    def __init__(self) -> None:
        super().__init__()
        e = self.EXPERTS
        self.to_q = nn.Conv1d(DIM * e, DIM * e, 1, bias=False, groups=e)
        self.to_kv = nn.Conv1d(DIM * e, 2 * DIM * e, 1, bias=False, groups=e)
        self.to_out = nn.Conv1d(DIM * e, DIM * e, 1, bias=False, groups=e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        e = self.EXPERTS
        folded = x.transpose(1, 2).repeat(1, e, 1)  # [b, e * dim, s]
        q = self.to_q(folded).view(b, e, HEADS, HEAD_DIM, s).transpose(-1, -2)
        k, v = self.to_kv(folded).view(b, e, 2, HEADS, HEAD_DIM, s).transpose(-1, -2).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, e, heads, s, head_dim]: heads are dim 2
        out = self.to_out(y.transpose(-1, -2).reshape(b, e * DIM, s))
        return out.view(b, e, DIM, s).mean(1).transpose(1, 2)


# ---- 5. Megatron: jit-scripted fusions, skip_bias_add linears ------------------------------


@torch.jit.script
def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


@torch.jit.script
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, prob: float, training: bool) -> torch.Tensor:
    return residual + F.dropout(x + bias, p=prob, training=training)


class SkipBiasLinear(nn.Module):
    """Megatron's ``skip_bias_add``: returns the matmul and the bias apart, for a later fusion."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(x, self.weight), self.bias


class MegatronBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.query_key_value = SkipBiasLinear(DIM, 3 * DIM)
        self.dense = SkipBiasLinear(DIM, DIM)
        self.dense_h_to_4h, self.dense_4h_to_h = SkipBiasLinear(DIM, FFN), SkipBiasLinear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        mixed, qkv_bias = self.query_key_value(self.input_layernorm(x))
        q, k, v = (mixed + qkv_bias).view(b, s, HEADS, 3 * HEAD_DIM).split(HEAD_DIM, dim=-1)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out, out_bias = self.dense(y.transpose(1, 2).reshape(b, s, DIM))
        x = bias_dropout_add(out, out_bias, x, 0.1, self.training)
        hidden, hidden_bias = self.dense_h_to_4h(self.post_attention_layernorm(x))
        out, out_bias = self.dense_4h_to_h(bias_gelu(hidden_bias, hidden))
        return bias_dropout_add(out, out_bias, x, 0.1, self.training)


# ---- 6. weight-norm parametrizations -------------------------------------------------------


class WeightNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.up, self.down = wn(nn.Linear(DIM, FFN)), wn(nn.Linear(FFN, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


# ---- 7. torchvision ViT on nn.MultiheadAttention -------------------------------------------


class MHABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.self_attention = nn.MultiheadAttention(DIM, HEADS, dropout=0.0, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, FFN), nn.GELU(), nn.Linear(FFN, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        h, _ = self.self_attention(h, h, h, need_weights=False)
        x = x + h
        return x + self.mlp(self.ln_2(x))


class TorchvisionViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(CHANNELS, DIM, PATCH, stride=PATCH)
        self.class_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embedding = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, DIM) * 0.02)
        self.layers = nn.Sequential(*(MHABlock() for _ in range(LAYERS)))
        self.ln = nn.LayerNorm(DIM)
        self.heads = nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(pixel_values).reshape(pixel_values.shape[0], DIM, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return self.heads(self.ln(self.layers(x))[:, 0])


# ---- 8. T5: relative position buckets, no-bias pre-norm, tied embedding rescaled -----------


def relative_buckets(relative: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's causal buckets: exact for small distances, log-spaced up to ``max_distance``."""
    relative = -torch.min(relative, torch.zeros_like(relative))
    exact = num_buckets // 2
    is_small = relative < exact
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return torch.where(is_small, relative, large)


class T5Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.9, 1.1, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class T5Attention(nn.Module):
    def __init__(self, bias_table: nn.Embedding | None) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.relative_attention_bias = bias_table

    def position_bias(self, s: int, device: torch.device) -> torch.Tensor:
        context = torch.arange(s, dtype=torch.long, device=device)[:, None]
        memory = torch.arange(s, dtype=torch.long, device=device)[None, :]
        values = self.relative_attention_bias(relative_buckets(memory - context))  # [S, S, H]
        return values.permute(2, 0, 1).unsqueeze(0)  # [1, H, S, S]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        if bias is None:
            mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
            bias = self.position_bias(s, x.device) + mask
        probs = (torch.matmul(q, k.transpose(3, 2)) + bias).softmax(-1)  # T5: no 1/sqrt(d)
        return self.o(torch.matmul(probs, v).transpose(1, 2).reshape(b, s, DIM)), bias


class T5Layer(nn.Module):
    def __init__(self, has_bias: bool) -> None:
        super().__init__()
        self.attn_norm, self.ff_norm = T5Norm(), T5Norm()
        self.attention = T5Attention(nn.Embedding(32, HEADS) if has_bias else None)
        self.wi, self.wo = nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, bias = self.attention(self.attn_norm(x), bias)
        x = x + h
        return x + self.wo(F.relu(self.wi(self.ff_norm(x)))), bias


class T5DecoderLM(nn.Module):
    """The first layer owns the bias table; its position bias is passed to the later layers."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, DIM)
        self.block = nn.ModuleList(T5Layer(has_bias=i == 0) for i in range(LAYERS))
        self.final_layer_norm = T5Norm()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h, bias = self.shared(input_ids), None
        for layer in self.block:
            h, bias = layer(h, bias)
        logits = self.lm_head(self.final_layer_norm(h) * DIM**-0.5)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- 9. a submodule wrapped by torch.compile before parallelize ----------------------------


# ---- torchtune's multi-query attention: the one KV head repeated by expand, Gemma's norms -------


class GemmaNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class ExpandedMQA(nn.Module):
    """One key/value head, expanded to every query head (``unsqueeze(2).expand(...).flatten(1, 2)``,
    a stride-0 view) and SDPA; the output back through ``transpose(1, 2).contiguous().view``."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(DIM, HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (p(x).view(b, s, 1, HEAD_DIM).transpose(1, 2) for p in (self.k, self.v))
        k, v = (t.unsqueeze(2).expand(b, 1, HEADS, s, HEAD_DIM).flatten(1, 2) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).contiguous().view(b, s, -1))


class GemmaLM(LM):
    """The embedding scaled by sqrt(dim), (1 + w) norms, the head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__(lambda: Residual(ExpandedMQA(), norm=GemmaNorm), None)
        self.norm = GemmaNorm()
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.embed(input_ids) * DIM**0.5
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return {"logits": logits, "loss": lm_loss(logits, labels)} if labels is not None else {"logits": logits}


def compiled_mlp_block() -> nn.Module:
    return Residual(EnableGQAAttention(), torch.compile(SwiGLU()))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "sdpa_enable_gqa": lambda: LM(llama_block),
    "alibi_baddbmm": lambda: LM(lambda: Residual(AlibiAttention(), norm=lambda: nn.LayerNorm(DIM))),
    "parallel_fused_block": lambda: LM(ParallelBlock),
    "parallel_einsum_mqa_block": lambda: LM(EinsumMultiQueryBlock),
    "additive_pooling_matvec": lambda: LM(lambda: Residual(AdditivePoolingBlock())),
    "unit_factor_views": lambda: LM(lambda: Residual(UnitFactorBlock())),
    "checkpoint_nonreentrant": lambda: LM(llama_block, checkpointed(use_reentrant=False)),
    "checkpoint_reentrant": lambda: LM(llama_block, checkpointed(use_reentrant=True)),
    "checkpoint_by_hand": lambda: LM(llama_block, checkpointed_by_hand),
    "grouped_conv_experts": lambda: LM(lambda: Residual(GroupedConvExperts())),
    "megatron_jit_skip_bias": lambda: LM(MegatronBlock),
    "weight_norm_mlp": lambda: LM(lambda: Residual(EnableGQAAttention(), WeightNormMLP())),
    "torchvision_vit_mha": TorchvisionViT,
    "t5_relative_buckets": T5DecoderLM,
    "compiled_submodule": lambda: LM(compiled_mlp_block),
    "torchtune_expanded_mqa": GemmaLM,
}
NAMES = tuple(MODELS)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2) -> dict[str, torch.Tensor]:
    """Images for the ViT, token ids and labels for the LMs (the structure suite's inputs)."""
    return structure.example_inputs("vit_loss_fn" if name == "torchvision_vit_mha" else name, batch)


def loss_fn(name: str) -> Callable[[Any], torch.Tensor] | None:
    return structure.loss_fn("vit_loss_fn") if name == "torchvision_vit_mha" else None
