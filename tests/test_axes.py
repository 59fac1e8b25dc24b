"""Named parallel axes: in layouts, plans, group keys and the process groups the runtime makes."""

from __future__ import annotations

import pytest

from autotp.ir.axes import Axis, group_key, replica_group_key
from autotp.ir.errors import UserInputError
from autotp.ir.layouts import DimVar, ShardingConflict, fixed_var, resolve, set_segments, shard, unify
from autotp.ir.dim_sharding import DimSharding
from autotp.ir.plan import ParallelPlan, ParamLayout
from autotp.ir.rank_groups import groups_of

from distributed import run_on_ranks


def test_a_dim_names_its_axis_and_two_axes_never_unify() -> None:
    tp_var = DimVar(8, frozenset({"a"}))
    ep_var = DimVar(8, frozenset({"b"}), axis=Axis.EP)
    assert tp_var.axis == Axis.TP  # the default: analysis code that names no axis means tp
    with pytest.raises(ShardingConflict, match="split over tp meets one split over ep"):
        unify(tp_var, ep_var, "x")
    assert unify(ep_var, DimVar(8, frozenset({"c"}), axis=Axis.EP), "y").axis == Axis.EP


def test_one_tensor_sharded_on_tp_and_ep_at_once() -> None:
    experts = DimVar(4, frozenset({"w"}), axis=Axis.EP)
    features = DimVar(16, frozenset({"w"}))
    layout = shard({0: experts, 2: features})
    assert layout.axes() == {Axis.EP, Axis.TP}
    assert layout.describe(tp=2) == "Shard(0:4@ep, 2:8/16)"
    set_segments(experts, [2, 2], "split")
    assert all(s.axis == Axis.EP for s in experts.find().segments or ())  # segments keep the axis
    assert resolve(experts, 2).axis == Axis.EP


def test_sharding_axis_round_trips_and_old_json_means_tp() -> None:
    ep = DimSharding(8, (8,), (8,), axis=Axis.EP)
    assert DimSharding.from_json(ep.to_json()) == ep
    old = {"size": 8, "segments": [8], "groups": [8], "padded": False}
    assert DimSharding.from_json(old).axis == Axis.TP
    assert fixed_var(ep, "w").axis == Axis.EP
    plan = ParallelPlan(tp=2, dp=2, ep=2, etp=1, cp=1, params=(ParamLayout("w", "expert", 0, ep),))
    again = ParallelPlan.from_json(plan.to_json())
    assert again == plan and again.params[0].axis == Axis.EP


def test_plan_has_a_degree_per_axis() -> None:
    plan = ParallelPlan(tp=2, cp=2, pp=2, dp=2, ep=4, etp=1)
    assert plan.world_size == 16
    degrees = {axis: plan.degree(axis) for axis in Axis}
    assert degrees == {Axis.TP: 2, Axis.CP: 2, Axis.EP: 4, Axis.ETP: 1, Axis.DP: 2, Axis.EDP: 2, Axis.PP: 2}
    assert ParallelPlan(tp=4, dp=2).degree(Axis.ETP) == 4  # etp defaults to tp (Megatron)
    assert ParallelPlan(tp=4, dp=2).degree(Axis.EDP) == 2


def test_plan_degrees_are_checked_against_the_world() -> None:
    with pytest.raises(UserInputError, match=r"tp\*cp\*pp\*dp = 2\*1\*1\*2 = 4 ranks, but the world has 8"):
        ParallelPlan(tp=2, dp=2).rank_groups(8)
    with pytest.raises(UserInputError, match="edp is not whole"):
        ParallelPlan(tp=1, dp=6, ep=4).rank_groups(6)
    groups = ParallelPlan(tp=2, dp=4, pp=2, ep=4, etp=1).rank_groups(16)
    assert set(groups) == {"tp", "dp", "pp", "etp", "ep", "edp"}
    assert groups[Axis.EP] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]  # seed 001, folded
    assert ParallelPlan(tp=2, dp=2).rank_groups(4).keys() == {"tp", "dp", "pp"}  # no expert layout asked


def test_group_keys_name_their_axis() -> None:
    assert group_key(Axis.TP, 2) == "tp2" and group_key(Axis.EP, 4) == "ep4" and group_key("etp", 1) == "etp1"
    assert replica_group_key(group_key(Axis.TP, 4), 2) == "tp4_replicas2"


def _groups_on_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from autotp.ir.plan import ParallelPlan
    from autotp.runtime.processes import collectives
    from autotp.runtime.processes.groups import make_groups

    plan = ParallelPlan(tp=2, dp=2, ep=2, etp=1)
    coords = make_groups(plan, timeout_s=60)
    registered = {key: dist.get_process_group_ranks(collectives.get_group(key)) for key in ("tp2", "ep2")}
    refused = ""
    made = {tuple(g): dist.new_group(g) for g in ([0, 3], [1, 2])}  # collective: every rank makes both
    other = next(group for g, group in made.items() if rank in g)
    try:  # the same key for other ranks (cp groups of another tp) would mix two models' groups
        collectives.register_group("ep2", other)
    except ValueError as e:
        refused = str(e)
    dp = dist.get_process_group_ranks(coords.dp_group)
    return {"ranks": {str(a): r for a, r in coords.ranks.items()}, "registered": registered, "dp": dp, "refused": refused}


def test_runtime_groups_are_the_plans_megatron_groups() -> None:
    results = run_on_ranks(_groups_on_rank, 4, timeout_s=120)
    groups = ParallelPlan(tp=2, dp=2, ep=2, etp=1).rank_groups(4)
    for rank, got in enumerate(results):
        mine = groups_of(rank, groups)
        assert got["ranks"] == {str(a): g.index(rank) for a, g in mine.items()}
        assert got["registered"] == {"tp2": mine[Axis.TP], "ep2": mine[Axis.EP]}
        assert got["dp"] == mine[Axis.DP]
        assert "group key 'ep2' names ranks" in got["refused"]
