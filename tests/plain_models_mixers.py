"""Small plain-PyTorch models of the other mixers of issue 27: timm-style vision
transformers (patch embedding, class token, a 10-class head), linear attention with a
causal depthwise short convolution, MoE layers (a loop over experts combined by
``index_put``/``index_add``, 3-D expert tensors with biases and interleaved gate/up) and
a mixture of attention experts. ``build(name)`` makes one; ``example_inputs(name)`` gives
its keyword inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, NanoGPTMLP
from plain_models_attention import MODELS as ATTENTION_MODELS
from plain_models_attention import PreNormBlock, RMSNorm, SwiGLU

IMAGE, PATCH, CLASSES = 16, 4, 10


# ---- timm-style ViT ----------------------------------------------------------------------


class PatchEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, DIM, kernel_size=PATCH, stride=PATCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # B, N, C


class ViTAttention(nn.Module):
    """timm: one qkv linear, ``reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``,
    per-head q/k LayerNorms. ``beit_bias``: BEiT's qkv bias assembled in the forward from a
    q bias, a zero k buffer and a v bias."""

    def __init__(self, beit_bias: bool = False) -> None:
        super().__init__()
        self.beit_bias = beit_bias
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=not beit_bias)
        if beit_bias:
            self.q_bias, self.v_bias = nn.Parameter(torch.randn(DIM) * 0.1), nn.Parameter(torch.randn(DIM) * 0.1)
            self.register_buffer("k_bias", torch.zeros(DIM), persistent=False)
        self.q_norm, self.k_norm = nn.LayerNorm(HEAD_DIM), nn.LayerNorm(HEAD_DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        if self.beit_bias:
            qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        else:
            qkv = self.qkv(x)
        q, k, v = qkv.reshape(B, N, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 0.5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ViTBlock(nn.Module):
    def __init__(self, beit_bias: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.ls1 = ViTAttention(beit_bias), LayerScale(DIM)
        self.mlp, self.ls2 = NanoGPTMLP(), LayerScale(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    """Patch embedding (conv), class token, learned positions, blocks, a 10-class head on
    the class token."""

    def __init__(self, beit_bias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch_embed = PatchEmbed()
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, DIM) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(beit_bias) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.patch_embed(pixel_values)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        logits = self.head(x[:, 0])
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


# ---- linear attention with a short causal depthwise convolution ---------------------------


class ShortConv(nn.Module):
    """Causal depthwise conv1d over the sequence (``F.pad`` on the left), channels last."""

    def __init__(self, channels: int, kernel: int = 4) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))
        return F.silu(self.conv(x)).transpose(1, 2)


class LinearAttention(nn.Module):
    """q/k/v short convolutions, L2-normalized q and k per head, causal linear attention
    (scores without softmax), an output gate, then the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.q_conv, self.k_conv, self.v_conv = ShortConv(DIM), ShortConv(DIM), ShortConv(DIM)
        self.o_norm = RMSNorm(HEAD_DIM)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_conv(self.q_proj(x)), self.k_conv(self.k_proj(x)), self.v_conv(self.v_proj(x))
        q, k, v = (t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)
        scores = (q @ k.transpose(-1, -2)).tril()
        o = self.o_norm((scores @ v).transpose(1, 2))
        o = o.reshape(b, s, DIM) * F.silu(self.g_proj(x))
        return self.o_proj(o)


# ---- MoE: a loop over experts, combined by index_put / index_add ---------------------------


class Expert(nn.Module):
    def __init__(self, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(DIM, hidden, bias=False), nn.Linear(hidden, DIM, bias=False), nn.Linear(DIM, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Top-2 routing; each expert's tokens found by ``torch.where``; ``index_put`` (``y[idx]
    += ...``) or ``index_add_`` combines them, plus a shared expert."""

    EXPERTS, TOP_K = 4, 2

    def __init__(self, combine: str) -> None:
        super().__init__()
        self.combine = combine
        self.gate = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(self.EXPERTS))
        self.shared = Expert()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])
        weights, indices = torch.topk(self.gate(x).softmax(-1), self.TOP_K, dim=-1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx, top = torch.where(indices == i)
            if self.combine == "index_put":
                y[idx] += expert(x[idx]) * weights[idx, top, None]
            else:
                y.index_add_(0, idx, expert(x[idx]) * weights[idx, top, None])
        return (y + self.shared(x)).view(shape)


# ---- MoE: experts stored as 3-D tensors [E, H, 2I] with biases, interleaved gate/up --------


class StackedExperts(nn.Module):
    """gpt-oss-like: ``gate_up_proj`` [E, H, 2I] whose gate and up columns alternate
    (``[..., ::2]``, ``[..., 1::2]``), biases [E, 2I] and [E, H]; every expert runs on every
    token by ``bmm`` and the routing weights (zero off the top-k) combine them."""

    EXPERTS, TOP_K, INTER = 4, 2, 2 * DIM

    def __init__(self) -> None:
        super().__init__()
        E, I = self.EXPERTS, self.INTER
        self.router = nn.Linear(DIM, E)
        self.gate_up_proj = nn.Parameter(torch.randn(E, DIM, 2 * I) * DIM**-0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, I, DIM) * I**-0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(E, DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        values, indices = torch.topk(self.router(tokens), self.TOP_K, dim=-1)
        routing = torch.zeros(tokens.shape[0], self.EXPERTS, dtype=x.dtype, device=x.device)
        routing = routing.scatter(1, indices, values.softmax(-1))
        rep = tokens.unsqueeze(0).expand(self.EXPERTS, -1, -1)
        gate_up = torch.bmm(rep, self.gate_up_proj) + self.gate_up_proj_bias[:, None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        glu = gate.clamp(max=7.0) * torch.sigmoid(gate * 1.702)
        out = torch.bmm((up.clamp(-7.0, 7.0) + 1) * glu, self.down_proj) + self.down_proj_bias[:, None, :]
        out = (out * routing.transpose(0, 1)[..., None]).sum(dim=0)
        return out.view(b, s, h)


# ---- a mixture of attention experts ------------------------------------------------------


class AttentionExperts(nn.Module):
    """Two full attention experts mixed per token by a softmax router (dense MoA)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 2, bias=False)
        self.experts = nn.ModuleList(NanoGPTAttention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.router(x).softmax(-1)
        return sum(w[..., e : e + 1] * expert(x) for e, expert in enumerate(self.experts))


class HeadExperts(nn.Module):
    """JetMoE's mixture of attention heads: each token's top-k experts (``[E, kv*D, DIM]``
    stacked weights) project its queries for the shared key/value heads, which ``repeat``
    tiles once per choice; each choice's heads go back through its expert's output
    projection, weighted by the router's gates."""

    EXPERTS, TOP_K, KV_HEADS = 4, 2, 4

    def __init__(self) -> None:
        super().__init__()
        width = self.KV_HEADS * HEAD_DIM
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.input_linear = nn.Parameter(torch.randn(self.EXPERTS, width, DIM) * DIM**-0.5)
        self.output_linear = nn.Parameter(torch.randn(self.EXPERTS, DIM, width) * width**-0.5)
        self.kv_proj = nn.Linear(DIM, 2 * width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        flat = x.reshape(-1, DIM)
        gates, chosen = self.router(flat).topk(self.TOP_K, dim=-1)
        gates, onehot = gates.softmax(-1), F.one_hot(chosen, self.EXPERTS).to(x.dtype)  # [T, k], [T, k, E]
        q = sum(onehot[..., e, None] * F.linear(flat, self.input_linear[e])[:, None] for e in range(self.EXPERTS))
        q = q.view(b, s, -1, HEAD_DIM).transpose(1, 2)  # k choices x kv heads
        k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2).repeat(1, self.TOP_K, 1, 1) for t in self.kv_proj(x).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * s, self.TOP_K, -1)
        out = sum((onehot[..., e, None] * gates[..., None] * F.linear(y, self.output_linear[e])).sum(1) for e in range(self.EXPERTS))
        return out.view(b, s, DIM)


MODELS: dict[str, Callable[[], nn.Module]] = {
    **ATTENTION_MODELS,
    "vit": VisionTransformer,
    "vit_beit_bias": lambda: VisionTransformer(beit_bias=True),
    "linear_attention_conv": lambda: DecoderLM(lambda: PreNormBlock(LinearAttention(), norm=RMSNorm), norm=RMSNorm),
    "moe_index_put": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), LoopMoE("index_put"))),
    "moe_index_add": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), LoopMoE("index_add"))),
    "moe_stacked_experts": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), StackedExperts())),
    "attention_experts": lambda: DecoderLM(lambda: PreNormBlock(AttentionExperts(), SwiGLU())),
    "attention_head_experts": lambda: DecoderLM(lambda: PreNormBlock(HeadExperts(), SwiGLU(hidden=DIM))),
}
VISION = frozenset({"vit", "vit_beit_bias"})
MOE = frozenset({"moe_index_put", "moe_index_add", "moe_stacked_experts"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """Keyword inputs of model ``name``, the same on every call."""
    gen = torch.Generator().manual_seed(1)
    if name in VISION:
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen),
                "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}  # fmt: skip
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    return {"input_ids": ids, "labels": labels}
