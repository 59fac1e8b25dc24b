"""The handlers of ``autotp run``, ``dump`` and ``explain`` (imported when one of them runs)."""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.fx import GraphModule
from transformers.utils import logging as hf_logging

from autotp import presets
from autotp.ir import ops
from autotp.ir.errors import UserInputError
from autotp.report import dump
from autotp.api import CompiledRank, compile_rank, parallelize
from autotp.cost_model.hardware import PROFILES
from autotp.cost_model.memory import bytes_per_param
from autotp.cost_model.graph_costs import build_report
from autotp.report.graph_report import explain_json, explain_table, stage_view
from autotp.report.cudagraphs import explain_cudagraphs
from autotp.runtime.launcher import launch
from autotp.cli.checkpoint import build_for_run, hf_weights
from autotp.compiler import compile_steps

_LR = 1e-3

# The pass runner's dump files: 00_traced.py, then NN_<pass>.py.
_AFTER = ["traced", *(p.__name__ for p in compile_steps())]


@dataclass(frozen=True)
class RunConfig:
    model: str
    tp: int
    steps: int
    batch: int
    seq: int
    seed: int
    pp: int = 1
    save: Path | None = None
    save_checkpoint: Path | None = None
    resume: Path | None = None


def _count_calls(graph: GraphModule, target: object) -> int:
    return sum(1 for node in graph.graph.nodes if node.op == "call_function" and node.target is target)


def _run_worker(config: RunConfig, rank: int, world_size: int) -> None:
    """One tp rank of ``autotp run``; rank 0 reports."""
    hf_logging.set_verbosity_error()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.manual_seed(config.seed)
    model, weights = build_for_run(config.model, device)
    # Uniform random tokens are unlearnable (their best loss is ln(vocab), where training
    # starts), so every step trains on the same batch and the loss visibly falls.
    input_ids = presets.example_inputs(model, config.batch, config.seq, seed=config.seed)["input_ids"].to(device)
    batch = {"input_ids": input_ids, "labels": input_ids}
    reference = None
    if rank == 0 and weights is None:
        with torch.no_grad():
            reference = model(**batch).loss.item()

    start = time.perf_counter()
    pm = parallelize(model, tp=config.tp, pp=config.pp, example_inputs=batch, device=device, seed=config.seed,
                     checkpoint=weights)  # fmt: skip
    graph = pm.graph_for(**batch)
    compiled_at = time.perf_counter()
    optimizer = torch.optim.AdamW(pm.parameters(), lr=_LR)
    first = 0
    if config.resume is not None:
        first = pm.load_checkpoint(config.resume, optimizer=optimizer) or 0
    losses = []
    for step in range(first + 1, first + config.steps + 1):
        loss = pm.train_step(**batch, num_microbatches=max(config.pp, pm.plan.microbatches)).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        if rank == 0:
            print(f"step {step}  loss {loss:.4f}", flush=True)
    trained_at = time.perf_counter()
    if config.save_checkpoint is not None:
        pm.save_checkpoint(config.save_checkpoint, optimizer=optimizer, step=first + config.steps)
    if config.save is not None:
        pm.save_pretrained(config.save)

    if rank == 0:
        for path in (config.save_checkpoint, config.save):
            if path is not None:
                print(f"wrote {path}")
        if reference is not None:
            print(
                f"step-1 loss vs unparallelized model: {losses[0]:.6f} vs {reference:.6f} "
                f"(|diff| {abs(losses[0] - reference):.1e})"
            )
        print(
            f"all-reduces per rank graph: {_count_calls(graph, ops.REDUCE_FROM_TP)} forward, "
            f"{_count_calls(graph, ops.COPY_TO_TP)} backward"
        )
        print(
            f"{config.model}, tp={config.tp} on {dist.get_backend()}: compile {compiled_at - start:.2f} s, "
            f"{config.steps} steps {trained_at - compiled_at:.2f} s",
            flush=True,
        )


def _resolve_backend(backend: str, tp: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= tp else "gloo"
    if backend == "nccl" and gpus < tp:
        raise UserInputError(f"--backend nccl needs {tp} GPUs but {gpus} are visible; use --backend gloo or a smaller --tp")
    return backend


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise UserInputError(f"{name} must be at least 1, got {value}")


def run_command(args: argparse.Namespace) -> int:
    for name in ("tp", "pp", "steps", "batch", "seq"):
        _positive(f"--{name}", getattr(args, name))
    meta = presets.build_model(args.model, device="meta")  # an unknown model fails here, before any worker starts
    world = args.tp * args.pp
    backend = _resolve_backend(args.backend, world)
    _check_memory(args.model, sum(p.numel() for p in meta.parameters()), world, backend)
    config = RunConfig(args.model, args.tp, args.steps, args.batch, args.seq, args.seed, args.pp, args.save,
                       args.save_checkpoint, args.resume)  # fmt: skip
    _progress(f"starting {world} {backend} workers; each builds {args.model} and compiles its rank")
    start = time.perf_counter()
    launch(functools.partial(_run_worker, config), world, backend=backend, timeout_s=args.timeout)
    print(f"wall time {time.perf_counter() - start:.1f} s")
    return 0


def _progress(message: str) -> None:
    print(f"autotp: {message} ...", file=sys.stderr, flush=True)


def _available_bytes(backend: str, tp: int) -> tuple[float, str]:
    """Free memory where the workers allocate: the smallest of the tp GPUs, or this host's RAM."""
    if backend == "nccl":
        return min(torch.cuda.mem_get_info(i)[0] for i in range(tp)), "free on the smallest GPU"
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024, "available on this host"


def _check_memory(model: str, numel: int, tp: int, backend: str) -> None:
    """Refuse a run that cannot fit, before any worker allocates: each worker builds the
    full fp32 model (not when ``model`` is a checkpoint folder: then each reads only its
    shard), then keeps its 1/tp shard with grads and AdamW states (``bytes_per_param('fp32')``);
    on the CPU the tp workers share the host."""
    full, shard = (0 if hf_weights(model) else 4 * numel), bytes_per_param("fp32") * numel / tp
    per_worker = full + shard
    need = per_worker if backend == "nccl" else tp * per_worker
    try:
        free, where = _available_bytes(backend, tp)
    except (OSError, KeyError, ValueError):  # no /proc/meminfo: nothing to compare with
        return
    if need > free:
        raise UserInputError(
            f"{model} needs about {need / 2**30:.1f} GiB ({'each GPU' if backend == 'nccl' else f'{tp} workers'}: the full fp32 "
            f"model while it is built, {full / 2**30:.1f} GiB, plus a 1/{tp} shard with grads and AdamW states, {shard / 2**30:.1f} GiB), "
            f"but {free / 2**30:.1f} GiB is {where}; pick a smaller --model or use GPUs with more memory"
        )


def _check_stage(pp: int, stage: int | None) -> None:
    if stage is not None and not 0 <= stage < pp:
        raise UserInputError(f"--stage {stage} does not exist with --pp {pp}; pick 0..{pp - 1}")


def _compile_for_inspection(args: argparse.Namespace, rank: int, dump_dir: Path | None) -> CompiledRank:
    for name in ("tp", "pp", "batch"):
        _positive(f"--{name}", getattr(args, name))
    if args.seq is not None:
        _positive("--seq", args.seq)
    _check_stage(args.pp, args.stage)
    hf_logging.set_verbosity_error()
    model = presets.build_model(args.model, device="meta", dtype=presets.DTYPES[args.dtype])
    inputs = presets.inspection_inputs(model, args.batch, args.seq, not args.no_labels)
    _progress(f"tracing, planning and compiling tp rank {rank} of {args.model} (tp={args.tp}, pp={args.pp})")
    return compile_rank(model, tp=args.tp, rank=rank, pp=args.pp, example_inputs=inputs, dump_dir=dump_dir,
                        sequence_parallel=args.sequence_parallel)  # fmt: skip


def dump_command(args: argparse.Namespace) -> int:
    if args.after is not None and args.after not in _AFTER:
        raise UserInputError(f"--after {args.after} is not a pass; use one of {', '.join(_AFTER)}")
    if args.after is not None and args.format != "code":
        raise UserInputError(
            f"--after writes the code that the pass runner saves after each pass; use --format code "
            f"(--format {args.format} shows the final graph, without --after)"
        )
    if args.after is not None and args.stage is not None:
        raise UserInputError("--after writes the whole rank graph as the pass runner saved it; drop --stage")
    stem = f"{Path(args.model).name}_tp{args.tp}_rank{args.rank}"
    if args.pp > 1:
        stem += f"_pp{args.pp}" + ("" if args.stage is None else f"_stage{args.stage}")
    with tempfile.TemporaryDirectory() as tmp:
        dump_dir = args.dump_dir or (Path(tmp) if args.after else None)
        compiled = _compile_for_inspection(args, args.rank, dump_dir)
        if args.after is not None:
            assert dump_dir is not None
            index = _AFTER.index(args.after)
            path = args.out / f"{stem}_after_{index:02d}_{args.after}.py"
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(dump_dir / f"{index:02d}_{args.after}.py", path)
        else:
            report = build_report(compiled.graph, compiled.plan, args.rank, PROFILES[args.hardware])
            if args.stage is not None:
                report = stage_view(report, args.stage)
            path, warning = dump.write(report, args.model, args.format, args.out, stem)
            if warning is not None:
                print(f"autotp: {warning}", file=sys.stderr)
    print(f"wrote {path}")
    if args.dump_dir is not None:
        print(f"wrote the code after each pass to {args.dump_dir}")
    return 0


def explain_command(args: argparse.Namespace) -> int:
    if args.cudagraphs:
        print(explain_cudagraphs(args.model, args.tp, args.pp, 0, args.format, batch=args.batch, seq=args.seq,
                                 dtype=args.dtype, labels=not args.no_labels))
        return 0
    compiled = _compile_for_inspection(args, 0, None)
    report = build_report(compiled.graph, compiled.plan, 0)
    if args.format == "json":
        print(json.dumps(explain_json(report, args.model), indent=2))
    else:
        print(explain_table(report, args.model))
    return 0
