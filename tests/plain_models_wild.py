"""Small plain-PyTorch models of constructs that other libraries and newer architectures write
and that no other suite module covers (issue 27, third round): Hyena's long convolution by
``torch.fft``, xLSTM's mLSTM (exponential input gates stabilized by a running max), nGPT
(weights normalized in the forward, learned per-channel scalers), ALBERT (one layer applied
``LAYERS`` times, a factorized embedding), peft-style LoRA adapters beside frozen base
weights, spectral-norm parametrizations, sliding-window attention by ``Tensor.unfold``, ToMe
token merging (``argsort`` + ``scatter_reduce``), PyTorch's own ``nn.Transformer``, Griffin's
RG-LRU (a Python loop over time, block-diagonal gates), gated linear attention by ``cumsum``,
a Switch MoE whose capacity factor drops tokens, and MoE layers whose loops depend on the
routing (``for e in mask.nonzero()``, ``if counts[i] == 0: continue``).

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)`` and ``MOE``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, HEAD_DIM, HEADS, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, SwiGLU, causal_mask, lm_loss

SEQ = 16


def heads(t: torch.Tensor) -> torch.Tensor:
    """[B, S, H*D] -> [B, H, S, D]."""
    b, s, _ = t.shape
    return t.view(b, s, HEADS, -1).transpose(1, 2)


def merge(t: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H*D]."""
    b, _, s, _ = t.shape
    return t.transpose(1, 2).reshape(b, s, -1)


def lm_outputs(logits: torch.Tensor, labels: torch.Tensor | None) -> dict[str, Any]:
    return {"logits": logits} if labels is None else {"logits": logits, "loss": lm_loss(logits, labels)}


# ---- Hyena: an implicit long filter applied by FFT over the sequence ----------------------


class HyenaFilter(nn.Module):
    """safari's ``HyenaFilter``: sinusoidal positions -> a small MLP -> one filter per channel,
    times an exponential decay window."""

    def __init__(self, emb: int = 9, order: int = 16) -> None:
        super().__init__()
        t = torch.linspace(0, 1, SEQ)[:, None]
        bands = torch.linspace(1e-4, emb // 2 - 1, emb // 2)[None]
        z = torch.cat([t, torch.cos(2 * math.pi * bands * t), torch.sin(2 * math.pi * bands * t)], dim=-1)
        self.register_buffer("z", z, persistent=False)  # [L, emb]
        self.register_buffer("t", t, persistent=False)
        self.mlp = nn.Sequential(nn.Linear(emb, order), nn.SiLU(), nn.Linear(order, order), nn.SiLU(), nn.Linear(order, DIM, bias=False))
        self.deltas = nn.Parameter(torch.linspace(0.3, 1.5, DIM))
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)

    def forward(self, length: int) -> torch.Tensor:
        h = self.mlp(self.z[:length])  # [L, D]
        return (h * torch.exp(-self.t[:length] * self.deltas.abs())).transpose(0, 1)  # [D, L]


def fftconv(u: torch.Tensor, k: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A causal convolution of ``u`` [B, D, L] with per-channel filters ``k`` [D, L] by FFT."""
    n = 2 * u.shape[-1]
    y = torch.fft.irfft(torch.fft.rfft(u, n=n) * torch.fft.rfft(k, n=n) / n, n=n, norm="forward")[..., : u.shape[-1]]
    return y + u * bias[:, None]


class HyenaOperator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 3 * DIM)
        self.short_filter = nn.Conv1d(3 * DIM, 3 * DIM, 3, padding=2, groups=3 * DIM)
        self.filter = HyenaFilter()
        self.out_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        u = self.in_proj(x).transpose(1, 2)  # [B, 3D, L]
        u = self.short_filter(u)[..., :length]
        x0, x1, v = u.split(DIM, dim=1)
        v = fftconv(v * x1, self.filter(length), self.filter.bias)
        return self.out_proj((v * x0).transpose(1, 2))


# ---- xLSTM mLSTM: exponential input gates, a stabilizer max, a normalizer -----------------


class MLSTMCell(nn.Module):
    """The parallel form of xLSTM's ``parallel_stabilized_simple``."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.igate, self.fgate = nn.Linear(DIM, HEADS), nn.Linear(DIM, HEADS)
        with torch.no_grad():
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, HEADS))
        self.outnorm = nn.GroupNorm(HEADS, DIM)
        self.out_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        igate = self.igate(x).transpose(1, 2).unsqueeze(-1)  # [B, H, S, 1]
        log_f = F.logsigmoid(self.fgate(x).transpose(1, 2).unsqueeze(-1))
        cum = torch.cat([torch.zeros_like(log_f[:, :, :1]), torch.cumsum(log_f, dim=-2)], dim=-2)
        rep = cum.repeat(1, 1, 1, s + 1)
        lower = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device))
        log_fg = torch.where(lower, (rep - rep.transpose(-2, -1))[:, :, 1:, 1:], -float("inf"))
        log_d = log_fg + igate.transpose(-2, -1)
        max_log_d, _ = torch.max(log_d, dim=-1, keepdim=True)
        d = torch.exp(log_d - max_log_d)
        c = (q @ (k / math.sqrt(HEAD_DIM)).transpose(-2, -1)) * d
        normalizer = torch.maximum(c.sum(dim=-1, keepdim=True).abs(), torch.exp(-max_log_d))
        h = (c / (normalizer + 1e-6)) @ v  # [B, H, S, D]
        h = self.outnorm(merge(h).reshape(b * s, DIM)).view(b, s, DIM)
        return self.out_proj(h)


# ---- nGPT: normalized weights and hidden states, learned per-channel scalers --------------


def justnorm(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)


class NormLinear(nn.Linear):
    """A linear layer whose rows are unit vectors, normalized over the input dim in the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, F.normalize(self.weight, dim=-1))


class Scale(nn.Module):
    def __init__(self, dim: int, init: float, scale: float) -> None:
        super().__init__()
        self.init, self.scale = init, scale
        self.param = nn.Parameter(torch.full((dim,), scale) + torch.linspace(-0.01, 0.01, dim))

    def forward(self) -> torch.Tensor:
        return self.param * (self.init / self.scale)


class NGPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (NormLinear(DIM, DIM, bias=False) for _ in range(4))
        self.up, self.gate, self.down = NormLinear(DIM, 2 * DIM, bias=False), NormLinear(DIM, 2 * DIM, bias=False), NormLinear(2 * DIM, DIM, bias=False)
        self.sqk, self.suv_u, self.suv_v = Scale(DIM, 1.0, DIM**-0.5), Scale(2 * DIM, 1.0, 1.0), Scale(2 * DIM, 1.0, 1.0)
        self.alpha_a, self.alpha_m = Scale(DIM, 0.05, DIM**-0.5), Scale(DIM, 0.05, DIM**-0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        sqk = self.sqk().view(1, HEADS, 1, HEAD_DIM)
        q = justnorm(heads(self.q(h))) * sqk
        k = justnorm(heads(self.k(h))) * sqk
        y = F.scaled_dot_product_attention(q, k, heads(self.v(h)), is_causal=True, scale=HEAD_DIM**0.5)
        h = justnorm(h + self.alpha_a().abs() * (justnorm(self.o(merge(y))) - h))
        u, v = self.up(h) * self.suv_u(), self.gate(h) * self.suv_v() * DIM**0.5
        m = self.down(u * F.silu(v))
        return justnorm(h + self.alpha_m().abs() * (justnorm(m) - h))


class NGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(NGPTBlock() for _ in range(LAYERS))
        self.output = NormLinear(DIM, VOCAB, bias=False)
        self.sz = Scale(VOCAB, 1.0, DIM**-0.5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        h = justnorm(self.embed(input_ids))
        for layer in self.layers:
            h = layer(h)
        logits = self.output(h) * self.sz()
        return lm_outputs(logits, labels)


# ---- ALBERT: a factorized embedding and one layer applied LAYERS times --------------------


class AlbertLayer(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query, self.key, self.value, self.dense = (nn.Linear(hidden, hidden) for _ in range(4))
        self.attention_norm, self.full_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.ffn, self.ffn_output = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        probs = ((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask).softmax(-1)
        x = self.attention_norm(x + self.dense(merge(probs @ v)))
        return self.full_norm(x + self.ffn_output(F.gelu(self.ffn(x), approximate="tanh")))


class Albert(nn.Module):
    """Embeddings of width ``EMBED`` < hidden, mapped in by one linear; one shared layer group
    run ``LAYERS + 1`` times; an MLM head back to ``EMBED`` tied to the word embeddings."""

    EMBED = 32

    def __init__(self) -> None:
        super().__init__()
        self.word, self.position = nn.Embedding(VOCAB, self.EMBED), nn.Embedding(SEQ, self.EMBED)
        self.emb_norm = nn.LayerNorm(self.EMBED)
        self.mapping_in = nn.Linear(self.EMBED, DIM)
        self.shared = AlbertLayer(DIM)
        self.dense, self.head_norm = nn.Linear(DIM, self.EMBED), nn.LayerNorm(self.EMBED)
        self.decoder_bias = nn.Parameter(torch.zeros(VOCAB))
        for module in self.modules():  # AlbertPreTrainedModel._init_weights: initializer_range 0.02
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.mapping_in(self.emb_norm(self.word(input_ids) + self.position(pos)))
        for _ in range(LAYERS + 1):
            x = self.shared(x, mask)
        h = self.head_norm(F.gelu(self.dense(x), approximate="tanh"))
        logits = F.linear(h, self.word.weight, self.decoder_bias)
        return lm_outputs(logits, labels)


# ---- peft-style LoRA: A/B adapters beside a frozen base linear ----------------------------


class LoraLinear(nn.Module):
    """peft's ``lora.Linear``: ``base_layer`` frozen, ``lora_A`` / ``lora_B`` in ModuleDicts keyed
    by the adapter name, ``scaling = alpha / r``."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: int = 8) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(0.0)})
        self.scaling = {"default": alpha / r}
        nn.init.normal_(self.lora_B["default"].weight, std=0.05)  # peft starts at zero; nonzero to test the path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        for name in self.lora_A:
            result = result + self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x))) * self.scaling[name]
        return result


def lora_lm() -> nn.Module:
    """NanoGPT-style attention and a SwiGLU with LoRA on q, v, the output and MLP projections."""
    model = DecoderLM(lambda: PreNormBlock(_SplitAttention(), SwiGLU()))
    model.requires_grad_(False)
    for layer in model.layers:
        attn, mlp = layer.attention, layer.feed_forward
        attn.q_proj, attn.v_proj, attn.o_proj = LoraLinear(attn.q_proj), LoraLinear(attn.v_proj), LoraLinear(attn.o_proj)
        mlp.w1, mlp.w2 = LoraLinear(mlp.w1), LoraLinear(mlp.w2)
    return model


class _SplitAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True)
        return self.o_proj(merge(y))


# ---- spectral norm (GAN / SNGP style) ------------------------------------------------------


class SpectralMLP(nn.Module):
    """Both MLP linears under ``nn.utils.parametrizations.spectral_norm`` (eval: sigma from
    the stored power-iteration vectors ``_u``, ``_v``)."""

    def __init__(self) -> None:
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.up, self.down = sn(nn.Linear(DIM, 2 * DIM)), sn(nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def spectral_lm() -> nn.Module:
    model = DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), SpectralMLP()))
    model.train()
    with torch.no_grad():  # a few power iterations so that _u and _v are meaningful
        for _ in range(3):
            model(torch.zeros(1, 4, dtype=torch.long))
    return model


# ---- sliding-window attention by Tensor.unfold ---------------------------------------------


class UnfoldWindowAttention(nn.Module):
    """Each query sees the ``WINDOW`` keys up to itself: keys and values padded on the left and
    unfolded over the sequence (``[B, H, S, D, W]``), scores by ``einsum``."""

    WINDOW = 4

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        w = self.WINDOW
        k = F.pad(k, (0, 0, w - 1, 0)).unfold(2, w, 1)  # [B, H, S, D, W]
        v = F.pad(v, (0, 0, w - 1, 0)).unfold(2, w, 1)
        scores = torch.einsum("bhsd,bhsdw->bhsw", q, k) * HEAD_DIM**-0.5
        pos = torch.arange(x.shape[1], device=x.device)[:, None] - (w - 1) + torch.arange(w, device=x.device)
        scores = scores.masked_fill(pos < 0, float("-inf"))
        return self.proj(merge(torch.einsum("bhsw,bhsdw->bhsd", scores.softmax(-1), v)))


# ---- ToMe: bipartite soft matching merges similar tokens inside a ViT ---------------------

IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10


def bipartite_merge(metric: torch.Tensor, x: torch.Tensor, size: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ToMe's ``bipartite_soft_matching`` + ``merge_wavg`` (the class token is never merged)."""
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, b = metric[..., ::2, :], metric[..., 1::2, :]
    scores = a @ b.transpose(-1, -2)
    scores[..., 0, :] = -math.inf
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)

    def merge_fn(t: torch.Tensor) -> torch.Tensor:
        src, dst = t[..., ::2, :], t[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce="sum")
        return torch.cat([unm, dst], dim=1)

    x = merge_fn(x * size)
    size = merge_fn(size)
    return x / size, size


class ToMeBlock(nn.Module):
    def __init__(self, r: int) -> None:
        super().__init__()
        self.r = r
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (heads(t) for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) * HEAD_DIM**-0.5 + size.log()[:, None, None, :, 0]  # proportional attention
        x = x + self.proj(merge(scores.softmax(-1) @ v))
        x, size = bipartite_merge(k.mean(1), x, size, self.r)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)))), size


class ToMeViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(CHANNELS, DIM, PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList(ToMeBlock(r=4) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        size = torch.ones_like(x[..., :1])
        for block in self.blocks:
            x, size = block(x, size)
        logits = self.head(self.norm(x)[:, 0])
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


# ---- PyTorch's own nn.Transformer (encoder-decoder) ---------------------------------------


class TorchTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.transformer = nn.Transformer(DIM, HEADS, LAYERS, LAYERS, dim_feedforward=2 * DIM, dropout=0.0, batch_first=True)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(decoder_input_ids.shape[1], device=input_ids.device)
        y = self.transformer(self.embed(input_ids), self.embed(decoder_input_ids), tgt_mask=tgt_mask, tgt_is_causal=True)
        logits = self.output(y)
        return lm_outputs(logits, labels)


# ---- Griffin / RecurrentGemma: RG-LRU with a Python loop over time ------------------------


class BlockDiagonalLinear(nn.Module):
    """recurrentgemma's per-head gate: ``einsum("... h i, h i j -> ... h j")`` plus a bias."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(HEADS, width // HEADS, width // HEADS) * (width // HEADS) ** -0.5)
        self.b = nn.Parameter(torch.zeros(HEADS, width // HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (HEADS, -1))
        return (torch.einsum("... h i, h i j -> ... h j", x, self.w) + self.b).flatten(-2)


class RGLRU(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a_param = nn.Parameter(torch.linspace(0.5, 2.0, width))
        self.input_gate, self.a_gate = BlockDiagonalLinear(width), BlockDiagonalLinear(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_x, gate_a = torch.sigmoid(self.input_gate(x)), torch.sigmoid(self.a_gate(x))
        log_a = -8.0 * gate_a * F.softplus(self.a_param)
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        normalized_x = x * gate_x * torch.sqrt(1 - a_square)
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + normalized_x[:, t]
            ys.append(h)
        return torch.stack(ys, dim=1)


class RecurrentBlock(nn.Module):
    def __init__(self, width: int = DIM) -> None:
        super().__init__()
        self.linear_y, self.linear_x, self.linear_out = nn.Linear(DIM, width), nn.Linear(DIM, width), nn.Linear(width, DIM)
        self.conv_1d = nn.Conv1d(width, width, 4, groups=width, padding=3)
        self.rg_lru = RGLRU(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.linear_y(x), approximate="tanh")
        xb = self.conv_1d(self.linear_x(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.linear_out(self.rg_lru(xb) * y)


# ---- gated linear attention by cumsum (the parallel form, no chunks) ----------------------


class GatedLinearAttention(nn.Module):
    """fla's GLA: a low-rank per-key-dim forget gate ``logsigmoid(...) / 16``, its prefix sum
    scaling q by ``exp(G)`` and k by ``exp(-G)``, a causal ``(q k^T) v``, a swish output gate."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(5))
        self.gk_proj = nn.Sequential(nn.Linear(DIM, 16, bias=False), nn.Linear(16, DIM))
        self.g_norm = nn.RMSNorm(HEAD_DIM, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        g = torch.cumsum(heads(F.logsigmoid(self.gk_proj(x)) / 16), dim=2)
        scores = (q * HEAD_DIM**-0.5 * g.exp()) @ (k * (-g).exp()).transpose(-1, -2)
        o = scores.masked_fill(causal_mask(x.shape[1], x.device) < 0, 0.0) @ v
        return self.o_proj(merge(self.g_norm(o)) * F.silu(self.g_proj(x)))


# ---- Switch Transformer: top-1 routing, a capacity factor that drops tokens ---------------


class SwitchMoE(nn.Module):
    """Mesh-TensorFlow / HF Switch style: ``capacity = int(factor * tokens / experts)``, each
    token's place in its expert by ``cumsum``; overflowing tokens are dropped (pass through the
    residual); experts as an ``nn.ModuleList`` looped over with boolean masks."""

    EXPERTS, FACTOR = 4, 1.0

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)) for _ in range(self.EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        probs = self.router(x).softmax(-1)  # [B, S, E]
        expert_index = F.one_hot(probs.argmax(-1), self.EXPERTS)
        capacity = int(self.FACTOR * s / self.EXPERTS)
        position = torch.cumsum(expert_index, dim=-2)  # per sequence, as HF's SwitchTransformersTop1Router
        expert_index = expert_index * (position <= capacity)
        router_probs = probs.max(dim=-1, keepdim=True).values
        out = x.clone()
        for e, expert in enumerate(self.experts):
            token_mask = expert_index[..., e].bool()
            out[token_mask] = expert(x[token_mask]).to(out.dtype)
        return out * router_probs


# ---- MoE loops over the experts hit: a trip count known only at run time -------------------


class ExpertHitLoop(nn.Module):
    """HF's eager experts (DBRX, Mixtral before grouped GEMMs): 3-D expert weights, a
    ``one_hot`` with a spare class, ``for e in expert_hit`` over its nonzero rows (the spare
    class is never hit, and ``gate_up[e]`` would be out of range for it), ``index_add_``."""

    EXPERTS, TOP_K, HIDDEN = 4, 2, 2 * DIM

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.gate_up = nn.Parameter(torch.randn(self.EXPERTS, 2 * self.HIDDEN, DIM) * DIM**-0.5)
        self.down = nn.Parameter(torch.randn(self.EXPERTS, DIM, self.HIDDEN) * self.HIDDEN**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        weights, chosen = self.router(tokens).softmax(-1).topk(self.TOP_K, -1)
        out = torch.zeros_like(tokens)
        with torch.no_grad():
            mask = F.one_hot(chosen, num_classes=self.EXPERTS + 1).permute(2, 1, 0)  # [E + 1, K, T]
            expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert in expert_hit:
            e = expert[0]
            slot, rows = torch.where(mask[e])
            gate, up = F.linear(tokens[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        return out.view_as(x)


class ExpertHitSkipEmpty(ExpertHitLoop):
    """The same experts as written before grouped GEMMs (LongCat-Flash's, HF's older
    Mixtral): the expert's index as a Python int, and an expert without rows skipped by
    ``if rows.numel() == 0: continue``, a branch on a row count known only at run time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        weights, chosen = self.router(tokens).softmax(-1).topk(self.TOP_K, -1)
        out = torch.zeros_like(tokens)
        mask = F.one_hot(chosen, num_classes=self.EXPERTS).permute(2, 1, 0)
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False):
            e = int(expert.item())
            slot, rows = torch.where(mask[e])
            if rows.numel() == 0:
                continue
            gate, up = F.linear(tokens[rows], self.gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, rows, F.linear(F.silu(gate) * up, self.down[e]) * weights[rows, slot, None])
        return out.view_as(x)


class ReferenceExperts(nn.Module):
    """DeepSeek-V3's reference MoE (its inference code, which other releases copy): the
    experts' counts by ``bincount(...).tolist()``, ``for i in range(E): if counts[i] == 0:
    continue``, the combine by ``y[idx] += expert(x[idx]) * weights[idx, top, None]``, and a
    shared expert."""

    EXPERTS, TOP_K = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(self.EXPERTS))
        self.shared_experts = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, DIM)
        weights, indices = torch.topk(self.gate(x).softmax(dim=-1), self.TOP_K, dim=-1)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.EXPERTS).tolist()
        for i in range(self.EXPERTS):
            if counts[i] == 0:
                continue
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        return (y + self.shared_experts(x)).view(shape)


class ArgwhereExperts(nn.Module):
    """Experts as an ``nn.ModuleList`` picked by ``int(e)`` for ``e`` in the one-argument
    ``torch.where`` of the per-expert counts, combined by ``out[rows] += ...``."""

    EXPERTS, TOP_K = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, self.EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(self.EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        weights, chosen = self.router(tokens).softmax(-1).topk(self.TOP_K, -1)
        out = torch.zeros_like(tokens)
        counts = F.one_hot(chosen, self.EXPERTS).sum(dim=(0, 1))
        for e in torch.where(counts > 0)[0]:
            rows, slot = torch.where(chosen == e)
            out[rows] += weights[rows, slot, None] * self.experts[int(e)](tokens[rows])
        return out.view_as(x)


# ---- NSA-style top-k block-sparse attention: compressed block keys pick the blocks -------


class TopKBlockAttention(nn.Module):
    """Native-sparse-attention's selection branch: keys mean-pooled per block of ``BLOCK``
    positions score the blocks for each query; its ``TOPK`` best (causal) blocks are
    gathered (``topk`` + ``gather`` of block indices) and attended to, causally masked."""

    BLOCK, TOPK = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        n_blocks, blk = s // self.BLOCK, self.BLOCK
        k_cmp = k.view(b, HEADS, n_blocks, blk, HEAD_DIM).mean(3)  # [B, H, N, D]
        block_scores = q @ k_cmp.transpose(-1, -2)  # [B, H, S, N]
        pos = torch.arange(s, device=x.device)
        block_start = torch.arange(n_blocks, device=x.device) * blk
        block_scores = block_scores.masked_fill(block_start[None, :] > pos[:, None], float("-inf"))
        block_scores = block_scores.masked_fill((pos[:, None] // blk) == torch.arange(n_blocks, device=x.device), float("inf"))  # own block always
        chosen = block_scores.topk(self.TOPK, dim=-1).indices  # [B, H, S, K]
        idx = (chosen[..., None] * blk + torch.arange(blk, device=x.device)).flatten(-2)  # [B, H, S, K*blk]
        k_sel = torch.gather(k[:, :, None].expand(-1, -1, s, -1, -1), 3, idx[..., None].expand(-1, -1, -1, -1, HEAD_DIM))
        v_sel = torch.gather(v[:, :, None].expand(-1, -1, s, -1, -1), 3, idx[..., None].expand(-1, -1, -1, -1, HEAD_DIM))
        scores = torch.einsum("bhsd,bhskd->bhsk", q, k_sel) * HEAD_DIM**-0.5
        scores = scores.masked_fill(idx > pos[:, None], float("-inf"))
        return self.o_proj(merge(torch.einsum("bhsk,bhskd->bhsd", scores.softmax(-1), v_sel)))


# ---- minLoRA: LoRA as a torch.nn.utils.parametrize parametrization ------------------------


class LoRAParametrization(nn.Module):
    """minLoRA's ``LoRAParametrization``: ``weight + (B @ A) * scale`` computed in the forward."""

    def __init__(self, fan_in: int, fan_out: int, rank: int = 4, alpha: int = 8) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.randn(rank, fan_in) * fan_in**-0.5)
        self.lora_B = nn.Parameter(torch.randn(fan_out, rank) * 0.05)
        self.scale = alpha / rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + torch.matmul(self.lora_B, self.lora_A).view(weight.shape) * self.scale


def minlora_lm() -> nn.Module:
    model = DecoderLM(lambda: PreNormBlock(_SplitAttention(), SwiGLU()))
    for module in list(model.modules()):
        if isinstance(module, nn.Linear) and module is not model.output:
            out_f, in_f = module.weight.shape
            nn.utils.parametrize.register_parametrization(module, "weight", LoRAParametrization(in_f, out_f))
            module.parametrizations.weight.original.requires_grad_(False)
    return model


# ---- sliding windows by as_strided ---------------------------------------------------------


class StridedWindowAttention(UnfoldWindowAttention):
    """The unfold windows built by hand with ``as_strided`` on the padded keys and values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        w = self.WINDOW

        def windows(t: torch.Tensor) -> torch.Tensor:
            t = F.pad(t, (0, 0, w - 1, 0)).contiguous()
            b, h, s, d = t.shape
            return t.as_strided((b, h, s - w + 1, w, d), (h * s * d, s * d, d, d, 1))  # [B, H, S, W, D]

        scores = torch.einsum("bhsd,bhswd->bhsw", q, windows(k)) * HEAD_DIM**-0.5
        pos = torch.arange(x.shape[1], device=x.device)[:, None] - (w - 1) + torch.arange(w, device=x.device)
        scores = scores.masked_fill(pos < 0, float("-inf"))
        return self.proj(merge(torch.einsum("bhsw,bhswd->bhsd", scores.softmax(-1), windows(v))))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "hyena_fft_conv": lambda: DecoderLM(lambda: PreNormBlock(HyenaOperator())),
    "xlstm_mlstm": lambda: DecoderLM(lambda: PreNormBlock(MLSTMCell())),
    "ngpt_normalized": NGPT,
    "albert_shared_layer": Albert,
    "peft_lora": lora_lm,
    "spectral_norm_mlp": spectral_lm,
    "unfold_window_attention": lambda: DecoderLM(lambda: PreNormBlock(UnfoldWindowAttention())),
    "tome_vit": ToMeViT,
    "torch_nn_transformer": TorchTransformer,
    "griffin_rglru": lambda: DecoderLM(lambda: PreNormBlock(RecurrentBlock())),
    "gla_cumsum": lambda: DecoderLM(lambda: PreNormBlock(GatedLinearAttention())),
    "switch_capacity": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), SwitchMoE())),
    "topk_block_sparse": lambda: DecoderLM(lambda: PreNormBlock(TopKBlockAttention())),
    "minlora_parametrize": minlora_lm,
    "as_strided_windows": lambda: DecoderLM(lambda: PreNormBlock(StridedWindowAttention())),
    "expert_hit_loop": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ExpertHitLoop())),
    "argwhere_experts": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ArgwhereExperts())),
    "expert_hit_skip_empty": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ExpertHitSkipEmpty())),
    "reference_moe_counts": lambda: DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), ReferenceExperts())),
}
MOE = frozenset({"switch_capacity", "expert_hit_loop", "argwhere_experts", "expert_hit_skip_empty", "reference_moe_counts"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """Keyword inputs of model ``name``, the same on every call."""
    gen = torch.Generator().manual_seed(1)
    if name == "tome_vit":
        return {"pixel_values": torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    if name == "torch_nn_transformer":
        return {"input_ids": ids, "decoder_input_ids": labels[:, : seq - 4], "labels": labels[:, 4:]}
    return {"input_ids": ids, "labels": labels}
