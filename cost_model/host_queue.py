"""Eager execution as one host feeding one GPU stream, and how such queues chain.

The host issues kernels one after another; the GPU starts kernel i when it is done with
kernel i-1 and the host has issued kernel i. With h_i the host time to issue kernel i,
H_k = h_1 + .. + h_k and g_j the GPU time of kernel j, the GPU finishes at (``queue_s``)

    Q = max_k (H_k + Σ_{j>=k} g_j)

**Chaining** (``Queue``). A run of kernels is summarised by three numbers: its host time
H = Σ h, its GPU time G = Σ g and its finish time Q, all counted from an empty queue
(the host and the GPU idle at 0). Running B right after A, with no synchronisation
between them, splits the max over k into the k of A and the k of B:

    Q(A·B) = max(Q(A) + G(B),  H(A) + Q(B)),   H(A·B) = H(A) + H(B),   G(A·B) = G(A) + G(B)

(the GPU either finishes A and then runs B without waiting, or waits for the host,
which issues B's kernels after A's). The rule is exact and associative (both groupings
of A·B·C give max(Q_A + G_B + G_C, H_A + Q_B + G_C, H_A + H_B + Q_C)), so segments can be
summarised once and chained in any grouping. m identical runs give

    Q(A^m) = Q(A) + (m-1) · max(H(A), G(A))

(the terms are Q + i·H + (m-1-i)·G, linear in i): after the first run the queue advances
by the slower of host and GPU. A run with no GPU work (a Python call's fixed cost c) is
(c, 0, c), one with no host work (a receive the GPU waits for, t) is (0, t, t).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


def queue_s(host: np.ndarray, gpu: np.ndarray) -> float:
    """When the GPU finishes a queue of kernels issued from empty: ``max_k (H_k + Σ_{j>=k} g_j)``."""
    if not len(gpu):
        return 0.0
    issued = np.cumsum(host)
    remaining = np.cumsum(gpu[::-1])[::-1]
    return float(np.max(issued + remaining))


@dataclass(frozen=True)
class Queue:
    """A run of kernels from an empty queue: host time, GPU time and when the GPU finishes (module docstring)."""

    host_s: float = 0.0
    gpu_s: float = 0.0
    finish_s: float = 0.0

    @classmethod
    def of(cls, host: np.ndarray, gpu: np.ndarray) -> Queue:
        """The run of kernels with these host and GPU times, in issue order."""
        return cls(float(np.sum(host)), float(np.sum(gpu)), queue_s(host, gpu))

    @classmethod
    def host_only(cls, seconds: float) -> Queue:
        return cls(seconds, 0.0, seconds)

    @classmethod
    def gpu_only(cls, seconds: float) -> Queue:
        return cls(0.0, seconds, seconds)

    def then(self, after: Queue) -> Queue:
        """This run, then ``after`` with no synchronisation between them."""
        finish = max(self.finish_s + after.gpu_s, self.host_s + after.finish_s)
        return Queue(self.host_s + after.host_s, self.gpu_s + after.gpu_s, finish)

    def repeat(self, times: int) -> Queue:
        """``times`` runs of this one back to back."""
        if times <= 0:
            return Queue()
        steady = max(self.host_s, self.gpu_s)
        return Queue(times * self.host_s, times * self.gpu_s, self.finish_s + (times - 1) * steady)

    @property
    def steady_s(self) -> float:
        """What each further repetition adds: the slower of host and GPU."""
        return max(self.host_s, self.gpu_s)


def chain(runs: Iterable[Queue]) -> Queue:
    """The runs one after another, from an empty queue."""
    out = Queue()
    for run in runs:
        out = out.then(run)
    return out
