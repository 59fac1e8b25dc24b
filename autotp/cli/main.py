"""The ``autotp`` command line (also ``python -m autotp``)."""

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
from autotp.report import dump
from autotp.api import CompiledRank, compile_rank, parallelize
from autotp.cost_model.hardware import PROFILES
from autotp.cost_model.graph_costs import build_report
from autotp.report.graph_report import explain_json, explain_table, stage_view
from autotp.cli.calibrate import add_calibrate_command
from autotp.cli.checkpoint import add_convert_command, add_run_checkpoint_options, build_for_run
from autotp.cli.plan import add_plan_command
from autotp.cli.ranks import add_ranks_command
from autotp.cli.schedule import add_schedule_command
from autotp.report.cudagraphs import explain_cudagraphs
from autotp.runtime.launcher import RankError, launch
from autotp.passes import PASSES

_LR = 1e-3

# The pass runner's dump files: 00_traced.py, then NN_<pass>.py.
_AFTER = ["traced", *(p.__name__ for p in PASSES)]


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
        raise ValueError(f"--backend nccl needs {tp} GPUs but {gpus} are visible; use --backend gloo or a smaller --tp")
    return backend


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def _run(args: argparse.Namespace) -> int:
    for name in ("tp", "pp", "steps", "batch", "seq"):
        _positive(f"--{name}", getattr(args, name))
    presets.build_model(args.model, device="meta")  # an unknown model fails here, before any worker starts
    world = args.tp * args.pp
    backend = _resolve_backend(args.backend, world)
    config = RunConfig(args.model, args.tp, args.steps, args.batch, args.seq, args.seed, args.pp, args.save,
                       args.save_checkpoint, args.resume)  # fmt: skip
    start = time.perf_counter()
    launch(functools.partial(_run_worker, config), world, backend=backend, timeout_s=args.timeout)
    print(f"wall time {time.perf_counter() - start:.1f} s")
    return 0


def _check_stage(pp: int, stage: int | None) -> None:
    if stage is not None and not 0 <= stage < pp:
        raise ValueError(f"--stage {stage} does not exist with --pp {pp}; pick 0..{pp - 1}")


def _compile_for_inspection(args: argparse.Namespace, rank: int, dump_dir: Path | None) -> CompiledRank:
    for name in ("tp", "pp", "batch"):
        _positive(f"--{name}", getattr(args, name))
    if args.seq is not None:
        _positive("--seq", args.seq)
    _check_stage(args.pp, args.stage)
    hf_logging.set_verbosity_error()
    model = presets.build_model(args.model, device="meta", dtype=presets.DTYPES[args.dtype])
    inputs = presets.inspection_inputs(model, args.batch, args.seq, not args.no_labels)
    return compile_rank(model, tp=args.tp, rank=rank, pp=args.pp, example_inputs=inputs, dump_dir=dump_dir)


def _dump(args: argparse.Namespace) -> int:
    if args.after is not None and args.format != "code":
        raise ValueError(
            f"--after writes the code that the pass runner saves after each pass; use --format code "
            f"(--format {args.format} shows the final graph, without --after)"
        )
    if args.after is not None and args.stage is not None:
        raise ValueError("--after writes the whole rank graph as the pass runner saved it; drop --stage")
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


def _explain(args: argparse.Namespace) -> int:
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


def _add_inspection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help=f"a preset ({', '.join(presets.preset_names())}) or a local folder holding config.json; "
        "built on the meta device, nothing is allocated or downloaded",
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: 2)")
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline stages; the planner cuts the layers between them (default: 1)"
    )
    parser.add_argument("--batch", type=int, default=1, help="batch size of the example input_ids (default: 1)")
    parser.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"sequence length (default: {presets.INSPECTION_SEQ}, or the model's max_position_embeddings if smaller)",
    )
    parser.add_argument("--dtype", choices=tuple(presets.DTYPES), default="bfloat16", help="parameter dtype (default: bfloat16)")
    parser.add_argument(
        "--no-labels",
        action="store_true",
        help="trace without labels= (by default labels are passed, so the vocab-parallel loss shows)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotp", description="Compile HuggingFace models into tensor-parallel per-rank graphs."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="train a built-in model for a few steps on --tp local worker processes",
        description="Launch --tp workers (gloo on CPU, NCCL when there are enough GPUs), parallelize the model, "
        "train it with AdamW and compare the first loss with the unparallelized model's.",
    )
    run.add_argument(
        "--model",
        default="llama-tiny",
        help=f"a preset ({', '.join(presets.preset_names())}) or a local folder holding config.json "
        "(default: llama-tiny)",
    )
    run.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: 2)")
    run.add_argument("--pp", type=int, default=1, help="pipeline stages; tp*pp workers are started (default: 1)")
    run.add_argument("--steps", type=int, default=5, help="training steps (default: 5)")
    run.add_argument("--batch", type=int, default=4, help="batch size (default: 4)")
    run.add_argument("--seq", type=int, default=32, help="sequence length (default: 32)")
    run.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: auto")
    run.add_argument("--timeout", type=float, default=300, help="seconds before hung workers are killed (default: 300)")
    run.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default: 0)")
    add_run_checkpoint_options(run)
    run.set_defaults(handler=_run)

    dump_cmd = commands.add_parser(
        "dump",
        help="write one rank's rewritten graph as annotated code, DOT, SVG or JSON",
        description="Compile one tp rank offline and write its graph. Every node is annotated with its "
        "layout (Replicate, Partial, Shard(dim:local/global)), its collectives with bytes and estimated time, "
        "its pipeline stage (stage boundaries are nodes, shown with their point-to-point bytes), and its "
        "forward FLOPs and estimated time, and its CUDA-graph region when the plan asks for CUDA graphs. "
        "DOT and SVG expand layer 0 and collapse the other decoder layers into one summary node each.",
    )
    _add_inspection_options(dump_cmd)
    dump_cmd.add_argument("--rank", type=int, default=0, help="tp rank to compile (default: 0)")
    dump_cmd.add_argument(
        "--stage",
        type=int,
        help="with --pp > 1: only this pipeline stage (its nodes, the repeated ones they read, its boundaries); "
        "default: the whole rank graph with every node's stage",
    )
    dump_cmd.add_argument(
        "--format",
        choices=dump.FORMATS,
        default="code",
        help="code: annotated listing; dot; svg: rendered by Graphviz's dot (DOT only, with a message, "
        "when it is missing); json: every node and the per-layer summary (default: code)",
    )
    dump_cmd.add_argument("--out", type=Path, default=Path("autotp-dump"), help="output folder (default: autotp-dump)")
    dump_cmd.add_argument(
        "--after",
        choices=_AFTER,
        help="write the graph as it was after this pass instead of the final one: the plain code the pass "
        "runner saves (only with --format code)",
    )
    dump_cmd.add_argument("--dump-dir", type=Path, help="also write the code after every pass here (NN_<pass>.py)")
    dump_cmd.add_argument(
        "--hardware", choices=tuple(PROFILES), default="h200", help="profile for estimated times (default: h200)"
    )
    dump_cmd.set_defaults(handler=_dump)

    explain = commands.add_parser(
        "explain",
        help="collectives, bytes, parameters and FLOPs per layer, against Megatron's minimum",
        description="Compile tp rank 0 offline and tabulate per layer: all-reduces and all-gathers by "
        "direction with their bytes, parameter bytes per rank and forward FLOPs per rank; then totals and "
        "Megatron's minimum of 2 forward + 2 backward all-reduces per decoder layer.",
    )
    _add_inspection_options(explain)
    explain.add_argument("--format", choices=("table", "json"), default="table", help="default: table")
    explain.add_argument(
        "--cudagraphs", action="store_true", help="list CUDA-graph regions and blockers (JSON key cudagraph_regions)"
    )
    explain.set_defaults(handler=_explain, stage=None)
    add_ranks_command(commands)
    add_schedule_command(commands)
    add_plan_command(commands)
    add_calibrate_command(commands)
    add_convert_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"autotp: error: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        if e.exc_type == "ValueError":  # bad input, found once the workers traced the model
            print(f"autotp: error: {e.message}", file=sys.stderr)
            return 2
        print(f"autotp: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"autotp: {e}", file=sys.stderr)
        return 1
