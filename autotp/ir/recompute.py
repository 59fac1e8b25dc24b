"""Activation recomputation of a region of the rank graph (``passes/recompute_layers``).

``run_recomputed(region, *inputs)`` runs ``region`` under torch's non-reentrant
``checkpoint``: the forward keeps only the region's inputs; the backward runs the region
again, with grad, and backpropagates through that copy. Collectives inside the region run
again in the backward too, on every rank of their group alike (each rank recomputes the
same regions in the same order).

**RNG.** A recomputed dropout must draw the mask its forward drew. ``checkpoint`` restores
the default CPU and CUDA generators (``preserve_rng_state``); the generators autotp's own
dropout draws from (``autotp::tp_rand``: the tp streams, kept by the runtime) are restored
through ``RNG_STATE_HOOKS``: the runtime registers a ``(snapshot, restore)`` pair, the
forward takes a snapshot as the region starts, the recomputation restores it, and the
state at the start of the recomputation is put back after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.fx import GraphModule
from torch.utils.checkpoint import checkpoint

RNG_STATE_HOOKS: list[tuple[Callable[[], object], Callable[[object], None]]] = []
"""``(snapshot, restore)`` of generators that ``checkpoint`` does not restore itself."""

def _snapshot() -> list[object]:
    return [snapshot() for snapshot, _ in RNG_STATE_HOOKS]


def _restore(states: list[object]) -> None:
    for (_, restore), state in zip(RNG_STATE_HOOKS, states, strict=True):
        restore(state)


def _rng_contexts() -> tuple[Any, Any]:
    """``checkpoint``'s ``context_fn``: the forward snapshots the hooked generators, the
    recomputation runs from that snapshot and puts the later state back after."""
    taken: list[list[object]] = []

    @contextmanager
    def forward() -> Iterator[None]:
        taken.append(_snapshot())
        yield

    @contextmanager
    def recompute() -> Iterator[None]:
        now = _snapshot()
        _restore(taken[0])
        try:
            yield
        finally:
            _restore(now)

    return forward(), recompute()


def run_recomputed(region: GraphModule, *inputs: Any) -> Any:
    """``region(*inputs)``, its activations recomputed in the backward (module docstring)."""
    return checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True, context_fn=_rng_contexts)
