"""Small models in plain PyTorch whose *structure* other training libraries use: one module
instance shared by several layers, custom autograd Functions (straight-through estimators,
weight fake-quantization, a router backward), autocast and no-grad regions inside the
forward, a patch-embedding vision transformer with a class token and a classification head
trained through ``loss_fn``, a vision tower that a text-only forward never reads, encoder stacks (hand-written and ``nn.TransformerEncoder``),
weight tying, and MoE layers with a loop over experts and with batched expert GEMMs.

The suite protocol (``tests/test_plain_suite.py``): ``NAMES``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``, ``loss_fn(name)`` (None: the outputs hold
``loss``) and ``MOE`` (also run with sequence parallelism).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from general_models import _Router as RoundSTE  # rounding with a straight-through backward

VOCAB, DIM, HEADS, LAYERS, SEQ = 128, 64, 4, 2, 16
HEAD_DIM = DIM // HEADS
IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 16
EXPERTS, TOP_K = 4, 2


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


# ---- custom autograd Functions ------------------------------------------------------------


class ClippedSTE(torch.autograd.Function):
    """Fake quantization whose backward passes the gradient only inside the clipping range
    (the saved input decides): elementwise, with a tensor saved for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bound: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.bound = bound
        return torch.round(x.clamp(-bound, bound) * 16) / 16

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= ctx.bound).to(grad.dtype), None


class RouterGrad(torch.autograd.Function):
    """Top-k routing weights whose backward is the softmax's, ignoring the top-k mask (a
    hand-written router backward): not elementwise, so it runs on replicated inputs."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, k: int) -> torch.Tensor:
        probs = logits.softmax(-1)
        ctx.save_for_backward(probs)
        top = probs.topk(k, dim=-1).indices
        return probs * torch.zeros_like(probs).scatter(-1, top, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (probs,) = ctx.saved_tensors
        return probs * (grad - (grad * probs).sum(-1, keepdim=True)), None


class HadamardProduct(torch.autograd.Function):
    """A LoHa adapter's weight delta ``(w1a @ w1b) * (w2a @ w2b) * scale`` with its hand-written
    backward (PEFT's way): the exact derivative, but None for ``scale``, a tensor the forward
    makes (``torch.tensor(0.5)``), which no gradient reaches."""

    @staticmethod
    def forward(ctx: Any, w1a: torch.Tensor, w1b: torch.Tensor, w2a: torch.Tensor, w2b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w1a, w1b, w2a, w2b, scale)
        return (w1a @ w1b) * (w2a @ w2b) * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w1a, w1b, w2a, w2b, scale = ctx.saved_tensors
        grad = grad * scale
        first, second = grad * (w2a @ w2b), grad * (w1a @ w1b)
        return first @ w1b.T, w1a.T @ first, second @ w2b.T, w2a.T @ second, None


class HadamardAdapterLinear(nn.Module):
    """A linear layer with a LoHa adapter of rank 4 added to its weight."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.w1a, self.w2a = (nn.Parameter(torch.randn(d_out, rank) * 0.1) for _ in range(2))
        self.w1b, self.w2b = (nn.Parameter(torch.randn(rank, d_in) * 0.1) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = HadamardProduct.apply(self.w1a, self.w1b, self.w2a, self.w2b, torch.tensor(0.5))
        return F.linear(x, self.base.weight + delta, self.base.bias)


# ---- building blocks ----------------------------------------------------------------------


class Rope(nn.Module):
    """Rotary tables in non-persistent buffers; one instance may serve every layer."""

    def __init__(self, dim: int = HEAD_DIM, end: int = 64) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(end).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, H, S, D] rotated."""
        s = x.shape[-2]
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return x * self.cos[:s] + torch.cat((-x2, x1), dim=-1) * self.sin[:s]


class Attention(nn.Module):
    """Separate q/k/v/o projections; ``rope`` (maybe shared) rotates q and k; subclasses
    change the q/k transform (``qk``) or where the scores go."""

    def __init__(self, rope: nn.Module | None = None, causal: bool = True) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.rope = rope
        self.causal = causal

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope is not None:
            return self.rope(q), self.rope(k)
        return q, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.qk(self.heads(self.q(x)), self.heads(self.k(x)))
        y = F.scaled_dot_product_attention(q, k, self.heads(self.v(x)), is_causal=self.causal)
        return self.o(y.transpose(1, 2).reshape(b, s, DIM))


class MLP(nn.Module):
    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class HadamardAdapterMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = HadamardAdapterLinear(DIM, 2 * DIM), HadamardAdapterLinear(2 * DIM, DIM)


class Block(nn.Module):
    """Pre-norm attention + feed-forward."""

    def __init__(self, attention: nn.Module | None = None, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = attention if attention is not None else Attention()
        self.ffn = ffn if ffn is not None else MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class DecoderLM(nn.Module):
    """Embedding, ``LAYERS`` blocks from ``block(i)``, final norm, head (tied to the embedding if asked)."""

    def __init__(self, block: Callable[[int], nn.Module], tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(block(i) for i in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- construct 1: one module instance shared by several layers ---------------------------


class SharedRopeLM(DecoderLM):
    """Every attention layer holds the same ``Rope`` instance (its buffers have one name per layer)."""

    def __init__(self) -> None:
        rope = Rope()
        super().__init__(lambda i: Block(Attention(rope)))


class SharedProjectionLM(DecoderLM):
    """One ``nn.Linear`` instance is every layer's output projection (tied parameters read in
    several layers, and in both pipeline stages)."""

    def __init__(self) -> None:
        shared = nn.Linear(DIM, DIM)

        def block(i: int) -> Block:
            attn = Attention()
            attn.o = shared
            return Block(attn)

        super().__init__(block)


# ---- construct 12: custom autograd Functions -------------------------------------------------


class QuantLinear(nn.Linear):
    """A linear layer whose weight is fake-quantized through a straight-through estimator (QAT)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, ClippedSTE.apply(self.weight, 0.5), self.bias)


class QuantMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = QuantLinear(DIM, 2 * DIM), QuantLinear(2 * DIM, DIM)


class RoutedMLP(nn.Module):
    """A soft mixture of two MLPs weighted by ``RouterGrad`` (a router with its own backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, 4, bias=False)
        self.experts = nn.ModuleList(MLP() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = RouterGrad.apply(self.router(x), 2)
        return self.experts[0](x) * w[..., :1] + self.experts[1](x) * w[..., 1:2]


# ---- construct 9: autocast and no-grad regions ---------------------------------------------


class Fp32NormAttention(Attention):
    """q/k layer-normed per head in float32 with autocast off (OLMo, Chameleon)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_norm, self.k_norm = nn.LayerNorm(HEAD_DIM), nn.LayerNorm(HEAD_DIM)

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device_type=q.device.type, enabled=False):
            return self.q_norm(q.float()).type_as(q), self.k_norm(k.float()).type_as(k)


class AmaxScaledAttention(Attention):
    """q and k divided by their per-head amax computed under ``no_grad`` (a detached scale, as
    fp8 recipes compute theirs); the gradient flows through q and k only."""

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            q_scale, k_scale = (t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-3) for t in (q, k))
        return q / q_scale, k / k_scale


class Fp32FinalNormLM(DecoderLM):
    """The final norm runs under ``torch.autocast(enabled=False)`` in float32."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        with torch.autocast(device_type=h.device.type, enabled=False):
            h = self.norm(h.float())
        logits = self.head(h)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


# ---- vision transformer: patch embedding, class token, classification head --------------


class ViT(nn.Module):
    """timm-style: conv patch embedding, a class token, learned positions, bidirectional
    blocks, a classification head on the class token. Returns logits; the loss is ``loss_fn``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(CHANNELS, DIM, PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, DIM) * 0.02)
        self.blocks = nn.Sequential(*(Block(Attention(causal=False)) for _ in range(LAYERS)))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


class UnreadTowerLM(DecoderLM):
    """A multimodal decoder trained on text: a vision tower, a projector of a width tp does not
    divide, an image-newline vector and a scalar that only the image path reads. The forward
    traced without ``pixel_values`` never reads them."""

    def __init__(self) -> None:
        super().__init__(lambda i: Block(Attention(Rope())))
        self.vision_tower = ViT()
        self.projector = nn.Linear(CLASSES, DIM + 3)
        self.image_newline = nn.Parameter(torch.randn(DIM + 3))
        self.image_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None) -> dict[str, Any]:  # fmt: skip
        out = super().forward(input_ids, labels)
        if pixel_values is not None:
            image = (self.projector(self.vision_tower(pixel_values)) + self.image_newline) * self.image_scale
            out["logits"] = out["logits"] + image[:, :1, None].mean()
        return out


# ---- encoder stacks ------------------------------------------------------------------------


class PostNormEncoderLayer(nn.Module):
    """BERT-style: attention, add, norm; MLP, add, norm."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.ffn = Attention(causal=False), MLP()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.ffn(x))


class EncoderMaskedLM(nn.Module):
    """Token and position embeddings, an embedding norm, post-norm layers, an MLM head
    (dense + GELU + norm + decoder tied to the token embedding)."""

    def __init__(self, layer: Callable[[], nn.Module] = PostNormEncoderLayer) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.embed_norm = nn.LayerNorm(DIM)
        self.layers = nn.ModuleList(layer() for _ in range(LAYERS))
        self.dense, self.head_norm = nn.Linear(DIM, DIM), nn.LayerNorm(DIM)
        self.decoder = nn.Linear(DIM, VOCAB)
        self.decoder.weight = self.tokens.weight
        for table in (self.tokens, self.positions):  # BERT's initializer range
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed_norm(self.tokens(input_ids) + self.positions(pos))
        for layer in self.layers:
            h = layer(h)
        logits = self.decoder(self.head_norm(F.gelu(self.dense(h))))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = lm_loss(logits, labels)
        return out


def torch_encoder_layer() -> nn.Module:
    """PyTorch's own ``nn.TransformerEncoderLayer`` (packed in-projection, ``F.multi_head_attention_forward``)."""
    return nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True, norm_first=True)


# ---- MoE: a loop over experts, and grouped GEMMs -------------------------------------------


class LoopMoE(nn.Module):
    """Top-k routing, every expert run on every token and weighted by its (maybe zero) gate:
    a Python loop over ``nn.ModuleList`` experts, as small MoE codebases write it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(MLP(F.silu) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        weights, chosen = probs.topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            w = (weights * (chosen == e)).sum(-1, keepdim=True)
            out = out + expert(x) * w
        return out


class EinsumDispatchMoE(nn.Module):
    """GShard / DeepSpeed-MoE style: one-hot dispatch and combine tensors [tokens*k, experts,
    capacity] and the experts as batched GEMMs over 3-D weights (``einsum``). The capacity
    holds every token, so nothing is dropped. (``torch._grouped_mm`` cannot be traced in
    fp32: its meta kernel asks for bf16.)"""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * DIM) / math.sqrt(DIM))
        self.w_out = nn.Parameter(torch.randn(EXPERTS, 2 * DIM, DIM) / math.sqrt(2 * DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        weights, chosen = self.gate(tokens).softmax(-1).topk(TOP_K, dim=-1)
        assigned = F.one_hot(chosen, EXPERTS).to(x.dtype).reshape(-1, EXPERTS)  # [tokens*k, experts]
        slots = ((assigned.cumsum(0) - 1) * assigned).sum(-1).long()  # each copy's place in its expert's buffer
        dispatch = assigned[:, :, None] * F.one_hot(slots, assigned.shape[0]).to(x.dtype)[:, None, :]
        buffers = torch.einsum("nec,nd->ecd", dispatch, tokens.repeat_interleave(TOP_K, dim=0))
        y = torch.einsum("ech,ehd->ecd", F.gelu(torch.einsum("ecd,edh->ech", buffers, self.w_in)), self.w_out)
        combine = dispatch * weights.reshape(-1, 1, 1)
        return torch.einsum("nec,ecd->nd", combine, y).view(-1, TOP_K, d).sum(1).view(b, s, d)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "shared_rope": SharedRopeLM,
    "shared_projection": SharedProjectionLM,
    "ste_activation": lambda: DecoderLM(lambda i: Block(ffn=MLP(lambda t: RoundSTE.apply(F.gelu(t))))),
    "clipped_ste": lambda: DecoderLM(lambda i: Block(ffn=MLP(lambda t: ClippedSTE.apply(F.silu(t), 0.5)))),
    "quantized_weights": lambda: DecoderLM(lambda i: Block(ffn=QuantMLP())),
    "router_backward": lambda: DecoderLM(lambda i: Block(ffn=RoutedMLP())),
    "hadamard_adapter": lambda: DecoderLM(lambda i: Block(ffn=HadamardAdapterMLP())),
    "fp32_qk_norm": lambda: DecoderLM(lambda i: Block(Fp32NormAttention())),
    "fp32_final_norm": lambda: Fp32FinalNormLM(lambda i: Block(Attention(Rope()))),
    "no_grad_scale": lambda: DecoderLM(lambda i: Block(AmaxScaledAttention())),
    "vit_loss_fn": ViT,
    "encoder_post_norm": EncoderMaskedLM,
    "torch_encoder": lambda: EncoderMaskedLM(torch_encoder_layer),
    "tied_embeddings": lambda: DecoderLM(lambda i: Block(Attention(Rope())), tie=True),
    "moe_loop": lambda: DecoderLM(lambda i: Block(ffn=LoopMoE())),
    "moe_einsum_dispatch": lambda: DecoderLM(lambda i: Block(ffn=EinsumDispatchMoE())),
    "unread_tower": UnreadTowerLM,
}
NAMES = tuple(MODELS)
MOE = frozenset({"moe_loop", "moe_einsum_dispatch"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2) -> dict[str, torch.Tensor]:
    """Keyword inputs of model ``name``, the same on every call."""
    gen = torch.Generator().manual_seed(1)
    if name == "vit_loss_fn":
        return {"pixel_values": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen)}
    ids, labels = (torch.randint(0, VOCAB, (batch, SEQ), generator=gen) for _ in range(2))
    return {"input_ids": ids, "labels": labels}


def _class_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross entropy against class 3 for every image (a mean over images, so microbatches agree)."""
    return F.cross_entropy(logits, torch.full((logits.shape[0],), 3))


def loss_fn(name: str) -> Callable[[Any], torch.Tensor] | None:
    return _class_loss if name == "vit_loss_fn" else None
