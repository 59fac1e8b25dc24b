"""``ParallelPlan``: everything the passes need to know, decided by the cost model.

A plan is plain data: frozen dataclasses that round-trip through JSON. Passes only read
it; ``autotp.cost_model`` produces it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from autotp.cost_model.cudagraphs import CudaGraphPolicy
from autotp.ir.layouts import DimSharding


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is split over the tp ranks.

    ``kind`` says why, for people reading the plan: ``column``/``row`` (linear
    out/in features), ``vocab`` (embedding rows), ``bias`` (follows its linear),
    ``expert_column``/``expert_row`` (fused MoE experts).
    """

    name: str
    kind: str
    dim: int
    sharding: DimSharding

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "dim": self.dim, "sharding": self.sharding.to_json()}

    @staticmethod
    def from_json(d: dict) -> ParamLayout:
        return ParamLayout(d["name"], d["kind"], d["dim"], DimSharding.from_json(d["sharding"]))


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of parallelism and the layout of every sharded parameter.

    Parameters not listed in ``params`` are replicated on every tp rank.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    params: tuple[ParamLayout, ...] = ()
    gather_outputs: bool = True
    notes: tuple[str, ...] = field(default=())
    vpp: int = 1
    # Pipeline chunk (0 .. pp*vpp-1) of every decoder layer, and of the nodes before the
    # first layer (embedding) and after the last one (final norm, lm_head, loss).
    layer_chunks: tuple[int, ...] = ()
    embedding_chunk: int = 0
    head_chunk: int = 0
    # CUDA graphs: whether to capture regions on GPU, which ``make_graphed_callables``
    # captures them (``torch`` or ``transformer_engine``), and the cost model's rule for
    # which regions are worth it.
    cudagraphs: bool = False
    cudagraph_impl: str = ""
    cudagraph_policy: CudaGraphPolicy = field(default_factory=CudaGraphPolicy)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def pp_rank_of_chunk(self, chunk: int) -> int:
        """Megatron's interleaving: pipeline rank r holds chunks r, r+pp, r+2pp, ..."""
        return chunk % self.pp

    def layout_of(self, name: str) -> ParamLayout | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    def to_json(self) -> str:
        return json.dumps(
            {
                "tp": self.tp,
                "pp": self.pp,
                "dp": self.dp,
                "gather_outputs": self.gather_outputs,
                "params": [p.to_json() for p in self.params],
                "notes": list(self.notes),
                "vpp": self.vpp,
                "layer_chunks": list(self.layer_chunks),
                "embedding_chunk": self.embedding_chunk,
                "head_chunk": self.head_chunk,
                "cudagraphs": self.cudagraphs,
                "cudagraph_impl": self.cudagraph_impl,
                "cudagraph_policy": self.cudagraph_policy.to_json(),
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: str) -> ParallelPlan:
        d = json.loads(text)
        return ParallelPlan(
            tp=d["tp"],
            pp=d.get("pp", 1),
            dp=d.get("dp", 1),
            params=tuple(ParamLayout.from_json(p) for p in d["params"]),
            gather_outputs=d.get("gather_outputs", True),
            notes=tuple(d.get("notes", ())),
            vpp=d.get("vpp", 1),
            layer_chunks=tuple(d.get("layer_chunks", ())),
            embedding_chunk=d.get("embedding_chunk", 0),
            head_chunk=d.get("head_chunk", 0),
            cudagraphs=d.get("cudagraphs", False),
            cudagraph_impl=d.get("cudagraph_impl", ""),
            cudagraph_policy=CudaGraphPolicy.from_json(d["cudagraph_policy"]) if "cudagraph_policy" in d else CudaGraphPolicy(),
        )
