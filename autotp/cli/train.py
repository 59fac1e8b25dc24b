"""``autotp run``: train a preset or a local checkpoint on local worker processes.

The model trains in eval mode (dropout off), so that its first loss can be compared with
the unparallelized model's. Without ``--data`` every step trains on one fixed random batch
(a demo: the loss falls because the batch is memorized). With ``--data FILE`` the steps read ``autotp.cli.data``'s
packed, shuffled, dp-sharded sequences and the held-out split is evaluated. Either way
the learning rate warms up linearly over ``--warmup`` steps, then follows a cosine down to
``--min-lr-ratio`` of ``--lr`` at step ``--total-steps`` (default: the last step of this
run), and rank 0 prints one progress line per step and writes the loss curve
(``autotp.cli.curves``) when there is an output folder.

Tokens/s is the global batch's tokens over the step's wall time (forward, backward,
optimizer). MFU counts the model FLOPs of PaLM's appendix B, 6·N + 12·L·h·s per token
(N the parameters less an untied input embedding; L layers, h hidden size, s sequence
length), against the peak of the device's built-in profile (``cost_model/hardware.py``)
times the world size.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging as hf_logging

from autotp import presets
from autotp.api import parallelize
from autotp.cli import curves
from autotp.cli.checkpoint import run_weights
from autotp.cli.data import PackedData, tokenize
from autotp.cli.commands import check_memory, positive, positive_timeout, resolve_backend
from autotp.cli.progress import progress
from autotp.cost_model.hardware import CPU, HardwareProfile, profile_for_gpu
from autotp.ir import ops
from autotp.ir.errors import UserInputError
from autotp.ir.rank_groups import groups_of, rank_groups
from autotp.runtime.processes.launcher import launch


@dataclass(frozen=True)
class RunConfig:
    model: str
    tp: int
    steps: int
    batch: int
    seq: int
    seed: int
    pp: int = 1
    dp: int = 1
    lr: float = 1e-3
    warmup: int = 0
    min_lr_ratio: float = 0.1
    total_steps: int | None = None
    weights: Path | None = None  # the safetensors folder the weights come from; None: random (or --resume)
    save: Path | None = None
    save_checkpoint: Path | None = None
    resume: Path | None = None
    tokens: Path | None = None  # the tokenized --data (.npy)
    eval_fraction: float = 0.0
    eval_every: int = 0
    out: Path | None = None


def lr_at(step: int, base: float, warmup: int, total: int, min_ratio: float) -> float:
    """The learning rate of 1-based ``step``: linear warm-up to ``base`` over ``warmup`` steps,
    then a cosine from ``base`` (the step after warm-up) to ``min_ratio * base`` (step ``total``)."""
    if step <= warmup:
        return base * step / warmup
    progress = min(1.0, (step - warmup - 1) / max(1, total - warmup - 1))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def flops_per_token(model: nn.Module, seq: int) -> float:
    """PaLM's model FLOPs per trained token (module docstring)."""
    params = sum(p.numel() for p in model.parameters())
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding, head = (get_in() if get_in else None), (get_out() if get_out else None)
    if isinstance(embedding, nn.Embedding) and (head is None or head.weight is not embedding.weight):
        params -= embedding.weight.numel()
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    layers, hidden = getattr(text, "num_hidden_layers", 0), getattr(text, "hidden_size", 0)
    return 6 * params + 12 * layers * hidden * seq


def _peak(device: torch.device) -> HardwareProfile:
    return (profile_for_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None) or CPU


def _count_calls(graph: torch.fx.GraphModule, target: object) -> int:
    return sum(1 for node in graph.graph.nodes if node.op == "call_function" and node.target is target)


class _Batches:
    """The batch of each step: ``--data``'s rows for this dp rank, else one fixed random batch."""

    def __init__(self, config: RunConfig, model: nn.Module, rank: int, world: int, device: torch.device) -> None:
        self.config, self.device = config, device
        self.data = PackedData.load(config.tokens, config.seq, config.eval_fraction) if config.tokens else None
        groups = rank_groups(world, tp=config.tp, pp=config.pp)
        self.dp_rank = groups_of(rank, groups)["dp"].index(rank)
        if self.data is None:
            # Uniform random tokens are unlearnable (their best loss is ln(vocab), where training
            # starts), so every step trains on the same batch and the loss visibly falls.
            self.fixed = presets.example_inputs(model, config.batch, config.seq, seed=config.seed)["input_ids"]

    def _tensor(self, rows) -> dict[str, torch.Tensor]:  # noqa: ANN001 - numpy rows
        ids = torch.as_tensor(rows, dtype=torch.long).to(self.device)
        return {"input_ids": ids, "labels": ids}

    def train(self, step: int, local: bool = True) -> dict[str, torch.Tensor]:
        """Step ``step`` (1-based): this dp rank's rows (``local``), or the whole global batch."""
        c = self.config
        if self.data is None:
            return self._tensor(self.fixed)
        if not local:
            return self._tensor(self.data.train_batch(step - 1, c.batch, c.seed))
        return self._tensor(self.data.train_batch(step - 1, c.batch, c.seed, self.dp_rank, c.dp))

    def held_out(self) -> list[dict[str, torch.Tensor]]:
        if self.data is None:
            return []
        return [self._tensor(rows) for rows in self.data.eval_batches(self.config.batch // self.config.dp)]


@torch.no_grad()
def _evaluate(pm: nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    training = pm.training
    pm.eval()
    try:
        return sum(float(pm(**b).loss) for b in batches) / len(batches)
    finally:
        pm.train(training)


def _run_worker(config: RunConfig, rank: int, world: int) -> None:
    """One rank of ``autotp run``; rank 0 reports."""
    hf_logging.set_verbosity_error()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    torch.manual_seed(config.seed)
    on_meta = config.weights is not None or config.resume is not None  # each rank then allocates only its shards
    model = presets.build_model(config.model, device="meta" if on_meta else device, dtype=torch.float32)
    batches = _Batches(config, model, rank, world, device)
    micro = config.pp
    example = {k: v[: config.batch // (config.dp * micro)] for k, v in batches.train(1).items()}
    reference = None
    if rank == 0 and not on_meta:
        with torch.no_grad():
            reference = model(**batches.train(1, local=False)).loss.item()
    flops = flops_per_token(model, config.seq) * config.batch * config.seq
    start = time.perf_counter()
    pm = parallelize(model, tp=config.tp, pp=config.pp, example_inputs=example, device=device, seed=config.seed,
                     checkpoint=config.weights)  # fmt: skip
    graph = pm.graph_for(**example)
    compiled_at = time.perf_counter()
    optimizer = torch.optim.AdamW(pm.parameters(), lr=config.lr)
    first = 0
    if config.resume is not None:
        first = pm.load_checkpoint(config.resume, optimizer=optimizer) or 0
    last = first + config.steps
    total = config.total_steps or last
    held_out = batches.held_out()
    every = config.eval_every or max(1, config.steps // 10)
    peak = _peak(device)
    csv_path = config.out / "loss.csv" if config.out is not None else None
    rows = curves.read_rows(csv_path, first) if csv_path is not None and rank == 0 else []
    losses = []
    for step in range(first + 1, last + 1):
        lr = lr_at(step, config.lr, config.warmup, total, config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = batches.train(step)
        began = time.perf_counter()
        loss = pm.train_step(**batch, num_microbatches=micro, batch_is_local=batches.data is not None).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        took = time.perf_counter() - began
        losses.append(loss)
        eval_loss = _evaluate(pm, held_out) if held_out and (step % every == 0 or step == last) else None
        if rank == 0:
            tokens_s = config.batch * config.seq / took
            mfu = flops / took / (world * peak.mfu_flops_per_s)
            line = f"step {step}  loss {loss:.4f}  lr {lr:.2e}  {tokens_s:.4g} tokens/s  MFU {mfu:.2%}"
            print(line + (f"  held-out loss {eval_loss:.4f}" if eval_loss is not None else ""), flush=True)
            rows.append({"step": step, "loss": f"{loss:.6f}", "lr": f"{lr:.6g}", "tokens_per_s": f"{tokens_s:.6g}",
                         "eval_loss": "" if eval_loss is None else f"{eval_loss:.6f}"})  # fmt: skip
    trained_at = time.perf_counter()
    if config.save_checkpoint is not None:
        pm.save_checkpoint(config.save_checkpoint, optimizer=optimizer, step=last)
    if config.save is not None:
        pm.save_pretrained(config.save)
    if rank != 0:
        return
    if csv_path is not None:
        curves.write_csv(csv_path, rows)
        curves.write_png(csv_path.with_suffix(".png"), rows, f"{config.model}: tp={config.tp} pp={config.pp} dp={config.dp}")
        print(f"wrote {csv_path} and {csv_path.with_suffix('.png')}")
    for path in (config.save_checkpoint, config.save):
        if path is not None:
            print(f"wrote {path}")
    if reference is not None:
        print(f"step-1 loss vs the unparallelized model on the same batch and weights: {losses[0]:.6f} vs "
              f"{reference:.6f} (|diff| {abs(losses[0] - reference):.1e})")  # fmt: skip
    print(f"all-reduces per rank graph: {_count_calls(graph, ops.REDUCE_FROM_TP)} forward, "
          f"{_count_calls(graph, ops.COPY_TO_TP)} backward")  # fmt: skip
    print(f"{config.model}, tp={config.tp} pp={config.pp} dp={config.dp} on {dist.get_backend()}: compile "
          f"{compiled_at - start:.2f} s, {config.steps} steps {trained_at - compiled_at:.2f} s; MFU against "
          f"{world} x {peak.name} at {peak.mfu_flops_per_s / 1e12:.3g} TFLOP/s", flush=True)  # fmt: skip


def _check_args(args: argparse.Namespace) -> None:
    for name in ("tp", "pp", "dp", "steps", "batch", "seq"):
        positive(f"--{name}", getattr(args, name))
    positive_timeout(args.timeout)
    if args.batch % (args.dp * args.pp):
        raise UserInputError(f"--batch {args.batch} does not split over --dp {args.dp} ranks x {args.pp} microbatches "
                             f"(one per pipeline stage); use a multiple of {args.dp * args.pp}")  # fmt: skip
    if not 0 <= args.eval_fraction < 1:
        raise UserInputError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction:g}")
    if args.warmup < 0 or args.lr <= 0:
        raise UserInputError(f"--warmup must be >= 0 and --lr > 0, got {args.warmup} and {args.lr:g}")


def _prepare_data(args: argparse.Namespace, model: nn.Module) -> Path | None:
    """Tokenize ``--data`` into the output folder and check that it makes the batches asked for."""
    if args.data is None:
        return None
    folder = args.tokenizer or (Path(args.model) if Path(args.model).is_dir() else None)
    tokens = args.out / "tokens.npy"
    progress(f"reading {args.data}")
    count = tokenize(args.data, tokens, model.config.get_text_config().vocab_size, folder, args.data_field, args.token_dtype)
    packed = PackedData.load(tokens, args.seq, args.eval_fraction)
    local = args.batch // args.dp
    if packed.train_rows < args.batch:
        raise UserInputError(f"--data {args.data} makes {packed.train_rows} training sequences of --seq {args.seq} "
                             f"({count} tokens), fewer than one --batch of {args.batch}; use more data or a smaller "
                             "--batch or --seq")  # fmt: skip
    if args.eval_fraction and packed.held_out < local:
        raise UserInputError(f"the held-out split has {packed.held_out} sequences, fewer than one evaluation batch of "
                             f"{local} (--batch / --dp); raise --eval-fraction, or pass --eval-fraction 0")  # fmt: skip
    progress(f"{count} tokens: {packed.train_rows} training and {packed.held_out} held-out sequences of {args.seq}")
    return tokens


def run_command(args: argparse.Namespace) -> int:
    _check_args(args)
    meta = presets.build_model(args.model, device="meta")  # an unknown model fails here, before any worker starts
    weights = run_weights(args.model, args.random_init, args.resume)
    if args.data is not None and args.out is None:
        args.out = Path("autotp-run")
    tokens = _prepare_data(args, meta)
    world = args.tp * args.pp * args.dp
    backend = resolve_backend(args.backend, world)
    on_meta = weights is not None or args.resume is not None  # the workers allocate only their shards
    check_memory(args.model, sum(p.numel() for p in meta.parameters()), world, backend, on_meta)
    config = RunConfig(args.model, args.tp, args.steps, args.batch, args.seq, args.seed, args.pp, args.dp, args.lr,
                       args.warmup, args.min_lr_ratio, args.total_steps, weights, args.save, args.save_checkpoint,
                       args.resume, tokens, args.eval_fraction, args.eval_every, args.out)  # fmt: skip
    source = ("the checkpoint in --resume" if args.resume else f"{weights}'s safetensors" if weights
              else "random weights")  # fmt: skip
    progress(f"starting {world} {backend} workers; each builds {args.model} from {source} and compiles its rank")
    start = time.perf_counter()
    launch(functools.partial(_run_worker, config), world, backend=backend, timeout_s=args.timeout)
    print(f"wall time {time.perf_counter() - start:.1f} s")
    return 0
