"""Refuse ranks that built different models.

Every rank traces, plans and shards its own copy of the model: its shards are cut from that
copy, and the parameters several ranks hold (norms, a kept-whole router, shared KV heads) must
be equal on them. Ranks whose models differ in their values (a model built without seeding
the random generator alike on every rank) would train a model no rank built, and ranks whose
models differ in their structure (a layer drawn with Python's ``random`` at construction) run
different graphs against each other's collectives. ``refuse_different_models`` compares, over
all ranks, a fingerprint of the traced graph, of the plan and of every parameter's and buffer's
bytes, and raises on every rank naming what differs and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import _get_qualified_name, map_aggregate

from autotp.ir.errors import UserInputError
from autotp.ir.plan import ParallelPlan

log = logging.getLogger(__name__)

_FIX_VALUES = ("autotp cuts each rank's shards from that rank's own copy of the model, so every rank must build the same "
               "one: seed the random generators alike on every rank before building it (torch.manual_seed(0)), load the "
               "same weights on every rank, or build the model on 'meta' and pass checkpoint=")
_FIX_STRUCTURE = ("every rank must build the same model; a model whose structure is drawn at construction (Python's "
                  "random, numpy's) needs those generators seeded alike on every rank too (random.seed(0))")

_PLAIN_ARGS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


@dataclass(frozen=True)
class _Fingerprint:
    graph: str
    plan: str
    tensors: dict[str, tuple[str, int | None]]  # name -> (dtype and shape, sum of its bytes or None when not compared)


def refuse_different_models(model: nn.Module, traced: GraphModule, plan: ParallelPlan, compare_values: bool) -> None:
    """Raise ``UserInputError`` on every rank when the ranks' models, traced graphs or plans differ.
    ``compare_values``: the parameters' values are the ones the ranks will shard (not a checkpoint's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    lines = _graph_lines(traced)
    mine = _Fingerprint(_digest("\n".join(lines)), _digest(json.dumps(plan.to_json(), sort_keys=True, default=str)),
                        _tensor_sums(model, compare_values))
    everyone: list[_Fingerprint | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    assert first is not None
    odd = next((r for r, f in enumerate(everyone) if f != first), None)
    if odd is None:
        return
    other = everyone[odd]
    assert other is not None
    if other.tensors != first.tensors:
        same_shapes = {n: s for n, (s, _) in first.tensors.items()} == {n: s for n, (s, _) in other.tensors.items()}
        raise UserInputError(f"ranks 0 and {odd} built different models: {_tensor_difference(first.tensors, other.tensors)}. "
                             + (_FIX_VALUES if same_shapes else _FIX_STRUCTURE))
    if other.graph != first.graph:
        graphs: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(graphs, lines)
        raise UserInputError(f"ranks 0 and {odd} traced different graphs from their models "
                             f"({_line_difference(traced, graphs[0], graphs[odd])}); {_FIX_STRUCTURE}")
    raise UserInputError(f"ranks 0 and {odd} chose different plans for the same model; pass one plan to every rank "
                         "(parallelize(..., plan=<the JSON of pm.plan.to_json() or autotp plan --format json>))")


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _graph_lines(gm: GraphModule) -> list[str]:
    """One line per node: its name, op, target, arguments and value's shape, free of addresses."""

    def plain(a: object) -> object:
        if isinstance(a, Node):
            return a.name
        return a if isinstance(a, _PLAIN_ARGS) else type(a).__name__

    lines = []
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else _get_qualified_name(node.target)
        value = node.meta.get("val")
        shape = list(value.shape) if isinstance(value, torch.Tensor) else ""
        lines.append(f"{node.name} = {node.op} {target}{map_aggregate(node.args, plain)}"
                     f"{map_aggregate(node.kwargs, plain)} {shape}")
    return lines


def _tensor_sums(model: nn.Module, compare_values: bool) -> dict[str, tuple[str, int | None]]:
    """Each parameter's and buffer's dtype and shape, and the exact (integer) sum of its bytes,
    which no summation order changes. Non-persistent buffers are compared by shape only: some are
    scratch space allocated empty and written before the forward reads them (caches)."""
    persistent = set(model.state_dict(keep_vars=True))
    shapes, sums = {}, {}
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            key = f"{kind} {name}"
            shapes[key] = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            if compare_values and t.device.type != "meta" and name in persistent:
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
                sums[key] = words.sum(dtype=torch.int64)
    by_device: dict[torch.device, list[str]] = {}
    for key, total in sums.items():
        by_device.setdefault(total.device, []).append(key)
    values = {}
    for keys in by_device.values():  # one copy to the host per device
        values.update(zip(keys, torch.stack([sums[k] for k in keys]).tolist()))
    return {key: (shape, values.get(key)) for key, shape in shapes.items()}


def _tensor_difference(first: dict[str, tuple[str, int | None]], other: dict[str, tuple[str, int | None]]) -> str:
    only = sorted(first.keys() ^ other.keys())
    if only:
        return f"{len(only)} parameter(s) or buffer(s) exist on one of them only, e.g. {only[:4]}"
    shaped = [f"{n} ({first[n][0]} vs {other[n][0]})" for n in first if first[n][0] != other[n][0]]
    if shaped:
        return f"{len(shaped)} parameter(s) or buffer(s) differ in dtype or shape, e.g. {', '.join(shaped[:4])}"
    valued = [n for n in first if first[n] != other[n]]
    return f"{len(valued)} of {len(first)} parameter(s) and buffer(s) hold different values, e.g. {', '.join(valued[:4])}"


def _line_difference(traced: GraphModule, first: list[str] | None, other: list[str] | None) -> str:
    assert first is not None and other is not None
    for node, a, b in zip(traced.graph.nodes, first, other):
        if a != b:
            stack = node.meta.get("nn_module_stack") or {}
            module = f" in module {next(reversed(stack.values()))[0] or '(the root)'}" if stack else ""
            return f"at node {node.name}{module}: '{a}' against '{b}'"
    return f"{len(first)} against {len(other)} nodes"
