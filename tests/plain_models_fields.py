"""Small plain-PyTorch models from fields the earlier rounds did not write (issue 27, fourteenth
round), after the code of fairseq, timm, StyleGAN2, the neural-operator and flow libraries.

Sequence layers: fairseq's MultiheadAttention (one packed ``in_proj_weight`` sliced by rows per
projection, time-first ``bmm`` over ``batch * heads``), its LightweightConv (a softmax-normalized
kernel per head over channels grouped by ``view(-1, H, T)``) and DynamicConv (a kernel per
position from a linear, windows by ``as_strided`` on a padded tensor). Vision: XCiT's
cross-covariance attention (attention between channels, a per-head temperature, a depthwise
local patch interaction), VOLO's outlook attention (``unfold``/``fold`` around a linear of
``heads * k^4`` outputs), ConViT's gated positional self-attention, LeViT's attention bias
table indexed by a buffer behind a linear and a ``BatchNorm1d``. Spectral mixers: GFNet's
global filter (``rfft2`` times ``view_as_complex`` of a parameter), AFNO's block-diagonal MLP
in the Fourier domain, FNO's spectral convolution with complex parameters written into a zero
spectrum, and complex-valued layers (``nn.Linear(dtype=torch.cfloat)``, modReLU by
``torch.polar``) over a spectrum that crosses the layers. Models of other fields are in ``plain_models_generative.py``.

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

from plain_models_attention import DIM, HEADS, LAYERS, VOCAB, SwiGLU
from plain_models_frontier import decoder_of

SEQ = 16
GRID = 4  # SEQ tokens as a GRID x GRID map where a mixer wants one
CLASSES = 10
IMAGE, PATCH = 16, 4


def causal_bias(n: int, device: torch.device) -> torch.Tensor:
    return torch.full((n, n), float("-inf"), device=device).triu(1)


# ---- fairseq ----------------------------------------------------------------------------------


class FairseqMultiheadAttention(nn.Module):
    """fairseq's ``MultiheadAttention`` before it split the projections: rows of one packed
    ``in_proj_weight`` per projection, q scaled, ``bmm`` over ``batch * heads``, time first."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim, self.scaling = DIM // HEADS, (DIM // HEADS) ** -0.5
        self.in_proj_weight = nn.Parameter(torch.empty(3 * DIM, DIM))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * DIM))
        self.out_proj = nn.Linear(DIM, DIM)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def _in_proj(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return F.linear(x, self.in_proj_weight[start:end, :], self.in_proj_bias[start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query = x.transpose(0, 1)
        tgt_len, bsz, embed_dim = query.size()
        q = self._in_proj(query, 0, embed_dim) * self.scaling
        k = self._in_proj(query, embed_dim, 2 * embed_dim)
        v = self._in_proj(query, 2 * embed_dim, 3 * embed_dim)
        q, k, v = (t.contiguous().view(tgt_len, bsz * HEADS, self.head_dim).transpose(0, 1) for t in (q, k, v))
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights += causal_bias(tgt_len, x.device).unsqueeze(0)
        attn_probs = F.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn).transpose(0, 1)


CONV_HEADS, KERNEL = 4, 3


class LightweightConv(nn.Module):
    """fairseq's ``LightweightConv1d`` between a GLU input projection and an output projection:
    channel ``c`` uses head ``c % H`` (``view(-1, H, T)``), the kernel softmax-normalized."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, DIM)
        self.weight = nn.Parameter(torch.randn(CONV_HEADS, 1, KERNEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear1(x), dim=-1).transpose(1, 2)  # B x C x T
        B, C, T = h.size()
        weight = F.softmax(self.weight, dim=-1)
        h = F.pad(h.reshape(-1, CONV_HEADS, T), (KERNEL - 1, 0))
        out = F.conv1d(h, weight, groups=CONV_HEADS).view(B, C, T)
        return self.linear2(out.transpose(1, 2))


class DynamicConv(nn.Module):
    """fairseq's ``DynamicConv1dTBC._forward_unfolded``: a softmax kernel per position and head
    from ``weight_linear``, windows by ``unfold1d`` (``F.pad`` then ``as_strided``), ``bmm``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.weight_linear = nn.Linear(DIM, CONV_HEADS * KERNEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear1(x).transpose(0, 1)  # T x B x C
        T, B, C = h.size()
        R = C // CONV_HEADS
        weight = F.softmax(self.weight_linear(h).view(T * B * CONV_HEADS, -1), dim=1)
        padded = F.pad(h, (0, 0, 0, 0, KERNEL - 1, 0))
        unfolded = padded.as_strided((T, B, C, KERNEL), (B * C, C, 1, B * C))
        out = torch.bmm(unfolded.reshape(T * B * CONV_HEADS, R, KERNEL), weight.unsqueeze(2)).view(T, B, C)
        return self.linear2(out.transpose(0, 1))


# ---- vision (timm) ----------------------------------------------------------------------------

VIT_HEADS = 4


class PatchClassifier(nn.Module):
    """timm's skeleton: conv patch embedding, ``LAYERS`` blocks on [B, N, C], mean pooling, head."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, DIM, PATCH, PATCH)
        self.blocks = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x).mean(1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class Mlp(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 2 * DIM) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerScaleBlock(nn.Module):
    """Pre-norm block with timm's ``LayerScale`` (``x * gamma``) on both branches."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = nn.LayerNorm(DIM), nn.LayerNorm(DIM), attention, Mlp()
        self.gamma1, self.gamma2 = nn.Parameter(1e-1 * torch.ones(DIM)), nn.Parameter(1e-1 * torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.gamma1 * self.attn(self.norm1(x))
        return x + self.gamma2 * self.mlp(self.norm2(x))


class XCA(nn.Module):
    """XCiT's cross-covariance attention: q and k normalized over the tokens, attention between
    a head's channels scaled by a per-head ``temperature``, then the local patch interaction."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(VIT_HEADS, 1, 1))
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.lpi = nn.Sequential(nn.Conv2d(DIM, DIM, 3, padding=1, groups=DIM), nn.GELU(), nn.BatchNorm2d(DIM), nn.Conv2d(DIM, DIM, 3, padding=1, groups=DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, VIT_HEADS, C // VIT_HEADS).permute(2, 0, 3, 4, 1)
        q, k, v = qkv.unbind(0)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        attn = ((q @ k.transpose(-2, -1)) * self.temperature).softmax(dim=-1)
        x = self.proj((attn @ v).permute(0, 3, 1, 2).reshape(B, N, C))
        side = int(math.sqrt(N))
        return x + self.lpi(x.transpose(1, 2).reshape(B, C, side, side)).reshape(B, C, N).transpose(1, 2)


class OutlookAttention(nn.Module):
    """VOLO's outlook attention: values unfolded into 3x3 windows, ``heads * k^4`` weights per
    position from a linear, the windows weighted and folded back (overlaps summed)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = (DIM // VIT_HEADS) ** -0.5
        self.v, self.proj = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM)
        self.attn = nn.Linear(DIM, KERNEL**4 * VIT_HEADS)
        self.unfold = nn.Unfold(kernel_size=KERNEL, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        H = W = int(math.sqrt(N))
        x = x.view(B, H, W, C)
        v = self.v(x).permute(0, 3, 1, 2)
        v = self.unfold(v).reshape(B, VIT_HEADS, C // VIT_HEADS, KERNEL * KERNEL, H * W).permute(0, 1, 4, 3, 2)
        attn = self.attn(x).reshape(B, H * W, VIT_HEADS, KERNEL * KERNEL, KERNEL * KERNEL).permute(0, 2, 1, 3, 4)
        attn = (attn * self.scale).softmax(dim=-1)
        x = (attn @ v).permute(0, 1, 4, 3, 2).reshape(B, C * KERNEL * KERNEL, H * W)
        x = F.fold(x, output_size=(H, W), kernel_size=KERNEL, padding=1)
        return self.proj(x.permute(0, 2, 3, 1)).reshape(B, N, C)


def rel_indices(side: int) -> torch.Tensor:
    """ConViT's [1, N, N, 3]: (dx, dy, dx^2 + dy^2) between the patches of a side x side grid."""
    ind = torch.arange(side).view(1, -1) - torch.arange(side).view(-1, 1)
    indx, indy = ind.repeat(side, side), ind.repeat_interleave(side, dim=0).repeat_interleave(side, dim=1)
    return torch.stack([indx, indy, indx**2 + indy**2], dim=-1).float().unsqueeze(0)


class GPSA(nn.Module):
    """ConViT's gated positional self-attention: content and positional attention mixed per head
    by ``sigmoid(gating_param)``, renormalized in place."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = (DIM // VIT_HEADS) ** -0.5
        self.qk, self.v, self.proj = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM)
        self.pos_proj = nn.Linear(3, VIT_HEADS)
        self.gating_param = nn.Parameter(torch.ones(VIT_HEADS))
        self.register_buffer("rel_indices", rel_indices(GRID), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        pos_score = self.pos_proj(self.rel_indices.expand(B, -1, -1, -1)).permute(0, 3, 1, 2)
        qk = self.qk(x).reshape(B, N, 2, VIT_HEADS, C // VIT_HEADS).permute(2, 0, 3, 1, 4)
        patch_score = ((qk[0] @ qk[1].transpose(-2, -1)) * self.scale).softmax(dim=-1)
        gating = self.gating_param.view(1, -1, 1, 1)
        attn = (1.0 - torch.sigmoid(gating)) * patch_score + torch.sigmoid(gating) * pos_score.softmax(dim=-1)
        attn /= attn.sum(dim=-1).unsqueeze(-1)
        v = self.v(x).reshape(B, N, VIT_HEADS, C // VIT_HEADS).permute(0, 2, 1, 3)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class LinearBN(nn.Sequential):
    """LeViT's ``Linear_BN``: a linear, then ``BatchNorm1d`` over the flattened tokens."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(nn.Linear(a, b, bias=False), nn.BatchNorm1d(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear, bn = self
        x = linear(x)
        return bn(x.flatten(0, 1)).reshape_as(x)


class LeViTAttention(nn.Module):
    """LeViT's attention: a bias per head and relative offset, ``attention_biases[:, idxs]``
    with the offsets' indices a buffer, the output projection after a hardswish."""

    def __init__(self) -> None:
        super().__init__()
        self.key_dim, self.scale = DIM // VIT_HEADS, (DIM // VIT_HEADS) ** -0.5
        self.qkv, self.proj = LinearBN(DIM, 3 * DIM), nn.Sequential(nn.Hardswish(), LinearBN(DIM, DIM))
        points = [(i, j) for i in range(GRID) for j in range(GRID)]
        offsets: dict[tuple[int, int], int] = {}
        idxs = [offsets.setdefault((abs(p[0] - q[0]), abs(p[1] - q[1])), len(offsets)) for p in points for q in points]
        self.attention_biases = nn.Parameter(0.1 * torch.randn(VIT_HEADS, len(offsets)))
        self.register_buffer("attention_bias_idxs", torch.LongTensor(idxs).view(len(points), len(points)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, VIT_HEADS, -1).split([self.key_dim, self.key_dim, self.key_dim], dim=3)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        attn = q @ k.transpose(-2, -1) * self.scale + self.attention_biases[:, self.attention_bias_idxs]
        x = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


# ---- spectral mixers --------------------------------------------------------------------------


class GlobalFilter(nn.Module):
    """GFNet's global filter: ``rfft2`` over the token grid, times a complex weight per channel
    (``view_as_complex`` of a real parameter), ``irfft2`` back."""

    def __init__(self) -> None:
        super().__init__()
        self.complex_weight = nn.Parameter(torch.randn(GRID, GRID // 2 + 1, DIM, 2) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        x = torch.fft.rfft2(x.view(B, GRID, GRID, C).to(torch.float32), dim=(1, 2), norm="ortho")
        x = x * torch.view_as_complex(self.complex_weight)
        return torch.fft.irfft2(x, s=(GRID, GRID), dim=(1, 2), norm="ortho").reshape(B, N, C)


AFNO_BLOCKS, AFNO_FACTOR = 4, 2


class AFNO1D(nn.Module):
    """FourCastNet's AFNO: ``rfft`` over the tokens, a block-diagonal complex two-layer MLP by
    ``einsum`` over the channel blocks, ``softshrink``, ``irfft``, the input added back."""

    def __init__(self) -> None:
        super().__init__()
        bs = DIM // AFNO_BLOCKS
        self.w1 = nn.Parameter(0.02 * torch.randn(2, AFNO_BLOCKS, bs, bs * AFNO_FACTOR))
        self.b1 = nn.Parameter(0.02 * torch.randn(2, AFNO_BLOCKS, bs * AFNO_FACTOR))
        self.w2 = nn.Parameter(0.02 * torch.randn(2, AFNO_BLOCKS, bs * AFNO_FACTOR, bs))
        self.b2 = nn.Parameter(0.02 * torch.randn(2, AFNO_BLOCKS, bs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        bias = x
        x = torch.fft.rfft(x, dim=1, norm="ortho").reshape(B, N // 2 + 1, AFNO_BLOCKS, C // AFNO_BLOCKS)
        o1_real = F.relu(torch.einsum("...bi,bio->...bo", x.real, self.w1[0]) - torch.einsum("...bi,bio->...bo", x.imag, self.w1[1]) + self.b1[0])
        o1_imag = F.relu(torch.einsum("...bi,bio->...bo", x.imag, self.w1[0]) + torch.einsum("...bi,bio->...bo", x.real, self.w1[1]) + self.b1[1])
        o2_real = torch.einsum("...bi,bio->...bo", o1_real, self.w2[0]) - torch.einsum("...bi,bio->...bo", o1_imag, self.w2[1]) + self.b2[0]
        o2_imag = torch.einsum("...bi,bio->...bo", o1_imag, self.w2[0]) + torch.einsum("...bi,bio->...bo", o1_real, self.w2[1]) + self.b2[1]
        x = F.softshrink(torch.stack([o2_real, o2_imag], dim=-1), lambd=0.01)
        x = torch.view_as_complex(x).reshape(B, N // 2 + 1, C)
        return torch.fft.irfft(x, n=N, dim=1, norm="ortho") + bias


MODES, FNO_WIDTH = 4, 32


class SpectralConv1d(nn.Module):
    """FNO's spectral convolution: complex ``cfloat`` parameters mix the channels of the lowest
    ``MODES`` frequencies, written into a zero spectrum by slice assignment."""

    def __init__(self) -> None:
        super().__init__()
        scale = 1 / (FNO_WIDTH * FNO_WIDTH)
        self.weights1 = nn.Parameter(scale * torch.rand(FNO_WIDTH, FNO_WIDTH, MODES, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batchsize, n = x.shape[0], x.size(-1)
        x_ft = torch.fft.rfft(x)
        out_ft = torch.zeros(batchsize, FNO_WIDTH, n // 2 + 1, device=x.device, dtype=torch.cfloat)
        out_ft[:, :, :MODES] = torch.einsum("bix,iox->box", x_ft[:, :, :MODES], self.weights1)
        return torch.fft.irfft(out_ft, n=n)


class FNO1d(nn.Module):
    """A neural operator regressing u(x) from a(x) on a grid of ``SEQ`` points (MSE)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(2, FNO_WIDTH)
        self.convs = nn.ModuleList(SpectralConv1d() for _ in range(LAYERS))
        self.ws = nn.ModuleList(nn.Conv1d(FNO_WIDTH, FNO_WIDTH, 1) for _ in range(LAYERS))
        self.fc1, self.fc2 = nn.Linear(FNO_WIDTH, 4 * FNO_WIDTH), nn.Linear(4 * FNO_WIDTH, 1)

    def forward(self, a: torch.Tensor, u: torch.Tensor) -> dict[str, Any]:
        grid = torch.linspace(0, 1, a.shape[1], device=a.device).view(1, -1, 1).expand(a.shape[0], -1, -1)
        x = self.fc0(torch.cat((a.unsqueeze(-1), grid), dim=-1)).permute(0, 2, 1)
        for conv, w in zip(self.convs, self.ws):
            x = F.gelu(conv(x) + w(x))
        pred = self.fc2(F.gelu(self.fc1(x.permute(0, 2, 1)))).squeeze(-1)
        return {"logits": pred, "loss": F.mse_loss(pred, u)}


class ModReLU(nn.Module):
    """complexPyTorch's modReLU: ``relu(|z| + b)`` at the phase of ``z``, by ``torch.polar``."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.full((FNO_WIDTH,), -0.1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.polar(F.relu(z.abs() + self.b), z.angle())


class ComplexLayer(nn.Module):
    """A residual MLP of ``nn.Linear(..., dtype=torch.cfloat)`` layers, ``tanh`` on the real and
    imaginary parts apart (a split activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(FNO_WIDTH, 2 * FNO_WIDTH, dtype=torch.cfloat), nn.Linear(2 * FNO_WIDTH, FNO_WIDTH, dtype=torch.cfloat)
        self.act = ModReLU()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.fc1(z)
        return self.act(z + self.fc2(torch.complex(torch.tanh(h.real), torch.tanh(h.imag))))


class ComplexSpectralNet(nn.Module):
    """Complex-valued layers over a signal's spectrum (the complex activations cross the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.lift, self.proj = nn.Linear(1, FNO_WIDTH), nn.Linear(FNO_WIDTH, 1)
        self.layers = nn.ModuleList(ComplexLayer() for _ in range(LAYERS))

    def forward(self, a: torch.Tensor, u: torch.Tensor) -> dict[str, Any]:
        z = torch.fft.rfft(self.lift(a.unsqueeze(-1)), dim=1)
        for layer in self.layers:
            z = layer(z)
        pred = self.proj(torch.fft.irfft(z, n=a.shape[1], dim=1)).squeeze(-1)
        return {"logits": pred, "loss": F.mse_loss(pred, u)}


MODELS: dict[str, Callable[[], nn.Module]] = {
    "fairseq_packed_in_proj": decoder_of(FairseqMultiheadAttention),
    "fairseq_lightweight_conv": decoder_of(LightweightConv),
    "fairseq_dynamic_conv": decoder_of(DynamicConv),
    "xcit_cross_covariance": lambda: PatchClassifier(lambda: LayerScaleBlock(XCA())),
    "volo_outlook_attention": lambda: PatchClassifier(lambda: LayerScaleBlock(OutlookAttention())),
    "convit_gated_positional": lambda: PatchClassifier(lambda: LayerScaleBlock(GPSA())),
    "levit_attention_bias": lambda: PatchClassifier(lambda: LayerScaleBlock(LeViTAttention())),
    "gfnet_global_filter": decoder_of(GlobalFilter, SwiGLU),
    "afno_spectral_mlp": decoder_of(AFNO1D, SwiGLU),
    "fno_complex_weights": FNO1d,
    "complex_valued_layers": ComplexSpectralNet,
}
VISION = {"xcit_cross_covariance", "volo_outlook_attention", "convit_gated_positional", "levit_attention_bias"}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name in VISION:
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    if name in ("fno_complex_weights", "complex_valued_layers"):
        a = torch.randn(batch, seq, generator=gen)
        return {"a": a, "u": torch.cumsum(a, dim=1) / seq}
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    return {"input_ids": ids, "labels": labels}
