"""A buffer the forward updates from its own earlier value (a routing bias, a running statistic):
a split batch cannot run such a forward as pieces (``batch_rows``)."""

from __future__ import annotations

from torch.fx import GraphModule, Node

from autotp.analysis.shapes import schema_arg
from autotp.ir.op_facts import is_alias, op_name, writes_by_base

# in-place ops whose result does not read what they overwrite
_OVERWRITES = frozenset({"copy_", "fill_", "zero_", "masked_fill_", "index_fill_", "index_copy_", "masked_scatter_"})


def carried_buffer_write(gm: GraphModule) -> tuple[Node, str] | None:
    """An in-place write of a buffer whose value from before the forward the forward reads: a read
    of it before its first write (a routing bias, a running statistic), or a write that reads what
    it writes (``bias += ...``). Pieces of a split batch run the forward one after another, each
    reading what the piece before it wrote, where the whole batch reads the value it started with.
    A buffer overwritten before it is read (a KV cache filled by slice assignment) carries nothing.
    The write and the buffer's name."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for base, writes in writes_by_base(gm.graph.nodes).items():
        if base.op != "get_attr" or str(base.target) in params:
            continue
        rewrite = next((w for w in writes if not _overwrites(w)), None)
        first = min(writes, key=order.__getitem__)
        if rewrite is not None or any(order[r] < order[first] for r in _reads(base)):
            return rewrite or first, str(base.target)
    return None


def _overwrites(write: Node) -> bool:
    name = op_name(write.target)
    return name in _OVERWRITES or (name == "index_put_" and not schema_arg(write, "accumulate", False))


def _reads(base: Node) -> list[Node]:
    """The nodes that read ``base``'s elements: users of it or of its views (and in-place results)
    that are neither views of it nor writes to it."""
    reads, stack = [], [base]
    while stack:
        node = stack.pop()
        for user in node.users:
            if is_alias(user) and user.args[0] is node:
                stack.append(user)
            else:
                reads.append(user)
    return reads
