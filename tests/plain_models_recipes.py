"""Small plain-PyTorch models written the way training recipes write them (issue 27, fifth
round): the losses and training tricks that sit around a transformer rather than in it.

Label-smoothed cross-entropy, a PaLM-style z-loss (``logsumexp(logits) ** 2``), a summed loss
over the non-ignored tokens, cross-entropy by hand (``log_softmax`` + ``gather``) and by
``F.nll_loss``, class-weighted cross-entropy, a distillation loss (``F.kl_div`` between the
model's logits and a teacher head's), an embedding with a ``padding_idx``, a head tied by
``einsum`` with the embedding, rotary written back into a slice of q and k in place, a
hashed n-gram ``EmbeddingBag``, DoRA (a LoRA update whose weight is renormalized per output
row), stochastic depth (``bernoulli_`` of an empty tensor), attention in the sequence-first
layout of Megatron (``[S, B, H]``, ``baddbmm``), and a frozen, ``no_grad`` teacher head.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``, ``loss_fn(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from plain_models_attention import (
    DIM,
    HEAD_DIM,
    HEADS,
    VOCAB,
    DecoderLM,
    NanoGPTAttention,
    PreNormBlock,
)
from torch import nn

SEQ = 16
IGNORE = -100


def _flat(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.size(-1))


class LossVariantLM(DecoderLM):
    """A nanoGPT decoder whose loss is ``loss(logits, labels)``."""

    def __init__(self, loss: Callable[[LossVariantLM, torch.Tensor, torch.Tensor], torch.Tensor], **kwargs: Any) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()), **kwargs)
        self.loss = loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.logits(self.hidden(input_ids))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = self.loss(self, logits, labels)
        return out


def label_smoothing(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_flat(logits), labels.reshape(-1), label_smoothing=0.1)


def z_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    flat = _flat(logits).float()
    return F.cross_entropy(flat, labels.reshape(-1)) + 1e-4 * flat.logsumexp(-1).pow(2).mean()


def summed_over_tokens(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    labels = labels.masked_fill(labels % 5 == 0, IGNORE)
    total = F.cross_entropy(_flat(logits), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return total / (labels != IGNORE).sum().clamp(min=1)


def by_hand(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logp = logits.log_softmax(dim=-1)
    return -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1).mean()


def nll(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(F.log_softmax(_flat(logits), dim=-1), labels.reshape(-1))


class ClassWeightedLM(LossVariantLM):
    def __init__(self) -> None:
        super().__init__(lambda m, logits, labels: F.cross_entropy(_flat(logits), labels.reshape(-1), weight=m.class_weight))
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, VOCAB))


class DistilledLM(LossVariantLM):
    """Cross-entropy plus a temperature-scaled KL to a frozen teacher head over the same hidden
    states, computed under ``no_grad``."""

    def __init__(self) -> None:
        super().__init__(lambda m, logits, labels: m.distill(logits, labels))
        self.teacher = nn.Linear(DIM, VOCAB, bias=False)
        self.teacher.requires_grad_(False)
        self.temperature = 2.0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids))
        logits = self.output(h)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            with torch.no_grad():
                teacher = self.teacher(h)
            t = self.temperature
            kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(teacher / t, -1), reduction="batchmean", log_target=True)
            out["loss"] = F.cross_entropy(_flat(logits), labels.reshape(-1)) + t * t * kl / logits.size(1)
        return out


# ---- an embedding with a padding row, a head tied by einsum ---------------------------------


class PaddedTiedLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=0)
        del self.output

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids)) * DIM ** -0.5
        logits = torch.einsum("bsd,vd->bsv", h, self.embed.weight)
        return {"logits": logits, "loss": F.cross_entropy(_flat(logits), labels.reshape(-1), ignore_index=0)}


# ---- rotary written into q and k in place ----------------------------------------------------


class InPlaceRotaryAttention(nn.Module):
    """Partial rotary applied by assigning into the first half of each head's dims."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        rot = HEAD_DIM // 2
        freqs = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def _rotate(self, x: torch.Tensor) -> None:
        r = self.cos.size(-1)
        part = x[..., :r]
        a, b = part.chunk(2, dim=-1)
        x[..., :r] = part * self.cos[: x.size(2)] + torch.cat([-b, a], dim=-1) * self.sin[: x.size(2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        self._rotate(q)
        self._rotate(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, DIM))


# ---- hashed n-gram embeddings ---------------------------------------------------------------


class NgramEmbeddingLM(DecoderLM):
    """Each token's embedding plus a bag of hashed bigram and trigram embeddings (fastText,
    BLT's hash n-grams)."""

    BUCKETS = 96

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.ngrams = nn.EmbeddingBag(self.BUCKETS, DIM, mode="sum")

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        prev = F.pad(input_ids, (1, 0))[:, :-1]
        prev2 = F.pad(input_ids, (2, 0))[:, :-2]
        bigram = (input_ids * 31 + prev) % self.BUCKETS
        trigram = (input_ids * 961 + prev * 31 + prev2 + 7) % self.BUCKETS
        bags = torch.stack([bigram, trigram], dim=-1).reshape(-1, 2)
        h = self.embed(input_ids) + self.ngrams(bags).view(*input_ids.shape, DIM)
        for layer in self.layers:
            h = layer(h)
        return h


# ---- DoRA --------------------------------------------------------------------------------------


class DoRALinear(nn.Module):
    """A frozen base weight plus a low-rank update, renormalized per output row and scaled by
    a learned magnitude (peft's DoRA)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in), requires_grad=False)
        self.lora_A = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(d_out, rank) * 0.1)
        self.magnitude = nn.Parameter(self.weight.norm(p=2, dim=1).detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.weight + self.lora_B @ self.lora_A
        scale = self.magnitude / merged.norm(p=2, dim=1).detach()
        return F.linear(x, merged) * scale


class DoRAMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = DoRALinear(DIM, 4 * DIM), DoRALinear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


# ---- stochastic depth -------------------------------------------------------------------------


class DropPathBlock(PreNormBlock):
    """timm's ``drop_path``: each sample's residual branch kept with probability ``keep``."""

    def __init__(self) -> None:
        super().__init__(NanoGPTAttention())
        self.keep = 0.8

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(self.keep)
        return x * mask / self.keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self._drop(self.attention(self.attention_norm(x)))
        return h + self._drop(self.feed_forward(self.ffn_norm(h)))


# ---- Megatron's sequence-first attention ------------------------------------------------------


class SequenceFirstAttention(nn.Module):
    """[S, B, H] activations; scores by ``baddbmm`` over (batch x heads) merged into one dim."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value, self.dense = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.register_buffer("causal", torch.ones(SEQ, SEQ).triu(1).bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        S, B, _ = x.shape
        mixed = self.query_key_value(x).view(S, B, HEADS, 3 * HEAD_DIM)
        q, k, v = mixed.split(HEAD_DIM, dim=-1)
        q = q.reshape(S, B * HEADS, HEAD_DIM).transpose(0, 1)
        k = k.reshape(S, B * HEADS, HEAD_DIM).transpose(0, 1)
        v = v.reshape(S, B * HEADS, HEAD_DIM).transpose(0, 1)
        scores = torch.baddbmm(torch.zeros(B * HEADS, S, S, dtype=x.dtype), q, k.transpose(1, 2), beta=0.0, alpha=HEAD_DIM ** -0.5)
        scores = scores.view(B, HEADS, S, S).masked_fill(self.causal[:S, :S], float("-inf"))
        probs = scores.softmax(-1).view(B * HEADS, S, S)
        ctx = torch.bmm(probs, v).transpose(0, 1).reshape(S, B, DIM)
        return self.dense(ctx)


class SequenceFirstLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(SequenceFirstAttention()))

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids).transpose(0, 1).contiguous()
        for layer in self.layers:
            h = layer(h)
        return h.transpose(0, 1)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "label_smoothing_ce": lambda: LossVariantLM(label_smoothing),
    "z_loss": lambda: LossVariantLM(z_loss),
    "summed_token_loss": lambda: LossVariantLM(summed_over_tokens),
    "cross_entropy_by_hand": lambda: LossVariantLM(by_hand),
    "nll_of_log_softmax": lambda: LossVariantLM(nll),
    "class_weighted_ce": ClassWeightedLM,
    "distillation_kl": DistilledLM,
    "padding_idx_einsum_tied": PaddedTiedLM,
    "in_place_rotary": lambda: DecoderLM(lambda: PreNormBlock(InPlaceRotaryAttention())),
    "hashed_ngram_bag": NgramEmbeddingLM,
    "dora": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), DoRAMLP())),
    "drop_path": lambda: DecoderLM(DropPathBlock),
    "sequence_first_megatron": SequenceFirstLM,
}
MICROBATCHES = {"drop_path": 1}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    if name == "padding_idx_einsum_tied":
        ids[:, -3:] = 0
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, seq), generator=gen)}
