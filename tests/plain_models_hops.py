"""Small plain-PyTorch models built on PyTorch's newer attention and loop APIs (issue 27,
thirteenth round), written the way torchtitan, gpt-fast and attention-gym write them.

FlexAttention (``torch.nn.attention.flex_attention``): a tanh soft cap as ``score_mod`` over a
causal ``BlockMask`` made in the forward; ALiBi, its per-head slopes a buffer the ``score_mod``
reads by the head index; a learned per-head relative-position table read by ``(h, q - kv)``;
document masking, the documents numbered from the EOS tokens of ``input_ids`` and read by the
``mask_mod``; grouped-query attention by ``enable_gqa``; a mask of one block mask per head.
Loops: a linear recurrence by ``torch._higher_order_ops.scan`` and minGRU's by
``associative_scan``. Attention under
``save_on_cpu`` (activation offloading written into the module).
A per-head bias over distances bucketed by ``torch.bucketize``.

PyTorch refuses FlexAttention's backward on the CPU (its compiled CPU kernel has none), while
the unfused implementation it runs without ``torch.compile`` has one and equals SDPA; the module
lets that path run on the CPU (``allow_flex_backward_on_cpu``) so the suite checks gradients there.

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.associative_scan import associative_scan
from torch._higher_order_ops.scan import scan
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from plain_models_attention import DIM, HEAD_DIM, HEADS, KV_HEADS, VOCAB, DecoderLM, SwiGLU
from plain_models_frontier import decoder_of, merge_heads
from plain_models_idioms import FusedHeads

SEQ = 16
EOS = 0


def allow_flex_backward_on_cpu() -> None:
    """Let FlexAttention's unfused path (what it runs without ``torch.compile``) train on the CPU."""
    check = getattr(flex_module, "_validate_device", None)
    if check is None or getattr(check, "allows_cpu", False):
        return

    def validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != "cpu":
            check(query, key, value)

    validate.allows_cpu = True  # type: ignore[attr-defined]
    flex_module._validate_device = validate


allow_flex_backward_on_cpu()


def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


# ---- FlexAttention -----------------------------------------------------------------------------


class FlexSoftCapAttention(FusedHeads):
    """Gemma-2's logit soft cap as a ``score_mod`` and a causal block mask built per forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)

        def soft_cap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return 30.0 * torch.tanh(score / 30.0)

        mask = create_block_mask(causal, None, None, x.shape[1], x.shape[1], device=x.device)
        return self.o(merge_heads(flex_attention(q, k, v, score_mod=soft_cap, block_mask=mask)))


class FlexAlibiAttention(FusedHeads):
    """ALiBi: the ``score_mod`` adds ``slopes[h] * (kv - q)``, the slopes a buffer of the module."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8.0 * (i + 1) / HEADS) for i in range(HEADS)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)

        def alibi(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return score + self.slopes[h] * (kv_idx - q_idx)

        mask = create_block_mask(causal, None, None, x.shape[1], x.shape[1], device=x.device)
        return self.o(merge_heads(flex_attention(q, k, v, score_mod=alibi, block_mask=mask)))


class FlexRelativeBiasAttention(FusedHeads):
    """A learned bias per head and relative distance (T5 without buckets) read in the ``score_mod``."""

    def __init__(self) -> None:
        super().__init__()
        self.rel_bias = nn.Parameter(torch.randn(HEADS, 2 * SEQ - 1) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)

        def relative(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return score + self.rel_bias[h, q_idx - kv_idx + SEQ - 1]

        mask = create_block_mask(causal, None, None, x.shape[1], x.shape[1], device=x.device)
        return self.o(merge_heads(flex_attention(q, k, v, score_mod=relative, block_mask=mask)))


class FlexDocumentAttention(FusedHeads):
    """torchtitan's document masking: tokens attend causally within their document, the documents
    numbered by the EOS tokens before them (``document_ids`` set on the module by the LM)."""

    document_ids: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        docs = self.document_ids

        def same_document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(same_document, x.shape[0], None, x.shape[1], x.shape[1], device=x.device)
        return self.o(merge_heads(flex_attention(q, k, v, block_mask=mask)))


class DocumentMaskedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attentions = nn.ModuleList(FlexDocumentAttention() for _ in range(2))
        self.ffns = nn.ModuleList(SwiGLU() for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(5))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        docs = torch.cumsum(input_ids == EOS, dim=1) - (input_ids == EOS).int()
        h = self.embed(input_ids)
        for i, (attention, ffn) in enumerate(zip(self.attentions, self.ffns)):
            attention.document_ids = docs
            h = h + attention(self.norms[2 * i](h))
            h = h + ffn(self.norms[2 * i + 1](h))
        logits = self.output(self.norms[4](h))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class FlexGQAAttention(nn.Module):
    """Grouped-query attention by ``enable_gqa``: ``KV_HEADS`` key/value heads for ``HEADS`` queries."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wkv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.wkv(x).view(B, S, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        mask = create_block_mask(causal, None, None, S, S, device=x.device)
        y = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, scale=1.0 / math.sqrt(HEAD_DIM))
        return self.wo(merge_heads(y))


class FlexPerHeadWindowAttention(FusedHeads):
    """A sliding window whose width doubles with the head (a block mask with a head dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("windows", torch.tensor([2 ** (1 + i % 4) for i in range(HEADS)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        windows = self.windows

        def windowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (q_idx >= kv_idx) & (q_idx - kv_idx < windows[h])

        mask = create_block_mask(windowed, None, HEADS, x.shape[1], x.shape[1], device=x.device)
        return self.o(merge_heads(flex_attention(q, k, v, block_mask=mask)))


SINKS = 4


class SinkMergeAttention(FusedHeads):
    """Sliding-window attention merged with attention to the first tokens by their log-sum-exps."""
    def forward(self, x):
        q, k, v = self.heads(x)
        S = x.shape[1]
        def window(b, hh, qi, ki): return (qi >= ki) & (qi - ki < 4)
        def sinks(b, hh, qi, ki): return (ki < SINKS) & (qi - ki >= 4)
        wm = create_block_mask(window, None, None, S, S, device=x.device)
        sm = create_block_mask(sinks, None, None, S, S, device=x.device)
        o1, l1 = flex_attention(q, k, v, block_mask=wm, return_lse=True)
        o2, l2 = flex_attention(q, k, v, block_mask=sm, return_lse=True)
        l = torch.logaddexp(l1, l2)
        w1, w2 = (l1 - l).exp().unsqueeze(-1), (l2 - l).exp().nan_to_num(0.0).unsqueeze(-1)
        return self.o(merge_heads(o1 * w1 + o2 * w2))


# ---- loops as higher-order ops -----------------------------------------------------------------


class ScanRecurrence(nn.Module):
    """A gated linear recurrence over the sequence by ``scan``: ``h = a * h + (1 - a) * u`` per
    channel, then an output projection (an RNN mixer written with PyTorch's loop op)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.out_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        a = torch.sigmoid(gate)

        def step(h: torch.Tensor, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            a_t, u_t = xs
            h = a_t * h + (1 - a_t) * u_t
            return h, h.clone()

        h0 = torch.zeros(x.shape[0], u.shape[-1], dtype=x.dtype, device=x.device)
        _, hs = scan(step, h0, (a.transpose(0, 1), u.transpose(0, 1)))
        return self.out_proj(hs.transpose(0, 1))


class MinGRU(nn.Module):
    """minGRU ("Were RNNs All We Needed?"): ``h_t = (1 - z_t) h_{t-1} + z_t h~_t`` solved by a
    parallel ``associative_scan`` over the pairs ``(1 - z_t, z_t h~_t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.to_hidden_and_gate = nn.Linear(DIM, 2 * DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.to_hidden_and_gate(x).chunk(2, dim=-1)
        z = torch.sigmoid(gate)

        def combine(left: tuple[torch.Tensor, torch.Tensor], right: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            a_l, b_l = left
            a_r, b_r = right
            return a_l * a_r, a_r * b_l + b_r

        _, h = associative_scan(combine, (1 - z, z * hidden), dim=1, combine_mode="generic")
        return self.to_out(h)


class CompileRegionBlock(nn.Module):
    """A decoder block whose forward is marked ``torch.compiler.nested_compile_region`` (compile
    once, reuse for every layer; non-strict export traces through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention, self.feed_forward = FlexSoftCapAttention(), SwiGLU()

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


# ---- regions the forward opens ----------------------------------------------------------------


class OffloadedBlockAttention(FusedHeads):
    """Attention whose saved activations go to host memory (``save_on_cpu``, torchtune's and
    FSDP recipes' activation offloading written into the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            q, k, v = self.heads(x)
            return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


BUCKETS = 6


class BucketizedBiasAttention(FusedHeads):
    """A per-head bias over relative distances bucketed by ``torch.bucketize`` against
    log-spaced boundaries (a buffer), looked up in an ``nn.Embedding(buckets, heads)``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("boundaries", torch.tensor([1, 2, 4, 8, 12]))
        self.bias = nn.Embedding(BUCKETS, HEADS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        n = x.shape[1]
        distance = torch.arange(n, device=x.device)[:, None] - torch.arange(n, device=x.device)[None, :]
        buckets = torch.bucketize(distance.clamp(min=0), self.boundaries)
        bias = self.bias(buckets).permute(2, 0, 1)  # [heads, n, n]
        bias = bias.masked_fill(distance < 0, float("-inf"))
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=bias)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "flex_soft_cap": decoder_of(FlexSoftCapAttention),
    "flex_alibi": decoder_of(FlexAlibiAttention),
    "flex_relative_bias": decoder_of(FlexRelativeBiasAttention),
    "flex_document_mask": DocumentMaskedLM,
    "flex_gqa": decoder_of(FlexGQAAttention),
    "flex_per_head_window": decoder_of(FlexPerHeadWindowAttention),
    "flex_lse_merge": decoder_of(SinkMergeAttention),
    "scan_recurrence": decoder_of(ScanRecurrence),
    "min_gru_associative_scan": decoder_of(MinGRU),
    "save_on_cpu_attention": decoder_of(OffloadedBlockAttention),
    "bucketized_relative_bias": decoder_of(BucketizedBiasAttention),
    "nested_compile_region": lambda: DecoderLM(CompileRegionBlock),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    if name == "flex_document_mask":
        ids[0, 5], ids[0, 11], ids[1, 8] = EOS, EOS, EOS
    return {"input_ids": ids, "labels": labels}
