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

With unequal stages (``pipeline_time_s``): let chunk k (k = 0 .. p·v-1, on rank k mod p)
run one microbatch's forward+backward as a queue ``X_k`` (``host_queue.Queue``: host time
H_k, GPU time g_k, finish time Q_k from an empty queue; ``step_estimate`` builds it from
``compute.segment_time``), and ``X_r`` the chain of rank r's chunks, with host time H_r,
GPU time G_r and finish Q_r. Nothing synchronises between microbatches, so rank r's m
microbatches take ``Q_r + (m-1)·max(H_r, G_r)`` (``Queue.repeat``): the first from an
empty queue, each further one the slower of its host and its GPU. Then

    T = max_r (Q_r + (m-1)·max(H_r, G_r))  +  (p-1) · mean_r(G_r) / v

the busiest rank's work plus the fill and drain, each (p-1) chunk-steps long. The fill
and drain are GPU time only: the host never waits for a peer (NCCL sends and receives
are stream-ordered, nothing in a step synchronizes the host), so while a rank's GPU
waits for its first input the host issues the actions after it, and a chunk-step of
the fill costs the GPU's time, not the host's. A GPU-bound pipeline (Q_r = G_r >= H_r) gives
T = m·G·(1 + (p-1)/(m·v)), the fractions above; ``autotp.ir.schedules.simulate`` counts
the same steps with unit costs. A host-bound one (G << H) is m·H, its host's work.
Under ZB-H1 the fill and drain shrink to ``ZB_H1_SHARE`` of that:
T = max_r (Q_r + (m-1)·max(H_r, G_r)) + (p-1) · mean_r(G_r) / 3.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotp.cost_model.host_queue import Queue, chain
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


def pipeline_time_s(chunks: Sequence[Queue], pp: int, vpp: int, microbatches: int, schedule: str = "1f1b") -> tuple[float, float]:
    """(step time, bubble time) from each of the pp·vpp chunks' queue of one microbatch (module docstring)."""
    assert len(chunks) == pp * vpp, f"{len(chunks)} chunks for pp={pp}, vpp={vpp}"
    ranks = [chain(chunks[r::pp]).repeat(microbatches) for r in range(pp)]
    bubble = _drain_share(schedule) * (pp - 1) * sum(q.gpu_s for q in chunks) / pp / vpp
    return max(q.finish_s for q in ranks) + bubble, bubble
