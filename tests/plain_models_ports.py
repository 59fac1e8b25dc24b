"""Small plain-PyTorch models with constructs from kernels, ported code and training recipes
(issue 27, seventh round): what the earlier rounds did not write.

Attention registered as a ``torch.library.custom_op`` with its own autograd (the way
flash-attn registers its kernels); a fused linear + cross-entropy ``autograd.Function`` that
takes the head's weight (Liger's idiom, gradients computed in the forward); widths that tp
does not divide (a byte vocabulary of 257, an FFN of ``int(8/3 * d)``); layer weights stacked
in one parameter and indexed in a loop (code ported from JAX); DeepSeek's reference MLA with
the ``wkv_b`` weight absorbed into the query and the output (``weight.view(H, -1, C)``,
sliced, einsummed); ``nn.Bilinear``; a video transformer that factorizes attention over
space and time by moving the frames between the batch and the sequence; an EMA teacher with
frozen parameters; gpt-fast's ``input_pos`` indexing the rotary table and the mask; a reward
model reading each row's last token; ``F.embedding(scale_grad_by_freq=True)``;
``nn.MultiheadAttention`` with ``add_bias_kv`` and ``add_zero_attn``; noisy top-k gating; an
audio LM with a head per codebook; a ``torch.stft`` front end; ``ConvTranspose1d`` upsamplers;
a weight formed by a low-rank update in the forward; a product-key memory read by
``EmbeddingBag``; selective activation checkpointing; a hypernetwork's per-sample weights;
ALiBi as SDPA's float mask; wav2vec2's grouped, weight-normed positional convolution; packed
documents attended in a loop over ``split(lengths.tolist())`` (shapes from values, each
document's assumed nonempty and asserted at run time). One is not in ``MODELS``, as
torch.export cannot trace it: a CTC speech model (``F.ctc_loss``'s output is shaped by the
data; ``tests/test_propagation_ports.py`` computes it on the parallel model's outputs).

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, RMSNorm, SwiGLU, apply_rotary_complex, causal_mask, lm_loss, precompute_freqs_cis

SEQ = 16


def _heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S, n * D] -> [B, n, S, D]."""
    return t.unflatten(-1, (n, -1)).transpose(1, 2)


def _merge(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)


# ---- attention as a custom op with its own autograd (flash-attn's registration) ----------------


def _causal_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return (scores + causal_mask(q.shape[-2], q.device)).softmax(-1)


@torch.library.custom_op("autotp_plain::causal_attention", mutates_args=())
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] each; what a fused kernel computes, written with aten ops."""
    return _causal_probs(q, k) @ v


@causal_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("autotp_plain::causal_attention_backward", mutates_args=())
def causal_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = _causal_probs(q, k)
    d_probs = grad @ v.transpose(-2, -1)
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    return d_scores @ k, d_scores.transpose(-2, -1) @ q, probs.transpose(-2, -1) @ grad


@causal_attention_backward.register_fake
def _(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _attention_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return causal_attention_backward(grad, *ctx.saved_tensors)


causal_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


class CustomOpAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(_merge(causal_attention(q, k, v)))


# ---- Liger's fused linear + cross-entropy: the head's weight goes into a Function ------------


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss of ``x @ weight.T`` against ``labels``; the gradients are computed in the forward,
    chunk by chunk, and the backward only scales them (Liger-Kernel's idiom)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
        loss = x.new_zeros(())
        n = x.shape[0]
        for start in range(0, n, 8):
            rows = slice(start, start + 8)
            logits = x[rows] @ weight.t()
            log_probs = logits.log_softmax(-1)
            loss = loss - log_probs.gather(1, labels[rows, None]).sum()
            d_logits = log_probs.exp()
            d_logits[torch.arange(d_logits.shape[0]), labels[rows]] -= 1
            grad_x[rows] = d_logits @ weight / n
            grad_w += d_logits.t() @ x[rows] / n
        ctx.save_for_backward(grad_x, grad_w)
        return loss / n

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad, grad_w * grad, None


class FusedLossLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids)).flatten(0, 1)
        return {"loss": FusedLinearCrossEntropy.apply(h, self.output.weight, labels.flatten())}


# ---- widths tp does not divide -------------------------------------------------------------

BYTE_VOCAB = 257  # 256 bytes and an end-of-text token
ODD_FFN = int(8 / 3 * DIM)  # 170, LLaMA's 2/3 * 4d before rounding to a multiple


class ByteLM(DecoderLM):
    """A byte-level LM whose embedding and head have 257 rows."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.embed = nn.Embedding(BYTE_VOCAB, DIM)
        self.output = nn.Linear(DIM, BYTE_VOCAB, bias=False)


# ---- layer weights stacked in one parameter (code ported from JAX's scanned layers) ----------


class StackedWeightsLM(nn.Module):
    """Every layer's weights are one slice of a [LAYERS, ...] parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.wqkv = nn.Parameter(torch.randn(LAYERS, DIM, 3 * DIM) * DIM**-0.5)
        self.wo = nn.Parameter(torch.randn(LAYERS, DIM, DIM) * DIM**-0.5)
        self.w_up = nn.Parameter(torch.randn(LAYERS, DIM, 4 * DIM) * DIM**-0.5)
        self.w_down = nn.Parameter(torch.randn(LAYERS, 4 * DIM, DIM) * (4 * DIM) ** -0.5)
        self.norm_scale = nn.Parameter(torch.ones(LAYERS, 2, DIM))
        self.head = nn.Parameter(torch.randn(DIM, VOCAB) * DIM**-0.5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.embed(input_ids)
        for i in range(LAYERS):
            h = F.rms_norm(x, (DIM,)) * self.norm_scale[i, 0]
            q, k, v = (_heads(t, HEADS) for t in (h @ self.wqkv[i]).split(DIM, dim=-1))
            x = x + _merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)) @ self.wo[i]
            h = F.rms_norm(x, (DIM,)) * self.norm_scale[i, 1]
            x = x + F.gelu(h @ self.w_up[i]) @ self.w_down[i]
        logits = F.rms_norm(x, (DIM,)) @ self.head
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- DeepSeek's reference MLA with the up-projection absorbed ------------------------------


class AbsorbedLatentAttention(nn.Module):
    """DeepSeek-V3's ``attn_impl="absorb"``: ``wkv_b``'s weight viewed per head, its key half
    folded into the query and its value half applied after the attention over the latent."""

    def __init__(self, q_lora_rank: int = 32, kv_lora_rank: int = 16, nope: int = 8, rope: int = 4, v_dim: int = 8) -> None:
        super().__init__()
        self.nope, self.rope, self.v_dim, self.kv_lora_rank = nope, rope, v_dim, kv_lora_rank
        self.wq_a = nn.Linear(DIM, q_lora_rank, bias=False)
        self.q_norm = RMSNorm(q_lora_rank)
        self.wq_b = nn.Linear(q_lora_rank, HEADS * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(DIM, kv_lora_rank + rope, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, HEADS * (nope + v_dim), bias=False)
        self.wo = nn.Linear(HEADS * v_dim, DIM, bias=False)
        self.softmax_scale = (nope + rope) ** -0.5
        self.register_buffer("freqs_cis", precompute_freqs_cis(rope, 32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, HEADS, self.nope + self.rope)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        q_pe = apply_rotary_complex(q_pe, self.freqs_cis)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope], dim=-1)
        k_pe = apply_rotary_complex(k_pe.unsqueeze(2), self.freqs_cis).squeeze(2)
        kv = self.kv_norm(kv)
        wkv_b = self.wkv_b.weight.view(HEADS, -1, self.kv_lora_rank)
        q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : self.nope])
        scores = (torch.einsum("bshc,btc->bsht", q_nope, kv) + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * self.softmax_scale
        scores = scores + causal_mask(seqlen, x.device)[None, :, None, :]
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        out = torch.einsum("bsht,btc->bshc", scores, kv)
        out = torch.einsum("bshc,hdc->bshd", out, wkv_b[:, -self.v_dim :])
        return self.wo(out.flatten(2))


# ---- nn.Bilinear -----------------------------------------------------------------------------


class BilinearGateMLP(nn.Module):
    """``nn.Bilinear`` between the token and a pooled context, then a down projection."""

    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(DIM, DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]
        return self.down(F.gelu(self.bilinear(x, context)))


# ---- a video transformer, attention factorized over space and time (TimeSformer) -------------

FRAMES, FRAME, TUBELET, VIDEO_CLASSES = 4, 8, 4, 10


class SpaceTimeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.time_norm, self.space_norm, self.mlp_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.time_attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.space_qkv, self.space_out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, n, d = x.shape
        xt = x.transpose(1, 2).reshape(b * n, t, d)  # (b n) t d
        h = self.time_norm(xt)
        xt = xt + self.time_attn(h, h, h, need_weights=False)[0]
        xs = xt.reshape(b, n, t, d).transpose(1, 2).reshape(b * t, n, d)  # (b t) n d
        q, k, v = (_heads(u, HEADS) for u in self.space_qkv(self.space_norm(xs)).chunk(3, -1))
        xs = xs + self.space_out(_merge(F.scaled_dot_product_attention(q, k, v)))
        xs = xs + self.mlp(self.mlp_norm(xs))
        return xs.reshape(b, t, n, d)


class VideoTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv3d(3, DIM, kernel_size=(2, TUBELET, TUBELET), stride=(2, TUBELET, TUBELET))
        tokens = (FRAMES // 2, (FRAME // TUBELET) ** 2)
        self.pos_time = nn.Parameter(torch.randn(1, tokens[0], 1, DIM) * 0.02)
        self.pos_space = nn.Parameter(torch.randn(1, 1, tokens[1], DIM) * 0.02)
        self.blocks = nn.ModuleList(SpaceTimeBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VIDEO_CLASSES)

    def forward(self, video: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.patch(video)  # [B, D, T', H', W']
        x = x.flatten(3).permute(0, 2, 3, 1) + self.pos_time + self.pos_space  # [B, T', N, D]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x.mean(dim=(1, 2))))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- an EMA teacher with frozen parameters (BYOL, data2vec, DINO without centering) -----------


class EmaTeacherLM(nn.Module):
    """A student LM and a frozen copy of it (updated outside the step, never by gradients);
    the student predicts the teacher's last hidden states of the unmasked tokens plus its own
    LM loss."""

    def __init__(self) -> None:
        super().__init__()
        self.student = DecoderLM(lambda: PreNormBlock(NanoGPTAttention()))
        self.teacher = DecoderLM(lambda: PreNormBlock(NanoGPTAttention()))
        self.teacher.load_state_dict(self.student.state_dict())
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.predictor = nn.Linear(DIM, DIM)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        masked = input_ids.masked_fill(torch.arange(input_ids.shape[1], device=input_ids.device) % 4 == 3, 0)
        h = self.student.hidden(masked)
        logits = self.student.logits(h)
        with torch.no_grad():
            target = F.layer_norm(self.teacher.hidden(input_ids), (DIM,))
        regression = F.smooth_l1_loss(self.predictor(h), target)
        return {"logits": logits, "loss": lm_loss(logits, labels) + regression}


# ---- gpt-fast: input_pos indexes the rotary table and the causal mask -------------------------


class InputPosAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = (t.view(bsz, seqlen, HEADS, HEAD_DIM) for t in self.wqkv(x).split(DIM, dim=-1))
        q, k = (apply_rotary_complex(t, freqs_cis) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, DIM))


class GptFastBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = InputPosAttention(), SwiGLU()
        self.attention_norm, self.ffn_norm = RMSNorm(DIM), RMSNorm(DIM)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class GptFastLM(nn.Module):
    def __init__(self, max_seq_length: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(GptFastBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(HEAD_DIM, max_seq_length), persistent=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool)), persistent=False)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        mask = self.causal_mask[None, None, input_pos][..., input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, freqs_cis, mask)
        logits = self.output(self.norm(x))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- a reward model reading each row's last token ---------------------------------------------

PAD = 0


class RewardModel(DecoderLM):
    """HF's sequence-classification idiom: the score of each row's last non-pad token
    (``logits[arange(B), lengths - 1]``), trained by the pairwise Bradley-Terry loss."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.score = nn.Linear(DIM, 1, bias=False)

    def forward(self, chosen_ids: torch.Tensor, rejected_ids: torch.Tensor) -> dict[str, Any]:
        rewards = []
        for ids in (chosen_ids, rejected_ids):
            scores = self.score(self.norm(self.hidden(ids))).squeeze(-1)
            last = (ids != PAD).int().argmax(-1) - 1
            last = torch.where(last < 0, ids.shape[1] - 1, last)  # a row without padding ends at the last position
            rewards.append(scores[torch.arange(ids.shape[0], device=ids.device), last])
        return {"logits": torch.stack(rewards, -1), "loss": -F.logsigmoid(rewards[0] - rewards[1]).mean()}


# ---- embeddings scaled by their frequency in the batch ------------------------------------------


class FrequencyScaledLM(DecoderLM):
    """``F.embedding(scale_grad_by_freq=True)``: each row's gradient divided by how often its
    token occurs in the batch."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.embed = nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)


# ---- a CTC speech head ---------------------------------------------------------------------------

FEATURES, FRAMES_AUDIO, CHARS, TARGET = 20, 24, 32, 6


class CtcSpeech(nn.Module):
    """A convolutional front end over filterbank frames, an encoder and a CTC loss over
    characters (blank = 0), the way wav2vec2-style fine-tuning trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frontend = nn.Sequential(nn.Conv1d(FEATURES, DIM, 3, stride=2, padding=1), nn.GELU(), nn.Conv1d(DIM, DIM, 3, padding=1), nn.GELU())
        self.layers = nn.ModuleList(PreNormBlock(BidirectionalAttention(), nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.ctc_head = nn.Linear(DIM, CHARS)

    def forward(self, features: torch.Tensor, feature_lengths: torch.Tensor, targets: torch.Tensor, target_lengths: torch.Tensor) -> dict[str, Any]:
        x = self.frontend(features.transpose(1, 2)).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        logits = self.ctc_head(self.norm(x))
        log_probs = logits.log_softmax(-1).transpose(0, 1)  # [T, B, C]
        frames = (feature_lengths + 1) // 2
        loss = F.ctc_loss(log_probs, targets, frames, target_lengths, blank=0, zero_infinity=True)
        return {"logits": logits, "loss": loss}


class BidirectionalAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, -1))
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v)))


# ---- nn.MultiheadAttention with add_bias_kv and add_zero_attn --------------------------------


class BiasKVBlock(nn.Module):
    """Learned key/value vectors and a zero key appended to every sequence (fairseq's
    ``add_bias_kv`` / ``add_zero_attn``), causal by an additive mask."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True, add_bias_kv=True, add_zero_attn=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = causal_mask(x.shape[1], x.device)  # MHA pads it for the bias and zero keys, seen by every query
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


# ---- noisy top-k gating (Shazeer et al.) with experts in a loop -------------------------------


class NoisyTopKMoE(nn.Module):
    """Router logits plus Gaussian noise scaled by a learned softplus, top-2 of a softmax over
    the kept logits, experts run on their tokens in a loop and added back by ``index_add_``."""

    EXPERTS, TOP = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.w_gate = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.w_noise = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU(DIM, 2 * DIM) for _ in range(self.EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        clean = self.w_gate(flat)
        noisy = clean + torch.randn_like(clean) * F.softplus(self.w_noise(flat))
        top_logits, top_idx = noisy.topk(self.TOP, dim=-1)
        weights = top_logits.softmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(top_idx == e)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


# ---- an audio LM with one head per codebook -----------------------------------------------------

CODEBOOKS, CODES = 4, 32


class MultiCodebookLM(nn.Module):
    """Tokens of 4 parallel codebooks summed at the input; one projection predicts every
    codebook's next code (``[B, S, K * V]`` viewed ``[B, S, K, V]``, MusicGen's delayed pattern
    without the delay)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeds = nn.ModuleList(nn.Embedding(CODES, DIM) for _ in range(CODEBOOKS))
        self.layers = nn.ModuleList(PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.heads = nn.Linear(DIM, CODEBOOKS * CODES, bias=False)

    def forward(self, codes: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = sum(embed(codes[:, k]) for k, embed in enumerate(self.embeds))
        for layer in self.layers:
            h = layer(h)
        logits = self.heads(self.norm(h)).unflatten(-1, (CODEBOOKS, CODES))  # [B, S, K, V]
        loss = F.cross_entropy(logits.permute(0, 3, 1, 2), labels.transpose(1, 2))  # labels [B, K, S]
        return {"logits": logits, "loss": loss}


# ---- a spectrogram front end computed in the forward ------------------------------------------

SAMPLES, N_FFT, HOP, AUDIO_CLASSES = 256, 32, 16, 10


class SpectrogramClassifier(nn.Module):
    """``torch.stft`` of the raw waveform with a Hann window buffer, log power, a linear
    projection of the frequency bins and a transformer encoder over the frames."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        self.proj = nn.Linear(N_FFT // 2 + 1, DIM)
        self.layers = nn.ModuleList(PreNormBlock(BidirectionalAttention()) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, AUDIO_CLASSES)

    def forward(self, waveform: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        spec = torch.stft(waveform, N_FFT, HOP, window=self.window, return_complex=True)  # [B, F, T]
        x = self.proj(torch.log1p(spec.abs().pow(2)).transpose(1, 2))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x).mean(1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- a transposed-convolution decoder (a VQ-VAE / codec upsampler) ----------------------------

LATENT_FRAMES, UPSAMPLE = 8, 4


class ConvTransposeAutoencoder(nn.Module):
    """A transformer over latent frames, then two ``ConvTranspose1d`` upsamplers back to the
    signal, trained by an L1 reconstruction loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encode = nn.Conv1d(1, DIM, kernel_size=UPSAMPLE * UPSAMPLE, stride=UPSAMPLE * UPSAMPLE)
        self.layers = nn.ModuleList(PreNormBlock(BidirectionalAttention()) for _ in range(LAYERS))
        self.up1 = nn.ConvTranspose1d(DIM, 2 * DIM, kernel_size=UPSAMPLE, stride=UPSAMPLE)
        self.up2 = nn.ConvTranspose1d(2 * DIM, 1, kernel_size=UPSAMPLE, stride=UPSAMPLE)

    def forward(self, signal: torch.Tensor) -> dict[str, Any]:
        x = self.encode(signal).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        recon = self.up2(F.gelu(self.up1(x.transpose(1, 2))))
        return {"logits": recon, "loss": F.l1_loss(recon, signal)}


# ---- a weight made by a low-rank update in the forward ------------------------------------------


class LowRankUpdatedLinear(nn.Linear):
    """``W + B @ A * scale`` formed in the forward, then one ``F.linear`` (a merged LoRA, ReLoRA)."""

    RANK = 4

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, bias=False)
        self.lora_a = nn.Parameter(torch.randn(self.RANK, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, self.RANK) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight + self.lora_b @ self.lora_a * 0.5)


class LowRankMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = LowRankUpdatedLinear(DIM, 4 * DIM), LowRankUpdatedLinear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


# ---- a product-key memory layer (Lample et al.; Meta's memory layers) --------------------------

MEMORY_KEYS, MEMORY_TOP = 16, 4  # 16 x 16 = 256 memory slots


class ProductKeyMemory(nn.Module):
    """The query split in halves, each scored against its own sub-keys; the top-k of each half
    combined into the top-k of the product keys, whose values a sum ``EmbeddingBag`` reads
    with the softmaxed scores as ``per_sample_weights``."""

    def __init__(self) -> None:
        super().__init__()
        half = DIM // 2
        self.query = nn.Linear(DIM, DIM, bias=False)
        self.sub_keys = nn.Parameter(torch.randn(2, MEMORY_KEYS, half) * half**-0.5)
        self.values = nn.EmbeddingBag(MEMORY_KEYS * MEMORY_KEYS, DIM, mode="sum")
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.query(x).flatten(0, 1)  # [T, D]
        q1, q2 = q.chunk(2, dim=-1)
        s1, i1 = (q1 @ self.sub_keys[0].t()).topk(MEMORY_TOP, dim=-1)
        s2, i2 = (q2 @ self.sub_keys[1].t()).topk(MEMORY_TOP, dim=-1)
        scores = (s1[:, :, None] + s2[:, None, :]).flatten(1)  # [T, k * k]
        slots = (i1[:, :, None] * MEMORY_KEYS + i2[:, None, :]).flatten(1)
        best, pick = scores.topk(MEMORY_TOP, dim=-1)
        read = self.values(slots.gather(1, pick), per_sample_weights=best.softmax(-1))
        return self.out(read).view_as(x)


# ---- selective activation checkpointing (torchtitan's op-level policy) -------------------------


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveCheckpointBlock(PreNormBlock):
    """Each block under ``checkpoint(use_reentrant=False)`` with a ``context_fn`` that saves the
    matmuls' outputs and recomputes the rest."""

    def __init__(self) -> None:
        super().__init__(NanoGPTAttention())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from functools import partial

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        return checkpoint(super().forward, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))


# ---- a hypernetwork: per-sample weights made by a linear ----------------------------------------

HYPER_RANK = 8


class HyperAdapter(nn.Module):
    """A per-sample low-rank adapter whose down and up matrices a hypernetwork makes from the
    sequence's mean (``bmm`` with generated weights), added to an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = SwiGLU()
        self.make_down = nn.Linear(DIM, DIM * HYPER_RANK)
        self.make_up = nn.Linear(DIM, HYPER_RANK * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x.mean(1)  # [B, D]
        down = self.make_down(context).view(-1, DIM, HYPER_RANK) * 0.1
        up = self.make_up(context).view(-1, HYPER_RANK, DIM) * 0.1
        return self.mlp(x) + torch.bmm(torch.bmm(x, down), up)


# ---- SDPA with an ALiBi bias tensor over the heads ----------------------------------------------


class AlibiSdpaAttention(nn.Module):
    """ALiBi as a float ``attn_mask`` [1, H, S, S] (slopes buffer times distances, plus the causal
    mask) into SDPA: the bias is read per head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, HEADS + 1) / HEADS), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        pos = torch.arange(s, device=x.device)
        bias = self.slopes[:, None, None] * (pos[None, :] - pos[:, None]).float() + causal_mask(s, x.device)
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, -1))
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])))


# ---- varlen attention by a loop over packed documents --------------------------------------------


class DocumentLoopAttention(nn.Module):
    """Packed documents without a varlen kernel: the sequence cut at the documents' lengths
    (``split(..., lengths.tolist())``) and each document attended on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, -1))
        pieces = [F.scaled_dot_product_attention(*doc, is_causal=True)
                  for doc in zip(*(t.split(lengths.tolist(), dim=2) for t in (q, k, v)))]  # fmt: skip
        return self.out(_merge(torch.cat(pieces, dim=2)))


class PackedLoopLM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(DocumentLoopAttention()))

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer.attention(layer.attention_norm(h), lengths) + h
            h = h + layer.feed_forward(layer.ffn_norm(h))
        logits = self.logits(h)
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- wav2vec2's grouped positional convolution ---------------------------------------------------

CONV_GROUPS = 4


class GroupedPositionalConv(nn.Module):
    """A convolution over the sequence in ``groups`` of the channels, weight-normed over its
    kernel dim, added to its input (wav2vec2 / HuBERT's relative positions)."""

    def __init__(self) -> None:
        super().__init__()
        conv = nn.Conv1d(DIM, DIM, kernel_size=5, padding=2, groups=CONV_GROUPS)
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)


class PositionalConvEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos_conv = GroupedPositionalConv()
        self.layers = nn.ModuleList(PreNormBlock(BidirectionalAttention()) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.pos_conv(self.embed(input_ids))
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- a verbalizer: class logits from the embedding rows of label words --------------------------

LABEL_WORDS = (3, 17, 42, 99)


class VerbalizerClassifier(DecoderLM):
    """Prompt-based classification: the last token's hidden state against the (tied) embedding
    rows of one label word per class, read by constant ids."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))
        self.register_buffer("label_words", torch.tensor(LABEL_WORDS), persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h = self.norm(self.hidden(input_ids))[:, -1]
        logits = h @ self.embed.weight[self.label_words].t()
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- ViTDet's simple feature pyramid ------------------------------------------------------------

PYRAMID_IMAGE, PYRAMID_PATCH = 16, 4


class SimpleFeaturePyramid(nn.Module):
    """A plain ViT's last feature map taken to four scales: two ``ConvTranspose2d`` (x4), one (x2),
    itself, and a max-pool (x1/2), each through a 1x1 and a 3x3 convolution; a dense target per
    scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, DIM, PYRAMID_PATCH, stride=PYRAMID_PATCH)
        self.layers = nn.ModuleList(PreNormBlock(BidirectionalAttention()) for _ in range(LAYERS))
        self.up4 = nn.Sequential(nn.ConvTranspose2d(DIM, DIM // 2, 2, stride=2), nn.GELU(), nn.ConvTranspose2d(DIM // 2, DIM // 4, 2, stride=2))
        self.up2 = nn.ConvTranspose2d(DIM, DIM // 2, 2, stride=2)
        self.down2 = nn.MaxPool2d(2)
        self.heads = nn.ModuleList(nn.Sequential(nn.Conv2d(c, 8, 1), nn.Conv2d(8, 8, 3, padding=1)) for c in (DIM // 4, DIM // 2, DIM, DIM))

    def forward(self, pixel_values: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        x = self.patch(pixel_values)
        b, d, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        for layer in self.layers:
            t = layer(t)
        x = t.transpose(1, 2).reshape(b, d, h, w)
        maps = [head(m) for head, m in zip(self.heads, (self.up4(x), self.up2(x), x, self.down2(x)))]
        loss = sum(F.mse_loss(m.mean(1), F.adaptive_avg_pool2d(targets, m.shape[-2:]).squeeze(1)) for m in maps)
        return {"logits": maps[0], "loss": loss}


# ---- an expert bias updated by the forward (aux-loss-free balancing) -----------------------------


class BiasBalancedMoE(nn.Module):
    """DeepSeek-V3's aux-loss-free balancing written into the forward: the routing bias buffer is
    moved toward balance by each forward's expert loads, under ``no_grad``."""

    EXPERTS, TOP, RATE = 4, 2, 0.01

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU(DIM, 2 * DIM) for _ in range(self.EXPERTS))
        self.register_buffer("expert_bias", torch.zeros(self.EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        scores = self.router(flat).sigmoid()
        _, top = (scores + self.expert_bias).topk(self.TOP, dim=-1)
        weights = scores.gather(1, top)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(top == e)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        with torch.no_grad():
            load = F.one_hot(top, self.EXPERTS).sum((0, 1)).float()
            self.expert_bias += self.RATE * torch.sign(load.mean() - load)
        return out.view_as(x)


# ---- overlapping windows summed back by F.fold ---------------------------------------------------

WINDOW, STRIDE = 4, 2


class FoldedWindowMixer(nn.Module):
    """Overlapping windows of the sequence (``F.unfold``), mixed by a linear over each window's
    positions, summed back by ``F.fold`` and divided by the overlap count."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WINDOW, WINDOW)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x)).transpose(1, 2).unsqueeze(-1)  # [B, C, S, 1]
        s = h.shape[2]
        cols = F.unfold(h, (WINDOW, 1), stride=(STRIDE, 1))  # [B, C * W, L]
        c = h.shape[1]
        cols = self.mix(cols.unflatten(1, (c, WINDOW)).transpose(2, 3)).transpose(2, 3).flatten(1, 2)
        ones = F.unfold(torch.ones_like(h[:1, :1]), (WINDOW, 1), stride=(STRIDE, 1))
        count = F.fold(ones, (s, 1), (WINDOW, 1), stride=(STRIDE, 1))
        mixed = F.fold(cols, (s, 1), (WINDOW, 1), stride=(STRIDE, 1)) / count
        return self.down(mixed.squeeze(-1).transpose(1, 2))


# ---- native sparse attention (DeepSeek NSA): compressed, selected and sliding branches -----------

BLOCK, SELECTED, WINDOW_NSA = 4, 2, 4


class NativeSparseAttention(nn.Module):
    """Keys and values compressed per block by an MLP, each query's top blocks (by its group's
    compressed scores) gathered whole, a sliding window; the three outputs mixed by per-head
    sigmoid gates. GQA with 2 query heads per KV head."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_heads, self.group = HEADS // 2, 2
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * self.kv_heads * HEAD_DIM, bias=False)
        self.compress = nn.Linear(BLOCK * HEAD_DIM, HEAD_DIM)
        self.gates = nn.Linear(DIM, 3 * HEADS)
        self.out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        n = s // BLOCK
        q = self.q(x).view(b, s, self.kv_heads, self.group, HEAD_DIM).permute(0, 2, 3, 1, 4)  # [B, K, G, S, D]
        k, v = (t.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2) for t in self.kv(x).chunk(2, -1))  # [B, K, S, D]
        kc, vc = (self.compress(t.reshape(b, self.kv_heads, n, BLOCK * HEAD_DIM)) for t in (k, v))  # [B, K, n, D]
        pos = torch.arange(s, device=x.device)
        block_end = torch.arange(n, device=x.device) * BLOCK + BLOCK - 1
        scale = HEAD_DIM**-0.5
        sc = torch.einsum("bkgsd,bknd->bkgsn", q, kc) * scale
        sc = sc.masked_fill(block_end[None, :] > pos[:, None], float("-inf"))
        pc = torch.nan_to_num(sc.softmax(-1))
        o_cmp = torch.einsum("bkgsn,bknd->bkgsd", pc, vc)
        importance = pc.sum(2)  # [B, K, S, n]: a KV group's queries pick the same blocks
        own = pos[:, None] // BLOCK == torch.arange(n, device=x.device)[None, :]
        chosen = importance.masked_fill(own, float("inf")).topk(SELECTED, dim=-1).indices  # [B, K, S, sel]
        token = (chosen[..., None] * BLOCK + torch.arange(BLOCK, device=x.device)).flatten(-2)  # [B, K, S, sel * BLOCK]
        ks, vs = (torch.gather(t[:, :, None].expand(-1, -1, s, -1, -1), 3, token[..., None].expand(-1, -1, -1, -1, HEAD_DIM)) for t in (k, v))
        ss = torch.einsum("bkgsd,bkstd->bkgst", q, ks) * scale
        ss = ss.masked_fill(token[:, :, None] > pos[None, None, None, :, None], float("-inf"))
        o_sel = torch.einsum("bkgst,bkstd->bkgsd", ss.softmax(-1), vs)
        local = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < WINDOW_NSA)
        sw = torch.einsum("bkgsd,bktd->bkgst", q, k) * scale
        o_win = torch.einsum("bkgst,bktd->bkgsd", sw.masked_fill(~local, float("-inf")).softmax(-1), v)
        g = self.gates(x).sigmoid().view(b, s, 3, self.kv_heads, self.group).permute(2, 0, 3, 4, 1)[..., None]  # [3, B, K, G, S, 1]
        o = g[0] * o_cmp + g[1] * o_sel + g[2] * o_win
        return self.out(o.permute(0, 3, 1, 2, 4).reshape(b, s, HEADS * HEAD_DIM))


# ---- a test-time-training layer (TTT-Linear, dual form over one mini-batch) ------------------------


class TTTLinear(nn.Module):
    """Each head's inner linear model ``W0`` [H, D, D] takes one gradient step per token on the
    reconstruction ``k W -> v``; in the dual form the output is ``q W0 - eta * tril(q k^T) (k W0 - v)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.inner = nn.Parameter(torch.eye(HEAD_DIM).repeat(HEADS, 1, 1) + 0.01 * torch.randn(HEADS, HEAD_DIM, HEAD_DIM))
        self.eta = nn.Parameter(torch.full((HEADS, 1, 1), 0.1))
        self.norm = nn.LayerNorm(HEAD_DIM)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, -1))  # [B, H, S, D]
        error = torch.einsum("bhsd,hde->bhse", k, self.inner) - v
        attn = torch.tril(q @ k.transpose(-2, -1))
        z = torch.einsum("bhsd,hde->bhse", q, self.inner) - self.eta * (attn @ error)
        return self.out(_merge(self.norm(z)))


# ---- keys and values pooled along the sequence, the output upsampled back -----------------------

POOL = 2


class PooledKVAttention(nn.Module):
    """Keys and values average-pooled along the sequence (``F.avg_pool1d`` over channels-first
    projections), bidirectional attention over the pooled ones, and a branch at half resolution
    brought back by ``F.interpolate`` (Funnel / pooling attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = F.avg_pool1d(self.kv(x).transpose(1, 2), POOL).transpose(1, 2)  # [B, S / 2, 2D]
        k, v = (_heads(t, HEADS) for t in kv.chunk(2, -1))
        coarse = F.scaled_dot_product_attention(_heads(self.q(x[:, ::POOL]), HEADS), k, v)  # [B, H, S / 2, D]
        fine = F.interpolate(_merge(coarse).transpose(1, 2), scale_factor=POOL, mode="linear", align_corners=False)
        return self.out(fine.transpose(1, 2))


# ---- rotary embeddings with a base per head ---------------------------------------------------------


class PerHeadRopeAttention(nn.Module):
    """Each head rotates with its own base (a ``[H, S, D/2]`` angle buffer): short- and
    long-range heads side by side."""

    def __init__(self, max_len: int = 32) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        bases = torch.logspace(2, 5, HEADS)  # 100 ... 100000
        inv = 1.0 / bases[:, None] ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)  # [H, D/2]
        self.register_buffer("angles", torch.arange(max_len).float()[None, :, None] * inv[:, None, :], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, -1))
        cos, sin = self.angles[:, :s].cos(), self.angles[:, :s].sin()

        def rotate(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t[..., ::2], t[..., 1::2]
            return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)

        return self.out(_merge(F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)))


# ---- a residual vector quantizer (SoundStream / EnCodec) ------------------------------------------------

CODEBOOK_SIZE, QUANTIZERS = 16, 3


class ResidualVQAutoencoder(nn.Module):
    """An encoder, then ``QUANTIZERS`` codebooks each quantizing what the ones before left
    (``cdist`` + ``argmin``, straight-through), commitment and codebook losses, a decoder."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.ModuleList(PreNormBlock(BidirectionalAttention()) for _ in range(LAYERS))
        self.codebooks = nn.Parameter(torch.randn(QUANTIZERS, CODEBOOK_SIZE, DIM))
        self.decoder = nn.ModuleList(PreNormBlock(BidirectionalAttention()) for _ in range(LAYERS))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        z = self.embed(input_ids)
        for layer in self.encoder:
            z = layer(z)
        residual, quantized, vq_loss = z, torch.zeros_like(z), z.new_zeros(())
        for codebook in self.codebooks:
            codes = torch.cdist(residual.flatten(0, 1), codebook).argmin(-1).view(residual.shape[:2])
            chosen = codebook[codes]
            vq_loss = vq_loss + F.mse_loss(chosen, residual.detach()) + 0.25 * F.mse_loss(residual, chosen.detach())
            quantized = quantized + residual + (chosen - residual).detach()
            residual = residual - chosen.detach()
        h = quantized
        for layer in self.decoder:
            h = layer(h)
        logits = self.output(h)
        return {"logits": logits, "loss": lm_loss(logits, labels) + vq_loss}


# ---- attention by einsums with an ellipsis (lucidrains' style) ------------------------------------


class EllipsisEinsumAttention(nn.Module):
    """Scores by ``einsum("...id,...jd->...ij")`` and the values by ``einsum("...ij,...jd->...id")``
    over ``[B, H, S, D]``, rotary angles by ``einsum("...,f->...f")``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, -1))
        angles = torch.einsum("...,f->...f", torch.arange(s, device=x.device).float(), self.inv_freq)
        angles = torch.cat((angles, angles), -1)
        q, k = (t * angles.cos() + torch.cat((-t[..., HEAD_DIM // 2 :], t[..., : HEAD_DIM // 2]), -1) * angles.sin() for t in (q, k))
        scores = torch.einsum("...id,...jd->...ij", q, k) * HEAD_DIM**-0.5 + causal_mask(s, x.device)
        return self.out(_merge(torch.einsum("...ij,...jd->...id", scores.softmax(-1), v)))


# ---- a short convolution per head, the heads folded into the batch ---------------------------------

SHORT_KERNEL = 3


class HeadsIntoBatchConv(nn.Module):
    """Values convolved along the sequence by one depthwise kernel shared by every head, the heads
    folded into the batch (``[B, H, D, S] -> [B * H, D, S]``), then attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.kernel = nn.Parameter(torch.randn(HEAD_DIM, 1, SHORT_KERNEL) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (_heads(t, HEADS) for t in self.qkv(x).chunk(3, -1))
        folded = v.transpose(2, 3).reshape(b * HEADS, HEAD_DIM, s)
        v = F.conv1d(folded, self.kernel, padding=SHORT_KERNEL - 1, groups=HEAD_DIM)[..., :s].reshape(b, HEADS, HEAD_DIM, s).transpose(2, 3)
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "custom_op_attention": lambda: DecoderLM(lambda: PreNormBlock(CustomOpAttention())),
    "fused_linear_cross_entropy": FusedLossLM,
    "byte_vocab_257": ByteLM,
    "odd_ffn_width": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), SwiGLU(DIM, ODD_FFN))),
    "stacked_layer_weights": StackedWeightsLM,
    "absorbed_mla": lambda: DecoderLM(lambda: PreNormBlock(AbsorbedLatentAttention(), norm=RMSNorm), norm=RMSNorm),
    "bilinear_context": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), BilinearGateMLP())),
    "spacetime_video": VideoTransformer,
    "ema_teacher": EmaTeacherLM,
    "gpt_fast_input_pos": GptFastLM,
    "reward_last_token": RewardModel,
    "scale_grad_by_freq": FrequencyScaledLM,
    "mha_bias_kv": lambda: DecoderLM(BiasKVBlock),
    "noisy_topk_moe": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), NoisyTopKMoE())),
    "multi_codebook_heads": MultiCodebookLM,
    "stft_frontend": SpectrogramClassifier,
    "conv_transpose_decoder": ConvTransposeAutoencoder,
    "low_rank_updated_weight": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), LowRankMLP())),
    "product_key_memory": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ProductKeyMemory())),
    "selective_checkpoint": lambda: DecoderLM(SelectiveCheckpointBlock),
    "hypernetwork_adapter": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), HyperAdapter())),
    "sdpa_alibi_bias": lambda: DecoderLM(lambda: PreNormBlock(AlibiSdpaAttention())),
    "grouped_positional_conv": PositionalConvEncoder,
    "verbalizer_head": VerbalizerClassifier,
    "vitdet_pyramid": SimpleFeaturePyramid,
    "bias_balanced_moe": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), BiasBalancedMoE())),
    "fold_overlap_windows": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), FoldedWindowMixer())),
    "native_sparse_attention": lambda: DecoderLM(lambda: PreNormBlock(NativeSparseAttention())),
    "ttt_linear": lambda: DecoderLM(lambda: PreNormBlock(TTTLinear())),
    "pooled_kv_attention": lambda: DecoderLM(lambda: PreNormBlock(PooledKVAttention())),
    "per_head_rope_bases": lambda: DecoderLM(lambda: PreNormBlock(PerHeadRopeAttention())),
    "residual_vq": ResidualVQAutoencoder,
    "ellipsis_einsum_attention": lambda: DecoderLM(lambda: PreNormBlock(EllipsisEinsumAttention())),
    "heads_into_batch_conv": lambda: DecoderLM(lambda: PreNormBlock(HeadsIntoBatchConv())),
    "varlen_document_loop": PackedLoopLM,
}
MOE = frozenset({"noisy_topk_moe", "bias_balanced_moe"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "byte_vocab_257":
        return {"input_ids": torch.randint(0, BYTE_VOCAB, (batch, seq), generator=gen), "labels": torch.randint(0, BYTE_VOCAB, (batch, seq), generator=gen)}
    if name == "spacetime_video":
        return {"video": torch.randn(batch, 3, FRAMES, FRAME, FRAME, generator=gen), "labels": torch.randint(0, VIDEO_CLASSES, (batch,), generator=gen)}
    if name == "gpt_fast_input_pos":
        return {"idx": torch.randint(0, VOCAB, (batch, seq), generator=gen), "input_pos": torch.arange(seq), "labels": torch.randint(0, VOCAB, (batch, seq), generator=gen)}
    if name == "reward_last_token":
        chosen, rejected = (torch.randint(1, VOCAB, (batch, seq), generator=gen) for _ in range(2))
        chosen[0, seq - 3 :] = PAD
        rejected[1, seq - 5 :] = PAD
        return {"chosen_ids": chosen, "rejected_ids": rejected}
    if name == "scale_grad_by_freq":
        ids = torch.randint(0, 8, (batch, seq), generator=gen)  # few distinct tokens, each repeated
        return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, seq), generator=gen)}
    if name == "verbalizer_head":
        return {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=gen), "labels": torch.randint(0, len(LABEL_WORDS), (batch,), generator=gen)}
    if name == "vitdet_pyramid":
        return {"pixel_values": torch.randn(batch, 3, PYRAMID_IMAGE, PYRAMID_IMAGE, generator=gen), "targets": torch.randn(batch, 1, 16, 16, generator=gen)}
    if name == "multi_codebook_heads":
        return {"codes": torch.randint(0, CODES, (batch, CODEBOOKS, seq), generator=gen), "labels": torch.randint(0, CODES, (batch, CODEBOOKS, seq), generator=gen)}
    if name == "stft_frontend":
        return {"waveform": torch.randn(batch, SAMPLES, generator=gen), "labels": torch.randint(0, AUDIO_CLASSES, (batch,), generator=gen)}
    if name == "conv_transpose_decoder":
        return {"signal": torch.randn(batch, 1, LATENT_FRAMES * UPSAMPLE * UPSAMPLE, generator=gen)}
    if name == "varlen_document_loop":
        ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
        return {"input_ids": ids, "lengths": torch.tensor([5, 8, seq - 13]), "labels": labels}
    return {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=gen), "labels": torch.randint(0, VOCAB, (batch, seq), generator=gen)}
