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
Then mixers and heads written other ways: SegFormer's Mix-FFN (a depthwise ``Conv2d`` over the
token grid between the FFN's linears), FastSpeech's convolutional FFN, heads made by
``stack(chunk(...))`` and by ``unflatten``, sigmoid attention, ``nn.MultiheadAttention`` with
``kdim``/``vdim`` (separate q, k, v weights) sequence-first, a tied head with its own bias,
talking-heads attention (learned mixes across the heads), a top-1 MoE gathering each token's
expert weights (``w1[expert_ids]``, ``bmm``), attention over chunks of queries in a loop, and a
parallel block with one fused input projection and one output projection over
``cat([attention, ffn])``, and a sparse autoencoder whose decoder is its encoder's transpose. Then inputs and outputs written other ways: ``forward(batch)`` with a
dict of tensors, forward hooks and pre-hooks, a loss on the rows a boolean mask selects, and
SDPA on batch and heads merged into one dim.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``, ``loss_fn(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, SwiGLU

SEQ = 16
GRID = 4  # the 16 tokens as a 4 x 4 grid
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


# ---- mixers and heads written other ways ---------------------------------------------------


class MixFFN(nn.Module):
    """SegFormer's Mix-FFN: fc1, a depthwise 3x3 conv over the token grid, GELU, fc2."""
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.dwconv = nn.Conv2d(4 * DIM, 4 * DIM, 3, padding=1, groups=4 * DIM)

    def forward(self, x):
        B, N, C = x.shape
        h = self.fc1(x).transpose(1, 2).reshape(B, 4 * DIM, GRID, GRID)
        h = self.dwconv(h).flatten(2).transpose(1, 2)
        return self.fc2(F.gelu(h))


class ConvFFN(nn.Module):
    """FastSpeech's FFT block FFN: Conv1d(k=3) up, ReLU, Conv1d(k=1) down, over channels."""
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Conv1d(DIM, 4 * DIM, 3, padding=1)
        self.w2 = nn.Conv1d(4 * DIM, DIM, 1)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x.transpose(1, 2)))).transpose(1, 2)


class StackedChunkHeads(nn.Module):
    """Heads made by ``torch.stack(q.chunk(H, -1), 1)`` and merged back by ``torch.cat(unbind)``."""
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = (torch.stack(p(x).chunk(HEADS, dim=-1), dim=1) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(torch.cat(y.unbind(1), dim=-1))


class UnflattenSigmoidAttention(nn.Module):
    """Heads by ``unflatten``; sigmoid attention (no softmax) with a causal mask and a bias."""
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.register_buffer("mask", torch.ones(SEQ, SEQ).tril(), persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, HEAD_DIM)).permute(2, 0, 3, 1, 4)
        s = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM) - math.log(SEQ)) * self.mask[: x.shape[1], : x.shape[1]]
        return self.o((s @ v).transpose(1, 2).flatten(2))


class MHAKdimBlock(nn.Module):
    """``nn.MultiheadAttention`` with separate q/k/v weights (kdim/vdim set), sequence-first."""
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, kdim=DIM, vdim=DIM)
        self.mlp = SwiGLU()
        self.register_buffer("causal", torch.ones(SEQ, SEQ).triu(1).bool(), persistent=False)

    def forward(self, x):
        h = self.norm1(x).transpose(0, 1)
        a, _ = self.attn(h, h, h, attn_mask=self.causal, need_weights=False)
        x = x + a.transpose(0, 1)
        return x + self.mlp(self.norm2(x))


class BiasTiedLM(DecoderLM):
    """A head tied to the embedding, with its own output bias, logits by ``F.linear``."""
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        del self.output
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's init of a table that is also the head
        self.out_bias = nn.Parameter(torch.randn(VOCAB) * 0.1)

    def logits(self, h):
        return F.linear(self.norm(h), self.embed.weight, self.out_bias)


class TalkingHeads(nn.Module):
    """Talking-heads attention: learned [H, H] mixes of the heads' logits before and after the softmax."""
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.pre, self.post = nn.Parameter(torch.eye(HEADS) + 0.1 * torch.randn(HEADS, HEADS)), nn.Parameter(torch.eye(HEADS) + 0.1 * torch.randn(HEADS, HEADS))
        self.register_buffer("causal", torch.ones(SEQ, SEQ).triu(1).bool(), persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(HEAD_DIM)
        s = torch.einsum("bhij,hg->bgij", s, self.pre).masked_fill(self.causal[:T, :T], float("-inf"))
        p = torch.einsum("bhij,hg->bgij", s.softmax(-1), self.post)
        return self.o(torch.einsum("bhij,bhjd->bihd", p, v).reshape(B, T, DIM))


class GatheredExpertWeights(nn.Module):
    """Top-1 MoE by gathering each token's expert weights (``w[idx]``) and a batched matmul."""
    def __init__(self, experts: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, DIM, hidden) / math.sqrt(DIM))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, DIM) / math.sqrt(hidden))

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        gate, idx = self.router(flat).softmax(-1).max(-1)
        h = F.gelu(torch.bmm(flat.unsqueeze(1), self.w1[idx]))
        return (torch.bmm(h, self.w2[idx]).squeeze(1) * gate.unsqueeze(-1)).view(B, T, C)


class ChunkedQueryAttention(NanoGPTAttention):
    """Attention computed over chunks of queries in a Python loop (memory-saving code), with an explicit mask."""
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, HEADS, HEAD_DIM).transpose(1, 2) for t in self.c_attn(x).split(DIM, dim=2))
        out = []
        for i in range(0, T, 4):
            mask = torch.ones(4, T, dtype=torch.bool).tril(i)
            out.append(F.scaled_dot_product_attention(q[:, :, i : i + 4], k, v, attn_mask=mask))
        return self.c_proj(torch.cat(out, dim=2).transpose(1, 2).reshape(B, T, C))


class FusedParallelBlock(nn.Module):
    """A parallel block with one fused input projection (q, k, v, gate, up) and one output
    projection over ``cat([attention, ffn])``."""
    FF = 2 * DIM

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.in_proj = nn.Linear(DIM, 3 * DIM + 2 * self.FF, bias=False)
        self.out_proj = nn.Linear(DIM + self.FF, DIM, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v, gate, up = self.in_proj(self.norm(x)).split([DIM, DIM, DIM, self.FF, self.FF], -1)
        q, k, v = (t.view(B, T, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, DIM)
        return x + self.out_proj(torch.cat([a, F.silu(gate) * up], dim=-1))


class TiedAutoencoderLM(DecoderLM):
    """A sparse-autoencoder bottleneck on the residual stream whose decoder is its encoder's transpose."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.w_enc = nn.Parameter(torch.randn(DIM, 4 * DIM) / DIM**0.5)
        self.b_enc = nn.Parameter(torch.zeros(4 * DIM))

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().hidden(input_ids)
        return h + F.relu(h @ self.w_enc + self.b_enc) @ self.w_enc.t()


# ---- inputs and outputs written other ways ----------------------------------------------------


class BatchDictLM(DecoderLM):
    """``forward(batch)`` with a dict of tensors (Lightning-style training code)."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        logits = self.logits(self.hidden(batch["input_ids"]))
        return {"logits": logits, "loss": F.cross_entropy(_flat(logits), batch["labels"].reshape(-1))}


class HookedLM(DecoderLM):
    """Forward hooks that rescale each attention's output and shift each FFN's input."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        for layer in self.layers:
            layer.attention.register_forward_hook(lambda module, args, out: out * 0.5)
            layer.feed_forward.register_forward_pre_hook(lambda module, args: (args[0] + 1.0,))


class SelectedRowsLM(DecoderLM):
    """The loss on the labelled rows only, selected by a boolean mask (``logits[labels != -100]``)."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.logits(self.hidden(input_ids))
        keep = labels != IGNORE
        return {"logits": logits, "loss": F.cross_entropy(logits[keep], labels[keep])}


class MergedHeadsAttention(nn.Module):
    """SDPA on 3-D ``[B*H, S, D]`` tensors: batch and heads merged into one dim."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.reshape(B, T, HEADS, HEAD_DIM).transpose(1, 2).reshape(B * HEADS, T, HEAD_DIM) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.view(B, HEADS, T, HEAD_DIM).transpose(1, 2).reshape(B, T, DIM))


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
    "segformer_mix_ffn": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), MixFFN())),
    "fastspeech_conv_ffn": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ConvFFN())),
    "stacked_chunk_heads": lambda: DecoderLM(lambda: PreNormBlock(StackedChunkHeads())),
    "unflatten_sigmoid_attention": lambda: DecoderLM(lambda: PreNormBlock(UnflattenSigmoidAttention())),
    "mha_kdim_seq_first": lambda: DecoderLM(MHAKdimBlock),
    "tied_head_with_bias": BiasTiedLM,
    "talking_heads": lambda: DecoderLM(lambda: PreNormBlock(TalkingHeads())),
    "gathered_expert_weights": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), GatheredExpertWeights())),
    "chunked_query_attention": lambda: DecoderLM(lambda: PreNormBlock(ChunkedQueryAttention())),
    "fused_parallel_block": lambda: DecoderLM(FusedParallelBlock),
    "batch_dict_input": BatchDictLM,
    "forward_hooks": HookedLM,
    "selected_rows_loss": SelectedRowsLM,
    "merged_heads_sdpa": lambda: DecoderLM(lambda: PreNormBlock(MergedHeadsAttention())),
    "tied_autoencoder": TiedAutoencoderLM,
}
MOE = frozenset({"gathered_expert_weights"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    if name == "padding_idx_einsum_tied":
        ids[:, -3:] = 0
    if name in ("selected_rows_loss", "batch_dict_input"):
        labels[0, 2:] = IGNORE  # the first microbatch counts 2 tokens, the second 16
    if name == "batch_dict_input":
        return {"batch": {"input_ids": ids, "labels": labels}}
    return {"input_ids": ids, "labels": labels}
