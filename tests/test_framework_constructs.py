"""Mechanisms the frameworks suite (``plain_models_frameworks.py``) found missing, on tiny
modules in one process: the loss a forward returns in a tuple, a buffer written in place by
a training forward (a KV cache), and a per-head ``A_log`` read through its rank's slice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.errors import UserInputError
from autotp.runtime.execution.buffer_history import cut_history_on_call, written_buffers
from autotp.runtime.execution.model_loss import returned_logits, returned_loss
from plain_models_frameworks import DIM, SSDMixer


def test_returned_loss_from_a_dict_a_tuple_or_refused() -> None:
    logits, loss = torch.randn(2, 4, 8), torch.tensor(1.5)
    assert returned_loss({"logits": logits, "loss": loss}) is loss
    with pytest.warns(UserWarning, match="auxiliary loss"):  # a lone aux loss would look the same: said
        assert returned_loss((logits, loss)) is loss  # minGPT: forward(idx, targets) -> (logits, loss)
    assert returned_logits((logits, loss)) is logits
    with pytest.raises(UserInputError, match="loss_fn="):
        returned_loss((logits, None))  # called without the targets: no loss to train on
    with pytest.raises(UserInputError, match="2 scalar"):
        returned_loss((logits, loss, torch.tensor(0.1)))  # a loss and an aux loss: which one?


class CacheWrite(nn.Module):
    """Meta's reference Llama: a projection written into a cache buffer by slice assignment,
    then read back from the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(2, 8, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[: x.shape[0], : x.shape[1]] = self.proj(x)
        return (self.cache[: x.shape[0], : x.shape[1]] ** 2).sum()


def test_a_written_buffer_carries_no_history_into_the_next_call() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4)
    torch.manual_seed(0)
    gm = torch.export.export(CacheWrite(), (), {"x": x}, strict=False).module()  # real weights, the write kept as a copy_
    assert written_buffers(gm) == ["cache"]
    cut_history_on_call(gm)
    for _ in range(2):  # a second forward + backward (the next microbatch) links no freed graph
        gm.zero_grad()
        torch.utils._pytree.tree_leaves(gm(x=x))[0].backward()
        assert gm.cache.grad_fn is not None  # this call's write stays differentiable
    torch.manual_seed(0)
    ref = CacheWrite()
    ref(x).backward()
    torch.testing.assert_close(gm.get_parameter("proj.weight").grad, ref.proj.weight.grad, rtol=1e-4, atol=1e-6)


def test_a_per_head_vector_computed_from_its_parameter_is_split_with_the_heads() -> None:
    """Mamba2's ``A = -exp(A_log)`` meets the per-head ``dt``: ``A_log`` is split by heads
    (read through the rank's slice) like ``dt_bias`` and ``D``, not read whole."""
    torch.manual_seed(0)
    gm = trace(SSDMixer().eval(), {"u": torch.randn(2, 8, DIM)})
    plan = plan_tensor_parallel(gm, 2)
    dims = {p.name: p.dim for p in plan.params}
    assert dims.get("A_log") == 0 and dims.get("dt_bias") == 0, dims
    assert "A_log" not in {k.name for k in plan.kept_whole}
