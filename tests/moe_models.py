"""Small MoE models of our own, each a form of MoE that expert parallelism must find from the
graph alone (issue 29); ``build(name)`` returns a seeded model in eval mode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from general_models import HIDDEN, TinyLM, _Block

EXPERTS, FFN = 4, 32


@torch.library.custom_op("moe_test::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Another library's grouped matmul (rows ``[offs[g-1], offs[g])`` times ``w[g]``), for any
    dtype: ``torch._grouped_mm`` traces only in bf16. Rows past the last offset belong to no
    group: their output is zero, as ``torch._grouped_mm`` leaves them unwritten."""
    starts = [0, *offs.tolist()[:-1]]
    out = x.new_zeros((x.shape[0], w.shape[-1]))
    for g, (a, b) in enumerate(zip(starts, offs.tolist())):
        out[a:b] = x[a:b] @ w[g]
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[-1]))


def _grouped_mm_backward(ctx, grad):  # type: ignore[no-untyped-def]
    x, w, offs = ctx.saved_tensors
    starts = [0, *offs.tolist()[:-1]]
    spans = list(zip(starts, offs.tolist()))
    grad_w = torch.stack([x[a:b].T @ grad[a:b] for a, b in spans])
    return grouped_mm(grad, w.transpose(-1, -2).contiguous(), offs), grad_w, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def _sorted_by_expert(choice: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (token x slot) sorted by expert, and the grouped matmul's offsets."""
    expert_ids, order = torch.sort(choice.reshape(-1))
    counts = torch.histc(expert_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    return order, torch.cumsum(counts, 0).to(torch.int32)


class FusedIndexAddBlock(_Block):
    """Fused [E, K, N] expert weights through a grouped matmul, top-2 softmax router,
    combined with ``index_add`` (not HF's view + sum)."""

    def __init__(self) -> None:
        super().__init__()
        del self.up, self.down
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * FFN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) * 0.1)

    def experts(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_mm(rows, self.w_in, offsets).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.w_out, offsets)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        weights, choice = self.router(flat).softmax(-1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        order, offsets = _sorted_by_expert(choice, EXPERTS)
        token = order // 2
        out = self.experts(flat[token], offsets) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add(0, token, out).view(b, s, h)


class GluExpert(nn.Module):
    """An expert that views its rows by their count (``x.shape[0]``): the view must follow the
    rows the expert receives, not the rows its rank gathered."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 2 * FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.up(x).view(x.shape[0], 2, FFN)
        return self.down(F.silu(gate_up[:, 0]) * gate_up[:, 1])


class LoopSigmoidBlock(_Block):
    """A loop over expert modules picked by a sigmoid router with a correction bias
    (DeepSeek-V3's rule: the bias steers the choice, the weights are the unbiased scores),
    top-2, plus a shared expert added to the routed output."""

    def __init__(self) -> None:
        super().__init__()
        del self.up, self.down
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.register_buffer("correction", torch.linspace(-0.2, 0.2, EXPERTS))
        self.routed = nn.ModuleList(GluExpert() for _ in range(EXPERTS))
        self.shared = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        scores = self.router(flat).sigmoid()
        choice = (scores + self.correction).topk(2, dim=-1).indices
        weights = scores.gather(1, choice)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.routed):
            picked = choice == e
            rows = torch.nonzero(picked.any(-1)).squeeze(-1)
            weight = (weights * picked).sum(-1)
            out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return (out + self.shared(flat)).view(b, s, h)


class RowMixingBlock(FusedIndexAddBlock):
    """Experts whose computation centers each expert's rows on their mean: not row-wise, so
    its rows cannot be computed on another rank."""

    def experts(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        h = grouped_mm(rows, self.w_in, offsets)
        h = h - h.mean(0, keepdim=True)
        gate, up = h.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.w_out, offsets)


class HashRoutedBlock(FusedIndexAddBlock):
    """Tokens go to expert ``position % E``: fused experts, but no router picks them."""

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        choice = (torch.arange(flat.shape[0], device=x.device) % EXPERTS).unsqueeze(-1)
        order, offsets = _sorted_by_expert(choice, EXPERTS)
        out = self.experts(flat[order], offsets)
        return torch.zeros_like(flat).index_add(0, order, out).view(b, s, h)


MODELS = {
    "fused_index_add": lambda: TinyLM(FusedIndexAddBlock),
    "loop_sigmoid": lambda: TinyLM(LoopSigmoidBlock),
    "row_mixing": lambda: TinyLM(RowMixingBlock),
    "hash_routed": lambda: TinyLM(HashRoutedBlock),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()
