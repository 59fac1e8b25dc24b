"""autotp: compile unmodified PyTorch/HuggingFace models into tensor-parallel per-rank graphs."""

from autotp.api import CompiledRank, compile_rank, parallelize
from autotp.ir.plan import ParallelPlan, ParamLayout
from autotp.runtime.launcher import init_distributed
from autotp.runtime.parallel_model import ParallelModel

__all__ = ["CompiledRank", "ParallelModel", "compile_rank", "init_distributed", "ParallelPlan", "ParamLayout", "parallelize"]
