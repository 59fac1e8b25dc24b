import argparse
import itertools
import json

import pytest

from autotp.cli.ranks import add_ranks_command
from autotp.ir.rank_groups import format_groups, groups_of, rank_groups

# The 16-GPU examples of seed 001 (Megatron-LM rank generator, order tp-cp-ep-dp-pp), typed from its text.
SEED_TP4_PP2_DP2 = {
    "tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
}
SEED_ETP1_EP4_EDP2_PP2 = {
    "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "etp": [[r] for r in range(16)],  # "etp为1，则会默认生成16个 groups"
}


def test_seed_dense_tp4_pp2_dp2() -> None:
    assert rank_groups(16, tp=4, pp=2) == SEED_TP4_PP2_DP2


def test_seed_moe_etp1_ep4_edp2_pp2() -> None:
    groups = rank_groups(16, tp=4, pp=2, ep=4, etp=1)
    assert list(groups) == ["tp", "dp", "pp", "etp", "ep", "edp"]
    assert {name: groups[name] for name in ("tp", "dp", "pp")} == SEED_TP4_PP2_DP2
    assert {name: groups[name] for name in SEED_ETP1_EP4_EDP2_PP2} == SEED_ETP1_EP4_EDP2_PP2


@pytest.mark.parametrize(
    ("world", "tp", "cp", "pp"),
    [(16, 4, 1, 2), (16, 2, 2, 2), (24, 2, 3, 2), (32, 8, 1, 4), (8, 1, 1, 1), (12, 1, 2, 3)],
)
def test_groups_differ_in_one_coordinate_of_the_seed_formula(world: int, tp: int, cp: int, pp: int) -> None:
    dp = world // (tp * cp * pp)
    groups = rank_groups(world, tp=tp, pp=pp, cp=cp)
    assert set(groups) == ({"tp", "cp", "dp", "pp"} if cp > 1 else {"tp", "dp", "pp"})
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    coords = {}
    for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
        # global_rank = tp_rank + cp_rank*tp + dp_rank*tp*cp + pp_rank*tp*cp*dp (seed 001, Dense)
        coords[t + c * tp + d * tp * cp + p * tp * cp * dp] = {"tp": t, "cp": c, "dp": d, "pp": p}
    for name, dim_groups in groups.items():
        assert sorted(r for g in dim_groups for r in g) == list(range(world))
        assert all(len(g) == sizes[name] for g in dim_groups)
        for g in dim_groups:
            assert [coords[r][name] for r in g] == list(range(sizes[name]))
            for other in sizes.keys() - {name}:
                assert len({coords[r][other] for r in g}) == 1


def test_expert_layout_folds_the_same_world() -> None:
    groups = rank_groups(16, tp=2, cp=2, pp=2, ep=4)
    assert groups["etp"] == groups["tp"]  # etp defaults to tp
    assert groups["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups["edp"] == [[r] for r in range(16)]
    assert "ep" not in rank_groups(16, tp=4, pp=2)
    assert set(rank_groups(16, tp=4, pp=2, ep=1)) == {"tp", "dp", "pp", "etp", "ep", "edp"}


def test_groups_of_one_rank() -> None:
    groups = rank_groups(16, tp=4, pp=2, ep=4, etp=1)
    assert groups_of(5, groups) == {
        "tp": [4, 5, 6, 7],
        "dp": [1, 5],
        "pp": [5, 13],
        "etp": [5],
        "ep": [4, 5, 6, 7],
        "edp": [1, 5],
    }
    with pytest.raises(ValueError, match=r"rank 16 is outside the world of 16 ranks \(0..15\)"):
        groups_of(16, groups)


def test_world_size_that_does_not_divide() -> None:
    with pytest.raises(ValueError, match=r"world size 12 is not divisible by tp·cp·pp = 4·1·2 = 8") as info:
        rank_groups(12, tp=4, pp=2)
    assert "multiple of 8" in str(info.value) and "(1, 2, 3, 4, 6, 12)" in str(info.value)
    with pytest.raises(ValueError, match=r"etp·ep·pp = 4·3·1 = 12, so edp is not whole"):
        rank_groups(16, tp=4, ep=3)
    with pytest.raises(ValueError, match="tp must be at least 1, got 0"):
        rank_groups(16, tp=0)


def _ranks(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_ranks_command(parser.add_subparsers())
    args = parser.parse_args(["ranks", *argv])
    assert args.handler(args) == 0
    return capsys.readouterr().out


def test_ranks_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = json.loads(_ranks(capsys, "--world-size", "16", "--tp", "4", "--pp", "2", "--format", "json"))
    assert out == SEED_TP4_PP2_DP2
    out = json.loads(
        _ranks(capsys, "--world-size", "16", "--tp", "4", "--pp", "2", "--ep", "4", "--etp", "1", "--format", "json")
    )
    assert out == {**SEED_TP4_PP2_DP2, **SEED_ETP1_EP4_EDP2_PP2}


def test_ranks_command_text(capsys: pytest.CaptureFixture[str]) -> None:
    out = _ranks(capsys, "--world-size", "16", "--tp", "4", "--pp", "2")
    assert out == format_groups(SEED_TP4_PP2_DP2) + "\n"
    assert out.splitlines()[0] == "tp  4 x 4:  [0, 1, 2, 3]  [4, 5, 6, 7]  [8, 9, 10, 11]  [12, 13, 14, 15]"
    assert out.splitlines()[2].startswith("pp  8 x 2:  [0, 8]  [1, 9]")
