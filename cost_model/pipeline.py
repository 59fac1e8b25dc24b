"""Where to cut the pipeline: contiguous chunks of decoder layers with balanced cost.

The cost of a layer is its matmul work, proportional to the weight elements its
matmuls read (2·tokens·weights FLOPs; tokens is the same for every layer, so it drops
out). The embedding lookup costs nothing; the lm_head and loss cost their weights like a
layer. ``balanced_cuts`` finds the contiguous partition of the layer sequence into
``pp·vpp`` chunks that minimizes the largest chunk cost (dynamic programming, O(L²·C), vectorized over L²),
with the embedding on the first chunk and the head on the last. Every cut lies on a
layer boundary, where only the hidden state [b, s, h] crosses, the fewest bytes any cut
of a decoder stack moves.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.fx import GraphModule

from autotp.analysis.layers import layer_of, num_layers
from autotp.ir.op_facts import is_matmul
from autotp.ir.errors import UserInputError



def layer_costs(gm: GraphModule) -> tuple[list[float], float]:
    """(cost of each decoder layer, cost of everything after the last layer)."""
    layers = num_layers(gm)
    costs = [0.0] * layers
    head = 0.0
    params = dict(gm.named_parameters(remove_duplicate=False))
    for node in gm.graph.nodes:
        if not is_matmul(node):
            continue
        weight_elems = sum(params[str(a.target)].numel() for a in _param_inputs(node) if str(a.target) in params)
        layer = layer_of(node)
        if layer is None:
            head += weight_elems
        else:
            costs[layer] += weight_elems
    return costs, head


def _param_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """get_attr inputs of ``node``, directly or through one transpose (MoE experts, ``x @ W.T``)."""
    out = []
    for n in node.all_input_nodes:
        if n.op == "call_function" and len(n.all_input_nodes) == 1:
            n = n.all_input_nodes[0]
        if n.op == "get_attr":
            out.append(n)
    return out


def balanced_cuts(costs: list[float], head: float, chunks: int) -> tuple[int, ...]:
    """The chunk of every layer: contiguous, every chunk non-empty, max cost minimal."""
    layers = len(costs)
    if chunks > layers:
        raise UserInputError(
            f"cannot cut {layers} layers into {chunks} pipeline chunks (pp*vpp); use pp*vpp <= {layers}"
        )
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=float)])
    # span[i, j]: cost of layers i..j-1, plus the head on the last chunk
    span = prefix[None, :] - prefix[:, None]
    span[:, layers] += head
    later = np.triu(np.ones((layers + 1, layers + 1), dtype=bool), k=1)  # i < j
    best = np.full((chunks + 1, layers + 1), np.inf)
    cut = np.zeros((chunks + 1, layers + 1), dtype=int)
    best[0, 0] = 0.0
    for c in range(1, chunks + 1):
        values = np.where(later, np.maximum(best[c - 1][:, None], span), np.inf)
        cut[c] = np.argmin(values, axis=0)  # the first minimum, as a left-to-right scan keeps
        best[c] = values[cut[c], np.arange(layers + 1)]
    assignment = [0] * layers
    j = layers
    for c in range(chunks, 0, -1):
        i = cut[c][j]
        for layer in range(i, j):
            assignment[layer] = c - 1
        j = i
    return tuple(assignment)


def plan_pipeline(gm: GraphModule, pp: int, vpp: int) -> tuple[tuple[int, ...], int, int]:
    """(layer_chunks, embedding_chunk, head_chunk) for ``pp*vpp`` chunks."""
    chunks = pp * vpp
    if chunks == 1:
        return (), 0, 0
    costs, head = layer_costs(gm)
    if not costs:
        raise UserInputError("pipeline parallelism needs a model with numbered decoder layers (model.layers.N ...)")
    assignment = balanced_cuts(costs, head, chunks)
    return assignment, 0, chunks - 1
