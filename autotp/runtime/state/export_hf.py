"""``save_pretrained``: stream the full model into HF safetensors files with their index.

Tensors are gathered one at a time (every rank takes part in each gather); rank 0 keeps
only the file being filled, writes it once it reaches ``max_shard_size`` and drops it.
The folder appears atomically (``checkpoint_dcp.atomic_dir``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from autotp.ir.errors import UserInputError
from autotp.runtime.state.checkpoint_dcp import atomic_dir
from autotp.runtime.state.checkpoint_hf import INDEX_FILE, SINGLE_FILE
from autotp.runtime.state.materialize import on_every_rank
from autotp.runtime.state.parameters import ParamChunks, Parameters, get_nested

log = logging.getLogger(__name__)


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string such as ``"5GB"`` or ``"200MB"``."""
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * factor)
    raise UserInputError(f"max_shard_size={size!r} is not a size; use an int or a string like '5GB' or '200MB'")


class _Files:
    """Rank 0's file being filled and the names written so far."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.written: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.limit:
            self.flush()
        self.current[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.current:
            return
        part = f"part-{len(self.written):05d}"
        save_file(self.current, str(self.folder / part), metadata={"format": "pt"})
        self.written.append((part, list(self.current)))
        self.current, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.written)
        if n == 1:
            (self.folder / self.written[0][0]).rename(self.folder / SINGLE_FILE)
            return
        weight_map = {}
        for i, (part, names) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / part).rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def save_pretrained(module: nn.Module, params: Parameters, param_chunks: ParamChunks, source: nn.Module,
                    directory: str | Path, max_shard_size: int | str, dtype: torch.dtype | None) -> None:  # fmt: skip
    limit = parse_size(max_shard_size)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    persistent = set(source.state_dict(keep_vars=True))
    names = list(params.aliases) + [b for b in params.buffer_names if b in persistent]
    with atomic_dir(Path(directory)) as tmp:
        files = _Files(tmp, limit)
        error: OSError | None = None  # rank 0 keeps taking part in the gathers, then every rank raises
        for name in tqdm(names, desc="save_pretrained", unit="tensor", disable=not rank0):
            if name in params.aliases:
                local = get_nested(module, name).detach() if name in params.local_names else None
                full = params.gather(name, local, param_chunks)
                assert full is not None
            else:
                full = get_nested(module, name).detach()
            if rank0 and error is None:
                full = full.to("cpu", dtype if dtype is not None and full.is_floating_point() else full.dtype)
                try:
                    files.add(name, full.contiguous())
                except OSError as e:
                    error = e

        def finish() -> None:
            if error is not None:
                raise UserInputError(f"writing {directory} failed: {error}; the previous contents stay") from error
            if rank0:
                files.finish()
                config = getattr(source, "config", None)
                if config is not None:
                    config.save_pretrained(tmp)
                generation = getattr(source, "generation_config", None)
                if generation is not None:
                    generation.save_pretrained(tmp)

        on_every_rank(finish, f"save_pretrained({directory})")
    log.info("wrote %s", directory)
