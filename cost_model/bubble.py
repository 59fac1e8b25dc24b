"""Pipeline bubbles: idle time of the schedules in ``autotp.ir.schedules``.

With p stages, m microbatches and v model chunks per rank, the bubble relative to the
busy time is (``bubble_fraction``):

* GPipe and 1F1B: (p-1)/m. Both fill and drain the pipeline once; 1F1B only changes the
  order (and so the memory, see ``autotp.cost_model.memory``).
* interleaved 1F1B: (p-1)/(m·v). The fill and drain are made of chunks, v times shorter.
* ZB-H1: (p-1)/(3m). Its backward is split into the input gradient B and the weight
  gradient W, and the drain is filled with deferred W's: the fill and drain cost
  (p-1)·(t_F + t_B - t_W) instead of (p-1)·(t_F + t_B + t_W) (Qi et al. 2023). Each of
  F, B and W is taken as a third of a chunk's forward+backward (``ZB_H1_SHARE``; a
  decoder layer's backward is two matmuls per forward one, one for each gradient).

With unequal stages (``pipeline_time_s``): let ``c_k`` be the forward+backward time of
one microbatch on virtual stage k (k = 0 .. p·v-1, chunk k on rank k mod p), host issue
included (``compute.segment_time``), ``g_k`` the GPU's busy part of it, and ``S_r``,
``G_r`` the sums over rank r's chunks. Then

    T = m · max_r S_r  +  (p-1) · mean_r(G_r) / v

the busiest rank's work plus the fill and drain, each (p-1) chunk-steps long. The fill
and drain are GPU time only: the host never waits for a peer (NCCL sends and receives
are stream-ordered, nothing in a step synchronizes the host), so while a rank's GPU
waits for its first input the host issues the actions after it, and a chunk-step of
the fill costs the GPU's time, not the host's. A GPU-bound pipeline (S = G) gives
T = m·S·(1 + (p-1)/(m·v)), the fractions above; ``autotp.ir.schedules.simulate`` counts
the same steps with unit costs. A host-bound one (G << S) is m·S, its host's work.
Under ZB-H1 the fill and drain shrink to ``ZB_H1_SHARE`` of that:
T = m · max_r S_r + (p-1) · mean_r(G_r) / 3.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotp.ir.schedules import SCHEDULES
from autotp.ir.errors import UserInputError

ZB_H1_SHARE = 1 / 3
"""ZB-H1's fill and drain over 1F1B's: (t_F + t_B - t_W) / (t_F + t_B + t_W) with equal times."""


def _drain_share(schedule: str) -> float:
    if schedule not in SCHEDULES:
        raise UserInputError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    return ZB_H1_SHARE if schedule == "zbh1" else 1.0


def bubble_fraction(schedule: str, pp: int, microbatches: int, vpp: int = 1) -> float:
    """Bubble time over busy time (formulas in the module docstring)."""
    chunks_per_rank = vpp if schedule == "interleaved" else 1
    return _drain_share(schedule) * (pp - 1) / (microbatches * chunks_per_rank)


def pipeline_time_s(
    chunk_s: Sequence[float], chunk_gpu_s: Sequence[float], pp: int, vpp: int, microbatches: int, schedule: str = "1f1b"
) -> tuple[float, float]:
    """(step time, bubble time) from each of the pp·vpp chunks' time per microbatch and its GPU part."""
    assert len(chunk_s) == len(chunk_gpu_s) == pp * vpp, f"{len(chunk_s)} chunk times for pp={pp}, vpp={vpp}"
    loads = [sum(chunk_s[r::pp]) for r in range(pp)]
    bubble = _drain_share(schedule) * (pp - 1) * sum(chunk_gpu_s) / pp / vpp
    return microbatches * max(loads) + bubble, bubble
