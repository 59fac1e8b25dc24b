"""Small plain-PyTorch models with position schemes of recent attention papers and the weight
adapters of PEFT libraries (issue 27, ninth round): what the earlier rounds did not write.

Positions: the Forgetting Transformer's per-head forget gate (``logsigmoid``, a ``cumsum`` over
the sequence, pairwise differences as an additive mask); stick-breaking attention (each key's
weight times the product of ``1 - w`` of the keys nearer the query, in log space by a reversed
``cumsum``); contextual positions (CoPE: gates ``sigmoid(q k^T)`` summed from the query back,
fractional positions interpolated between ``floor`` and ``ceil`` by a ``gather``); FIRE (an MLP
over log distances with one output per head); L2 attention (``-cdist(q, k)^2``); RealFormer's
residual attention scores; a ViT whose position table is ``F.interpolate``d to the image's
grid. Adapters: LyCORIS's LoKr (a weight delta ``torch.kron(w1, w2)``); OFT (a block-diagonal
rotation of the input dim by Cayley's transform, ``torch.linalg.solve``); VeRA (frozen random
matrices shared by every layer, sliced to each linear's shape, per-layer scaling vectors);
weight standardization (each output row centred and scaled over its inputs in the forward);
q/k norms over all heads written with ``torch.var_mean`` and ``torch.std_mean``.
Others: an MoE combining a dense expert stack by ``take_along_dim``; a residual gated by an
``nn.GRUCell`` (x-transformers' ``gate_residual``).

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

from plain_models_attention import DIM, HEAD_DIM, HEADS, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, SwiGLU
from plain_models_frontier import decoder_of, merge_heads, split_heads

SEQ = 16


class QKVAttention(nn.Module):
    """Separate q/k/v/o projections; subclasses compute the weights from ``scores`` [B, H, S, S]
    (``q k^T / sqrt(d)``) and may add a bias from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def weights(self, scores: torch.Tensor, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        return self.o(merge_heads(self.weights(scores, x, q, k) @ v))


def _future(s: int, device: torch.device) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)


# ---- attention position schemes ------------------------------------------------------------


class ForgettingAttention(nn.Module):
    """The Forgetting Transformer: a forget gate per head and token, ``log f = logsigmoid(.)``;
    query i reads key j with the bias ``sum_{j<l<=i} log f_l`` (differences of a cumsum),
    passed to SDPA as a float mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.forget = nn.Linear(DIM, HEADS)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        log_f = F.logsigmoid(self.forget(x).float()).transpose(1, 2)  # [B, H, S]
        c = log_f.cumsum(-1)
        bias = (c[..., :, None] - c[..., None, :]).masked_fill(_future(x.shape[1], x.device), float("-inf"))
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))))


class StickBreakingAttention(QKVAttention):
    """Stick-breaking: ``w_ij = sigmoid(z_ij) * prod_{j<l<i} (1 - sigmoid(z_il))`` over earlier
    keys, computed in log space with a reversed cumsum along the keys."""

    def weights(self, scores: torch.Tensor, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = scores.shape[-1]
        not_before = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(0)  # j >= i
        log_beta = F.logsigmoid(scores).masked_fill(not_before, float("-inf"))
        log_rest = F.logsigmoid(-scores).masked_fill(not_before, 0.0)
        later = log_rest.flip(-1).cumsum(-1).flip(-1) - log_rest  # sum over l in (j, i)
        return torch.exp(log_beta + later)


COPE_POSITIONS = 8


class ContextualPositionAttention(QKVAttention):
    """CoPE: gates ``sigmoid(q k^T)`` over earlier keys, summed from the query back, give
    fractional positions (clamped); a learned table [HEAD_DIM, P] scores every integer position
    and the fractional ones interpolate between ``floor`` and ``ceil`` by ``gather``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_emb = nn.Parameter(torch.randn(HEAD_DIM, COPE_POSITIONS) * 0.2)

    def weights(self, scores: torch.Tensor, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        future = _future(scores.shape[-1], x.device)
        gates = torch.sigmoid(scores).masked_fill(future, 0.0)
        pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=COPE_POSITIONS - 1)
        by_position = q @ self.pos_emb  # [B, H, S, P]
        low, high = pos.floor().long(), pos.ceil().long()
        frac = pos - low
        bias = by_position.gather(-1, high) * frac + by_position.gather(-1, low) * (1 - frac)
        return torch.softmax((scores + bias).masked_fill(future, float("-inf")), dim=-1)


class FirePositionAttention(nn.Module):
    """FIRE: an MLP over ``log(1 + c * (i - j)) / log(1 + c * i)`` with one output per head,
    added to the scores (a position MLP whose last layer is as wide as the heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, HEADS))
        self.c = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        pos = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
        rel = (pos[:, None] - pos[None, :]).clamp(min=0)
        c = F.softplus(self.c)
        norm = torch.log1p(c * rel) / torch.log1p(c * pos.clamp(min=1))[:, None]
        bias = self.mlp(norm[..., None]).permute(2, 0, 1)  # [H, S, S]
        mask = bias.masked_fill(_future(x.shape[1], x.device), float("-inf"))
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class L2DistanceAttention(QKVAttention):
    """L2 attention (Lipschitz self-attention): ``-||q_i - k_j||^2 / sqrt(d)`` by ``torch.cdist``."""

    def weights(self, scores: torch.Tensor, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        logits = -torch.cdist(q, k).pow(2) / math.sqrt(HEAD_DIM)
        return torch.softmax(logits.masked_fill(_future(x.shape[1], x.device), float("-inf")), dim=-1)


class RealFormerAttention(nn.Module):
    """RealFormer: each layer adds the previous layer's pre-softmax scores to its own and hands
    its scores on (``forward(x, prev) -> (out, scores)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        if prev is not None:
            scores = scores + prev
        masked = scores.masked_fill(_future(x.shape[1], x.device), float("-inf"))
        return self.o(merge_heads(torch.softmax(masked, dim=-1) @ v)), scores


class RealFormerLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attns = nn.ModuleList(RealFormerAttention() for _ in range(LAYERS))
        self.mlps = nn.ModuleList(SwiGLU() for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2 * LAYERS + 1))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h, scores = self.embed(input_ids), None
        for i, (attn, mlp) in enumerate(zip(self.attns, self.mlps)):
            out, scores = attn(self.norms[2 * i](h), scores)
            h = h + out
            h = h + mlp(self.norms[2 * i + 1](h))
        logits = self.head(self.norms[-1](h))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


# ---- a ViT whose position table is interpolated to the image's grid -----------------------

IMAGE, PATCH, TABLE_GRID, CLASSES = 16, 4, 6, 10


class InterpolatedPositionViT(nn.Module):
    """timm-style: a conv patch embedding, a class token, and a learned position table for a
    6x6 grid resized (bicubic) to the image's 4x4 grid in the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 1 + TABLE_GRID**2, DIM) * 0.02)
        self.blocks = nn.ModuleList(PreNormBlock(NanoGPTAttentionBidirectional(), SwiGLU()) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def positions(self, grid: int) -> torch.Tensor:
        cls_pos, table = self.pos[:, :1], self.pos[:, 1:]
        table = table.reshape(1, TABLE_GRID, TABLE_GRID, DIM).permute(0, 3, 1, 2)
        table = F.interpolate(table, size=(grid, grid), mode="bicubic", align_corners=False)
        return torch.cat([cls_pos, table.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.patch(pixels)
        grid = x.shape[-1]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)], dim=1)
        x = x + self.positions(grid)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x[:, 0]))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class NanoGPTAttentionBidirectional(NanoGPTAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (split_heads(p) for p in self.c_attn(x).split(DIM, dim=2))
        return self.c_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c))


# ---- PEFT adapters ---------------------------------------------------------------------------


class LoKrLinear(nn.Module):
    """LyCORIS LoKr: a frozen base weight plus ``torch.kron(w1, w2)``, ``w1`` [4, 4] full and
    ``w2`` [out/4, in/4] of rank 2 (``w2_a @ w2_b``)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.base.weight.requires_grad_(False)
        self.w1 = nn.Parameter(torch.randn(4, 4) * 0.1)
        self.w2_a = nn.Parameter(torch.randn(d_out // 4, 2) * 0.1)
        self.w2_b = nn.Parameter(torch.randn(2, d_in // 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.base.weight + torch.kron(self.w1, self.w2_a @ self.w2_b))


OFT_BLOCK = 8


class OFTLinear(nn.Module):
    """OFT: the frozen weight's input dim rotated by a block-diagonal orthogonal matrix, each
    block ``(I + Q)^-1 (I - Q)`` of a skew-symmetric ``Q`` (Cayley), assembled by ``block_diag``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.base.weight.requires_grad_(False)
        self.blocks = nn.Parameter(torch.randn(d_in // OFT_BLOCK, OFT_BLOCK, OFT_BLOCK) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skew = self.blocks - self.blocks.transpose(-1, -2)
        eye = torch.eye(OFT_BLOCK, device=x.device, dtype=x.dtype).expand_as(skew)
        rotations = torch.linalg.solve(eye + skew, eye - skew)
        return F.linear(x, self.base.weight @ torch.block_diag(*rotations.unbind(0)))


VERA_RANK = 16


class VeRAShared(nn.Module):
    """VeRA's frozen random matrices, one pair for the whole model, sized to its widest linear."""

    def __init__(self, widest: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.register_buffer("a", torch.randn(VERA_RANK, widest, generator=gen) / math.sqrt(widest))
        self.register_buffer("b", torch.randn(widest, VERA_RANK, generator=gen) / math.sqrt(VERA_RANK))


class VeRALinear(nn.Module):
    """``base(x) + lambda_b * (B[:out] @ (lambda_d * (A[:, :in] @ x)))``, A and B shared."""

    def __init__(self, shared: VeRAShared, d_in: int, d_out: int) -> None:
        super().__init__()
        self.shared = shared
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.lambda_d = nn.Parameter(torch.linspace(0.5, 1.5, VERA_RANK))
        self.lambda_b = nn.Parameter(torch.linspace(0.2, 0.4, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.shared.a[:, : self.base.in_features]
        b = self.shared.b[: self.base.out_features]
        return self.base(x) + self.lambda_b * F.linear(self.lambda_d * F.linear(x, a), b)


class StandardizedLinear(nn.Linear):
    """Scaled weight standardization (NFNets): each output row centred and scaled over its
    inputs in the forward, times a learned gain / sqrt(fan-in)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.gain = nn.Parameter(torch.ones(d_out, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean(dim=1, keepdim=True)) / torch.sqrt(w.var(dim=1, keepdim=True, unbiased=False) * w.shape[1] + 1e-4)
        return F.linear(x, w * self.gain, self.bias)


class AdaptedAttention(nn.Module):
    """q/k/v/o and the FFN built from one linear factory (an adapter around a base weight)."""

    def __init__(self, linear: Callable[[int, int], nn.Module]) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class AdaptedMLP(nn.Module):
    def __init__(self, linear: Callable[[int, int], nn.Module]) -> None:
        super().__init__()
        self.gate, self.up, self.down = linear(DIM, 2 * DIM), linear(DIM, 2 * DIM), linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _adapted(linear: Callable[[int, int], nn.Module]) -> nn.Module:
    return DecoderLM(lambda: PreNormBlock(AdaptedAttention(linear), AdaptedMLP(linear)))


def _vera_lm() -> nn.Module:
    shared = VeRAShared(2 * DIM)
    return _adapted(lambda d_in, d_out: VeRALinear(shared, d_in, d_out))


class MomentNormAttention(nn.Module):
    """q and k normalized over all heads by hand-written norms: ``torch.var_mean`` (keepdim)
    for q, ``torch.std_mean`` (not keepdim, unbiased) for k, each with a learned scale."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.q_scale, self.k_scale = nn.Parameter(torch.linspace(0.9, 1.1, DIM)), nn.Parameter(torch.linspace(1.1, 0.9, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        var, mean = torch.var_mean(q, dim=-1, keepdim=True, correction=0)
        q = (q - mean) * torch.rsqrt(var + 1e-5) * self.q_scale
        std, mean = torch.std_mean(k, dim=-1)
        k = (k - mean[..., None]) / (std[..., None] + 1e-5) * self.k_scale
        return self.o(merge_heads(F.scaled_dot_product_attention(split_heads(q), split_heads(k), split_heads(v), is_causal=True)))


# ---- others ------------------------------------------------------------------------------------

EXPERTS, TOP_K = 4, 2


class TakeAlongMoE(nn.Module):
    """Every expert runs on every token (``einsum`` over stacked weights [E, D, I]); the top-k
    outputs are picked by ``take_along_dim`` and mixed by their renormalized router weights."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * DIM) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)
        top_w, top_i = probs.topk(TOP_K, dim=-1)
        outs = torch.einsum("bsei,eid->bsed", F.gelu(torch.einsum("bsd,edi->bsei", x, self.w_in)), self.w_out)
        picked = torch.take_along_dim(outs, top_i[..., None], dim=2)  # [B, S, K, D]
        return (picked * (top_w / top_w.sum(-1, keepdim=True))[..., None]).sum(2)


class GRUGatedBlock(nn.Module):
    """x-transformers' ``gate_residual``: each sublayer's output and the residual meet in an
    ``nn.GRUCell`` over the flattened tokens instead of an add."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.attention, self.mlp = NanoGPTAttention(), SwiGLU()
        self.gates = nn.ModuleList(nn.GRUCell(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, sub, gate in zip(self.norms, (self.attention, self.mlp), self.gates):
            x = gate(sub(norm(x)).reshape(-1, DIM), x.reshape(-1, DIM)).view_as(x)
        return x


# ---- batch two: recurrent decoders, sequence projections, output layers -----------------


class LSTMCellDecoder(nn.Module):
    """An encoder (transformer blocks) and a recurrent head: an ``nn.LSTMCell`` stepped over the
    sequence in a Python loop (Tacotron's and RNN-T's decoders), each step reading the encoder's
    token and the previous output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(PreNormBlock(NanoGPTAttention(), SwiGLU()) for _ in range(LAYERS))
        self.cell = nn.LSTMCell(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        h = c = x.new_zeros(x.shape[0], DIM)
        steps = []
        for t in range(x.shape[1]):
            h, c = self.cell(torch.cat([x[:, t], h], dim=-1), (h, c))
            steps.append(h)
        logits = self.head(torch.stack(steps, dim=1))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class BatchNormStandardizedLinear(nn.Linear):
    """timm's ``ScaledStdConv`` trick on a linear: the weight standardized per output row by
    ``F.batch_norm`` in training mode over ``weight.reshape(1, out, in)``, gain as its weight."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.gain = nn.Parameter(torch.ones(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.in_features**-0.5
        w = F.batch_norm(self.weight.reshape(1, self.out_features, -1), None, None, weight=self.gain * scale, training=True, momentum=0.0, eps=1e-4)
        return F.linear(x, w.reshape_as(self.weight), self.bias)


LINFORMER_K = 8


class LinformerAttention(nn.Module):
    """Linformer: keys and values projected along the sequence by learned [S, k] matrices
    (``einsum('bhnd,nk->bhkd')``) before the attention (bidirectional)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.e, self.f = (nn.Parameter(torch.randn(SEQ, LINFORMER_K) / math.sqrt(SEQ)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        n = x.shape[1]
        k = torch.einsum("bhnd,nk->bhkd", k, self.e[:n])
        v = torch.einsum("bhnd,nk->bhkd", v, self.f[:n])
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v)))


NYSTROM_LANDMARKS = 4


def iterative_pinv(mat: torch.Tensor, iterations: int = 6) -> torch.Tensor:
    """Nystromformer's Moore-Penrose iteration, started from ``mat^T`` over the largest column
    sum of the whole batch (every head's)."""
    eye = torch.eye(mat.shape[-1], device=mat.device, dtype=mat.dtype)
    inv = mat.transpose(-1, -2) / torch.max(mat.sum(dim=-2))
    for _ in range(iterations):
        kv = mat @ inv
        inv = (0.25 * inv) @ (13 * eye - kv @ (15 * eye - kv @ (7 * eye - kv)))
    return inv


class NystromAttention(nn.Module):
    """Nystromformer: landmarks are segment means of q and k; the softmax kernel is approximated
    by ``A(q, k_l) pinv(A(q_l, k_l)) A(q_l, k)``, the pseudo-inverse iterated."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        q = q / HEAD_DIM**0.25
        k = k / HEAD_DIM**0.25
        b, h, n, d = q.shape
        q_l = q.reshape(b, h, NYSTROM_LANDMARKS, n // NYSTROM_LANDMARKS, d).mean(-2)
        k_l = k.reshape(b, h, NYSTROM_LANDMARKS, n // NYSTROM_LANDMARKS, d).mean(-2)
        kernel_1 = torch.softmax(q @ k_l.transpose(-1, -2), dim=-1)
        kernel_2 = torch.softmax(q_l @ k_l.transpose(-1, -2), dim=-1)
        kernel_3 = torch.softmax(q_l @ k.transpose(-1, -2), dim=-1)
        return self.o(merge_heads(kernel_1 @ iterative_pinv(kernel_2) @ (kernel_3 @ v)))


SHAW_CLIP = 4


class ShawRelativeAttention(QKVAttention):
    """Shaw et al.'s relative keys: an embedding of the clipped distance ``j - i`` [S, S, D]
    (one table shared by the heads), scored against each query by ``einsum('bhqd,qkd->bhqk')``."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Embedding(2 * SHAW_CLIP + 1, HEAD_DIM)

    def weights(self, scores: torch.Tensor, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        dist = (pos[None, :] - pos[:, None]).clamp(-SHAW_CLIP, SHAW_CLIP) + SHAW_CLIP
        scores = scores + torch.einsum("bhqd,qkd->bhqk", q, self.rel(dist)) / math.sqrt(HEAD_DIM)
        return torch.softmax(scores.masked_fill(_future(x.shape[1], x.device), float("-inf")), dim=-1)


SOFTMAXES = 3


class MixtureOfSoftmaxesLM(DecoderLM):
    """Mixture of softmaxes: K contexts from one projection, K softmaxes over the vocabulary
    (one shared head), mixed by a prior; the loss is the NLL of the log of the mixture."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention(), SwiGLU()))
        self.contexts = nn.Linear(DIM, SOFTMAXES * DIM)
        self.prior = nn.Linear(DIM, SOFTMAXES, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids))
        ctx = torch.tanh(self.contexts(h)).view(*h.shape[:2], SOFTMAXES, DIM)
        probs = torch.softmax(self.output(ctx), dim=-1)  # [B, S, K, V]
        mixed = (probs * torch.softmax(self.prior(h), dim=-1)[..., None]).sum(2)
        log_probs = torch.log(mixed + 1e-9)
        return {"logits": log_probs, "loss": F.nll_loss(log_probs.flatten(0, 1), labels.flatten())}


class AdaptiveSoftmaxLM(DecoderLM):
    """``nn.AdaptiveLogSoftmaxWithLoss`` as the output layer (Transformer-XL's adaptive softmax):
    a head over the frequent tokens and two clusters, each a projection to a narrower width."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention(), SwiGLU()))
        self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(DIM, VOCAB, cutoffs=[32, 64], div_value=2.0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids)).flatten(0, 1)
        out = self.adaptive(h, labels.flatten())
        return {"logits": out.output, "loss": out.loss}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "forgetting_attention": decoder_of(ForgettingAttention),
    "stick_breaking_attention": decoder_of(StickBreakingAttention),
    "contextual_positions": decoder_of(ContextualPositionAttention),
    "fire_position_mlp": decoder_of(FirePositionAttention),
    "l2_distance_attention": decoder_of(L2DistanceAttention),
    "realformer_scores": RealFormerLM,
    "interpolated_position_vit": InterpolatedPositionViT,
    "lokr_kron_adapter": lambda: _adapted(LoKrLinear),
    "oft_block_rotation": lambda: _adapted(OFTLinear),
    "vera_shared_adapter": _vera_lm,
    "weight_standardization": lambda: _adapted(StandardizedLinear),
    "moment_qk_norm": decoder_of(MomentNormAttention),
    "take_along_moe": decoder_of(NanoGPTAttention, TakeAlongMoE),
    "gru_gated_residual": lambda: DecoderLM(GRUGatedBlock),
    "lstm_cell_decoder": LSTMCellDecoder,
    "batch_norm_standardization": lambda: _adapted(BatchNormStandardizedLinear),
    "linformer_sequence_projection": decoder_of(LinformerAttention),
    "nystrom_iterative_pinv": decoder_of(NystromAttention),
    "shaw_relative_keys": decoder_of(ShawRelativeAttention),
    "mixture_of_softmaxes": MixtureOfSoftmaxesLM,
    "adaptive_softmax": AdaptiveSoftmaxLM,
}
MOE = frozenset({"take_along_moe"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "interpolated_position_vit":
        return {"pixels": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    return {"input_ids": ids, "labels": labels}
