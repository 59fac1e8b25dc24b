"""The handlers of ``autotp dump`` and ``explain``, and what ``autotp run`` shares with them (imported when one runs)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from autotp import presets
from autotp.ir.errors import UserInputError
from autotp.report import dump
from autotp.api import CompiledRank, compile_rank
from autotp.cost_model.hardware import PROFILES
from autotp.cost_model.memory import bytes_per_param
from autotp.cost_model.graph_costs import build_report
from autotp.report.graph_report import explain_json, explain_table, stage_view
from autotp.report.cudagraphs import explain_cudagraphs
from autotp.report.moe import moe_dispatch_report, moe_dispatch_table
from autotp.compiler import compile_steps
from autotp.cli.progress import progress

# The pass runner's dump files: 00_traced.py, then NN_<pass>.py.
_AFTER = ["traced", *(p.__name__ for p in compile_steps())]


def resolve_backend(backend: str, tp: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= tp else "gloo"
    if backend == "nccl" and gpus < tp:
        raise UserInputError(f"--backend nccl needs {tp} GPUs (one per worker) but {gpus} are visible; "
                             "use --backend gloo or fewer workers (--tp, --pp, --dp)")
    return backend


def positive(name: str, value: int) -> None:
    if value < 1:
        raise UserInputError(f"{name} must be at least 1, got {value}")


def positive_timeout(seconds: float) -> None:
    if not seconds > 0:
        raise UserInputError(f"--timeout must be a positive number of seconds, got {seconds:g}")


def _available_bytes(backend: str, tp: int) -> tuple[float, str]:
    """Free memory where the workers allocate: the smallest of the tp GPUs, or this host's RAM."""
    if backend == "nccl":
        return min(torch.cuda.mem_get_info(i)[0] for i in range(tp)), "free on the smallest GPU"
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024, "available on this host"


def check_memory(model: str, numel: int, tp: int, backend: str, on_meta: bool) -> None:
    """Refuse a run that cannot fit, before any worker allocates: each worker builds the
    full fp32 model (not ``on_meta``, from a checkpoint folder or resumed: then each allocates
    only its shard), then keeps its 1/tp shard with grads and AdamW states
    (``bytes_per_param('fp32')``); on the CPU the tp workers share the host."""
    full, shard = (0 if on_meta else 4 * numel), bytes_per_param("fp32") * numel / tp
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
        positive(f"--{name}", getattr(args, name))
    if args.seq is not None:
        positive("--seq", args.seq)
    _check_stage(args.pp, args.stage)
    hf_logging.set_verbosity_error()
    model = presets.build_model(args.model, device="meta", dtype=presets.DTYPES[args.dtype])
    inputs = presets.inspection_inputs(model, args.batch, args.seq, not args.no_labels)
    progress(f"tracing, planning and compiling tp rank {rank} of {args.model} (tp={args.tp}, pp={args.pp})")
    return compile_rank(model, tp=args.tp, rank=rank, pp=args.pp, example_inputs=inputs, dump_dir=dump_dir,
                        sequence_parallel=args.sequence_parallel, ep=args.ep, moe_dispatch=args.moe_dispatch,
                        moe_capacity_factor=args.moe_capacity_factor, recompute=args.recompute)  # fmt: skip


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
    dispatch = moe_dispatch_report(compiled.graph, compiled.plan)
    if args.format == "json":
        print(json.dumps(explain_json(report, args.model) | ({"moe_dispatch": dispatch} if dispatch else {}), indent=2))
    else:
        print(explain_table(report, args.model))
        if dispatch:
            print("\n" + moe_dispatch_table(dispatch))
    return 0
