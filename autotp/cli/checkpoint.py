"""Checkpoints on the command line: ``autotp run --model <HF dir> --save ...`` and ``autotp convert``."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autotp.ir.errors import UserInputError
from autotp import presets
from autotp.api import parallelize
from autotp.runtime.checkpoint_hf import INDEX_FILE, SINGLE_FILE
from autotp.runtime.launcher import launch


def hf_weights(model: str) -> Path | None:
    """``model`` as a local HF checkpoint folder (config and safetensors), else None."""
    path = Path(model)
    return path if (path / SINGLE_FILE).exists() or (path / INDEX_FILE).exists() else None


def is_dcp(path: Path) -> bool:
    return (path / ".metadata").exists()


def saved_dtype(folder: Path) -> torch.dtype | None:
    """The dtype that ``config.json`` in ``folder`` records, if any."""
    config = json.loads((folder / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


def _convert_worker(src: Path, dst: Path, tp: int, max_shard_size: str, rank: int, world: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = saved_dtype(src)
    model = presets.build_model(str(src), device="meta", dtype=dtype)
    inputs = {k: v.to(device) for k, v in presets.example_inputs(model, 1, 8).items()}
    if is_dcp(src):
        pm = parallelize(model, tp=tp, example_inputs=inputs, device=device)
        pm.load_checkpoint(src)
        pm.save_pretrained(dst, max_shard_size=max_shard_size)
    else:
        pm = parallelize(model, tp=tp, example_inputs=inputs, device=device, checkpoint=src)
        pm.save_checkpoint(dst)
    if rank == 0:
        print(f"wrote {dst}")


def convert_command(args: argparse.Namespace) -> int:
    src: Path = args.src
    if not (src / "config.json").exists():
        raise UserInputError(f"{src} has no config.json; convert reads the architecture from it")
    if not is_dcp(src) and hf_weights(str(src)) is None:
        raise UserInputError(f"{src} is neither a DCP checkpoint (.metadata) nor an HF safetensors folder")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= args.tp else "gloo"
    launch(functools.partial(_convert_worker, src, args.dst, args.tp, args.max_shard_size), args.tp,
           backend=backend, timeout_s=args.timeout)  # fmt: skip
    return 0


def build_for_run(model_name: str, device: torch.device) -> tuple[nn.Module, Path | None]:
    """The model of ``autotp run``: on meta with its checkpoint folder when ``model_name`` holds
    weights, else a preset built with random weights on ``device``."""
    weights = hf_weights(model_name)
    if weights is not None:
        return presets.build_model(model_name, device="meta", dtype=torch.float32), weights
    return presets.build_model(model_name, device=device, dtype=torch.float32), None
