"""Which tensors are alive at each node of one microbatch's forward and backward: ``simulate``.

The compiled rank graph runs eagerly, node by node, under autograd; this replays that
run on the local shapes and counts the bytes of live tensor storage at every step, as
``torch.cuda.max_memory_allocated`` sees them (checked against ``PeakLiveBytes`` on CPU,
``tests/test_memory_model.py``). Every byte count is ``const + per_sample·b`` (a row of
``[const, per_sample]``) at microbatch size b, as in ``autotp.cost_model.compute``.

**Forward**, in graph order: a node allocates its output unless it aliases its first
input (``autotp.ir.op_facts``: views, conversions to the same dtype, in-place ops;
``reshape`` and ``contiguous`` copy a non-contiguous input: one made by transpose, permute,
expand or slice). A storage dies
after its last forward use unless a node saves it for backward
(``saved_tensors.saved_inputs``); graph outputs other than the loss die when the forward
returns. ``cross_entropy_loss`` keeps its log-softmax (input size) and the vocab-parallel
loss its input.

**Backward**, in reverse graph order over the nodes that need a gradient and that the loss
depends on (the other outputs, such as gathered logits, get none; what only their nodes
save dies with them when the forward returns; ``_backpropagated``): each allocates
the gradient of each input that needs one (views, ``add`` and the identity collectives
pass their output's gradient on; slices allocate their whole input), then frees its
output's gradient and the storages no earlier node still saves. A gradient reaching an
input that already has one is added in place (the new one is a transient). The losses
hold input-sized temporaries while they run: ``cross_entropy_loss`` the gradient of its
log-softmax, the vocab-parallel loss four (``autotp.ir.ops``: exp, softmax, one-hot, their difference)
backward and two forward. The fused lm_head and loss (``linear_cross_entropy``) keeps the
gradients of its hidden states and of its weight (which does not grow with the batch), computed
in its forward, and holds ``_FUSED_LOSS_BUFFERS`` float32 logit chunks while it runs; its
backward allocates the two gradients again (scaled).

**Compiled** (``compile=True``): ``saved_by`` holds what AOTAutograd's partitioner keeps
(``fused_kernels.compiled_saves``), the fused loss's chunk buffers are its logits and their
gradient in the weight's dtype, and an embedding's backward holds a float32 copy of its table
while it accumulates the gradient (inductor's decomposition of ``embedding_dense_backward``);
the backward graph returns every parameter gradient of a microbatch at its end, and autograd adds
them to ``.grad`` after it (``grads_returned_together``).

**Parameter gradients** are reported apart: ``param_grads`` is what a node's backward
allocates for parameters (``.grad`` keeps it on the first microbatch; later ones add it
in place, a transient of that size).

Per segment (``SegmentMemory``), with ``prefix`` the saved bytes of the segments before it:
``forward[j]`` = live bytes at its j-th forward node minus ``prefix``; ``backward[j]``
the same in its backward, without parameter gradients; ``own_grads[j]`` this segment's
parameter gradients allocated up to node j (first microbatch); ``grad_transient[j]`` the
parameter gradient node j makes (later microbatches). ``saved`` is what it holds from its
forward to its backward; ``deferred`` what a zero-bubble schedule holds from its ``B`` to
its ``W`` (``autotp.runtime.execution.weight_grads``: each linear's input, once per storage, and
output gradient); ``inputs`` the storages it reads from other segments (what it keeps when it
recomputes, ``autotp.cost_model.recompute``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch.fx import GraphModule, Node

from autotp.analysis.layers import LayerKey
from autotp.analysis.local_shapes import TensorInfo
from autotp.ir.op_facts import copies_if_strided, is_conversion, is_inplace, is_view, op_name, strides_output

_WHOLE_INPUT_GRAD = {"slice", "select", "narrow", "expand", "expand_as", "as_strided"}  # zeros + copy, or a sum
_PASS_GRAD = {"add", "sub", "neg", "reduce_from_tp", "stage_boundary"}  # the gradient of each input is a view of the output's
_GRAD_COPIES = {"copy_to_tp"}  # a view forward; its backward all-reduces a copy of the gradient
_OWN_SAVE = {"cross_entropy_loss"}  # keeps its log-softmax (input-sized), not its input
_LOSS_FORWARD = {"cross_entropy_loss": 1, "vocab_parallel_cross_entropy": 2}  # input-sized buffers while it runs
_LOSS_BACKWARD = {"cross_entropy_loss": 1, "vocab_parallel_cross_entropy": 4}
_FUSED_LOSS = "linear_cross_entropy"  # keeps the gradients of its hidden states and weight
_FUSED_LOSS_BUFFERS = 2  # float32 logit-chunk-sized buffers while it runs
# compiled, the table's gradient is accumulated in a float32 buffer before its cast (torch._decomp's
# embedding_dense_backward computes in the op-math dtype), a transient of the table's size
_OPMATH_TABLE_GRAD = {"embedding"}


@dataclass(frozen=True, eq=False)
class SegmentMemory:
    """One segment's share of a microbatch's live bytes (module docstring); arrays are [nodes, 2]."""

    saved: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    own_grads: np.ndarray
    grad_transient: np.ndarray
    param_grads: np.ndarray
    deferred: np.ndarray  # what a zero-bubble W keeps after B: each weight linear's input and output gradient
    inputs: np.ndarray = field(default_factory=lambda: np.zeros(2))  # the activations it reads from other segments (what a recomputed segment keeps)
    # compiled: the backward graph returns a microbatch's parameter gradients together, added to ``.grad`` after it
    # (every later microbatch's gradients are alive at once, as the first one's are)
    grads_returned_together: bool = False

    @staticmethod
    def empty() -> SegmentMemory:
        z = np.zeros((1, 2))
        return SegmentMemory(np.zeros(2), z, z, z, z, np.zeros(2), np.zeros(2))


def _is_view(node: Node, strided: set[Node]) -> bool:
    target, src = node.target, node.args[0] if node.args else None
    if is_inplace(target):
        return True
    if is_conversion(target):
        return isinstance(src, Node) and _dtype(src) == _dtype(node)
    if copies_if_strided(target):
        return not (isinstance(src, Node) and src in strided)
    return is_view(target)


def _dtype(node: Node) -> object:
    val = node.meta.get("val")
    return getattr(val, "dtype", None)


def _backpropagated(output: Node, grad: set[Node]) -> set[Node]:
    """The nodes needing a gradient that the backward reaches: those the loss (the scalar
    outputs that need a gradient; every output that needs one if none is a scalar) depends on.
    The other outputs (gathered logits) get no gradient: their graph dies with them."""
    outs = [a for a in output.all_input_nodes if a in grad]
    scalar = [a for a in outs if getattr(a.meta.get("val"), "shape", None) == ()]
    reached: set[Node] = set()
    stack = scalar or outs
    while stack:
        n = stack.pop()
        if n not in reached:
            reached.add(n)
            stack.extend(a for a in n.all_input_nodes if a in grad)
    return reached


def _fused_loss_chunk(n: Node, tensors: dict[Node, list[TensorInfo]], batch: int, compiled: bool) -> np.ndarray:
    """The fused loss's buffers while it runs: float32 logits of one chunk of tokens (all of
    them, growing with the batch, when the chunk holds every traced token); ``compiled``, the chunk's
    logits and their gradient in the weight's dtype (inductor fuses the float32 work between them)."""
    hidden, weight = tensors[n.args[0]][0], tensors[n.args[1]][0]
    tokens = hidden.numel // hidden.shape[-1]
    per_token = _FUSED_LOSS_BUFFERS * (weight.dtype.itemsize if compiled else 4) * weight.shape[0]
    chunk = n.args[7]
    return np.array([0.0, tokens * per_token / batch]) if chunk >= tokens else np.array([float(chunk * per_token), 0.0])


def simulate(
    gm: GraphModule,
    tensors: dict[Node, list[TensorInfo]],
    dependent: set[Node],
    grad: set[Node],
    saved_by: dict[Node, list[Node]],
    segment_of: dict[Node, LayerKey],
    batch: int,
    compiled: bool = False,
) -> dict[LayerKey, SegmentMemory]:
    """Live bytes of one microbatch through ``gm``, per segment (module docstring).

    ``saved_by[n]``: the inputs node n keeps for its backward; ``segment_of``: each call
    node's segment; ``batch``: the traced batch size (``dependent`` nodes scale with it);
    ``compiled``: under ``compile=True`` (``saved_by`` then says what its partitioner keeps).
    """
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function"]
    output = next(n for n in nodes if n.op == "output")
    reached = _backpropagated(output, grad)
    params = {n for n in nodes if n.op == "get_attr" and n in reached}

    def size(n: Node) -> np.ndarray:  # scalars (a loss) do not grow with the batch
        scaled = sum(t.nbytes for t in tensors.get(n, ()) if t.shape) if n in dependent else 0
        fixed = sum(t.nbytes for t in tensors.get(n, ())) - scaled
        return np.array([float(fixed), scaled / batch])

    def storage(n: Node) -> np.ndarray:  # a loss that keeps its log-softmax (or the fused loss its gradients) holds that too
        if op_name(n.target) == _FUSED_LOSS:
            return size(n) + size(n.args[0]) + size(n.args[1])
        return size(n) + size(n.args[0]) if op_name(n.target) in _OWN_SAVE else size(n)

    # ---- storages: every call node's root (the node that allocated what it reads) ----
    root: dict[Node, Node] = {}
    strided: set[Node] = set()
    for n in calls:
        src = next((a for a in n.all_input_nodes if a in root), None)
        if _is_view(n, strided) and src is not None:
            root[n] = root[src]
            if strides_output(n.target) or src in strided:
                strided.add(n)
        else:
            root[n] = n
    position = {n: i for i, n in enumerate(nodes)}
    last_use: dict[Node, int] = {}
    for n in calls:
        for u in n.users:
            last_use[root[n]] = max(last_use.get(root[n], 0), position[u])
    kept: dict[Node, Node] = {}  # saved storage -> the earliest node saving it (its backward frees it)
    for n in (c for c in calls if c in reached):
        for x in [n] if op_name(n.target) in _OWN_SAVE | {_FUSED_LOSS} else saved_by.get(n, ()):
            if x in root:
                kept.setdefault(root[x], n)
    outputs = {root[a] for a in output.all_input_nodes if a in root}

    segments = list(dict.fromkeys(segment_of[n] for n in calls))
    saved = {k: np.zeros(2) for k in segments}
    for r in kept:
        saved[segment_of[r]] += storage(r)
    prefix: dict[LayerKey, np.ndarray] = {}
    running = np.zeros(2)
    for k in segments:
        prefix[k] = running.copy()
        running = running + saved[k]
    rows: dict[LayerKey, dict[str, list]] = {k: {"forward": [], "backward": [], "own": [], "transient": []} for k in segments}

    # ---- forward ----
    live: dict[Node, np.ndarray] = {}
    total = np.zeros(2)
    for n in calls:
        if root[n] is n:
            live[n] = storage(n)
            total = total + live[n]
        if n in grad:
            loss = _LOSS_FORWARD.get(op_name(n.target), 0) - (op_name(n.target) in _OWN_SAVE)
            transient = loss * size(n.args[0]) + (_fused_loss_chunk(n, tensors, batch, compiled) if op_name(n.target) == _FUSED_LOSS else 0)
            rows[segment_of[n]]["forward"].append(total + transient - prefix[segment_of[n]])
        for r in {root[a] for a in n.all_input_nodes if a in root} | {root[n]}:
            if r in live and r not in kept and last_use.get(r, -1) <= position[n] and r not in outputs:
                total = total - live.pop(r)
    for r in outputs - set(kept):
        if r in live:
            total = total - live.pop(r)

    # ---- backward ----
    grads: dict[Node, np.ndarray] = {}  # node -> bytes of the gradient of its output it owns
    seen_grad: set[Node] = set()
    by_saver: dict[Node, list[Node]] = {}
    for r, saver in kept.items():
        by_saver.setdefault(saver, []).append(r)
    param_grads = {k: np.zeros(2) for k in segments}
    for n in reversed(calls):
        if n not in reached:
            continue
        name = op_name(n.target)
        k = segment_of[n]
        step = np.zeros(2)  # transients of this node
        pg = np.zeros(2)
        passes = name in _PASS_GRAD or (root[n] is not n and name not in _WHOLE_INPUT_GRAD | _GRAD_COPIES)
        for x in dict.fromkeys(n.all_input_nodes):
            if x in params:
                pg = pg + size(x)
            elif x in reached and x in root:
                g = np.zeros(2) if passes else size(x)
                if x in seen_grad:
                    step = step + g
                else:
                    seen_grad.add(x)
                    grads[x] = g
                    total = total + g
        step = step + _LOSS_BACKWARD.get(name, 0) * size(n.args[0])
        if compiled and name in _OPMATH_TABLE_GRAD and n.args[0] in params:
            step = step + np.array([4.0 * sum(t.numel for t in tensors[n.args[0]]), 0.0])  # the table in float32
        param_grads[k] = param_grads[k] + pg
        rows[k]["backward"].append(total + step - prefix[k])
        rows[k]["own"].append(param_grads[k].copy())
        rows[k]["transient"].append(pg)
        total = total - grads.pop(n, np.zeros(2))
        for r in by_saver.get(n, ()):
            total = total - live.pop(r, np.zeros(2))
    deferred = {k: np.zeros(2) for k in segments}
    inputs_held: set[Node] = set()
    for n in calls:
        weight = n.args[1] if op_name(n.target) == "linear" and len(n.args) > 1 else None
        if weight in params and n.args[0] in root:
            deferred[segment_of[n]] += size(n)
            if root[n.args[0]] not in inputs_held:
                inputs_held.add(root[n.args[0]])
                deferred[segment_of[n]] += storage(root[n.args[0]])
    inputs = {k: np.zeros(2) for k in segments}
    read_from: dict[LayerKey, set[Node]] = {k: set() for k in segments}
    for n in calls:
        for a in n.all_input_nodes:
            if a in root and segment_of[a] != segment_of[n] and root[a] not in read_from[segment_of[n]]:
                read_from[segment_of[n]].add(root[a])
                inputs[segment_of[n]] += storage(root[a])
    out = {}
    for k in segments:
        arr = {key: np.array(v) if v else np.zeros((1, 2)) for key, v in rows[k].items()}
        out[k] = SegmentMemory(saved[k], arr["forward"], arr["backward"], arr["own"], arr["transient"], param_grads[k],
                               deferred[k], inputs[k], compiled)
    return out
