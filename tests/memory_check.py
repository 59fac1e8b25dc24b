"""Predicted against measured peak memory of a real CPU training step (``tests/test_memory_model.py``, ``bench_cost_model``).

``measure`` runs ``parallelize`` + ``train_step`` + an AdamW step (foreach, as on a GPU),
twice, on gloo ranks under ``PeakLiveBytes`` and returns each rank's peak live bytes
(``measure_cuda``: the same on one GPU, ``torch.cuda.max_memory_allocated``);
``predict`` is the planner's ``estimate`` of the same configuration.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from transformers import LlamaConfig

from autotp.compiler import trace_for_planning
from autotp.cost_model.candidates import Cluster, Config
from autotp.cost_model.hardware import get_profile
from autotp.cost_model.planner import Training, estimate


@dataclass(frozen=True)
class Case:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    microbatches: int = 1
    global_batch: int = 4
    schedule: str | None = None  # None: the plan's default
    distributed_optimizer: bool = False
    sequence_parallel: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class _Scheduled(Config):
    schedule_name: str | None = None

    @property
    def schedule(self) -> str | None:
        return self.schedule_name or Config.schedule.fget(self)  # type: ignore[attr-defined]


DIMS = (256, 688, 4, 8, 4, 8192, 256)  # hidden, intermediate, layers, heads, kv heads, vocab, seq
DTYPE = torch.bfloat16


def config(dims: tuple[int, ...] = DIMS) -> LlamaConfig:
    h, i, layers, heads, kv, vocab, seq = dims
    return LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq)  # fmt: skip


def precision(case: Case) -> str:
    if DTYPE == torch.float32:
        return "fp32"
    return "bf16-fp32-grads" if case.distributed_optimizer else "bf16-pure"


def predict(case: Case, dims: tuple[int, ...] = DIMS) -> float:
    """The planner's peak bytes per rank for ``case``."""
    costs = trace_for_planning(config(dims), dims[6], dtype=DTYPE)
    b = case.global_batch // (case.dp * case.microbatches)
    cfg = _Scheduled(case.tp, case.pp, case.dp, case.vpp, b, case.microbatches, case.schedule)
    training = Training(case.global_batch, precision(case), case.distributed_optimizer, gather_outputs=True,
                        sequence_parallel=case.sequence_parallel)
    est = estimate(costs, Cluster(case.world, case.world, get_profile("cpu", calibrated=False)), training, cfg,
                   distributed=case.distributed_optimizer)  # fmt: skip
    return est.mem_bytes_per_gpu


def _setup(case: Case, dims: tuple[int, ...], device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """The parallelized model of ``case`` on ``device``, its optimizer and the global batch."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    import autotp

    logging.set_verbosity_error()
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config(dims)).to(DTYPE)
    ids = torch.randint(0, dims[5], (case.global_batch, dims[6]), generator=torch.Generator().manual_seed(0)).to(device)
    micro = ids[: case.global_batch // (case.dp * case.microbatches)]
    pm = autotp.parallelize(model, tp=case.tp, pp=case.pp, dp=case.dp, vpp=case.vpp,
                            example_inputs={"input_ids": micro, "labels": micro},
                            sequence_parallel=case.sequence_parallel)  # fmt: skip
    del model
    if case.distributed_optimizer:
        return pm, autotp.DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-5, foreach=True), ids
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-5, foreach=True), ids


def _train(pm: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, case: Case, steps: int) -> None:
    for _ in range(steps):
        pm.train_step(input_ids=ids, labels=ids, num_microbatches=case.microbatches, schedule=case.schedule)
        opt.step()
        opt.zero_grad(set_to_none=True)


def measure_worker(rank: int, world: int, case: Case, dims: tuple[int, ...] = DIMS, steps: int = 2) -> int:
    """This rank's peak live bytes over ``steps`` training steps."""
    from autotp.runtime.execution.live_memory import PeakLiveBytes

    pm, opt, ids = _setup(case, dims, torch.device("cpu"))
    with PeakLiveBytes() as tracker:
        _train(pm, opt, ids, case, steps)
    return tracker.peak


def measure_cuda_worker(rank: int, world: int, case: Case, dims: tuple[int, ...] = DIMS, steps: int = 2) -> int:
    """``torch.cuda.max_memory_allocated`` of this rank over ``steps`` training steps on GPU
    ``rank``, from a GPU holding nothing (what an earlier run left is collected first: the
    runtime's fx graphs are reference cycles, freed by the garbage collector only)."""
    torch.cuda.set_device(rank)
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps a workspace per stream it ran on
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    assert left <= 2**20, f"{left / 2**20:.0f} MiB still allocated from earlier runs"
    pm, opt, ids = _setup(case, dims, torch.device("cuda", rank))
    torch.cuda.reset_peak_memory_stats()  # parallelize held the model and its shards at once
    _train(pm, opt, ids, case, steps)
    peak = torch.cuda.max_memory_allocated()
    del pm, opt, ids
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def measure_cuda(case: Case, dims: tuple[int, ...] = DIMS) -> int:
    """The fullest rank's ``max_memory_allocated`` (one process per GPU, NCCL, beyond one rank)."""
    if case.world == 1:
        return measure_cuda_worker(0, 1, case, dims)
    from autotp.runtime.processes.launcher import spawn_ranks

    return max(spawn_ranks(measure_cuda_worker, case.world, case, dims, backend="nccl", timeout_s=900))


def measure(case: Case, dims: tuple[int, ...] = DIMS) -> int:
    """The fullest rank's peak live bytes (one process per rank, gloo)."""
    if case.world == 1:
        return measure_worker(0, 1, case, dims)
    from distributed import run_on_ranks

    return max(run_on_ranks(measure_worker, case.world, case, dims, timeout_s=900))
