"""Pipeline schedules as data: the order in which each rank runs forwards and backwards.

A rank (pipeline stage) ``r`` of ``pp`` holds ``vpp`` model chunks; chunk ``c`` is
virtual stage ``c*pp + r`` of the ``pp*vpp`` the model is cut into. An ``Action``
is one forward (``F``) or backward (``B``) of one chunk on one microbatch. Zero-bubble
schedules split the backward: ``B`` then computes only the gradient of the chunk's
inputs (what the previous stage waits for) and a later ``W`` the gradients of its weights.

Text forms:
- actions: ``F0.3`` is the forward of chunk 0 on microbatch 3, ``B1.0`` the
  backward of chunk 1 on microbatch 0, ``W0.2`` the weight gradients of chunk 0 on
  microbatch 2; tokens are separated by spaces and ``parse`` reads them back.
- Megatron's: one integer per action, ``c+1`` for a forward of chunk ``c`` and
  ``-(c+1)`` for its backward; microbatches are implicit. It has no ``W``.

Schedules, with ``m`` microbatches:
- ``gpipe``: every forward in microbatch order, then every backward in microbatch order.
- ``one_f_one_b`` (1F1B): rank ``r`` runs ``w = min(pp - r - 1, m)`` warmup forwards,
  then alternates forward ``w+i`` and backward ``i``, then runs the ``w`` backwards left.
- ``interleaved_one_f_one_b`` (Megatron's interleaved 1F1B): ``m*vpp`` forwards and
  as many backwards. Forward step ``k`` runs chunk ``(k // pp) % vpp`` and backward
  step ``k`` chunk ``vpp - 1 - (k // pp) % vpp``, both on microbatch
  ``(k // (pp*vpp))*pp + k % pp`` (microbatches go in groups of ``pp`` per chunk).
  Rank ``r`` runs ``w = min((pp - r - 1)*2 + (vpp - 1)*pp, m*vpp)`` warmup forwards,
  then alternates forward ``w+i`` and backward ``i``, then the ``w`` backwards left.
- ``zbh1`` (ZB-H1, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of
  forwards and input-gradient backwards; rank ``r`` runs the weight gradients ``W``
  of microbatch ``i`` right after the backward of microbatch ``i + r``, and its last
  ``r`` of them at the end. The last rank's drain, where earlier ranks would wait for
  its backwards, is filled with their deferred ``W``; every rank then holds at most
  ``pp`` microbatches between ``F`` and ``W`` (1F1B's peak, rank 0's).

``simulate`` runs all ranks' orders against each other with unit-time actions
(a fused backward ``B`` counts as one step, like a forward); its step count gives the
bubble: ``steps / (2*vpp*m) - 1`` of the busy time, which is ``(pp-1)/m`` for 1F1B and
``(pp-1)/(m*vpp)`` for interleaved 1F1B. With ``F``, ``B`` and ``W`` one step each,
ZB-H1 takes ``3*m + pp - 1`` steps, a bubble of ``(pp-1)/(3*m)``; 1F1B with the same
three steps per microbatch takes ``3*(m + pp - 1)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from autotp.ir.errors import UserInputError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1")

_ACTION = re.compile(r"([FBW])(\d+)\.(\d+)")


@dataclass(frozen=True)
class Action:
    """The forward (``F``), backward (``B``) or weight gradients (``W``) of local model
    ``chunk`` on ``microbatch``."""

    kind: Literal["F", "B", "W"]
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"

    @property
    def megatron(self) -> int:
        """Megatron's integer: ``chunk + 1`` for a forward, ``-(chunk + 1)`` for a backward."""
        if self.kind == "W":
            raise UserInputError(f"Megatron's notation has no weight-gradient action ({self}); use the actions form (autotp schedule --format actions)")
        return self.chunk + 1 if self.kind == "F" else -(self.chunk + 1)


def format_actions(actions: Sequence[Action]) -> str:
    """Space-separated ``F0.3`` tokens; ``parse`` reads them back."""
    return " ".join(map(str, actions))


def format_megatron(actions: Sequence[Action]) -> str:
    """Space-separated Megatron integers (``1 2 -2 -1`` ...)."""
    return " ".join(str(a.megatron) for a in actions)


def parse(text: str) -> list[Action]:
    """The actions of ``format_actions`` text."""
    actions = []
    for token in text.split():
        match = _ACTION.fullmatch(token)
        if match is None:
            raise UserInputError(f"cannot parse schedule action {token!r}: expected F<chunk>.<microbatch>, B<...> or W<...>")
        kind, chunk, microbatch = match.groups()
        actions.append(Action(kind, int(chunk), int(microbatch)))  # type: ignore[arg-type]
    return actions


def default_schedule(vpp: int) -> str:
    """``interleaved`` when a rank holds several chunks, else ``1f1b``."""
    return "interleaved" if vpp > 1 else "1f1b"


def check_schedule(pp: int, vpp: int, microbatches: int, schedule: str | None = None) -> None:
    """Raise ValueError unless the pipeline runtime can run ``schedule`` (default: ``default_schedule``).

    Rules: degrees and microbatches are at least 1; gpipe, 1f1b and zbh1 hold one chunk per
    rank (vpp = 1); 1f1b and zbh1 need microbatches >= pp; interleaved needs pp >= 2, vpp >= 2
    and microbatches a multiple of pp.
    """
    schedule = default_schedule(vpp) if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise UserInputError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    for name, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if value < 1:
            raise UserInputError(f"{name} must be at least 1, got {value}")
    if schedule != "interleaved" and vpp != 1:
        raise UserInputError(f"the {schedule} schedule runs one chunk per rank, got vpp={vpp}: use vpp=1 or interleaved")
    if schedule in ("1f1b", "zbh1") and microbatches < pp:
        raise UserInputError(
            f"{'1F1B' if schedule == '1f1b' else 'ZB-H1'} needs at least as many microbatches as pipeline stages: got {microbatches} for pp={pp}; "
            f"use {pp} or more microbatches, or the gpipe schedule"
        )
    if schedule == "interleaved":
        if pp < 2 or vpp < 2:
            raise UserInputError(f"interleaved 1F1B needs pp >= 2 and vpp >= 2, got pp={pp}, vpp={vpp}: use 1f1b")
        if microbatches % pp:
            raise UserInputError(
                f"interleaved 1F1B needs the microbatches to be a multiple of pp={pp}, got {microbatches}: "
                f"use {', '.join(str(pp * k) for k in range(1, 4))}, ..."
            )


def _check_rank(pp: int, microbatches: int, rank: int) -> None:
    if pp < 1 or microbatches < 1:
        raise UserInputError(f"pp and microbatches must be at least 1, got pp={pp}, microbatches={microbatches}")
    if not 0 <= rank < pp:
        raise UserInputError(f"rank {rank} is not a pipeline stage of pp={pp} (0..{pp - 1})")


def gpipe(pp: int, microbatches: int, rank: int) -> list[Action]:
    """All forwards, then all backwards, each in microbatch order."""
    _check_rank(pp, microbatches, rank)
    return [Action("F", 0, i) for i in range(microbatches)] + [Action("B", 0, i) for i in range(microbatches)]


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup :]


def one_f_one_b(pp: int, microbatches: int, rank: int) -> list[Action]:
    """1F1B: ``min(pp - rank - 1, microbatches)`` warmup forwards, then alternate, then drain."""
    _check_rank(pp, microbatches, rank)
    forwards = [Action("F", 0, i) for i in range(microbatches)]
    backwards = [Action("B", 0, i) for i in range(microbatches)]
    return _one_f_one_b_order(forwards, backwards, min(pp - rank - 1, microbatches))


def interleaved_one_f_one_b(pp: int, vpp: int, microbatches: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B (rules in the module docstring)."""
    _check_rank(pp, microbatches, rank)
    check_schedule(pp, vpp, microbatches, "interleaved")
    total = microbatches * vpp
    steps = [((k // pp) % vpp, (k // (pp * vpp)) * pp + k % pp) for k in range(total)]
    forwards = [Action("F", chunk, mb) for chunk, mb in steps]
    backwards = [Action("B", vpp - 1 - chunk, mb) for chunk, mb in steps]
    return _one_f_one_b_order(forwards, backwards, min((pp - rank - 1) * 2 + (vpp - 1) * pp, total))


def zero_bubble_h1(pp: int, microbatches: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B with each weight-gradient ``W`` deferred by ``rank`` backwards (module docstring)."""
    _check_rank(pp, microbatches, rank)
    order: list[Action] = []
    for action in one_f_one_b(pp, microbatches, rank):
        order.append(action)
        if action.kind == "B" and action.microbatch >= rank:
            order.append(Action("W", 0, action.microbatch - rank))
    return order + [Action("W", 0, i) for i in range(max(microbatches - rank, 0), microbatches)]


def splits_backward(actions: Sequence[Action]) -> bool:
    """Whether the order runs weight gradients as separate ``W`` actions."""
    return any(a.kind == "W" for a in actions)


def schedule(name: str, pp: int, vpp: int, microbatches: int, rank: int) -> list[Action]:
    """The order of ``rank`` under schedule ``name`` (one of ``SCHEDULES``), after ``check_schedule``."""
    check_schedule(pp, vpp, microbatches, name)
    if name == "interleaved":
        return interleaved_one_f_one_b(pp, vpp, microbatches, rank)
    if name == "zbh1":
        return zero_bubble_h1(pp, microbatches, rank)
    return (gpipe if name == "gpipe" else one_f_one_b)(pp, microbatches, rank)


def _dependencies(pp: int, vpp: int, rank: int, action: Action) -> list[tuple[int, Action]]:
    """The (rank, action) pairs that must finish before ``action`` can start on ``rank``."""
    stage = action.chunk * pp + rank
    mb = action.microbatch
    if action.kind == "W":
        return [(rank, Action("B", action.chunk, mb))]
    if action.kind == "F":
        return [] if stage == 0 else [((stage - 1) % pp, Action("F", (stage - 1) // pp, mb))]
    deps = [(rank, Action("F", action.chunk, mb))]
    if stage + 1 < pp * vpp:
        deps.append(((stage + 1) % pp, Action("B", (stage + 1) // pp, mb)))
    return deps


def timeline(pp: int, vpp: int, microbatches: int, schedule_fn: Callable[[int], Sequence[Action]]) -> list[dict[Action, int]]:
    """Run every rank's order (``schedule_fn(rank)``) in lockstep: the time step of each
    rank's every action.

    Every action takes one step. In a step each rank runs its next action if the
    actions it depends on finished in earlier steps: a forward needs the previous
    virtual stage's forward of the microbatch; a backward needs its own forward and
    the next virtual stage's backward; a weight gradient needs its own backward. Sends
    never block. Raises ValueError when an order does not run each (kind, chunk,
    microbatch) exactly once (``W`` for every one or for none), or deadlocks.
    """
    orders = [list(schedule_fn(rank)) for rank in range(pp)]
    kinds = ("F", "B", "W") if splits_backward(orders[0]) else ("F", "B")
    expected = {Action(kind, c, mb) for kind in kinds for c in range(vpp) for mb in range(microbatches)}
    for rank, order in enumerate(orders):
        if len(order) != len(expected) or set(order) != expected:
            missing = sorted(map(str, expected - set(order)))
            extra = sorted({str(a) for a in order if a not in expected or order.count(a) > 1})
            raise UserInputError(f"rank {rank} must run each action once: missing {missing}, extra or repeated {extra}")
    done: set[tuple[int, Action]] = set()
    times: list[dict[Action, int]] = [{} for _ in range(pp)]
    position = [0] * pp
    steps = 0
    while any(position[rank] < len(orders[rank]) for rank in range(pp)):
        ready = [
            rank
            for rank in range(pp)
            if position[rank] < len(orders[rank])
            and all(dep in done for dep in _dependencies(pp, vpp, rank, orders[rank][position[rank]]))
        ]
        if not ready:
            waits = [
                f"rank {rank} at {orders[rank][position[rank]]} waits for "
                + ", ".join(
                    f"{dep} on rank {dep_rank}"
                    for dep_rank, dep in _dependencies(pp, vpp, rank, orders[rank][position[rank]])
                    if (dep_rank, dep) not in done
                )
                for rank in range(pp)
                if position[rank] < len(orders[rank])
            ]
            raise UserInputError(f"schedule deadlocks after {steps} steps: " + "; ".join(waits))
        for rank in ready:
            done.add((rank, orders[rank][position[rank]]))
            times[rank][orders[rank][position[rank]]] = steps
            position[rank] += 1
        steps += 1
    return times


def simulate(pp: int, vpp: int, microbatches: int, schedule_fn: Callable[[int], Sequence[Action]]) -> int:
    """The number of time steps of ``timeline`` (same rules and errors)."""
    times = timeline(pp, vpp, microbatches, schedule_fn)
    return 1 + max((t for rank in times for t in rank.values()), default=-1)


@dataclass(frozen=True)
class Message:
    """What a virtual stage sends a neighbour: the outputs of its forward (``F``, to the
    next stage) or the input gradients of its backward (``B``, to the previous one)."""

    kind: Literal["F", "B"]
    src: int  # sending pipeline rank
    dst: int  # receiving pipeline rank
    stage: int  # the sender's virtual stage
    microbatch: int
    step: int  # both ranks post it in their batch of this time step


def messages(pp: int, vpp: int, times: Sequence[dict[Action, int]]) -> list[Message]:
    """Every message of a step, in ``timeline`` order.

    A message is posted by sender and receiver in the batch of the time step after the
    sender's action. Each rank posts its batches in step order, so two ranks post their
    sends and receives between them in the same order, which NCCL needs to match them;
    and the batch of a step is posted only after the actions of earlier steps, whose
    results every send of the batch carries. A receive then never waits for a send that
    sits behind it: the ``timeline`` that numbers the steps has no cycles.
    """
    out = []
    last = pp * vpp - 1
    for rank, order in enumerate(times):
        for action, step in order.items():
            stage = action.chunk * pp + rank
            if action.kind == "F" and stage < last:
                out.append(Message("F", rank, (stage + 1) % pp, stage, action.microbatch, step + 1))
            elif action.kind == "B" and stage > 0:
                out.append(Message("B", rank, (stage - 1) % pp, stage, action.microbatch, step + 1))
    return sorted(out, key=lambda m: (m.step, m.src, m.kind))


def receive_slots(pp: int, times: Sequence[dict[Action, int]], received: Sequence[Message], rank: int) -> dict[Message, int]:
    """The receive buffer of each message ``rank`` receives, per (kind, local chunk).

    A buffer is busy from the step its receive is posted until the action that last
    reads it ran: the backward of the microbatch, or its ``W`` where the order splits the
    backward (the deferred weight gradients keep the linears' inputs and output
    gradients, which may be the received tensors themselves). It is reused by a receive
    posted in a later step, so a chunk needs as many buffers as microbatches it has in
    flight, not one per microbatch.
    """
    order = times[rank]
    release = "W" if splits_backward(list(order)) else "B"
    busy: dict[tuple[str, int], list[int]] = {}  # per pool: the release step of each buffer
    slots: dict[Message, int] = {}
    for m in sorted(received, key=lambda m: m.step):
        chunk = ((m.stage + 1) if m.kind == "F" else (m.stage - 1)) // pp
        done = order[Action(release, chunk, m.microbatch)]
        pool = busy.setdefault((m.kind, chunk), [])
        slot = next((i for i, until in enumerate(pool) if until < m.step), len(pool))
        if slot == len(pool):
            pool.append(done)
        pool[slot] = done
        slots[m] = slot
    return slots


def buffer_slots(actions: Sequence[Action]) -> dict[tuple[int, int], int]:
    """The static-buffer slot of every (chunk, microbatch) of one rank's order.

    A CUDA-graph capture of a chunk holds one microbatch's activations in its static
    buffers from the forward until the backward, and the pipeline runtime its received
    inputs. Each forward takes the chunk's lowest free slot and its backward (its ``W``
    where the order splits the backward) frees it, so a chunk needs one slot per
    microbatch in flight: ``pp - rank`` under 1F1B however many microbatches run,
    ``pp`` under ZB-H1, ``microbatches`` under GPipe.
    """
    release = "W" if splits_backward(actions) else "B"
    free: dict[int, list[int]] = {}
    taken: dict[int, int] = {}
    slots: dict[tuple[int, int], int] = {}
    for action in actions:
        key = (action.chunk, action.microbatch)
        if action.kind == "F":
            pool = free.setdefault(action.chunk, [])
            slot = min(pool) if pool else taken.get(action.chunk, 0)
            if pool:
                pool.remove(slot)
            else:
                taken[action.chunk] = slot + 1
            slots[key] = slot
        elif action.kind == release:
            free.setdefault(action.chunk, []).append(slots[key])
    return slots


def slots_per_chunk(name: str, pp: int, vpp: int, rank: int) -> dict[int, int]:
    """Static-buffer slots each local chunk of ``rank`` needs under ``name`` in the
    steady state (enough microbatches that the warmup is full; GPipe's grows with them)."""
    microbatches = 4 * pp * vpp
    slots = buffer_slots(schedule(name, pp, vpp, microbatches, rank))
    return {c: 1 + max(s for (chunk, _), s in slots.items() if chunk == c) for c in range(vpp)}
