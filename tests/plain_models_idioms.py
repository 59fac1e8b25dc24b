"""Small plain-PyTorch models with idioms of training code the earlier rounds did not write
(issue 27, tenth round).

Side effects in the forward: a gradient hook registered on an activation (``register_hook``,
scaling the gradient that flows through it; normalizing the whole gradient; clipping the
gradient of a tensor used before and after the registration); routing statistics kept on the module for logging
(``.item()`` and ``.tolist()``). Mixture-of-experts: torchtitan's grouped GEMM (tokens sorted
by expert, ``F.grouped_mm`` with the offsets of a ``histc``); hash routing (the expert is the
token id modulo the experts, no router). Adapters: (IA)^3's learned vectors on keys, values and
the FFN's hidden units; prefix tuning (learned keys and values per layer and head, concatenated
before the sequence's). Quantization-aware training with per-output-channel fake quantization of
the weights (``torch.fake_quantize_per_channel_affine``). Layers: attention run document by
document over ``cu_seqlens.tolist()`` (the packed-sequence reference of varlen kernels);
DenseFormer's depth-weighted averages of every earlier layer's output; a mixture of attention
heads (each token's top-k heads by a router, MoH); Dynamic Tanh in place of the norms; a
bidirectional mixer scanning the sequence flipped; an ``nn.LSTM`` layer between attention blocks;
SDPA inside ``sdpa_kernel``; Matryoshka heads (the loss summed over prefixes of the hidden dim);
heads laid out by composites without a rule of their own (``movedim``, ``swapaxes``,
``tensor_split``, ``narrow``); ``hardswish`` and ``PReLU``, which PyTorch does not tag pointwise.

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
from torch.nn.attention import SDPBackend, sdpa_kernel

from plain_models_attention import DIM, HEADS, HEAD_DIM, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, SwiGLU, lm_loss
from plain_models_frontier import decoder_of, merge_heads, split_heads

SEQ = 16
EXPERTS, TOP_K, EXPERT_HIDDEN = 4, 2, 64


class FusedHeads(nn.Module):
    """A fused q/k/v projection split into heads (``heads``) and an output projection ``o``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))


class RoutedExperts(nn.Module):
    """A router over ``EXPERTS`` SwiGLU experts; subclasses route."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU(DIM, EXPERT_HIDDEN) for _ in range(EXPERTS))


class MovedAxesAttention(FusedHeads):
    """Heads laid out by composites without a rule of their own: q/k/v split by
    ``tensor_split``, heads moved by ``movedim``, merged by ``swapaxes``; the FFN's hidden units
    cut by ``narrow`` (einops- and NumPy-style code)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (HEADS, -1)).movedim(2, 1) for t in self.qkv(x).tensor_split(3, dim=-1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).swapaxes(1, 2).flatten(2))
        h = self.up(x)
        return x + self.down(F.silu(h.narrow(-1, 0, 2 * DIM)) * h.narrow(-1, 2 * DIM, 2 * DIM))


class HardSwishFFN(nn.Module):
    """MobileViT-style activations PyTorch leaves untagged pointwise: ``hardswish`` and a
    learned ``PReLU`` on the FFN's hidden units."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.prelu = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), nn.PReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.prelu(F.hardswish(self.up(x))))


class HookedAttention(NanoGPTAttention):
    """The attention output's gradient halved by a hook (a gradient-scaling trick)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if y.requires_grad:
            y.register_hook(lambda grad: grad * 0.5)
        return y


class NormalizedGradientFFN(SwiGLU):
    """The FFN's hidden units' gradient normalized to unit norm by a hook (a gradient-normalization
    trick): the hook reads the whole gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w1(x)) * self.w3(x)
        if h.requires_grad:
            h.register_hook(lambda grad: grad / (grad.norm() + 1e-6))
        return self.w2(h)


GRAD_CLIP = 1e-3


class ClippedReusedFFN(nn.Module):
    """A hook clipping the gradient of the FFN's hidden units, registered between their two uses:
    it clips the sum of both uses' gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        gate = torch.sigmoid(h)
        if h.requires_grad:
            h.register_hook(lambda grad: grad.clamp(-GRAD_CLIP, GRAD_CLIP))
        return self.down(gate * h)


class LoggedRouterMoE(RoutedExperts):
    """Top-2 MoE whose forward keeps the tokens per expert and the aux loss as Python numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens_per_expert: list[int] = []
        self.last_aux = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        weights, chosen = probs.topk(TOP_K, dim=-1)
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS)
        self.tokens_per_expert = counts.tolist()
        self.last_aux = (probs.mean((0, 1)) * counts.float() / chosen.numel()).sum().item()
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (weights * (chosen == e)).sum(-1, keepdim=True)
            out = out + gate * expert(x)
        return out


class GroupedGemmMoE(nn.Module):
    """torchtitan's MoE: expert weights stored [E, dim, hidden], tokens sorted by expert and run
    by ``F.grouped_mm`` with cumulative offsets, then scattered back weighted."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        scale = DIM**-0.5
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, EXPERT_HIDDEN) * scale)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, DIM, EXPERT_HIDDEN) * scale)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, EXPERT_HIDDEN, DIM) * EXPERT_HIDDEN**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        weights, chosen = self.router(flat).softmax(-1).topk(TOP_K, dim=-1)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.histc(chosen.flatten().float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = counts.cumsum(0).to(torch.int32)
        routed = flat[order // TOP_K]
        hidden = F.silu(F.grouped_mm(routed, self.w1, offs=offsets)) * F.grouped_mm(routed, self.w3, offs=offsets)
        out = F.grouped_mm(hidden, self.w2, offs=offsets) * weights.flatten()[order, None]
        combined = torch.zeros_like(flat).index_add_(0, order // TOP_K, out)
        return combined.view_as(x)


class HashRoutedMoE(nn.Module):
    """Hash layers: token ``t`` goes to expert ``t % E``; the ids reach every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(SwiGLU(DIM, EXPERT_HIDDEN) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        bucket = (input_ids % EXPERTS).unsqueeze(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = torch.where(bucket == e, expert(x), out)
        return out


class HashRoutedLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention(), HashRoutedMoE()))

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer.attention(layer.attention_norm(h))
            h = h + layer.feed_forward(layer.ffn_norm(h), input_ids)
        return h


class IA3Attention(nn.Module):
    """(IA)^3: keys and values scaled by learned vectors (PEFT's ``ia3_l``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.ia3_k = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.ia3_v = nn.Parameter(torch.linspace(1.5, 0.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x) * self.ia3_k, self.v(x) * self.ia3_v
        y = F.scaled_dot_product_attention(split_heads(q), split_heads(k), split_heads(v), is_causal=True)
        return self.o(merge_heads(y))


class IA3FFN(SwiGLU):
    def __init__(self) -> None:
        super().__init__()
        self.ia3_ff = nn.Parameter(torch.linspace(0.7, 1.3, 2 * DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x) * self.ia3_ff)


PREFIX = 4


class PrefixTunedAttention(FusedHeads):
    """Prefix tuning: ``PREFIX`` learned keys and values per head before the sequence's."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(2, HEADS, PREFIX, HEAD_DIM) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.heads(x)
        k = torch.cat([self.prefix[0].expand(b, -1, -1, -1), k], dim=2)
        v = torch.cat([self.prefix[1].expand(b, -1, -1, -1), v], dim=2)
        visible = torch.ones(s, PREFIX + s, dtype=torch.bool, device=x.device).tril(PREFIX)
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=visible)))


class FakeQuantLinear(nn.Linear):
    """QAT: the weight fake-quantized to int8 per output channel, scales from each row's max."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight.detach().abs().amax(dim=1).clamp_min(1e-5) / 127
        zero = torch.zeros(self.out_features, dtype=torch.int32, device=x.device)
        weight = torch.fake_quantize_per_channel_affine(self.weight, scale, zero, 0, -128, 127)
        return F.linear(x, weight, self.bias)


class FakeQuantAttention(NanoGPTAttention):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = FakeQuantLinear(DIM, 3 * DIM), FakeQuantLinear(DIM, DIM)


class FakeQuantFFN(SwiGLU):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = FakeQuantLinear(DIM, 2 * DIM), FakeQuantLinear(2 * DIM, DIM), FakeQuantLinear(DIM, 2 * DIM)


class DocumentLoopAttention(FusedHeads):
    """Packed documents attended one by one: the slices come from ``cu_seqlens.tolist()``."""

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        bounds = cu_seqlens.tolist()
        pieces = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True) for a, b in zip(bounds[:-1], bounds[1:])]
        return self.o(merge_heads(torch.cat(pieces, dim=2)))


class PackedDocumentsLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(DocumentLoopAttention()))

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer.attention(layer.attention_norm(h), cu_seqlens)
            h = h + layer.feed_forward(layer.ffn_norm(h))
        logits = self.logits(h)
        return {"logits": logits, "loss": lm_loss(logits, labels)}


class DenseFormerLM(DecoderLM):
    """DenseFormer: after layer ``i`` the stream is a learned average of the embeddings and every
    layer output so far (depth-weighted averaging)."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.depth_weights = nn.ParameterList(nn.Parameter(F.one_hot(torch.tensor(i + 1), i + 2).float() * 0.6 + 0.2) for i in range(LAYERS))

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        outputs = [self.embed(input_ids)]
        for layer, alpha in zip(self.layers, self.depth_weights):
            outputs.append(layer(outputs[-1]))
            h = torch.einsum("l,lbsd->bsd", alpha, torch.stack(outputs))
            outputs[-1] = h
        return outputs[-1]


class MixtureOfHeadsAttention(FusedHeads):
    """MoH: a router picks each token's top-k heads; the others' outputs are zeroed and the picked
    ones weighted by the router's softmax over them."""

    def __init__(self) -> None:
        super().__init__()
        self.head_router = nn.Linear(DIM, HEADS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, D]
        logits = self.head_router(x)  # [B, S, H]
        top, picked = logits.topk(HEADS // 2, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, picked, top.softmax(-1))
        return self.o(merge_heads(y * gates.transpose(1, 2).unsqueeze(-1)))


class DynamicTanh(nn.Module):
    """DyT: ``weight * tanh(alpha * x) + bias`` instead of a norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.8))
        self.weight, self.bias = nn.Parameter(torch.linspace(0.9, 1.1, dim)), nn.Parameter(torch.linspace(-0.1, 0.1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.alpha * x) + self.bias


class BidirectionalScanMixer(nn.Module):
    """Vision Mamba's two directions, simplified: a gated decaying cumulative sum over the
    sequence forward and over it flipped, the two summed."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.decay = nn.Parameter(torch.linspace(0.5, 0.95, DIM))
        self.out_proj = nn.Linear(DIM, DIM, bias=False)

    def scan(self, u: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(u.shape[1], device=u.device, dtype=u.dtype)
        rate = self.decay.log()  # per channel
        scaled = u * torch.exp(-steps[:, None] * rate)
        return scaled.cumsum(1) * torch.exp(steps[:, None] * rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        both = self.scan(u) + self.scan(u.flip(1)).flip(1)
        return self.out_proj(both * F.silu(gate))


class LSTMBlock(nn.Module):
    """An ``nn.LSTM`` layer as a block's sequence mixer (speech and hybrid encoders)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.lstm = nn.LSTM(DIM, DIM, batch_first=True)
        self.ffn_norm, self.ffn = nn.LayerNorm(DIM), SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.lstm(self.norm(x))[0]
        return h + self.ffn(self.ffn_norm(h))


class MathKernelAttention(NanoGPTAttention):
    """SDPA pinned to the math backend by ``sdpa_kernel`` (done for determinism)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.MATH]):
            return super().forward(x)


MATRYOSHKA = (16, 32, DIM)


class MatryoshkaLM(DecoderLM):
    """Matryoshka representation learning: the head's loss on each prefix of the hidden dim,
    read through the matching columns of the one output matrix, summed."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids))
        losses = [lm_loss(F.linear(h[..., :d], self.output.weight[:, :d]), labels) for d in MATRYOSHKA]
        return {"logits": self.output(h), "loss": torch.stack(losses).sum()}


class FastWeightFFN(nn.Module):
    """Fast weights: an FFN run by ``torch.func.functional_call`` with its up-projection plus a
    low-rank delta made from each sequence's mean (a hypernetwork's per-sequence weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.ffn = SwiGLU()
        self.delta_a = nn.Linear(DIM, 4, bias=False)
        self.delta_b = nn.Parameter(torch.randn(2 * DIM, 4) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        coeff = self.delta_a(x.mean(1))  # [B, 4]
        outs = []
        for b in range(x.shape[0]):
            w1 = self.ffn.w1.weight + (self.delta_b * coeff[b]) @ self.delta_a.weight
            outs.append(torch.func.functional_call(self.ffn, {"w1.weight": w1}, (x[b : b + 1],)))
        return torch.cat(outs)


class BoolMaskMoE(RoutedExperts):
    """Top-1 MoE by boolean masks: ``out[mask] = expert(x[mask])`` (shapes depend on the routing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        weight, chosen = self.router(flat).softmax(-1).max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            mask = chosen == e
            out[mask] = weight[mask, None] * expert(flat[mask])
        return out.view_as(x)


class SinkhornRouterMoE(RoutedExperts):
    """BASE-layer style balanced routing: the router's scores normalized over tokens and experts
    in turn (Sinkhorn iterations), then top-1 by the balanced scores, weighted by the raw softmax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        logits = self.router(flat)
        with torch.no_grad():
            balanced = logits.exp()
            for _ in range(3):
                balanced = balanced / balanced.sum(0, keepdim=True)
                balanced = balanced / balanced.sum(1, keepdim=True)
            chosen = balanced.argmax(-1)
        gate = logits.softmax(-1).gather(-1, chosen[:, None])
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out = out + (chosen == e)[:, None] * gate * expert(flat)
        return out.view_as(x)


LAYER_HEADS, LAYER_FFN = (4, 8), (96, 192)


class OpenELMAttention(nn.Module):
    """Layer-wise scaling (OpenELM): each layer has its own head count (head dim fixed)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(DIM, 3 * heads * HEAD_DIM, bias=False)
        self.o = nn.Linear(heads * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class OpenELMLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: nn.Identity())
        self.layers = nn.ModuleList(PreNormBlock(OpenELMAttention(h), SwiGLU(DIM, f)) for h, f in zip(LAYER_HEADS, LAYER_FFN))


class SelectiveAttention(FusedHeads):
    """Selective attention (Leviathan et al.): head 0's scores, ReLU'd and summed over earlier
    queries, are subtracted from every head's scores (a token masks what it makes redundant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        s = x.shape[1]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = (q @ k.transpose(-1, -2) / HEAD_DIM**0.5).masked_fill(future, float("-inf"))
        selection = F.relu(scores[:, 0]).masked_fill(future, 0.0)
        selection = selection.masked_fill(torch.eye(s, dtype=torch.bool, device=x.device), 0.0)
        penalty = F.pad(selection[:, :-1].cumsum(-2), (0, 0, 1, 0))
        return self.o(merge_heads((scores - penalty[:, None]).softmax(-1) @ v))


class MultiTokenAttention(FusedHeads):
    """Multi-token attention: each head's score map convolved over (query, key) by its own
    causal kernel before the softmax (a depthwise ``conv2d`` with the heads as channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Conv2d(HEADS, HEADS, (3, 3), groups=HEADS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        s = x.shape[1]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = (q @ k.transpose(-1, -2) / HEAD_DIM**0.5).masked_fill(future, 0.0)
        mixed = self.kernel(F.pad(scores, (2, 0, 2, 0))).masked_fill(future, float("-inf"))
        return self.o(merge_heads(mixed.softmax(-1) @ v))


class HeadPoolingAttention(nn.Module):
    """Heads pooled by a softmax over the heads of a learned score of each head's output (the
    output projection reads the pooled head only)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.head_score = nn.Parameter(torch.randn(HEAD_DIM) * 0.3)
        self.o = nn.Linear(HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, S, D]
        weights = (y @ self.head_score).softmax(dim=1)  # over the heads
        return self.o((weights.unsqueeze(-1) * y).sum(1))


class DisentangledAttention(nn.Module):
    """DeBERTa's disentangled attention: content-to-position and position-to-content scores, each
    read from a [S, 2S-1] table of relative positions by ``gather`` along the heads' last dim."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.rel = nn.Parameter(torch.randn(2 * SEQ - 1, DIM) * 0.3)
        self.pos_k, self.pos_q = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (split_heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        pk, pq = split_heads(self.pos_k(self.rel).unsqueeze(0)), split_heads(self.pos_q(self.rel).unsqueeze(0))  # [1, H, 2S-1, D]
        offset = torch.arange(s, device=x.device)[None, :] - torch.arange(s, device=x.device)[:, None] + SEQ - 1  # key - query
        c2p = torch.gather(q @ pk.transpose(-1, -2), -1, offset.expand(b, HEADS, s, s))
        p2c = torch.gather(k @ pq.transpose(-1, -2), -1, (2 * (SEQ - 1) - offset).T.expand(b, HEADS, s, s)).transpose(-1, -2)
        scores = (q @ k.transpose(-1, -2) + c2p + p2c) / math.sqrt(3 * HEAD_DIM)
        return self.o(merge_heads(scores.softmax(-1) @ v))


PAIR, RESIDUES, PAIR_HEADS = 32, 12, 4


class TriangleBlock(nn.Module):
    """A pair representation [B, N, N, C] (AlphaFold/ESMFold): the outgoing triangle
    multiplicative update (``einsum('bikc,bjkc->bijc')`` of gated projections), then
    attention along each row biased per head by a projection of the pair, then a transition."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b, self.gate_a, self.gate_b = nn.LayerNorm(PAIR), *(nn.Linear(PAIR, PAIR) for _ in range(4))
        self.out_norm, self.out, self.out_gate = nn.LayerNorm(PAIR), nn.Linear(PAIR, PAIR), nn.Linear(PAIR, PAIR)
        self.att_norm, self.qkv, self.bias, self.att_out = nn.LayerNorm(PAIR), nn.Linear(PAIR, 3 * PAIR, bias=False), nn.Linear(PAIR, PAIR_HEADS, bias=False), nn.Linear(PAIR, PAIR)
        self.transition = nn.Sequential(nn.LayerNorm(PAIR), nn.Linear(PAIR, 4 * PAIR), nn.ReLU(), nn.Linear(4 * PAIR, PAIR))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.norm(z)
        a, b = torch.sigmoid(self.gate_a(h)) * self.a(h), torch.sigmoid(self.gate_b(h)) * self.b(h)
        z = z + torch.sigmoid(self.out_gate(h)) * self.out(self.out_norm(torch.einsum("bikc,bjkc->bijc", a, b)))
        h = self.att_norm(z)
        n = z.shape[1]
        q, k, v = (t.reshape(*t.shape[:3], PAIR_HEADS, -1).permute(0, 1, 3, 2, 4) for t in self.qkv(h).chunk(3, -1))  # [B, N, Hd, N, D]
        bias = self.bias(h).permute(0, 3, 1, 2).unsqueeze(1)  # [B, 1, Hd, N, N]
        y = ((q @ k.transpose(-1, -2)) / math.sqrt(PAIR // PAIR_HEADS) + bias).softmax(-1) @ v
        z = z + self.att_out(y.permute(0, 1, 3, 2, 4).reshape(*z.shape[:2], n, PAIR))
        return z + self.transition(z)


class PairDistanceModel(nn.Module):
    """Residue pairs from two embeddings (outer sum), two triangle blocks, a distogram head
    (binned distances, cross entropy) on the symmetrized pair."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Embedding(20, PAIR), nn.Embedding(20, PAIR)
        self.blocks = nn.ModuleList(TriangleBlock() for _ in range(LAYERS))
        self.head = nn.Linear(PAIR, 16)

    def forward(self, residues: torch.Tensor, bins: torch.Tensor) -> dict[str, Any]:
        z = self.left(residues)[:, :, None] + self.right(residues)[:, None, :]
        for block in self.blocks:
            z = block(z)
        logits = self.head(z + z.transpose(1, 2))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 2), bins.flatten())}


NODES, EDGES = 10, 24


class MessagePassingLayer(nn.Module):
    """A graph transformer layer: per-head attention over each node's incoming edges (scores
    from the edge's ends, softmax per destination by ``scatter_reduce`` amax and ``index_add``),
    messages summed into the destination by ``index_add_``; then an FFN."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.edge, self.o = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(4, DIM), nn.Linear(DIM, DIM)
        self.ffn_norm, self.ffn = nn.LayerNorm(DIM), SwiGLU()

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, edge_attr: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(-1, HEADS, HEAD_DIM) for t in self.qkv(self.norm(x)).chunk(3, -1))  # [N, H, D]
        e = self.edge(edge_attr).view(-1, HEADS, HEAD_DIM)
        score = (q[dst] * (k[src] + e)).sum(-1) / math.sqrt(HEAD_DIM)  # [E, H]
        top = torch.full((x.shape[0], HEADS), float("-inf")).scatter_reduce(0, dst[:, None].expand(-1, HEADS), score, "amax")
        weight = (score - top[dst]).exp()
        total = torch.zeros(x.shape[0], HEADS).index_add(0, dst, weight)
        message = (weight / total[dst])[..., None] * (v[src] + e)
        h = x + self.o(torch.zeros_like(q).index_add_(0, dst, message).reshape(x.shape[0], DIM))
        return h + self.ffn(self.ffn_norm(h))


class GraphTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MessagePassingLayer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 5)

    def forward(self, node_types: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, edge_attr: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(node_types)
        for layer in self.layers:
            h = layer(h, src, dst, edge_attr)
        logits = self.head(h)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


VARIATES, CONTEXT, HORIZON, PATCH = 3, 32, 8, 8


class PatchTST(nn.Module):
    """Time-series forecasting, channel-independent (PatchTST): RevIN (each series normalized by
    its own mean and std over time, with per-variate affine), patches by ``unfold``, the variates
    folded into the batch, an encoder, a flatten head over patches x hidden, MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.revin_weight, self.revin_bias = nn.Parameter(torch.linspace(0.8, 1.2, VARIATES)), nn.Parameter(torch.linspace(-0.1, 0.1, VARIATES))
        self.patch = nn.Linear(PATCH, DIM)
        self.position = nn.Parameter(torch.randn(CONTEXT // PATCH, DIM) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True, norm_first=True) for _ in range(LAYERS))
        self.head = nn.Linear(DIM * (CONTEXT // PATCH), HORIZON)

    def forward(self, series: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
        b = series.shape[0]  # series [B, T, V]
        mean, std = series.mean(1, keepdim=True), (series.var(1, keepdim=True, unbiased=False) + 1e-5).sqrt()
        x = (series - mean) / std * self.revin_weight + self.revin_bias
        patches = x.transpose(1, 2).unfold(-1, PATCH, PATCH)  # [B, V, P, PATCH]
        h = self.patch(patches).reshape(b * VARIATES, -1, DIM) + self.position
        for layer in self.layers:
            h = layer(h)
        out = self.head(h.flatten(1)).view(b, VARIATES, HORIZON).transpose(1, 2)
        prediction = (out - self.revin_bias) / self.revin_weight * std + mean
        return {"logits": prediction, "loss": F.mse_loss(prediction, target)}


class TopKDistillationLM(DecoderLM):
    """Sparse distillation: a frozen teacher head's top-k vocabulary entries per token, the
    student's log-probabilities gathered there, a KL over those k, plus the usual loss."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.teacher = nn.Linear(DIM, VOCAB, bias=False).requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids))
        logits = self.output(h)
        top, picked = self.teacher(h).topk(8, dim=-1)
        teacher = top.softmax(-1)
        student = logits.log_softmax(-1).gather(-1, picked)
        distill = (teacher * (teacher.log() - student)).sum(-1).mean()
        return {"logits": logits, "loss": lm_loss(logits, labels) + distill}


class AccuracyMetricLM(DecoderLM):
    """Metrics computed in the forward: top-1 accuracy (``argmax`` over the vocabulary) and the
    predictive entropy, returned beside the loss."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.logits(self.hidden(input_ids))
        logp = logits.log_softmax(-1)
        accuracy = (logits.argmax(-1) == labels).float().mean()
        entropy = -(logp.exp() * logp).sum(-1).mean()
        return {"logits": logits, "loss": lm_loss(logits, labels), "accuracy": accuracy, "entropy": entropy.detach()}


PADDED_VOCAB = VOCAB + 8


class PaddedVocabLM(DecoderLM):
    """A head padded to a multiple of 8 beyond the real vocabulary (nanoGPT's 50304); the logits
    of the padding are sliced off before the loss."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.embed, self.output = nn.Embedding(PADDED_VOCAB, DIM), nn.Linear(DIM, PADDED_VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.logits(self.hidden(input_ids))[..., :VOCAB]
        return {"logits": logits, "loss": lm_loss(logits, labels)}


class AlignedAttention(nn.Module):
    """``nn.MultiheadAttention`` returning its weights averaged over the heads; the layer keeps
    the entropy of those weights for an attention-sharpness penalty."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.penalty = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        y, weights = self.attn(x, x, x, attn_mask=future, need_weights=True, average_attn_weights=True)
        self.penalty = -(weights * (weights + 1e-9).log()).sum(-1).mean()
        return y


class AttentionPenaltyLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(AlignedAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.logits(self.hidden(input_ids))
        penalty = torch.stack([layer.attention.penalty for layer in self.layers]).mean()
        return {"logits": logits, "loss": lm_loss(logits, labels) + 0.01 * penalty}


PROMPT = 4


class PromptTunedLM(DecoderLM):
    """Prompt tuning: learned input embeddings concatenated before the sequence; the loss on
    the sequence's positions only."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.prompt = nn.Parameter(torch.randn(PROMPT, DIM) * 0.5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = torch.cat([self.prompt.expand(input_ids.shape[0], -1, -1), self.embed(input_ids)], dim=1)
        for layer in self.layers:
            h = layer(h)
        logits = self.logits(h)[:, PROMPT:]
        return {"logits": logits, "loss": lm_loss(logits, labels)}


def _block_with(attention: Callable[[], nn.Module], mlp: Callable[[], nn.Module] = SwiGLU, norm: Callable[[int], nn.Module] = nn.LayerNorm) -> Callable[[], nn.Module]:
    return lambda: DecoderLM(lambda: PreNormBlock(attention(), mlp(), norm), norm)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gradient_hook": decoder_of(HookedAttention),
    "gradient_norm_hook": decoder_of(NanoGPTAttention, NormalizedGradientFFN),
    "hook_on_reused_tensor": decoder_of(NanoGPTAttention, ClippedReusedFFN),
    "logged_router_stats": decoder_of(NanoGPTAttention, LoggedRouterMoE),
    "grouped_gemm_moe": decoder_of(NanoGPTAttention, GroupedGemmMoE),
    "hash_routed_moe": HashRoutedLM,
    "ia3_adapter": decoder_of(IA3Attention, IA3FFN),
    "prefix_tuning": decoder_of(PrefixTunedAttention),
    "per_channel_fake_quant": decoder_of(FakeQuantAttention, FakeQuantFFN),
    "document_loop_attention": PackedDocumentsLM,
    "denseformer_depth_average": DenseFormerLM,
    "mixture_of_heads": decoder_of(MixtureOfHeadsAttention),
    "dynamic_tanh": _block_with(NanoGPTAttention, norm=DynamicTanh),
    "bidirectional_scan": decoder_of(BidirectionalScanMixer),
    "lstm_layer_mixer": lambda: DecoderLM(LSTMBlock),
    "sdpa_math_kernel": decoder_of(MathKernelAttention),
    "matryoshka_heads": MatryoshkaLM,
    "functional_call_fast_weights": decoder_of(NanoGPTAttention, FastWeightFFN),
    "bool_mask_moe": decoder_of(NanoGPTAttention, BoolMaskMoE),
    "sinkhorn_router_moe": decoder_of(NanoGPTAttention, SinkhornRouterMoE),
    "layerwise_widths": OpenELMLM,
    "selective_attention": decoder_of(SelectiveAttention),
    "multi_token_attention": decoder_of(MultiTokenAttention),
    "head_pooling": decoder_of(HeadPoolingAttention),
    "deberta_disentangled": decoder_of(DisentangledAttention),
    "triangle_pair_updates": PairDistanceModel,
    "graph_message_passing": GraphTransformer,
    "patchtst_revin": PatchTST,
    "topk_distillation": TopKDistillationLM,
    "accuracy_metric": AccuracyMetricLM,
    "padded_vocab_slice": PaddedVocabLM,
    "attention_weights_penalty": AttentionPenaltyLM,
    "prompt_tuning": PromptTunedLM,
    "moved_axes_attention": decoder_of(MovedAxesAttention),
    "hardswish_prelu_ffn": decoder_of(NanoGPTAttention, HardSwishFFN),
}
MOE = frozenset({"logged_router_stats", "grouped_gemm_moe", "hash_routed_moe", "bool_mask_moe", "sinkhorn_router_moe"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    if name == "triangle_pair_updates":
        return {"residues": torch.randint(0, 20, (batch, RESIDUES), generator=gen), "bins": torch.randint(0, 16, (batch, RESIDUES, RESIDUES), generator=gen)}
    if name == "graph_message_passing":
        return {
            "node_types": torch.randint(0, VOCAB, (NODES,), generator=gen),
            "src": torch.randint(0, NODES, (EDGES,), generator=gen),
            "dst": torch.cat([torch.arange(NODES), torch.randint(0, NODES, (EDGES - NODES,), generator=gen)]),
            "edge_attr": torch.randn(EDGES, 4, generator=gen),
            "labels": torch.randint(0, 5, (NODES,), generator=gen),
        }
    if name == "patchtst_revin":
        return {"series": torch.randn(batch, CONTEXT, VARIATES, generator=gen), "target": torch.randn(batch, HORIZON, VARIATES, generator=gen)}
    if name == "document_loop_attention":
        return {"input_ids": ids, "cu_seqlens": torch.tensor([0, 5, 11, seq]), "labels": labels}
    return {"input_ids": ids, "labels": labels}
