"""FlexAttention models on one GPU (``tests/plain_models_hops.py``): autotp's step, eager and with
``compile=True`` (the fused Triton kernel), against the unmodified model run the same way, eager
and under ``torch.compile``: loss and every gradient (fp32; skipped without a GPU). A captured
parameter the score function reads (a per-head relative-position table) gets its gradient."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from plain_models_hops import build, example_inputs

pytestmark = pytest.mark.gpu
RTOL, ATOL = 1e-4, 1e-5  # fp32 on the GPU, reductions in another order than the reference's


def _reference(model: torch.nn.Module, batch: dict[str, torch.Tensor], compiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    run = torch.compile(model) if compiled else model
    loss = run(**batch)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["flex_alibi", "flex_relative_bias", "flex_document_mask"])
@pytest.mark.parametrize("options", [{}, {"compile": True}], ids=["eager", "compile"])
def test_flex_attention_models_train_on_one_gpu(name: str, options: dict[str, Any]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import autotp

    model = build(name).cuda()
    reference = copy.deepcopy(model)
    batch = {k: v.cuda() for k, v in example_inputs(name).items()}
    loss_ref, grads_ref = _reference(reference, batch, compiled=bool(options))
    pm = autotp.parallelize(model, tp=1, example_inputs=batch, **options)
    loss = pm.train_step(**batch)
    torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    bad = [n for n, want in grads_ref.items() if want is None or not torch.allclose(grads[n], want, rtol=RTOL, atol=ATOL)]
    assert not bad, bad
