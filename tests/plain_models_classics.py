"""Small plain-PyTorch models after the efficient-transformer classics and other families the
earlier rounds did not write (issue 27, twelfth round).

Attention approximations: Informer's ProbSparse attention (keys sampled by ``randint``, the
top queries of a sparsity measure picked per head by advanced indexing with ``arange`` over the
batch and the heads, their outputs written into a cumulative mean by ``index_put``); Reformer's
LSH attention (buckets from random rotations, tokens sorted by bucket per head, attention in
chunks with a look-back, unsorted by the inverse permutation); Performer's FAVOR+ (positive
random features, causal prefix sums); Based's Taylor feature map (``1, x, x ⊗ x`` flattened);
the dense and random Synthesizer (attention weights from an MLP and from a learned table);
Infini-attention (a compressive memory carried across segments, gated per head). Mixers:
gMLP's spatial gating unit (a causal ``Conv1d`` whose channels are the positions); KAN layers
(B-spline bases by Cox-de Boor over a grid buffer, efficient-kan's layout). Other domains: the
Decision Transformer (return, state and action tokens interleaved by ``stack`` and
``reshape``); MaxViT (MBConv with squeeze-excitation, block and grid attention by
``view``/``permute``).

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

from plain_models_attention import DIM, HEADS, HEAD_DIM, LAYERS, VOCAB, DecoderLM, NanoGPTAttention, PreNormBlock, SwiGLU
from plain_models_frontier import decoder_of, merge_heads, split_heads
from plain_models_idioms import FusedHeads

SEQ = 16


# ---- Informer: ProbSparse self-attention ------------------------------------------------------


class ProbSparseAttention(FusedHeads):
    """The top ``u`` queries of each head by ``max - mean`` of their scores against sampled keys
    attend fully; the others take the causal running mean of the values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        B, H, L, D = q.shape
        sample, u = 4, 4
        index_sample = torch.randint(L, (L, sample), device=x.device)
        k_sample = k[:, :, index_sample, :]  # [B, H, L, sample, D]
        qk_sample = (q.unsqueeze(-2) @ k_sample.transpose(-2, -1)).squeeze(-2)
        measure = qk_sample.max(-1)[0] - qk_sample.sum(-1) / L
        top = measure.topk(u, sorted=False)[1]  # [B, H, u]
        b_idx, h_idx = torch.arange(B)[:, None, None], torch.arange(H)[None, :, None]
        scores = q[b_idx, h_idx, top, :] @ k.transpose(-2, -1) / math.sqrt(D)
        future = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future[top], float("-inf"))
        context = v.cumsum(dim=-2) / torch.arange(1, L + 1, device=x.device, dtype=v.dtype)[:, None]
        context[b_idx, h_idx, top, :] = scores.softmax(-1) @ v
        return self.o(merge_heads(context))


# ---- Reformer: LSH attention -------------------------------------------------------------------

BUCKETS, CHUNK = 4, 4


class LSHAttention(nn.Module):
    """Shared query/key projection; tokens hashed by random rotations, sorted by (bucket,
    position) per head, attended in chunks with one chunk of look-back, and put back in order."""

    def __init__(self) -> None:
        super().__init__()
        self.qk, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.register_buffer("rotations", torch.randn(HEAD_DIM, BUCKETS // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qk, v = split_heads(self.qk(x)), split_heads(self.v(x))
        B, H, L, D = qk.shape
        rotated = F.normalize(qk, dim=-1) @ self.rotations
        buckets = torch.cat([rotated, -rotated], dim=-1).argmax(-1)  # [B, H, L]
        positions = torch.arange(L, device=x.device).expand(B, H, L)
        order = (buckets * L + positions).argsort(dim=-1)
        undo = order.argsort(dim=-1)

        def sort(t: torch.Tensor) -> torch.Tensor:
            return t.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])).view(B, H, L // CHUNK, CHUNK, t.shape[-1])

        sq, sv = sort(qk), sort(v)
        sk = F.normalize(sq, dim=-1)
        spos = positions.gather(2, order).view(B, H, L // CHUNK, CHUNK)
        keys, values = (torch.cat([t, t.roll(1, dims=2)], dim=3) for t in (sk, sv))
        kpos = torch.cat([spos, spos.roll(1, dims=2)], dim=3)
        dots = sq @ keys.transpose(-1, -2) / math.sqrt(D)
        dots = dots.masked_fill(spos.unsqueeze(-1) < kpos.unsqueeze(-2), -1e9)
        dots = dots.masked_fill(spos.unsqueeze(-1) == kpos.unsqueeze(-2), -1e5)  # a token attends to itself last
        out = (dots.softmax(-1) @ values).reshape(B, H, L, D)
        out = out.gather(2, undo.unsqueeze(-1).expand(-1, -1, -1, D))
        return self.o(merge_heads(out))


# ---- Performer: FAVOR+ -------------------------------------------------------------------------

FEATURES = 16


class PerformerAttention(FusedHeads):
    """Positive orthogonal random features of queries and keys (a stabilizer subtracted before
    ``exp``, over the features for queries and over positions and features for keys), and
    causal linear attention by prefix sums."""

    def __init__(self) -> None:
        super().__init__()
        blocks = [torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM))[0].T for _ in range(FEATURES // HEAD_DIM)]
        self.register_buffer("projection", torch.cat(blocks) * math.sqrt(HEAD_DIM), persistent=False)

    def features(self, t: torch.Tensor, is_query: bool) -> torch.Tensor:
        t = t * t.shape[-1] ** -0.25
        dash = torch.einsum("bhsd,md->bhsm", t, self.projection)
        diag = (t**2).sum(-1, keepdim=True) / 2
        stabilizer = dash.amax(-1, keepdim=True) if is_query else dash.amax(dim=(-1, -2), keepdim=True)
        return (torch.exp(dash - diag - stabilizer.detach()) + 1e-4) / math.sqrt(FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        q, k = self.features(q, True), self.features(k, False)
        kv = torch.einsum("bhsm,bhsd->bhsmd", k, v).cumsum(2)
        num = torch.einsum("bhsm,bhsmd->bhsd", q, kv)
        den = torch.einsum("bhsm,bhsm->bhs", q, k.cumsum(2))
        return self.o(merge_heads(num / den.unsqueeze(-1)))


# ---- Based: Taylor-expansion linear attention ---------------------------------------------------

TAYLOR_DIM = 4


class TaylorLinearAttention(nn.Module):
    """Queries and keys projected to a small feature dim per head, mapped to ``[1, x, x ⊗ x / √2]``
    (the second-order Taylor expansion of ``exp``), then causal linear attention."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(DIM, HEADS * TAYLOR_DIM, bias=False), nn.Linear(DIM, HEADS * TAYLOR_DIM, bias=False)
        self.v, self.o = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    @staticmethod
    def taylor(t: torch.Tensor) -> torch.Tensor:
        t = t / TAYLOR_DIM**0.5
        outer = (t.unsqueeze(-1) * t.unsqueeze(-2)).flatten(start_dim=-2) / math.sqrt(2)
        return torch.cat([torch.ones_like(t[..., :1]), t, outer], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k = (p(x).view(B, S, HEADS, TAYLOR_DIM).transpose(1, 2) for p in (self.q, self.k))
        q, k, v = self.taylor(q), self.taylor(k), split_heads(self.v(x))
        kv = (k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(2)  # [B, H, S, F, D]
        num = (q.unsqueeze(-1) * kv).sum(-2)
        den = (q * k.cumsum(2)).sum(-1, keepdim=True)
        return self.o(merge_heads(num / (den + 1e-6)))


# ---- Synthesizer ---------------------------------------------------------------------------------


class SynthesizerAttention(nn.Module):
    """Dense synthesizer (each token's attention row from a two-layer MLP over the positions)
    mixed with a random synthesizer (a learned [heads, L, L] table), causal."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, DIM), nn.Linear(DIM, HEADS * SEQ)
        self.random = nn.Parameter(torch.randn(HEADS, SEQ, SEQ) * 0.1)
        self.v, self.o = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        dense = self.w2(F.relu(self.w1(x))).view(B, L, HEADS, SEQ)[..., :L].transpose(1, 2)
        logits = dense + self.random[:, :L, :L]
        logits = logits.masked_fill(torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.o(merge_heads(logits.softmax(-1) @ split_heads(self.v(x))))


# ---- Infini-attention ------------------------------------------------------------------------------

SEGMENT = 8


class InfiniAttention(FusedHeads):
    """Segments attended locally; each also reads a compressive memory of the earlier segments
    (``σ(q) M / σ(q) z``, ``σ = elu + 1``), mixed by a learned gate per head; the memory takes
    the delta rule update."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.linspace(-1, 1, HEADS).view(HEADS, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        B, H, _, D = q.shape
        memory, norm = q.new_zeros(B, H, D, D), q.new_zeros(B, H, D, 1)
        outs = []
        for qs, ks, vs in zip(*(t.split(SEGMENT, dim=2) for t in (q, k, v))):
            sq, sk = F.elu(qs) + 1, F.elu(ks) + 1
            from_memory = (sq @ memory) / (sq @ norm + 1e-6)
            local = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            gate = torch.sigmoid(self.beta)
            outs.append(gate * from_memory + (1 - gate) * local)
            memory = memory + sk.transpose(-2, -1) @ (vs - (sk @ memory) / (sk @ norm + 1e-6))
            norm = norm + sk.sum(dim=-2, keepdim=True).transpose(-2, -1)
        return self.o(merge_heads(torch.cat(outs, dim=2)))


# ---- gMLP: spatial gating unit ----------------------------------------------------------------------

GMLP_HIDDEN = 4 * DIM


class SpatialGatingUnit(nn.Module):
    """Half of the channels normed and mixed over the positions by a causal ``Conv1d`` whose
    channels are the positions (gmlp-pytorch), then gating the other half."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(GMLP_HIDDEN // 2)
        self.proj = nn.Conv1d(SEQ, SEQ, 1)
        nn.init.uniform_(self.proj.weight, -0.1, 0.1)
        nn.init.constant_(self.proj.bias, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        u, v = x.chunk(2, dim=-1)
        weight, bias = self.proj.weight[:L, :L], self.proj.bias[:L]
        weight = weight.masked_fill(torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)[..., None], 0.0)
        return u * F.conv1d(self.norm(v), weight, bias)


class GMLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj_in, self.proj_out = nn.Linear(DIM, GMLP_HIDDEN), nn.Linear(GMLP_HIDDEN // 2, DIM)
        self.sgu = SpatialGatingUnit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj_out(self.sgu(F.gelu(self.proj_in(self.norm(x)))))


# ---- KAN layers (efficient-kan) ----------------------------------------------------------------------

GRID, ORDER = 5, 3


class KANLinear(nn.Module):
    """``silu(x) @ base_weight.T`` plus B-spline bases of ``x`` (Cox-de Boor over a grid buffer
    [in, GRID + 2 ORDER + 1]) against ``spline_weight`` [out, in, GRID + ORDER] scaled per edge."""

    def __init__(self, inp: int, out: int) -> None:
        super().__init__()
        h = 2 / GRID
        grid = torch.arange(-ORDER, GRID + ORDER + 1) * h - 1
        self.register_buffer("grid", grid.expand(inp, -1).contiguous())
        self.base_weight = nn.Parameter(torch.randn(out, inp) / math.sqrt(inp))
        self.spline_weight = nn.Parameter(torch.randn(out, inp, GRID + ORDER) * 0.1)
        self.spline_scaler = nn.Parameter(torch.ones(out, inp) + 0.1 * torch.randn(out, inp))

    def b_splines(self, x: torch.Tensor) -> torch.Tensor:
        grid, x = self.grid, x.unsqueeze(-1)
        bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).to(x.dtype)
        for k in range(1, ORDER + 1):
            left = (x - grid[:, : -(k + 1)]) / (grid[:, k:-1] - grid[:, : -(k + 1)]) * bases[:, :, :-1]
            right = (grid[:, k + 1 :] - x) / (grid[:, k + 1 :] - grid[:, 1:(-k)]) * bases[:, :, 1:]
            bases = left + right
        return bases

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        base = F.linear(F.silu(x), self.base_weight)
        scaled = self.spline_weight * self.spline_scaler.unsqueeze(-1)
        spline = F.linear(self.b_splines(x).view(x.size(0), -1), scaled.view(scaled.size(0), -1))
        return (base + spline).reshape(*shape[:-1], -1)


class KANFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = KANLinear(DIM, 2 * DIM), KANLinear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


# ---- Decision Transformer ------------------------------------------------------------------------------

STATE, ACTIONS, MAX_EP_LEN, STEPS = 6, 5, 64, 8


class DecisionTransformer(nn.Module):
    """Returns-to-go, states and actions embedded, interleaved as (R, s, a) tokens with a
    timestep embedding each, a causal GPT over the 3T tokens, actions predicted from the state
    tokens' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_timestep = nn.Embedding(MAX_EP_LEN, DIM)
        self.embed_return, self.embed_state = nn.Linear(1, DIM), nn.Linear(STATE, DIM)
        self.embed_action = nn.Embedding(ACTIONS, DIM)
        self.embed_ln = nn.LayerNorm(DIM)
        self.layers = nn.ModuleList(PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.predict_action = nn.Linear(DIM, ACTIONS)

    def forward(self, returns_to_go: torch.Tensor, states: torch.Tensor, actions: torch.Tensor, timesteps: torch.Tensor) -> dict[str, Any]:
        B, T = actions.shape
        time = self.embed_timestep(timesteps)
        tokens = (self.embed_return(returns_to_go) + time, self.embed_state(states) + time, self.embed_action(actions) + time)
        h = self.embed_ln(torch.stack(tokens, dim=1).permute(0, 2, 1, 3).reshape(B, 3 * T, DIM))
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h).reshape(B, T, 3, DIM).permute(0, 2, 1, 3)
        logits = self.predict_action(h[:, 1])
        return {"logits": logits, "loss": F.cross_entropy(logits.reshape(-1, ACTIONS), actions.reshape(-1))}


# ---- MaxViT -------------------------------------------------------------------------------------------

IMAGE, PATCH, WINDOW, CLASSES = 16, 2, 2, 10
SIDE = IMAGE // PATCH


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, channels // 4, 1), nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True)))))


class MBConv(nn.Module):
    """Inverted bottleneck: 1x1 expand, depthwise 3x3, squeeze-excitation, 1x1 project."""

    def __init__(self) -> None:
        super().__init__()
        hidden = 4 * DIM
        self.norm = nn.BatchNorm2d(DIM)
        self.expand = nn.Conv2d(DIM, hidden, 1)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        self.se = SqueezeExcite(hidden)
        self.project = nn.Conv2d(hidden, DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(F.gelu(self.depthwise(F.gelu(self.expand(self.norm(x)))))))


def block_partition(x: torch.Tensor) -> torch.Tensor:
    """[B, H, W, C] -> [B * windows, WINDOW², C]: non-overlapping local windows."""
    B, H, W, C = x.shape
    return x.view(B, H // WINDOW, WINDOW, W // WINDOW, WINDOW, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, WINDOW * WINDOW, C)


def block_merge(x: torch.Tensor, B: int) -> torch.Tensor:
    n = SIDE // WINDOW
    return x.view(B, n, n, WINDOW, WINDOW, -1).permute(0, 1, 3, 2, 4, 5).reshape(B, SIDE, SIDE, -1)


def grid_partition(x: torch.Tensor) -> torch.Tensor:
    """[B, H, W, C] -> [B * cells, WINDOW², C]: a sparse grid of tokens ``SIDE / WINDOW`` apart."""
    B, H, W, C = x.shape
    return x.view(B, WINDOW, H // WINDOW, WINDOW, W // WINDOW, C).permute(0, 2, 4, 1, 3, 5).reshape(-1, WINDOW * WINDOW, C)


def grid_merge(x: torch.Tensor, B: int) -> torch.Tensor:
    n = SIDE // WINDOW
    return x.view(B, n, n, WINDOW, WINDOW, -1).permute(0, 3, 1, 4, 2, 5).reshape(B, SIDE, SIDE, -1)


class PartitionAttention(nn.Module):
    """Pre-norm multi-head attention within partitions, with a learned relative position bias
    per head indexed by a buffer of relative offsets."""

    def __init__(self, partition: Callable[[torch.Tensor], torch.Tensor], merge: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        super().__init__()
        self.partition, self.merge = partition, merge
        self.norm = nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.bias_table = nn.Parameter(torch.randn((2 * WINDOW - 1) ** 2, HEADS) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(WINDOW), torch.arange(WINDOW), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + WINDOW - 1
        self.register_buffer("rel_index", rel[..., 0] * (2 * WINDOW - 1) + rel[..., 1], persistent=False)
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, W, C]
        B = x.shape[0]
        windows = self.partition(self.norm(x))
        N = windows.shape[1]
        q, k, v = self.qkv(windows).view(-1, N, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.bias_table[self.rel_index.view(-1)].view(N, N, HEADS).permute(2, 0, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        x = x + self.merge(self.proj(out.transpose(1, 2).reshape(-1, N, DIM)), B)
        return x + self.mlp(x)


class MaxViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"conv": MBConv(), "block": PartitionAttention(block_partition, block_merge), "grid": PartitionAttention(grid_partition, grid_merge)})
            for _ in range(LAYERS)
        )
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.stem(pixels)
        for blk in self.blocks:
            x = blk["conv"](x).permute(0, 2, 3, 1)
            x = blk["grid"](blk["block"](x)).permute(0, 3, 1, 2)
        logits = self.head(self.norm(x.mean((2, 3))))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- xLSTM: sLSTM with per-head recurrence -----------------------------------------------------------


class SLSTMMixer(nn.Module):
    """sLSTM: input and forget gates exponential with a stabilizer state, a block-diagonal
    recurrent weight per head (``einsum("bhd,hdg->bhg", h, R)``), a loop over time; the heads'
    outputs through a group norm per head and an up/down projection."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(DIM, 4 * DIM)
        self.r = nn.Parameter(torch.randn(HEADS, HEAD_DIM, 4 * HEAD_DIM) / math.sqrt(HEAD_DIM))
        self.norm = nn.GroupNorm(HEADS, DIM)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        wx = self.w(x).view(B, S, HEADS, 4 * HEAD_DIM)
        h = c = n = m = x.new_zeros(B, HEADS, HEAD_DIM)
        outs = []
        for t in range(S):
            raw = wx[:, t] + torch.einsum("bhd,hdg->bhg", h, self.r)
            i_raw, f_raw, z_raw, o_raw = raw.chunk(4, dim=-1)
            log_f = F.logsigmoid(f_raw)
            m_new = torch.maximum(log_f + m, i_raw)
            i, f = torch.exp(i_raw - m_new), torch.exp(log_f + m - m_new)
            c = f * c + i * torch.tanh(z_raw)
            n = f * n + i
            h = torch.sigmoid(o_raw) * c / n
            m = m_new
            outs.append(h)
        y = torch.stack(outs, dim=1).reshape(B * S, DIM)
        return self.out(self.norm(y).view(B, S, DIM))


# ---- ConvNeXt V2: global response normalization ------------------------------------------------------


CONVNEXT_WIDTH = 2 * DIM  # at DIM the depthwise kernels (49 per channel) would be a tenth of a block, not its ~1%


class GRNBlock(nn.Module):
    """ConvNeXt V2 block: depthwise 7x7, channels-last LayerNorm, pointwise MLP with global
    response normalization (the spatial L2 norm of each channel over its mean across channels)."""

    def __init__(self) -> None:
        super().__init__()
        c = CONVNEXT_WIDTH
        self.dwconv = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pwconv1, self.pwconv2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma, self.beta = nn.Parameter(torch.full((4 * c,), 0.1)), nn.Parameter(torch.full((4 * c,), 0.05))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.pwconv1(self.norm(self.dwconv(x).permute(0, 2, 3, 1))))
        gx = torch.norm(h, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        h = self.gamma * (h * nx) + self.beta + h
        return x + self.pwconv2(h).permute(0, 3, 1, 2)


class ConvNeXtV2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, CONVNEXT_WIDTH, PATCH, stride=PATCH)
        self.blocks = nn.Sequential(*(GRNBlock() for _ in range(LAYERS)))
        self.norm, self.head = nn.LayerNorm(CONVNEXT_WIDTH), nn.Linear(CONVNEXT_WIDTH, CLASSES)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.head(self.norm(self.blocks(self.stem(pixels)).mean((2, 3))))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


# ---- ELECTRA: generator samples, discriminator detects -----------------------------------------------

MASK_ID = VOCAB - 1


class Electra(nn.Module):
    """A small generator fills masked positions by Gumbel-max sampling over its vocabulary
    logits; the discriminator (sharing the token embedding) tells replaced tokens from
    originals. Loss: the generator's masked LM loss plus 50 times the detection loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.generator = nn.ModuleList(PreNormBlock(NanoGPTAttention()) for _ in range(1))
        self.gen_head = nn.Linear(DIM, VOCAB)
        self.discriminator = nn.ModuleList(PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS))
        self.disc_head = nn.Linear(DIM, 1)

    def forward(self, input_ids: torch.Tensor, masked: torch.Tensor) -> dict[str, Any]:
        h = self.embed(input_ids.masked_fill(masked, MASK_ID))
        for layer in self.generator:
            h = layer(h)
        gen_logits = self.gen_head(h)
        gen_loss = F.cross_entropy(gen_logits[masked], input_ids[masked])
        gumbel = -torch.log(-torch.log(torch.rand_like(gen_logits).clamp(1e-9, 1)))
        sampled = (gen_logits.detach() + gumbel).argmax(-1)
        corrupted = torch.where(masked, sampled, input_ids)
        d = self.embed(corrupted)
        for layer in self.discriminator:
            d = layer(d)
        replaced = (corrupted != input_ids).float()
        disc_loss = F.binary_cross_entropy_with_logits(self.disc_head(d).squeeze(-1), replaced)
        return {"loss": gen_loss + 50 * disc_loss}


# ---- SPLADE: sparse lexical representations over the vocabulary ---------------------------------------


class Splade(nn.Module):
    """A masked-LM encoder whose vocabulary logits become ``log(1 + relu(.))`` max-pooled over
    the tokens: a [B, V] representation per text; a query and a document scored by their dot
    product, trained with a binary relevance loss and a FLOPS regularizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(PreNormBlock(NanoGPTAttention()) for _ in range(LAYERS))
        self.norm, self.mlm = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def represent(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return torch.log1p(F.relu(self.mlm(self.norm(h)))).amax(dim=1)

    def forward(self, query_ids: torch.Tensor, doc_ids: torch.Tensor, relevant: torch.Tensor) -> dict[str, Any]:
        q, d = self.represent(query_ids), self.represent(doc_ids)
        score = (q * d).sum(-1)
        flops = (q.abs().mean(0) ** 2).sum() + (d.abs().mean(0) ** 2).sum()
        return {"loss": F.binary_cross_entropy_with_logits(score, relevant) + 1e-3 * flops}


# ---- FLASH: gated attention unit --------------------------------------------------------------------------

GAU_QK, GAU_EXPAND = 32, 2 * DIM


class GatedAttentionUnit(nn.Module):
    """One-head attention with a small shared query/key base (per-dim scales and offsets give q
    and k), squared-ReLU scores, and the value path expanded and gated: ``u * (A @ v)``."""

    def __init__(self) -> None:
        super().__init__()
        self.uv = nn.Linear(DIM, 2 * GAU_EXPAND)
        self.base = nn.Linear(DIM, GAU_QK)
        self.gamma, self.beta = nn.Parameter(torch.randn(2, GAU_QK) * 0.1 + 1), nn.Parameter(torch.zeros(2, GAU_QK))
        self.out = nn.Linear(GAU_EXPAND, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        u, v = F.silu(self.uv(x)).chunk(2, dim=-1)
        qk = F.silu(self.base(x)).unsqueeze(2) * self.gamma + self.beta  # [B, L, 2, QK]
        q, k = qk.unbind(2)
        a = F.relu(q @ k.transpose(-1, -2) / L) ** 2
        a = a.masked_fill(torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1), 0.0)
        return self.out(u * (a @ v))


class GAUBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.gau1, self.gau2 = GatedAttentionUnit(), GatedAttentionUnit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.gau1(self.norm1(x))
        return x + self.gau2(self.norm2(x))


class GAULM(DecoderLM):
    def __init__(self) -> None:
        super().__init__(lambda: GAUBlock())


# ---- CaiT: class attention -------------------------------------------------------------------------------


class ClassAttention(nn.Module):
    """Only the class token queries; keys and values over every token; its output replaces the
    class token, the patch tokens pass unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.proj = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.gamma1, self.gamma2 = nn.Parameter(torch.full((DIM,), 0.1)), nn.Parameter(torch.full((DIM,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        h = self.norm(x)
        q = self.q(h[:, 0]).reshape(B, 1, HEADS, HEAD_DIM).permute(0, 2, 1, 3)
        k, v = self.kv(h).reshape(B, N, 2, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        attn = (q * HEAD_DIM**-0.5 @ k.transpose(-2, -1)).softmax(-1)
        cls = x[:, :1] + self.gamma1 * self.proj((attn @ v).transpose(1, 2).reshape(B, 1, C))
        cls = cls + self.gamma2 * self.mlp(cls)
        return torch.cat([cls, x[:, 1:]], dim=1)


class CaiT(nn.Module):
    """Self-attention layers over the patches, then class-attention layers with the class token
    appended."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, DIM, PATCH, stride=PATCH)
        self.pos = nn.Parameter(torch.randn(1, SIDE * SIDE, DIM) * 0.02)
        self.cls = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.blocks = nn.ModuleList(PreNormBlock(BidirectionalAttention(), NanoGPTMLPLike()) for _ in range(LAYERS))
        self.class_blocks = nn.ModuleList(ClassAttention() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.patch(pixels).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            x = blk(x)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        for blk in self.class_blocks:
            x = blk(x)
        logits = self.head(self.norm(x)[:, 0])
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class BidirectionalAttention(FusedHeads):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(merge_heads(F.scaled_dot_product_attention(*self.heads(x))))


class NanoGPTMLPLike(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))


# ---- sigmoid attention ---------------------------------------------------------------------------------------


class SigmoidAttention(FusedHeads):
    """Attention weights ``sigmoid(q k^T / sqrt(d) - log(L))`` instead of a softmax (no row
    normalization), causal by a mask of zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        L = q.shape[2]
        w = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) - math.log(L))
        w = w * torch.ones(L, L, device=x.device).tril()
        return self.o(merge_heads(w @ v))



# ---- Switch MoE whose load-balancing loss is carried through the layers ---------------------------------

EXPERTS = 4


class SwitchFFN(nn.Module):
    """Top-1 routing over SwiGLU experts in a loop, returning the output and Switch's
    load-balancing loss ``E * sum_e f_e * P_e`` (the fraction of tokens sent to expert e times
    its mean router probability)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, DIM)
        probs = self.router(flat).softmax(-1)
        gate, choice = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = (choice == e).unsqueeze(-1)
            out = out + torch.where(hit, gate.unsqueeze(-1) * expert(flat), 0.0)
        fraction = F.one_hot(choice, EXPERTS).float().mean(0)
        return out.view_as(x), EXPERTS * (fraction * probs.mean(0)).sum()


class SwitchBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention, self.moe = NanoGPTAttention(), SwitchFFN()

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.norm1(x))
        y, balance = self.moe(self.norm2(x))
        return x + y, aux + balance


class SwitchLM(DecoderLM):
    """The blocks pass ``(hidden, aux)`` on; the loss is the LM loss plus 0.01 of the summed
    balancing losses (crossing the pipeline stages as a scalar)."""

    def __init__(self) -> None:
        super().__init__(SwitchBlock)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        h, aux = self.embed(input_ids), torch.zeros(())
        for layer in self.layers:
            h, aux = layer(h, aux)
        logits = self.logits(h)
        return {"logits": logits, "loss": F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + 0.01 * aux}



# ---- a loss over the tokens a mask selects -------------------------------------------------------------


class MaskedSelectLossLM(DecoderLM):
    """The token losses of the positions a ``loss_mask`` keeps, taken by ``masked_select`` (a
    size known only at run time) and averaged: rows that keep different counts weigh by tokens."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(NanoGPTAttention()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, Any]:
        logits = self.logits(self.hidden(input_ids))
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return {"logits": logits, "loss": per_token.masked_select(loss_mask.flatten()).mean()}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "informer_probsparse": decoder_of(ProbSparseAttention),
    "reformer_lsh": decoder_of(LSHAttention),
    "performer_favor": decoder_of(PerformerAttention),
    "based_taylor": decoder_of(TaylorLinearAttention),
    "synthesizer": decoder_of(SynthesizerAttention),
    "infini_attention": decoder_of(InfiniAttention),
    "gmlp_spatial_gating": lambda: DecoderLM(GMLPBlock),
    "kan_ffn": decoder_of(NanoGPTAttention, KANFFN),
    "decision_transformer": DecisionTransformer,
    "maxvit": MaxViT,
    "xlstm_slstm": decoder_of(SLSTMMixer),
    "convnext_v2_grn": ConvNeXtV2,
    "electra_replaced_tokens": Electra,
    "splade_sparse_vocab": Splade,
    "flash_gated_attention_unit": GAULM,
    "cait_class_attention": CaiT,
    "sigmoid_attention": decoder_of(SigmoidAttention),
    "switch_aux_through_layers": SwitchLM,
    "masked_select_loss": MaskedSelectLossLM,
}
MOE = frozenset({"switch_aux_through_layers"})


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "decision_transformer":
        return {
            "returns_to_go": torch.randn(batch, STEPS, 1, generator=gen),
            "states": torch.randn(batch, STEPS, STATE, generator=gen),
            "actions": torch.randint(0, ACTIONS, (batch, STEPS), generator=gen),
            "timesteps": torch.arange(STEPS).expand(batch, -1) + torch.randint(0, MAX_EP_LEN - STEPS, (batch, 1), generator=gen),
        }
    if name == "electra_replaced_tokens":
        ids = torch.randint(0, VOCAB - 1, (batch, seq), generator=gen)
        return {"input_ids": ids, "masked": torch.rand(batch, seq, generator=gen) < 0.3}
    if name == "splade_sparse_vocab":
        return {"query_ids": torch.randint(0, VOCAB, (batch, 6), generator=gen), "doc_ids": torch.randint(0, VOCAB, (batch, seq), generator=gen),
                "relevant": torch.tensor([1.0, 0.0] * (batch // 2))}
    if name in ("maxvit", "convnext_v2_grn", "cait_class_attention"):
        return {"pixels": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    if name == "masked_select_loss":  # the first row keeps 5 positions, the others all of theirs
        return {"input_ids": ids, "labels": labels, "loss_mask": torch.arange(seq).expand(batch, -1) < torch.tensor([5] + [seq] * (batch - 1))[:, None]}
    return {"input_ids": ids, "labels": labels}
