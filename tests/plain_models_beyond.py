"""Small plain-PyTorch models beyond the transformer (issue 27, fourteenth round), after the
reference code of their fields.

StyleGAN2's modulated convolution (the weight scaled by a style per sample and demodulated, the
batch folded into the channels and ``groups=batch``); PointNet's feature transform (a linear's
output viewed as one matrix per sample, applied by ``bmm``, an orthogonality penalty); slot
attention (softmax over the slots, a weighted mean over the inputs, ``nn.GRUCell``, three
iterations); capsules by dynamic routing (a 5-D broadcast ``matmul``, routing logits updated in
a loop, ``squash``, the margin loss); MADE (linears whose weights a mask buffer multiplies, three hidden layers);
RealNVP (affine couplings on ``chunk``ed halves, the log-determinant in the loss); a neural ODE
integrated by fixed-step RK4 inside the block; a mixture density network whose loss is
``torch.distributions.MixtureSameFamily(...).log_prob``; a VAE by ``Normal.rsample`` and
``kl_divergence``, DreamerV3's straight-through one-hot latents; DLRM (``EmbeddingBag`` by flat
indices and offsets, with dense and with sparse gradients, pairwise interactions by ``bmm``).

The suite protocol (``tests/test_plain_suite.py``): ``MODELS``, ``build(name)`` (eval mode,
fixed weights), ``example_inputs(name)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributions as D
import torch.nn.functional as F
from torch import nn

from plain_models_attention import DIM, LAYERS, VOCAB, DecoderLM, PreNormBlock
from plain_models_idioms import FusedHeads

SEQ = 16
CLASSES = 10
FEATURES = 32  # inputs of the density models


# ---- StyleGAN2 ---------------------------------------------------------------------------------

CHANNELS, RES = 32, 4


class ModulatedConv2d(nn.Module):
    """rosinality's ``ModulatedConv2d``: ``scale * weight * style``, demodulated per sample and
    output channel, run as one grouped convolution over ``[1, batch * in, h, w]``."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, demodulate: bool = True) -> None:
        super().__init__()
        self.out_ch, self.kernel, self.demodulate = out_ch, kernel, demodulate
        self.scale = 1 / math.sqrt(in_ch * kernel**2)
        self.weight = nn.Parameter(torch.randn(1, out_ch, in_ch, kernel, kernel))
        self.modulation = nn.Linear(DIM, in_ch)
        nn.init.ones_(self.modulation.bias)

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        batch, in_ch, height, width = x.shape
        weight = self.scale * self.weight * self.modulation(style).view(batch, 1, in_ch, 1, 1)
        if self.demodulate:
            demod = torch.rsqrt(weight.pow(2).sum([2, 3, 4]) + 1e-8)
            weight = weight * demod.view(batch, self.out_ch, 1, 1, 1)
        weight = weight.view(batch * self.out_ch, in_ch, self.kernel, self.kernel)
        out = F.conv2d(x.view(1, batch * in_ch, height, width), weight, padding=self.kernel // 2, groups=batch)
        return out.view(batch, self.out_ch, height, width)


class StyleGenerator(nn.Module):
    """A mapping network, a learned constant, two modulated 3x3 layers with ``fused_leaky_relu``
    as a plain op, a modulated ``to_rgb`` without demodulation; MSE against target images."""

    def __init__(self) -> None:
        super().__init__()
        self.mapping = nn.Sequential(nn.Linear(DIM, DIM), nn.LeakyReLU(0.2), nn.Linear(DIM, DIM), nn.LeakyReLU(0.2))
        self.constant = nn.Parameter(torch.randn(1, CHANNELS, RES, RES))
        self.convs = nn.ModuleList(ModulatedConv2d(CHANNELS, CHANNELS, 3) for _ in range(LAYERS))
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(1, CHANNELS, 1, 1)) for _ in range(LAYERS))
        self.to_rgb = ModulatedConv2d(CHANNELS, 3, 1, demodulate=False)

    def forward(self, z: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
        style = self.mapping(F.normalize(z, dim=1))
        x = self.constant.repeat(z.shape[0], 1, 1, 1)
        for conv, bias in zip(self.convs, self.biases):
            x = F.leaky_relu(conv(x, style) + bias, 0.2) * math.sqrt(2)
        image = self.to_rgb(x, style)
        return {"logits": image, "loss": F.mse_loss(image, target)}


# ---- point clouds, slots, capsules -------------------------------------------------------------

POINTS, K = 16, 16


class PointNet(nn.Module):
    """PointNet: shared per-point MLPs as ``Conv1d(k=1)``, a feature T-Net whose last linear's
    ``K * K`` outputs are viewed as a matrix per sample (plus identity), ``bmm``, max pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.conv3 = nn.Conv1d(3, K, 1), nn.Conv1d(K, 2 * DIM, 1), nn.Conv1d(2 * DIM, 2 * DIM, 1)
        self.tnet_conv, self.tnet_fc = nn.Conv1d(K, DIM, 1), nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, K * K))
        self.head = nn.Sequential(nn.Linear(2 * DIM, DIM), nn.ReLU(), nn.Linear(DIM, CLASSES))

    def forward(self, points: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        x = F.relu(self.conv1(points.transpose(2, 1)))
        trans = self.tnet_fc(torch.max(F.relu(self.tnet_conv(x)), 2, keepdim=True)[0].view(-1, DIM))
        trans = trans.view(-1, K, K) + torch.eye(K, device=x.device).unsqueeze(0)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = torch.max(self.conv3(F.relu(self.conv2(x))), 2)[0]
        logits = self.head(x)
        penalty = torch.linalg.matrix_norm(torch.eye(K, device=x.device)[None] - torch.bmm(trans, trans.transpose(2, 1))).mean()
        return {"logits": logits, "loss": F.cross_entropy(logits, labels) + 1e-3 * penalty}


SLOTS, ITERS = 4, 3


class SlotAttention(nn.Module):
    """Locatello et al.'s slot attention: softmax over the slots, a weighted mean over the
    inputs, a ``GRUCell`` update and a residual MLP, ``ITERS`` times."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = DIM**-0.5
        self.slots_init = nn.Parameter(torch.randn(1, SLOTS, DIM))
        self.to_q, self.to_k, self.to_v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.gru, self.mlp = nn.GRUCell(DIM, DIM), nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM))
        self.norm_input, self.norm_slots, self.norm_pre_ff = nn.LayerNorm(DIM), nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        b, _, d = inputs.shape
        slots = self.slots_init.expand(b, -1, -1)
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        for _ in range(ITERS):
            slots_prev = slots
            q = self.to_q(self.norm_slots(slots))
            attn = torch.einsum("bid,bjd->bij", q, k).mul(self.scale).softmax(dim=1) + 1e-8
            attn = attn / attn.sum(dim=-1, keepdim=True)
            updates = torch.einsum("bjd,bij->bid", v, attn)
            slots = self.gru(updates.reshape(-1, d), slots_prev.reshape(-1, d)).reshape(b, -1, d)
            slots = slots + self.mlp(self.norm_pre_ff(slots))
        return slots


class SlotDecoderLM(DecoderLM):
    """Tokens read back the slots their layers bound (attention from the tokens to the slots)."""

    def __init__(self) -> None:
        super().__init__(lambda: PreNormBlock(FusedSlotReadout()))


class FusedSlotReadout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.slots, self.o = SlotAttention(), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = self.slots(x)
        return self.o(torch.softmax(x @ slots.transpose(1, 2) * DIM**-0.5, dim=-1) @ slots)


IN_CAPS, IN_DIM, OUT_DIM = 16, 8, 16


def squash(s: torch.Tensor, dim: int = -1) -> torch.Tensor:
    norm2 = (s**2).sum(dim=dim, keepdim=True)
    return norm2 / (1 + norm2) * s / torch.sqrt(norm2 + 1e-8)


class DigitCaps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(0.1 * torch.randn(1, IN_CAPS, CLASSES, OUT_DIM, IN_DIM))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.W, u[:, :, None, :, None]).squeeze(-1)  # [B, in, out, out_dim]


class CapsuleNet(nn.Module):
    """Sabour et al.'s routing by agreement over features: primary capsules from a linear, digit
    capsules by a 5-D ``matmul`` with ``W``, three routing iterations, the margin loss plus a
    reconstruction from the label's capsule."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.primary = nn.Linear(FEATURES, 2 * DIM), nn.Linear(2 * DIM, IN_CAPS * IN_DIM)
        self.digit_caps = DigitCaps()
        self.decoder = nn.Sequential(nn.Linear(CLASSES * OUT_DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, FEATURES))

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        u = squash(self.primary(F.relu(self.conv1(features))).view(-1, IN_CAPS, IN_DIM))
        u_hat = self.digit_caps(u)
        b = torch.zeros(u.shape[0], IN_CAPS, CLASSES, 1, device=u.device)
        for i in range(ITERS):
            c = b.softmax(dim=2)
            v = squash((c * u_hat).sum(dim=1, keepdim=True))
            if i < ITERS - 1:
                b = b + (u_hat * v).sum(-1, keepdim=True)
        v = v.squeeze(1)
        lengths = v.norm(dim=-1)
        onehot = F.one_hot(labels, CLASSES).float()
        margin = onehot * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - onehot) * F.relu(lengths - 0.1) ** 2
        recon = self.decoder((v * onehot[..., None]).flatten(1))
        return {"logits": lengths, "loss": margin.sum(-1).mean() + 5e-4 * F.mse_loss(recon, features, reduction="sum")}


# ---- densities: MADE, RealNVP, mixture density network -----------------------------------------


class MaskedLinear(nn.Linear):
    """MADE's ``MaskedLinear``: ``F.linear(x, self.mask * self.weight, self.bias)``."""

    def __init__(self, in_features: int, out_features: int, mask: torch.Tensor) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.mask * self.weight, self.bias)


class MADE(nn.Module):
    """Karpathy's pytorch-made over binary vectors: degrees per unit, masks ``m_out >= m_in``
    (strict at the output), Bernoulli log-likelihood by ``binary_cross_entropy_with_logits``."""

    def __init__(self, hidden: int = DIM, layers: int = 3) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        degrees = [torch.arange(FEATURES)] + [torch.randint(0, FEATURES - 1, (hidden,), generator=gen) for _ in range(layers)]
        masks = [(d1[:, None] >= d0[None, :]).float() for d0, d1 in zip(degrees, degrees[1:])]
        masks.append((degrees[0][:, None] > degrees[-1][None, :]).float())
        modules: list[nn.Module] = []
        for mask in masks:
            modules += [MaskedLinear(mask.shape[1], mask.shape[0], mask), nn.ReLU()]
        self.net = nn.Sequential(*modules[:-1])

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        logits = self.net(x)
        return {"logits": logits, "loss": F.binary_cross_entropy_with_logits(logits, x, reduction="none").sum(-1).mean()}


class RealNVP(nn.Module):
    """Affine couplings: ``s, t = net(x1).chunk(2, -1)``, ``x2 * exp(tanh(s)) + t``, halves
    swapped between layers; the loss is the negative log-likelihood under a standard normal."""

    def __init__(self, couplings: int = 4) -> None:
        super().__init__()
        half = FEATURES // 2
        self.nets = nn.ModuleList(nn.Sequential(nn.Linear(half, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, FEATURES))
                                  for _ in range(couplings))  # fmt: skip

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        log_det = torch.zeros(x.shape[0], device=x.device)
        for net in self.nets:
            x1, x2 = x.chunk(2, dim=-1)
            s, t = net(x1).chunk(2, dim=-1)
            s = torch.tanh(s)
            x = torch.cat([x2 * torch.exp(s) + t, x1], dim=-1)
            log_det = log_det + s.sum(-1)
        log_prob = -0.5 * (x**2).sum(-1) - 0.5 * FEATURES * math.log(2 * math.pi) + log_det
        return {"logits": x, "loss": -log_prob.mean()}


MIXTURES = 4


class MixtureDensityNetwork(nn.Module):
    """An MLP predicting a Gaussian mixture over ``FEATURES // 4`` targets; the loss is the
    negative ``log_prob`` of ``MixtureSameFamily(Categorical, Independent(Normal))``."""

    def __init__(self) -> None:
        super().__init__()
        self.out = FEATURES // 4
        self.body = nn.Sequential(nn.Linear(FEATURES, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh())
        self.pi, self.mu, self.log_sigma = (nn.Linear(DIM, n) for n in (MIXTURES, MIXTURES * self.out, MIXTURES * self.out))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        h = self.body(x)
        mu = self.mu(h).view(-1, MIXTURES, self.out)
        sigma = self.log_sigma(h).view(-1, MIXTURES, self.out).exp()
        mixture = D.MixtureSameFamily(D.Categorical(logits=self.pi(h)), D.Independent(D.Normal(mu, sigma), 1))
        return {"logits": mu, "loss": -mixture.log_prob(y).mean()}


LATENT, CATEGORIES, CLASSES_PER = 16, 4, 8


class DistributionsVAE(nn.Module):
    """A VAE written with ``torch.distributions``: ``Normal(mu, std).rsample()``, the KL by
    ``kl_divergence`` against the prior, the likelihood by ``Independent(Normal).log_prob``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(FEATURES, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.ReLU())
        self.to_stats = nn.Linear(DIM, 2 * LATENT)
        self.dec = nn.Sequential(nn.Linear(LATENT, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, FEATURES))

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        mu, log_std = self.to_stats(self.enc(x)).chunk(2, dim=-1)
        q = D.Normal(mu, log_std.exp())
        recon = self.dec(q.rsample())
        kl = D.kl_divergence(q, D.Normal(torch.zeros_like(mu), torch.ones_like(mu))).sum(-1).mean()
        return {"logits": recon, "loss": kl - D.Independent(D.Normal(recon, 1.0), 1).log_prob(x).mean()}


class StraightThroughLatents(nn.Module):
    """DreamerV3's discrete latents: ``OneHotCategoricalStraightThrough(logits).rsample()`` (a
    multinomial draw plus ``probs - probs.detach()``), an entropy bonus."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(FEATURES, DIM), nn.SiLU(), nn.Linear(DIM, DIM), nn.SiLU(), nn.Linear(DIM, CATEGORIES * CLASSES_PER))
        self.dec = nn.Sequential(nn.Linear(CATEGORIES * CLASSES_PER, DIM), nn.SiLU(), nn.Linear(DIM, DIM), nn.SiLU(), nn.Linear(DIM, FEATURES))

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        dist = D.Independent(D.OneHotCategoricalStraightThrough(logits=self.enc(x).view(-1, CATEGORIES, CLASSES_PER)), 1)
        recon = self.dec(dist.rsample().flatten(1))
        return {"logits": recon, "loss": F.mse_loss(recon, x) - 1e-3 * dist.entropy().mean()}


TABLES, ROWS, EMB, DENSE = 4, 64, 16, 13


class DLRM(nn.Module):
    """facebookresearch/dlrm: a bottom MLP over dense features, one ``EmbeddingBag`` per sparse
    feature read by flat indices and per-table ``offsets``, pairwise dot interactions by ``bmm``
    kept below the diagonal by index buffers (``Z[:, li, lj]``), a top MLP, a click loss."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.bot = nn.Sequential(nn.Linear(DENSE, DIM), nn.ReLU(), nn.Linear(DIM, EMB), nn.ReLU())
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(ROWS, EMB, mode="sum", sparse=sparse) for _ in range(TABLES))
        n = TABLES + 1
        self.register_buffer("li", torch.tensor([i for i in range(n) for j in range(i)]), persistent=False)
        self.register_buffer("lj", torch.tensor([j for i in range(n) for j in range(i)]), persistent=False)
        self.top = nn.Sequential(nn.Linear(EMB + n * (n - 1) // 2, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, 1))

    def forward(self, dense_x: torch.Tensor, ls_i: torch.Tensor, ls_o: torch.Tensor, click: torch.Tensor) -> dict[str, Any]:
        x = self.bot(dense_x)
        ly = [emb(ls_i[k], ls_o[k]) for k, emb in enumerate(self.emb_l)]
        T = torch.cat([x, *ly], dim=1).view(x.shape[0], -1, EMB)
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        p = self.top(torch.cat([x, Z[:, self.li, self.lj]], dim=1)).squeeze(-1)
        return {"logits": p, "loss": F.binary_cross_entropy_with_logits(p, click)}


# ---- a neural ODE ------------------------------------------------------------------------------


class ODEFeedForward(nn.Module):
    """torchdiffeq's ``odeint(func, y0, t, method="rk4")`` written out: four steps of RK4 over
    t in [0, 1], each evaluating the dynamics (an MLP reading t) four times."""

    def __init__(self, steps: int = 2) -> None:
        super().__init__()
        self.steps = steps
        self.func = nn.Sequential(nn.Linear(DIM + 1, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))

    def dynamics(self, t: float, y: torch.Tensor) -> torch.Tensor:
        return self.func(torch.cat([y, torch.full_like(y[..., :1], t)], dim=-1))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        h = 1.0 / self.steps
        for i in range(self.steps):
            t = i * h
            k1 = self.dynamics(t, y)
            k2 = self.dynamics(t + h / 2, y + h / 2 * k1)
            k3 = self.dynamics(t + h / 2, y + h / 2 * k2)
            k4 = self.dynamics(t + h, y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return y


class ODEAttention(FusedHeads):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(x.shape))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "stylegan2_modulated_conv": StyleGenerator,
    "pointnet_feature_transform": PointNet,
    "slot_attention": SlotDecoderLM,
    "capsule_dynamic_routing": CapsuleNet,
    "made_masked_linear": MADE,
    "realnvp_coupling": RealNVP,
    "mixture_density_network": MixtureDensityNetwork,
    "vae_distributions": DistributionsVAE,
    "dreamer_straight_through": StraightThroughLatents,
    "dlrm_offsets": lambda: DLRM(False),
    "dlrm_sparse_grads": lambda: DLRM(True),
    "neural_ode_rk4": lambda: DecoderLM(lambda: PreNormBlock(ODEAttention(), ODEFeedForward())),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def example_inputs(name: str, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "stylegan2_modulated_conv":
        return {"z": torch.randn(batch, DIM, generator=gen), "target": torch.randn(batch, 3, RES, RES, generator=gen)}
    if name == "pointnet_feature_transform":
        return {"points": torch.randn(batch, POINTS, 3, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    if name == "capsule_dynamic_routing":
        return {"features": torch.randn(batch, FEATURES, generator=gen), "labels": torch.randint(0, CLASSES, (batch,), generator=gen)}
    if name == "made_masked_linear":
        return {"x": (torch.rand(batch, FEATURES, generator=gen) < 0.5).float()}
    if name in ("realnvp_coupling", "vae_distributions", "dreamer_straight_through"):
        return {"x": torch.randn(batch, FEATURES, generator=gen)}
    if name == "mixture_density_network":
        return {"x": torch.randn(batch, FEATURES, generator=gen), "y": torch.randn(batch, FEATURES // 4, generator=gen)}
    if name.startswith("dlrm"):
        bag = 3
        return {"dense_x": torch.randn(batch, DENSE, generator=gen), "ls_i": torch.randint(0, ROWS, (TABLES, batch * bag), generator=gen),
                "ls_o": torch.arange(0, batch * bag, bag).expand(TABLES, -1).contiguous(), "click": (torch.rand(batch, generator=gen) < 0.5).float()}  # fmt: skip
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=gen) for _ in range(2))
    return {"input_ids": ids, "labels": labels}
