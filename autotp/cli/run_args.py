"""The options of ``autotp run`` (parsing only: no torch import)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from autotp import presets
from autotp.cli.checkpoint_args import add_run_checkpoint_options


def _run(args: argparse.Namespace) -> int:
    return importlib.import_module("autotp.cli.train").run_command(args)


def add_run_command(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="train a preset or a local checkpoint on tp*pp*dp local worker processes",
        description="Launch tp*pp*dp workers (gloo on CPU, NCCL when there are enough GPUs), parallelize the model, "
        "train it with AdamW (linear warm-up, then cosine decay) and print one line per step (loss, learning rate, "
        "tokens/s, MFU). Without --data every step trains on one fixed random batch (a demo) and the first loss is "
        "compared with the unparallelized model's; with --data the steps read packed, shuffled sequences of FILE, "
        "sharded over the dp ranks, and a held-out split is evaluated. The loss curve goes to --out as loss.csv "
        "and loss.png.",
    )
    run.add_argument("--model", default="llama-tiny", help=f"a preset ({', '.join(presets.preset_names())}) or a local "
                     "folder holding config.json and model.safetensors (default: llama-tiny)")  # fmt: skip
    run.add_argument("--random-init", action="store_true",
                     help="start from random weights when --model is a folder without safetensors weights")  # fmt: skip
    run.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: 2)")
    run.add_argument("--pp", type=int, default=1, help="pipeline stages (default: 1)")
    run.add_argument("--dp", type=int, default=1, help="data-parallel replicas; tp*pp*dp workers are started (default: 1)")
    run.add_argument("--steps", type=int, default=5, help="training steps of this run (default: 5)")
    run.add_argument("--batch", type=int, default=4, help="global batch: sequences per step over all dp ranks (default: 4)")
    run.add_argument("--seq", type=int, default=32, help="sequence length (default: 32)")
    run.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (default: 1e-3)")
    run.add_argument("--warmup", type=int, default=0, help="steps of linear warm-up from 0 to --lr (default: 0)")
    run.add_argument("--min-lr-ratio", type=float, default=0.1,
                     help="the cosine decay ends at this fraction of --lr (default: 0.1)")  # fmt: skip
    run.add_argument("--total-steps", type=int, help="the step where the cosine decay ends (default: the last step "
                     "of this run; pass the whole run's length when it is split by --resume)")  # fmt: skip
    run.add_argument("--data", type=Path, metavar="FILE", help="train on FILE: .txt (documents separated by blank "
                     "lines) or .jsonl, tokenized with the tokenizer saved in --model's folder (or --tokenizer), or "
                     "token ids as .npy or .bin (with --token-dtype); default: one fixed random batch")  # fmt: skip
    run.add_argument("--data-field", default="text", help="the JSONL key that holds the text (default: text)")
    run.add_argument("--tokenizer", type=Path, metavar="DIR", help="folder of a saved tokenizer (default: --model's)")
    run.add_argument("--token-dtype", choices=("uint16", "uint32", "int32", "int64"),
                     help="the width of the ids in a .bin file (nanoGPT writes uint16)")  # fmt: skip
    run.add_argument("--eval-fraction", type=float, default=0.05,
                     help="the share of --data's sequences held out for evaluation (default: 0.05)")  # fmt: skip
    run.add_argument("--eval-every", type=int, default=0,
                     help="evaluate the held-out split every N steps and at the last (default: steps/10)")  # fmt: skip
    run.add_argument("--out", type=Path, help="write loss.csv, loss.png and the tokenized data here "
                     "(default: autotp-run with --data, else nothing)")  # fmt: skip
    run.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="default: auto")
    run.add_argument("--timeout", type=float, default=300, help="seconds before hung workers are killed (default: 300)")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights, the demo batch and the data order (default: 0)")
    add_run_checkpoint_options(run)
    run.set_defaults(handler=_run)
