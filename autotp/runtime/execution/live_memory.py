"""Peak bytes of live tensor storage on any device: what ``torch.cuda.max_memory_allocated`` counts, on CPU.

``PeakLiveBytes`` is a ``TorchDispatchMode``. Every tensor an op returns (forward,
backward through the autograd engine, optimizer, collectives) registers its storage
once, with the storage's size; a storage leaves the count when its last reference dies
(a C++ weak reference, checked before each op registers its outputs). Tensors alive when
the mode is entered (parameters, gradients, optimizer state, inputs) are found through
the garbage collector (after a collection) and count from the start. The peak is taken when an op's
outputs are registered, while its inputs are still alive, as on a GPU.

What it does not see: buffers an op allocates and frees inside its kernel (GPU
attention and cuBLAS workspaces go through the caching allocator and do count on a GPU),
and the caching allocator's rounding of each block to 512 bytes.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.multiprocessing.reductions import StorageWeakRef


class PeakLiveBytes(TorchDispatchMode):
    """``with PeakLiveBytes(device) as m: ...``; then ``m.peak`` and ``m.current`` in bytes.

    ``mark(label)`` records the live bytes at a point (``m.marks``); ``reset_peak()``
    starts a new peak from the current count.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.marks: list[tuple[str, int]] = []

    def __enter__(self) -> PeakLiveBytes:
        gc.collect()  # garbage in reference cycles is not alive
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance on deprecated module attributes warns
            found = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for obj in found:
            self._register(obj)
            if obj.grad is not None:
                self._register(obj.grad)
        self.peak = self.current
        return super().__enter__()

    def _register(self, t: torch.Tensor) -> None:
        if t.device != self.device or t.is_meta or not hasattr(t, "untyped_storage"):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested or functional wrappers: no plain storage
            return
        if storage.device != self.device:  # a FakeTensor's storage is on meta
            return
        key = storage._cdata
        nbytes = storage.nbytes()
        held = self._live.get(key)
        if held is not None and not held[0].expired():
            if held[1] != nbytes:  # resized in place
                self.current += nbytes - held[1]
                self._live[key] = (held[0], nbytes)
            return
        if held is not None:
            self.current -= held[1]
        self._live[key] = (StorageWeakRef(storage), nbytes)
        self.current += nbytes

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.current -= self._live.pop(k)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._register(t)
        self.peak = max(self.peak, self.current)
        return out

    def mark(self, label: str) -> None:
        """Record the live bytes now (after freeing what died since the last op)."""
        self._sweep()
        self.marks.append((label, self.current))

    def reset_peak(self) -> None:
        self._sweep()
        self.peak = self.current
