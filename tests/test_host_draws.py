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


def _type_checked(forward):  # noqa: ANN001, ANN202 - a decorator as beartype writes one: code generated at run time
    namespace = {"random": random, "forward": forward}
    source = "def checked(self, x):\n    random.getrandbits(8)  # sample an element to check\n    return forward(self, x)\n"
    exec(compile(source, "<@type_checked(forward)>", "exec"), namespace)
    return namespace["checked"]


class TypeChecked(nn.Module):
    """A forward wrapped by generated code that draws from Python's generator to pick what it checks (beartype)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    @_type_checked
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).square().mean()


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


@pytest.mark.parametrize("model", [MaskedTimeSteps(seeded=True), TypeChecked()], ids=["seeded_first", "generated_code"])
def test_a_draw_that_repeats_or_that_generated_code_makes_is_traced_and_equal(model: nn.Module) -> None:
    result = check_on_rank(model.train(), _x(), tp=1, loss_fn=lambda loss: loss)  # the forward returns its loss
    assert result.passed, result.reason
