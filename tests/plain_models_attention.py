"""Small decoder and encoder LMs in plain PyTorch, written the way other training libraries
write them (nanoGPT, torchtitan, DeepSeek's reference MLA, OLMo, BERT...), one or more
per construct of issue 27. Every model takes ``input_ids`` (and ``labels``) and returns
``{"logits", "loss"}``; ``build(name)`` makes one in eval mode with fixed weights."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, HEAD_DIM, KV_HEADS, LAYERS = 128, 64, 8, 8, 2, 2


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class RMSNorm(nn.Module):
    """Hand-written RMSNorm (reductions and pointwise ops in the graph, not ``aten.rms_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.linspace(0.8, 1.2, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def causal_mask(s: int, device: torch.device) -> torch.Tensor:
    return torch.full((s, s), float("-inf"), device=device).triu(1)


# ---- rotary embeddings, three ways -------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """torchtitan / Meta llama: complex rotations [end, dim/2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """``x`` [B, S, H, D] rotated through ``view_as_complex`` / ``view_as_real``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(dim: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(end).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# ---- a generic decoder LM around one block class ------------------------------------------


class DecoderLM(nn.Module):
    """Token embedding, ``LAYERS`` blocks, final norm, untied head (the common skeleton)."""

    def __init__(self, block: Callable[[], nn.Module], norm: Callable[[int], nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm = norm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.logits(self.hidden(input_ids))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


class PreNormBlock(nn.Module):
    def __init__(self, attention: nn.Module, mlp: nn.Module | None = None, norm: Callable[[int], nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = norm(DIM), norm(DIM)
        self.attention, self.feed_forward = attention, mlp if mlp is not None else SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


# ---- nanoGPT ---------------------------------------------------------------------------


class NanoGPTAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(DIM, dim=2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoGPTMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoGPT(nn.Module):
    """nanoGPT: learned positions, fused c_attn split three ways, weight tying."""

    def __init__(self, block_size: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, DIM),
                wpe=nn.Embedding(block_size, DIM),
                h=nn.ModuleList(PreNormBlock(NanoGPTAttention(), NanoGPTMLP()) for _ in range(LAYERS)),
                ln_f=nn.LayerNorm(DIM),
            )
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        t = input_ids.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-1)
        return out


# ---- torchtitan llama: complex RoPE, repeat_kv by expand, a complex buffer ---------------


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    return torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class TitanAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, HEAD_DIM)
        xk = self.wk(x).view(bs, seqlen, -1, HEAD_DIM)
        xv = self.wv(x).view(bs, seqlen, -1, HEAD_DIM)
        xq, xk = apply_rotary_complex(xq, freqs_cis), apply_rotary_complex(xk, freqs_cis)
        keys, values = repeat_kv(xk, HEADS // KV_HEADS), repeat_kv(xv, HEADS // KV_HEADS)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, keys, values))
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = TitanAttention(), SwiGLU()
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, max_seq_len: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", precompute_freqs_cis(HEAD_DIM, max_seq_len), persistent=True)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(LAYERS)})
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        logits = self.output(self.norm(h))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- GQA by repeat_interleave, with real RoPE from buffers ---------------------------------


class RepeatInterleaveAttention(nn.Module):
    """Fused QKV (q heads, then kv heads), GQA by ``repeat_interleave`` on the heads dim."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        cos, sin = cos_sin(HEAD_DIM, 32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = q.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


# ---- multi-query fused QKV (one KV head) with partial rotary -------------------------------


class MultiQueryPartialRotary(nn.Module):
    """One fused projection for all query heads and a single k and v head; rotary on the
    first half of each head only (``k[..., :rot]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(DIM, (HEADS + 2) * HEAD_DIM)
        self.dense = nn.Linear(HEADS * HEAD_DIM, DIM)
        self.rot = HEAD_DIM // 2
        cos, sin = cos_sin(self.rot, 32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rotary(self, t: torch.Tensor, s: int) -> torch.Tensor:
        t_rot, t_pass = t[..., : self.rot], t[..., self.rot :]
        t_rot = t_rot * self.cos[:s] + rotate_half(t_rot) * self.sin[:s]
        return torch.cat((t_rot, t_pass), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.query_key_value(x).split([HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
        q = q.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = k.view(b, s, 1, HEAD_DIM).transpose(1, 2), v.view(b, s, 1, HEAD_DIM).transpose(1, 2)
        q, k = self.rotary(q, s), self.rotary(k, s)
        y = F.scaled_dot_product_attention(q, k.expand(b, HEADS, s, HEAD_DIM), v.expand(b, HEADS, s, HEAD_DIM), is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class FalconMultiQuery(nn.Module):
    """Falcon-7B: ``view(b, s, heads + 2, head_dim)``, queries ``[..., :-2, :]``, the key and
    value by constant indices ``[..., [-2], :]`` and ``[..., [-1], :]``, rotary on half."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(DIM, (HEADS + 2) * HEAD_DIM, bias=False)
        self.dense = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        cos, sin = cos_sin(HEAD_DIM // 2, 32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rotary(self, t: torch.Tensor, s: int) -> torch.Tensor:
        half = HEAD_DIM // 2
        rot = t[..., :half] * self.cos[:s, None] + rotate_half(t[..., :half]) * self.sin[:s, None]
        return torch.cat((rot, t[..., half:]), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        fused = self.query_key_value(x).view(b, s, HEADS + 2, HEAD_DIM)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        q, k = self.rotary(q, s).transpose(1, 2), self.rotary(k, s).transpose(1, 2)
        k, v = k.expand(b, HEADS, s, HEAD_DIM), v.transpose(1, 2).expand(b, HEADS, s, HEAD_DIM)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class FalconBroadcastKV(FalconMultiQuery):
    """HF Falcon: the one key and value head by constant indices, through a reshape that keeps
    the size-1 head dim, rotary on the whole head, and SDPA broadcasting the one KV head over
    the query heads (no expand)."""

    def __init__(self) -> None:
        super().__init__()
        self.cos, self.sin = cos_sin(HEAD_DIM, 32)  # the whole head rotates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        fused = self.query_key_value(x).view(b, s, HEADS + 2, HEAD_DIM)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        q, k, v = (t.transpose(1, 2).reshape(b, t.shape[2], s, HEAD_DIM) for t in (q, k, v))
        q, k = (t * self.cos[:s] + rotate_half(t) * self.sin[:s] for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class EmptyCacheAttention(nn.Module):
    """XLM through HF's cache: separate q/k/v projections, the keys and values appended to
    an empty ``torch.tensor([])`` (``cat`` skips a 1-D empty input) along the sequence dim,
    scores by ``matmul`` and a float softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q_lin, self.k_lin, self.v_lin = (nn.Linear(DIM, HEADS * HEAD_DIM) for _ in range(3))
        self.out_lin = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, -1, HEADS, HEAD_DIM).transpose(1, 2) for lin in (self.q_lin, self.k_lin, self.v_lin))
        empty_k, empty_v = torch.tensor([], dtype=x.dtype), torch.tensor([], dtype=x.dtype)
        k, v = torch.cat([empty_k, k], dim=-2), torch.cat([empty_v, v], dim=-2)
        scores = torch.matmul(q / math.sqrt(HEAD_DIM), k.transpose(2, 3)) + causal_mask(s, x.device)
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        return self.out_lin(torch.matmul(weights, v).transpose(1, 2).contiguous().view(b, -1, HEADS * HEAD_DIM))


class GroupedOutputAttention(nn.Module):
    """DeepSeek-V4's grouped output projection: the heads' output cut into groups, each
    projected by its own block of one weight (``weight.view(groups, -1, d_in)`` and
    ``bmm``), then mixed by one more linear."""

    GROUPS, RANK = 4, 128

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.o_a = nn.Parameter(torch.randn(self.GROUPS * self.RANK, HEADS * HEAD_DIM // self.GROUPS) * 0.2)
        self.o_b = nn.Linear(self.GROUPS * self.RANK, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, self.GROUPS, -1)
        d_in = y.shape[-1]
        w = self.o_a.view(self.GROUPS, -1, d_in).transpose(1, 2)
        grouped = torch.bmm(y.reshape(-1, self.GROUPS, d_in).transpose(0, 1), w).transpose(0, 1)
        return self.o_b(grouped.reshape(b, s, -1))


class SlicedKeyMultiQuery(nn.Module):
    """One KV head; the key's rotary half sliced off before the key is viewed as a head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, (HEADS + 2) * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
        half = HEAD_DIM // 2
        k = torch.cat((k[..., :half] * 2.0, k[..., half:]), dim=-1)
        q = q.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = k.view(b, s, 1, HEAD_DIM).transpose(1, 2), v.view(b, s, 1, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k.expand(b, HEADS, s, HEAD_DIM), v.expand(b, HEADS, s, HEAD_DIM), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


# ---- per-head interleaved fused QKV, in groups (ChatGLM / Falcon-40B multi-part layout) ---


class GroupedInterleavedQKV(nn.Module):
    """Rows ordered [kv_group, (q_per_group q heads, k, v), head_dim]: each KV group's query
    heads, key and value are adjacent."""

    def __init__(self) -> None:
        super().__init__()
        self.per = HEADS // KV_HEADS
        self.qkv = nn.Linear(DIM, KV_HEADS * (self.per + 2) * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        fused = self.qkv(x).view(b, s, KV_HEADS, self.per + 2, HEAD_DIM)
        q = fused[:, :, :, : self.per].reshape(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = fused[:, :, :, self.per].transpose(1, 2)
        v = fused[:, :, :, self.per + 1].transpose(1, 2)
        k = k[:, :, None].expand(b, KV_HEADS, self.per, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        v = v[:, :, None].expand(b, KV_HEADS, self.per, s, HEAD_DIM).reshape(b, HEADS, s, HEAD_DIM)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


class NeoXInterleavedQKV(nn.Module):
    """GPT-NeoX: rows [heads, 3, head_dim], viewed per head then chunked three ways."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(DIM, 3 * DIM)
        self.dense = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, HEADS, 3 * HEAD_DIM).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, DIM))


# ---- latent attention (DeepSeek MLA, complex RoPE, einsum) --------------------------------


class LatentAttention(nn.Module):
    """Low-rank q (``wq_a`` -> norm -> ``wq_b``) and kv (``wkv_a`` -> norm -> ``wkv_b``)
    projections, a shared rotary key ``k_pe`` broadcast to every head."""

    def __init__(self, q_lora_rank: int = 32, kv_lora_rank: int = 16, nope: int = 8, rope: int = 4, v_dim: int = 8) -> None:
        super().__init__()
        self.nope, self.rope, self.v_dim, self.kv_lora_rank = nope, rope, v_dim, kv_lora_rank
        self.qk_head_dim = nope + rope
        self.wq_a = nn.Linear(DIM, q_lora_rank, bias=False)
        self.q_norm = RMSNorm(q_lora_rank)
        self.wq_b = nn.Linear(q_lora_rank, HEADS * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(DIM, kv_lora_rank + rope, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, HEADS * (nope + v_dim), bias=False)
        self.wo = nn.Linear(HEADS * v_dim, DIM, bias=False)
        self.softmax_scale = self.qk_head_dim**-0.5
        self.register_buffer("freqs_cis", precompute_freqs_cis(rope, 32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, HEADS, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        q_pe = apply_rotary_complex(q_pe, self.freqs_cis)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope], dim=-1)
        k_pe = apply_rotary_complex(k_pe.unsqueeze(2), self.freqs_cis)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, HEADS, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, HEADS, -1)], dim=-1)
        scores = torch.einsum("bshd,bthd->bsht", q, k) * self.softmax_scale
        scores = scores + causal_mask(seqlen, x.device).unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        out = torch.einsum("bsht,bthd->bshd", scores, v)
        return self.wo(out.flatten(2))


# ---- q/k norms over the whole projection (all heads), OLMo-2 style -----------------------


class QKNormAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.q_norm, self.k_norm = RMSNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, DIM))


# ---- L2-normalized q/k and relative-position bias by gather ------------------------------


class L2GatherAttention(nn.Module):
    """Cosine attention (``F.normalize`` = ``linalg_vector_norm``) with a learned scale per
    head and a relative-position bias per head looked up by ``torch.gather``."""

    def __init__(self, max_seq: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(HEADS, 1, 1)))
        self.max_seq = max_seq
        self.rel_bias = nn.Parameter(torch.randn(HEADS, 2 * max_seq - 1) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        att = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        att = att * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        pos = torch.arange(s, device=x.device)
        index = (pos[None, :] - pos[:, None] + self.max_seq - 1).expand(HEADS, s, s)
        bias = torch.gather(self.rel_bias[:, None, :].expand(HEADS, s, 2 * self.max_seq - 1), 2, index)
        att = (att + bias + causal_mask(s, x.device)).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, s, DIM))


# ---- a reshape that regroups the sharded heads --------------------------------------------


class PairedHeadsAttention(nn.Module):
    """Heads are processed in pairs (``view(b, s, heads/2, 2*head_dim)``) by a differential-
    attention-like combine: each pair's two heads are mixed before the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.lam = nn.Parameter(torch.full((HEADS // 2, 1), 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        pairs = y.reshape(b, s, HEADS // 2, 2 * HEAD_DIM)
        first, second = pairs[..., :HEAD_DIM], pairs[..., HEAD_DIM:]
        mixed = torch.cat([first - self.lam * second, second], dim=-1)
        return self.o(mixed.reshape(b, s, DIM))


# ---- per-vocabulary scale on vocab-parallel logits, BERT-style encoder --------------------


class ScaledVocabLM(DecoderLM):
    """A learned per-vocabulary vector scales the logits (``logits * (scale.float() * c)``)."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention(), NanoGPTMLP()))
        self.vocab_scale = nn.Parameter(torch.linspace(0.5, 1.5, VOCAB))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return super().logits(h) * (self.vocab_scale.float() * 2.0)


class EncoderLayer(nn.Module):
    """Post-norm BERT layer with explicit softmax attention."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value, self.dense = (nn.Linear(DIM, DIM) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.intermediate, self.output = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).permute(0, 2, 1, 3) for t in (self.query(x), self.key(x), self.value(x)))
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), dim=-1)
        ctx = (probs @ v).permute(0, 2, 1, 3).contiguous().view(b, s, DIM)
        x = self.ln1(x + self.dense(ctx))
        return self.ln2(x + self.output(F.gelu(self.intermediate(x))))


class EncoderMLM(nn.Module):
    """BERT-style encoder: word + position + token-type embeddings, post-norm layers, an MLM
    head (dense, gelu, norm) tied to the word embeddings with a per-vocabulary bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.word, self.position, self.token_type = nn.Embedding(VOCAB, DIM), nn.Embedding(32, DIM), nn.Embedding(2, DIM)
        self.emb_norm = nn.LayerNorm(DIM)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(LAYERS))
        self.transform, self.transform_norm = nn.Linear(DIM, DIM), nn.LayerNorm(DIM)
        self.decoder_bias = nn.Parameter(torch.linspace(-0.1, 0.1, VOCAB))
        for table in (self.word, self.position, self.token_type):  # BERT's initializer range
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)
        x = self.word(input_ids) + self.position(pos)[None] + self.token_type(torch.zeros_like(input_ids))
        x = self.emb_norm(x)
        for layer in self.layers:
            x = layer(x)
        h = self.transform_norm(F.gelu(self.transform(x)))
        logits = F.linear(h, self.word.weight) + self.decoder_bias
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


MODELS: dict[str, Callable[[], nn.Module]] = {
    "nanogpt": NanoGPT,
    "titan_llama": TitanLlama,
    "gqa_repeat_interleave": lambda: DecoderLM(lambda: PreNormBlock(RepeatInterleaveAttention())),
    "mqa_partial_rotary": lambda: DecoderLM(lambda: PreNormBlock(MultiQueryPartialRotary())),
    "mqa_falcon_index": lambda: DecoderLM(lambda: PreNormBlock(FalconMultiQuery())),
    "mqa_broadcast_kv": lambda: DecoderLM(lambda: PreNormBlock(FalconBroadcastKV())),
    "empty_cache_cat": lambda: DecoderLM(lambda: PreNormBlock(EmptyCacheAttention())),
    "grouped_output_proj": lambda: DecoderLM(lambda: PreNormBlock(GroupedOutputAttention(), SwiGLU(hidden=DIM))),
    "mqa_sliced_key": lambda: DecoderLM(lambda: PreNormBlock(SlicedKeyMultiQuery())),
    "grouped_interleaved_qkv": lambda: DecoderLM(lambda: PreNormBlock(GroupedInterleavedQKV())),
    "neox_interleaved_qkv": lambda: DecoderLM(lambda: PreNormBlock(NeoXInterleavedQKV(), NanoGPTMLP())),
    "latent_attention": lambda: DecoderLM(lambda: PreNormBlock(LatentAttention(), norm=RMSNorm), norm=RMSNorm),
    "qk_norm_all_heads": lambda: DecoderLM(lambda: PreNormBlock(QKNormAttention(), norm=RMSNorm), norm=RMSNorm),
    "l2_gather_attention": lambda: DecoderLM(lambda: PreNormBlock(L2GatherAttention())),
    "paired_heads": lambda: DecoderLM(lambda: PreNormBlock(PairedHeadsAttention())),
    "scaled_vocab": ScaledVocabLM,
    "encoder_mlm": EncoderMLM,
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()
