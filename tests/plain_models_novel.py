"""Small plain-PyTorch models of vision, mixer and MoE constructs that newer architectures
and other training libraries use (issue 27, second round): a Swin-style vision transformer
(shifted windows by ``roll``, a relative-position bias table, patch merging), a MoE whose
experts run as grouped GEMMs over tokens sorted by expert, DeepSeek-V3's group-limited
sigmoid routing with a shared expert and a dense first layer, RWKV's token shift and
per-channel recurrence, mixture-of-depths, hyper-connections (several residual streams),
Mamba1's reference selective scan and a T5/BART-like encoder-decoder with cross-attention.

The experts' ``torch._grouped_mm`` path is not in ``MODELS``: PyTorch's meta kernel of that
op takes only bf16, so an fp32 model using it cannot be traced (autotp refuses it naming
the module, ``tests/test_propagation_novel.py``), and bf16 does not meet the strict rule's
fp32 tolerances; ``moe_sorted_loop`` runs the same routing through torchtitan's for-loop path.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)`` and ``MOE`` (DiT returns the loss it computes from ``target``;
``train_step`` finds it without a ``loss_fn``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, RMSNorm, SwiGLU, lm_loss

# ---- Swin: windows by view/permute, shifted by roll, relative-position bias, patch merging --

IMAGE, PATCH, WINDOW, CLASSES, SWIN_DIM = 16, 2, 4, 10, 32


def window_partition(x: torch.Tensor, w: int) -> torch.Tensor:
    """[B, H, W, C] -> [B * windows, w * w, C]."""
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, w * w, c)


def window_reverse(windows: torch.Tensor, w: int, h: int, wd: int) -> torch.Tensor:
    """[B * windows, w * w, C] -> [B, H, W, C]."""
    b = windows.shape[0] // ((h // w) * (wd // w))
    x = windows.view(b, h // w, wd // w, w, w, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, wd, -1)


class WindowAttention(nn.Module):
    """One qkv linear, a learned bias per relative offset and head (``[(2W-1)^2, H]``) read
    through a buffer of indices and permuted to ``[H, N, N]``, an optional shift mask."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * WINDOW - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(WINDOW), torch.arange(WINDOW), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (WINDOW - 1)
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * WINDOW - 1) + rel[..., 1], persistent=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b_, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b_, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        if mask is not None:
            windows = mask.shape[0]
            attn = attn.view(b_ // windows, windows, self.heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, n, n)
        x = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b_, n, c)
        return self.proj(x)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, resolution: int, shift: int) -> None:
        super().__init__()
        self.resolution, self.shift = resolution, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        mask = None
        if shift:
            img = torch.zeros(1, resolution, resolution, 1)
            region = 0
            for hs in (slice(0, -WINDOW), slice(-WINDOW, -shift), slice(-shift, None)):
                for ws in (slice(0, -WINDOW), slice(-WINDOW, -shift), slice(-shift, None)):
                    img[:, hs, ws, :] = region
                    region += 1
            ids = window_partition(img, WINDOW).squeeze(-1)
            diff = ids.unsqueeze(1) - ids.unsqueeze(2)
            mask = diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, c = x.shape
        r = self.resolution
        shortcut = x
        x = self.norm1(x).view(b, r, r, c)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        x = window_reverse(self.attn(window_partition(x, WINDOW), self.attn_mask), WINDOW, r, r)
        if self.shift:
            x = torch.roll(x, shifts=(self.shift, self.shift), dims=(1, 2))
        x = shortcut + x.reshape(b, length, c)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PatchMerging(nn.Module):
    """Four strided slices of the [B, H, W, C] grid concatenated, normed, projected to 2C."""

    def __init__(self, dim: int, resolution: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, c = x.shape
        x = x.view(b, self.resolution, self.resolution, c)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(b, -1, 4 * c)))


class SwinTransformer(nn.Module):
    """Patch embedding, a regular and a shifted-window block, patch merging, one block at
    half the resolution, mean pooling, a 10-class head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        r = IMAGE // PATCH
        self.patch_embed = nn.Conv2d(3, SWIN_DIM, kernel_size=PATCH, stride=PATCH)
        self.patch_norm = nn.LayerNorm(SWIN_DIM)
        self.stage1 = nn.Sequential(SwinBlock(SWIN_DIM, 4, r, 0), SwinBlock(SWIN_DIM, 4, r, WINDOW // 2))
        self.merge = PatchMerging(SWIN_DIM, r)
        self.stage2 = nn.Sequential(SwinBlock(2 * SWIN_DIM, 8, r // 2, 0))
        self.norm = nn.LayerNorm(2 * SWIN_DIM)
        self.head = nn.Linear(2 * SWIN_DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.patch_norm(self.patch_embed(pixel_values).flatten(2).transpose(1, 2))
        x = self.stage2(self.merge(self.stage1(x)))
        logits = self.head(self.norm(x).mean(dim=1))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


# ---- MoE with grouped GEMMs over tokens sorted by expert (torchtitan-style) ----------------


class GroupedExperts(nn.Module):
    """Experts as 3-D weights ``[E, out, in]`` over rows sorted by expert: one
    ``torch._grouped_mm`` per weight at the cumulative offsets, or (``loop``) torchtitan's
    for-loop path, ``torch.split`` by the host-read counts and one GEMM per expert."""

    def __init__(self, experts: int, hidden: int, loop: bool) -> None:
        super().__init__()
        self.loop = loop
        self.w1 = nn.Parameter(torch.randn(experts, hidden, DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, DIM, hidden) * hidden**-0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, DIM) * DIM**-0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.loop:
            outs = []
            for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
                h = F.silu(rows @ self.w1[e].transpose(-2, -1)) * (rows @ self.w3[e].transpose(-2, -1))
                outs.append(h @ self.w2[e].transpose(-2, -1))
            return torch.cat(outs, dim=0)
        offsets = torch.cumsum(counts, dim=0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)


class SortedTokenMoE(nn.Module):
    """Top-k softmax routing; the (token, choice) pairs sorted by expert (``argsort``), the
    tokens per expert counted by ``histc``; the experts' outputs, scaled by their scores,
    added back to their tokens by ``scatter_add``."""

    EXPERTS, TOP_K = 4, 2

    def __init__(self, loop: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = GroupedExperts(self.EXPERTS, 2 * DIM, loop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        scores, selected = torch.topk(self.router(tokens).softmax(dim=-1), self.TOP_K, dim=-1)
        counts = torch.histc(selected.view(-1).float(), bins=self.EXPERTS, min=0, max=self.EXPERTS - 1).to(torch.int64)
        order = torch.argsort(selected.view(-1), stable=True)
        token_ids = order // self.TOP_K
        routed = self.experts(tokens[token_ids], counts) * scores.view(-1)[order, None]
        out = torch.zeros_like(tokens).scatter_add(0, token_ids[:, None].expand(-1, d), routed)
        return out.view(b, s, d)


class GatheredWeightsMoE(nn.Module):
    """gpt-fast's Mixtral: each token's chosen experts' weights gathered by index
    (``w1[selected]``: [tokens, top-k, hidden, dim]) and contracted by einsums, the outputs
    weighted by the renormalized scores. Top-2 of 4: tp=2 divides the gathered top-k dim,
    which is no dim of the weights."""

    EXPERTS, TOP_K = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(self.EXPERTS, 2 * DIM, DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(self.EXPERTS, DIM, 2 * DIM) * (2 * DIM) ** -0.5)
        self.w3 = nn.Parameter(torch.randn(self.EXPERTS, 2 * DIM, DIM) * DIM**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores, selected = torch.topk(F.softmax(self.router(tokens), dim=-1), self.TOP_K, dim=-1)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        h = F.silu(torch.einsum("ti,taoi->tao", tokens, self.w1[selected])) * torch.einsum("ti,taoi->tao", tokens, self.w3[selected])
        out = torch.einsum("tao,taio->tai", h, self.w2[selected])
        return torch.einsum("tai,ta->ti", out, scores).view_as(x)


# ---- DeepSeek-V3 routing: sigmoid + bias for selection, group-limited top-k, shared expert ---


class DeepSeekV3MoE(nn.Module):
    """Sigmoid scores; a bias buffer shifts them for choosing only; each group scored by
    its two best experts, the best ``TOPK_GROUP`` groups kept, top-k inside them; weights
    normalized and scaled; experts combined by ``index_add_``; one shared expert always on."""

    EXPERTS, GROUPS, TOPK_GROUP, TOP_K, SCALE = 8, 4, 2, 2, 2.5

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.register_buffer("e_score_correction_bias", torch.linspace(-0.1, 0.1, self.EXPERTS))
        self.experts = nn.ModuleList(SwiGLU(hidden=DIM) for _ in range(self.EXPERTS))
        self.shared_experts = SwiGLU(hidden=DIM)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(tokens).sigmoid()
        choice = scores + self.e_score_correction_bias.unsqueeze(0)
        per_group = self.EXPERTS // self.GROUPS
        group_scores = choice.view(-1, self.GROUPS, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.TOPK_GROUP, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.GROUPS, per_group).reshape(-1, self.EXPERTS)
        idx = torch.topk(choice.masked_fill(~score_mask.bool(), 0.0), k=self.TOP_K, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.SCALE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.view(-1, shape[-1])
        idx, weights = self.route(tokens)
        out = torch.zeros_like(tokens)
        expert_mask = F.one_hot(idx, num_classes=self.EXPERTS).permute(2, 0, 1)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(expert_mask[e])
            out.index_add_(0, token_idx, expert(tokens[token_idx]) * weights[token_idx, slot, None])
        return (out + self.shared_experts(tokens)).view(shape)


class DenseFirstLM(DecoderLM):
    """DeepSeek-V3's layout: the first layer's MLP dense, the others MoE (four layers: with
    two, the MoE layer alone is over 65% of the model and no pp=2 cut can balance it)."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention(), DeepSeekV3MoE(), norm=RMSNorm), norm=RMSNorm)
        moe = [PreNormBlock(NanoGPTAttention(), DeepSeekV3MoE(), norm=RMSNorm) for _ in range(3)]
        self.layers = nn.ModuleList([PreNormBlock(NanoGPTAttention(), SwiGLU(), norm=RMSNorm), *moe])


# ---- RWKV-4: token shift and a per-channel recurrence -------------------------------------


class TimeMix(nn.Module):
    """Token shift by ``ZeroPad2d((0, 0, 1, -1))`` mixed into r/k/v by learned per-channel
    vectors; the WKV recurrence (per-channel decay and bonus, a numerically stable loop over
    time); ``sigmoid(r) * wkv`` through the output projection."""

    def __init__(self) -> None:
        super().__init__()
        ramp = torch.arange(DIM) / DIM
        self.time_decay, self.time_first = nn.Parameter(-5 + 8 * ramp), nn.Parameter(0.5 + 0.3 * ramp)
        self.time_mix_k, self.time_mix_v, self.time_mix_r = (nn.Parameter(ramp ** p) for p in (1.0, 0.7, 0.5))
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.key, self.value, self.receptance = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.output = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xx = self.time_shift(x)
        k = self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))
        v = self.value(x * self.time_mix_v + xx * (1 - self.time_mix_v))
        r = torch.sigmoid(self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r)))
        w, u = -torch.exp(self.time_decay), self.time_first
        aa, bb = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
        pp = torch.full_like(k[:, 0], -1e38)
        outs = []
        for t in range(x.shape[1]):
            kt, vt = k[:, t], v[:, t]
            ww = u + kt
            p = torch.maximum(pp, ww)
            e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
            outs.append((e1 * aa + e2 * vt) / (e1 * bb + e2))
            ww = pp + w
            p = torch.maximum(ww, kt)
            e1, e2 = torch.exp(ww - p), torch.exp(kt - p)
            aa, bb, pp = e1 * aa + e2 * vt, e1 * bb + e2, p
        return self.output(r * torch.stack(outs, dim=1))


class ChannelMix(nn.Module):
    """Token shift, ``relu(k)^2`` through the value projection, gated by ``sigmoid(r)``."""

    def __init__(self) -> None:
        super().__init__()
        ramp = torch.arange(DIM) / DIM
        self.time_mix_k, self.time_mix_r = nn.Parameter(ramp**0.8), nn.Parameter(ramp**0.6)
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.key, self.value = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)
        self.receptance = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xx = self.time_shift(x)
        k = torch.square(torch.relu(self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))))
        return torch.sigmoid(self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r))) * self.value(k)


# ---- mixture-of-depths: only the router's top-k tokens go through the block ----------------


class MixtureOfDepthsBlock(nn.Module):
    """A router scores every token; the top half of each sequence (kept in order) is
    gathered, run through the block, scaled by its router weight and scattered back."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 1, bias=False)
        self.block = PreNormBlock(NanoGPTAttention(), SwiGLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        weights = self.router(x).squeeze(-1)
        chosen = torch.sort(torch.topk(weights, s // 2, dim=1, sorted=False).indices, dim=1).values
        index = chosen.unsqueeze(-1).expand(-1, -1, d)
        picked = torch.gather(x, 1, index)
        delta = (self.block(picked) - picked) * torch.gather(weights, 1, chosen).sigmoid().unsqueeze(-1)
        return torch.scatter(x, 1, index, picked + delta)


# ---- hyper-connections: several residual streams mixed by small learned matrices -----------


class HyperConnection(nn.Module):
    """``STREAMS`` residual streams ``[B, S, n, D]``; static plus dynamic (tanh of a normed
    projection) weights choose the block's input (``einsum``) and mix the streams; the
    block's output is added to each stream with its own weight."""

    STREAMS = 2

    def __init__(self, layer: int, block: nn.Module) -> None:
        super().__init__()
        n = self.STREAMS
        alpha = torch.zeros(n, n + 1)
        alpha[layer % n, 0] = 1.0
        alpha[:, 1:] = torch.eye(n)
        self.static_alpha, self.static_beta = nn.Parameter(alpha), nn.Parameter(torch.ones(n))
        self.dynamic_alpha_fn = nn.Parameter(torch.randn(DIM, n + 1) * 0.02)
        self.dynamic_beta_fn = nn.Parameter(torch.randn(DIM) * 0.02)
        self.dynamic_scale = nn.Parameter(torch.tensor([0.1, 0.1]))
        self.norm = RMSNorm(DIM)
        self.block = block

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        normed = self.norm(streams)
        alpha = torch.tanh(normed @ self.dynamic_alpha_fn) * self.dynamic_scale[0] + self.static_alpha
        beta = torch.tanh(normed @ self.dynamic_beta_fn) * self.dynamic_scale[1] + self.static_beta
        mixed = torch.einsum("bsnd,bsnm->bsmd", streams, alpha)
        out = self.block(mixed[:, :, 0])
        return mixed[:, :, 1:] + torch.einsum("bsd,bsn->bsnd", out, beta)


class HyperConnectionLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: nn.Identity())
        self.layers = nn.ModuleList(
            HyperConnection(2 * i + j, PreNormBlock(NanoGPTAttention(), SwiGLU()) if j == 0 else SwiGLU()) for i in range(LAYERS) for j in range(2)
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.embed(input_ids).unsqueeze(2).expand(-1, -1, HyperConnection.STREAMS, -1)
        for layer in self.layers:
            h = layer(h)
        logits = self.logits(h.sum(dim=2))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- Mamba1: the reference selective scan -------------------------------------------------


class MambaMixer(nn.Module):
    """in_proj to x and z; a causal depthwise conv1d (padding, then the first L steps);
    ``x_proj`` to dt, B, C of unequal widths; ``dt_proj``; the discretisation by ``einsum``;
    a Python loop over time; the skip ``D``; the ``silu(z)`` gate; out_proj."""

    INNER, STATE, DT_RANK, CONV = 2 * DIM, 8, 4, 4

    def __init__(self) -> None:
        super().__init__()
        d, n = self.INNER, self.STATE
        self.in_proj = nn.Linear(DIM, 2 * d, bias=False)
        self.conv1d = nn.Conv1d(d, d, self.CONV, groups=d, padding=self.CONV - 1)
        self.x_proj = nn.Linear(d, self.DT_RANK + 2 * n, bias=False)
        self.dt_proj = nn.Linear(self.DT_RANK, d)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d, 1))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, DIM, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        length = hidden.shape[1]
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :length]).transpose(1, 2)  # [B, L, d]
        dt, b_, c_ = self.x_proj(x).split([self.DT_RANK, self.STATE, self.STATE], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        a = -torch.exp(self.A_log.float())
        delta_a = torch.exp(torch.einsum("bld,dn->bldn", dt, a))
        delta_bu = torch.einsum("bld,bln,bld->bldn", dt, b_, x)
        state = torch.zeros_like(delta_a[:, 0])
        ys = []
        for t in range(length):
            state = delta_a[:, t] * state + delta_bu[:, t]
            ys.append(torch.einsum("bdn,bn->bd", state, c_[:, t]))
        y = torch.stack(ys, dim=1) + x * self.D
        return self.out_proj(y * F.silu(z))


class MambaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mixer = RMSNorm(DIM), MambaMixer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


# ---- a T5/BART-like encoder-decoder with cross-attention ----------------------------------


class CrossAttention(nn.Module):
    """q from one sequence, k and v from another (itself for self-attention)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        memory = x if memory is None else memory
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.shape[1], HEADS, HEAD_DIM).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(memory)), heads(self.v_proj(memory)), is_causal=self.causal)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, DIM))


class DecoderBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.cross_attn, self.mlp = CrossAttention(causal=True), CrossAttention(causal=False), SwiGLU()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(DIM), nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), memory)
        return x + self.mlp(self.norm3(x))


class EncoderDecoder(nn.Module):
    """One embedding shared by the encoder, the decoder and the (tied, scaled) LM head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.ModuleList(PreNormBlock(CrossAttention(causal=False)) for _ in range(LAYERS))
        self.decoder = nn.ModuleList(DecoderBlock() for _ in range(LAYERS))
        self.encoder_norm, self.decoder_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        memory = self.shared(input_ids)
        for block in self.encoder:
            memory = block(memory)
        memory = self.encoder_norm(memory)
        h = self.shared(decoder_input_ids)
        for block in self.decoder:
            h = block(h, memory)
        logits = F.linear(self.decoder_norm(h) * DIM**-0.5, self.shared.weight)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- MLP-Mixer: token mixing by a linear over the patches -----------------------------------


class MixerBlock(nn.Module):
    """Token mixing (an MLP over the patch dim, channels transposed in front) and channel
    mixing (an MLP over the channels)."""

    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_fc1, self.token_fc2 = nn.Linear(tokens, 2 * tokens), nn.Linear(2 * tokens, tokens)
        self.channel_fc1, self.channel_fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x).transpose(1, 2)
        x = x + self.token_fc2(F.gelu(self.token_fc1(y))).transpose(1, 2)
        return x + self.channel_fc2(F.gelu(self.channel_fc1(self.norm2(x))))


class MlpMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        tokens = (IMAGE // PATCH) ** 2
        self.stem = nn.Conv2d(3, DIM, kernel_size=PATCH, stride=PATCH)
        self.blocks = nn.ModuleList(MixerBlock(tokens, DIM) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.stem(pixel_values).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x).mean(dim=1))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


# ---- DiT: adaLN-Zero modulation from a class embedding -----------------------------------


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """One linear of the conditioning gives shift, scale and gate of both sub-blocks
    (``chunk(6, dim=1)``); norms without affine weights."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.attn = NanoGPTAttention()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 6 * DIM))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.fc2(F.gelu(self.fc1(modulate(self.norm2(x), shift_mlp, scale_mlp)), approximate="tanh"))


class DiT(nn.Module):
    """Patch embedding, a class embedding conditioning every block, a modulated final
    layer predicting the patches back; the loss is the mean squared error to a target."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.x_embedder = nn.Conv2d(3, DIM, kernel_size=PATCH, stride=PATCH)
        self.y_embedder = nn.Embedding(CLASSES, DIM)
        self.blocks = nn.ModuleList(DiTBlock() for _ in range(LAYERS))
        self.final_norm = nn.LayerNorm(DIM, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 2 * DIM))
        self.final_linear = nn.Linear(DIM, PATCH * PATCH * 3)

    def forward(self, pixel_values: torch.Tensor, class_labels: torch.Tensor, target: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.x_embedder(pixel_values).flatten(2).transpose(1, 2)
        c = self.y_embedder(class_labels)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=1)
        pred = self.final_linear(modulate(self.final_norm(x), shift, scale))
        out: dict[str, Any] = {"logits": pred}
        if target is not None:
            out["loss"] = F.mse_loss(pred, target)
        return out


# ---- Perceiver: a learned latent array cross-attends to the inputs ------------------------


class PerceiverLM(nn.Module):
    """Learned latents query the token embeddings (cross-attention), latent self-attention
    blocks, then the tokens query the latents back for their logits."""

    LATENTS = 8

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.latents = nn.Parameter(torch.randn(self.LATENTS, DIM) * 0.02)
        self.encode = CrossAttention(causal=False)
        self.blocks = nn.ModuleList(PreNormBlock(CrossAttention(causal=False)) for _ in range(LAYERS))
        self.decode = CrossAttention(causal=False)
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.embed(input_ids)
        z = self.latents.unsqueeze(0).expand(x.shape[0], -1, -1)
        z = z + self.encode(z, x)
        for block in self.blocks:
            z = block(z)
        logits = self.output(self.norm(x + self.decode(x, z)))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- differential attention: the difference of two softmax maps --------------------------


class DiffAttention(nn.Module):
    """q and k projected to two maps per head (``view(b, s, 2 * H, D/2)``), ``lambda`` from
    four learned per-head-dim vectors, the second map subtracted, a per-head RMS norm."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        half = HEAD_DIM // 2
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (nn.Parameter(torch.randn(half) * 0.1) for _ in range(4))
        self.subln = RMSNorm(HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, 2 * HEADS, HEAD_DIM // 2).transpose(1, 2)
        k = self.k_proj(x).view(b, s, 2 * HEADS, HEAD_DIM // 2).transpose(1, 2)
        v = self.v_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) * (HEAD_DIM // 2) ** -0.5
        scores = scores + torch.full((s, s), float("-inf"), device=x.device).triu(1)
        probs = scores.softmax(dim=-1).view(b, HEADS, 2, s, s)
        lam = torch.exp((self.lambda_q1 * self.lambda_k1).sum()) - torch.exp((self.lambda_q2 * self.lambda_k2).sum()) + 0.8
        out = (probs[:, :, 0] - lam * probs[:, :, 1]) @ v
        out = self.subln(out.transpose(1, 2)) * (1 - 0.8)
        return self.out_proj(out.reshape(b, s, DIM))


# ---- expert-choice routing: each expert picks its top tokens ------------------------------


class ExpertChoiceMoE(nn.Module):
    """Router scores transposed to ``[E, T]``; each expert takes its ``CAPACITY`` best
    tokens (``topk`` over the tokens), runs them (``bmm`` on stacked weights) and adds them
    back weighted by their scores (``index_add_`` over the flattened choices)."""

    EXPERTS, CAPACITY = 4, 8

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(self.EXPERTS, DIM, 2 * DIM) * DIM**-0.5)
        self.w_out = nn.Parameter(torch.randn(self.EXPERTS, 2 * DIM, DIM) * (2 * DIM) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores = self.gate(tokens).softmax(dim=-1).t()  # [E, T]
        weights, chosen = torch.topk(scores, self.CAPACITY, dim=-1)  # [E, C]
        h = torch.bmm(tokens[chosen], self.w_in)  # [E, C, 2D]
        y = torch.bmm(F.gelu(h), self.w_out) * weights.unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add_(0, chosen.reshape(-1), y.reshape(-1, shape[-1]))
        return out.view(shape)


# ---- Conformer's convolution module: GLU over channels, depthwise conv, BatchNorm ---------


class ConformerConv(nn.Module):
    """Pointwise conv to 2C, GLU over the channels, a depthwise conv over time, BatchNorm
    (running statistics in eval), SiLU, a pointwise conv back."""

    def __init__(self, kernel: int = 5) -> None:
        super().__init__()
        self.pointwise1 = nn.Conv1d(DIM, 2 * DIM, 1)
        self.depthwise = nn.Conv1d(DIM, DIM, kernel, padding=kernel // 2, groups=DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.pointwise2 = nn.Conv1d(DIM, DIM, 1)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.1, 0.1)
            self.norm.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.glu(self.pointwise1(x.transpose(1, 2)), dim=1)
        y = F.silu(self.norm(self.depthwise(y)))
        return self.pointwise2(y).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff1, self.ff2 = SwiGLU(), SwiGLU()
        self.attn, self.conv = CrossAttention(causal=False), ConformerConv()
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(self.norms[0](x))
        x = x + self.attn(self.norms[1](x))
        x = x + self.conv(self.norms[2](x))
        x = x + 0.5 * self.ff2(self.norms[3](x))
        return self.norms[4](x)


# ---- RetNet: retention with a per-head decay mask -----------------------------------------


class Retention(nn.Module):
    """Per-head decays ``gamma`` (a buffer), the decay mask ``gamma^(n-m)`` below the
    diagonal built in the forward, ``(q k^T * D) v``, a group norm per head, a swish gate."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.out_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(5))
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(HEADS, dtype=torch.float32)), persistent=False)
        self.group_norm = nn.GroupNorm(HEADS, DIM, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        n = torch.arange(s, device=x.device, dtype=torch.float32)
        dist = n[:, None] - n[None, :]
        decay = torch.where(dist >= 0, self.gamma[:, None, None] ** dist.clamp(min=0), torch.zeros((), device=x.device))
        y = ((q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5 * decay) @ v  # [b, H, s, D]
        y = self.group_norm(y.transpose(1, 2).reshape(b * s, DIM)).view(b, s, DIM)
        return self.out_proj(F.silu(self.g_proj(x)) * y)


# ---- multi-token prediction: extra heads predict further tokens ---------------------------


class MultiTokenLM(DecoderLM):
    """A shared trunk; each of ``DEPTH`` extra blocks predicts the token ``d`` steps ahead
    through the shared output head; the loss is the mean over depths."""

    DEPTH = 2

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention(), SwiGLU()))
        self.mtp = nn.ModuleList(PreNormBlock(NanoGPTAttention(), SwiGLU()) for _ in range(self.DEPTH))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.hidden(input_ids)
        logits = self.logits(h)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            losses = [lm_loss(logits, labels)]
            for d, block in enumerate(self.mtp, start=1):
                h = block(h)
                losses.append(lm_loss(self.logits(h)[:, :-d], labels[:, d:]))
            out["loss"] = torch.stack(losses).mean()
        return out


MODELS: dict[str, Callable[[], nn.Module]] = {
    "swin": SwinTransformer,
    "moe_sorted_loop": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), SortedTokenMoE(loop=True))),
    "deepseek_v3_routing": DenseFirstLM,
    "rwkv_token_shift": lambda: DecoderLM(lambda: PreNormBlock(TimeMix(), ChannelMix())),
    "mixture_of_depths": lambda: DecoderLM(MixtureOfDepthsBlock),
    "hyper_connections": HyperConnectionLM,
    "mamba1_scan": lambda: DecoderLM(MambaBlock, norm=RMSNorm),
    "encoder_decoder": EncoderDecoder,
    "mlp_mixer": MlpMixer,
    "dit_adaln": DiT,
    "perceiver_latents": PerceiverLM,
    "diff_attention": lambda: DecoderLM(lambda: PreNormBlock(DiffAttention(), SwiGLU(), norm=RMSNorm), norm=RMSNorm),
    "moe_expert_choice": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ExpertChoiceMoE())),
    "conformer": lambda: DecoderLM(ConformerBlock),
    "retnet": lambda: DecoderLM(lambda: PreNormBlock(Retention(), SwiGLU())),
    "multi_token_prediction": MultiTokenLM,
    "moe_gathered_expert_weights": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), GatheredWeightsMoE())),
}
MOE = frozenset({"moe_sorted_loop", "deepseek_v3_routing", "moe_expert_choice", "moe_gathered_expert_weights"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """Keyword inputs of model ``name``, the same on every call."""
    gen = torch.Generator().manual_seed(1)
    if name in ("swin", "mlp_mixer"):
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen),
                "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}  # fmt: skip
    if name == "dit_adaln":
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "class_labels": torch.randint(0, CLASSES, (batch,), generator=gen),
                "target": torch.randn(batch, (IMAGE // PATCH) ** 2, PATCH * PATCH * 3, generator=gen)}  # fmt: skip
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    if name == "encoder_decoder":
        return {"input_ids": ids, "decoder_input_ids": labels[:, : seq - 4], "labels": labels[:, 4:]}
    return {"input_ids": ids, "labels": labels}
