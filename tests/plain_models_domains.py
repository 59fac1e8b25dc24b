"""Small plain-PyTorch models from other domains and with kernels written by hand (issue 27,
sixth round): constructs the earlier rounds did not write.

A diffusion UNet the way diffusers writes one (``GroupNorm`` between convolutions, a timestep
embedding added per channel, a spatial transformer over the pixels, ``F.interpolate`` and a
skip ``cat`` over channels); packed documents (per-document positions by ``cummax``, a
block-diagonal causal mask built from document ids); learned attention sinks concatenated to
the scores; softmax by ``logsumexp``; SimMIM's masked-image reconstruction (a 1x1 convolution
and ``PixelShuffle``, an L1 loss over the masked pixels); ``F.rms_norm`` with a per-head q/k
norm and SDPA's ``scale=``; a gated convolutional LM (``F.glu`` over channels); an hourglass
that shortens the sequence by a linear over pairs of tokens and lengthens it by
``repeat_interleave``; cross-entropy summed over chunks of the sequence in a loop; GQA by an
einsum over a group dim; quantization-aware training by ``torch.fake_quantize_*``; 2-D axial
rotary embeddings in a ViT; deep supervision (one tied head read after every layer); LSQ's
trained per-channel scales; a ViT with ``F.unfold`` patches, a ConvNeXt block, a position table
resized by bicubic ``F.interpolate`` and einsums with ``...``; a top-2 MoE summing its
experts back by ``scatter_reduce``; a LLaVA-style merge by ``masked_scatter``; ``nn.PReLU``;
scans in log space; embeddings by ``one_hot`` and ``embedding_bag``; the DDPM training step
drawing its noise and timesteps in the forward; Gumbel-softmax routing; and a loss weighted
per sample over the weights' sum, with left padding.

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

from plain_models_attention import DIM, HEAD_DIM, HEADS, KV_HEADS, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, SwiGLU, cos_sin, lm_loss, rotate_half

SEQ = 16
IGNORE = -100
IMAGE, PATCH, CLASSES = 8, 2, 10


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S, n * D] -> [B, n, S, D]."""
    return t.unflatten(-1, (n, -1)).transpose(1, 2)


def _merge(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)


# ---- a diffusion UNet (diffusers' ResnetBlock2D, Transformer2DModel, Up/Downsample) --------

UNET_CH, TIME_DIM, GROUPS = 32, 64, 8


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(GROUPS, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(TIME_DIM, cout)
        self.norm2, self.conv2 = nn.GroupNorm(GROUPS, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.shortcut(x) + h


class SpatialTransformer(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm, self.proj_in, self.proj_out = nn.GroupNorm(GROUPS, ch), nn.Conv2d(ch, ch, 1), nn.Conv2d(ch, ch, 1)
        self.norm1, self.norm2 = nn.LayerNorm(ch), nn.LayerNorm(ch)
        self.to_q, self.to_k, self.to_v = (nn.Linear(ch, ch, bias=False) for _ in range(3))
        self.to_out = nn.Linear(ch, ch)
        self.ff_in, self.ff_out = nn.Linear(ch, 2 * 4 * ch), nn.Linear(4 * ch, ch)  # GEGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)  # [B, H*W, C]
        n = self.norm1(h)
        q, k, v = (_heads(f(n), HEADS // 2) for f in (self.to_q, self.to_k, self.to_v))
        h = h + self.to_out(_merge(F.scaled_dot_product_attention(q, k, v)))
        a, gate = self.ff_in(self.norm2(h)).chunk(2, dim=-1)
        h = h + self.ff_out(a * F.gelu(gate))
        return x + self.proj_out(h.transpose(1, 2).reshape(B, C, H, W))


class TinyUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(UNET_CH, TIME_DIM), nn.SiLU(), nn.Linear(TIME_DIM, TIME_DIM))
        self.conv_in = nn.Conv2d(4, UNET_CH, 3, padding=1)
        self.down = ResnetBlock(UNET_CH, 2 * UNET_CH)
        self.downsample = nn.Conv2d(2 * UNET_CH, 2 * UNET_CH, 3, stride=2, padding=1)
        self.mid = ResnetBlock(2 * UNET_CH, 2 * UNET_CH)
        self.mid_attn = SpatialTransformer(2 * UNET_CH)
        self.upsample = nn.Conv2d(2 * UNET_CH, 2 * UNET_CH, 3, padding=1)
        self.up = ResnetBlock(4 * UNET_CH, 2 * UNET_CH)
        self.norm_out, self.conv_out = nn.GroupNorm(GROUPS, 2 * UNET_CH), nn.Conv2d(2 * UNET_CH, 4, 3, padding=1)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, noise: torch.Tensor) -> dict[str, Any]:
        temb = self.time_mlp(timestep_embedding(timestep, UNET_CH))
        skip = self.down(self.conv_in(sample), temb)
        h = self.mid_attn(self.mid(self.downsample(skip), temb))
        h = self.upsample(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = self.up(torch.cat([h, skip], dim=1), temb)
        pred = self.conv_out(F.silu(self.norm_out(h)))
        return {"logits": pred, "loss": F.mse_loss(pred.float(), noise.float())}


class DiffusionTraining(nn.Module):
    """The DDPM training step inside the forward: timesteps by ``randint`` and noise by
    ``randn_like``, each sample's noise level gathered from a schedule buffer by its timestep."""

    STEPS = 1000

    def __init__(self) -> None:
        super().__init__()
        self.unet = TinyUNet()
        betas = torch.linspace(1e-4, 0.02, self.STEPS)
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - betas, dim=0), persistent=False)

    def forward(self, latents: torch.Tensor) -> dict[str, Any]:
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, self.STEPS, (latents.shape[0],), device=latents.device)
        level = self.alphas_cumprod[timesteps][:, None, None, None]
        noisy = level.sqrt() * latents + (1 - level).sqrt() * noise
        return self.unet(noisy, timesteps, noise)


# ---- packed documents ---------------------------------------------------------------------


class PackedDocAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.wqkv(x).split(DIM, dim=-1))
        q, k = (t * cos + rotate_half(t) * sin for t in (q, k))
        return self.wo(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class PackedDocumentsLM(nn.Module):
    """Several documents per row: positions restart and attention stays inside a document."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.ModuleList(PackedDocAttention() for _ in range(LAYERS))
        self.mlp = nn.ModuleList(SwiGLU() for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2 * LAYERS + 1))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        cos, sin = cos_sin(HEAD_DIM, SEQ)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        B, S = input_ids.shape
        idx = torch.arange(S, device=input_ids.device).expand(B, S)
        starts = torch.cat([torch.ones_like(doc_ids[:, :1], dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], dim=1)
        positions = idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
        mask = (same_doc & torch.ones(S, S, dtype=torch.bool, device=input_ids.device).tril())[:, None]
        x = self.embed(input_ids)
        for i in range(LAYERS):
            x = x + self.attn[i](self.norms[2 * i](x), cos, sin, mask)
            x = x + self.mlp[i](self.norms[2 * i + 1](x))
        logits = self.lm_head(self.norms[-1](x))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)}


# ---- attention written by hand ------------------------------------------------------------


class SinkAttention(nn.Module):
    """GQA with a learned logit per head joining every row's softmax (an attention sink)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.kv_proj = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = _heads(self.q_proj(x), HEADS)
        k, v = (_heads(t, KV_HEADS).repeat_interleave(HEADS // KV_HEADS, dim=1) for t in self.kv_proj(x).chunk(2, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        sinks = self.sinks.reshape(1, HEADS, 1, 1).expand(B, HEADS, S, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return self.o_proj(_merge(probs @ v))


class LogsumexpAttention(nn.Module):
    """Softmax as ``exp(scores - logsumexp(scores))``, heads by ``view``/``permute``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * HEAD_DIM**-0.5
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        probs = (scores - torch.logsumexp(scores, dim=-1, keepdim=True)).exp()
        return self.proj(torch.einsum("bhqk,bhkd->bqhd", probs, v).reshape(B, S, DIM))


class GroupedEinsumAttention(nn.Module):
    """GQA without repeating k/v: the queries viewed as [KV heads, group] and an einsum over the group."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk, self.wv = (nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False) for _ in range(2))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        k, v = self.wk(x).view(B, S, KV_HEADS, HEAD_DIM), self.wv(x).view(B, S, KV_HEADS, HEAD_DIM)
        scores = torch.einsum("bskgd,btkd->bkgst", q, k) / math.sqrt(HEAD_DIM)
        scores = scores + torch.full((S, S), float("-inf"), device=x.device).triu(1)
        out = torch.einsum("bkgst,btkd->bskgd", scores.softmax(-1), v)
        return self.wo(out.reshape(B, S, DIM))


class FunctionalNormAttention(nn.Module):
    """``F.rms_norm`` on each head's q and k, SDPA with its own ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.q_norm, self.k_norm = nn.Parameter(torch.linspace(0.9, 1.1, HEAD_DIM)), nn.Parameter(torch.linspace(1.1, 0.9, HEAD_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = F.rms_norm(q, (HEAD_DIM,), self.q_norm, 1e-6), F.rms_norm(k, (HEAD_DIM,), self.k_norm, 1e-6)
        return self.o(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)))


class FunctionalRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.8, 1.2, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


# ---- SimMIM: masked image modelling with a pixel-shuffle decoder ----------------------------


class SimMIM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.mask_token = nn.Parameter(torch.randn(DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2, DIM) * 0.02)
        self.blocks = nn.ModuleList(PreNormBlock(LogsumexpAttention(), nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.decoder = nn.Conv2d(DIM, PATCH * PATCH * 3, 1)
        self.shuffle = nn.PixelShuffle(PATCH)

    def forward(self, pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor) -> dict[str, Any]:
        B, _, H, W = pixel_values.shape
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        x = torch.where(bool_masked_pos.flatten(1)[..., None], self.mask_token.to(x.dtype), x) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        grid = self.norm(x).transpose(1, 2).reshape(B, DIM, H // PATCH, W // PATCH)
        reconstruction = self.shuffle(self.decoder(grid))
        mask = bool_masked_pos.repeat_interleave(PATCH, 1).repeat_interleave(PATCH, 2)[:, None].to(pixel_values.dtype)
        per_pixel = F.l1_loss(reconstruction, pixel_values, reduction="none")
        loss = (per_pixel * mask).sum() / (mask.sum() + 1e-5) / 3
        return {"logits": reconstruction, "loss": loss}


# ---- convolution and sequence length --------------------------------------------------------


class GatedConvBlock(nn.Module):
    """Dauphin et al.'s gated convolution: a causal ``Conv1d`` to 2C channels, ``F.glu`` over them."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.width = width
        self.norm = nn.LayerNorm(DIM)
        self.conv = nn.Conv1d(DIM, 2 * 2 * DIM, width)
        self.out = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.norm(x).transpose(1, 2), (self.width - 1, 0))
        return x + self.out(F.glu(self.conv(h), dim=1).transpose(1, 2))


class HourglassLM(nn.Module):
    """A layer at full length, the sequence shortened 2x by a linear over pairs of tokens, a layer
    there, then lengthened by ``repeat_interleave`` with a residual from before the shortening."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pre = PreNormBlock(NanoGPTAttention())
        self.shorten = nn.Linear(2 * DIM, DIM)
        self.short = PreNormBlock(NanoGPTAttention())
        self.lengthen = nn.Linear(DIM, DIM)
        self.post = PreNormBlock(NanoGPTAttention())
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.pre(self.embed(input_ids))
        B, S, D = x.shape
        short = self.short(self.shorten(x.reshape(B, S // 2, 2 * D)))
        x = self.post(x + self.lengthen(short).repeat_interleave(2, dim=1))
        logits = self.head(self.norm(x))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- losses -----------------------------------------------------------------------------


class ChunkedLossLM(DecoderLM):
    """Cross-entropy summed over chunks of the sequence in a loop (no whole logits), over the counted tokens."""

    CHUNK = 4

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids))
        total = h.new_zeros(())
        for i in range(0, h.shape[1], self.CHUNK):
            logits = self.output(h[:, i : i + self.CHUNK]).float()
            total = total + F.cross_entropy(logits.flatten(0, 1), labels[:, i : i + self.CHUNK].flatten(), ignore_index=IGNORE, reduction="sum")
        return {"loss": total / (labels != IGNORE).sum()}


class DeepSupervisionLM(DecoderLM):
    """The final norm and head read after every layer; the losses weighted by depth."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids)
        loss = h.new_zeros(())
        for depth, layer in enumerate(self.layers, start=1):
            h = layer(h)
            loss = loss + depth / LAYERS * lm_loss(self.logits(h), labels)
        logits = self.logits(h)
        return {"logits": logits, "loss": loss}


class SampleWeightedLM(DecoderLM):
    """Left-padded rows: positions from the mask (``cumsum - 1``, written in place where padded),
    a per-row mean of the token losses weighted by each sample's weight over the weights' sum."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.position = nn.Embedding(SEQ, DIM)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, sample_weight: torch.Tensor) -> dict[str, Any]:
        positions = attention_mask.long().cumsum(-1) - 1
        positions.masked_fill_(attention_mask == 0, 0)
        h = self.embed(input_ids) + self.position(positions)
        for layer in self.layers:
            h = layer(h)
        logits = self.logits(h)
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
        per_row = (per_token * attention_mask).sum(1) / attention_mask.sum(1)
        return {"logits": logits, "loss": (per_row * sample_weight).sum() / sample_weight.sum()}


# ---- quantization-aware training ----------------------------------------------------------


class FakeQuantLinear(nn.Linear):
    """int8 QAT as ``torch.ao`` simulates it: weights per output channel, activations per tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_scale = (self.weight.detach().abs().amax(dim=1) / 127).clamp(min=1e-8)
        w = torch.fake_quantize_per_channel_affine(self.weight, w_scale, torch.zeros_like(w_scale, dtype=torch.int32), 0, -128, 127)
        x_scale = (x.detach().abs().amax() / 127).clamp(min=1e-8).reshape(1)
        x = torch.fake_quantize_per_tensor_affine(x, x_scale, torch.zeros(1, dtype=torch.int32, device=x.device), -128, 127)
        return F.linear(x, w, self.bias)


class TernarySTELinear(nn.Linear):
    """BitNet b1.58's linear as its ports write it: activations scaled per token by their absolute
    maximum (``max(dim).values`` of a value that takes a gradient), weights ternary by their mean
    magnitude over the whole matrix, both through straight-through estimators (the quantized value
    minus the input, detached, added to the input). BitNet also normalizes x first; over a split dim
    that sum rounds otherwise, and rounding to the int8 grid turns an ulp into a quantum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 127.0 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
        x = x + ((x * scale).round().clamp(-128, 127) / scale - x).detach()
        w = self.weight
        w = w + ((w - w.mean()).sign() * w.abs().mean() - w).detach()
        return F.linear(x, w, self.bias)


class _ScaledGrad(torch.autograd.Function):
    """Unit scaling's scale op (Graphcore's unit_scaling): one factor forward, another backward,
    the backward's saved as a tensor the forward makes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_scale: float, bwd_scale: float) -> torch.Tensor:
        ctx.save_for_backward(torch.tensor(bwd_scale, dtype=x.dtype))
        return fwd_scale * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (bwd_scale,) = ctx.saved_tensors
        return bwd_scale * grad, None, None


class UnitScaledLinear(nn.Linear):
    """A unit-scaled linear: input, weight and bias gradients scaled by their fans, the output by
    its fan-in, each through ``_ScaledGrad``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fan_out, fan_in = self.weight.shape
        batch = x.numel() // fan_in
        x = _ScaledGrad.apply(x, 1.0, fan_out**-0.5)
        w = _ScaledGrad.apply(self.weight, 1.0, batch**-0.5)
        b = _ScaledGrad.apply(self.bias, 1.0, batch**-0.5)
        return _ScaledGrad.apply(F.linear(x, w, b), fan_in**-0.5, 1.0)


class QuantizedMLP(nn.Module):
    def __init__(self, linear: type[nn.Linear], act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.up, self.down, self.act = linear(DIM, 4 * DIM), linear(4 * DIM, DIM), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


# ---- a ViT with 2-D axial rotary embeddings (EVA-02, ViT-RoPE) ------------------------------


def axial_cos_sin(grid: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [grid*grid, head_dim]: the first half of each head rotates by the row, the second by the column."""
    cos1, sin1 = cos_sin(head_dim // 2, grid)
    rows, cols = torch.arange(grid).repeat_interleave(grid), torch.arange(grid).repeat(grid)
    return torch.cat([cos1[rows], cos1[cols]], -1), torch.cat([sin1[rows], sin1[cols]], -1)


class AxialRopeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        cos, sin = axial_cos_sin(IMAGE // PATCH, HEAD_DIM)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, dim=-1))
        half = HEAD_DIM // 2
        q, k = (torch.cat([self._rotate(t[..., :half], slice(None, half)), self._rotate(t[..., half:], slice(half, None))], -1) for t in (q, k))
        return self.proj(_merge(F.scaled_dot_product_attention(q, k, v)))

    def _rotate(self, t: torch.Tensor, part: slice) -> torch.Tensor:
        return t * self.cos[:, part] + rotate_half(t) * self.sin[:, part]


class AxialRopeViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.blocks = nn.ModuleList(PreNormBlock(AxialRopeAttention(), nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(approximate="tanh"), nn.Linear(4 * DIM, DIM))) for _ in range(LAYERS))
        self.layer_scale = nn.Parameter(torch.full((DIM,), 0.5))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = torch.addcmul(x, self.layer_scale, block(x) - x)  # LayerScale written as addcmul
        logits = self.head(self.norm(x).mean(dim=1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- more quantization, vision and MoE ----------------------------------------------------


class LearnedScaleLinear(nn.Linear):
    """LSQ: per-output-channel weight scales that are trained (``_fake_quantize_learnable_*``)."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__(fan_in, fan_out)
        self.w_scale = nn.Parameter(self.weight.detach().abs().amax(dim=1) / 7)
        self.register_buffer("w_zero", torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch._fake_quantize_learnable_per_channel_affine(self.weight, self.w_scale, self.w_zero, 0, -8, 7, 1.0)
        return F.linear(x, w, self.bias)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 convolution, LayerNorm channels-last, inverted MLP, LayerScale."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(ch, ch, 7, padding=3, groups=ch)
        self.norm = nn.LayerNorm(ch)
        self.pwconv1, self.pwconv2 = nn.Linear(ch, 4 * ch), nn.Linear(4 * ch, ch)
        self.gamma = nn.Parameter(torch.full((ch,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.permute(0, 3, 1, 2)


class UnfoldViT(nn.Module):
    """Patches by ``F.unfold`` (im2col) and a linear, a class token, a position table trained at
    another grid and resized by bicubic ``F.interpolate`` (DINOv2), einsum attention with ``...``,
    and a ConvNeXt stage on the patch grid before the transformer."""

    TRAINED_GRID = 3

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(3 * PATCH * PATCH, DIM)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, self.TRAINED_GRID**2, DIM) * 0.02)
        self.convnext = ConvNeXtBlock(DIM)
        self.blocks = nn.ModuleList(PreNormBlock(EllipsisAttention(), nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        B, grid = pixel_values.shape[0], IMAGE // PATCH
        x = self.patch(F.unfold(pixel_values, kernel_size=PATCH, stride=PATCH).transpose(1, 2))
        x = self.convnext(x.transpose(1, 2).reshape(B, DIM, grid, grid)).flatten(2).transpose(1, 2)
        trained = self.pos_embed.reshape(1, self.TRAINED_GRID, self.TRAINED_GRID, DIM).permute(0, 3, 1, 2)
        pos = F.interpolate(trained, size=(grid, grid), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).reshape(1, grid * grid, DIM)
        x = torch.cat([self.cls_token.expand(B, -1, -1), x + pos], dim=1)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x[:, 0]))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class EllipsisAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, dim=-1))
        probs = torch.einsum("...qd,...kd->...qk", q, k).mul(HEAD_DIM**-0.5).softmax(-1)
        return self.proj(_merge(torch.einsum("...qk,...kd->...qd", probs, v)))


class ScatterReduceMoE(nn.Module):
    """Top-2 of 4 experts in a loop; each expert's rows gathered by ``index_select`` and summed
    back by ``scatter_reduce(reduce="sum")``; a shared expert beside them."""

    EXPERTS, TOP = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU(DIM, DIM) for _ in range(self.EXPERTS))
        self.shared = SwiGLU(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        weights, chosen = self.router(tokens).sigmoid().topk(self.TOP, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            mask = chosen == e
            rows = mask.any(-1).nonzero().squeeze(-1)
            w = (weights * mask).sum(-1).index_select(0, rows)[:, None]
            y = expert(tokens.index_select(0, rows)) * w
            out = out.scatter_reduce(0, rows[:, None].expand(-1, DIM), y, reduce="sum")
        return (out + self.shared(tokens)).view(x.shape)


# ---- a vision-language model and ops along the sequence --------------------------------------

IMAGE_TOKEN, IMAGE_TOKENS = VOCAB - 1, 4


class TinyVLM(nn.Module):
    """LLaVA's merge: a vision tower's patches, a two-layer projector, written into the text
    embeddings at the image tokens by ``masked_scatter``; then a decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, DIM // 2, 4, stride=4)
        self.vision = nn.TransformerEncoderLayer(DIM // 2, 4, DIM, batch_first=True, dropout=0.0)
        self.projector = nn.Sequential(nn.Linear(DIM // 2, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.lm = DecoderLM(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        features = self.projector(self.vision(self.patch(pixel_values).flatten(2).transpose(1, 2)))
        embeds = self.lm.embed(input_ids)
        mask = (input_ids == IMAGE_TOKEN)[..., None].expand_as(embeds)
        h = embeds.masked_scatter(mask, features.to(embeds.dtype))
        for layer in self.lm.layers:
            h = layer(h)
        logits = self.lm.logits(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)}


class PReLUMLP(nn.Module):
    """A learned slope per hidden channel (``nn.PReLU(hidden)``), the activation written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.PReLU(4 * DIM, init=0.1), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.mul_(1.5)
        return self.fc2(self.act(h.flatten(0, 1)).view_as(h))  # channels on dim 1, as PReLU reads them


class LogSpaceGatedMixer(nn.Module):
    """Per-channel decays summed in log space over the sequence (``logcumsumexp``), a running
    maximum (``cummax``) and a bidirectional pass over the flipped sequence (Vision Mamba)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 3 * DIM)
        self.out_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate, peak = self.in_proj(x).chunk(3, dim=-1)
        log_decay = F.logsigmoid(gate)
        forward_pass = (torch.logcumsumexp(log_decay + value, dim=1) - torch.logcumsumexp(log_decay, dim=1)).exp()
        backward_pass = torch.flip(torch.logcumsumexp(torch.flip(log_decay + value, dims=[1]), dim=1), dims=[1]).sigmoid()
        running = torch.cummax(peak, dim=1).values
        return self.out_proj(forward_pass + backward_pass + torch.lerp(running, value, 0.25))


class OneHotEmbeddingLM(DecoderLM):
    """Embedding by ``one_hot(ids) @ table`` (TPU style) and a bag of the row's previous tokens
    weighted per token (``F.embedding_bag(per_sample_weights=...)``); the top-k tokens of each row
    kept by ``take_along_dim`` before the head."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.bag = nn.Parameter(torch.randn(VOCAB, DIM) * 0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        B, S = input_ids.shape
        h = F.one_hot(input_ids, VOCAB).to(self.embed.weight.dtype) @ self.embed.weight
        previous = torch.cat([input_ids[:, :1], input_ids[:, :-1]], dim=1)
        weights = 1.0 / (1.0 + (previous % 3).to(h.dtype)).reshape(-1, 1)  # each token's weight, from the data
        h = h + F.embedding_bag(previous.reshape(-1, 1), self.bag, per_sample_weights=weights, mode="sum").view(B, S, DIM)
        for layer in self.layers:
            h = layer(h)
        scores = h.norm(dim=-1)
        keep = scores.topk(S // 2, dim=1).indices.sort(dim=1).values
        kept = torch.take_along_dim(h, keep[..., None], dim=1)
        logits = self.logits(kept)
        return {"logits": logits, "loss": lm_loss(logits, torch.take_along_dim(labels, keep, dim=1))}


class GumbelRoutedMoE(nn.Module):
    """Each token's expert by a hard Gumbel-softmax of the router's logits (noise from
    ``exponential_``), the straight-through one-hot weighing the stacked experts' outputs."""

    EXPERTS = 4

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(self.EXPERTS, DIM, 2 * DIM) * DIM**-0.5)
        self.w_out = nn.Parameter(torch.randn(self.EXPERTS, 2 * DIM, DIM) * (2 * DIM) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = F.gumbel_softmax(self.router(x), tau=0.5, hard=True)  # [B, S, E], one-hot forward
        hidden = F.gelu(torch.einsum("bsd,edf->bsef", x, self.w_in))
        return torch.einsum("bsef,efd,bse->bsd", hidden, self.w_out, gates)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "diffusion_unet": TinyUNet,
    "packed_documents": PackedDocumentsLM,
    "attention_sinks": lambda: DecoderLM(lambda: PreNormBlock(SinkAttention())),
    "logsumexp_softmax": lambda: DecoderLM(lambda: PreNormBlock(LogsumexpAttention())),
    "grouped_einsum_gqa": lambda: DecoderLM(lambda: PreNormBlock(GroupedEinsumAttention())),
    "functional_rms_norm": lambda: DecoderLM(lambda: PreNormBlock(FunctionalNormAttention(), norm=FunctionalRMSNorm), norm=FunctionalRMSNorm),
    "simmim_pixel_shuffle": SimMIM,
    "gated_conv_glu": lambda: DecoderLM(GatedConvBlock),
    "hourglass_shortening": HourglassLM,
    "chunked_loss_loop": ChunkedLossLM,
    "deep_supervision": DeepSupervisionLM,
    "fake_quant_qat": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), QuantizedMLP(FakeQuantLinear, F.gelu))),
    "axial_rope_vit": AxialRopeViT,
    "lsq_learned_scales": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), QuantizedMLP(LearnedScaleLinear, lambda h: F.relu(h).square()))),
    "unfold_convnext_vit": UnfoldViT,
    "moe_scatter_reduce": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ScatterReduceMoE())),
    "vlm_masked_scatter": TinyVLM,
    "prelu_in_place": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), PReLUMLP())),
    "log_space_scans": lambda: DecoderLM(lambda: PreNormBlock(LogSpaceGatedMixer())),
    "one_hot_embedding_bag": OneHotEmbeddingLM,
    "diffusion_training_step": DiffusionTraining,
    "gumbel_router_moe": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), GumbelRoutedMoE())),
    "sample_weighted_loss": SampleWeightedLM,
    "ternary_ste_mlp": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), QuantizedMLP(TernarySTELinear, F.gelu))),
    "unit_scaled_mlp": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), QuantizedMLP(UnitScaledLinear, F.gelu))),
}
MOE = frozenset({"moe_scatter_reduce", "gumbel_router_moe"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "diffusion_unet":
        return {"sample": torch.randn(batch, 4, 8, 8, generator=gen), "timestep": torch.randint(0, 1000, (batch,), generator=gen),
                "noise": torch.randn(batch, 4, 8, 8, generator=gen)}  # fmt: skip
    if name == "diffusion_training_step":
        return {"latents": torch.randn(batch, 4, 8, 8, generator=gen)}
    if name == "simmim_pixel_shuffle":
        masked = torch.rand(batch, IMAGE // PATCH, IMAGE // PATCH, generator=gen) < 0.5
        masked[0, 0, :] = True  # the rows count different numbers of masked pixels
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "bool_masked_pos": masked}
    if name in ("axial_rope_vit", "unfold_convnext_vit"):
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    ids = torch.randint(0, VOCAB - 1, (batch, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    if name == "packed_documents":
        doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])[:batch]
        labels = labels.masked_fill(torch.cat([doc_ids[:, 1:] != doc_ids[:, :-1], torch.ones_like(doc_ids[:, :1], dtype=torch.bool)], 1), IGNORE)
        return {"input_ids": ids, "doc_ids": doc_ids, "labels": labels}
    if name == "vlm_masked_scatter":
        ids[:, 2 : 2 + IMAGE_TOKENS] = IMAGE_TOKEN
        labels[:, : 2 + IMAGE_TOKENS] = IGNORE
        return {"input_ids": ids, "pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "labels": labels}
    if name == "sample_weighted_loss":
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # left padding in the first row
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "sample_weight": torch.tensor([0.5, 2.0])[:batch]}
    if name == "chunked_loss_loop":
        labels[1, 3:] = IGNORE
    return {"input_ids": ids, "labels": labels}
