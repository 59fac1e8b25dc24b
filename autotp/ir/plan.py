"""``ParallelPlan``: every decision the passes and the runtime read, made by the cost model
and the compiler.

A plan is plain data: frozen dataclasses that round-trip through JSON (JSON written
before a field existed loads with that field's default). Passes and the runtime only
read it; ``autotp.cost_model`` and ``autotp.compiler`` produce it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from autotp.ir.axes import Axis
from autotp.ir.errors import UserInputError
from autotp.ir.fp8_delayed import DEFAULT_LENGTH
from autotp.ir.dim_sharding import DimSharding
from autotp.ir.op_facts import Collective
from autotp.ir.rank_groups import rank_groups
from autotp.ir.moe_plan import ExpertParallelEstimate, MoeLayerPlan
from autotp.ir.schedules import default_schedule

DEFAULT_HARDWARE = "h200"
"""``plan.hardware`` of a plan made without a GPU in sight (offline compiles): an H200."""
DP_BUCKET_BYTES = 25 * 2**20
"""Default size of the dp gradient all-reduce buckets."""

OVERLAP_ALL_GATHER = Collective.ALL_GATHER
"""``plan.tp_overlap``: the sequence all-gathers before column-parallel GEMMs run as ``all_gather_matmul``."""
OVERLAP_REDUCE_SCATTER = Collective.REDUCE_SCATTER
"""``plan.tp_overlap``: the reduce-scatters after row-parallel GEMMs run as ``matmul_reduce_scatter``."""


@dataclass(frozen=True)
class CudaGraphPolicy:
    """The cost model's constants for choosing CUDA-graph regions
    (the rule is in ``autotp.cost_model.cudagraphs``; the hardware is ``ParallelPlan.hardware``)."""

    launch_s: float = 26e-6
    replay_s: float = 20e-6
    max_static_bytes: int = 16 * 2**30
    min_saved_s: float = 0.0

    def to_json(self) -> dict:
        return {
            "launch_s": self.launch_s,
            "replay_s": self.replay_s,
            "max_static_bytes": self.max_static_bytes,
            "min_saved_s": self.min_saved_s,
        }

    @staticmethod
    def from_json(d: dict) -> CudaGraphPolicy:
        return CudaGraphPolicy(**{k: v for k, v in d.items() if k != "hardware"})  # JSON before plan.hardware had it here


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is split over the ranks of one axis (``sharding.axis``, tp by default).

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

    @property
    def axis(self) -> Axis:
        return self.sharding.axis

    @staticmethod
    def from_json(d: dict) -> ParamLayout:
        return ParamLayout(d["name"], d["kind"], d["dim"], DimSharding.from_json(d["sharding"]))


KEPT_WHOLE_CONFLICT = "conflict"
"""``KeptWhole.reason``: its sharding reaches an op that needs the sharded dim whole."""
KEPT_WHOLE_COMM = "comm_outweighs_compute"
"""``KeptWhole.reason``: the cost model found sharding it slower than keeping it whole."""
KEPT_WHOLE_INDIVISIBLE = "indivisible"
"""``KeptWhole.reason``: tp does not split a dim its sharding would cut (a 10-class head at tp=4)."""
KEPT_WHOLE_READ_WHOLE = "read_whole"
"""``KeptWhole.reason``: its first use reads it whole (a norm weight on the replicated
residual stream, a router, a row-parallel bias added after the all-reduce)."""


@dataclass(frozen=True)
class KeptWhole:
    """A parameter that the plan keeps whole on every tp rank although it has a dim that
    could be split, and why. A weight kept whole without such an entry is a planner bug."""

    name: str
    reason: str
    detail: str = ""
    node: str = ""
    op: str = ""
    bytes: int = 0

    def to_json(self) -> dict:
        return {"name": self.name, "reason": self.reason, "detail": self.detail, "node": self.node, "op": self.op, "bytes": self.bytes}

    @staticmethod
    def from_json(d: dict) -> KeptWhole:
        return KeptWhole(**d)


@dataclass(frozen=True)
class Gathered:
    """A split activation all-gathered to whole where an op needs it whole, instead of
    keeping the parameters behind it whole (``passes/gather_activations``): ``tensor`` is the
    node whose value is gathered (every later reader gets it whole), ``node`` and ``op`` the
    op that needed it whole, ``bytes`` the whole tensor's size and ``comm_s`` the estimated
    all-gather time per step (on ``ParallelPlan.hardware``). ``detail`` is for people."""

    tensor: str
    node: str
    op: str
    bytes: int = 0
    comm_s: float = 0.0
    detail: str = ""

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "node": self.node, "op": self.op, "bytes": self.bytes, "comm_s": self.comm_s, "detail": self.detail}

    @staticmethod
    def from_json(d: dict) -> Gathered:
        return Gathered(**d)


UNREAD_KIND = "unread"
"""``ParamLayout.kind`` of a parameter that no node of the traced forward reads (``UnreadParam``)."""


@dataclass(frozen=True)
class UnreadParam:
    """A parameter that no node of the traced forward reads (a vision tower of a text-only
    forward): stored split over tp (at tp=1, over pp) by its ``UNREAD_KIND`` layout in
    ``ParallelPlan.params`` (``dim`` -1: a scalar, held whole) and held by the stage of pipeline
    chunk ``chunk`` (by every stage when split over pp). It
    has no grad; checkpoints and ``state_dict`` reassemble it whole. ``detail`` is for people."""

    name: str
    dim: int
    chunk: int = 0
    bytes: int = 0
    detail: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "dim": self.dim, "chunk": self.chunk, "bytes": self.bytes, "detail": self.detail}

    @staticmethod
    def from_json(d: dict) -> UnreadParam:
        return UnreadParam(**d)


FP8_OUTSIDE_LAYERS = "outside_layers"
"""``Fp8Linear.reason``: a GEMM outside the decoder layers (``lm_head``), kept in the model's dtype by default."""
FP8_DIMS = "dims"
"""``Fp8Linear.reason``: a local GEMM dim is not a multiple of what the recipe's kernels need (16; 128 blockwise)."""
FP8_PARTIAL_INPUT = "partial_input"
"""``Fp8Linear.reason``: the GEMM reads a partial sum, whose summands would be scaled apart."""
FP8_TOKEN_SPLIT = "token_split"
"""``Fp8Linear.reason``: blockwise tiles along tokens that the tp group splits would differ from one rank's."""
FP8_DTYPE = "dtype"
"""``Fp8Linear.reason``: the weight is not a floating-point tensor of 16 or 32 bits."""


@dataclass(frozen=True)
class Fp8Linear:
    """How the GEMMs reading one 2-d weight run under ``ParallelPlan.fp8``: ``recipe``
    (``autotp.ir.fp8.RECIPES``), or "" to stay in the model's dtype for ``reason``
    (``detail`` for people; ``node``: the GEMM that decided it)."""

    weight: str
    recipe: str
    reason: str = ""
    detail: str = ""
    node: str = ""

    def to_json(self) -> dict:
        return {"weight": self.weight, "recipe": self.recipe, "reason": self.reason, "detail": self.detail, "node": self.node}

    @staticmethod
    def from_json(d: dict) -> Fp8Linear:
        return Fp8Linear(**d)


RECOMPUTE_MODEL, RECOMPUTE_MEMORY, RECOMPUTE_USER = "model", "memory", "user"
RECOMPUTE_REASONS = (RECOMPUTE_MODEL, RECOMPUTE_MEMORY, RECOMPUTE_USER)
"""Why ``ParallelPlan.recompute_layers`` holds its layers: the model checkpointed them itself,
the planner recomputes them so the plan fits (or a larger microbatch wins), or the user asked."""


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees of parallelism and the layout of every sharded parameter.

    Parameters not listed in ``params`` are replicated on every tp rank; ``kept_whole``
    says why for each one that could have been split.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    params: tuple[ParamLayout, ...] = ()
    gather_outputs: bool = True
    notes: tuple[str, ...] = field(default=())
    vpp: int = 1
    # Pipeline chunk (0 .. pp*vpp-1) of every decoder layer, and of the nodes before the
    # first layer (embedding) and after the last one (final norm, lm_head, loss);
    # ``module_chunks``: (module path, chunk) of each module outside the layers placed off
    # its section's chunk (``autotp.analysis.pipeline_units``: a block before the layers cut
    # from the embedding, one after them cut from the head).
    layer_chunks: tuple[int, ...] = ()
    embedding_chunk: int = 0
    head_chunk: int = 0
    module_chunks: tuple[tuple[str, int], ...] = ()
    # CUDA graphs: whether to capture regions on GPU, which ``make_graphed_callables``
    # captures them (``torch`` or ``transformer_engine``), and the cost model's rule for
    # which regions are worth it.
    cudagraphs: bool = False
    cudagraph_impl: str = ""
    cudagraph_policy: CudaGraphPolicy = field(default_factory=CudaGraphPolicy)
    # The candidate regions (``meta_keys.CUDAGRAPH_CANDIDATE`` ids) that the policy chose,
    # recorded by the compiler for the signature it compiled.
    cudagraph_regions: tuple[int, ...] = ()
    # ``train_step``'s defaults: microbatches per step, their size (0: not planned, the
    # global batch / (dp * microbatches)) and the pipeline schedule ("": ``schedule_name``'s default).
    microbatches: int = 1
    microbatch_size: int = 0
    schedule: str = ""
    dp_bucket_bytes: int = DP_BUCKET_BYTES
    # Attention masks proven causal-only run as SDPA ``is_causal=True``; the compiler records
    # the SDPA nodes it rewrote for the signature it compiled.
    causal_attention: bool = True
    causal_attention_nodes: tuple[str, ...] = ()
    # Megatron sequence parallelism: the regions between tp regions run on 1/tp of the
    # tokens (``passes/sequence_parallel``).
    sequence_parallel: bool = False
    # Sequence-parallel collectives decomposed to run behind their GEMM (``passes/tp_overlap``):
    # any of ``OVERLAP_ALL_GATHER``, ``OVERLAP_REDUCE_SCATTER`` (with their duals backward), and
    # how (``ops.OVERLAP_IMPLS``: ``symm_mem`` on CUDA + NCCL, else the P2P ring).
    tp_overlap: tuple[str, ...] = ()
    tp_overlap_impl: str = "symm_mem"
    # The training step the planner assumed (``autotp.ir.training_step``): its precision
    # ("": not planned) and whether the optimizer state is sharded over dp
    # (``autotp.DistributedOptimizer``).
    precision: str = ""
    distributed_optimizer: bool = False
    ep: int = 1
    kept_whole: tuple[KeptWhole, ...] = ()
    # Split activations gathered whole where an op needs them whole (the other sound fallback).
    gathered: tuple[Gathered, ...] = ()
    # Context parallelism (``degree`` has every axis, ``rank_groups`` lays them out: autotp.ir.axes).
    cp: int = 1
    # The hardware the plan is costed for (a ``autotp.cost_model.hardware.PROFILES`` key): the
    # planner's, or the GPU kind the compiler runs on.
    hardware: str = DEFAULT_HARDWARE
    # Expert parallelism (``passes/expert_parallel``): the expert tensor-parallel degree (0: tp,
    # experts sharded like dense MLPs), how rows reach the experts (``moe_ops.MODES``, "": not
    # rewritten), the sync-free capacity factor and the MoE layers it applies to.
    etp: int = 0
    moe_dispatch: str = ""
    moe_capacity_factor: float = 0.0
    moe_layers: tuple[MoeLayerPlan, ...] = ()
    # The lm_head and its cross entropy fused, this many tokens at a time (0: not fused;
    # ``passes/fused_linear_cross_entropy``, chosen by ``autotp.cost_model.fused_loss``).
    loss_chunk_tokens: int = 0
    # FP8 training (``passes/fp8_linear``): the recipe asked ("": off), the backend whose op runs
    # the GEMMs, every GEMM weight's recipe or why it stays in the model's dtype, and whether
    # sequence-parallel all-gathers into FP8 GEMMs carry FP8 (tensorwise).
    fp8: str = ""
    fp8_backend: str = "torch"
    fp8_linears: tuple[Fp8Linear, ...] = ()
    fp8_all_gather: bool = False
    # Delayed FP8 scaling (``autotp.ir.fp8_delayed``): steps in each operand's amax window (max over them).
    fp8_amax_history: int = DEFAULT_LENGTH
    # The planner's price of the chosen expert parallelism (None: not planned by the cost model).
    moe_estimate: ExpertParallelEstimate | None = None
    # The parameters the traced forward never reads, stored split (``UnreadParam``).
    unread: tuple[UnreadParam, ...] = ()
    # The op whose values mix the rows of the batch (``analysis.batch_rows``), described; ""
    # when none: ``train_step`` then refuses to split the batch over microbatches or dp ranks.
    batch_mixing: str = ""
    # The op through which the loss takes a trained statistic of the batch's rows other than
    # linearly (``loss_denominators.per_piece_statistic``), described; "": none. A split step
    # computes it per piece (a router's load-balancing loss per microbatch, as Megatron does).
    batch_statistics: str = ""
    # Inputs whose batch rows lie on a dim other than 0, by pytree key path (``['position_ids']``):
    # the dim, or -1 where the trace could not tell (``analysis.trace.input_batch_dims``).
    input_batch_dims: tuple[tuple[str, int], ...] = ()
    # Per leaf of the forward's outputs (pytree order), the dim holding the batch's rows, None where
    # it holds none (``analysis.batch_rows.batch_verdicts``); () when the traced batch had one row.
    # ``train_step`` reads a ``loss_fn``'s inputs by it (``analysis.loss_fn_rows``).
    output_batch_dims: tuple[int | None, ...] = ()
    # The parameters whose ``requires_grad`` the traced forward set, and the value it left
    # (``meta_keys.REQUIRES_GRAD_SET``): each rank's parameter takes it, as the model's would
    # after its first forward, so that a part the forward freezes gets no gradient.
    requires_grad_set: tuple[tuple[str, bool], ...] = ()
    # The buffers whose values took a branch of the traced forward (``analysis.buffer_branches``):
    # a retrace (another input signature) reads them from the copy the model keeps.
    branch_buffers: tuple[str, ...] = ()
    # Activation recomputation (``passes/recompute_layers``): the decoder layers whose forward runs
    # again in the backward instead of keeping its activations, and why (``RECOMPUTE_REASONS``).
    recompute_layers: tuple[int, ...] = ()
    recompute_reason: str = ""

    def __post_init__(self) -> None:
        layers = self.recompute_layers
        if any(not isinstance(i, int) or i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise UserInputError(f"plan.recompute_layers {list(layers)}: give distinct decoder-layer indices (0, 1, ...)")
        if layers and self.recompute_reason not in RECOMPUTE_REASONS:
            raise UserInputError(f"plan.recompute_reason {self.recompute_reason!r}: one of {', '.join(RECOMPUTE_REASONS)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def degree(self, axis: Axis) -> int:
        """The number of ranks along ``axis`` (edp: what the world leaves the experts, after etp·ep·pp)."""
        if axis == Axis.ETP:
            return self.etp or self.tp
        if axis == Axis.EDP:
            return self.world_size // (self.degree(Axis.ETP) * self.ep * self.pp)
        return {Axis.TP: self.tp, Axis.CP: self.cp, Axis.EP: self.ep, Axis.DP: self.dp, Axis.PP: self.pp}[Axis(axis)]

    @property
    def has_experts_layout(self) -> bool:
        """Whether the expert layers fold the world differently from the dense ones (ep or etp set)."""
        return self.ep > 1 or self.etp > 0

    def rank_groups(self, world_size: int) -> dict[Axis, list[list[int]]]:
        """Every group of every axis of this plan over ``world_size`` ranks (Megatron's order,
        MoE folding); raises UserInputError when the degrees do not fit the world."""
        if world_size != self.world_size:
            raise UserInputError(
                f"the plan's tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {self.world_size} ranks, but the "
                f"world has {world_size}; run it on {self.world_size} processes or plan for {world_size}"
            )
        experts = self.has_experts_layout
        return rank_groups(world_size, tp=self.tp, pp=self.pp, cp=self.cp,
                           ep=self.ep if experts else None, etp=self.degree(Axis.ETP) if experts else None)  # fmt: skip

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def pp_rank_of_chunk(self, chunk: int) -> int:
        """Megatron's interleaving: pipeline rank r holds chunks r, r+pp, r+2pp, ..."""
        return chunk % self.pp

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule to run: ``schedule``, else ``schedules.default_schedule``."""
        return self.schedule or default_schedule(self.vpp)

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
                "module_chunks": [list(m) for m in self.module_chunks],
                "cudagraphs": self.cudagraphs,
                "cudagraph_impl": self.cudagraph_impl,
                "cudagraph_policy": self.cudagraph_policy.to_json(),
                "cudagraph_regions": list(self.cudagraph_regions),
                "microbatches": self.microbatches,
                "microbatch_size": self.microbatch_size,
                "schedule": self.schedule,
                "dp_bucket_bytes": self.dp_bucket_bytes,
                "causal_attention": self.causal_attention,
                "causal_attention_nodes": list(self.causal_attention_nodes),
                "precision": self.precision,
                "sequence_parallel": self.sequence_parallel,
                "tp_overlap": list(self.tp_overlap),
                "tp_overlap_impl": self.tp_overlap_impl,
                "distributed_optimizer": self.distributed_optimizer,
                "ep": self.ep,
                "kept_whole": [k.to_json() for k in self.kept_whole],
                "gathered": [g.to_json() for g in self.gathered],
                "cp": self.cp,
                "hardware": self.hardware,
                "etp": self.etp,
                "moe_dispatch": self.moe_dispatch,
                "moe_capacity_factor": self.moe_capacity_factor,
                "moe_layers": [m.to_json() for m in self.moe_layers],
                "loss_chunk_tokens": self.loss_chunk_tokens,
                "fp8": self.fp8,
                "fp8_backend": self.fp8_backend,
                "fp8_linears": [f.to_json() for f in self.fp8_linears],
                "fp8_all_gather": self.fp8_all_gather,
                "fp8_amax_history": self.fp8_amax_history,
                "moe_estimate": self.moe_estimate.to_json() if self.moe_estimate else None,
                "unread": [u.to_json() for u in self.unread],
                "batch_mixing": self.batch_mixing,
                "batch_statistics": self.batch_statistics,
                "input_batch_dims": [list(p) for p in self.input_batch_dims],
                "output_batch_dims": list(self.output_batch_dims),
                "requires_grad_set": [list(p) for p in self.requires_grad_set],
                "branch_buffers": list(self.branch_buffers),
                "recompute_layers": list(self.recompute_layers),
                "recompute_reason": self.recompute_reason,
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
            module_chunks=tuple((path, chunk) for path, chunk in d.get("module_chunks", ())),
            cudagraphs=d.get("cudagraphs", False),
            cudagraph_impl=d.get("cudagraph_impl", ""),
            cudagraph_policy=CudaGraphPolicy.from_json(d["cudagraph_policy"]) if "cudagraph_policy" in d else CudaGraphPolicy(),
            cudagraph_regions=tuple(d.get("cudagraph_regions", ())),
            microbatches=d.get("microbatches", 1),
            microbatch_size=d.get("microbatch_size", 0),
            schedule=d.get("schedule", ""),
            dp_bucket_bytes=d.get("dp_bucket_bytes", DP_BUCKET_BYTES),
            causal_attention=d.get("causal_attention", True),
            causal_attention_nodes=tuple(d.get("causal_attention_nodes", ())),
            precision=d.get("precision", ""),
            sequence_parallel=d.get("sequence_parallel", False),
            tp_overlap=tuple(d.get("tp_overlap", ())),
            tp_overlap_impl=d.get("tp_overlap_impl", "symm_mem"),
            distributed_optimizer=d.get("distributed_optimizer", False),
            ep=d.get("ep", 1),
            kept_whole=tuple(KeptWhole.from_json(k) for k in d.get("kept_whole", ())),
            gathered=tuple(Gathered.from_json(g) for g in d.get("gathered", ())),
            cp=d.get("cp", 1),
            hardware=d.get("hardware", d.get("cudagraph_policy", {}).get("hardware", DEFAULT_HARDWARE)),
            etp=d.get("etp", 0),
            moe_dispatch=d.get("moe_dispatch", ""),
            moe_capacity_factor=d.get("moe_capacity_factor", 0.0),
            moe_layers=tuple(MoeLayerPlan.from_json(m) for m in d.get("moe_layers", ())),
            loss_chunk_tokens=d.get("loss_chunk_tokens", 0),
            fp8=d.get("fp8", ""),
            fp8_backend=d.get("fp8_backend", "torch"),
            fp8_linears=tuple(Fp8Linear.from_json(f) for f in d.get("fp8_linears", ())),
            fp8_all_gather=d.get("fp8_all_gather", False),
            fp8_amax_history=d.get("fp8_amax_history", DEFAULT_LENGTH),
            moe_estimate=ExpertParallelEstimate.from_json(d["moe_estimate"]) if d.get("moe_estimate") else None,
            unread=tuple(UnreadParam.from_json(u) for u in d.get("unread", ())),
            batch_mixing=d.get("batch_mixing", ""),
            batch_statistics=d.get("batch_statistics", ""),
            input_batch_dims=tuple((path, dim) for path, dim in d.get("input_batch_dims", ())),
            output_batch_dims=tuple(d.get("output_batch_dims", ())),
            requires_grad_set=tuple((name, flag) for name, flag in d.get("requires_grad_set", ())),
            branch_buffers=tuple(d.get("branch_buffers", ())),
            recompute_layers=tuple(d.get("recompute_layers", ())),
            recompute_reason=d.get("recompute_reason", ""),
        )
