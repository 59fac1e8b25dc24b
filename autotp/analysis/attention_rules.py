"""Layout rules of attention: ``scaled_dot_product_attention`` and FlexAttention's higher-order op.

Heads attend on their own, so q, k and v split on their heads dim (1; for SDPA, any dim before its
last two, a batch dim of it) give an output split there.
One KV head held whole broadcasts over the rank's query heads (multi-query attention); k or v held
whole for every query head is read through the rank's heads (``Propagation.local_slices``), as is
a per-head mask or block mask held whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from autotp.analysis.shapes import shape_of
from autotp.ir.errors import describe
from autotp.ir.layouts import REPLICATE, DimVar, Layout, ShardingConflict, local_size, make_whole, shard, unify

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker

FLEX_ATTENTION = torch.ops.higher_order.flex_attention


def sdpa(w: Walker, node: Node) -> Layout:
    """Every dim before the last two is a batch dim of SDPA: the heads are dim 1, or the one
    other of those dims q, k and v are split on (``[batch, experts, heads, tokens, head_dim]``)."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    rank = len(shape_of(node) or ())
    hd = _split_batch_dim(w, node, rank)
    heads = _heads(w, node, *node.args[:3], hd=hd)
    if isinstance(mask, Node):
        _per_head_operand(w, node, mask, len(shape_of(mask) or ()) - (rank - hd), heads)
    return REPLICATE if heads is None else shard({hd: heads})


def _split_batch_dim(w: Walker, node: Node, rank: int) -> int:
    """The dim before SDPA's last two that q, k or v is split on, past the batch: 1 where none is."""
    for t in node.args[:3]:
        lay = w.get(t) if isinstance(t, Node) else None
        if isinstance(lay, Layout) and not lay.partial:
            split = [d for d, _ in lay.dims if 1 <= d < rank - 2]
            if split:
                return split[0]
    return 1


def flex_attention(w: Walker, node: Node) -> tuple[Layout, ...]:
    """``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_mod_buffers,
    mask_mod_buffers)``: q, k and v split on their heads as for SDPA; the block mask's
    ``[batch, heads, ...]`` tensors follow the heads where they have one per head; the tensors the
    score and mask functions read stay whole, and ``passes/flex_attention_rank`` gives those
    functions the global index of the rank's heads. The outputs (values, log-sum-exp, maxima) are
    split on their heads."""
    heads = _heads(w, node, *node.args[:3])
    for t in node.args[4]:
        if isinstance(t, Node) and isinstance(t.meta.get("val"), torch.Tensor):
            _per_head_operand(w, node, t, 1, heads)
    for t in (t for captured in node.args[7:9] for t in captured):
        lay = w.concrete(t, node)
        w.reduce_first(node, [t])
        if lay.dims and not lay.partial:
            raise ShardingConflict(f"{describe(node)}: a tensor its score or mask function reads is split", lay.origins(), tuple(v for _, v in lay.dims))
    return tuple(REPLICATE if heads is None or not isinstance(o, torch.Tensor) or o.dim() < 2 else shard({1: heads}) for o in node.meta["val"])


def _heads(w: Walker, node: Node, q: Node, k: Node, v: Node, hd: int = 1) -> DimVar | None:
    """The split of the heads dim (``hd``) that q, k and v share, None when all three are whole."""
    lays = [w.concrete(t, node) for t in (q, k, v)]
    w.reduce_first(node, [q, k, v])
    lays = [REPLICATE if l.partial else l for l in lays]
    if all(l.replicated for l in lays):
        return None
    heads = [l.var_at(hd) for l in lays]
    # one KV head every rank holds whole (multi-query attention) broadcasts over the rank's query heads
    one_head = [(shape_of(t) or (0,) * (hd + 1))[hd] == 1 and all(d == hd for d, _ in l.dims) for t, l in zip((q, k, v), lays)]
    for i, t in ((1, k), (2, v)):
        if _whole_heads_of(w, q, t, lays[0], lays[i], hd):  # k/v of all the query heads held whole: the rank's heads of it
            for _, var in lays[i].dims:
                make_whole(var)
            w.out.local_slices.setdefault(node, []).append((t, hd, heads[0]))
            lays[i], heads[i] = shard({hd: heads[0]}), heads[0]
    if any(len(l.dims) != 1 or l.var_at(hd) is None for l, whole in zip(lays, [False, *one_head[1:]]) if not whole):
        blame = lays[0].origins() | lays[1].origins() | lays[2].origins()
        wrong = tuple(v for l in lays for d, v in l.dims if d != hd)  # a reshape may put these on the heads instead
        raise ShardingConflict(f"{describe(node)}: attention needs q, k and v sharded on heads", blame, wrong)
    if not (one_head[1] or one_head[2]):  # a broadcast head is a whole block, not the other's split
        unify(heads[1], heads[2], describe(node))
        if heads[0].find().size == heads[1].find().size:
            unify(heads[0], heads[1], describe(node))
    return heads[0]


def _whole_heads_of(w: Walker, q: Node, t: Node, q_lay: Layout, t_lay: Layout, hd: int) -> bool:
    """Whether ``t`` (k or v) holds every one of q's heads, not split on them, while q is split
    on them (one KV head of a fused projection expanded to all heads): each head attends on
    its own, so ``t`` is held whole (a split of its other dims, e.g. its segment of the fused
    projection, becomes one block every rank holds) and the rank reads the heads it holds."""
    q_heads = q_lay.var_at(hd)
    if q_heads is None or len(q_lay.dims) != 1 or q_heads.find().padded or t_lay.var_at(hd) is not None:
        return False
    for _, v in t_lay.dims:
        if v.find().padded or v.find().made_by is not None:  # a reshape may put that split on the heads instead
            return False
        if w.plan is not None and local_size(v, w.tp) != v.find().size:  # a plan that splits it does not hold t whole
            return False
    qs, ts = shape_of(q) or (), shape_of(t) or ()
    return len(ts) == len(qs) and ts[hd] == qs[hd] > 1


def _per_head_operand(w: Walker, node: Node, mask: Node, hd: int, heads: DimVar | None) -> None:
    """A mask whose dim ``hd`` meets the heads: one per head follows the heads (split with them,
    or each rank reads its slice of a whole one); with whole heads it must be whole."""
    lm = w.concrete(mask, node)
    w.reduce_first(node, [mask])
    if lm.partial:
        lm = REPLICATE
    mshape = shape_of(mask) or ()
    per_head = hd >= 0 and mshape[hd] != 1
    others = [d for d, _ in lm.dims if d != hd]
    if heads is None or others or (lm.var_at(hd) is not None and not per_head):
        if lm.dims:
            blame = lm.origins() | (heads.find().origins if heads is not None else set())
            raise ShardingConflict(f"{describe(node)}: the attention mask is sharded where the heads are not", blame)
        if heads is None or not per_head:
            return
    if lm.var_at(hd) is not None:
        unify(lm.var_at(hd), heads, describe(node))
    elif per_head:
        if heads.find().padded:
            raise ShardingConflict(f"{describe(node)}: a per-head attention mask meets padded heads", heads.find().origins)
        w.out.local_slices.setdefault(node, []).append((mask, hd, heads))
