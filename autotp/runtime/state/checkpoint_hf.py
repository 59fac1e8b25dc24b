"""Shard-on-read from a local HF safetensors checkpoint.

Every rank reads only the bytes of its own slices, one thread per group of files: each
contiguous run of a slice is read with ``preadv`` straight into a tensor of the slice's
size, so the process never maps the files (their pages stay in the page cache, out of
this process's resident memory) and holds one slice per thread at a time. Checkpoint names map to the model's tensors through
transformers' own conversion mapping (renamings, and the converters that stack
per-expert matrices into a 3-D expert tensor or concatenate them), which is read as a
tree of stack/concatenate nodes over checkpoint tensors: a slice of the model tensor
becomes slices of the checkpoint tensors. Tied names read whichever name the file holds.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from autotp.ir.errors import UserInputError
from autotp.runtime.state.shard_map import ShardSpec

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip


@dataclass(frozen=True)
class Leaf:
    """One tensor stored in a file."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # of the tensor's first byte in the file


@dataclass(frozen=True)
class Join:
    """Checkpoint tensors stacked (a new dim) or concatenated along ``dim``."""

    dim: int
    stack: bool
    parts: tuple[Leaf | Join, ...]


Node = Leaf | Join


def shape_of(node: Node) -> tuple[int, ...]:
    if isinstance(node, Leaf):
        return node.shape
    shapes = [shape_of(p) for p in node.parts]
    out = list(shapes[0])
    if node.stack:
        out.insert(node.dim, len(shapes))
    else:
        out[node.dim] = sum(s[node.dim] for s in shapes)
    return tuple(out)


def leaves(node: Node) -> Iterator[Leaf]:
    if isinstance(node, Leaf):
        yield node
    else:
        for p in node.parts:
            yield from leaves(p)


def describe(node: Node) -> str:
    first = next(leaves(node))
    more = sum(1 for _ in leaves(node)) - 1
    return f"{first.key} in {first.file.name}" + (f" (and {more} more tensors)" if more else "")


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``path``, checked against the file's length, and where the data starts."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size:
                raise UserInputError("header runs past the end of the file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserInputError(f"{path} is not a readable safetensors file ({e}); re-save or re-download it") from e
    if 8 + n + end > size:
        raise UserInputError(f"{path} is truncated: its header needs {8 + n + end} bytes but the file has {size}; "
                         "re-save or re-download it")
    return header, 8 + n


def checkpoint_tensors(root: Path) -> dict[str, Leaf]:
    """Every tensor of the HF checkpoint in ``root`` (one file or an index of several)."""
    if not root.is_dir():
        raise UserInputError(f"checkpoint {root} is not a directory; pass a folder holding {SINGLE_FILE} or {INDEX_FILE}")
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserInputError(f"{index} is not a safetensors index ({e}); re-save the checkpoint") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).exists()]
        if missing:
            raise UserInputError(f"{index} names {len(missing)} file(s) that do not exist: {missing[:3]}; "
                             "copy the whole checkpoint folder")
    elif (root / SINGLE_FILE).exists():
        files = [SINGLE_FILE]
    else:
        found = sorted(p.name for p in root.iterdir())[:8]
        raise UserInputError(f"{root} holds neither {SINGLE_FILE} nor {INDEX_FILE} (found {found}); "
                         "write it with save_pretrained(..., safe_serialization=True)")
    out: dict[str, Leaf] = {}
    for name in files:
        header, data_start = _header(root / name)
        for key, v in header.items():
            if key == "__metadata__":
                continue
            if v["dtype"] not in _DTYPES:
                raise UserInputError(f"{key} in {root / name} has dtype {v['dtype']}, which autotp cannot read")
            out[key] = Leaf(key, root / name, tuple(v["shape"]), _DTYPES[v["dtype"]], data_start + v["data_offsets"][0])
    return out


def check_architecture(root: Path, model: nn.Module) -> None:
    config = getattr(model, "config", None)
    path = root / "config.json"
    if config is None or not path.exists():
        return
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserInputError(f"{path} is not valid JSON ({e})") from e
    want, have = getattr(config, "model_type", None), saved.get("model_type")
    if want and have and want != have:
        raise UserInputError(f"checkpoint {root} is a {have!r} model ({saved.get('architectures')}), but the model is "
                         f"{want!r} ({type(model).__name__}); build the model from {path}")


def _source_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))


def model_sources(model: nn.Module, tensors: dict[str, Leaf]) -> dict[str, Node]:
    """Model tensor name -> how to assemble it from the checkpoint's tensors."""
    transforms: list[Any] = []
    if hasattr(model, "config"):
        from transformers.conversion_mapping import get_model_conversion_mapping

        transforms = list(get_model_conversion_mapping(model))
    out: dict[str, Node] = {}
    groups: dict[str, tuple[Any, dict[int, dict[int, Leaf]]]] = {}
    for key, leaf in tensors.items():
        name = key
        for t in transforms:
            renamed, pattern = t.rename_source_key(name)
            if pattern is None:
                continue
            if not hasattr(t, "operations"):  # a renaming
                name = renamed
                continue
            match = _source_regex(pattern).search(name)
            index = int(match.group(1)) if match and match.groups() else 0
            _, parts = groups.setdefault(renamed, (t, {}))
            parts.setdefault(t.source_patterns.index(pattern), {})[index] = leaf
            name = None
            break
        if name is not None:
            out[name] = leaf
    for target, (t, parts) in groups.items():
        out[target] = _converted(target, t, parts)
    return out


def _converted(target: str, transform: Any, parts: dict[int, dict[int, Leaf]]) -> Node:
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in transform.operations]
    by_source = [tuple(parts[i][k] for k in sorted(parts[i])) for i in sorted(parts)]
    if ops and ops[0][0] == "MergeModulelist":
        merged: list[Node] = [Join(ops[0][1], True, p) for p in by_source]
        ops = ops[1:]
    else:
        merged = [p[0] for p in by_source]
    if not ops and len(merged) == 1:
        return merged[0]
    if len(ops) == 1 and ops[0][0] == "Concatenate":
        return Join(ops[0][1], False, tuple(merged))
    raise UserInputError(f"{target} is stored in the checkpoint in a form that needs transformers' conversion "
                     f"{[o for o, _ in transform.operations]}, which autotp cannot read slice by slice; load the "
                     "model with from_pretrained, save it with save_pretrained in the model's own format, and load that")


def read_box(fd: int, leaf: Leaf, box: list[tuple[int, int]]) -> Tensor:
    """The elements of ``leaf`` inside ``box`` (one (start, stop) per dim), read from the open file ``fd``."""
    out = torch.empty([b - a for a, b in box], dtype=leaf.dtype)
    if out.numel() == 0:
        return out
    size = out.element_size()
    # dims from ``cut`` on are read whole, so each run of the slice is contiguous in the file
    cut = len(box)
    while cut > 0 and box[cut - 1] == (0, leaf.shape[cut - 1]):
        cut -= 1
    inner = math.prod(leaf.shape[cut:])
    if cut == 0:
        starts, run = [()], inner
    else:
        starts = itertools.product(*(range(a, b) for a, b in box[: cut - 1]))
        run = (box[cut - 1][1] - box[cut - 1][0]) * inner
    strides = [math.prod(leaf.shape[d + 1 :]) for d in range(len(leaf.shape))]
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
    for i, index in enumerate(starts):
        first = sum(j * strides[d] for d, j in enumerate(index)) + (box[cut - 1][0] * inner if cut else 0)
        view, at = buffer[i * run * size : (i + 1) * run * size], leaf.offset + first * size
        while len(view):
            n = os.preadv(fd, [view], at)
            if n == 0:
                raise UserInputError(f"{leaf.file} ended while reading {leaf.key}; re-save or re-download it")
            view, at = view[n:], at + n
    return out


class _Reader:
    """The checkpoint's files, opened once and read by every worker thread (``preadv`` is positional)."""

    def __init__(self) -> None:
        self.files: dict[Path, int] = {}
        self.lock = threading.Lock()

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)

    def fd(self, file: Path) -> int:
        with self.lock:
            if file not in self.files:
                self.files[file] = os.open(file, os.O_RDONLY)
            return self.files[file]

    def read(self, node: Node, box: list[tuple[int, int]]) -> Tensor:
        if isinstance(node, Leaf):
            return read_box(self.fd(node.file), node, box)
        d = node.dim
        if node.stack:
            a, b = box[d]
            rest = box[:d] + box[d + 1 :]
            return torch.stack([self.read(node.parts[i], rest) for i in range(a, b)], dim=d)
        pieces, offset = [], 0
        a, b = box[d]
        for part in node.parts:
            n = shape_of(part)[d]
            lo, hi = max(a, offset), min(b, offset + n)
            if lo < hi:
                pieces.append(self.read(part, box[:d] + [(lo - offset, hi - offset)] + box[d + 1 :]))
            offset += n
        return torch.cat(pieces, dim=d)


@dataclass(frozen=True)
class LoadJob:
    """Fill ``local`` (this rank's tensor with ``spec``) from ``source``."""

    spec: ShardSpec
    local: Tensor
    source: Node


def check_job(job: LoadJob) -> None:
    have = shape_of(job.source)
    if have != job.spec.global_shape:
        raise UserInputError(f"{job.spec.name}: the checkpoint holds shape {list(have)} ({describe(job.source)}) but the "
                         f"model expects {list(job.spec.global_shape)}; the checkpoint is for another configuration")
    for leaf in leaves(job.source):
        src, dst = leaf.dtype, job.local.dtype
        if src != dst and not (src.is_floating_point and dst.is_floating_point):
            raise UserInputError(f"{job.spec.name}: {leaf.key} in {leaf.file.name} is {src}, which does not convert to "
                             f"the model's {dst}; build the model with a matching dtype")


def read_jobs(jobs: list[LoadJob], threads: int, progress: bool) -> int:
    """Fill every job's local tensor with its slices, ``threads`` tensors at a time; returns the bytes read."""
    bar = tqdm(total=len(jobs), desc="load checkpoint", unit="tensor", disable=not progress)
    reader, lock = _Reader(), threading.Lock()

    def run(job: LoadJob) -> int:
        spec, read = job.spec, 0
        for piece in spec.pieces:
            offsets, sizes = spec.box(piece)
            data = reader.read(job.source, [(o, o + s) for o, s in zip(offsets, sizes)])
            read += data.numel() * data.element_size()
            with torch.no_grad():
                spec.local_view(job.local, piece).copy_(data)
        with lock:
            bar.update(1)
        return read

    # in file order, so that cold reads go through each file front to back
    ordered = sorted(jobs, key=lambda j: (str(next(leaves(j.source)).file), next(leaves(j.source)).offset))
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(jobs)))) as pool:
            total = sum(pool.map(run, ordered))
    finally:
        reader.close()
        bar.close()
    log.info("read %d tensors, %.1f MB", len(jobs), total / 1e6)
    return total
