"""Tensor-parallel layout planning: which parameters to shard, and how.

The layout walk (``autotp.analysis.propagation``) proposes Megatron's column/row pairs,
vocab-parallel embeddings and the vocab-parallel loss straight from the graph. This
module decides what to keep, walking again until the proposal is sound:

* A matmul weight computed from parameters alone (weight norm) that the walk read whole
  is walked again with those parameters split as the matmul asks (``Propagation.hints``).
* A reshape whose chosen output factor meets an op that cannot keep it sharded (timm's
  ``reshape(B, N, 3, H, D)`` then ``unbind`` of the 3) is walked again with that factor
  avoided (``ShardingConflict.retries``).
* Any other proposal that leads to an op that needs the sharded dim whole (a softmax over
  the MoE router's experts, an unbind of the heads...) is dropped: those parameters stay
  whole (``KEPT_WHOLE_CONFLICT``, naming the node and op); or the split value is gathered
  whole on its way to that op or where those parameters compute it (a ``Gathered`` entry
  naming the value, the node, the op and the cost), whichever ``layout_choice.footprint``
  finds better (``_Search._settle``); a value gathered in one layer is gathered at the same
  place of every layer, so the choice is weighed for all of them at once.
* A sharded dim that tp does not split (an FFN of 170 channels at tp=4) is split with
  padding, blocks of ``ceil(size / tp)`` (``autotp.analysis.padded_dims``), where nothing
  cuts it into parts; otherwise (heads that tp does not divide) it keeps the parameters
  that made it whole (``KEPT_WHOLE_INDIVISIBLE``). If that leaves a rank more than
  ``MAX_SHARE_FACTOR``/tp of the parameters, the model cannot be sharded at this tp: a
  ``UserInputError`` names the module, the op and the degrees that split it.
* A norm over a sharded dim is computed from a tp-reduced statistic, or its producer is
  kept whole, whichever ``layout_choice.footprint`` finds better; norms at the same place
  of every layer decide together.
* An embedding table is vocab-parallel only if each rank keeps at least
  ``MIN_EMBEDDING_ROWS_PER_RANK`` rows; smaller tables (token types) stay replicated,
  since their partial sum costs as much to reduce as the table saves.
* The plan is walked once more as the passes will (``propagate(plan=...)``); a parameter
  that walk cannot place is kept whole too, so the passes never refuse a plan made here.

Every parameter left whole gets a ``KeptWhole`` entry with the node and op that decided
it and its bytes (``KEPT_WHOLE_READ_WHOLE`` when its first use reads it whole).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch.fx import GraphModule, Node

from autotp.ir.op_facts import op_name
from autotp.analysis.propagation import propagate
from autotp.analysis.propagation_result import NodeRole, ParamView, Propagation, indivisible, param_sharding
from autotp.cost_model.fused_loss import loss_chunk_tokens
from autotp.cost_model.layout_choice import PARAM_STATE_COPIES, TIE, footprint, gather_s, gathered_bytes
from autotp.ir.errors import UserInputError, describe
from autotp.ir.layouts import Layout, ShardingConflict
from autotp.ir.plan import (
    KEPT_WHOLE_CONFLICT,
    KEPT_WHOLE_INDIVISIBLE,
    KEPT_WHOLE_READ_WHOLE,
    Gathered,
    KeptWhole,
    ParallelPlan,
    ParamLayout,
)

MIN_EMBEDDING_ROWS_PER_RANK = 16
MAX_PLANNING_ROUNDS = 64
MAX_GATHER_CHAIN = 8
MAX_SHARE_FACTOR = 1.3
"""A rank holding more than this over tp of the parameters because tp cannot split them
means the model cannot be sharded at that tp (the strict rule the tests apply)."""


class _Search:
    """Walks of one graph at one tp, and what they decided to keep whole and why."""

    def __init__(self, gm: GraphModule, tp: int, replicate: set[str]) -> None:
        self.gm, self.tp, self.replicate = gm, tp, replicate
        self.params = dict(gm.named_parameters(remove_duplicate=False))
        # every place that took a tp-reduced statistic in some walk (``choose_statistics``)
        self.statistic_places: dict[tuple[str, str], frozenset[str]] = {}
        # converge's results by its arguments: the walks that weigh a conflict repeat them
        self.walked: dict[tuple[frozenset[str], frozenset[str], frozenset[str], bool], tuple[Propagation, dict[str, KeptWhole]]] = {}
        # gathered value -> (node, op, why) of the conflict that chose it (``_settle``)
        self.gather_reasons: dict[str, tuple[str, str, str]] = {}
        # parameters whose split tp does not divide, split with padding (``autotp.analysis.padded_dims``)
        self.padded: set[str] = set()
        # node name -> the nodes at the same place of every layer (``repeated``)
        self.repeats: dict[str, list[str]] | None = None

    def converge(
        self, no_statistic: frozenset[str], banned: dict[str, KeptWhole] | None = None, gathers: frozenset[str] = frozenset(), weigh: bool = True
    ) -> tuple[Propagation, dict[str, KeptWhole]]:
        """Walk until no conflict and no indivisible dim is left; ``banned``: parameters kept
        whole so far, with their entries; ``gathers``: values gathered whole so far. With
        ``weigh``, each conflict weighs gathering its split inputs against keeping its
        parameters whole (``_settle``); without, it keeps them whole."""
        key = (no_statistic, frozenset(banned or {}), gathers, weigh)
        if key not in self.walked:
            self.walked[key] = self._converge(no_statistic, dict(banned or {}), gathers, weigh)
        prop, done = self.walked[key]
        return prop, dict(done)

    def _converge(
        self, no_statistic: frozenset[str], banned: dict[str, KeptWhole], gathers: frozenset[str], weigh: bool
    ) -> tuple[Propagation, dict[str, KeptWhole]]:
        avoid: dict[str, frozenset[int]] = {}
        tp = self.tp

        def policy(name: str, kind: str, shape: tuple[int, ...]) -> bool:
            if tp == 1 or name in banned or name in self.replicate:
                return False
            return shape[0] >= MIN_EMBEDDING_ROWS_PER_RANK * tp if kind == "vocab" else True

        tried: set[tuple[str, int]] = set()
        hints: dict[str, tuple[str, int]] = {}
        undo: tuple[dict[str, frozenset[int]], Propagation] | None = None
        for _ in range(MAX_PLANNING_ROUNDS):
            prop = propagate(self.gm, tp, policy=policy, avoid=avoid, statistics=lambda n: n.name not in no_statistic, hints=hints, gathers=gathers,
                             padded=frozenset(self.padded))
            new_hints = {name: h for name, h in prop.hints.items() if name not in hints and policy(name, "column", ())}
            if new_hints:  # weight reparametrizations: their parameters (in every layer) split from the start
                places = {_generic(name): h for name, h in new_hints.items()}
                for name, p in self.params.items():
                    h = places.get(_generic(name))
                    if h is not None and name not in hints and policy(name, "column", ()) and p.dim() > h[1]:
                        hints[name] = h
                continue
            for place, names in _statistic_places(prop).items():
                self.statistic_places[place] = self.statistic_places.get(place, frozenset()) | names
            retries = {r for c in _first_kind(prop.conflicts) for r in self.repeated(c.retries)} - tried if prop.conflicts else set()
            worse = undo is not None and len(prop.conflicts) >= len(undo[1].conflicts)
            if worse and not retries:
                # the other factors did no better: take the choices back, settle the first conflict
                avoid, before = undo
                undo = None
                gathers = self._settle(before, banned, gathers, no_statistic, weigh)
                continue
            if not worse:
                undo = None
            if prop.conflicts:
                if retries:  # after a retry that did no better, the choices behind its first conflict join it
                    undo = undo or (dict(avoid), prop)
                    for node_name, factor in retries:
                        avoid[node_name] = avoid.get(node_name, frozenset()) | {factor}
                    tried |= retries
                    continue
                gathers = self._settle(prop, banned, gathers, no_statistic, weigh)
                continue
            bad = indivisible(prop)
            if not bad:
                return prop, banned
            pads = {name for b in bad for name in b.paddable} - self.padded - self.replicate
            if pads:  # split with padding from their first use (``padded_dims``); what cannot take it conflicts
                self.padded |= pads
                continue
            for b in bad:
                self._ban(banned, b.origins, KEPT_WHOLE_INDIVISIBLE, f"dim {b.dim} of {describe(b.node)}: {b.why}", b.node)
        raise AssertionError(f"layout planning did not converge in {MAX_PLANNING_ROUNDS} walks")

    def _settle(
        self, prop: Propagation, banned: dict[str, KeptWhole], gathers: frozenset[str], no_statistic: frozenset[str], weigh: bool
    ) -> frozenset[str]:
        """Settle the first conflict of ``prop`` (and its repeats in the other layers): keep
        the parameters behind it whole (into ``banned``), or gather a split value on its way
        whole (the gathers returned), whichever ``footprint`` finds better once the rest is
        settled by keeping whole."""
        conflicts = _first_kind(prop.conflicts)
        # a value gathered in one layer is gathered at the same place of every layer: the
        # repeats of the conflict that later walks meet are settled alike, and weighed together
        found = _gather_options(prop, conflicts) if weigh else []
        options = [{other: c for name, c in o.items() for other in self.same_place(name)} for o in found]
        options = [o for o in options if not set(o) <= gathers]
        if options and self.kept_bytes(conflicts) < TIE * footprint(prop, self.gm).held_bytes:
            options = []  # keeping them whole ties in bytes, and costs no collective
        if options:
            kept = dict(banned)
            for c in conflicts:
                self._ban(kept, c.origins, KEPT_WHOLE_CONFLICT, str(c), c.node)
            best, chosen = footprint(self.converge(no_statistic, kept, gathers, weigh=False)[0], self.gm), None
            for option in options:
                fp = footprint(self.converge(no_statistic, banned, gathers | set(option), weigh=False)[0], self.gm)
                if fp.better(best):
                    best, chosen = fp, option
            if chosen is not None:
                for name, c in chosen.items():
                    self.gather_reasons[name] = (c.node.name, op_name(c.node.target), str(c))
                return gathers | set(chosen)
        for c in conflicts:
            self._ban(banned, c.origins, KEPT_WHOLE_CONFLICT, str(c), c.node)
        return gathers

    def repeated(self, retries: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
        """The same reshape choices at the same places of the other layers: the first
        conflict's repeats are settled together (``_first_kind``), and so are its retries."""
        return {(other, factor) for name, factor in retries for other in self.same_place(name)}

    def same_place(self, name: str) -> list[str]:
        """Node ``name`` and the nodes at its place in the other layers."""
        if self.repeats is None:
            by_place: dict[tuple[str, str], list[str]] = {}
            for node in self.gm.graph.nodes:
                if node.op == "call_function":
                    by_place.setdefault((_module_path(node), op_name(node.target)), []).append(node.name)
            groups: dict[tuple[str, str, int], list[str]] = {}
            for (path, op), names in by_place.items():
                for i, other in enumerate(names):
                    groups.setdefault((_generic(path), op, i), []).append(other)
            self.repeats = {name: group for group in groups.values() for name in group}
        return self.repeats.get(name, [name])

    def kept_bytes(self, conflicts: list[ShardingConflict]) -> float:
        """What a rank would hold more of by keeping the parameters behind ``conflicts`` whole."""
        names = {n for c in conflicts for n in c.origins} - self.replicate
        unique = {id(self.params[n]): self.params[n] for n in names}
        return PARAM_STATE_COPIES * (1 - 1 / self.tp) * sum(p.numel() * p.dtype.itemsize for p in unique.values())

    def _ban(self, banned: dict[str, KeptWhole], origins: Iterable[str], reason: str, detail: str, node: Node | None) -> None:
        for name in sorted(set(origins) - self.replicate):
            if name not in banned:
                banned[name] = self.entry(name, reason, detail, node)
        assert set(origins) - self.replicate, f"a conflict without a parameter to blame: {detail}"

    def entry(self, name: str, reason: str, detail: str, node: Node | None) -> KeptWhole:
        p = self.params[name]
        return KeptWhole(name, reason, detail, node.name if node is not None else "", op_name(node.target) if node is not None else "",
                         p.numel() * p.dtype.itemsize)  # fmt: skip

    def choose_statistics(self, prop: Propagation, banned: dict[str, KeptWhole]) -> tuple[Propagation, dict[str, KeptWhole]]:
        """Per place of the model (module path without layer numbers, and op), a tp-reduced
        statistic or the producer kept whole, whichever ``footprint`` prefers: the better of
        all statistics and none, then each place flipped in turn."""
        if not self.statistic_places:
            return prop, banned
        # each place flipped in every layer (also where no walk so far took a statistic), then
        # in the layers the walks found, where they differ (layers of other kinds than the first)
        every_layer: dict[tuple[str, str], set[str]] = {}
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and _place(node) in self.statistic_places:
                every_layer.setdefault(_place(node), set()).add(node.name)
        places = [frozenset(every_layer[place]) for place in self.statistic_places]
        places += [found for place, found in self.statistic_places.items() if found != every_layer[place]]
        every = frozenset().union(*places)
        best = (prop, banned, footprint(prop, self.gm), frozenset())
        for no_statistic in [every] + [None] * len(places):
            if no_statistic is None:
                names = places.pop(0)
                no_statistic = best[3] - names if names <= best[3] else best[3] | names
            trial, trial_banned = self.converge(no_statistic)
            fp = footprint(trial, self.gm)
            if fp.better(best[2]):
                best = (trial, trial_banned, fp, no_statistic)
        return best[0], best[1]

    def fit_plan(self, prop: Propagation, banned: dict[str, KeptWhole]) -> tuple[Propagation, dict[str, KeptWhole]]:
        """Keep whole what the passes' walk of the plan cannot place, until it places all."""
        for _ in range(MAX_PLANNING_ROUNDS):
            try:
                propagate(self.gm, self.tp, plan=_plan(prop, self.tp, (), self.gathered(prop)))
                return prop, banned
            except UserInputError as e:
                cause = e.__cause__
                if not isinstance(cause, ShardingConflict):
                    raise
                self._ban(banned, cause.origins, KEPT_WHOLE_CONFLICT, str(cause), cause.node)
                prop, banned = self.converge(frozenset(), banned, frozenset(n.name for n in prop.gathered))
        raise AssertionError("the plan does not fit its own graph")

    def gathered(self, prop: Propagation) -> tuple[Gathered, ...]:
        """The plan's entries for the values ``prop`` gathers whole."""
        entries = []
        for node in prop.gathered:
            at, op, why = self.gather_reasons.get(node.name, ("", "", ""))
            entries.append(Gathered(node.name, at, op, int(gathered_bytes(node)), gather_s(node, self.tp), why))
        return tuple(sorted(entries, key=lambda g: g.tensor))


def _generic(path: str) -> str:
    """A module path or parameter name with its layer numbers dropped."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def _module_path(node: Node) -> str:
    """The path of the innermost module ``node`` was traced in ("" at the root)."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    return stack[-1][0] if stack else ""


def _place(node: Node) -> tuple[str, str]:
    """Where a node is in the model, the same in every layer: module path and op."""
    return (_generic(_module_path(node)), op_name(node.target))


def _statistic_places(prop: Propagation) -> dict[tuple[str, str], frozenset[str]]:
    """Nodes that took a tp-reduced statistic, grouped by place."""
    places: dict[tuple[str, str], set[str]] = {}
    for node, role in prop.roles.items():
        if role in (NodeRole.SHARDED_NORM, NodeRole.SHARDED_REDUCTION, NodeRole.SHARDED_EXTREMUM) and node.name in prop.statistics:
            places.setdefault(_place(node), set()).add(node.name)
    return {k: frozenset(v) for k, v in places.items()}


def _first_kind(conflicts: list[ShardingConflict]) -> list[ShardingConflict]:
    """The first conflict in graph order and its repeats in the other layers (same place,
    same parameters up to layer numbers). Later conflicts may follow from the first one's
    sharding, so they are only acted on if the next walk meets them again."""
    def kind(c: ShardingConflict) -> tuple:
        return (_place(c.node) if c.node is not None else None, frozenset(_generic(o) for o in c.origins))

    first = kind(conflicts[0])
    return [c for c in conflicts if kind(c) == first]


def _split(prop: Propagation, node: Node) -> bool:
    """Whether ``node``'s value (a parameter once decided, every output of a tuple) is split somewhere."""
    lay = prop.layouts.get(node)
    if isinstance(lay, ParamView):
        dec = prop.decisions.get(lay.name)
        return dec is not None and dec.dim is not None
    return any(isinstance(l, Layout) and bool(l.dims) for l in (lay if isinstance(lay, tuple) else (lay,)))


def _carrier(prop: Propagation, node: Node) -> bool:
    """A value that can be gathered whole: one split tensor an op computed (not a tuple of them, as
    ``lstm`` returns: its items are), not yet gathered."""
    lay = prop.layouts.get(node)
    return (node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor) and isinstance(lay, Layout) and bool(lay.dims)
            and node not in prop.gathered)  # fmt: skip


def _gather_options(prop: Propagation, conflicts: list[ShardingConflict]) -> list[dict[str, ShardingConflict]]:
    """Values to gather whole so the conflicting ops read no split input, each with the
    conflict it settles. At each conflict, every split input starts a chain up through the
    ops it came from, as long as one input carries the split (a split of a matmul's output,
    through pointwise ops and views); option ``k`` gathers the ``k``-th value of every chain
    (its last where shorter): option 0 gathers the conflicting op's inputs. One more option
    gathers the split where it starts, the values the conflicts' parameters compute (an
    adaLN modulation's column-parallel output, small beside the activations it scales),
    which a chain does not reach when the split has spread to both inputs of an op on its way."""
    chains: list[tuple[ShardingConflict, list[Node]]] = []
    for c in conflicts:
        for a in c.node.all_input_nodes if c.node is not None else ():
            chain = [a] if _carrier(prop, a) else []
            while chain and len(chain) < MAX_GATHER_CHAIN:
                up = [b for b in chain[-1].all_input_nodes if _split(prop, b)]
                if len(up) != 1 or not _carrier(prop, up[0]):
                    break
                chain.append(up[0])
            if chain:
                chains.append((c, chain))
    options: dict[frozenset[str], dict[str, ShardingConflict]] = {}
    if len({id(c) for c, _ in chains}) == len(conflicts):
        for k in range(max(len(ch) for _, ch in chains)):
            option = {ch[min(k, len(ch) - 1)].name: c for c, ch in chains}
            options.setdefault(frozenset(option), option)
    sources = {v.name: c for c in conflicts for v in _computed_from(prop, c.origins)}
    if sources:
        options.setdefault(frozenset(sources), sources)
    return list(options.values())


def _computed_from(prop: Propagation, params: frozenset[str]) -> list[Node]:
    """The split values ops compute straight from ``params`` (a column-parallel matmul's output)."""
    views = [n for n, lay in prop.layouts.items() if isinstance(lay, ParamView) and lay.name in params]
    return [u for v in views for u in v.users if _carrier(prop, u)]


def _plan(prop: Propagation, tp: int, kept: tuple[KeptWhole, ...], gathered: tuple[Gathered, ...]) -> ParallelPlan:
    params = []
    for name in sorted(prop.decisions):
        found = param_sharding(prop, name)
        if found is not None:
            params.append(ParamLayout(name, *found))
    return ParallelPlan(tp=tp, params=tuple(params), kept_whole=kept, gathered=gathered)


def _check_shardable(search: _Search, prop: Propagation, banned: dict[str, KeptWhole]) -> None:
    """Refuse a tp that leaves a rank more than MAX_SHARE_FACTOR/tp of the parameters
    because tp cannot split them."""
    tp, params = search.tp, search.params
    unique = {id(p): (n, p) for n, p in params.items()}
    total = sum(p.numel() for _, p in unique.values())
    held = 0
    for name, p in unique.values():
        found = param_sharding(prop, name)
        held += p.numel() if found is None else p.numel() // p.shape[found[1]] * found[2].local_size(tp)
    stuck = [k for k in banned.values() if k.reason == KEPT_WHOLE_INDIVISIBLE]
    stuck_numel = sum(params[k.name].numel() for k in stuck)
    if not stuck or total == 0 or held <= MAX_SHARE_FACTOR / tp * total or held - stuck_numel * (1 - 1 / tp) > MAX_SHARE_FACTOR / tp * total:
        return
    worst = max(stuck, key=lambda k: k.bytes)
    works = _working_degrees(search, worst)
    raise UserInputError(
        f"tp={tp} cannot shard this model: {worst.detail}, so {worst.name} and {len(stuck) - 1} other parameter(s) would "
        f"stay whole on every rank ({held / total:.0%} of the model per rank). "
        + (f"The smallest tp that splits it is {works[0]} (it splits at tp={', '.join(map(str, works))}). " if works else "")
        + "Choose such a tp, or keep those parameters replicated with a smaller tp."
    )


def _working_degrees(search: _Search, entry: KeptWhole) -> list[int]:
    """The degrees 2..2·tp at which planning shards ``entry``'s parameter."""
    works = []
    for t in range(2, 2 * search.tp + 1):
        prop, _ = _Search(search.gm, t, search.replicate).converge(frozenset())
        dec = prop.decisions.get(entry.name)
        if dec is not None and dec.dim is not None:
            works.append(t)
    return works


def _first_reader(gm: GraphModule, name: str) -> Node | None:
    """The first op that reads parameter ``name`` (in a list argument too: ``aten.lstm``'s weights)."""
    users = [u for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) == name for u in n.users]
    return min(users, key=list(gm.graph.nodes).index, default=None)


def plan_tensor_parallel(gm: GraphModule, tp: int, *, replicate: Iterable[str] = ()) -> ParallelPlan:
    """A ``ParallelPlan`` for ``tp`` ranks; ``replicate`` names parameters to keep whole."""
    if tp < 1:
        raise UserInputError(f"tp must be >= 1, got {tp}")
    search = _Search(gm, tp, set(replicate))
    prop, banned = search.converge(frozenset())
    prop, banned = search.choose_statistics(prop, banned)
    prop, banned = search.fit_plan(prop, banned)
    _check_shardable(search, prop, banned)
    sharded = {id(search.params[n]) for n, d in prop.decisions.items() if d.dim is not None and n in search.params}
    # a parameter kept from being column-parallel may still be row-parallel behind a split input
    kept = {n: k for n, k in banned.items() if id(search.params[n]) not in sharded}
    planned = sharded | {id(search.params[n]) for n in kept}
    if tp > 1:
        for name, dec in prop.decisions.items():
            p = search.params.get(name)
            if p is None or id(p) in planned:
                continue  # a tied weight is planned under its other name
            if dec.dim is None and name not in search.replicate and p.numel() > 1:
                reader = dec.node or _first_reader(gm, name)
                where = f"its first use, {describe(reader)}, reads it whole" if reader is not None else "no op reads it"
                kept[name] = search.entry(name, KEPT_WHOLE_READ_WHOLE, where, reader)
                planned.add(id(p))
    order = {KEPT_WHOLE_CONFLICT: 0, KEPT_WHOLE_INDIVISIBLE: 0}
    entries = sorted(kept.values(), key=lambda k: (order.get(k.reason, 1), -k.bytes, k.name))
    plan = _plan(prop, tp, tuple(entries), search.gathered(prop))
    return replace(plan, loss_chunk_tokens=loss_chunk_tokens(gm, tp, {p.name for p in plan.params if p.dim == 0}))

