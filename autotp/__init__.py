"""autotp: compile unmodified PyTorch/HuggingFace models into tensor-parallel per-rank graphs.

The public names are imported on first use, so that ``autotp --help`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotp.api import CompiledRank, compile_rank, parallelize
    from autotp.ir.plan import ParallelPlan, ParamLayout
    from autotp.runtime.gradients.distributed_optimizer import DistributedOptimizer
    from autotp.runtime.processes.launcher import init_distributed
    from autotp.runtime.execution.parallel_model import ParallelModel

_PUBLIC = {
    "CompiledRank": "autotp.api",
    "compile_rank": "autotp.api",
    "parallelize": "autotp.api",
    "ParallelPlan": "autotp.ir.plan",
    "ParamLayout": "autotp.ir.plan",
    "DistributedOptimizer": "autotp.runtime.gradients.distributed_optimizer",
    "init_distributed": "autotp.runtime.processes.launcher",
    "ParallelModel": "autotp.runtime.execution.parallel_model",
}

__all__ = ["CompiledRank", "DistributedOptimizer", "ParallelModel", "ParallelPlan", "ParamLayout", "compile_rank", "init_distributed", "parallelize"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'autotp' has no attribute '{name}'")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
