"""``parallelize(plan=<file or dict>)``: the JSON of ``autotp plan --format json`` and of
``pm.plan.to_json()`` run as the plan they hold, with its degrees; bad files say why."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
import torch

from autotp.cli import main
from autotp.ir.errors import UserInputError
from autotp.ir.plan_files import load_plan
from distributed import run_on_ranks


def _planned(tmp_path: Path) -> Path:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "llama-tiny", "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "4", "--seq", "16",
                     "--hardware", "cpu", "--tp", "2", "--format", "json"]) == 0  # fmt: skip
    path = tmp_path / "plans.json"
    path.write_text(out.getvalue())
    return path


def _train_from_plan_file(rank: int, world: int, path: str) -> dict:
    import autotp
    from autotp import presets

    torch.manual_seed(0)
    model = presets.build_model("llama-tiny", device="cpu", dtype=torch.float32)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    pm = autotp.parallelize(model, plan=path, example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    loss = pm.train_step(input_ids=ids, labels=ids).item()
    again = autotp.parallelize(copy.deepcopy(reference), plan=json.loads(pm.plan.to_json()),
                               example_inputs={"input_ids": ids[:2], "labels": ids[:2]})  # fmt: skip
    expected = torch.stack([reference(input_ids=c, labels=c).loss for c in ids.chunk(pm.plan.dp * pm.plan.microbatches)])
    return {"tp": pm.plan.tp, "dp": pm.plan.dp, "loss": loss, "expected": expected.mean().item(),
            "as_planned": all(pm.get_parameter(p.name).shape[p.dim] == p.sharding.local_size(2) for p in pm.plan.params),
            "layouts": len(pm.plan.params), "again": again.plan == pm.plan}


def test_parallelize_runs_the_planners_json_file(tmp_path: Path) -> None:
    path = _planned(tmp_path)
    for out in run_on_ranks(_train_from_plan_file, 2, str(path)):
        assert (out["tp"], out["dp"]) == (2, 1)  # the plan's degrees
        assert out["layouts"] > 0 and out["as_planned"]  # its parameters split as it says
        assert out["loss"] == pytest.approx(out["expected"], rel=1e-5)
        assert out["again"]


def test_plan_files_that_are_not_plans_say_why(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="neither 'auto' nor a file"):
        load_plan(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserInputError, match="is not JSON"):
        load_plan(tmp_path / "bad.json")
    with pytest.raises(UserInputError, match=r"is not a plan \(it has \['layers'\]\)"):
        load_plan({"layers": []})
    assert load_plan("auto") == "auto" and load_plan(None) is None
