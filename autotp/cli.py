"""The ``autotp`` command line (also ``python -m autotp``)."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.fx import GraphModule
from transformers.utils import logging as hf_logging

from autotp import collectives, presets
from autotp.api import parallelize
from autotp.launcher import RankError, launch

_LR = 1e-3


@dataclass(frozen=True)
class RunConfig:
    model: str
    tp: int
    steps: int
    batch: int
    seq: int
    seed: int


def _count_calls(graph: GraphModule, target: object) -> int:
    return sum(1 for node in graph.graph.nodes if node.op == "call_function" and node.target is target)


def _run_worker(config: RunConfig, rank: int, world_size: int) -> None:
    """One tp rank of ``autotp run``; rank 0 reports."""
    hf_logging.set_verbosity_error()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.manual_seed(config.seed)
    model = presets.build_model(config.model, device=device, dtype=torch.float32)
    # Uniform random tokens are unlearnable (their best loss is ln(vocab), where training
    # starts), so every step trains on the same batch and the loss visibly falls.
    input_ids = presets.example_inputs(model, config.batch, config.seq, seed=config.seed)["input_ids"]
    batch = {"input_ids": input_ids, "labels": input_ids}
    reference = None
    if rank == 0:
        with torch.no_grad():
            reference = model(**batch).loss.item()

    start = time.perf_counter()
    pm = parallelize(model, tp=config.tp, example_inputs=batch, device=device, seed=config.seed)
    graph = pm.graph_for(**batch)
    compiled_at = time.perf_counter()
    optimizer = torch.optim.AdamW(pm.parameters(), lr=_LR)
    losses = []
    for step in range(1, config.steps + 1):
        loss = pm.train_step(**batch).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        if rank == 0:
            print(f"step {step}  loss {loss:.4f}", flush=True)
    trained_at = time.perf_counter()

    if rank == 0:
        assert reference is not None
        print(
            f"step-1 loss vs unparallelized model: {losses[0]:.6f} vs {reference:.6f} "
            f"(|diff| {abs(losses[0] - reference):.1e})"
        )
        print(
            f"all-reduces per rank graph: {_count_calls(graph, collectives.reduce_from_tp)} forward, "
            f"{_count_calls(graph, collectives.copy_to_tp)} backward"
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
    for name in ("tp", "steps", "batch", "seq"):
        _positive(f"--{name}", getattr(args, name))
    presets.build_model(args.model, device="meta")  # an unknown model fails here, before any worker starts
    backend = _resolve_backend(args.backend, args.tp)
    config = RunConfig(args.model, args.tp, args.steps, args.batch, args.seq, args.seed)
    start = time.perf_counter()
    launch(functools.partial(_run_worker, config), args.tp, backend=backend, timeout_s=args.timeout)
    print(f"wall time {time.perf_counter() - start:.1f} s")
    return 0


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
    run.add_argument("--tp", type=int, default=2, help="tensor-parallel degree = number of workers (default: 2)")
    run.add_argument("--steps", type=int, default=5, help="training steps (default: 5)")
    run.add_argument("--batch", type=int, default=4, help="batch size (default: 4)")
    run.add_argument("--seq", type=int, default=32, help="sequence length (default: 32)")
    run.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: auto")
    run.add_argument("--timeout", type=float, default=300, help="seconds before hung workers are killed (default: 300)")
    run.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default: 0)")
    run.set_defaults(handler=_run)
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
