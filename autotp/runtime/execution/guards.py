"""Checks that turn a user's mistake or a peer's crash into an error on every rank.

* ``InputCheck``: every rank of a model replica must pass the same inputs. The first
  ``CHECKED_CALLS`` calls (every call with ``AUTOTP_CHECK_INPUTS=1``, and every call on
  gloo, where it costs little next to the step and where collectives of different sizes
  abort the process) compare a fingerprint of the inputs (names, shapes, dtypes, a
  weighted sum) across the tp and pp groups and raise naming the ranks that differ. A
  training step also compares the dp group: the same fingerprint when the ranks pass one
  global batch (``DP_GLOBAL``), the shapes only when each passes its own shard (``DP_LOCAL``).
* ``explain_retrace_failure``: a new input signature that fails to trace is compared with
  the signatures traced before, to name the argument whose dtype or rank changed.
* ``refuse_autocast``: a graph holding an inlined ``torch.autocast`` region of the model's
  (``analysis.trace_regions``) is refused under an autocast active around the call.
* ``FailureWatch``: a rank whose call raises posts the cause under ``FAILURE_KEY`` in
  the default store (one key per watch, i.e. per ``ParallelModel``: every rank builds
  its models in the same order, and a failure of one model must not fail the next). A thread on every rank polls it; when another rank failed while
  this one is inside a call, it aborts the process groups (NCCL ops then fail at once)
  and, if the call is still blocked ``_EXIT_AFTER_S`` later (gloo waits cannot be
  aborted), prints the cause and exits the process, as torchrun would.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.fx import GraphModule

from autotp.ir import meta_keys
from autotp.ir.errors import UserInputError, describe
from autotp.ir.rank_log import warn_once

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECKED_CALLS = 2
DP_GLOBAL = "global"
"""A training step's dp ranks pass one global batch alike (``train_step``'s default)."""
DP_LOCAL = "local"
"""A training step's dp ranks pass their own shards, of one size (``train_step(batch_is_local=True)``)."""
CHECK_ENV = "AUTOTP_CHECK_INPUTS"
FAILURE_KEY = "autotp/failure"
_POLL_S = 1.0
_ABORT_AFTER_S = 3.0
_EXIT_AFTER_S = 10.0


def _signature(call: dict[str, Any]) -> str:
    parts = []
    for k, v in flat_call(call).items():
        if isinstance(v, torch.Tensor):
            parts.append(f"{k}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
        elif v is None or isinstance(v, (bool, int, float, str)):
            parts.append(f"{k}={v!r}")
    return ", ".join(parts)


def _checksum(call: dict[str, Any]) -> float:
    total = 0.0
    for v in flat_call(call).values():
        if isinstance(v, torch.Tensor) and v.numel():
            flat = v.detach().reshape(-1).double()
            weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 1021 + 1
            total += float((flat * weights).sum())
    return total


class InputCheck:
    """Compares the inputs of the first calls (every call on gloo or with ``AUTOTP_CHECK_INPUTS=1``) across ranks."""

    def __init__(self, groups: list[tuple[str, dist.ProcessGroup | None]], dp_group: dist.ProcessGroup | None = None) -> None:
        self._groups = [(name, g) for name, g in groups if g is not None and dist.get_world_size(g) > 1]
        self._dp = dp_group if dp_group is not None and dist.get_world_size(dp_group) > 1 else None
        every = [g for _, g in self._groups] + ([self._dp] if self._dp is not None else [])
        self._every_call = all(dist.get_backend(g) == dist.Backend.GLOO for g in every)
        self._calls = {None: 0, DP_GLOBAL: 0, DP_LOCAL: 0}

    def __call__(self, call: dict[str, Any], dp: str | None = None) -> None:
        """Compare ``call`` over the tp and pp groups, and over the dp group as ``dp`` says
        (``DP_GLOBAL``, ``DP_LOCAL``, or None for a forward, which each dp replica runs on its own data)."""
        self._calls[dp] += 1
        every_call = self._every_call or os.environ.get(CHECK_ENV) == "1"
        groups = self._groups + ([("dp", self._dp)] if dp is not None and self._dp is not None else [])
        if not groups or (self._calls[dp] > CHECKED_CALLS and not every_call):
            return
        signature = _signature(call)
        for name, group in groups:
            mine = signature if name == "dp" and dp == DP_LOCAL else (signature, _checksum(call))
            seen: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(seen, mine, group=group)
            if all(s == seen[0] for s in seen):
                continue
            ranks = dist.get_process_group_ranks(group)
            odd = next(i for i, s in enumerate(seen) if s != seen[0])
            shapes = (seen[0], seen[odd]) if isinstance(mine, str) else (seen[0][0], seen[odd][0])
            what = "input shapes" if shapes[0] != shapes[1] else "input values"
            detail = f" ({shapes[0]} vs {shapes[1]})" if shapes[0] != shapes[1] else ""
            advice = _SAME_REPLICA if name != "dp" else _SAME_SIZE if dp == DP_LOCAL else _SAME_GLOBAL
            raise UserInputError(f"ranks {ranks[0]} and {ranks[odd]} of a {name} group were passed different {what}{detail}; {advice}")


_SAME_REPLICA = "every rank of a model replica must pass the same global batch (train_step splits it over dp ranks)"
_SAME_GLOBAL = ("train_step takes one global batch that every rank passes alike and splits it over the dp ranks; pass the "
                "same batch on every rank, or pass each dp rank's own shard with train_step(..., batch_is_local=True)")
_SAME_SIZE = "with batch_is_local=True every dp rank passes a shard of the same size (and its tp and pp ranks the same one)"


_FLAT_LEAVES = frozenset({torch.Tensor, bool, int, float, str})


def flat_call(call: dict[str, Any]) -> dict[str, Any]:
    """Each leaf of ``call`` (keyword arguments, tensors nested in dicts, lists and tuples
    included) under its path, ``batch.input_ids``, sorted."""
    if all(type(k) is str and type(v) in _FLAT_LEAVES for k, v in call.items()):  # nothing nested: a leaf's path is its key
        return dict(sorted(call.items()))
    leaves, _ = torch.utils._pytree.tree_flatten_with_path(call)
    named = {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): v for path, v in leaves}
    return dict(sorted(named.items()))


def signature_key(kwargs: dict[str, Any], training: bool) -> tuple:
    """What a traced graph is cached by: train/eval, and each input's shape and dtype (or repr)."""
    items = []
    for k, v in flat_call(kwargs).items():
        items.append((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v)))
    return (training, tuple(items))


def explain_retrace_failure(call: dict[str, Any], traced: list[tuple], error: Exception) -> None:
    """Raise naming the argument whose dtype kind or number of dims differs from the
    signatures traced before (``signature_key``s), when tracing a new one failed."""
    for name, value in flat_call(call).items():
        known = [item for _, items, *_ in traced for item in items if item[0] == name and len(item) == 3]
        if not isinstance(value, torch.Tensor) or not known:
            continue
        _, shape, dtype = known[0]
        ndim = len(shape)
        if value.is_floating_point() != dtype.is_floating_point or value.dim() != ndim:
            raise UserInputError(
                f"argument {name!r} is {str(value.dtype).removeprefix('torch.')} with {value.dim()} dims "
                f"{list(value.shape)}, but the model was traced with {str(dtype).removeprefix('torch.')} with {ndim} dims; "
                f"pass {name} like the example inputs"
            ) from error


class PeerFailure(RuntimeError):
    """Another rank failed; the message carries its rank and cause."""


class FailureWatch:
    """Posts this rank's failures and notices the other ranks' (module docstring).

    Calls are counted alike on every rank (each rank makes the same calls). A failure
    posted in call n concerns this rank while it is in call n, or in call n+1 when its
    own call n did not fail (the failed rank never joins call n+1); a user error that
    every rank raised in the same call concerns nobody.
    """

    _made = 0  # watches made by this process

    def __init__(self) -> None:
        FailureWatch._made += 1
        self._key = f"{FAILURE_KEY}/{FailureWatch._made}"
        self._store = dist.distributed_c10d._get_default_store()
        self._rank = dist.get_rank()
        self._call = 0
        self.depth = 0
        self._own_failures: set[int] = set()
        self.peer_cause: str | None = None
        threading.Thread(target=self._watch, name="autotp-failure-watch", daemon=True).start()

    @contextmanager
    def call(self) -> Iterator[None]:
        """Wrap one top-level call of the model; errors leave it as ``failed`` says."""
        self.depth += 1
        if self.depth == 1:
            self._call += 1
            self.peer_cause = None
        try:
            yield
        except Exception as e:
            if self.depth == 1:
                raised = self._failed(e)
                if raised is not e:
                    raise raised from e
            raise
        finally:
            self.depth -= 1

    def _failed(self, error: Exception) -> Exception:
        try:
            cause = self.peer_cause or self._peer_cause()
        except RuntimeError as store_error:  # the store's host finished first: this rank's error is the news
            log.debug("could not read the other ranks' failures: %s", store_error)
            cause = None
        if cause is not None and not isinstance(error, UserInputError):
            return PeerFailure(f"{cause} (rank {self._rank} saw: {type(error).__name__}: {_first_line(error)})")
        self._own_failures.add(self._call)
        try:
            self._store.set(self._key, f"{self._rank} {self._call} rank {self._rank} failed: {type(error).__name__}: {_first_line(error)}")
        except RuntimeError as store_error:  # the store's host is gone: nobody is left to tell
            log.debug("could not post the failure: %s", store_error)
        return error

    def _peer_cause(self) -> str | None:
        if not self._store.check([self._key]):
            return None
        rank, call, cause = self._store.get(self._key).decode().split(" ", 2)
        n = int(call)
        if int(rank) == self._rank or not (n == self._call or (n == self._call - 1 and n not in self._own_failures)):
            return None
        return cause

    def _watch(self) -> None:
        noticed: float | None = None
        aborted = False
        while True:
            time.sleep(_POLL_S)
            try:
                cause = self._peer_cause() if self.depth else None
            except Exception:  # noqa: BLE001 - the store is gone: the job is shutting down
                return
            if cause is None:
                noticed, aborted = None, False
                continue
            self.peer_cause = cause
            noticed = noticed or time.monotonic()
            waited = time.monotonic() - noticed
            if waited >= _ABORT_AFTER_S and not aborted:
                aborted = True
                log.error("%s; aborting the process groups of rank %d", cause, self._rank)
                dist.distributed_c10d._abort_process_group()
            if waited >= _EXIT_AFTER_S:
                print(f"autotp: {cause}; rank {self._rank} was waiting for it and exits", file=sys.stderr, flush=True)
                os._exit(1)


def refuse_autocast(graph: GraphModule, device: torch.device) -> None:
    """Raise if autocast is active around a graph that holds an inlined autocast region."""
    if not torch.is_autocast_enabled(device.type):
        return
    node = next((n for n in graph.graph.nodes if n.meta.get(meta_keys.AUTOCAST_INLINED)), None)
    if node is not None:
        raise UserInputError(
            f"the model runs {describe(node)} under a torch.autocast region of its own, which autotp inlined "
            f"into the graph; under the autocast active around this call it would run at another precision. "
            f"Fix: call the parallel model outside torch.autocast (cast the model to the dtype instead)."
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def guarded(method: Callable[..., T] | None = None, *, step: bool = False) -> Any:
    """Wrap a ``ParallelModel`` call: its ``_failure_watch`` sees errors, its ``_input_check`` the
    inputs; a training ``step`` also has its dp group's inputs compared (``batch_is_local`` says how)."""
    if method is None:
        return functools.partial(guarded, step=step)

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        watch: FailureWatch | None = self._failure_watch
        with watch.call() if watch is not None else nullcontext():
            try:
                if watch is None or watch.depth == 1:
                    dp = (DP_LOCAL if kwargs.get("batch_is_local") else DP_GLOBAL) if step else None
                    self._input_check({**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}, dp)
                return method(self, *args, **kwargs)
            except RuntimeError as e:
                explained = _explain_collective_error(e)
                if explained is e:
                    raise
                raise explained from e

    return wrapper


def _explain_collective_error(error: RuntimeError) -> RuntimeError:
    """``error`` with its likely cause when a collective timed out or saw other sizes on another rank."""
    text = str(error).lower()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if "timed out" in text or "timeout" in text:
        return RuntimeError(
            f"a collective timed out on rank {rank}: another rank did not reach the same "
            f"collective (it crashed, or was called with other input shapes). {error}"
        )
    if "enforce" in text:  # gloo's size checks
        return RuntimeError(
            f"ranks ran a collective with different sizes on rank {rank}: they were most likely "
            f"passed inputs of different shapes (set {CHECK_ENV}=1 to compare inputs on every call). {error}"
        )
    return error


def refuse_mixed_batch(plan: Any, pieces: int) -> None:
    """Refuse to split the batch into ``pieces`` (dp ranks x microbatches) when the forward mixes
    its rows; say once when a loss term will be computed per piece (``plan.batch_statistics``)."""
    if pieces > 1 and plan.batch_statistics and not plan.batch_mixing:
        warn_once(log, f"the loss takes a statistic of the batch's rows other than linearly at {plan.batch_statistics}: "
                       f"each of the {pieces} pieces of the batch (dp ranks x microbatches) computes that term over its own "
                       "rows, and the step averages them, as Megatron and HF's Trainer compute a router's load-balancing "
                       "loss per microbatch; train with dp=1 and num_microbatches=1 for the whole batch's")  # fmt: skip
    if pieces > 1 and plan.batch_mixing:
        raise UserInputError(
            f"the forward mixes the rows of its batch at {plan.batch_mixing}: each row's value depends on "
            f"other rows, so splitting the batch over dp={plan.dp} ranks x {pieces // plan.dp} microbatches "
            "would compute another function than the whole batch does. Train with dp=1 and "
            "num_microbatches=1 (schedule='gpipe' when pp > 1), or make that op work within each row "
            "(e.g. route tokens per row)"
        )
