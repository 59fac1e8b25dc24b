"""Parameters that the traced forward never reads (a vision tower of a text-only forward) are
stored split over tp and spread over the pipeline stages, named in ``plan.unread``, left
alone by the optimizer and reassembled whole by checkpoints and ``unshard_state_dict``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import plain_models_structure as structure
from distributed import run_on_ranks
from autotp.compiler import plan_model
from autotp.cost_model.unread_params import split_dim
from autotp.ir.axes import Axis
from autotp.ir.plan import UNREAD_KIND, ParallelPlan

NAME = "unread_tower"
ARCH = "gemma3"  # a vision tower and projector that a text-only forward never reads
IMAGE_PATH = ("vision_tower.", "projector.", "image_")


def _image_only(name: str) -> bool:
    return name.startswith(IMAGE_PATH)


def test_split_dim_leaves_the_smallest_local_tensor() -> None:
    assert split_dim((64, 16), 2) == 0
    assert split_dim((1, 17, 64), 2) == 2  # a class token [1, n, d]: split d
    assert split_dim((67,), 2) == 0  # padded
    assert split_dim((), 4) == -1
    assert split_dim((0, 64), 2) == -1  # an empty parameter (no memory tokens configured) has nothing to split


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (4, 2)])
def test_every_unread_parameter_is_planned_split_with_an_entry(tp: int, pp: int) -> None:
    model = structure.build(NAME)
    plan = plan_model(model, structure.example_inputs(NAME), "cpu", tp=tp, pp=pp, dp=1, vpp=1, plan=None).plan
    names = {n for n, _ in model.named_parameters()}
    assert {u.name for u in plan.unread} == {n for n in names if _image_only(n)}
    axis = Axis.TP if tp > 1 else Axis.PP  # at tp=1 split over the stages
    for u in plan.unread:
        layout = plan.layout_of(u.name)
        if u.dim < 0:
            assert layout is None, u.name
        else:
            assert layout is not None and layout.kind == UNREAD_KIND and layout.dim == u.dim and layout.axis == axis, u.name
    if tp > 1:
        assert {u.chunk for u in plan.unread} == set(range(pp)), "every stage holds a share"
    assert ParallelPlan.from_json(plan.to_json()).unread == plan.unread


def test_explain_names_the_unread_parameters() -> None:
    import autotp
    from autotp.cost_model.graph_costs import build_report
    from autotp.report.graph_report import explain_table

    compiled = autotp.compile_rank(structure.build(NAME), tp=2, example_inputs=structure.example_inputs(NAME))
    text = explain_table(build_report(compiled.graph, compiled.plan, 0), NAME)
    assert f"parameters the traced forward never reads ({len(compiled.plan.unread)}," in text
    assert "largest: vision_tower.blocks.0.ffn.down.weight" in text


def _train_save_load(rank: int, world: int, tp: int, pp: int, folder: str) -> dict[str, object]:
    import autotp
    from autotp.report.strict_rule import check_on_rank

    inputs = structure.example_inputs(NAME)
    verdict = check_on_rank(structure.build(NAME), inputs, tp=tp, pp=pp)

    model = structure.build(NAME)
    reference = copy.deepcopy(model)
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs=inputs)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)  # Adam would amplify rounding noise of ~0 grads
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    pm.train_step(**inputs, num_microbatches=2)
    opt.step()
    reference(**inputs)["loss"].backward()
    ref_opt.step()
    trained = pm.unshard_state_dict()
    expected = reference.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"after a step, {key}: {m}")
    assert torch.equal(trained["vision_tower.patch.weight"], structure.build(NAME).vision_tower.patch.weight.detach())

    zero = autotp.parallelize(structure.build(NAME), tp=tp, pp=pp, example_inputs=inputs)
    zero_opt = autotp.DistributedOptimizer(zero, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1)
    zero.train_step(**inputs, num_microbatches=2)
    zero_opt.step()
    for key, value in zero.unshard_state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"DistributedOptimizer, {key}: {m}")

    pm.save_checkpoint(Path(folder) / "ckpt", optimizer=opt, step=1)
    fresh = structure.build(NAME)
    for p in fresh.parameters():
        p.data.zero_()
    resumed = autotp.parallelize(fresh, tp=tp, pp=pp, example_inputs=inputs)
    assert resumed.load_checkpoint(Path(folder) / "ckpt") == 1
    loaded = resumed.unshard_state_dict()
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), f"checkpoint round trip: {key}"

    with pytest.raises(ValueError, match=r"reads parameter (vision_tower|projector|image_).*never read it.*pixel_values"):
        pm(**inputs, pixel_values=torch.randn(2, structure.CHANNELS, structure.IMAGE, structure.IMAGE))
    return {"reason": verdict.reason, "share": verdict.share, "limit": verdict.limit}


@pytest.mark.parametrize("tp, pp", [pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])  # tp=2: planned split in the test above
def test_unread_tower_passes_the_strict_rule_and_round_trips(tmp_path: Path, tp: int, pp: int) -> None:
    results = run_on_ranks(_train_save_load, tp * pp, tp, pp, str(tmp_path), timeout_s=600)
    for r in results:
        assert not r["reason"], r["reason"]
        assert r["share"] <= r["limit"]


def _hf_round_trip(rank: int, world: int, folder: str, tp: int, pp: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import autotp
    from sweep_registry import _inputs, build

    path = Path(folder) / "hf"
    reference = type(build(ARCH)).from_pretrained(path).float().eval()
    model = build(ARCH)  # on the CPU: on meta, SigLIP's position_ids buffer has no initializer
    for p in model.parameters():
        p.data.zero_()
    pm = autotp.parallelize(model, tp=tp, pp=pp, checkpoint=path, example_inputs=_inputs())
    assert pm.plan.unread, "the vision tower is never read by a text-only forward"
    state, expected = pm.unshard_state_dict(), reference.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), f"loaded from the HF checkpoint: {key}"
    pm.save_pretrained(Path(folder) / f"out{tp}{pp}")
    if rank == 0:
        saved = type(reference).from_pretrained(Path(folder) / f"out{tp}{pp}").float().state_dict()
        for key, value in expected.items():
            assert torch.equal(saved[key], value), f"save_pretrained: {key}"


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_unread_tower_loads_from_and_saves_to_an_hf_checkpoint(tmp_path: Path, tp: int, pp: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sweep_registry import build

    build(ARCH).save_pretrained(tmp_path / "hf")
    run_on_ranks(_hf_round_trip, tp * pp, str(tmp_path), tp, pp, timeout_s=600)
