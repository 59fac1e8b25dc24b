"""Rank groups in Megatron-LM's order (``autotp ranks`` prints them).

The world is a grid of coordinates listed in the order ``tp-cp-ep-dp-pp``, the
first varying fastest, so the dimensions that talk most stay on nearby ranks:

    rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank))

A group of dimension X is the set of ranks whose coordinates differ only in X
(Megatron's "masked orthogonal" groups). Groups are listed by the other
coordinates, the first varying fastest, and each group lists its ranks by X.

Dense layers use ``tp-cp-dp-pp`` with ``dp = world / (tp*cp*pp)``. Expert layers
fold the same world as ``etp-ep-edp-pp`` with ``edp = world / (etp*ep*pp)``
(MoE folding: ep reuses ranks that dense layers spend on cp and dp). pp is the
slowest dimension in both, so the two layouts share their pp groups.
"""

from __future__ import annotations

import math

from autotp.ir.axes import DENSE_ORDER, EXPERT_ORDER, Axis
from autotp.ir.errors import UserInputError


def _orthogonal_groups(sizes: list[int], dim: int) -> list[list[int]]:
    """The groups of ranks that differ only in coordinate ``dim`` of a grid of ``sizes``."""
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    others = [i for i in range(len(sizes)) if i != dim]
    groups = []
    for index in range(math.prod(sizes[i] for i in others)):
        base = 0
        for i in others:
            index, coordinate = divmod(index, sizes[i])
            base += coordinate * strides[i]
        groups.append([base + k * strides[dim] for k in range(sizes[dim])])
    return groups


def _data_parallel_size(world_size: int, degrees: dict[str, int], dp_name: str) -> int:
    product = math.prod(degrees.values())
    if world_size % product:
        names = "·".join(degrees)
        values = "·".join(str(v) for v in degrees.values())
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise UserInputError(
            f"world size {world_size} is not divisible by {names} = {values} = {product}, so {dp_name} "
            f"is not whole: use a world size that is a multiple of {product}, or degrees whose product "
            f"divides {world_size} ({', '.join(map(str, divisors))})"
        )
    return world_size // product


def rank_groups(
    world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int | None = None, etp: int | None = None
) -> dict[Axis, list[list[int]]]:
    """Every group of every parallel axis, keyed by axis (``Axis`` members are strings).

    Keys: ``tp``, ``dp``, ``pp`` always; ``cp`` when cp > 1; ``etp``, ``ep``, ``edp``
    when ``ep`` or ``etp`` is given (``etp`` defaults to ``tp``, ``ep`` to 1).
    Raises ValueError when a degree is below 1 or the world does not divide.
    """
    for name, value in (("world size", world_size), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp)):
        if value is not None and value < 1:
            raise UserInputError(f"{name} must be at least 1, got {value}")
    dense = {"tp": tp, "cp": cp, "pp": pp}
    dense_sizes = [tp, cp, _data_parallel_size(world_size, dense, "dp"), pp]
    groups = {
        axis: _orthogonal_groups(dense_sizes, dim)
        for dim, axis in enumerate(DENSE_ORDER)
        if axis != Axis.CP or cp > 1
    }
    if ep is None and etp is None:
        return groups
    expert = {"etp": tp if etp is None else etp, "ep": 1 if ep is None else ep, "pp": pp}
    expert_sizes = [expert["etp"], expert["ep"], _data_parallel_size(world_size, expert, "edp"), pp]
    for dim, axis in enumerate(EXPERT_ORDER[:-1]):
        groups[axis] = _orthogonal_groups(expert_sizes, dim)
    assert _orthogonal_groups(expert_sizes, 3) == groups[Axis.PP]
    return groups


def groups_of(rank: int, groups: dict[Axis, list[list[int]]]) -> dict[Axis, list[int]]:
    """The group that holds ``rank`` on each axis of ``groups``."""
    world_size = sum(len(g) for g in groups[Axis.TP])
    if not 0 <= rank < world_size:
        raise UserInputError(f"rank {rank} is outside the world of {world_size} ranks (0..{world_size - 1})")
    return {name: next(g for g in dim_groups if rank in g) for name, dim_groups in groups.items()}


def format_groups(groups: dict[Axis, list[list[int]]]) -> str:
    """One line per dimension: its name, how many groups of what size, then the groups."""
    width = max(map(len, groups))
    return "\n".join(
        f"{name:<{width}}  {len(dim_groups)} x {len(dim_groups[0])}:  " + "  ".join(map(str, dim_groups))
        for name, dim_groups in groups.items()
    )
