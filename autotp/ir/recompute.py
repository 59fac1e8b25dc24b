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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

RNG_STATE_HOOKS: list[tuple[Callable[[], object], Callable[[object], None]]] = []
"""``(snapshot, restore)`` of generators that ``checkpoint`` does not restore itself."""

def _hooked_states() -> list[object]:
    return [snapshot() for snapshot, _ in RNG_STATE_HOOKS]


def _restore_hooked(states: list[object]) -> None:
    for (_, restore), state in zip(RNG_STATE_HOOKS, states, strict=True):
        restore(state)


def _rng_contexts() -> tuple[Any, Any]:
    """``checkpoint``'s ``context_fn``: the forward snapshots the hooked generators, the
    recomputation runs from that snapshot and puts the later state back after."""
    taken: list[list[object]] = []

    @contextmanager
    def forward() -> Iterator[None]:
        taken.append(_hooked_states())
        yield

    @contextmanager
    def recompute() -> Iterator[None]:
        now = _hooked_states()
        _restore_hooked(taken[0])
        try:
            yield
        finally:
            _restore_hooked(now)

    return forward(), recompute()


def _keep_random(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_random_numbers() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_keep_random)


def run_recomputed(region: GraphModule, *inputs: Any) -> Any:
    """``region(*inputs)``, its activations recomputed in the backward (module docstring).
    Under ``torch.compile`` the checkpoint becomes AOT autograd's recompute tags, and the
    partitioner would draw a random op's numbers again: a selective-checkpoint policy saves
    the output of every op tagged ``nondeterministic_seeded`` (``autotp::tp_rand``, float32
    numbers the size of the dropped tensor) and recomputes the rest."""
    if torch.compiler.is_compiling():
        return checkpoint(region, *inputs, use_reentrant=False, context_fn=_save_random_numbers)
    return checkpoint(region, *inputs, use_reentrant=False, preserve_rng_state=True, context_fn=_rng_contexts)
