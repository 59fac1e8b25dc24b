"""What eager autograd keeps for a rank graph's backward (``saved_inputs``) and which nodes need a gradient
(``needs_grad``): the activations ``autotp.cost_model.liveness`` holds from the forward to the backward.

Per op: a matmul its activation operands; a mul or div each operand whose partner needs a
gradient; attention q, k, v and its output; nonlinear elementwise ops, norms, softmax and
the losses their input; adds, casts, views, concatenations, reductions and collectives
nothing (the fused lm_head and loss keeps its outputs instead, ``liveness``); any other op its
inputs. Under ``compile=True`` ``fused_kernels.compiled_saves`` turns these into what AOTAutograd's
partitioner keeps.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from autotp.cost_model.flops import node_cost
from autotp.ir.op_facts import is_matmul, op_name

_SAVE_NOTHING = {
    "add", "sub", "neg", "to", "_to_copy", "clone", "contiguous", "cat", "stack", "mean", "sum", "where",
    "embedding", "vocab_parallel_embedding", "arange", "full", "zeros", "ones", "empty", "scalar_tensor",
    "linear_cross_entropy",
}  # fmt: skip
_SAVE_FIRST_INPUT = {
    "pow", "rsqrt", "sqrt", "exp", "log", "silu", "gelu", "relu", "tanh", "sigmoid", "erf", "sin", "cos",
    "softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm", "native_layer_norm", "rms_norm",
    "group_norm", "dropout", "native_dropout", "cross_entropy_loss", "vocab_parallel_cross_entropy",
    "nll_loss", "nll_loss_forward",
}  # fmt: skip


def needs_grad(gm: GraphModule) -> set[Node]:
    """Nodes computed from a floating-point parameter (their values need gradients)."""
    params = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.is_floating_point()}
    out: set[Node] = set()
    for node in gm.graph.nodes:
        if (node.op == "get_attr" and str(node.target) in params) or (
            node.op == "call_function" and any(a in out for a in node.all_input_nodes)
        ):
            out.add(node)
    return out


def saved_inputs(node: Node, grad: set[Node]) -> list[Node]:
    """The tensors eager autograd keeps for ``node``'s backward (rules in the module docstring)."""
    if node not in grad:
        return []
    name = op_name(node.target)
    inputs = node.all_input_nodes
    if name in _SAVE_NOTHING or node_cost(node).bytes == 0:
        return []
    if is_matmul(node):
        return inputs
    if name in ("mul", "div"):
        return [x for x in inputs if any(y in grad for y in inputs if y is not x)]
    if name == "scaled_dot_product_attention":
        return [*inputs[:3], node]
    if name in _SAVE_FIRST_INPUT:
        return inputs[:1]
    return inputs
