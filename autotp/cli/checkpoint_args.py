"""The checkpoint options of ``autotp run`` and the ``convert`` command (parsing only: no torch import)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path


def _convert(args: argparse.Namespace) -> int:
    return importlib.import_module("autotp.cli.checkpoint").convert_command(args)


def add_run_checkpoint_options(run: argparse.ArgumentParser) -> None:
    run.add_argument("--save", type=Path, help="after training, write the model here as HF safetensors + config.json "
                     "(loadable by transformers' from_pretrained and by autotp run --model)")  # fmt: skip
    run.add_argument("--save-checkpoint", type=Path, help="after training, write a resumable DCP checkpoint "
                     "(model, AdamW state, step) here; it loads at any --tp/--pp")  # fmt: skip
    run.add_argument("--resume", type=Path, help="start from this DCP checkpoint (written by --save-checkpoint) "
                     "instead of the model's weights; --model must name the same architecture")  # fmt: skip


def add_convert_command(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert between an HF safetensors folder and a DCP checkpoint (either direction)",
        description="SRC is an HF folder (config.json + safetensors): write a DCP checkpoint to DST. SRC is a DCP "
        "checkpoint of autotp (it holds config.json): write HF safetensors + config.json to DST. --tp workers "
        "share the work; no worker holds more than its shards plus one gathered tensor.",
    )
    convert.add_argument("src", type=Path, metavar="SRC")
    convert.add_argument("dst", type=Path, metavar="DST")
    convert.add_argument("--tp", type=int, default=1, help="worker processes (tensor-parallel degree; default: 1)")
    convert.add_argument("--max-shard-size", default="5GB", help="largest HF file written (default: 5GB)")
    convert.add_argument("--timeout", type=float, default=3600, help="seconds before workers are killed")
    convert.set_defaults(handler=_convert)
