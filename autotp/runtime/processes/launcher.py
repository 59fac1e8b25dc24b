"""Start one process per rank, like torchrun, and surface failures and hangs.

`spawn_ranks` is the single implementation of spawning, result collection and
timeouts; `launch` (used by `autotp run`) and the tests' `run_on_ranks` wrap it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autotp.ir.errors import UserInputError
from autotp.runtime.execution import cudagraphs

T = TypeVar("T")

TRACEBACK_ENV = "AUTOTP_TRACEBACK"
_EXIT_GRACE_S = 30.0
_POLL_S = 0.1


class RankError(RuntimeError):
    """A worker raised; carries the rank, the worker-side traceback and whether the root
    cause was the user's input (``UserInputError``). A user error reads as one line
    naming the log file that holds the traceback; an internal error shows the traceback."""

    def __init__(
        self, rank: int, world_size: int, worker_traceback: str, exc_type: str = "", message: str = "", user_error: bool = False
    ) -> None:
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.exc_type = exc_type
        self.message = message
        self.user_error = user_error
        if user_error:
            log_file = _write_log(rank, worker_traceback)
            super().__init__(f"rank {rank} of {world_size} failed: {exc_type}: {message} (traceback in {log_file})")
        else:
            super().__init__(f"rank {rank} of {world_size} failed:\n{worker_traceback}")


KEPT_LOGS = 32
"""Traceback logs kept in ``log_folder()``; older ones are deleted as new ones are written."""


def log_folder() -> Path:
    """Where a user error's traceback is written: one folder under the temp folder, per user."""
    return Path(tempfile.gettempdir()) / f"autotp-tracebacks-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _write_log(rank: int, text: str) -> Path:
    folder = log_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-pid{os.getpid()}-rank{rank}.log"
    path.write_text(text)
    for old in _logs_oldest_first(folder)[:-KEPT_LOGS]:
        old.unlink(missing_ok=True)
    return path


def _logs_oldest_first(folder: Path) -> list[Path]:
    """The logs in ``folder``, oldest first; a log that another rank deletes meanwhile is left out."""
    dated: list[tuple[float, Path]] = []
    for log in folder.glob("*.log"):
        try:
            dated.append((log.stat().st_mtime, log))
        except FileNotFoundError:
            continue
    return [log for _, log in sorted(dated, key=lambda d: d[0])]


def _install_excepthook() -> None:
    """Under torchrun: a user error prints one line, once per distinct message across the
    ranks; its traceback goes to a log file (``AUTOTP_TRACEBACK=1``: Python's own report)."""
    if os.environ.get(TRACEBACK_ENV) == "1" or getattr(sys.excepthook, "_autotp", False):
        return
    default = sys.excepthook

    def hook(exc_type: type[BaseException], error: BaseException, tb: Any) -> None:
        if not issubclass(exc_type, UserInputError) or not dist.is_initialized():
            default(exc_type, error, tb)
            return
        rank = dist.get_rank()
        log_file = _write_log(rank, "".join(traceback.format_exception(exc_type, error, tb)))
        key = f"autotp/error/{zlib.crc32(str(error).encode())}"
        try:
            first = dist.distributed_c10d._get_default_store().add(key, 1) == 1
        except RuntimeError:  # the store is gone
            first = True
        if first:
            print(f"autotp: error on rank {rank}: {error} (traceback in {log_file}; {TRACEBACK_ENV}=1 prints it)", file=sys.stderr)

    hook._autotp = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None = None, timeout_s: float = 300) -> None:
    """Initialize the default process group from torchrun-style env vars.

    Also installs a ``sys.excepthook`` that reports a user error (``UserInputError``)
    as one line per distinct message over all ranks, its traceback in a log file.

    `backend=None` picks nccl when every local rank can have its own CUDA device,
    else gloo. Does nothing if a process group already exists.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise UserInputError(
            f"environment variables {missing} are not set; start the program with torchrun "
            "or through autotp.runtime.processes.launcher.launch"
        )
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    if backend is None:
        backend = "nccl" if enough_gpus else "gloo"
    device_id = None
    if backend == "nccl":
        if not enough_gpus:
            raise UserInputError(
                f"backend 'nccl' needs {local_world_size} CUDA devices on this host but "
                f"{torch.cuda.device_count()} are visible; use backend='gloo' or fewer ranks"
            )
        device_id = torch.device("cuda", local_rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device_id,
    )
    _install_excepthook()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    timeout_s: float,
    num_threads: int,
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's, as a spawned rank has it (a fork server's children get the server's)
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(num_threads)
    try:
        init_distributed(backend, timeout_s)
        # Pickled here, not by the queue: torch.multiprocessing would share tensor
        # storage with this process, which exits right after.
        payload = pickle.dumps(_to_cpu(fn(rank, world_size, *args)))
        results.put((rank, True, payload))
    except BaseException as e:
        results.put((rank, False, (traceback.format_exc(), type(e).__name__, str(e), isinstance(e, UserInputError))))
    finally:
        cudagraphs.release_all()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300,
    num_threads: int | None = None,
    preload: tuple[str, ...] = (),
) -> list[T]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes; return results by rank.

    Each process gets torchrun env vars and a process group (`init_distributed`).
    `fn` must be a module-level function and its result picklable; tensors come back
    on CPU. If any rank raises, all ranks are killed and `RankError` carries its
    traceback; if the ranks do not finish in `timeout_s`, all are killed and
    `TimeoutError` is raised. `num_threads` defaults to the CPU cores split across ranks.
    `preload` names modules imported once in a fork server that the ranks fork from
    (`forkserver` start method) instead of each rank importing them afresh (`spawn`):
    for callers that start many short-lived groups, like the registry sweep.
    """
    if world_size < 1:
        raise UserInputError(f"world_size must be at least 1, got {world_size}")
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, backend, timeout_s, num_threads, results, fn, args, dict(os.environ)),
            name=f"autotp-rank{rank}",
        )
        for rank in range(world_size)
    ]
    outputs: dict[int, T] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(outputs) < world_size:
            if time.monotonic() > deadline:
                pending = sorted(set(range(world_size)) - outputs.keys())
                raise TimeoutError(
                    f"ranks {pending} of {world_size} did not finish within {timeout_s} s; all ranks were killed"
                )
            try:
                rank, ok, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                _check_silent_deaths(procs, outputs, results)
                continue
            if not ok:
                raise RankError(rank, world_size, *payload)
            outputs[rank] = pickle.loads(payload)
        # Every rank has reported. One stuck in its teardown (NCCL's destroy_process_group
        # can hang after CUDA graphs captured collectives) is killed after a grace period.
        exit_by = min(deadline, time.monotonic() + _EXIT_GRACE_S)
        for p in procs:
            p.join(timeout=max(0.0, exit_by - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        results.close()
    return [outputs[rank] for rank in range(world_size)]


def _check_silent_deaths(procs: list[Any], outputs: dict[int, Any], results: Any) -> None:
    """Raise if a rank exited without reporting (killed by a signal, os._exit, ...)."""
    dead = [rank for rank, p in enumerate(procs) if p.exitcode is not None and rank not in outputs]
    if not dead:
        return
    # Its report may have been flushed to the queue between our get() and the exitcode check.
    while True:
        try:
            rank, ok, payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            break
        if not ok:
            raise RankError(rank, len(procs), *payload)
        outputs[rank] = pickle.loads(payload)
    for rank in dead:
        if rank not in outputs:
            raise RankError(rank, len(procs), f"process exited with code {procs[rank].exitcode} without reporting\n")


def launch(worker: Callable[[int, int], None], world_size: int, backend: str, timeout_s: float) -> None:
    """Run `worker(rank, world_size)` on `world_size` local processes with a `backend` process group."""
    spawn_ranks(worker, world_size, backend=backend, timeout_s=timeout_s)
