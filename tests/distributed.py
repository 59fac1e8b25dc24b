"""Multi-rank CPU test helper: gloo process groups in spawned processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from autotp.runtime.processes.launcher import spawn_ranks

T = TypeVar("T")

# Imported once by a fork server the ranks fork from: a spawned rank spends ~4 s of a CI core importing them,
# and ~1.2 s more importing the test models and the transformers architectures they build (test_equivalence.py
# with test_fused_loss.py: 139 s without the model modules here, 103 s with them).
PRELOAD = ("autotp.api", "autotp.report.strict_rule", "transformers", "small_models", "general_models", "plain_models_attention")


def run_on_ranks(fn: Callable[..., T], world_size: int, *args: Any, timeout_s: float = 300) -> list[T]:
    """Run module-level `fn(rank, world_size, *args)` on `world_size` gloo ranks; results by rank.

    Raises `autotp.runtime.processes.launcher.RankError` with the rank's traceback if a rank raises, and
    `TimeoutError` after killing every rank if they do not finish in `timeout_s`.
    """
    return spawn_ranks(fn, world_size, *args, backend="gloo", timeout_s=timeout_s, num_threads=1, preload=PRELOAD)
