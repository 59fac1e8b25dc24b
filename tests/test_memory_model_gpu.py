"""The memory model against ``torch.cuda.max_memory_allocated`` on GPUs (skipped without them), on
the workload issue 17 measured (8 Llama layers of 8B widths, vocab 32000, seq 2048, global batch
8, bf16, torch AdamW): gradient accumulation over m = 1, 2, 4 microbatches on one GPU, and on two
tp=2 with and without sequence parallelism and pp=2 under ZB-H1. Every run starts from an empty GPU."""

from __future__ import annotations

import pytest
import torch
from memory_check import Case, measure_cuda, predict
from test_memory_model import TOLERANCE

DIMS_8B_WIDTH = (4096, 14336, 8, 32, 8, 32000, 2048)
CASES = [
    Case(global_batch=8),
    Case(microbatches=2, global_batch=8),
    Case(microbatches=4, global_batch=8),
    Case(tp=2, global_batch=8),
    Case(tp=2, global_batch=8, sequence_parallel=True),
    Case(pp=2, microbatches=4, global_batch=8, schedule="zbh1"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_memory_model_on_gpus(case: Case) -> None:
    if torch.cuda.device_count() < case.world:
        pytest.skip(f"needs {case.world} CUDA GPUs, found {torch.cuda.device_count()}")
    measured, predicted = measure_cuda(case, DIMS_8B_WIDTH), predict(case, DIMS_8B_WIDTH)
    error = predicted / measured - 1
    print(f"{case}: predicted {predicted / 2**30:.2f} GiB, max_memory_allocated {measured / 2**30:.2f} GiB, {error:+.1%}")
    assert abs(error) <= TOLERANCE, f"{case}: predicted {predicted} bytes, measured {measured} ({error:+.1%})"
