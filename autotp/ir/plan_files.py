"""``parallelize(plan=...)`` from what a user has at hand: a ``ParallelPlan``, a JSON file or
a dict, in either of the two forms autotp writes.

* ``ParallelPlan.to_json()`` (``pm.plan``): an object with ``tp`` and ``params``.
* ``autotp plan --format json``: a list of ranked estimates, best first, each holding its
  plan under ``"plan"``; the list means its first entry, one entry its plan.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from autotp.ir.errors import UserInputError
from autotp.ir.plan import ParallelPlan

log = logging.getLogger(__name__)


def _from_data(data: Any, where: str) -> ParallelPlan:
    if isinstance(data, list):
        if not data:
            raise UserInputError(f"{where} is an empty list of plans; write it with autotp plan --format json")
        log.info("%s lists %d plans; using the first (the planner's best)", where, len(data))
        data = data[0]
    if isinstance(data, dict) and isinstance(data.get("plan"), dict):
        data = data["plan"]
    if not isinstance(data, dict) or "tp" not in data or "params" not in data:
        keys = sorted(data)[:8] if isinstance(data, dict) else type(data).__name__
        raise UserInputError(f"{where} is not a plan (it has {keys}); pass pm.plan.to_json() or the output of "
                             "autotp plan --format json")  # fmt: skip
    try:
        return ParallelPlan.from_json(json.dumps(data))
    except (KeyError, TypeError, ValueError) as e:
        raise UserInputError(f"{where} is not a readable plan ({type(e).__name__}: {e}); regenerate it") from e


def load_plan(plan: ParallelPlan | str | Path | dict | list | None) -> ParallelPlan | str | None:
    """``plan`` as a ``ParallelPlan``, read from a file or a dict; ``"auto"`` and None stay."""
    if plan is None or isinstance(plan, ParallelPlan) or plan == "auto":
        return plan
    if isinstance(plan, (dict, list)):
        return _from_data(plan, "the plan passed")
    if not isinstance(plan, (str, Path)):
        raise UserInputError(f"plan must be a ParallelPlan, a JSON file, a dict or 'auto', got {type(plan).__name__}")
    path = Path(plan)
    if not path.is_file():
        raise UserInputError(f"plan={str(plan)!r} is neither 'auto' nor a file; pass the path of a plan's JSON "
                             "(autotp plan --format json > plan.json, or pm.plan.to_json())")  # fmt: skip
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"plan file {path} is not JSON ({e})") from e
    return _from_data(data, f"plan file {path}")
