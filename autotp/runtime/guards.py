"""Checks that turn a user's mistake or a peer's crash into an error on every rank.

* ``InputCheck``: every rank of a model replica must pass the same inputs. The first
  ``CHECKED_CALLS`` calls (every call with ``AUTOTP_CHECK_INPUTS=1``, and every call on
  gloo, where it costs little next to the step and where collectives of different sizes
  abort the process) compare a fingerprint of the inputs (names, shapes, dtypes, a
  weighted sum) across the tp and pp groups and raise naming the ranks that differ.
* ``explain_retrace_failure``: a new input signature that fails to trace is compared with
  the signatures traced before, to name the argument whose dtype or rank changed.
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

from autotp.ir.errors import UserInputError

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECKED_CALLS = 2
CHECK_ENV = "AUTOTP_CHECK_INPUTS"
FAILURE_KEY = "autotp/failure"
_POLL_S = 1.0
_ABORT_AFTER_S = 3.0
_EXIT_AFTER_S = 10.0


def _signature(call: dict[str, Any]) -> str:
    parts = []
    for k in sorted(call):
        v = call[k]
        if isinstance(v, torch.Tensor):
            parts.append(f"{k}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
        elif v is None or isinstance(v, (bool, int, float, str)):
            parts.append(f"{k}={v!r}")
    return ", ".join(parts)


def _checksum(call: dict[str, Any]) -> float:
    total = 0.0
    for k in sorted(call):
        v = call[k]
        if isinstance(v, torch.Tensor) and v.numel():
            flat = v.detach().reshape(-1).double()
            weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 1021 + 1
            total += float((flat * weights).sum())
    return total


class InputCheck:
    """Compares the inputs of the first calls (every call on gloo or with ``AUTOTP_CHECK_INPUTS=1``) across ranks."""

    def __init__(self, groups: list[tuple[str, dist.ProcessGroup | None]]) -> None:
        self._groups = [(name, g) for name, g in groups if g is not None and dist.get_world_size(g) > 1]
        self._every_call = all(dist.get_backend(g) == dist.Backend.GLOO for _, g in self._groups)
        self._calls = 0

    def __call__(self, call: dict[str, Any]) -> None:
        self._calls += 1
        every_call = self._every_call or os.environ.get(CHECK_ENV) == "1"
        if not self._groups or (self._calls > CHECKED_CALLS and not every_call):
            return
        mine = (_signature(call), _checksum(call))
        for name, group in self._groups:
            seen: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(seen, mine, group=group)
            if all(s == seen[0] for s in seen):
                continue
            ranks = dist.get_process_group_ranks(group)
            odd = next(i for i, s in enumerate(seen) if s != seen[0])
            what = "input shapes" if seen[odd][0] != seen[0][0] else "input values"
            detail = f" ({seen[0][0]} vs {seen[odd][0]})" if seen[odd][0] != seen[0][0] else ""
            raise UserInputError(
                f"ranks {ranks[0]} and {ranks[odd]} of a {name} group were passed different {what}{detail}; every rank "
                "of a model replica must pass the same global batch (train_step splits it over dp ranks)"
            )


def signature_key(kwargs: dict[str, Any], training: bool) -> tuple:
    """What a traced graph is cached by: train/eval, and each argument's shape and dtype (or repr)."""
    items = []
    for k in sorted(kwargs):
        v = kwargs[k]
        items.append((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v)))
    return (training, tuple(items))


def explain_retrace_failure(call: dict[str, Any], traced: list[tuple], error: Exception) -> None:
    """Raise naming the argument whose dtype kind or number of dims differs from the
    signatures traced before (``signature_key``s), when tracing a new one failed."""
    for name, value in call.items():
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
        cause = self.peer_cause or self._peer_cause()
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def guarded(method: Callable[..., T]) -> Callable[..., T]:
    """Wrap a ``ParallelModel`` call: its ``_failure_watch`` sees errors, its ``_input_check`` the inputs."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        watch: FailureWatch | None = self._failure_watch
        with watch.call() if watch is not None else nullcontext():
            try:
                if watch is None or watch.depth == 1:
                    self._input_check({**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs})
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
