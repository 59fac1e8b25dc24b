"""Checkpoints on the command line: ``autotp run --model <HF dir> --save ...`` and ``autotp convert``."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.ir.errors import UserInputError
from autotp import presets
from autotp.api import parallelize
from autotp.runtime.state.checkpoint_hf import INDEX_FILE, SINGLE_FILE
from autotp.runtime.processes.launcher import launch


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
    from autotp.cli.commands import positive, positive_timeout

    positive("--tp", args.tp)
    positive_timeout(args.timeout)
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


_FOREIGN_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf", "*.safetensors")


def run_weights(model: str, random_init: bool, resume: Path | None) -> Path | None:
    """The folder ``autotp run`` reads ``model``'s weights from (HF safetensors), or None when
    they start random (a preset, or ``--random-init``) or come from ``--resume``. A folder
    without safetensors weights is refused unless one of those says what to start from."""
    weights = hf_weights(model)
    if random_init or resume is not None or not Path(model).is_dir():
        return None
    if weights is None:
        found = sorted({p.name for pattern in _FOREIGN_WEIGHTS for p in Path(model).glob(pattern)})
        held = f"holds {', '.join(found[:4])}, which autotp does not read" if found else "holds no weights"
        raise UserInputError(
            f"{model} {held} ({SINGLE_FILE} or {INDEX_FILE} expected); save the model there with "
            "save_pretrained(...) (safetensors), or pass --random-init to train it from random weights"
        )
    return weights
