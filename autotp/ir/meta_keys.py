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
"""Set on inserted collective nodes: what it does, an ``autotp.ir.op_facts.CollectiveTag`` (``all_reduce``,
``all_reduce_backward``, ``all_gather``; with sequence parallelism also ``reduce_scatter``,
``sequence_all_gather`` and ``scatter``; with tp overlap the fused GEMM collectives)."""

COLLECTIVE_RANKS = "autotp_collective_ranks"
"""On inserted collective nodes: how many ranks the collective spans."""

NEEDS_GRAD = "autotp_needs_grad"
"""Whether the node's value depends on a trainable tensor."""

SLICE_FIXUP = "autotp_slice_fixup"
"""On a ``slice`` of a sharded dim: ``(sliced DimVar, selected segment DimVar)``; its
bounds become the segment's local offset and size."""

PADDING_SLICE = "autotp_padding_slice"
"""On a ``slice`` that keeps the first elements of an evenly split dim as a padded dim of its
blocks (``shape_rules._drops_padding``): the sliced DimVar; each rank keeps its block, the
elements past the slice's end zeroed."""

PADDING_MASKS = "autotp_padding_masks"
"""On a node that sums over a dim split with padding (``Propagation.padding_masks``): the
(operand, dim, DimVar) whose padding the ranks holding some zero first (``passes/mask_padding``)."""

EXPAND_FIXUPS = "autotp_expand_fixups"
"""On an ``expand`` whose broadcast dim is later merged into a sharded dim (``repeat_kv``):
``[(dim, merged DimVar, outer DimVar)]``; that dim's local size is local(merged)/local(outer)."""

INDEX_AS_SLICE = "autotp_index_as_slice"
"""On an ``index``/``index_select`` of a sharded dim by a constant run of positions: that
dim; the rank graph takes the slice of ``SLICE_FIXUP``'s local bounds instead."""

IDENTITY_INDICES = "autotp_identity_indices"
"""On an ``index``/``index_put`` whose ``arange`` index enumerates a sharded dim in place:
``[(indexed dim, DimVar)]``; the rank graph indexes by the ``arange`` of its local size."""

REPEAT_FIXUP = "autotp_repeat_fixup"
"""On a ``repeat_interleave`` along a sharded dim: ``(output DimVar, input DimVar)``; its
local repeat count is local(output) / local(input)."""

LOCAL_SLICES = "autotp_local_slices"
"""On an elementwise op that meets a replicated operand of full size along a sharded dim:
``[(input node, dim, DimVar)]``; the op reads the rank's slice of that input."""

CHUNK = "autotp_chunk"
"""Pipeline chunk that computes the node; None for cheap input-derived values (masks,
positions, rotary tables) and parameter reads, which every chunk that needs them repeats."""

LAYER = "autotp_layer"
"""Index of the decoder layer the node belongs to (from its module path), or None."""

CUDAGRAPH_BLOCKER = "autotp_cudagraph_blocker"
"""Why a CUDA graph cannot capture the node (a ``passes.find_cudagraph_candidates.Blocker``)."""

CUDAGRAPH_CANDIDATE = "autotp_cudagraph_candidate"
"""Index of the maximal run of capturable nodes (one pipeline chunk, no blocker) holding the node."""

CUDAGRAPH_REGION = "autotp_cudagraph_region"
"""Id of the CUDA-graph region that captures the node: its candidate's index, set only where
the cost model found capturing worth it."""

CAUSAL_MASK = "autotp_causal_mask"
"""On ``scaled_dot_product_attention`` nodes with an explicit mask: ``"causal"`` when the mask was
proven causal-only and replaced by ``is_causal=True``, else why it stays (``passes/causal_attention``)."""

KEPT_ALL_REDUCE = "autotp_kept_all_reduce"
"""On an f (``copy_to_tp``) that sequence parallelism could not fold into the backward reduce-scatter of an
all-gather of the tokens (``passes/sequence_parallel``): why its all-reduce stays; ``autotp explain`` prints it."""

AUTOCAST_INLINED = "autotp_autocast_inlined"
"""On the nodes of an inlined ``torch.autocast`` region (``analysis.trace_regions``): they run as
the region ran only when no autocast is active around the graph, so ``ParallelModel`` refuses
to run such a graph under one."""

CHECKPOINTED = "autotp_checkpointed"
"""On a traced node that the model computed inside ``torch.utils.checkpoint`` (``analysis.trace_regions``)."""

BATCH_DENOMINATORS = "autotp_batch_denominators"
"""On a traced graph module's ``meta``: the ``batch_denominators.DenominatorProgram`` of each
``batch_denominator`` the trace inserted (``analysis.loss_denominators``)."""

REQUIRES_GRAD_SET = "autotp_requires_grad_set"
"""On a traced graph module's ``meta``: the parameters whose ``requires_grad`` the forward set to
another value (a forward that freezes a part of the model, ``p.requires_grad_(False)``), by name:
the value it left (``ParallelPlan.requires_grad_set``)."""

BRANCH_BUFFERS = "autotp_branch_buffers"
"""On a traced graph module's ``meta``: the names of the buffers whose values took a branch of the
forward (``analysis.buffer_branches``; ``ParallelPlan.branch_buffers``)."""

BATCH_DRAW_ROWS = "autotp_batch_draw_rows"
"""On a random draw of a traced piece of a split step: the dims of the draw that hold the batch's
rows (found in a trace of the batch doubled; None: not found). ``passes/batch_draws`` reads it."""

BATCH_DRAWS = "autotp_batch_draws"
"""On a rank graph module's ``meta``: the ``batch_draws.DrawProgram`` of each ``batch_draw``
(``passes/batch_draws``), in the forward's order."""
