"""The planner's candidate configurations: tp, pp, dp, vpp and microbatches that a
cluster and a global batch allow (rules in ``autotp.cost_model.planner``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from autotp.cost_model.hardware import HardwareProfile
from autotp.ir.schedules import default_schedule
from autotp.ir.errors import UserInputError


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    hardware: HardwareProfile


@dataclass(frozen=True)
class Config:
    tp: int
    pp: int
    dp: int
    vpp: int
    microbatch_size: int
    microbatches: int

    @property
    def schedule(self) -> str | None:
        return None if self.pp == 1 else default_schedule(self.vpp)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_cluster(cluster: Cluster) -> int:
    """GPUs per node actually used (all of them on one partial node); ValueError when the world cannot be laid out."""
    if cluster.gpus < 1 or cluster.gpus_per_node < 1:
        raise UserInputError(f"--gpus and --gpus-per-node must be at least 1, got {cluster.gpus} and {cluster.gpus_per_node}")
    if cluster.gpus <= cluster.gpus_per_node:
        return cluster.gpus
    if cluster.gpus % cluster.gpus_per_node:
        raise UserInputError(
            f"{cluster.gpus} GPUs do not make whole nodes of {cluster.gpus_per_node}; use a multiple of "
            f"{cluster.gpus_per_node} GPUs (e.g. {cluster.gpus - cluster.gpus % cluster.gpus_per_node}) or fewer than one node"
        )
    return cluster.gpus_per_node


def candidates(
    num_layers: int,
    cluster: Cluster,
    global_batch: int,
    *,
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    microbatch_size: int | None = None,
) -> list[Config]:
    """Every configuration the rules of the module docstring allow; ValueError when fixed degrees cannot be."""
    per_node = check_cluster(cluster)
    world = cluster.gpus
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp), ("microbatch size", microbatch_size), ("global batch", global_batch)):
        if value is not None and value < 1:
            raise UserInputError(f"{name} must be at least 1, got {value}")
    if tp is not None and (per_node % tp or world % tp):
        raise UserInputError(
            f"tp={tp} does not divide the {per_node} GPUs of a node (a tp group must not span nodes); "
            f"use one of {_divisors(per_node)}"
        )
    if pp is not None and (world // (tp or 1)) % pp:
        raise UserInputError(f"pp={pp} does not divide {world} GPUs / tp={tp or 1}; use one of {_divisors(world // (tp or 1))}")
    if pp is not None and pp > num_layers:
        raise UserInputError(f"pp={pp} is more pipeline stages than the model's {num_layers} layers; use pp <= {num_layers}")
    tps = [tp] if tp is not None else [k for k in _divisors(per_node) if world % k == 0]
    out = []
    for t in tps:
        pps = [pp] if pp is not None else [k for k in _divisors(world // t) if k <= num_layers]
        for p in pps:
            dp = world // (t * p)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            sizes = [microbatch_size] if microbatch_size is not None else _divisors(per_replica)
            for mbs in sizes:
                if per_replica % mbs:
                    continue
                m = per_replica // mbs
                if p > 1 and m < p:
                    continue
                vpps = [1] + [v for v in range(2, num_layers // p + 1) if p > 1 and num_layers % (p * v) == 0 and m % p == 0]
                for v in [vpp] if vpp is not None else vpps:
                    if v == 1 or v in vpps:
                        out.append(Config(t, p, dp, v, mbs, m))
    if not out:
        raise UserInputError(
            f"no way to split a global batch of {global_batch} over {world} GPUs with "
            f"tp={tp or 'any'}, pp={pp or 'any'}, vpp={vpp or 'any'}, microbatch size={microbatch_size or 'any'}: "
            f"dp = GPUs/(tp*pp) must divide the batch, 1F1B needs at least pp microbatches and interleaving "
            f"layers divisible by pp*vpp; use a global batch that is a multiple of {world} or fix fewer degrees"
        )
    return out
