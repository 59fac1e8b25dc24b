"""Pipeline cuts between any two modules the forward runs in turn, not only between the
layers of a module list: a large block before or after the layer stack gets a stage of its
own share (fp32, gloo, pp=2, the strict rule of ``autotp.report.strict_rule``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autotp.analysis.trace import trace
from autotp.cost_model.pipeline import plan_pipeline
from autotp.ir.plan import ParallelPlan
from autotp.report.strict_rule import StrictResult, check_on_rank, combine
from distributed import run_on_ranks

DIM, VOCAB, CLASSES, SEQ = 32, 16, 256, 8


class Mlp(nn.Module):
    """A block outside every module list: its linears are named, not numbered."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, hidden), nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _stack() -> nn.ModuleList:
    return nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM)) for _ in range(2))


class BlocksBeforeStack(nn.Module):
    """Two blocks between the embedding and the stack; the larger is half of the matmul work."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.big, self.small = Mlp(3 * DIM), nn.Linear(DIM, DIM)
        self.layers = _stack()
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids) * 2.0
        x = x + self.big(x)
        x = x + self.small(x)
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(self.norm(x))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class BlocksAfterStack(nn.Module):
    """A pooled block after the stack and a wide classifier, each about half of the matmul work."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = _stack()
        self.post, self.classifier = Mlp(2 * DIM), nn.Linear(DIM, CLASSES)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        pooled = x.mean(dim=1)
        pooled = pooled + self.post(pooled)
        logits = self.classifier(pooled)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


MODELS = {"before": BlocksBeforeStack, "after": BlocksAfterStack}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def _inputs(name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    labels = torch.randint(0, CLASSES, (4,), generator=gen) if name == "after" else torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    return {"input_ids": ids, "labels": labels}


def test_the_cut_falls_between_blocks_outside_the_stack() -> None:
    before = plan_pipeline(trace(_build("before"), _inputs("before")), 2, 1)
    assert before.layer_chunks == (1, 1) and before.module_chunks == (("small", 1),)
    after = plan_pipeline(trace(_build("after"), _inputs("after")), 2, 1)
    assert after.layer_chunks == (0, 0) and after.module_chunks == (("post", 0),)
    plan = ParallelPlan(pp=2, **after._asdict())
    assert ParallelPlan.from_json(plan.to_json()) == plan


def _strict_on_rank(rank: int, world: int, name: str) -> StrictResult:
    return check_on_rank(_build(name), _inputs(name), tp=1, pp=2)


def test_blocks_outside_the_stack_pass_the_strict_rule_at_pp2() -> None:
    for name in MODELS:
        result = combine(run_on_ranks(_strict_on_rank, 2, name, timeout_s=400))
        assert result.passed, f"{name}: {result.reason}"
