"""autotp: compile unmodified PyTorch/HuggingFace models into tensor-parallel per-rank graphs."""

from autotp.api import CompiledRank, ParallelModel, compile_rank, parallelize
from autotp.ir.plan import ParallelPlan, ParamLayout

__all__ = ["CompiledRank", "ParallelModel", "compile_rank", "ParallelPlan", "ParamLayout", "parallelize"]
