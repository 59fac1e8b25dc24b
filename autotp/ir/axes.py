"""The named parallel axes, and the keys that name their process groups in graphs.

A world of ranks is laid out twice over the same ranks (Megatron's order, seed 001;
``autotp.ir.rank_groups`` builds the groups):

* dense layers: ``tp-cp-dp-pp`` -- tensor, context, data and pipeline parallelism;
* expert layers: ``etp-ep-edp-pp`` -- the experts' tensor parallelism, expert
  parallelism and the experts' data parallelism (MoE folding: ep reuses the ranks the
  dense layers spend on cp and dp).

A sharded tensor dim names the axis it is split over (``autotp.ir.layouts.DimVar.axis``,
tp unless said otherwise), a plan holds a degree per axis (``ParallelPlan.degree``) and a
collective in a graph names its group by ``group_key(axis, size)``, the key under which
the runtime registers the group of this rank on that axis.
"""

from __future__ import annotations

from enum import StrEnum


class Axis(StrEnum):
    """A parallel axis. Members are strings (``Axis.TP == "tp"``), so they key JSON and dicts."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    ETP = "etp"
    DP = "dp"
    EDP = "edp"
    PP = "pp"


DENSE_ORDER = (Axis.TP, Axis.CP, Axis.DP, Axis.PP)
"""Megatron's order of the dense layers' axes, fastest-varying first."""
EXPERT_ORDER = (Axis.ETP, Axis.EP, Axis.EDP, Axis.PP)
"""Megatron's order of the expert layers' axes (MoE folding), fastest-varying first."""


def group_key(axis: Axis, size: int) -> str:
    """Key of the group of ``size`` ranks on ``axis`` that holds this rank (``tp2``, ``ep4``):
    what collectives in a graph name and what the runtime registers."""
    return f"{Axis(axis).value}{size}"


def replica_group_key(group: str, replicas: int) -> str:
    """Key of the subgroup of ``replicas`` consecutive ranks of ``group`` that hold the same slice."""
    return f"{group}_replicas{replicas}"
