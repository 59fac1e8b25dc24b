"""A buffer that a rank graph writes in place carries no autograd history into the next call.

A forward that writes a value computed from parameters into a buffer (Meta's reference Llama
fills its KV cache by slice assignment, ``cache_k[:b, pos : pos + s] = xk``, in every forward)
leaves the buffer with a ``grad_fn``. Eager PyTorch then links the next call's graph to the
previous one through that buffer: once the previous backward freed its graph, the next
backward raises, and a pipeline's microbatches (slices of one batch, each its own forward)
would be linked to one another, which the unmodified model's single forward over the whole
batch never is. So each call of a graph that writes buffers first detaches them in place (the
values stay): within the call, the write and every read after it stay differentiable, as in
the unmodified model. Gradients never flow from one call into an earlier one's graph.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.fx import GraphModule

from autotp.ir.op_facts import mutated_base

log = logging.getLogger(__name__)


def written_buffers(gm: GraphModule) -> list[str]:
    """Qualified names of the buffers ``gm`` writes in place (through any views of them)."""
    names = dict.fromkeys(
        base.target
        for node in gm.graph.nodes
        if node.op == "call_function" and (base := mutated_base(node)) is not None and base.op == "get_attr"
    )
    params = {name for name, _ in gm.named_parameters()}
    return [str(n) for n in names if n not in params]


def cut_history_on_call(gm: GraphModule) -> None:
    """Make every call of ``gm`` start by detaching the buffers it writes (nothing if none)."""
    names = written_buffers(gm)
    if not names:
        return
    log.info("the graph writes buffers in place (%s): each call starts them without autograd history", ", ".join(names))

    def cut(module: nn.Module, _args: Any) -> None:
        for name in names:
            owner, _, attr = name.rpartition(".")
            buffer = getattr(module.get_submodule(owner), attr)
            if buffer.grad_fn is not None:
                buffer.detach_()

    gm.register_forward_pre_hook(cut)
