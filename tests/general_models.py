"""Small models of our own, each showing one pattern that unnamed models use (issue 20)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 2


class _Router(torch.autograd.Function):
    """A straight-through estimator: forward rounds, backward passes the grad through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Tanh(torch.autograd.Function):
    """A hand-written backward that is the forward's derivative."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class _Block(nn.Module):
    """Pre-norm attention + MLP; subclasses change one thing."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ k.transpose(-1, -2)) / (HIDDEN // HEADS) ** 0.5

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = self.scores(q, k).masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(att.transpose(1, 2).reshape(b, s, HIDDEN))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CustomFunctionBlock(_Block):
    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_Router.apply(F.gelu(self.up(x))))


class ExactFunctionBlock(_Block):
    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_Tanh.apply(self.up(x)))


class PerHeadScaleBlock(_Block):
    """A learned temperature per head, multiplied into the attention scores."""

    def __init__(self) -> None:
        super().__init__()
        self.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, HEADS))

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return super().scores(q, k) * self.head_scale.view(1, HEADS, 1, 1)


class PerHeadBiasBlock(_Block):
    """A learned per-head slope times a replicated distance matrix (ALiBi-like), added to the scores."""

    def __init__(self) -> None:
        super().__init__()
        self.slopes = nn.Parameter(torch.linspace(-0.5, -0.1, HEADS))

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = q.shape[-2]
        pos = torch.arange(s, device=q.device, dtype=q.dtype)
        dist = (pos[None, :] - pos[:, None]).abs()
        return super().scores(q, k) + self.slopes[:, None, None] * dist


class EinsumBlock(_Block):
    """Attention written with einsum."""

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HIDDEN // HEADS) for t in (self.q(x), self.k(x), self.v(x)))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (HIDDEN // HEADS) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
        return self.o(att.reshape(b, s, HIDDEN))


class ExpertLoopBlock(_Block):
    """A top-1 MoE whose per-expert token count comes from the routing (data-dependent sizes)."""

    EXPERTS = 4

    def __init__(self) -> None:
        super().__init__()
        del self.up, self.down
        self.router = nn.Linear(HIDDEN, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            for _ in range(self.EXPERTS)
        )

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        probs = self.router(flat).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == e).squeeze(-1)
            out = out.index_add(0, idx, expert(flat[idx]) * weight[idx, None])
        return out.view(b, s, h)


class BufferBlock(_Block):
    """A non-trainable buffer (expert load bias) that only this block reads, and a
    parameter that forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mlp_bias", torch.linspace(-1, 1, 2 * HIDDEN))
        self.spare = nn.Parameter(torch.zeros(3))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x) + self.mlp_bias))


class FrozenBiasBlock(_Block):
    """A frozen per-channel correction bias (a Parameter without grad) scaled before use: every
    pipeline chunk repeats the scaling, and only the chunk of this block reads the result."""

    def __init__(self) -> None:
        super().__init__()
        self.correction = nn.Parameter(torch.linspace(-1, 1, 2 * HIDDEN), requires_grad=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x) + self.correction * 0.5))


class NoGradScorerBlock(_Block):
    """A scorer run under ``torch.no_grad`` that casts the hidden states to fp32 (a no-op on an
    fp32 model: ``to`` returns the same tensor, and export hands later reads of the hidden
    states that region's output), then a per-head output gate on the same hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.scorer, self.gate = nn.Linear(HIDDEN, HEADS), nn.Linear(HIDDEN, HEADS)

    @torch.no_grad()
    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer(x.to(torch.float32)).softmax(-1)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        weights = self.score(x)
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = self.scores(q, k).masked_fill(~mask, float("-inf")).softmax(-1) @ v
        gate = torch.sigmoid(self.gate(x)) * (1 + weights)
        att = att * gate.transpose(1, 2)[..., None]
        return self.o(att.transpose(1, 2).reshape(b, s, HIDDEN))


class RescalingBlock(_Block):
    """Rescales its output weight in place the first time it runs in eval mode, behind a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.rescaled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and not self.rescaled:
            with torch.no_grad():
                self.o.weight.div_(2)
            self.rescaled = True
        return super().forward(x)


class GatedMaskBlock(_Block):
    """SDPA with a per-head additive mask computed from the values by a small linear
    (a learned per-head, per-key gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, HEADS)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        values = self.v(x)
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(values)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        gate = F.logsigmoid(self.gate(values)).transpose(1, 2)[:, :, None, :].expand(b, HEADS, s, s)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=gate.masked_fill(future, float("-inf")))
        return self.o(att.transpose(1, 2).reshape(b, s, HIDDEN))


class SlopeMaskBlock(_Block):
    """SDPA with a per-head ALiBi-like mask: a learned slope per head times the distance."""

    def __init__(self) -> None:
        super().__init__()
        self.slopes = nn.Parameter(torch.linspace(-0.5, -0.1, HEADS))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        pos = torch.arange(s, device=x.device, dtype=x.dtype)
        mask = self.slopes[:, None, None] * (pos[:, None] - pos[None, :]).clamp(min=0)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.o(att.transpose(1, 2).reshape(b, s, HIDDEN))


class PositionAttentionBlock(_Block):
    """Attention whose weights are a learned [heads, S, S] table (no q/k), applied to
    head-sharded values: a matmul whose head (batch) dim is whole on one side."""

    SEQ = 16

    def __init__(self) -> None:
        super().__init__()
        del self.q, self.k
        self.table = nn.Parameter(torch.randn(HEADS, self.SEQ, self.SEQ))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.table[:, :s, :s].masked_fill(future, float("-inf")).softmax(-1)
        return self.o((probs @ self.heads(self.v(x))).transpose(1, 2).reshape(b, s, HIDDEN))


class SinkBlock(_Block):
    """A learned per-head sink logit concatenated to the scores, then dropped after the
    softmax (attention sinks), with the max subtracted first."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1, 1, HEADS))

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = self.scores(q, k).masked_fill(future, float("-inf"))
        logits = torch.cat([scores, self.sinks.view(1, HEADS, 1, 1).expand(b, HEADS, s, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(-1)[..., :-1]
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, HIDDEN))


class RelativeBiasBlock(_Block):
    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.norm1(x)
        b, s, _ = h.shape
        q, k, v = self.heads(self.q(h)), self.heads(self.k(h)), self.heads(self.v(h))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = (self.scores(q, k) + bias).masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.o(att.transpose(1, 2).reshape(b, s, HIDDEN))
        return x + self.mlp(self.norm2(x))


class RelativeBiasLM(nn.Module):
    """T5-style relative position bias: one embedding table [buckets, heads], looked up
    once and added to the scores of every layer (a partial value with several users)."""

    BUCKETS = 64

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM(RelativeBiasBlock)
        self.relative = nn.Embedding(self.BUCKETS, HEADS)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)
        buckets = (pos[None, :] - pos[:, None]).clamp(-self.BUCKETS // 2, self.BUCKETS // 2 - 1) + self.BUCKETS // 2
        bias = self.relative(buckets).permute(2, 0, 1)
        x = self.lm.embed(input_ids)
        for blk in self.lm.blocks:
            x = blk(x, bias)
        logits = self.lm.head(self.lm.norm(x))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return out


class Cache:
    """A key/value cache object, as generation code returns (not a tensor, no pytree)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class TinyLM(nn.Module):
    """A decoder LM built from one block class; ``return_cache`` makes forward return a cache object."""

    def __init__(self, block: type[nn.Module] = _Block, return_cache: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.return_cache = return_cache

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.embed(input_ids)
        cache = Cache()
        for blk in self.blocks:
            x = blk(x)
            cache.keys.append(x)
        logits = self.head(self.norm(x))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = self.loss(logits, labels)
        if self.return_cache:
            out["past_key_values"] = cache
        return out

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


class ShiftedTargetsLM(TinyLM):
    """Next-token targets written into a buffer made from the labels (through a view), as
    ProphetNet's n-gram loss does: the buffer depends on the inputs only, so every pipeline
    chunk repeats it, its in-place writes included."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = labels.new_zeros(labels.shape).fill_(-100)
        targets[:, :-1] = labels[:, 1:]
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-100)


class RunningStatsLM(TinyLM):
    """Each block adds its activations' mean square, through a view, into one buffer made
    from the input's shape, and the logits read the sum: in-place writes of activations (one
    per pipeline chunk) into a value that depends on the inputs only."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.embed(input_ids)
        stats = torch.zeros(input_ids.shape, dtype=x.dtype, device=x.device)
        flat = stats.view(-1)
        for blk in self.blocks:
            x = blk(x)
            flat.add_(x.detach().pow(2).mean(-1).view(-1))
        logits = self.head(self.norm(x)) * (1 + 0.1 * stats[..., None])
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = self.loss(logits, labels)
        return out


class DetachedScaleLM(TinyLM):
    """The head is scaled by a statistic of the first block's weight, read without grad:
    the first block's chunk trains that weight, the head's chunk only reads it detached."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.embed(input_ids)
        for blk in self.blocks:
            x = blk(x)
        scale = self.blocks[0].up.weight.detach().abs().mean()
        logits = self.head(self.norm(x)) * (1 + scale)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = self.loss(logits, labels)
        return out


MODELS: dict[str, Any] = {
    "custom_function": lambda: TinyLM(CustomFunctionBlock),
    "exact_function": lambda: TinyLM(ExactFunctionBlock),
    "per_head_scale": lambda: TinyLM(PerHeadScaleBlock),
    "per_head_bias": lambda: TinyLM(PerHeadBiasBlock),
    "einsum": lambda: TinyLM(EinsumBlock),
    "expert_loop": lambda: TinyLM(ExpertLoopBlock),
    "buffer": lambda: TinyLM(BufferBlock),
    "cache": lambda: TinyLM(return_cache=True),
    "frozen_bias": lambda: TinyLM(FrozenBiasBlock),
    "shifted_targets": lambda: ShiftedTargetsLM(),
    "rescaling": lambda: TinyLM(RescalingBlock),
    "gated_mask": lambda: TinyLM(GatedMaskBlock),
    "slope_mask": lambda: TinyLM(SlopeMaskBlock),
    "position_attention": lambda: TinyLM(PositionAttentionBlock),
    "relative_bias": RelativeBiasLM,
    "sinks": lambda: TinyLM(SinkBlock),
    "running_stats": RunningStatsLM,
    "no_grad_scorer": lambda: TinyLM(NoGradScorerBlock),
    "detached_scale": DetachedScaleLM,
}


def build_general(name: str) -> nn.Module:
    return MODELS[name]().eval()
