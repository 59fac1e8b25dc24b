"""Contractions: ``einsum``, ``tensordot`` and ``bilinear`` by one rule over index letters.

Every letter is one dim, sharded alike in every operand that has it; a sharded letter
missing from the output makes the result partial. An undecided parameter follows a letter
that an activation shards (kind ``row`` if contracted, ``column`` if kept); where no operand
is split, a letter a parameter alone has and the output keeps makes it column-parallel
(``_own_letter``). ``tensordot`` and ``bilinear`` are written as the einsum they compute.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Any

from torch.fx import Node

from autotp.analysis.padded_dims import record_mask
from autotp.analysis.propagation_result import ParamView
from autotp.analysis.shapes import reads_input, schema_arg, shape_of
from autotp.analysis.sharding_policy import output_bias
from autotp.ir.errors import describe
from autotp.ir.layouts import PARTIAL, REPLICATE, DimVar, Layout, ShardingConflict, local_size, make_whole, shard, unify

if TYPE_CHECKING:
    from autotp.analysis.propagation import Walker


def _own_letter(w: Walker, node: Node, view: ParamView, term: str, terms: list[str], out: str, shape: tuple[int, ...]) -> tuple[int | None, bool]:
    """The dim of a parameter's ``term`` that a column split takes: a letter no other operand
    has, the output keeps and the parameter has (not a dim its view made by indexing or
    broadcasting: the tokens and chosen experts of gpt-fast's ``w1[expert_indices]``). Of
    several (the heads and head dim of ``ibh,hnd->ibnd``) the outermost that tp divides, as a
    reshape into factors picks, and whether that was a choice: a walk may then avoid it
    (``Walker.avoid``) after it met a conflict."""
    avoid = w.avoid.get(node.name, frozenset())
    own = [i for i, c in enumerate(term) if c in out and sum(c in other for other in terms) == 1 and view.dim_map[i] is not None]
    left = [i for i in own if i not in avoid]
    return next((i for i in left if shape[i] % w.tp == 0), left[0] if left else None), len(own) > 1


def einsum(w: Walker, node: Node) -> Any:
    """``aten.einsum(equation, operands)``: every letter is one dim, sharded alike in every
    operand that has it; a sharded letter missing from the output makes the result
    partial. An undecided parameter follows a letter that an activation shards (kind
    ``row`` if contracted, ``column`` if kept); where no operand is split, a letter a
    parameter alone has and the output keeps (the experts' hidden dim of ``ecd,edh->ech``,
    XLNet's heads of ``ibh,hnd->ibnd``: ``_own_letter``) makes it column-parallel;
    otherwise it is replicated. A replicated operand made from weights alone whose letter
    another operand splits is read through the rank's slice (Mamba's ``A = -exp(A_log)``
    meeting the channel-split ``dt``), as ``values.pointwise`` does for a broadcast operand."""
    parsed = einsum_terms(node)
    if parsed is None:
        return w.opaque(node)
    terms, out = parsed
    return _contraction(w, node, terms, out, list(node.args[1]))


def einsum_terms(node: Node) -> tuple[list[str], str] | None:
    """An ``aten.einsum`` node's operand terms and output, one letter per dim: each ``...``
    written as letters of its own, an implicit output made explicit; None where the equation
    does not fit the operands."""
    equation, operands = node.args[0].replace(" ", ""), list(node.args[1])
    lhs, out = equation.split("->") if "->" in equation else (equation, None)
    terms = lhs.split(",")
    if len(operands) != len(terms):
        return None
    lead = ""
    if "..." in equation:
        expanded = _without_ellipsis(terms, out, operands)
        if expanded is None:
            return None
        terms, out, lead = expanded
    if out is None:
        letters = "".join(terms)
        out = lead + "".join(sorted(c for c in set(letters) - set(lead) if letters.count(c) == 1))
    return terms, out


def _without_ellipsis(terms: list[str], out: str | None, operands: list[Any]) -> tuple[list[str], str | None, str] | None:
    """The terms and output with each ``...`` written as letters of its own, the dims it
    stands for aligned from the right as they broadcast (``...id,...jd->...ij`` over
    ``[B, H, S, D]``: ``abid,abjd->abij``), and those letters; None for an operand of unknown rank."""
    used = set("".join(terms) + (out or ""))
    fresh = [c for c in string.ascii_letters if c not in used]
    ranks = [len(shape_of(t)) if isinstance(t, Node) and shape_of(t) is not None else None for t in operands]
    if any(r is None for term, r in zip(terms, ranks) if "..." in term):
        return None
    hidden = [r - (len(term) - 3) if "..." in term else 0 for term, r in zip(terms, ranks)]
    lead = "".join(fresh[: max(hidden)])
    terms = [term.replace("...", lead[len(lead) - k :] if k else "") for term, k in zip(terms, hidden)]
    return terms, None if out is None else out.replace("...", lead), lead


def bilinear(w: Walker, node: Node) -> Any:
    """``aten.bilinear(x1, x2, weight, bias)``: the contraction ``...i,oij,...j->...o`` (einsum's
    rule: ``nn.Bilinear``'s weight goes column-parallel over ``o`` where no input is split), and
    a bias over ``o`` that follows its split. A split input makes the form a partial sum, which
    a bias would join on every rank: that is a conflict."""
    x1, x2, weight = node.args[:3]
    bias = schema_arg(node, "bias")
    lead = "abcdefgh"[: len(shape_of(x1) or ()) - 1]
    out = _contraction(w, node, [f"{lead}i", "oij", f"{lead}j"], f"{lead}o", [x1, weight, x2])
    if not isinstance(bias, Node):
        return out
    if out == PARTIAL:
        raise ShardingConflict(f"{describe(node)}: a bilinear form of a split input adds a bias", w.get(weight).origins())
    output_bias(w, node, bias, out.var_at(len(lead)))
    return out


def tensordot(w: Walker, node: Node) -> Any:
    """``aten.tensordot(a, b, dims_a, dims_b)``: the einsum contracting ``dims_a`` of ``a`` with
    ``dims_b`` of ``b``, the output ``a``'s other dims then ``b``'s (JAX's ``DenseGeneral``
    against a ``[C, H, D]`` weight)."""
    a, b, dims_a, dims_b = node.args[:4]
    rank_a, rank_b = len(shape_of(a) or ()), len(shape_of(b) or ())
    if not rank_a or not rank_b or len(dims_a) != len(dims_b):
        return w.opaque(node)
    dims_a, dims_b = [d % rank_a for d in dims_a], [d % rank_b for d in dims_b]
    letters = iter(string.ascii_letters)
    term_a = [next(letters) for _ in range(rank_a)]
    term_b = [next(letters) for _ in range(rank_b)]
    for da, db in zip(dims_a, dims_b):
        term_b[db] = term_a[da]
    out = [c for i, c in enumerate(term_a) if i not in dims_a] + [c for i, c in enumerate(term_b) if i not in dims_b]
    return _contraction(w, node, ["".join(term_a), "".join(term_b)], "".join(out), [a, b])


def is_vector_matmul(node: Node) -> bool:
    """``aten.matmul`` of a 1-D operand (a matrix-vector product): ``vector_matmul``'s."""
    return any(isinstance(t, Node) and len(shape_of(t) or ()) == 1 for t in node.args[:2])


def vector_matmul(w: Walker, node: Node) -> Any:
    """``aten.matmul`` with a 1-D operand: the einsum it computes, ``...k,k->...`` for a vector on
    the right (hyper-connections' ``normed @ dynamic_beta_fn``), ``k,...kn->...n`` on the left."""
    a, b = node.args[:2]
    rank_a, rank_b = len(shape_of(a) or ()), len(shape_of(b) or ())
    if not rank_a or not rank_b:
        return w.opaque(node)
    lead = "abcdefghij"[: max(rank_a, rank_b) - 1]
    if rank_b == 1:
        return _contraction(w, node, [lead[: rank_a - 1] + "k", "k"], lead[: rank_a - 1], [a, b])
    batch = lead[: rank_b - 2]
    return _contraction(w, node, ["k", batch + "kn"], batch + "n", [a, b])


def _contraction(w: Walker, node: Node, terms: list[str], out: str, operands: list[Any]) -> Any:
    """The layout of an einsum of ``operands`` over index ``terms`` into ``out`` (``einsum``)."""
    lays = [w.get(t) for t in operands]
    if any(l == PARTIAL for l in lays):
        w.reduce_first(node, operands)
        lays = [REPLICATE if l == PARTIAL else l for l in lays]
    letters: dict[str, DimVar] = {}
    for term, lay in zip(terms, lays):
        if isinstance(lay, Layout):
            for d, var in lay.dims:
                letters[term[d]] = unify(letters[term[d]], var, describe(node)) if term[d] in letters else var
    _hold_broadcast_operands_whole(w, terms, out, operands, lays, letters)
    if not letters:  # no operand split: a parameter's own output letter goes column-parallel, as in ``matmul``
        for t, term, lay in zip(operands, terms, lays):
            if isinstance(lay, ParamView) and w.allowed(lay.name, "column"):
                own, choice = _own_letter(w, node, lay, term, terms, out, shape_of(t) or ())
                if own is not None:
                    letters[term[own]] = DimVar((shape_of(t) or ())[own], frozenset({lay.name}))
                    letters[term[own]].made_by = (node.name, own) if choice else None
                    break
    for t, term, lay in zip(operands, terms, lays):
        if not isinstance(lay, ParamView):
            continue
        sharded = [i for i, c in enumerate(term) if c in letters]
        if len(sharded) == 1 and letters[term[sharded[0]]].find().size == shape_of(t)[sharded[0]]:
            kind = "column" if term[sharded[0]] in out else "row"
            w.param_view_shard(lay, sharded[0], letters[term[sharded[0]]], kind, node)
        else:
            w.concrete(t, node)
    for t, term in zip(operands, terms):
        lay = w.get(t)
        assert isinstance(lay, Layout)
        shape = shape_of(t) or ()
        for i, c in enumerate(term):
            if c in letters and lay.var_at(i) is None and shape[i] != 1:
                # a weight-made operand's slice costs nothing; an activation is better split where it is made
                if not lay.replicated or letters[c].find().padded or reads_input(t, w.input_readers):
                    raise ShardingConflict(f"{describe(node)}: letter {c} is sharded in one operand only", letters[c].find().origins)
                w.out.local_slices.setdefault(node, []).append((t, i, letters[c]))  # read through the rank's slice
    contracted = [c for c in letters if c not in out]
    if contracted and len(contracted) != len(letters):
        raise ShardingConflict(f"{describe(node)}: contraction and output both sharded", letters[contracted[0]].find().origins)
    sliced = {t for t, _, _ in w.out.local_slices.get(node, ())}
    for c in contracted:  # padding summed in: zeroed in one operand split there, an activation where there is one
        holders = [(t, term.index(c)) for t, term in zip(operands, terms) if c in term and t not in sliced]
        record_mask(w.out, node, *min(holders, key=lambda h: h[0].op == "get_attr"), letters[c])
    if contracted:
        return PARTIAL
    return shard({out.index(c): var for c, var in letters.items()})


def _hold_broadcast_operands_whole(w: Walker, terms: list[str], out: str, operands: list[Any], lays: list[Any], letters: dict[str, DimVar]) -> None:
    """An activation that lacks a letter another operand is split on and the output keeps is the
    same for each value of that letter (the one key head of multi-query attention, shared by every
    query head: ``einsum("bhid,bjd->bhij", q, k)``). Where it is split on letters of its own only,
    all contracted, it is held whole (its segment of a fused projection one block every rank holds), as
    ``attention_rules`` holds a shared KV head for SDPA, and those letters leave the contraction.
    Where its own letters reach the output too, the output would be split on two dims over one axis
    (the one value head: ``einsum("bhij,bjd->bhid", attn, v)``, split on ``h`` and ``d``): of the
    operands that meet this way, the one activation whose splits no reshape chose is held whole."""
    split_in = {c: [i for i, (term, lay) in enumerate(zip(terms, lays)) if isinstance(lay, Layout) and c in term
                    and lay.var_at(term.index(c)) is not None] for c in letters}  # fmt: skip
    held: list[tuple[set[str], list[DimVar]]] = []
    reaching: list[tuple[set[str], list[DimVar], bool]] = []  # (own letters, their vars, whether it may be held)
    for i, (term, lay) in enumerate(zip(terms, lays)):
        if not isinstance(lay, Layout) or isinstance(lay, ParamView) or lay.partial or not lay.dims:
            continue
        own = {term[d] for d, _ in lay.dims}
        vars_ = [v.find() for _, v in lay.dims]
        broadcast = [c for c in letters if c in out and c not in term and split_in[c]]
        if not broadcast or not all(split_in.get(c) == [i] for c in own):
            continue
        fixed = any(v.padded or v.made_by is not None or (w.plan is not None and local_size(v, w.tp) != v.size) for v in vars_)
        if not own & set(out):
            if not fixed:
                held.append((own, vars_))
        elif any(letters[c].find().axis == v.axis for c in broadcast for v in vars_):
            reaching.append((own, vars_, not fixed and reads_input(operands[i], w.input_readers)))
    holdable = [(own, vars_) for own, vars_, may in reaching if may]
    if len(reaching) > 1 and len(holdable) == 1:
        held += holdable
    for own, vars_ in held:
        for v in vars_:
            make_whole(v)
        for c in own:
            del letters[c]
