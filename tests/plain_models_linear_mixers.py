"""Small plain-PyTorch linear-attention mixers with fused input projections (issue 27):
Gated DeltaNet and Mamba2 written the way their reference code writes them. One fused
projection carries q, k, v (and the output gate z) with different head counts; a causal
depthwise ``conv1d`` runs over the channels of q, k and v together; the result is split
again, viewed per head, L2-normalised, run through a recurrence, normed per head (or per
group of heads) with a gate, flattened back through ``[batch*time*heads, head_dim]`` and
projected out. Megatron's layout splits every segment of the fused projection, the conv's
channels and the per-head vectors by whole heads (key-head groups for the grouped
variant, norm groups for Mamba2) and makes the output projection row-parallel.
``build(name)`` makes one; the suite gives it ``input_ids`` and ``labels``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, DecoderLM, PreNormBlock, RMSNorm, SwiGLU
from plain_models_attention import VOCAB as VOCAB  # the suite's default inputs draw token ids below it

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, KERNEL = 4, 8, 8, 8, 4
GROUPS, STATE = 4, 8  # Mamba2: groups of heads sharing B and C, state size


def causal_conv(conv: nn.Conv1d, x: torch.Tensor, pad_left: bool) -> torch.Tensor:
    """Depthwise causal conv over time of channels-last ``x``: ``F.pad`` on the left, or the
    conv's own symmetric padding with the tail dropped (both are common)."""
    t = x.shape[1]
    x = x.transpose(1, 2)
    y = conv(F.pad(x, (conv.kernel_size[0] - 1, 0))) if pad_left else conv(x)[..., :t]
    return F.silu(y).transpose(1, 2)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule step by step: q, k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, decay
    ``g`` and write strength ``beta`` ``[B, T, H]``; returns ``[B, T, H, dv]``."""
    state = torch.zeros_like(k[:, 0, :, :, None] * v[:, 0, :, None, :])
    outs = []
    for i in range(q.shape[1]):
        state = state * g[:, i].exp()[..., None, None]
        remembered = (k[:, i, :, :, None] * state).sum(-2)
        delta = (v[:, i] - remembered) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append((q[:, i, :, :, None] * state).sum(-2))
    return torch.stack(outs, dim=1)


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of ``group`` channels, times ``silu(gate)`` (a gated norm)."""

    def __init__(self, dim: int, group: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        *prefix, last = x.shape
        grouped = x.view(*prefix, last // self.group, self.group)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(*prefix, last) * F.silu(gate)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet. ``grouped=False``: ``in_proj_qkv`` holds all q, then all k, then all v
    heads, ``in_proj_z`` the gate (Qwen3.5's layout). ``grouped=True``: one ``in_proj_qkvz``
    holds, per key head, its q, k, the values of its value heads and their gates
    (Qwen3-Next's layout), reordered by ``view``/``split`` into the conv's q|k|v order."""

    def __init__(self, grouped: bool) -> None:
        super().__init__()
        self.grouped = grouped
        self.key_dim, self.value_dim = KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM
        channels = 2 * self.key_dim + self.value_dim
        if grouped:
            self.in_proj_qkvz = nn.Linear(DIM, channels + self.value_dim, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(DIM, channels, bias=False)
            self.in_proj_z = nn.Linear(DIM, self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(DIM, 2 * VALUE_HEADS, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, KERNEL, groups=channels, padding=0 if not grouped else KERNEL - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.randn(VALUE_HEADS))
        self.A_log = nn.Parameter(torch.log(torch.empty(VALUE_HEADS).uniform_(1, 4)))
        self.norm = GatedRMSNorm(VALUE_DIM, VALUE_DIM)
        self.out_proj = nn.Linear(self.value_dim, DIM, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv's input (q|k|v channels) and the gate z ``[B, T, value heads, dv]``."""
        b, t, _ = x.shape
        if not self.grouped:
            return self.in_proj_qkv(x), self.in_proj_z(x).reshape(b, t, -1, VALUE_DIM)
        per_key = VALUE_HEADS // KEY_HEADS * VALUE_DIM
        fused = self.in_proj_qkvz(x).view(b, t, KEY_HEADS, 2 * KEY_DIM + 2 * per_key)
        q, k, v, z = torch.split(fused, [KEY_DIM, KEY_DIM, per_key, per_key], dim=3)
        mixed = torch.cat([t_.reshape(b, t, -1) for t_ in (q, k, v)], dim=-1)
        return mixed, z.reshape(b, t, -1, VALUE_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        mixed, z = self.project(x)
        mixed = causal_conv(self.conv1d, mixed, pad_left=not self.grouped)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (F.normalize(y.reshape(b, t, -1, KEY_DIM), p=2, dim=-1) for y in (q, k))
        q, k = (y.repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=2) for y in (q, k))
        v = v.reshape(b, t, -1, VALUE_DIM)
        beta, a = self.in_proj_ba(x).chunk(2, dim=-1)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        out = gated_delta_rule(q * KEY_DIM**-0.5, k, v, g, beta.sigmoid())
        out = self.norm(out.reshape(-1, VALUE_DIM), z.reshape(-1, VALUE_DIM))
        return self.out_proj(out.reshape(b, t, -1))


class Mamba2Mixer(nn.Module):
    """Mamba2: one ``in_proj`` holds the gate z, the conv's x|B|C channels and dt per head;
    B and C are shared by groups of heads (``repeat_interleave``); the gated norm runs per
    group of heads over the flattened heads."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.head_dim = VALUE_HEADS, VALUE_DIM
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * GROUPS * STATE
        self.in_proj = nn.Linear(DIM, self.inner + self.conv_dim + self.heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, KERNEL, groups=self.conv_dim, padding=KERNEL - 1)
        self.dt_bias = nn.Parameter(torch.randn(self.heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.heads).uniform_(1, 4)))
        self.D = nn.Parameter(torch.randn(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // GROUPS)
        self.out_proj = nn.Linear(self.inner, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        z, xbc, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = causal_conv(self.conv1d, xbc, pad_left=False)
        xs, bs, cs = torch.split(xbc, [self.inner, GROUPS * STATE, GROUPS * STATE], dim=-1)
        xs = xs.view(b, t, self.heads, self.head_dim)
        bs, cs = (y.view(b, t, GROUPS, STATE).repeat_interleave(self.heads // GROUPS, dim=2) for y in (bs, cs))
        dt = F.softplus(dt + self.dt_bias)
        decay = (dt * -self.A_log.exp()).exp()
        state = torch.zeros_like(xs[:, 0, :, :, None] * bs[:, 0, :, None, :])
        ys = []
        for i in range(t):
            write = (dt[:, i, :, None] * xs[:, i])[..., None] * bs[:, i, :, None, :]
            state = state * decay[:, i, :, None, None] + write
            ys.append((state * cs[:, i, :, None, :]).sum(-1))
        y = torch.stack(ys, dim=1) + self.D[:, None] * xs
        return self.out_proj(self.norm(y.reshape(b, t, self.inner), z))


def _lm(mixer: Callable[[], nn.Module]) -> nn.Module:
    return DecoderLM(lambda: PreNormBlock(mixer(), SwiGLU(), norm=RMSNorm), norm=RMSNorm)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gated_delta_fused_qkv": lambda: _lm(lambda: GatedDeltaNet(grouped=False)),
    "gated_delta_grouped_qkvz": lambda: _lm(lambda: GatedDeltaNet(grouped=True)),
    "mamba2_grouped_norm": lambda: _lm(Mamba2Mixer),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()
