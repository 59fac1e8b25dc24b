"""Random draws of split steps on a GPU (``autotp.ir.batch_draws``): two microbatches on one
GPU, eager and ``compile=True``, draw the numbers the unmodified model draws for the whole batch
from the CUDA generator, which then stands where that model leaves it (fp32; skipped without a
GPU). ``bernoulli(p)`` of a tensor is left out: the pass draws it as ``rand < p``, which on the
GPU is the same distribution but not the numbers of CUDA's own Bernoulli kernel."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from test_batch_draws import NoisyLM, RandomlyMaskedLM, _batch, _reference

pytestmark = pytest.mark.gpu
RTOL, ATOL = 1e-4, 1e-5  # fp32 on the GPU, reductions in another order than the reference's


@pytest.mark.parametrize("options", [{}, {"compile": True}], ids=["eager", "compile"])
@pytest.mark.parametrize("name", ["noisy", "randomly_masked"])
def test_microbatches_on_one_gpu_draw_the_whole_batch_s_numbers(options: dict[str, Any], name: str) -> None:
    """``randomly_masked`` divides its loss by the count of random masks: each piece's count
    reads the draws its forward takes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import autotp

    model = (NoisyLM(units=False) if name == "noisy" else RandomlyMaskedLM()).cuda().eval()
    reference = copy.deepcopy(model)
    batch = {k: v.cuda() for k, v in _batch().items()}
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()}, **options)
    loss_ref, grads_ref, after_ref = _reference(reference, batch, seed=5)
    torch.manual_seed(5)
    loss = pm.train_step(**batch, num_microbatches=2)
    after = torch.rand(4, device="cuda")
    torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    bad = [n for n, want in grads_ref.items() if not torch.allclose(grads[n], want, rtol=RTOL, atol=ATOL)]
    assert not bad, bad
    torch.testing.assert_close(after, after_ref, rtol=0, atol=0)
