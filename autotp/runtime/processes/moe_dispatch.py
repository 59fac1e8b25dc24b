"""Kernels of the expert-parallel dispatch ops (``autotp.ir.moe_ops``), CPU and CUDA.

Rows arrive sorted by global expert; experts ``[r*E/ep, (r+1)*E/ep)`` live on ep rank r,
so the rows for each destination are contiguous. The tokens are replicated over tp, so tp
rank r dispatches every tp-th row from row r: each expert's rows split evenly over the tp
ranks (within one), still sorted. Dropless movements read the counts on
the host to size the all-to-all; sync-free ones place each kept row in a static slot
``expert * capacity + position`` (``_capacity_slots``) and move fixed-size buffers. On
arrival the kept rows are packed, local expert by local expert (``_packed_slots``), at the
front of a static ``E * capacity``-row buffer (with one ep rank, of at most the rank's own
rows): the grouped matmuls read the received counts' offsets on the device and multiply
only the rows that arrived, not the padding. With one ep rank both maps compose into one
scatter and one gather.

``drop_counts`` reports, per layer, the rows the sync-free capacity dropped and the rows
routed since the last ``reset_drop_counts`` (device tensors, read on demand).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.library import Library

from autotp.ir import moe_ops
from autotp.ir.moe_ops import received_rows
from autotp.runtime.processes.collectives import get_group

_KERNELS = Library(moe_ops.NAMESPACE, "IMPL")
_DROPS: dict[str, Tensor] = {}  # layer -> [dropped, routed] (int64, on the layer's device)


def drop_counts() -> dict[str, tuple[int, int]]:
    """Per MoE layer (sync-free mode): (rows dropped by the capacity, rows routed) since the last reset."""
    return {layer: (int(c[0]), int(c[1])) for layer, c in _DROPS.items()}


def reset_drop_counts(layers: set[str] | None = None) -> None:
    """Zero the counts of ``layers`` (None: all)."""
    for layer, counts in _DROPS.items():
        if layers is None or layer in layers:
            counts.zero_()


def _rank(group: str, size: int) -> tuple[dist.ProcessGroup | None, int]:
    if size == 1:
        return None, 0
    pg = get_group(group)
    return pg, (0 if pg is None else dist.get_rank(pg))


def _taken(x: Tensor | int, r: int, tp: int) -> Tensor | int:
    """How many of the rows ``[0, x)`` tp rank r takes: those ``i`` with ``i % tp == r``."""
    return (x - r + tp - 1) // tp if isinstance(x, int) else (x - r + tp - 1).clamp(min=0) // tp


def _route(offsets: Tensor, rows: int, num_experts: int, capacity: int, ep: int, ep_group: str, tp: int, tp_group: str,
           layer: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    _, r = _rank(tp_group, tp)
    ends = offsets.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sent = _taken(ends, r, tp) - _taken(starts, r, tp)
    kept = sent.clamp(max=capacity) if capacity else sent
    pg, _ = _rank(ep_group, ep)
    received = kept.clone()
    if pg is not None:
        dist.all_to_all_single(received, kept.contiguous(), group=pg)
    local = num_experts // ep
    if capacity:
        counts = _DROPS.get(layer)
        if counts is None or counts.device != sent.device:
            counts = _DROPS[layer] = torch.zeros(2, dtype=torch.int64, device=sent.device)
        counts.add_(torch.stack([(sent - kept).sum(), sent.sum()]))
    local_offsets = received.view(ep, local).sum(0).cumsum(0)
    header = sent.new_full((2,), tp)  # filled on the device: a host-to-device copy would break a CUDA-graph capture
    header[:1].fill_(r)
    route = torch.cat([header, sent, received])
    return route, local_offsets.to(offsets.dtype)


def _counts(route: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    return route[2 : 2 + num_experts], route[2 + num_experts :]


def _all_to_all(x: Tensor, out_rows: int, out_splits: list[int] | None, in_splits: list[int] | None, pg: dist.ProcessGroup | None) -> Tensor:
    if pg is None:
        return x.clone()
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=pg)
    return out


def _expert_major(received: list[int], ep: int, local: int) -> Tensor:
    """Index that reorders rows received source by source (each source's rows by local
    expert) into local expert by local expert (each expert's rows by source)."""
    starts, pos = [], 0
    for c in received:
        starts.append(pos)
        pos += c
    parts = [torch.arange(starts[s * local + j], starts[s * local + j] + received[s * local + j]) for j in range(local) for s in range(ep)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _capacity_slots(sent: Tensor, n: int, num_experts: int, capacity: int) -> Tensor:
    """For each of the ``n`` rows of this rank's slice: its slot ``expert * capacity +
    position`` in the send buffer, or ``num_experts * capacity`` (a spare row) when the
    capacity drops it. Device ops only (``output_size`` keeps ``repeat_interleave`` sync-free)."""
    starts = sent.cumsum(0) - sent
    expert = torch.repeat_interleave(torch.arange(num_experts, device=sent.device), sent, output_size=n)
    position = torch.arange(n, device=sent.device) - starts[expert]
    return torch.where(position < capacity, expert * capacity + position, num_experts * capacity)


def _packed_slots(received: Tensor, ep: int, local: int, capacity: int, spare: int) -> Tensor:
    """For each slot of the received buffer (source rank, local expert, position): its row in
    the packed buffer of ``spare`` rows (local expert by local expert, each expert's rows by
    source rank), or ``spare`` (a spare row) for padding; one more entry maps the send
    buffer's spare slot (a dropped row) to that spare row. Device ops only."""
    counts = received.view(ep, local)
    expert_major = counts.t().reshape(-1)
    starts = (expert_major.cumsum(0) - expert_major).view(local, ep).t()
    position = torch.arange(capacity, device=received.device)
    slots = starts.unsqueeze(-1) + position
    packed = torch.where(position < counts.unsqueeze(-1), slots, spare).reshape(-1)
    return torch.cat([packed, packed.new_full((1,), spare)])


def _with_spare(x: Tensor) -> Tensor:
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])


def _to_experts(x: Tensor, route: Tensor, num_experts: int, capacity: int, ep: int, ep_group: str, tp: int, tp_group: str) -> Tensor:
    _, r = _rank(tp_group, tp)
    part = x[r::tp]
    sent, received = _counts(route, num_experts)
    pg, _ = _rank(ep_group, ep)
    local = num_experts // ep
    if capacity:
        rows = received_rows(x.shape[0], num_experts, capacity, ep, tp)
        slots = _capacity_slots(sent, part.shape[0], num_experts, capacity)
        packed = _packed_slots(received, ep, local, capacity, rows)
        out = part.new_zeros((rows + 1, *part.shape[1:]))
        if pg is None:  # one ep rank: each row straight to its packed slot
            out[packed[slots]] = part
            return out[:-1]
        buf = part.new_zeros((num_experts * capacity + 1, *part.shape[1:]))
        buf[slots] = part
        out[packed[:-1]] = _all_to_all(buf[:-1], num_experts * capacity, None, None, pg)
        return out[:-1]
    host = route.tolist()  # dropless: the all-to-all sizes come from the counts
    sent_h, received_h = host[2 : 2 + num_experts], host[2 + num_experts :]
    in_splits = [sum(sent_h[d * local : (d + 1) * local]) for d in range(ep)]
    out_splits = [sum(received_h[s * local : (s + 1) * local]) for s in range(ep)]
    moved = _all_to_all(part, sum(out_splits), out_splits, in_splits, pg)
    return moved[_expert_major(received_h, ep, local).to(moved.device)]


def _from_experts(y: Tensor, route: Tensor, rows: int, num_experts: int, capacity: int, ep: int, ep_group: str, tp: int,
                  tp_group: str) -> Tensor:  # fmt: skip
    _, r = _rank(tp_group, tp)
    mine = _taken(rows, r, tp)
    sent, received = _counts(route, num_experts)
    pg, _ = _rank(ep_group, ep)
    local = num_experts // ep
    if capacity:
        slots = _capacity_slots(sent, mine, num_experts, capacity)
        packed = _packed_slots(received, ep, local, capacity, y.shape[0])
        if pg is None:
            part = _with_spare(y)[packed[slots]]
        else:
            back = _all_to_all(_with_spare(y)[packed[:-1]], num_experts * capacity, None, None, pg)
            part = _with_spare(back)[slots]
    else:
        host = route.tolist()
        sent_h, received_h = host[2 : 2 + num_experts], host[2 + num_experts :]
        in_splits = [sum(sent_h[d * local : (d + 1) * local]) for d in range(ep)]
        out_splits = [sum(received_h[s * local : (s + 1) * local]) for s in range(ep)]
        order = _expert_major(received_h, ep, local).to(y.device)
        source_major = torch.empty_like(y)
        source_major[order] = y
        part = _all_to_all(source_major, mine, in_splits, out_splits, pg)
    return _gather_slices(part, rows, tp, tp_group)


def _gather_slices(part: Tensor, rows: int, tp: int, tp_group: str) -> Tensor:
    """The ``rows`` rows from every tp rank's share (rank r took the rows ``i % tp == r``)."""
    pg, _ = _rank(tp_group, tp)
    if pg is None:
        return part.clone()
    width = -(-rows // tp)
    padded = torch.cat([part, part.new_zeros((width - part.shape[0], *part.shape[1:]))])
    pieces = [torch.empty_like(padded) for _ in range(tp)]
    dist.all_gather(pieces, padded.contiguous(), group=pg)
    return torch.stack(pieces, 1).reshape(width * tp, *part.shape[1:])[:rows]

for _op, _fn in ((moe_ops.MOE_ROUTE, _route), (moe_ops.MOE_TO_EXPERTS, _to_experts), (moe_ops.MOE_FROM_EXPERTS, _from_experts)):
    for _device in ("CPU", "CUDA"):
        _KERNELS.impl(_op._schema.name.split("::")[1], _fn, _device)
