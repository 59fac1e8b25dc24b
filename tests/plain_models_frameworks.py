"""Whole small models written the way other code bases write them (minGPT/nanoGPT, Meta's
reference Llama, lucidrains' x-transformers, DiT, Mamba2's SSD, RetNet, BERT, Perceiver,
OLMo/GPT-NeoX), each with the constructs of its code base that the other suite modules do
not have: a causal mask buffer sliced and ``masked_fill``ed with weights tied and the loss
returned in a tuple, a KV cache written by slice assignment in a training forward,
``nn.Sequential`` residual/pre-norm wrappers with token shift and a scalar scale norm, an
unpatchify ``einsum``, a chunked SSD scan with ``A_log``, a pooled classifier beside a tied
MLM decoder, parallel residual with ``clamp_`` of the fused qkv. ``build(name)`` makes one
in eval mode with fixed weights; ``example_inputs(name)`` its keyword inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DecoderLM

VOCAB, DIM, HEADS, HEAD_DIM, KV_HEADS, LAYERS, SEQ = 128, 64, 8, 8, 2, 2, 16


def _ce(logits: torch.Tensor, targets: torch.Tensor, **kw: Any) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), **kw)


# ---- minGPT: tril buffer, masked_fill, tied weights, forward(idx, targets) -> (logits, loss) ----


class CausalSelfAttention(nn.Module):
    def __init__(self, block_size: int = SEQ) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.n_head, self.n_embd = HEADS, DIM
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(DIM, 4 * DIM), c_proj=nn.Linear(4 * DIM, DIM), act=nn.GELU()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        x = x + self.attn(self.ln_1(x))
        return x + m.c_proj(m.act(m.c_fc(self.ln_2(x))))


class MinGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), wpe=nn.Embedding(SEQ, DIM),
            h=nn.ModuleList(GPTBlock() for _ in range(LAYERS)), ln_f=nn.LayerNorm(DIM)))  # fmt: skip
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = _ce(logits, targets, ignore_index=-1) if targets is not None else None
        return logits, loss


# ---- Meta's reference Llama: complex freqs_cis, repeat_kv by expand, a KV cache written in forward ----


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    shape = [d if i == 1 or i == xq_.ndim - 1 else 1 for i, d in enumerate(xq_.shape)]
    freqs_cis = freqs_cis.view(*shape)
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class LlamaRefRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.linspace(0.9, 1.1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LlamaRefAttention(nn.Module):
    def __init__(self, max_batch: int = 4, max_seq: int = SEQ) -> None:
        super().__init__()
        self.n_rep = HEADS // KV_HEADS
        self.wq, self.wo = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False), nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.wk, self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False), nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.register_buffer("cache_k", torch.zeros(max_batch, max_seq, KV_HEADS, HEAD_DIM), persistent=False)
        self.register_buffer("cache_v", torch.zeros(max_batch, max_seq, KV_HEADS, HEAD_DIM), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, HEADS, HEAD_DIM)
        xk = self.wk(x).view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        xv = self.wv(x).view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
        keys = repeat_kv(self.cache_k[:bsz, : start_pos + seqlen], self.n_rep).transpose(1, 2)
        values = repeat_kv(self.cache_v[:bsz, : start_pos + seqlen], self.n_rep).transpose(1, 2)
        xq = xq.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(HEAD_DIM)
        if mask is not None:
            scores = scores + mask
        output = torch.matmul(F.softmax(scores.float(), dim=-1).type_as(xq), values)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class LlamaRefFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden_dim, bias=False), nn.Linear(hidden_dim, dim, bias=False), nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaRefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = LlamaRefAttention()
        self.feed_forward = LlamaRefFeedForward(DIM, 4 * DIM, multiple_of=32, ffn_dim_multiplier=1.3)
        self.attention_norm, self.ffn_norm = LlamaRefRMSNorm(DIM), LlamaRefRMSNorm(DIM)

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaReference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(LlamaRefBlock() for _ in range(LAYERS))
        self.norm = LlamaRefRMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.freqs_cis = precompute_freqs_cis(HEAD_DIM, SEQ * 2)  # a plain attribute, as in the reference

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, start_pos: int = 0) -> dict[str, Any]:
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=tokens.device), diagonal=1)
            mask = torch.hstack([torch.zeros((seqlen, start_pos), device=tokens.device), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        logits = self.output(self.norm(h)).float()
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = _ce(logits, labels)
        return out


# ---- x-transformers style: nn.Sequential of Residual(PreNorm(...)), token shift, ScaleNorm, half rotary ----


class ScaleNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps, self.scale = eps, dim**-0.5
        self.g = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.norm(x, dim=-1, keepdim=True) * self.scale
        return x / norm.clamp(min=self.eps) * self.g


class Residual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) + x


class PreNorm(nn.Module):
    def __init__(self, dim: int, fn: nn.Module) -> None:
        super().__init__()
        self.norm, self.fn = ScaleNorm(dim), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(x))


class ShiftTokens(nn.Module):
    """Half the features come from the previous token (``F.pad`` over the sequence dim)."""

    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted, rest = x.chunk(2, dim=-1)
        shifted = F.pad(shifted, (0, 0, 1, -1), value=0.0)
        return self.fn(torch.cat((shifted, rest), dim=-1))


class GLUFeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 2) -> None:
        super().__init__()
        self.proj_in, self.proj_out = nn.Linear(dim, dim * mult * 2), nn.Linear(dim * mult, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(x * F.gelu(gate))


def rearrange_heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """``rearrange(t, 'b n (h d) -> b h n d', h=h)`` written out."""
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).permute(0, 2, 1, 3)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``rearrange(t, 'b h n d -> b n (h d)')`` written out."""
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)


class RotaryHalf(nn.Module):
    """Rotary over the first half of each head's dims (x-transformers' ``rotary_emb_dim = dim_head // 2``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        n, rot = t.shape[-2], self.inv_freq.shape[0] * 2
        freqs = torch.einsum("i,j->ij", torch.arange(n, device=t.device).float(), self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        t_rot, t_pass = t[..., :rot], t[..., rot:]
        x1, x2 = t_rot.chunk(2, dim=-1)
        t_rot = t_rot * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()
        return torch.cat((t_rot, t_pass), dim=-1)


class XAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.to_q, self.to_kv, self.to_out = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, dim)
        self.rotary = RotaryHalf(HEAD_DIM // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = rearrange_heads(self.to_q(x), HEADS)
        k, v = (rearrange_heads(t, HEADS) for t in self.to_kv(x).chunk(2, dim=-1))
        q, k = self.rotary(q), self.rotary(k)
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * HEAD_DIM**-0.5
        i = sim.shape[-1]
        causal = torch.ones(i, i, device=x.device, dtype=torch.bool).triu(1)
        sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v)
        return self.to_out(merge_heads(out))


class XTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.Sequential(*[
            nn.Sequential(Residual(PreNorm(DIM, ShiftTokens(XAttention(DIM)))), Residual(PreNorm(DIM, ShiftTokens(GLUFeedForward(DIM)))))
            for _ in range(LAYERS)])  # fmt: skip
        self.norm = ScaleNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.to_logits(self.norm(self.layers(self.token_emb(input_ids))))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = _ce(logits, labels)
        return out


# ---- DiT: sinusoidal timestep embedding + MLP, adaLN-Zero, an einsum unpatchify ----------------

PATCH, IMAGE, CHANNELS = 4, 16, 3


def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_size: int = 32) -> None:
        super().__init__()
        self.freq_size = freq_size
        self.mlp = nn.Sequential(nn.Linear(freq_size, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.freq_size))


class DiTAttention(nn.Module):
    """timm's ``Attention``: ``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)`` then indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class DiTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.attn = DiTAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(approximate="tanh"), nn.Linear(4 * DIM, DIM))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 6 * DIM, bias=True))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(self.norm1(x) * (1 + scale_msa.unsqueeze(1)) + shift_msa.unsqueeze(1))
        return x + gate_mlp.unsqueeze(1) * self.mlp(self.norm2(x) * (1 + scale_mlp.unsqueeze(1)) + shift_mlp.unsqueeze(1))


class DiTUnpatchify(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x_embedder = nn.Conv2d(CHANNELS, DIM, kernel_size=PATCH, stride=PATCH, bias=True)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2, DIM) * 0.02)
        self.t_embedder = TimestepEmbedder(DIM)
        self.blocks = nn.ModuleList(DiTBlock() for _ in range(LAYERS))
        self.norm_final = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.final_adaLN = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 2 * DIM))
        self.final_linear = nn.Linear(DIM, PATCH * PATCH * CHANNELS)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        c, p = CHANNELS, PATCH
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, h * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.t_embedder(t)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_adaLN(c).chunk(2, dim=1)
        x = self.final_linear(self.norm_final(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1))
        pred = self.unpatchify(x)
        out: dict[str, Any] = {"logits": pred}
        if noise is not None:
            out["loss"] = ((pred - noise) ** 2).mean()
        return out


# ---- Mamba2 SSD: a chunked scan with segment sums, A_log / dt_bias / D per head ------------------

CHUNK = 4


def segsum(x: torch.Tensor) -> torch.Tensor:
    """Stable segment sum: ``out[..., i, j] = sum(x[..., j+1:i+1])`` below the diagonal, -inf above."""
    T = x.size(-1)
    x = x[..., None].repeat(*([1] * x.dim()), T)
    mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    x_segsum = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=0)
    return x_segsum.masked_fill(~mask, -torch.inf)


def ssd_scan(X: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """The reference 'minimal' SSD: X [b, l, h, p], A [b, l, h], B/C [b, l, h, n]."""
    b, l, h, p = X.shape
    X, A, B, C = (t.reshape(b, l // CHUNK, CHUNK, *t.shape[2:]) for t in (X, A, B, C))
    A = A.permute(0, 3, 1, 2)  # b h c l
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segsum(A))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, X)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, new_states, torch.exp(A_cumsum))
    return (Y_diag + Y_off).reshape(b, l, h, p)


class SSDMixer(nn.Module):
    """Separate x/z/B/C/dt projections (B and C per head), the SSD scan, a gated output."""

    STATE = 8

    def __init__(self) -> None:
        super().__init__()
        self.in_x, self.in_z = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.in_bc = nn.Linear(DIM, 2 * HEADS * self.STATE, bias=False)
        self.in_dt = nn.Linear(DIM, HEADS, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 4.0, HEADS)))
        self.dt_bias = nn.Parameter(torch.linspace(-1.0, 0.5, HEADS))
        self.D = nn.Parameter(torch.linspace(0.5, 1.5, HEADS))
        self.out_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        b, l, _ = u.shape
        x = self.in_x(u).view(b, l, HEADS, HEAD_DIM)
        Bm, Cm = self.in_bc(u).view(b, l, 2 * HEADS, self.STATE).chunk(2, dim=2)
        dt = F.softplus(self.in_dt(u) + self.dt_bias)  # [b, l, h]
        A = -torch.exp(self.A_log.float())
        y = ssd_scan(x * dt.unsqueeze(-1), A * dt, Bm, Cm)
        y = y + x * self.D[:, None]
        return self.out_proj(y.reshape(b, l, DIM) * F.silu(self.in_z(u)))


class SSDBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mixer = LlamaRefRMSNorm(DIM), SSDMixer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


# ---- RetNet-style retention: decay exp(log_gamma * (n - m)) masked_fill, F.group_norm with weights ----


class ExpDecayRetention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.g_proj, self.out_proj = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.gn_weight, self.gn_bias = nn.Parameter(torch.linspace(0.8, 1.2, DIM)), nn.Parameter(torch.linspace(-0.1, 0.1, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        log_gamma = torch.log(1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), HEADS, device=x.device)))
        idx = torch.arange(s, device=x.device)
        dist = (idx[:, None] - idx[None, :]).float()
        decay = torch.exp(log_gamma[:, None, None] * dist).masked_fill(dist < 0, 0.0)
        decay = decay / decay.sum(dim=-1, keepdim=True).sqrt()
        y = (q @ k.transpose(-1, -2) * decay) @ v  # [b, h, s, d]
        y = F.group_norm(y.permute(0, 2, 1, 3).reshape(b * s, HEADS * HEAD_DIM), HEADS, self.gn_weight, self.gn_bias)
        return self.out_proj(F.silu(self.g_proj(x)) * y.view(b, s, DIM))


class RetBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.retention = ExpDecayRetention()
        self.ffn = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.retention(self.ln1(x))
        return x + self.ffn(self.ln2(x))


# ---- BERT: token types, post-LN, extended additive mask, pooler + classifier, tied MLM decoder with a bias ----

CLASSES = 3


class BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(DIM, DIM) for _ in range(3))
        self.attn_out, self.attn_ln = nn.Linear(DIM, DIM), nn.LayerNorm(DIM, eps=1e-12)
        self.intermediate, self.output, self.out_ln = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), nn.LayerNorm(DIM, eps=1e-12)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size()[:-1] + (HEADS, HEAD_DIM)).permute(0, 2, 1, 3)

    def forward(self, hidden: torch.Tensor, extended_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.transpose_for_scores(p(hidden)) for p in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM) + extended_mask
        ctx = torch.matmul(nn.functional.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
        ctx = ctx.view(ctx.size()[:-2] + (DIM,))
        hidden = self.attn_ln(self.attn_out(ctx) + hidden)
        return self.out_ln(self.output(F.gelu(self.intermediate(hidden))) + hidden)


class BertPretraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings, self.position_embeddings = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.token_type_embeddings, self.emb_ln = nn.Embedding(2, DIM), nn.LayerNorm(DIM, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer() for _ in range(LAYERS))
        self.pooler, self.classifier = nn.Linear(DIM, DIM), nn.Linear(DIM, CLASSES)
        self.transform, self.transform_ln = nn.Linear(DIM, DIM), nn.LayerNorm(DIM, eps=1e-12)
        self.decoder = nn.Linear(DIM, VOCAB, bias=False)
        self.decoder_bias = nn.Parameter(torch.linspace(-0.1, 0.1, VOCAB))
        self.decoder.weight = self.word_embeddings.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT's initializer (``initializer_range`` 0.02); the tied decoder shares the embedding's."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None, next_sentence_label: torch.Tensor | None = None) -> dict[str, Any]:  # fmt: skip
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        h = self.emb_ln(self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids))
        extended = attention_mask[:, None, None, :].to(h.dtype)
        extended = (1.0 - extended) * torch.finfo(h.dtype).min
        for layer in self.layers:
            h = layer(h, extended)
        pooled = torch.tanh(self.pooler(h[:, 0]))
        seq_rel = self.classifier(pooled)
        logits = self.decoder(self.transform_ln(F.gelu(self.transform(h)))) + self.decoder_bias
        out: dict[str, Any] = {"logits": logits, "seq_relationship_logits": seq_rel}
        if labels is not None and next_sentence_label is not None:
            out["loss"] = _ce(logits, labels, ignore_index=-100) + F.cross_entropy(seq_rel, next_sentence_label)
        return out


# ---- Perceiver: latents cross-attend with a fused to_kv, a latent self-attention stack, mean pooling ----


class LatentAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_kv, self.to_out = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        b, n, _ = q.shape
        q, k, v = (t.reshape(b, t.shape[1], HEADS, HEAD_DIM).permute(0, 2, 1, 3).reshape(b * HEADS, t.shape[1], HEAD_DIM) for t in (q, k, v))
        attn = torch.einsum("b i d, b j d -> b i j", q, k).mul(HEAD_DIM**-0.5).softmax(dim=-1)
        out = torch.einsum("b i j, b j d -> b i d", attn, v)
        return self.to_out(out.reshape(b, HEADS, n, HEAD_DIM).permute(0, 2, 1, 3).reshape(b, n, DIM))


class PerceiverClassifier(nn.Module):
    LATENTS = 8

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.latents = nn.Parameter(torch.randn(self.LATENTS, DIM))
        self.cross_norm, self.context_norm, self.cross = nn.LayerNorm(DIM), nn.LayerNorm(DIM), LatentAttention()
        self.cross_ff = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.self_attn = nn.ModuleList(nn.ModuleList([nn.LayerNorm(DIM), LatentAttention(), nn.LayerNorm(DIM),
                                                      nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))])
                                       for _ in range(LAYERS))  # fmt: skip
        self.to_logits = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        data = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        x = self.latents[None].repeat(input_ids.shape[0], 1, 1)
        x = self.cross(self.cross_norm(x), context=self.context_norm(data)) + x
        x = self.cross_ff(x) + x
        for n1, attn, n2, ff in self.self_attn:
            x = attn(n1(x)) + x
            x = ff(n2(x)) + x
        logits = self.to_logits(x.mean(dim=-2))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


# ---- OLMo / GPT-NeoX: parallel residual, partial rotary, qk-norm over all heads, no biases, clamp_ ----


class OlmoParallelBlock(nn.Module):
    ROTARY_PCT, CLIP_QKV = 0.25, 4.0

    def __init__(self) -> None:
        super().__init__()
        self.att_proj = nn.Linear(DIM, 3 * DIM, bias=False)
        self.q_norm, self.k_norm = nn.LayerNorm(DIM, bias=False), nn.LayerNorm(DIM, bias=False)
        self.attn_out = nn.Linear(DIM, DIM, bias=False)
        self.ff_proj, self.ff_out = nn.Linear(DIM, 2 * 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)
        self.attn_norm, self.ff_norm = nn.LayerNorm(DIM, bias=False), nn.LayerNorm(DIM, bias=False)
        rot = int(HEAD_DIM * self.ROTARY_PCT)
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        freqs = torch.outer(torch.arange(SEQ).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        rot = self.cos_cached.shape[-1]
        t_rot, t_pass = t[..., :rot], t[..., rot:]
        s = t.shape[-2]
        x1, x2 = t_rot[..., : rot // 2], t_rot[..., rot // 2 :]
        t_rot = t_rot * self.cos_cached[:, :, :s] + torch.cat((-x2, x1), dim=-1) * self.sin_cached[:, :, :s]
        return torch.cat((t_rot, t_pass), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.att_proj(self.attn_norm(x))
        qkv.clamp_(min=-self.CLIP_QKV, max=self.CLIP_QKV)
        q, k, v = qkv.split(DIM, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        att = self.attn_out(att.transpose(1, 2).reshape(b, s, DIM))
        h, gate = self.ff_proj(self.ff_norm(x)).chunk(2, dim=-1)
        return x + att + self.ff_out(F.silu(gate) * h)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mingpt_tied_tuple": MinGPT,
    "llama_reference_kv_cache": LlamaReference,
    "xtransformers_sequential": XTransformer,
    "dit_unpatchify_timestep": DiTUnpatchify,
    "mamba2_ssd_chunked": lambda: DecoderLM(SSDBlock),
    "retention_exp_decay": lambda: DecoderLM(RetBlock),
    "bert_pretraining": BertPretraining,
    "perceiver_classifier": PerceiverClassifier,
    "olmo_parallel_clip": lambda: DecoderLM(OlmoParallelBlock),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 4, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Keyword inputs of model ``name``, the same on every call."""
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    if name == "mingpt_tied_tuple":
        labels[:, :2] = -1
        return {"idx": ids, "targets": labels}
    if name == "llama_reference_kv_cache":
        return {"tokens": ids, "labels": labels}
    if name == "dit_unpatchify_timestep":
        return {"x": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen), "t": torch.randint(0, 1000, (batch,), generator=gen).float(),
                "noise": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen)}  # fmt: skip
    if name == "bert_pretraining":
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, seq - 5 :] = 0
        labels[:, ::2] = -100
        return {"input_ids": ids, "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous(),
                "attention_mask": mask, "labels": labels, "next_sentence_label": torch.randint(0, CLASSES, (batch,), generator=gen)}  # fmt: skip
    if name == "perceiver_classifier":
        return {"input_ids": ids, "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    return {"input_ids": ids, "labels": labels}
