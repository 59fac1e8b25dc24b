"""How ``all_gather_matmul`` and ``matmul_reduce_scatter`` (``autotp.ir.ops``) run on a
process group of several ranks: the sequence-parallel collectives behind the GEMM that
consumes or produces them (``autotp.runtime.processes.collectives`` registers the kernels).

**Ring** (``impl="ring"``, and every backend but CUDA + NCCL): the tensor moves between
neighbours in ``t - 1`` point-to-point steps (``dist.batch_isend_irecv``, asynchronous on
every backend, on NCCL's own stream on a GPU), and each step multiplies the chunk that is
already here while the next one travels:

* all-gather-matmul: rank r starts with its own chunk; at step s it sends the chunk it holds
  to r+1, receives chunk ``r-s-1`` from r-1 and meanwhile multiplies chunk ``r-s``;
* matmul-reduce-scatter: at step s rank r computes the partial product of chunk ``r-s-1``,
  adds the partial sum received from r-1 and sends it on to r+1 while computing the next
  one; after ``t`` steps it holds the full sum of its own chunk ``r``.

**Symmetric memory** (``impl="symm_mem"`` on CUDA + NCCL): ``torch.ops.symm_mem.fused_all_gather_matmul``
and ``fused_matmul_reduce_scatter``, which pipeline the same way through NVLink copies
into a symmetric workspace. Several (x, w) pairs of one matmul-reduce-scatter (the
backward of q/k/v sharing one all-gather) are concatenated along K into one GEMM. Keep
``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` on the device.

Outputs are contiguous, as the fake kernels say.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor

_SYMM_MEM_GROUPS: set[str] = set()


def _symm_mem_group(pg: dist.ProcessGroup, x: Tensor, impl: str) -> str | None:
    """The group name to hand ``torch.ops.symm_mem`` when this call takes that path, else None."""
    if impl != "symm_mem" or not x.is_cuda or dist.get_backend(pg) != dist.Backend.NCCL:
        return None
    name = pg.group_name
    if name not in _SYMM_MEM_GROUPS:
        from torch.distributed import _symmetric_memory

        enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
        if enable is not None:  # required before torch 2.12, a deprecated no-op after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        _SYMM_MEM_GROUPS.add(name)
    return name


def _shift(pg: dist.ProcessGroup, send: Tensor, recv: Tensor) -> list[dist.Work]:
    """Start sending ``send`` to the next rank of the ring and receiving ``recv`` from the previous one."""
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, dist.get_global_rank(pg, (rank + 1) % size), pg),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(pg, (rank - 1) % size), pg),
    ])  # fmt: skip


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def all_gather_matmul(x: Tensor, weights: list[Tensor], dim: int, pg: dist.ProcessGroup, impl: str) -> list[Tensor]:
    """``[all_gather(x, dim), all_gather(x, dim) @ w for w in weights]`` over ``pg``."""
    name = _symm_mem_group(pg, x, impl)
    if name is not None:
        full, outs = torch.ops.symm_mem.fused_all_gather_matmul(x, list(weights), dim % x.dim(), name)
        return [t.contiguous() for t in (full, *outs)]
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    chunks: list[Tensor | None] = [None] * size
    chunks[rank] = held = x.contiguous()
    products: list[list[Tensor | None]] = [[None] * size for _ in weights]
    for step in range(size):
        source = (rank - step) % size
        works: list[dist.Work] = []
        if step < size - 1:
            arriving = torch.empty_like(held)
            works = _shift(pg, held, arriving)
        for out, w in zip(products, weights):
            out[source] = torch.matmul(held, w)
        if works:
            _wait(works)
            chunks[(source - 1) % size] = held = arriving
    return [torch.cat(chunks, dim), *(torch.cat(out, dim) for out in products)]  # type: ignore[arg-type]


def matmul_reduce_scatter(xs: list[Tensor], weights: list[Tensor], dim: int, local: int, pg: dist.ProcessGroup, impl: str) -> Tensor:
    """``reduce_scatter(sum_i xs[i] @ weights[i], dim)`` over ``pg``, ``local`` rows of ``dim`` per rank."""
    name = _symm_mem_group(pg, xs[0], impl)
    if name is not None:
        x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=-1)
        w = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w, "sum", dim % x.dim(), name).contiguous()
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    arriving: Tensor | None = None
    sending: Tensor | None = None  # kept alive until its send completes
    works: list[dist.Work] = []
    for step in range(size):
        chunk = (rank - step - 1) % size
        acc = sum(torch.matmul(x.narrow(dim, chunk * local, local), w) for x, w in zip(xs, weights))
        if works:
            _wait(works)
            acc = acc + arriving
        if step == size - 1:
            return acc.contiguous()  # type: ignore[union-attr]
        sending = acc.contiguous()  # type: ignore[union-attr]
        arriving = torch.empty_like(sending)
        works = _shift(pg, sending, arriving)
    raise AssertionError("unreachable")

