"""Branches on values computed from the model's buffers alone (``if self.freqs_cos[0, 0] == 0:``,
``if self.initted:``), taken the way the user's model's buffers say.

The trace runs on a fake copy, whose buffers carry no values, so such a test is a branch on a value
known only at run time. It tests the model's state, not the data: the partial graph export has
recorded so far gives the ops that computed the tested tensor, and where all of them are pure and
read only buffers (and constants), they are evaluated on copies of the user's model's buffers.
``trace_control_flow`` takes that side and asserts at run time that the test still comes out so.
A host read of such a value (``lens.max().item()`` of a ``torch.full`` of the sequence length,
``int(t)``, ``t.tolist()``) gives the value the same way (``constant_host_reads``), where export
would make it a size known only at run time."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
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
        with _untraced():
            values: dict[Node, torch.Tensor] = {node: real.detach().clone() for node, real in buffers.items()}
            for node in [n for n in target.graph.nodes if n in needed]:  # in the order they were recorded
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                values[node] = node.target(*args, **kwargs)
    except (RuntimeError, TypeError):
        return None
    return values[target], frozenset(names[node] for node in buffers)


@contextmanager
def _untraced() -> Iterator[None]:
    """Real tensors computed while the trace is running, seen by neither fake mode nor the proxy."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.fx.experimental.proxy_tensor.disable_proxy_modes_tracing():
        yield


def _pure(op: object) -> bool:
    """An op that writes nothing and draws nothing: its value is its inputs'."""
    schema = getattr(op, "_schema", None)
    return schema is not None and not schema.is_mutable and torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ())


HOST_READS = ("item", "tolist", "__int__", "__float__", "__index__")


@contextmanager
def constant_host_reads(model: torch.nn.Module, real_buffer: Callable[[str], torch.Tensor | None], buffers_read: set[str],
                        line_of: Callable[[FrameType], str]) -> Iterator[None]:  # fmt: skip
    """While tracing ``model``: a host read (``HOST_READS``) of a value computed from buffers and
    constants alone returns that value, its buffers' names added to ``buffers_read``, and the
    graph asserts at run time that the tensor still holds it."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    own = {name: torch.Tensor.__dict__[name] for name in HOST_READS if name in torch.Tensor.__dict__}

    def constant_read(name: str) -> Callable[[torch.Tensor], Any]:
        def read(self: torch.Tensor) -> Any:
            found = value_from_buffers(self, model, real_buffer) if is_fake(self) else None
            if found is None:
                return originals[name](self)
            value, names = found
            buffers_read.update(names)
            with _untraced():
                held, result = value.tolist(), getattr(value, name)()
            source = f"buffers {', '.join(sorted(names))}" if names else "constants"
            torch._assert_async((self == torch.tensor(held, dtype=self.dtype, device=self.device)).all(),
                                f"the value read at {line_of(sys._getframe(1))} was traced as {source} = {held}, which they "
                                f"no longer give; parallelize the model again")  # fmt: skip
            return result

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, constant_read(name))
    try:
        yield
    finally:
        for name in HOST_READS:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)  # back to TensorBase's
