"""Small plain-PyTorch models written the way research code writes them (issue 27, fourth
round): a modded-nanogpt-style speedrun GPT (one ``[3, H*D, D]`` QKV parameter flattened in the
forward, ``F.rms_norm`` without weights, value embeddings added to the values, U-net skips from
the first half of the layers to the second, ReLU², a sigmoid logit cap), BitNet b1.58
(``BitLinear``: a per-tensor absmean weight quantizer and a per-token absmax activation
quantizer behind straight-through estimators), a Whisper-style audio encoder (a strided
``conv1d`` stem over mel channels, sinusoidal positions, q/k scaled separately, per-frame
logits), an MAE (random masking by ``argsort`` of noise drawn in the forward, ``gather`` to
keep and to restore the patches, a masked reconstruction loss), a Soft MoE encoder (slots
dispatched by a softmax over tokens, experts as einsums over stacked weights), CLIP (an image
and a text tower, rows pooled at each text's highest token id, L2-normalized embeddings, a
contrastive loss over the batch), PVT (keys and values from a strided ``Conv2d`` over the
token grid), mistral-inference's MoE (``torch.where`` over the routed (token, slot) pairs,
``results[batch_idx] += ...``), Transformer-XL's relative shift (pad, view with two dims
swapped, drop a row), cross-layer attention (odd layers reuse the keys and values of the
layer before), Gemma's reference code ((1 + w) norms, soft-capped attention and logits, a head
tied through ``embedder.weight.t()``), Swin V2's cosine attention, an encoder-decoder with a
padding mask and Flamingo-style gated cross-attention, and stochastic
units (a VAE's ``randn_like`` reparametrization, ``bernoulli`` units) drawn from split
projections. Models that draw in the forward match the unmodified model only from the same
generator state: the strict rule seeds both sides alike.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``, ``loss_fn(name)`` and ``MOE``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, lm_loss

SEQ = 16
LAYERS = 4


def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


# ---- modded-nanogpt: the speedrun GPT ------------------------------------------------------


class HalfTruncatedRotary(nn.Module):
    """Rotary on half of each head's dims (the other half's frequencies are zero)."""

    def __init__(self, head_dim: int, max_seq: int = 64) -> None:
        super().__init__()
        freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4)
        freq = torch.cat([freq, freq.new_zeros(head_dim // 4)])
        theta = torch.einsum("i,j->ij", torch.arange(max_seq, dtype=torch.float32), freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D]
        cos, sin = self.cos[None, : x.size(-3), None, :], self.sin[None, : x.size(-3), None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), 3).type_as(x)


class SpeedrunAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        bound = math.sqrt(3) * 0.5 * DIM**-0.5
        self.qkv_w = nn.Parameter(torch.empty(3, HEADS * HEAD_DIM, DIM).uniform_(-bound, bound))
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.rotary = HalfTruncatedRotary(HEAD_DIM)
        self.c_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None) -> torch.Tensor:
        b, t = x.shape[:2]
        q, k, v = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(b, t, 3 * HEADS, HEAD_DIM).chunk(3, dim=-2)
        q, k = self.rotary(rms(q)), self.rotary(rms(k))
        v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v) if ve is not None else self.lambdas[0] * v
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.12)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, HEADS * HEAD_DIM))


class ReluSquaredMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM, bias=False)
        self.c_proj = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class SpeedrunBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = SpeedrunAttention()
        self.mlp = ReluSquaredMLP()
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.1]))

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, x0: torch.Tensor) -> torch.Tensor:
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        x = x + self.attn(rms(x), ve)
        return x + self.mlp(rms(x))


class SpeedrunGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.value_embeds = nn.ModuleList([nn.Embedding(VOCAB, DIM) for _ in range(2)])
        self.blocks = nn.ModuleList([SpeedrunBlock() for _ in range(LAYERS)])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.skip_weights = nn.Parameter(torch.linspace(0.5, 1.0, LAYERS // 2))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ve = [embed(input_ids) for embed in self.value_embeds]
        ve = ve + [None] * (LAYERS - 2 * len(ve)) + ve
        x = x0 = rms(self.embed(input_ids))
        skips, n = [], len(self.skip_weights)
        for i, block in enumerate(self.blocks):
            if i >= n:
                x = x + self.skip_weights[i - n] * skips.pop()
            x = block(x, ve[i], x0)
            if i < n:
                skips.append(x)
        logits = 30 * torch.sigmoid(self.lm_head(rms(x)).float() / 7.5)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


# ---- BitNet b1.58 --------------------------------------------------------------------------


class BitLinear(nn.Linear):
    """Quantize-aware training: ternary weights scaled by their absmean, 8-bit activations
    scaled per token, both rounded behind a straight-through estimator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = rms(x)
        x_scale = 127.0 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
        x = x + ((x * x_scale).round().clamp(-128, 127) / x_scale - x).detach()
        w_scale = 1.0 / self.weight.abs().mean().clamp(min=1e-5)
        w = self.weight + ((self.weight * w_scale).round().clamp(-1, 1) / w_scale - self.weight).detach()
        return F.linear(x, w, self.bias)


class BitBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.qkv = BitLinear(DIM, 3 * DIM, bias=False)
        self.o = BitLinear(DIM, DIM, bias=False)
        self.gate_up = BitLinear(DIM, 4 * DIM, bias=False)
        self.down = BitLinear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, DIM))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.relu(gate).square() * up)


class BitNetLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([BitBlock() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- Whisper's audio encoder ---------------------------------------------------------------

MELS, FRAMES = 16, 32


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2))
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class WhisperAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(DIM, DIM)
        self.key = nn.Linear(DIM, DIM, bias=False)
        self.value = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        scale = HEAD_DIM**-0.25
        q = self.query(x).view(b, t, HEADS, -1).permute(0, 2, 1, 3) * scale
        k = self.key(x).view(b, t, HEADS, -1).permute(0, 2, 3, 1) * scale
        v = self.value(x).view(b, t, HEADS, -1).permute(0, 2, 1, 3)
        w = (q @ k).float().softmax(dim=-1).to(q.dtype)
        return self.out((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2))


class WhisperBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_ln, self.mlp_ln = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = WhisperAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x))
        return x + self.mlp(self.mlp_ln(x))


class WhisperEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(MELS, DIM, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(DIM, DIM, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(FRAMES // 2, DIM))
        self.blocks = nn.ModuleList([WhisperBlock() for _ in range(LAYERS)])
        self.ln_post = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = F.gelu(self.conv2(F.gelu(self.conv1(input_features)))).permute(0, 2, 1)
        x = (x + self.positional_embedding).to(x.dtype)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_post(x))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


# ---- MAE: masked autoencoder with random masking -------------------------------------------

IMAGE, PATCH, CHANNELS, DECODER_DIM = 16, 4, 3, 32


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class MaskedAutoencoder(nn.Module):
    def __init__(self, mask_ratio: float = 0.75) -> None:
        super().__init__()
        self.mask_ratio = mask_ratio
        patches = (IMAGE // PATCH) ** 2
        self.patch_embed = nn.Conv2d(CHANNELS, DIM, PATCH, PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.register_buffer("pos_embed", torch.randn(1, patches + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList([ViTBlock(DIM, HEADS) for _ in range(LAYERS // 2)])
        self.norm = nn.LayerNorm(DIM)
        self.decoder_embed = nn.Linear(DIM, DECODER_DIM)
        self.mask_token = nn.Parameter(torch.randn(1, 1, DECODER_DIM) * 0.02)
        self.register_buffer("decoder_pos_embed", torch.randn(1, patches + 1, DECODER_DIM) * 0.02)
        self.decoder_blocks = nn.ModuleList([ViTBlock(DECODER_DIM, 4) for _ in range(LAYERS // 2)])
        self.decoder_norm = nn.LayerNorm(DECODER_DIM)
        self.decoder_pred = nn.Linear(DECODER_DIM, PATCH * PATCH * CHANNELS)

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        h = w = imgs.shape[2] // PATCH
        x = imgs.reshape(imgs.shape[0], CHANNELS, h, PATCH, w, PATCH)
        return torch.einsum("nchpwq->nhwpqc", x).reshape(imgs.shape[0], h * w, PATCH * PATCH * CHANNELS)

    def random_masking(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, length, d = x.shape
        keep = int(length * (1 - self.mask_ratio))
        ids_shuffle = torch.argsort(torch.rand(n, length, device=x.device), dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        x_masked = torch.gather(x, 1, ids_shuffle[:, :keep].unsqueeze(-1).repeat(1, 1, d))
        mask = torch.ones(n, length, device=x.device)
        mask[:, :keep] = 0
        return x_masked, torch.gather(mask, 1, ids_restore), ids_restore

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2) + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x)
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1)
        for block in self.blocks:
            x = block(x)
        x = self.decoder_embed(self.norm(x))
        tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], tokens], dim=1)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        for block in self.decoder_blocks:
            x = block(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:, :]
        loss = ((pred - self.patchify(pixel_values)) ** 2).mean(dim=-1)
        return {"logits": pred, "loss": (loss * mask).sum() / mask.sum()}


# ---- Soft MoE ------------------------------------------------------------------------------

EXPERTS, SLOTS, CLASSES = 4, 2, 10


class SoftMoE(nn.Module):
    """Each slot takes a softmax-over-tokens mix of the tokens; each token takes a
    softmax-over-slots mix of the experts' slot outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.phi = nn.Parameter(torch.randn(DIM, EXPERTS * SLOTS) * DIM**-0.5)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) * (2 * DIM) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        logits = torch.einsum("bmd,dn->bmn", x, self.phi)
        dispatch, combine = logits.softmax(dim=1), logits.softmax(dim=-1)
        slots = torch.einsum("bmd,bmn->bnd", x, dispatch).view(b, EXPERTS, SLOTS, DIM)
        hidden = F.gelu(torch.einsum("besd,edh->besh", slots, self.w1))
        out = torch.einsum("besh,ehd->besd", hidden, self.w2).reshape(b, EXPERTS * SLOTS, DIM)
        return torch.einsum("bnd,bmn->bmd", out, combine)


class SoftMoEEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.ModuleList([ViTBlock(DIM, HEADS) for _ in range(LAYERS // 2)])
        self.moe_norm = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS // 2)])
        self.moe = nn.ModuleList([SoftMoE() for _ in range(LAYERS // 2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for attn, norm, moe in zip(self.attn, self.moe_norm, self.moe):
            x = attn(x)
            x = x + moe(norm(x))
        logits = self.head(self.norm(x).mean(dim=1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- random draws in the forward: a VAE bottleneck, stochastic binary units ---------------


class StochasticMLP(nn.Module):
    """A reparametrized Gaussian (``mu + sigma * randn_like(mu)``) and Bernoulli units with a
    straight-through gradient (``bernoulli(p)``), drawn from column-parallel projections."""

    def __init__(self) -> None:
        super().__init__()
        self.to_stats = nn.Linear(DIM, 4 * DIM)
        self.to_probs = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.to_stats(x).chunk(2, dim=-1)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        p = torch.sigmoid(self.to_probs(x))
        bits = p + (torch.bernoulli(p) - p).detach()
        return self.out(torch.cat([z, bits], dim=-1))


class StochasticLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([StochasticMLP() for _ in range(LAYERS // 2)])
        self.norms = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS // 2)])
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        logits = self.lm_head(x)
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- CLIP: two towers and a contrastive loss over the batch ---------------------------------

EMBED = 32


class TextTower(nn.Module):
    """Causal text transformer pooled at each row's end-of-text token (its highest id)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, DIM)
        self.positional_embedding = nn.Parameter(torch.randn(SEQ, DIM) * 0.01)
        self.resblocks = nn.ModuleList([ViTBlock(DIM, HEADS) for _ in range(LAYERS // 2)])
        self.ln_final = nn.LayerNorm(DIM)
        self.text_projection = nn.Parameter(torch.randn(DIM, EMBED) * DIM**-0.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(input_ids) + self.positional_embedding
        for block in self.resblocks:
            x = block(x)
        x = self.ln_final(x)
        return x[torch.arange(x.shape[0]), input_ids.argmax(dim=-1)] @ self.text_projection


class ImageTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, DIM, PATCH, PATCH, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(DIM) * 0.02)
        self.positional_embedding = nn.Parameter(torch.randn((IMAGE // PATCH) ** 2 + 1, DIM) * 0.02)
        self.ln_pre, self.ln_post = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.resblocks = nn.ModuleList([ViTBlock(DIM, HEADS) for _ in range(LAYERS // 2)])
        self.proj = nn.Parameter(torch.randn(DIM, EMBED) * DIM**-0.5)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.conv1(pixel_values).flatten(2).permute(0, 2, 1)
        cls = self.class_embedding.to(x.dtype) + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding)
        for block in self.resblocks:
            x = block(x)
        return self.ln_post(x[:, 0, :]) @ self.proj


class CLIP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual = ImageTower()
        self.transformer = TextTower()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        image = self.visual(pixel_values)
        text = self.transformer(input_ids)
        image = image / image.norm(dim=1, keepdim=True)
        text = text / text.norm(dim=1, keepdim=True)
        logits = self.logit_scale.exp() * image @ text.t()
        labels = torch.arange(logits.shape[0])
        return {"logits": logits, "loss": (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2}


# ---- PVT: attention whose keys and values come from a strided convolution of the grid ------


class SpatialReductionAttention(nn.Module):
    def __init__(self, ratio: int = 2) -> None:
        super().__init__()
        self.ratio = ratio
        self.q = nn.Linear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * DIM)
        self.sr = nn.Conv2d(DIM, DIM, kernel_size=ratio, stride=ratio)
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, HEADS, c // HEADS).permute(0, 2, 1, 3)
        x_ = self.sr(x.permute(0, 2, 1).reshape(b, c, h, w)).reshape(b, c, -1).permute(0, 2, 1)
        kv = self.kv(self.norm(x_)).reshape(b, -1, 2, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        attn = (q @ k.transpose(-2, -1) * (c // HEADS) ** -0.5).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class PVTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SpatialReductionAttention()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), h, w)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PVT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(CHANNELS, DIM, PATCH, PATCH)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2, DIM) * 0.02)
        self.blocks = nn.ModuleList([PVTBlock() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.patch_embed(pixel_values)
        h, w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x, h, w)
        logits = self.head(self.norm(x).mean(dim=1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- mistral-inference's MoE: torch.where over the routed (token, slot) pairs --------------


class WhereTupleMoE(nn.Module):
    def __init__(self, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList([ReluSquaredMLP() for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = x.view(-1, x.shape[-1])
        weights, selected = torch.topk(self.gate(inputs), self.top_k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results.view_as(x)


# ---- Transformer-XL: relative positions by the pad-and-reshape shift -----------------------


class RelShiftAttention(nn.Module):
    """Scores against sinusoidal relative positions, aligned by ``_rel_shift`` (pad one column,
    view the scores with the key and query dims swapped, drop the first row)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.r_net = nn.Linear(DIM, DIM, bias=False)
        self.r_w_bias = nn.Parameter(torch.randn(HEADS, HEAD_DIM) * 0.02)
        self.r_r_bias = nn.Parameter(torch.randn(HEADS, HEAD_DIM) * 0.02)
        self.o = nn.Linear(DIM, DIM, bias=False)
        inv = 1 / (10000 ** (torch.arange(0.0, DIM, 2.0) / DIM))
        self.register_buffer("inv_freq", inv, persistent=False)

    @staticmethod
    def rel_shift(x: torch.Tensor) -> torch.Tensor:  # [q, k, b, h]
        pad = torch.zeros((x.size(0), 1, *x.size()[2:]), dtype=x.dtype)
        padded = torch.cat([pad, x], dim=1).view(x.size(1) + 1, x.size(0), *x.size()[2:])
        return padded[1:].view_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        w = x.transpose(0, 1)  # [s, b, d], Transformer-XL's layout
        pos = torch.arange(s - 1, -1, -1.0)
        sinusoid = torch.outer(pos, self.inv_freq)
        r_head_k = self.r_net(torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)).view(s, HEADS, HEAD_DIM)
        q, k, v = (t.reshape(s, b, HEADS, HEAD_DIM) for t in self.qkv(w).chunk(3, dim=-1))
        ac = torch.einsum("ibnd,jbnd->ijbn", q + self.r_w_bias, k)
        bd = self.rel_shift(torch.einsum("ibnd,jnd->ijbn", q + self.r_r_bias, r_head_k))
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[:, :, None, None]
        probs = ((ac + bd) * HEAD_DIM**-0.5).masked_fill(causal, float("-inf")).softmax(dim=1)
        out = torch.einsum("ijbn,jbnd->ibnd", probs, v).reshape(s, b, DIM)
        return self.o(out).transpose(0, 1)


# ---- cross-layer attention: odd layers reuse the keys and values of the layer before -------


class CrossLayerKVAttention(nn.Module):
    def __init__(self, makes_kv: bool) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * DIM, bias=False) if makes_kv else None
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        if self.kv is not None:
            k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
            kv = (k, v)
        assert kv is not None
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, DIM)), kv


class CrossLayerKVBlock(nn.Module):
    def __init__(self, makes_kv: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn = CrossLayerKVAttention(makes_kv)
        self.mlp = ReluSquaredMLP()

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h, kv = self.attn(self.norm1(x), kv)
        x = x + h
        return x + self.mlp(self.norm2(x)), kv


class CrossLayerKVLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([CrossLayerKVBlock(makes_kv=i % 2 == 0) for i in range(LAYERS)])
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x, kv = self.embed(input_ids), None
        for layer in self.layers:
            x, kv = layer(x, kv)
        logits = self.lm_head(self.norm(x))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- Gemma's reference code: (1 + w) norms, a scaled embedding, soft-capped logits, tied head


class GemmaRMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (out * (1 + self.weight.float())).type_as(x)


class SoftcapAttention(nn.Module):
    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.qkv_proj = nn.Linear(DIM, (HEADS + 4) * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split([DIM, 2 * HEAD_DIM, 2 * HEAD_DIM], dim=-1)
        q = q.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (t.view(b, s, 2, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // 2, dim=1) for t in (k, v))
        scores = torch.tanh(q @ k.transpose(2, 3) * HEAD_DIM**-0.5 / 50.0) * 50.0
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
        if self.window is not None:
            mask = mask | torch.tril(torch.ones(s, s, dtype=torch.bool), -self.window)
        probs = scores.masked_fill(mask, -2.3819763e38).float().softmax(dim=-1).type_as(q)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, DIM))


class GeGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(DIM, 4 * DIM)
        self.down_proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaBlock(nn.Module):
    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = GemmaRMSNorm(), GemmaRMSNorm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = GemmaRMSNorm(), GemmaRMSNorm()
        self.self_attn = SoftcapAttention(window)
        self.mlp = GeGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaReference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedder = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([GemmaBlock(window=4 if i % 2 == 0 else None) for i in range(LAYERS)])
        self.norm = GemmaRMSNorm()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embedder(input_ids)
        x = x * torch.tensor(DIM**0.5, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x)
        logits = torch.matmul(self.norm(x), self.embedder.weight.t())
        logits = torch.tanh(logits / 30.0) * 30.0
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- the lecture GPT: one module per head, concatenated ------------------------------------


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.key = nn.Linear(DIM, HEAD_DIM, bias=False)
        self.query = nn.Linear(DIM, HEAD_DIM, bias=False)
        self.value = nn.Linear(DIM, HEAD_DIM, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(SEQ, SEQ)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, t, _ = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = F.softmax(wei.masked_fill(self.tril[:t, :t] == 0, float("-inf")), dim=-1)
        return wei @ self.value(x)


class MultiHeadAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([Head() for _ in range(HEADS)])
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


# ---- experts batched by torch.vmap over their stacked weights -------------------------------


class VmapExperts(nn.Module):
    """Every expert runs on every token (a dense mixture weighted by the router), batched by
    ``torch.vmap`` over stacked ``[E, D, F]`` and ``[E, F, D]`` weights."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, DIM, 2 * DIM) * DIM**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * DIM, DIM) * (2 * DIM) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(dim=-1)  # [B, S, E]
        outs = torch.vmap(lambda w1, w2: F.gelu(x @ w1) @ w2)(self.w1, self.w2)  # [E, B, S, D]
        return torch.einsum("bse,ebsd->bsd", gates, outs)


# ---- a vector-quantized bottleneck: nearest code by distance, straight-through ---------------


class VectorQuantizer(nn.Module):
    def __init__(self, codes: int = 64) -> None:
        super().__init__()
        self.codebook = nn.Embedding(codes, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, DIM)
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.codebook.weight.t() + self.codebook.weight.pow(2).sum(1)
        quantized = self.codebook(dist.argmin(dim=1)).view_as(x)
        commitment = F.mse_loss(x, quantized.detach()) + F.mse_loss(quantized, x.detach())
        return x + (quantized - x).detach(), commitment


class VQTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS)])
        self.vq = VectorQuantizer()
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == LAYERS // 2 - 1:
                x, commitment = self.vq(x)
        logits = self.lm_head(self.norm(x))
        return {"logits": logits, "loss": lm_loss(logits, labels) + 0.25 * commitment}


# ---- Deformable DETR's attention: values sampled at learned offsets by grid_sample ----------


class DeformableAttention(nn.Module):
    """One feature level, ``POINTS`` sampling points per head: offsets and weights from the
    query, values sampled by ``F.grid_sample`` with the heads folded into the batch."""

    POINTS = 4

    def __init__(self) -> None:
        super().__init__()
        self.sampling_offsets = nn.Linear(DIM, HEADS * self.POINTS * 2)
        self.attention_weights = nn.Linear(DIM, HEADS * self.POINTS)
        self.value_proj = nn.Linear(DIM, DIM)
        self.output_proj = nn.Linear(DIM, DIM)

    def forward(self, query: torch.Tensor, reference: torch.Tensor, value: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, lq, _ = query.shape
        v = self.value_proj(value).view(b, h * w, HEADS, HEAD_DIM)
        offsets = self.sampling_offsets(query).view(b, lq, HEADS, self.POINTS, 2)
        weights = self.attention_weights(query).view(b, lq, HEADS, self.POINTS).softmax(-1)
        locations = reference[:, :, None, None, :] + offsets / torch.tensor([w, h], dtype=query.dtype)
        grid = 2 * locations - 1  # [b, lq, H, P, 2] in [-1, 1]
        v = v.flatten(2).transpose(1, 2).reshape(b * HEADS, HEAD_DIM, h, w)
        grid = grid.transpose(1, 2).flatten(0, 1)  # [b*H, lq, P, 2]
        sampled = F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False)  # [b*H, D, lq, P]
        weights = weights.transpose(1, 2).reshape(b * HEADS, 1, lq, self.POINTS)
        out = (sampled * weights).sum(-1).view(b, HEADS * HEAD_DIM, lq)
        return self.output_proj(out.transpose(1, 2))


class DeformableEncoder(nn.Module):
    GRID = 4

    def __init__(self) -> None:
        super().__init__()
        self.input_proj = nn.Conv2d(CHANNELS, DIM, PATCH, PATCH)
        self.layers = nn.ModuleList([DeformableAttention() for _ in range(LAYERS // 2)])
        self.norms = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS // 2)])
        self.ffns = nn.ModuleList([ReluSquaredMLP() for _ in range(LAYERS // 2)])
        self.head = nn.Linear(DIM, CLASSES)
        ys, xs = torch.meshgrid(torch.linspace(0.5, self.GRID - 0.5, self.GRID), torch.linspace(0.5, self.GRID - 0.5, self.GRID), indexing="ij")
        self.register_buffer("reference", torch.stack([xs.flatten() / self.GRID, ys.flatten() / self.GRID], -1)[None], persistent=False)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.input_proj(pixel_values)
        h, w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        reference = self.reference.expand(x.shape[0], -1, -1)
        for attn, norm, ffn in zip(self.layers, self.norms, self.ffns):
            x = norm(x + attn(x, reference, x, h, w))
            x = x + ffn(x)
        logits = self.head(x.mean(dim=1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- memory tokens: learned slots prepended to every segment (RMT-style) --------------------


class MemoryTokenLM(nn.Module):
    MEMORY = 4

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.memory = nn.Parameter(torch.randn(self.MEMORY, DIM) * 0.02)
        self.layers = nn.ModuleList([PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        x = torch.cat([self.memory.expand(x.shape[0], -1, -1), x], dim=1)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x[:, self.MEMORY :]))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- MEGABYTE-style: a global model over patches, a local model within each ----------------


class PatchLM(nn.Module):
    PATCH_LEN = 4

    def __init__(self) -> None:
        super().__init__()
        self.global_embed = nn.Embedding(VOCAB, DIM // self.PATCH_LEN)
        self.local_embed = nn.Embedding(VOCAB, DIM)
        self.global_layers = nn.ModuleList([PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS // 2)])
        self.global_to_local = nn.Linear(DIM // self.PATCH_LEN, DIM)
        self.local_layers = nn.ModuleList([PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS // 2)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        b, s = input_ids.shape
        p = self.PATCH_LEN
        patches = self.global_embed(input_ids).reshape(b, s // p, DIM)  # each patch's bytes concatenated
        patches = F.pad(patches, (0, 0, 1, -1))  # shift by one patch: a patch sees the ones before it
        for layer in self.global_layers:
            patches = layer(patches)
        context = self.global_to_local(patches.reshape(b, s, DIM // p)).reshape(b * s // p, p, DIM)
        local = self.local_embed(input_ids).reshape(b * s // p, p, DIM)
        local = F.pad(local, (0, 0, 1, -1)) + context  # shift by one byte within the patch
        for layer in self.local_layers:
            local = layer(local)
        logits = self.lm_head(self.norm(local)).reshape(b, s, VOCAB)
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- Swin V2's cosine attention: normalized q and k, a clamped learned scale per head ---------


class CosineAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.rand(HEADS, 1, 1) + 1))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        return self.proj((attn.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


# ---- an encoder-decoder with a padding mask and Flamingo-style gated cross-attention --------


class GatedCrossAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, DIM)
        self.gate = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (t.view(b, memory.shape[1], HEADS, HEAD_DIM).transpose(1, 2) for t in self.kv(memory).chunk(2, dim=-1))
        scores = (q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5
        scores = scores.masked_fill(~memory_mask[:, None, None, :], float("-inf"))
        return torch.tanh(self.gate) * self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, DIM))


class PaddedEncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.ModuleList([PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS // 2)])
        self.decoder = nn.ModuleList([PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS // 2)])
        self.cross = nn.ModuleList([GatedCrossAttention() for _ in range(LAYERS // 2)])
        self.cross_norm = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS // 2)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        memory = self.embed(input_ids)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embed(decoder_input_ids)
        for layer, cross, norm in zip(self.decoder, self.cross, self.cross_norm):
            x = layer(x)
            x = x + cross(norm(x), memory, attention_mask)
        logits = self.lm_head(self.norm(x))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "speedrun_gpt": SpeedrunGPT,
    "bitnet_b158": BitNetLM,
    "whisper_encoder": WhisperEncoder,
    "mae_random_masking": MaskedAutoencoder,
    "soft_moe_encoder": SoftMoEEncoder,
    "stochastic_units": StochasticLM,
    "clip_two_towers": CLIP,
    "pvt_spatial_reduction": PVT,
    "where_tuple_moe": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), WhereTupleMoE())),
    "transformer_xl_rel_shift": lambda: DecoderLM(lambda: PreNormBlock(RelShiftAttention())),
    "cross_layer_kv": CrossLayerKVLM,
    "gemma_reference": GemmaReference,
    "module_per_head": lambda: DecoderLM(lambda: PreNormBlock(MultiHeadAttention())),
    "vmap_experts": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), VmapExperts())),
    "vq_bottleneck": VQTransformer,
    "deformable_attention": DeformableEncoder,
    "memory_tokens": MemoryTokenLM,
    "megabyte_patches": PatchLM,
    "swinv2_cosine_attention": lambda: DecoderLM(lambda: PreNormBlock(CosineAttention())),
    "padded_encoder_decoder": PaddedEncoderDecoder,
}
MOE = frozenset({"soft_moe_encoder", "where_tuple_moe", "vmap_experts"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Keyword inputs of model ``name``, the same on every call."""
    gen = torch.Generator().manual_seed(1)
    if name == "whisper_encoder":
        return {"input_features": torch.randn(batch, MELS, FRAMES, generator=gen), "labels": torch.randint(0, VOCAB, (batch, FRAMES // 2), generator=gen)}
    if name == "mae_random_masking":
        return {"pixel_values": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen)}
    if name in ("pvt_spatial_reduction", "deformable_attention"):
        return {"pixel_values": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    if name == "clip_two_towers":
        return {"input_ids": torch.randint(0, VOCAB, (batch, SEQ), generator=gen), "pixel_values": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen)}
    if name == "padded_encoder_decoder":
        lengths = torch.tensor([seq, seq // 2])[:batch]
        return {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=gen), "attention_mask": torch.arange(seq)[None] < lengths[:, None],
                "decoder_input_ids": torch.randint(0, VOCAB, (batch, seq // 2), generator=gen), "labels": torch.randint(0, VOCAB, (batch, seq // 2), generator=gen)}
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, CLASSES, (batch,), generator=gen) if name == "soft_moe_encoder" else torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": labels}


def loss_fn(name: str) -> Callable[[Any], torch.Tensor] | None:
    """The speedrun GPT returns its loss as a bare scalar; the others return ``loss`` in their outputs."""
    return (lambda out: out) if name == "speedrun_gpt" else None
