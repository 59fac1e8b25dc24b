"""The memory model against ``torch.cuda.max_memory_allocated`` on one GPU (skipped without CUDA):
gradient accumulation over m = 1, 2, 4 microbatches of the workload issue 17 measured (8 Llama
layers of 8B widths, vocab 32000, seq 2048, global batch 8, bf16, torch AdamW), each run
starting from an empty GPU."""

from __future__ import annotations

import pytest
import torch
from memory_check import Case, measure_cuda, predict
from test_memory_model import TOLERANCE

DIMS_8B_WIDTH = (4096, 14336, 8, 32, 8, 32000, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_memory_model_on_one_gpu(microbatches: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    case = Case(microbatches=microbatches, global_batch=8)
    measured, predicted = measure_cuda(case, DIMS_8B_WIDTH), predict(case, DIMS_8B_WIDTH)
    error = predicted / measured - 1
    print(f"m={microbatches}: predicted {predicted / 2**30:.2f} GiB, max_memory_allocated {measured / 2**30:.2f} GiB, {error:+.1%}")
    assert abs(error) <= TOLERANCE, f"m={microbatches}: predicted {predicted} bytes, measured {measured} ({error:+.1%})"
