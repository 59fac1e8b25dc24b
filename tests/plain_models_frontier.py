"""Small plain-PyTorch models with constructs of recent architectures and of code ported from
JAX (issue 27, eighth round): what the earlier rounds did not write.

Qwen2-VL's multimodal rotary (three position rows, the frequency bands taken from each in
sections); Qwen3-Next's gated attention output (a query projection twice as wide, split per
head into the query and a sigmoid gate); MatFormer's elastic FFN (the first ``k`` rows of the
weights, sliced in the forward); SD3's joint attention over text and image tokens, each with
its own weights; an S4D layer (complex parameters, a convolution kernel from ``exp`` of a
complex product, FFT convolution); ``nn.Embedding(max_norm=...)``, which renormalizes the
rows it reads in place; ``torch.cond`` choosing a branch by the data; JAX's ``DenseGeneral``
(``torch.tensordot`` against ``[C, H, D]`` and ``[H, D, C]`` weights); a chunked delta rule
whose UT transform is ``torch.linalg.solve_triangular``; ResFormer's value residual (the first
layer's values mixed into every later layer's); top-p routing (sort, cumsum, a mask); FNet's
Fourier mixing; heads laid out minor (einops ``(d h)``); a temporal channel shift on a slice
of the FFN's channels; Gemma 3n's per-layer embeddings (a second vocabulary table whose
columns each layer slices) and LAuReL's low-rank residual; AltUp's predicted residual streams.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, RMSNorm, SwiGLU, lm_loss, rotate_half

SEQ = 16


def split_heads(t: torch.Tensor) -> torch.Tensor:
    """[B, S, H*D] -> [B, H, S, D]."""
    return t.view(t.shape[0], t.shape[1], HEADS, -1).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H*D]."""
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


# ---- Qwen2-VL: multimodal rotary with sections ----------------------------------------------

MROPE_SECTION = (2, 1, 1)  # frequency bands of (time, height, width); sums to HEAD_DIM / 2


class MultimodalRotaryAttention(nn.Module):
    """q/k/v with biases; ``position_ids`` [3, B, S] give each token a (t, h, w) position; the
    cos and sin of each row are cut into sections and section ``i`` is taken from row ``i % 3``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), persistent=False)

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [3, B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sections = list(MROPE_SECTION) * 2
        cos = torch.cat([m[i % 3] for i, m in enumerate(emb.cos().split(sections, dim=-1))], dim=-1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(emb.sin().split(sections, dim=-1))], dim=-1)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(self.q_proj(x)), split_heads(self.k_proj(x)), split_heads(self.v_proj(x))
        cos, sin = self.cos_sin(position_ids)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return self.o_proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class SideInputLM(nn.Module):
    """A pre-norm decoder LM whose attention layers also read one more input of the model's
    (``run``); each subclass names that input in its ``forward``."""

    def __init__(self, attention: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attns = nn.ModuleList(attention() for _ in range(LAYERS))
        self.mlps = nn.ModuleList(SwiGLU() for _ in range(LAYERS))
        self.norms = nn.ModuleList(RMSNorm(DIM) for _ in range(2 * LAYERS + 1))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def run(self, input_ids: torch.Tensor, side: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids)
        for i, (attn, mlp) in enumerate(zip(self.attns, self.mlps)):
            h = h + attn(self.norms[2 * i](h), side)
            h = h + mlp(self.norms[2 * i + 1](h))
        logits = self.lm_head(self.norms[-1](h))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


class MultimodalRotaryLM(SideInputLM):
    def __init__(self) -> None:
        super().__init__(MultimodalRotaryAttention)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return self.run(input_ids, position_ids, labels)


def mrope_positions(batch: int, seq: int) -> torch.Tensor:
    """[3, B, S]: 4 text tokens, a 2x4 grid of image patches (one time step), then text."""
    t, hgt, wid = (torch.arange(seq) for _ in range(3))
    image = slice(4, 12)
    t[image], hgt[image], wid[image] = 4, 4 + torch.arange(8) // 4, 4 + torch.arange(8) % 4
    after = torch.arange(seq - 12) + 8
    t[12:], hgt[12:], wid[12:] = after, after, after
    return torch.stack([t, hgt, wid])[:, None, :].expand(3, batch, seq).contiguous()


# ---- Qwen3-Next: a gated attention output -------------------------------------------------


class GatedOutputAttention(nn.Module):
    """The query projection holds each head's query and its gate side by side
    (``view(B, S, H, 2*D).chunk(2, -1)``); the attention output is scaled by ``sigmoid(gate)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, 2 * HEADS * HEAD_DIM, bias=False)
        self.k_proj, self.v_proj = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.q_norm, self.k_norm = RMSNorm(HEAD_DIM), RMSNorm(HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, gate = self.q_proj(x).view(b, s, HEADS, 2 * HEAD_DIM).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, HEADS, HEAD_DIM)).transpose(1, 2)
        out = merge_heads(F.scaled_dot_product_attention(q, k, split_heads(self.v_proj(x)), is_causal=True))
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, s, -1)))


# ---- MatFormer: an FFN whose width is chosen in the forward ------------------------------------

ELASTIC_HIDDEN, ELASTIC_ACTIVE = 4 * DIM, 3 * DIM


class ElasticFFN(nn.Module):
    """The full FFN is ``ELASTIC_HIDDEN`` wide; this submodel uses its first ``ELASTIC_ACTIVE``
    channels, slicing the weights in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, ELASTIC_HIDDEN, bias=False)
        self.down = nn.Linear(ELASTIC_HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(x, self.up.weight[:ELASTIC_ACTIVE]))
        return F.linear(h, self.down.weight[:, :ELASTIC_ACTIVE])


# ---- SD3's MMDiT: joint attention over two token streams --------------------------------------

PATCH_DIM, PATCHES = 16, 8


class JointBlock(nn.Module):
    """Text and image tokens, each with its own norms, q/k/v, output projection and MLP; the
    attention runs over both streams concatenated along the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(4))
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.mlps = nn.ModuleList(SwiGLU() for _ in range(2))

    def forward(self, txt: torch.Tensor, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.qkv[i](self.norms[i](t)).chunk(3, dim=-1) for i, t in enumerate((txt, img))]
        q, k, v = (torch.cat([split_heads(p[j]) for p in parts], dim=2) for j in range(3))
        y = merge_heads(F.scaled_dot_product_attention(q, k, v))
        y_txt, y_img = y.split([txt.shape[1], img.shape[1]], dim=1)
        txt, img = txt + self.out[0](y_txt), img + self.out[1](y_img)
        return txt + self.mlps[0](self.norms[2](txt)), img + self.mlps[1](self.norms[3](img))


class JointDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.patch_in = nn.Linear(PATCH_DIM, DIM)
        self.blocks = nn.ModuleList(JointBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.patch_out = nn.Linear(DIM, PATCH_DIM)

    def forward(self, input_ids: torch.Tensor, patches: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        txt, img = self.embed(input_ids), self.patch_in(patches)
        for block in self.blocks:
            txt, img = block(txt, img)
        logits = self.lm_head(self.norm(txt))
        loss = lm_loss(logits, labels) + F.mse_loss(self.patch_out(self.norm(img)), patches)
        return {"logits": logits, "loss": loss}


# ---- S4D: complex diagonal state space, FFT convolution ---------------------------------------

STATE = 8


class S4DMixer(nn.Module):
    """Per channel: ``A = -exp(log_a) + i·a_imag`` and complex ``C`` ([H, N/2, 2] viewed as
    complex), the kernel ``K[h, l] = 2·Re(Σ_n C·(exp(dt·A) − 1)/A · exp(dt·A·l))``, and the
    causal convolution by ``rfft`` of length 2L; channels are the input projection's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.log_dt = nn.Parameter(torch.linspace(math.log(1e-3), math.log(1e-1), DIM))
        self.log_a = nn.Parameter(torch.log(0.5 * torch.ones(DIM, STATE // 2)))
        self.a_imag = nn.Parameter(math.pi * torch.arange(STATE // 2).float().repeat(DIM, 1))
        self.c = nn.Parameter(torch.randn(DIM, STATE // 2, 2) * 0.5)
        self.d = nn.Parameter(torch.randn(DIM))

    def kernel(self, length: int) -> torch.Tensor:
        dt_a = torch.complex(-torch.exp(self.log_a), self.a_imag) * torch.exp(self.log_dt)[:, None]
        c = torch.view_as_complex(self.c) * (torch.exp(dt_a) - 1.0) / (dt_a / torch.exp(self.log_dt)[:, None])
        powers = torch.exp(dt_a[..., None] * torch.arange(length, device=dt_a.device))
        return 2 * torch.einsum("hn,hnl->hl", c, powers).real

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.in_proj(x).transpose(1, 2)  # [B, H, L]
        length = u.shape[-1]
        k = self.kernel(length)
        y = torch.fft.irfft(torch.fft.rfft(u, n=2 * length) * torch.fft.rfft(k, n=2 * length), n=2 * length)[..., :length]
        y = y + u * self.d[:, None]
        return self.out_proj(F.gelu(y).transpose(1, 2))


# ---- nn.Embedding(max_norm=...) ------------------------------------------------------------


class MaxNormEmbeddingLM(DecoderLM):
    """The token table renormalizes each row it reads to norm at most 1 (in place, no grad)."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.embed = nn.Embedding(VOCAB, DIM, max_norm=1.0)


# ---- torch.cond: a branch chosen by the data -------------------------------------------------


class ConditionalRefine(nn.Module):
    """An MLP whose output runs through a refinement projection only when its mean magnitude
    exceeds a threshold (``torch.cond``: both branches are traced, one runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = SwiGLU()
        self.refine = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(x)
        return torch.cond(h.abs().mean() > 1e-3, lambda t: t + self.refine(t), lambda t: t.clone(), (h,))


# ---- JAX's DenseGeneral: tensordot with [C, H, D] and [H, D, C] weights -----------------------


class DenseGeneralAttention(nn.Module):
    """Projections as ported from Flax: ``tensordot(x, w_q, dims=1)`` against ``[C, H, D]``
    weights, and the output ``tensordot(o, w_o, dims=([2, 3], [0, 1]))`` against ``[H, D, C]``."""

    def __init__(self) -> None:
        super().__init__()
        self.w_q, self.w_k, self.w_v = (nn.Parameter(torch.randn(DIM, HEADS, HEAD_DIM) / math.sqrt(DIM)) for _ in range(3))
        self.w_o = nn.Parameter(torch.randn(HEADS, HEAD_DIM, DIM) / math.sqrt(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.tensordot(x, w, dims=1).transpose(1, 2) for w in (self.w_q, self.w_k, self.w_v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)  # [B, S, H, D]
        return torch.tensordot(o, self.w_o, dims=([2, 3], [0, 1]))


# ---- a chunked delta rule with the UT transform -------------------------------------------------

CHUNK = 8


class ChunkedDeltaRule(nn.Module):
    """DeltaNet in chunks: within a chunk, ``T = (I + tril(diag(β)·K·Kᵀ, -1))⁻¹`` by
    ``solve_triangular``, ``W = T·(β·K)``, ``U = T·(β·V)``; the state ``S`` [D, D] per head
    carries across chunks: ``O = Q·S + tril(Q·Kᵀ)·(U − W·S)``, ``S += Kᵀ·(U − W·S)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.beta = nn.Linear(DIM, HEADS, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = torch.sigmoid(self.beta(x)).transpose(1, 2)[..., None]  # [B, H, S, 1]
        eye = torch.eye(CHUNK, device=x.device)
        state = torch.zeros(b, HEADS, HEAD_DIM, HEAD_DIM, device=x.device)
        outs = []
        for c in range(s // CHUNK):
            part = slice(c * CHUNK, (c + 1) * CHUNK)
            qc, kc, vc, bc = q[:, :, part], k[:, :, part], v[:, :, part], beta[:, :, part]
            a = torch.tril((bc * kc) @ kc.transpose(-1, -2), diagonal=-1)
            t = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False)
            w, u = t @ (bc * kc), t @ (bc * vc)
            new = u - w @ state
            outs.append(qc @ state + torch.tril(qc @ kc.transpose(-1, -2)) @ new)
            state = state + kc.transpose(-1, -2) @ new
        return self.o_proj(merge_heads(torch.cat(outs, dim=2)))


# ---- ResFormer: every layer mixes in the first layer's values ----------------------------------


class ValueResidualAttention(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))

    def forward(self, x: torch.Tensor, v_first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        if v_first is None:
            v_first = v
        else:
            v = self.lambdas[0] * v + self.lambdas[1] * v_first
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))), v_first


class ValueResidualLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attns = nn.ModuleList(ValueResidualAttention(i == 0) for i in range(LAYERS + 1))
        self.mlps = nn.ModuleList(SwiGLU() for _ in range(LAYERS + 1))
        self.norms = nn.ModuleList(RMSNorm(DIM) for _ in range(2 * LAYERS + 3))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h, v_first = self.embed(input_ids), None
        for i, (attn, mlp) in enumerate(zip(self.attns, self.mlps)):
            a, v_first = attn(self.norms[2 * i](h), v_first)
            h = h + a
            h = h + mlp(self.norms[2 * i + 1](h))
        logits = self.lm_head(self.norms[-1](h))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- top-p routing ------------------------------------------------------------------------------


class TopPMoE(nn.Module):
    """Each token takes the fewest experts whose probabilities sum past ``TOP_P`` (sorted,
    cumsum, a mask scattered back to expert order); experts run densely, weighted."""

    EXPERTS, TOP_P = 4, 0.6

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU(DIM, DIM) for _ in range(self.EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < self.TOP_P
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        weights = probs * keep
        weights = weights / weights.sum(-1, keepdim=True)
        return sum(weights[..., e, None] * expert(x) for e, expert in enumerate(self.experts))


# ---- FNet: Fourier mixing ----------------------------------------------------------------------


class FourierMixer(nn.Module):
    """``Re(FFT_seq(FFT_hidden(x)))`` in place of attention."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(torch.fft.fft(x.float(), dim=-1), dim=-2).real.type_as(x)


class FNetEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.mixers = nn.ModuleList(FourierMixer() for _ in range(LAYERS))
        self.ffns = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)) for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2 * LAYERS))
        self.mlm_head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for i, (mixer, ffn) in enumerate(zip(self.mixers, self.ffns)):
            h = self.norms[2 * i](h + mixer(h))
            h = self.norms[2 * i + 1](h + ffn(h))
        logits = self.mlm_head(h)
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- heads laid out minor: einops' "(d h)" ------------------------------------------------------


class HeadsMinorAttention(nn.Module):
    """``rearrange(t, 'b s (d h) -> b h s d')``: each projection's output is ordered by head
    dim first and head second, so a contiguous block of its channels spans every head."""

    def __init__(self) -> None:
        super().__init__()
        self.to_qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEAD_DIM, HEADS).permute(0, 3, 1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.permute(0, 2, 3, 1).reshape(b, s, DIM))


# ---- a temporal shift of some FFN channels --------------------------------------------------------

SHIFTED = DIM // 2


class ChannelShiftFFN(nn.Module):
    """TSM's shift inside the FFN: the first ``SHIFTED`` hidden channels come from the previous
    token (``torch.roll`` along the sequence, the first position zeroed)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        shifted = torch.roll(h[..., :SHIFTED], shifts=1, dims=1)
        shifted = torch.cat([torch.zeros_like(shifted[:, :1]), shifted[:, 1:]], dim=1)
        return self.down(torch.cat([shifted, h[..., SHIFTED:]], dim=-1))


# ---- Gemma 3n: per-layer embeddings, LAuReL, AltUp ----------------------------------------------

PER_LAYER, LAUREL_RANK, STREAMS = 16, 4, 2


class Gemma3nStyleLM(nn.Module):
    """A second vocabulary table ``[V, LAYERS * P]`` read once; layer ``i`` gates its slice
    ``[..., i, :]`` into the residual. Each block adds LAuReL's ``B(A(x))`` (rank 4) beside
    attention, and the residual is carried as ``STREAMS`` AltUp streams: a router mixes them into
    a prediction, the block runs on stream 0, and the correction is added to every stream."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.per_layer_embed = nn.Embedding(VOCAB, LAYERS * PER_LAYER)
        self.blocks = nn.ModuleList(PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS))
        self.laurel_a = nn.ModuleList(nn.Linear(DIM, LAUREL_RANK, bias=False) for _ in range(LAYERS))
        self.laurel_b = nn.ModuleList(nn.Linear(LAUREL_RANK, DIM, bias=False) for _ in range(LAYERS))
        self.per_layer_gate = nn.ModuleList(nn.Linear(DIM, PER_LAYER, bias=False) for _ in range(LAYERS))
        self.per_layer_proj = nn.ModuleList(nn.Linear(PER_LAYER, DIM, bias=False) for _ in range(LAYERS))
        self.altup_router = nn.ModuleList(nn.Linear(DIM, STREAMS * STREAMS, bias=False) for _ in range(LAYERS))
        self.altup_correct = nn.Parameter(torch.ones(LAYERS, STREAMS))
        self.stream_proj = nn.Linear(DIM, DIM, bias=False)
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        b, s = input_ids.shape
        x = self.embed(input_ids)
        per_layer = self.per_layer_embed(input_ids).view(b, s, LAYERS, PER_LAYER)
        streams = torch.stack([x, self.stream_proj(x)])  # [K, B, S, C]
        for i, block in enumerate(self.blocks):
            mix = torch.tanh(self.altup_router[i](streams[0])).view(b, s, STREAMS, STREAMS)
            predicted = streams + torch.einsum("bsij,jbsc->ibsc", mix, streams)
            active = predicted[0]
            out = block(active) + self.laurel_b[i](self.laurel_a[i](active))
            out = out + self.per_layer_proj[i](F.gelu(self.per_layer_gate[i](out)) * per_layer[:, :, i])
            streams = predicted + self.altup_correct[i][:, None, None, None] * (out - active)
        logits = self.lm_head(self.norm(streams.mean(0)))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- sparsemax attention ------------------------------------------------------------------------


def sparsemax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Martins & Astudillo's sparsemax: the Euclidean projection onto the simplex (sort, cumsum,
    the support's threshold)."""
    z, _ = scores.sort(dim=dim, descending=True)
    k = torch.arange(1, scores.shape[dim] + 1, device=scores.device, dtype=scores.dtype)
    shape = [1] * scores.dim()
    shape[dim] = -1
    k = k.view(shape)
    support = (1 + k * z) > z.cumsum(dim)
    k_z = support.sum(dim=dim, keepdim=True)
    tau = ((z * support).sum(dim=dim, keepdim=True) - 1) / k_z
    return torch.clamp(scores - tau, min=0)


class SparsemaxAttention(nn.Module):
    """Causal attention whose probabilities are sparsemax's, not softmax's."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        s = x.shape[1]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), -1e4)
        return self.proj(merge_heads(sparsemax(scores) @ v))


# ---- DeepSeek sparse attention: a lightning indexer picks each query's keys ----------------------

INDEX_HEADS, INDEX_DIM, SELECTED = 2, 8, 4


class IndexerSelectedAttention(nn.Module):
    """A small indexer (``INDEX_HEADS`` heads of ``relu(q_I · k_I)``, weighted per token and
    summed) scores every earlier key; each query attends to its ``SELECTED`` best keys, gathered
    per query (``torch.gather`` over the key dim of ``[B, H, S, S_sel, D]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.index_q = nn.Linear(DIM, INDEX_HEADS * INDEX_DIM, bias=False)
        self.index_k = nn.Linear(DIM, INDEX_DIM, bias=False)
        self.index_w = nn.Linear(DIM, INDEX_HEADS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        iq = self.index_q(x).view(b, s, INDEX_HEADS, INDEX_DIM)
        index = torch.einsum("bshd,btd->bsht", iq, self.index_k(x)).relu()
        index = (index * self.index_w(x)[..., None]).sum(2)  # [B, S, S]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        picked = index.masked_fill(future, float("-inf")).topk(SELECTED, dim=-1).indices  # [B, S, K]
        picked = torch.minimum(picked, torch.arange(s, device=x.device)[:, None])  # rows with fewer earlier keys repeat themselves
        gather_at = picked[:, None, :, :, None].expand(b, HEADS, s, SELECTED, HEAD_DIM)
        keys = torch.gather(k[:, :, None].expand(b, HEADS, s, s, HEAD_DIM), 3, gather_at)
        values = torch.gather(v[:, :, None].expand(b, HEADS, s, s, HEAD_DIM), 3, gather_at)
        probs = (torch.einsum("bhsd,bhskd->bhsk", q, keys) / math.sqrt(HEAD_DIM)).softmax(-1)
        return self.proj(merge_heads(torch.einsum("bhsk,bhskd->bhsd", probs, values)))


# ---- a prefix LM: bidirectional over each row's prefix, causal after it ----------------------------


class PrefixLMAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, prefix_len: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        pos = torch.arange(x.shape[1], device=x.device)
        allowed = (pos[None, :, None] >= pos[None, None, :]) | (pos[None, None, :] < prefix_len[:, None, None])
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])))


class PrefixLM(SideInputLM):
    """PaliGemma's mask: ``prefix_len`` [B] tokens of each row see each other."""

    def __init__(self) -> None:
        super().__init__(PrefixLMAttention)

    def forward(self, input_ids: torch.Tensor, prefix_len: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return self.run(input_ids, prefix_len, labels)


# ---- multiway FFNs: one expert per modality, chosen by a token mask ---------------------------------


class MultiwayLM(nn.Module):
    """BEiT-3 / VLMo: shared attention, and each token's FFN chosen by its modality
    (``torch.where(is_image, image_ffn(x), text_ffn(x))``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attns = nn.ModuleList(NanoGPTAttention() for _ in range(LAYERS))
        self.text_ffns = nn.ModuleList(SwiGLU() for _ in range(LAYERS))
        self.image_ffns = nn.ModuleList(SwiGLU() for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2 * LAYERS + 1))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, is_image: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids)
        for i, attn in enumerate(self.attns):
            h = h + attn(self.norms[2 * i](h))
            x = self.norms[2 * i + 1](h)
            h = h + torch.where(is_image[..., None], self.image_ffns[i](x), self.text_ffns[i](x))
        logits = self.lm_head(self.norms[-1](h))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- a mixture of LoRA experts beside a shared projection --------------------------------------------

LORA_EXPERTS, LORA_RANK = 4, 4


class LoraExpertsFFN(nn.Module):
    """A dense FFN plus a softly routed mixture of low-rank experts on its up projection, the
    experts stacked ``[E, r, C]`` and ``[E, 4C, r]`` and combined by one three-operand einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)
        self.router = nn.Linear(DIM, LORA_EXPERTS, bias=False)
        self.lora_a = nn.Parameter(torch.randn(LORA_EXPERTS, LORA_RANK, DIM) / math.sqrt(DIM))
        self.lora_b = nn.Parameter(torch.randn(LORA_EXPERTS, 4 * DIM, LORA_RANK) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        low = torch.einsum("bsc,erc->bser", x, self.lora_a)
        h = self.up(x) + torch.einsum("bser,eor,bse->bso", low, self.lora_b, gates)
        return self.down(F.gelu(h))


def decoder_of(attention: Callable[[], nn.Module], mlp: Callable[[], nn.Module] = SwiGLU) -> Callable[[], nn.Module]:
    """A maker of the pre-norm ``DecoderLM`` whose blocks hold ``attention()`` and ``mlp()``."""
    return lambda: DecoderLM(lambda: PreNormBlock(attention(), mlp()))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "multimodal_rotary_sections": MultimodalRotaryLM,
    "gated_attention_output": decoder_of(GatedOutputAttention),
    "elastic_width_ffn": decoder_of(NanoGPTAttention, ElasticFFN),
    "joint_text_image_attention": JointDiT,
    "s4d_complex_kernel": decoder_of(S4DMixer),
    "embedding_max_norm": MaxNormEmbeddingLM,
    "cond_refinement": decoder_of(NanoGPTAttention, ConditionalRefine),
    "dense_general_tensordot": decoder_of(DenseGeneralAttention),
    "chunked_delta_rule": decoder_of(ChunkedDeltaRule),
    "value_residual": ValueResidualLM,
    "top_p_routing": decoder_of(NanoGPTAttention, TopPMoE),
    "fnet_fourier_mixing": FNetEncoder,
    "heads_minor_layout": decoder_of(HeadsMinorAttention),
    "channel_shift_ffn": decoder_of(NanoGPTAttention, ChannelShiftFFN),
    "gemma3n_streams": Gemma3nStyleLM,
    "sparsemax_attention": decoder_of(SparsemaxAttention),
    "indexer_selected_attention": decoder_of(IndexerSelectedAttention),
    "prefix_lm_mask": PrefixLM,
    "multiway_ffn": MultiwayLM,
    "lora_experts_ffn": decoder_of(NanoGPTAttention, LoraExpertsFFN),
}
MOE = frozenset({"top_p_routing"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    if name == "multimodal_rotary_sections":
        return {"input_ids": ids, "position_ids": mrope_positions(batch, seq), "labels": labels}
    if name == "prefix_lm_mask":
        return {"input_ids": ids, "prefix_len": torch.tensor([5, 11][:batch] + [3] * max(0, batch - 2)), "labels": labels}
    if name == "multiway_ffn":
        is_image = torch.zeros(batch, seq, dtype=torch.bool)
        is_image[:, 2:8] = True
        return {"input_ids": ids, "is_image": is_image, "labels": labels}
    if name == "joint_text_image_attention":
        return {"input_ids": ids, "patches": torch.randn(batch, PATCHES, PATCH_DIM, generator=gen), "labels": labels}
    return {"input_ids": ids, "labels": labels}
