"""Branches on values computed from the model's buffers alone (``if self.freqs_cos[0, 0] == 0:``,
``if self.initted:``), taken the way the user's model's buffers say.

The trace runs on a fake copy, whose buffers carry no values, so such a test is a branch on a value
known only at run time. It tests the model's state, not the data: the partial graph export has
recorded so far gives the ops that computed the tested tensor, and where all of them are pure and
read only buffers (and constants), they are evaluated on copies of the user's model's buffers.
``trace_control_flow`` takes that side and asserts at run time that the test still comes out so."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot


def value_from_buffers(tensor: torch.Tensor, model: torch.nn.Module,
                       real_buffer: Callable[[str], torch.Tensor | None]) -> tuple[torch.Tensor, frozenset[str]] | None:  # fmt: skip
    """``tensor``'s value computed from the real buffers (and constants: a causal mask made in the
    forward, compared with another) it was made of, with the buffers' names; None where it reads
    anything else (an input, a parameter), an op that writes or draws random numbers, or a buffer
    whose values are not at hand."""
    mode = get_proxy_mode()
    if mode is None:
        return None

    def node_of(t: torch.Tensor) -> Node | None:
        slot = get_proxy_slot(t, mode.tracer, None)
        return getattr(getattr(slot, "proxy", None), "node", None)

    target = node_of(tensor)
    if target is None:
        return None
    names: dict[Node, str] = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        node = node_of(buffer)
        if node is not None:
            names.setdefault(node, name)
    # the ops behind the tested tensor, found breadth first so that a parameter or an input
    # nearby ends the search before the graph's whole history is read
    needed: set[Node] = set()
    seen, frontier = {target}, [target]
    while frontier:
        node = frontier.pop(0)
        if node in names:
            continue
        if node.op != "call_function" or not _pure(node.target):
            return None
        needed.add(node)
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                frontier.append(arg)
    buffers = {node: real_buffer(name) for node, name in names.items() if node in seen}
    if any(real is None or real.is_meta for real in buffers.values()):
        return None
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.fx.experimental.proxy_tensor.disable_proxy_modes_tracing():
            values: dict[Node, torch.Tensor] = {node: real.detach().clone() for node, real in buffers.items()}
            for node in [n for n in target.graph.nodes if n in needed]:  # in the order they were recorded
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                values[node] = node.target(*args, **kwargs)
    except (RuntimeError, TypeError):
        return None
    return values[target], frozenset(names[node] for node in buffers)


def _pure(op: object) -> bool:
    """An op that writes nothing and draws nothing: its value is its inputs'."""
    schema = getattr(op, "_schema", None)
    return schema is not None and not schema.is_mutable and torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ())
