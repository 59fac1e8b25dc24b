"""A forward drawing from Python's or NumPy's global random generator is refused naming the line
(``analysis.host_draws``): the traced graph would repeat that one draw at every step. A forward that
seeds the generator before drawing draws the same at every call and is traced."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from autotp.analysis.trace import trace
from autotp.ir.errors import UserInputError
from autotp.report.strict_rule import check_on_rank

DIM = 8


class LayerDrop(nn.Module):
    """x-transformers' layer dropout: ``random() < p`` skips a layer while training."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and random.random() < 0.5:
                continue
            x = x + layer(x)
        return x.square().mean()


class MaskedTimeSteps(nn.Module):
    """SpecAugment-style: the time steps to mask drawn by NumPy, seeded first (BigBird) or not."""

    def __init__(self, seeded: bool) -> None:
        super().__init__()
        self.proj, self.seeded = nn.Linear(DIM, DIM), seeded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seeded:
            np.random.seed(7)
        steps = torch.from_numpy(np.random.permutation(x.shape[1])[:2].copy())
        return self.proj(x.index_fill(1, steps, 0.0)).square().mean()


def _x() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(1))}


@pytest.mark.parametrize("model, where", [
    (LayerDrop(), r"Python's random module \(random\) at .*test_host_draws.py:\d+ \(if self.training and random.random\(\) < 0.5:\)"),
    (MaskedTimeSteps(seeded=False), r"NumPy's global generator \(permutation\) at .*test_host_draws.py:\d+ \(steps = "),
])  # fmt: skip
def test_a_forward_drawing_from_a_host_generator_is_refused_naming_the_line(model: nn.Module, where: str) -> None:
    with pytest.raises(UserInputError, match=rf"the forward draws from {where}.*torch.rand"):
        trace(model.train(), _x())
    trace(model.eval() if isinstance(model, LayerDrop) else MaskedTimeSteps(seeded=True), _x())


def test_a_forward_seeding_its_host_generator_first_is_traced_and_equal() -> None:
    result = check_on_rank(MaskedTimeSteps(seeded=True).train(), _x(), tp=1)
    assert result.passed, result.reason
