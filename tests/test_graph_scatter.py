"""Graph attention by message passing, written as PyTorch Geometric writes it (GATv2): per-head scores on
an edge list, a softmax over each node's incoming edges by ``scatter_reduce`` (its max) and
``scatter_add`` (its sum), messages summed into the nodes by ``index_add``. ``scatter_reduce`` had no
rule: the planner gathered the heads' scores there, or kept the heads' projections whole (PyG's own
GATv2Conv: 66% of the model on a rank at tp=2); it now keeps the split of every dim it does not
scatter along, reading partial sums summed unless it sums them, and ``index_reduce`` likewise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_on_ranks

NODES, EDGES, DIM, HEADS = 16, 40, 32, 4


class EdgeSoftmaxAttention(nn.Module):
    """Two GATv2-style layers over one graph, then a node classifier."""

    def __init__(self, reduce_by: str) -> None:
        super().__init__()
        self.src, self.dst = (nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2)) for _ in range(2))
        self.att = nn.ParameterList(nn.Parameter(torch.randn(HEADS, DIM // HEADS)) for _ in range(2))
        self.head = nn.Linear(DIM, 8)
        self.reduce_by = reduce_by

    def _edge_max(self, scores: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        if self.reduce_by == "index_reduce":
            return scores.new_full((NODES, HEADS), -1e4).index_reduce(0, dst, scores, "amax")
        index = dst[:, None].expand_as(scores)
        return scores.new_zeros(NODES, HEADS).scatter_reduce(0, index, scores, reduce="amax", include_self=False)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        for lin_s, lin_d, att in zip(self.src, self.dst, self.att):
            xs, xd = lin_s(x).view(NODES, HEADS, -1), lin_d(x).view(NODES, HEADS, -1)
            scores = (nn.functional.leaky_relu(xs[src] + xd[dst], 0.2) * att).sum(-1)  # [E, H]
            scores = (scores - self._edge_max(scores, dst)[dst]).exp()
            total = scores.new_zeros(NODES, HEADS).scatter_add(0, dst[:, None].expand_as(scores), scores)
            alpha = scores / total[dst]
            x = x + torch.zeros_like(xs).index_add(0, dst, xs[src] * alpha[..., None]).flatten(1).relu()
        return self.head(x)


def _graph() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(NODES, DIM, generator=gen), "edge_index": torch.randint(0, NODES, (2, EDGES), generator=gen)}


def _strict(rank: int, world: int, reduce_by: str, tp: int) -> tuple[bool, str, tuple[str, ...]]:
    from autotp import parallelize
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    r = check_on_rank(EdgeSoftmaxAttention(reduce_by), _graph(), tp=tp, loss_fn=lambda out: out.square().mean())
    torch.manual_seed(0)
    plan = parallelize(EdgeSoftmaxAttention(reduce_by), tp=tp, example_inputs=_graph()).plan
    return r.passed, r.reason, tuple(g.node for g in plan.gathered)


@pytest.mark.parametrize(("reduce_by", "tp"), [("scatter_reduce", 2), ("scatter_reduce", 4), ("index_reduce", 2)])
def test_edge_softmax_keeps_the_heads_split(reduce_by: str, tp: int) -> None:
    assert run_on_ranks(_strict, tp, reduce_by, tp) == [(True, "", ())] * tp
