"""Golden files hold what autotp decides, not what transformers happens to emit.

A newer transformers may trace the same model into more nodes (5.24's embedding has 8
more than 5.17's, from how it builds the causal mask) and moves source lines; those
counts, and what follows from them alone (ops per layer, elementwise FLOPs, CUDA-graph
launches and static bytes, region boundary node names), are left out. What stays is
decided by autotp: collectives with their bytes, parameter bytes per rank (the layouts),
stage assignment, the Megatron comparison, regions by layer span and blockers by node,
kind and reason. Regenerate with ``AUTOTP_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "golden"
_TRACE_COUNTS = {"ops", "flops_per_rank", "nodes", "launches", "static_bytes", "first", "last"}


def decisions(report: Any) -> Any:
    """``report`` (explain or CUDA-graph JSON) without the counts of what the trace emitted."""
    if isinstance(report, dict):
        out = {k: decisions(v) for k, v in report.items() if k not in _TRACE_COUNTS}
        if "source" in out:  # a blocker's source line moves with transformers' code: keep its file and function
            out["source"] = re.sub(r", line \d+,", ",", out["source"])
        return out
    if isinstance(report, list):
        return [decisions(v) for v in report]
    return report


def check_golden(name: str, report: Any) -> None:
    out = json.dumps(decisions(report), indent=2) + "\n"
    golden = GOLDEN / name
    if os.environ.get("AUTOTP_UPDATE_GOLDEN") == "1":
        golden.write_text(out)
    assert out == golden.read_text(), f"regenerate with AUTOTP_UPDATE_GOLDEN=1 if intended: {golden}"
