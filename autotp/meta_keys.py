"""Keys that autotp writes into ``node.meta``.

Every key starts with ``autotp_`` so that torch's own keys (``val``, ``stack_trace``,
``nn_module_stack``...) are never overwritten.
"""

LAYOUT = "autotp_layout"
"""The node's output layout (a ``Layout``, or a tuple of them for multi-output ops)."""

REDUCE_INPUTS = "autotp_reduce_inputs"
"""Partial input nodes that must be all-reduced before this node uses them."""

ROLE = "autotp_role"
"""What the sharding rewrite must do with the node (a ``NodeRole`` value)."""

COLLECTIVE = "autotp_collective"
"""Set on inserted collective nodes: ``all_reduce``, ``all_reduce_backward`` or ``all_gather``."""

NEEDS_GRAD = "autotp_needs_grad"
"""Whether the node's value depends on a trainable tensor."""

EXPAND_FIXUPS = "autotp_expand_fixups"
"""On an ``expand`` whose broadcast dim is later merged into a sharded dim (``repeat_kv``):
``[(dim, merged DimVar, outer DimVar)]``; that dim's local size is local(merged)/local(outer)."""

CHUNK = "autotp_chunk"
"""Pipeline chunk that computes the node; None for cheap input-derived values (masks,
positions, rotary tables) and parameter reads, which every chunk that needs them repeats."""

LAYER = "autotp_layer"
"""Index of the decoder layer the node belongs to (from its module path), or None."""
