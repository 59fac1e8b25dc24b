"""Where to cut the pipeline: contiguous chunks of units with balanced loads.

A unit (``autotp.analysis.pipeline_units``) is a decoder layer, or a block outside the
layers: the embedding, a cross-attention before a latent stack, the lm_head. It has two
costs (``unit_costs``): its matmul work, proportional to the weight elements its
contractions read (``contracts_weight``: matmuls, einsums, convolutions; 2·tokens·weights
FLOPs, tokens the same for every unit, so it drops out; the embedding lookup costs nothing), and the parameter elements it reads; a node of no unit
counts for the unit in progress, where it runs. A chunk's load is the larger of its shares
of the two totals, ``max(work_c / work, params_c / params)``: the slowest stage sets the
step time and the fullest its memory. ``balanced_cuts`` finds the contiguous partition of
a unit sequence into ``pp·vpp`` chunks that minimizes the largest load (dynamic
programming, O(U²·C), vectorized over U²). ``plan_pipeline`` cuts the graph's units in the
order they run, so a cut lies on a layer boundary (where only the hidden state [b, s, h]
crosses, the fewest bytes any cut of a decoder stack moves) or between the blocks around
the stack; a unit that alone exceeds a chunk's share is split into its child modules first,
and inside such a split its parts again where that balances the chunks clearly better
(``balanceable_units``: a hierarchical model's last stage is cut between or inside its blocks). The
planner (``ModelCosts.layer_chunks``) cuts its extrapolated layers by their work alone
(``layer_costs``: the matmuls outside the layers on the last chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autotp.analysis.layers import HEAD, last_layer_position, layer_of, num_layers, outside_layers
from autotp.analysis.pipeline_units import Unit, layer_paths, placed_chunk, units
from autotp.ir.op_facts import CONVOLUTIONS, is_matmul, op_name
from autotp.ir.errors import UserInputError


MIN_SPLIT_GAIN = 0.02
"""What splitting a block further must take off the fullest chunk's load: a cut inside a block sends its inner
activations (an MLP's hidden state beside the residual), more than a cut between blocks."""


CROWDED_SHARE = 1.3
"""A chunk holding more than this over ``chunks`` of the parameters defeats the memory pipelining
saves: then a layer of that chunk is split into its parts too (a CNN's stages, whose last ones
hold most parameters in few blocks), which cuts between whole layers never do otherwise."""


class StageCuts(NamedTuple):
    """The plan's pipeline fields (``ParallelPlan.layer_chunks`` and friends)."""

    layer_chunks: tuple[int, ...]
    embedding_chunk: int
    head_chunk: int
    module_chunks: tuple[tuple[str, int], ...]


def weight_operands(gm: GraphModule) -> dict[torch.fx.Node, int]:
    """Elements of every value computed from parameters alone (no input in its ancestry, a
    parameter in it): a weight as a matmul reads it, directly, transposed, or rebuilt in the
    forward (a fake-quantized, normalized or LoRA-merged weight)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    sizes: dict[torch.fx.Node, int] = {}
    constant: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            constant.add(node)
            if str(node.target) in params:
                sizes[node] = params[str(node.target)].numel()
        elif node.op == "call_function" and all(a in constant for a in node.all_input_nodes):  # factories (zeros) too
            constant.add(node)
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and any(a in sizes for a in node.all_input_nodes):
                sizes[node] = val.numel()
    return sizes


_CONTRACTIONS = frozenset({"einsum", "tensordot", "bilinear"})


def contracts_weight(node: torch.fx.Node) -> bool:
    """A matmul, an einsum or a convolution: the ops whose work grows with the weight they read
    (an FNO's complex ``einsum`` over its spectral weights, a ``Conv1d(k=1)``)."""
    return is_matmul(node) or node.target in CONVOLUTIONS or op_name(node.target) in _CONTRACTIONS


def _weight_elems(node: torch.fx.Node, weights: dict[torch.fx.Node, int]) -> int:
    return sum(weights.get(a, 0) for a in node.all_input_nodes)


def layer_costs(gm: GraphModule) -> tuple[list[float], float]:
    """(cost of each decoder layer, cost of the matmuls outside the layers)."""
    costs = [0.0] * num_layers(gm)
    head = 0.0
    weights = weight_operands(gm)
    for node in gm.graph.nodes:
        if not contracts_weight(node):
            continue
        layer = layer_of(node)
        if layer is None:
            head += _weight_elems(node, weights)
        else:
            costs[layer] += _weight_elems(node, weights)
    return costs, head


def unit_costs(gm: GraphModule, of: dict[torch.fx.Node, Unit]) -> dict[Unit, tuple[float, float]]:
    """(matmul work, parameter elements) of every unit of ``gm`` (``of``: ``units(gm)``), in
    the order the graph first runs them; a parameter read by several units counts in each."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    weights = weight_operands(gm)
    work: dict[Unit, float] = dict.fromkeys(dict.fromkeys(of.values()), 0.0)
    held: dict[Unit, dict[int, int]] = {unit: {} for unit in work}
    current = next(iter(work), None)
    for node in gm.graph.nodes:
        current = of.get(node, current)
        if current is None or node.op != "call_function":
            continue
        if contracts_weight(node):
            work[current] += _weight_elems(node, weights)
        for a in node.all_input_nodes:
            if a.op == "get_attr" and str(a.target) in params:
                held[current][id(params[str(a.target)])] = params[str(a.target)].numel()
    return {unit: (work[unit], float(sum(held[unit].values()))) for unit in work}


def _shares(costs: Sequence[float] | Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(costs as a [units, resources] array, the totals to divide them by: 1 for a zero total)."""
    per_unit = np.asarray(costs, dtype=float).reshape(len(costs), -1)
    totals = per_unit.sum(axis=0)
    return per_unit, np.where(totals > 0, totals, 1.0)


def balanced_cuts(costs: Sequence[float] | Sequence[Sequence[float]], chunks: int) -> tuple[int, ...]:
    """The chunk of every unit of ``costs`` (one cost, or one per resource, each unit):
    contiguous, every chunk non-empty, the largest load minimal; a chunk's load is its
    largest share of a resource's total."""
    n = len(costs)
    if chunks > n:
        raise UserInputError(
            f"cannot cut {n} layers into {chunks} pipeline chunks (pp*vpp); use pp*vpp <= {n}"
        )
    per_unit, totals = _shares(costs)
    prefix = np.concatenate([np.zeros((1, per_unit.shape[1])), np.cumsum(per_unit, axis=0)])
    # span[i, j]: load of units i..j-1 (shares of the differences, so equal sums tie exactly)
    span = ((prefix[None, :, :] - prefix[:, None, :]) / totals).max(axis=-1)
    later = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)  # i < j
    best = np.full((chunks + 1, n + 1), np.inf)
    cut = np.zeros((chunks + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for c in range(1, chunks + 1):
        values = np.where(later, np.maximum(best[c - 1][:, None], span), np.inf)
        cut[c] = np.argmin(values, axis=0)  # the first minimum, as a left-to-right scan keeps
        best[c] = values[cut[c], np.arange(n + 1)]
    assignment = [0] * n
    j = n
    for c in range(chunks, 0, -1):
        i = cut[c][j]
        for unit in range(i, j):
            assignment[unit] = c - 1
        j = i
    return tuple(assignment)


def _parts(of: dict[torch.fx.Node, Unit], path: str) -> list[str]:
    """The units inside the module ``path``, in the order they first run."""
    return [u for u in dict.fromkeys(of.values()) if isinstance(u, str) and u.startswith(path + ".")]


def _sized_by_data(gm: GraphModule, path: str) -> bool:
    """Whether a value computed inside the module ``path`` has a size only the run knows (the
    tokens routed to an expert): a cut inside it would send a tensor that no receiver can size."""
    return any(
        free_unbacked_symbols(n.meta.get("val")) for n in gm.graph.nodes
        if any(p == path or p.startswith(path + ".") for p, _ in (n.meta.get("nn_module_stack") or {}).values())
    )  # fmt: skip


def balanceable_units(gm: GraphModule, chunks: int) -> tuple[dict[torch.fx.Node, Unit], frozenset[str]]:
    """(``units(gm, split)``, ``split``): every unit whose load alone exceeds a chunk's share
    (``1 / chunks``: no cut between units could balance it) split into its children, again
    while a part exceeds it, where it has two parts or more (a module of one part: that part's)
    and no value of a size only the run knows (``_sized_by_data``: an MoE layer stays whole).
    Then, inside the modules so split, the heaviest part of the fullest chunk of the best cut is
    split too while that lowers the fullest chunk's load by ``MIN_SPLIT_GAIN`` (a stage of two large
    blocks, each under a chunk's share, that no cut between them balances: a ResNeXt's last stage),
    and so are its layers while it holds more than ``CROWDED_SHARE`` of its share of the parameters
    (ConvNeXt's last two stages, a third of the parameters each)."""
    paths = layer_paths(gm)
    split: frozenset[str] = frozenset()
    whole: set[str] = set()  # too large, but of fewer than two parts
    of = units(gm)
    while True:
        costs = unit_costs(gm, of)
        per_unit, totals = _shares(list(costs.values()))
        loads = (per_unit / totals).max(axis=-1)
        heavy = [path for u, load in zip(costs, loads) if load > 1 / chunks and (path := paths[u] if isinstance(u, int) else u) not in whole]
        if not heavy:
            break
        for path in heavy:
            trial = _split_into_parts(gm, split, path)
            if trial is None:
                whole.add(path)
            else:
                split = trial
        of = units(gm, split)
    while True:
        costs = unit_costs(gm, of)
        fullest = _fullest_load(list(costs.values()), chunks)
        crowded = fullest.params_share > CROWDED_SHARE / chunks
        inside = {u: u for u in fullest.units(list(costs)) if isinstance(u, str) and u not in whole and any(u.startswith(p + ".") for p in split)}
        inside |= {u: paths[u] for u in fullest.units(list(costs)) if crowded and isinstance(u, int) and paths[u] not in whole}
        if not inside:
            return of, split
        heaviest = inside[max(inside, key=lambda u: max(a / b for a, b in zip(costs[u], fullest.totals)))]
        trial = _split_into_parts(gm, split, heaviest)
        if trial is not None and _fullest_load(list(unit_costs(gm, units(gm, trial)).values()), chunks).load < fullest.load - MIN_SPLIT_GAIN:
            split, of = trial, units(gm, trial)
        else:
            whole.add(heaviest)


def _split_into_parts(gm: GraphModule, split: frozenset[str], path: str) -> frozenset[str] | None:
    """``split`` with the module ``path`` split into two parts or more (None: it has fewer, or a size only the run knows)."""
    if _sized_by_data(gm, path):
        return None
    trial = split | {path}
    parts = _parts(units(gm, trial), path)
    while len(parts) == 1:  # a module of one part (a block list of one block): split that part too
        trial |= {parts[0]}
        parts = _parts(units(gm, trial), path)
    return trial if len(parts) >= 2 else None


class _Fullest(NamedTuple):
    load: float  # the fullest chunk's load in the best cut
    chunk: int
    assignment: tuple[int, ...]
    totals: np.ndarray
    params_share: float  # of the fullest chunk

    def units(self, listed: list[Unit]) -> list[Unit]:
        return [u for u, c in zip(listed, self.assignment) if c == self.chunk]


def _fullest_load(costs: list[tuple[float, float]], chunks: int) -> _Fullest:
    """The best cut of ``costs`` (``balanced_cuts``) and its fullest chunk."""
    assignment = balanced_cuts(costs, chunks)
    per_unit, totals = _shares(costs)
    loads = [(per_unit[[i for i, c in enumerate(assignment) if c == chunk]].sum(axis=0) / totals).max() for chunk in range(chunks)]
    chunk = int(np.argmax(loads))
    params = per_unit[[i for i, c in enumerate(assignment) if c == chunk]].sum(axis=0)[-1] / totals[-1]
    return _Fullest(float(loads[chunk]), chunk, assignment, totals, float(params))


def plan_pipeline(gm: GraphModule, pp: int, vpp: int) -> StageCuts:
    """The stage cuts of ``gm`` for ``pp*vpp`` chunks: its units balanced (those too large to
    balance split, ``balanceable_units``), the first on the first chunk, the last on the last."""
    chunks = pp * vpp
    if chunks == 1:
        return StageCuts((), 0, 0, ())
    count = len(set(units(gm).values()))
    if count < chunks:
        raise UserInputError(f"{chunks} pipeline chunks need as many modules to cut between (numbered decoder layers, model.layers.N ..., or blocks the forward runs one after another); the model has {count}")
    of, split = balanceable_units(gm, chunks)
    costs = unit_costs(gm, of)
    chunk_of: dict[Unit, int] = dict(zip(costs, balanced_cuts(list(costs.values()), chunks)))
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    first_at: dict[Unit, int] = {}
    for node, unit in of.items():
        first_at.setdefault(unit, position[node])
    for path in split:  # a split module runs where its first part does
        first = _parts(of, path)[0]
        chunk_of[path], first_at[path] = chunk_of[first], first_at[first]
    paths = layer_paths(gm)
    layer_chunks = tuple(chunk_of[i] if i in chunk_of else chunk_of[paths[i]] for i in range(num_layers(gm)))
    layers = {paths[i]: chunk for i, chunk in enumerate(layer_chunks)}
    last_layer_at, head = last_layer_position(nodes), chunks - 1
    moved: dict[str, int] = {}
    for path in sorted((u for u in chunk_of if isinstance(u, str) and u not in layers), key=lambda p: p.count(".")):
        placed = placed_chunk(path.rpartition(".")[0], moved, layers) if "." in path else None
        if placed is None:
            placed = head if outside_layers(first_at[path], last_layer_at) == HEAD else 0
        if chunk_of[path] != placed:
            moved[path] = chunk_of[path]
    in_order = sorted(moved, key=lambda p: (first_at[p], p.count(".")))
    return StageCuts(layer_chunks, 0, head, tuple((path, moved[path]) for path in in_order))
