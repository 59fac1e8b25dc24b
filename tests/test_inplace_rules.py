"""In-place ops that PyTorch leaves untagged (``masked_fill_``, ``gelu_``) take the rule of
their out-of-place op (``op_facts.functional_variant``): halonet masks its attention scores
with ``sim.masked_fill_(mask, -max)``, which kept its q/k/v projections whole before."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autotp.analysis.op_rules import rule_for
from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.op_facts import functional_variant
from distributed import run_on_ranks

BATCH, SEQ, DIM, HEADS = 2, 8, 32, 4
aten = torch.ops.aten


class MaskedInPlace(nn.Module):
    """Attention whose scores are masked in place, then a classifier over the mean token."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        # heads merged into the batch dim, as einops' 'b n (h d) -> (b h) n d'
        q, k, v = (t.unflatten(-1, (HEADS, DIM // HEADS)).transpose(1, 2).flatten(0, 1) for t in self.qkv(x).chunk(3, -1))
        sim = torch.bmm(q, k.transpose(-1, -2))
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH * HEADS, SEQ, SEQ)  # of full size on the split dim
        sim.masked_fill_(mask, -torch.finfo(sim.dtype).max)
        h = self.out(torch.bmm(sim.softmax(-1), v).unflatten(0, (BATCH, HEADS)).transpose(1, 2).flatten(2))
        logits = self.head(h.mean(1))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(BATCH, SEQ, DIM, generator=gen), "labels": torch.randint(0, 8, (BATCH,), generator=gen)}


def test_untagged_in_place_ops_take_their_out_of_place_rule() -> None:
    assert functional_variant(aten.masked_fill_.Scalar) is aten.masked_fill.Scalar
    assert functional_variant(aten.gelu_.default) is aten.gelu.default
    assert functional_variant(aten.masked_fill.Scalar) is None and functional_variant(aten.zero_.default) is aten.zero.default
    assert rule_for(aten.masked_fill_.Scalar) is not None and rule_for(aten.zero_.default) is None


def test_scores_masked_in_place_keep_the_heads_split() -> None:
    torch.manual_seed(0)
    plan = plan_tensor_parallel(trace(MaskedInPlace().eval(), _inputs()), 2)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["qkv.weight"] == "column" and kinds["out.weight"] == "row"
    assert "qkv.weight" not in {k.name for k in plan.kept_whole} and not plan.gathered  # no all-gather of the scores either


def _strict(rank: int, world: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    return check_on_rank(MaskedInPlace().eval(), _inputs(), tp=world).reason


def test_scores_masked_in_place_at_tp2_equal_the_model() -> None:
    assert run_on_ranks(_strict, 2) == ["", ""]
