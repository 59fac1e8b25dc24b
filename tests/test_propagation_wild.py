"""Constructs of the third round of issue 27 (``tests/plain_models_wild.py``) on tiny
modules, one process: what the planner decides for them. ``test_plain_suite`` checks the
numerics of the whole models on gloo ranks."""

from __future__ import annotations

import pytest
import torch

from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from plain_models_wild import DIM, UnfoldWindowAttention


@pytest.mark.parametrize("tp", [2, 4])
def test_sliding_windows_by_unfold_keep_the_heads_split(tp: int) -> None:
    """``k.unfold(2, w, 1)`` over the sequence of ``[B, H, S, D]`` keys: the heads keep their
    split (only the unfolded dim must be whole), so the fused qkv stays column-parallel."""
    gm = trace(UnfoldWindowAttention().eval(), {"x": torch.randn(2, 16, DIM)})
    plan = plan_tensor_parallel(gm, tp)
    kinds = {p.name: p.kind for p in plan.params}
    assert kinds["qkv.weight"] == "column" and kinds["proj.weight"] == "row"
    assert {k.name for k in plan.kept_whole} <= {"proj.bias"}  # a row-parallel bias is added after the all-reduce
