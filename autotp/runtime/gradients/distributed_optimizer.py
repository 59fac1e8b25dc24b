"""``DistributedOptimizer``: ZeRO-1 over the data-parallel group, Megatron's distributed optimizer (seed 004).

Gradients live in contiguous buffers and are reduce-scattered over dp in buckets while
the backward runs (``autotp.runtime.gradients.grad_buffers``). Each dp rank owns a 1/dp slice of
every bucket; for each parameter that slice covers a flat range ``[start, stop)`` of the
parameter (this rank's tp shard, flattened), and only for those ranges does the rank keep
an fp32 master copy (the parameter's own memory when it is fp32) and the optimizer
state. ``step`` runs a plain torch optimizer on those ranges, writes them back into the
parameter buffer and all-gathers the parameters. Only elementwise optimizers can be
sliced like this (``SUPPORTED``).

**Overlap with the next forward** (``overlap_param_gather``, on by default for eager
graphs): ``step`` launches the all-gathers and returns; the next forward waits for each
bucket right before its first read (``GradBuffers.insert_waits``). ``torch.compile`` and
CUDA graphs would capture that wait inside a compiled region, so there ``step`` waits
for the all-gathers itself. Reading the parameters directly between ``step`` and the
next forward needs ``finish_param_gather()`` first; autotp's own readers (state dicts,
checkpoints, unsharding) call it.

**State dict** (``state_dict``), per rank, keyed by the original parameter names:
``{"format", "dp", "dp_rank", "optimizer", "param_groups": [{hyperparameters,
"params": [names]}], "state": {name: {"shape": local shape, "start", "stop",
"master" (fp32, only for 16-bit params), <optimizer state tensors of the range>}}}``.
Ranges are into the flattened tp shard, so a checkpoint writer can place every dp
rank's piece in the full tensor (``autotp.ir.plan.ParamLayout`` gives the tp shard's place).

**DCP checkpoints** (``pm.save_checkpoint(dir, optimizer=opt)``, ``checkpoint_state``):
each range goes to DCP as the global chunks it covers (``shard_map.FlatRangeLocal``),
under the keys a plain torch optimizer's state has there (``optim.<name>.<state key>``,
global shape) plus ``optim.<name>.master`` for 16-bit parameters' fp32 master weights.
So a checkpoint loads at any (tp, pp, dp), into a DistributedOptimizer or into the same
torch optimizer class stepping ``pm.parameters()``, and the other way round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from autotp.ir.rank_log import warn_once
from autotp.ir.errors import UserInputError
from autotp.ir.training_step import TrainingStep, runtime_precision
from autotp.runtime.state import expert_parallel
from autotp.runtime.gradients import grad_norm
from autotp.runtime.gradients.grad_buffers import GradBuffers, Slot
from autotp.runtime.state.shard_map import FlatRangeLocal, ShardSpec

if TYPE_CHECKING:
    from autotp.runtime.execution.parallel_model import ParallelModel

log = logging.getLogger(__name__)

FORMAT = "autotp.DistributedOptimizer/1"
SUPPORTED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
)  # fmt: skip


@dataclass
class _Piece:
    """This rank's range of one parameter, and the tensor the inner optimizer steps."""

    slot: Slot
    start: int
    stop: int
    master: nn.Parameter  # fp32; a view of the parameter itself when that is fp32

    @property
    def name(self) -> str:
        return self.slot.use.name

    @property
    def separate(self) -> bool:
        return self.slot.use.param.dtype != torch.float32

    def param_range(self) -> Tensor:
        return self.slot.use.param.data.view(-1)[self.start : self.stop]

    def grad_range(self) -> Tensor:
        return self.slot.grad.view(-1)[self.start : self.stop]


class DistributedOptimizer:
    """ZeRO-1 over dp for a ``ParallelModel``: ``DistributedOptimizer(pm, torch.optim.AdamW, lr=..., weight_decay=...)``.

    ``params``: parameters of ``pm`` or param-group dicts (default: every trainable
    parameter); each trainable parameter must be in exactly one group. ``bucket_bytes``:
    gradient bytes per reduce-scatter (default ``pm.plan.dp_bucket_bytes``).
    ``grad_dtype``: the gradient buffer's dtype for 16-bit parameters (fp32 main grads by
    default; ``torch.bfloat16`` keeps bf16 grads and steps on an fp32 copy of the slice).
    Create it before the first ``train_step``; then ``train_step``, ``clip_grad_norm_``,
    ``step``, ``zero_grad``. ``self.optimizer`` is the inner torch optimizer (give it
    to an LR scheduler). ``overlap_param_gather``: hide the parameters' all-gather behind
    the next forward (module docstring; default: on unless the graphs are compiled or
    captured as CUDA graphs, where it is refused).
    """

    def __init__(self, pm: ParallelModel, optimizer_class: type[torch.optim.Optimizer], *, params: Any = None,
                 bucket_bytes: int | None = None, grad_dtype: torch.dtype = torch.float32,
                 overlap_param_gather: bool | None = None, **kwargs: Any) -> None:  # fmt: skip
        from autotp.runtime.execution.parallel_model import ZBH1_REFUSED, ParallelModel

        if not isinstance(pm, ParallelModel):
            raise UserInputError(f"DistributedOptimizer needs the ParallelModel that autotp.parallelize returned, got {type(pm).__name__}")
        if optimizer_class not in SUPPORTED:
            raise UserInputError(
                f"{getattr(optimizer_class, '__name__', optimizer_class)} cannot be sharded over dp: each dp rank steps "
                "its own 1/dp of the flattened parameters, which only elementwise torch optimizers allow; use one of "
                f"{', '.join(c.__name__ for c in SUPPORTED)} (subclasses are refused: they may not be elementwise)"
            )
        if pm.grad_sync.holds_grads:
            raise UserInputError("this ParallelModel already has a DistributedOptimizer; create one per model")
        if pm.cudagraph_slots:
            raise UserInputError("create the DistributedOptimizer before the first call of pm: CUDA graphs were captured "
                             "with the parameters where they are now, and the optimizer moves them into its buffers")
        plan, coords = pm.plan, pm.coords
        if plan.pp > 1 and plan.schedule_name == "zbh1":
            raise UserInputError(ZBH1_REFUSED)
        captured = "torch.compile" if pm.compile_graphs else "CUDA graphs" if plan.cudagraphs else None
        if overlap_param_gather and captured:
            raise UserInputError(f"overlap_param_gather=True waits for the all-gather inside the forward graph, which "
                                 f"{captured} would capture; pass overlap_param_gather=False (or leave it unset)")
        overlap = captured is None if overlap_param_gather is None else overlap_param_gather
        self._pm = pm
        groups = self._groups(pm, params)
        names = [n for g in groups for n in g["params"]]
        shared = {n: g for n, g in pm.shared_param_groups.items() if n in names}
        buffer_kw = dict(bucket_bytes=bucket_bytes or plan.dp_bucket_bytes, grad_dtype=grad_dtype, shared_groups=shared, overlap=overlap)
        if coords.experts is None:
            self.buffers = GradBuffers(pm.param_uses(names), plan.dp, coords.dp_rank, coords.dp_group, **buffer_kw)
        else:
            self.buffers = expert_parallel.grad_buffers(pm.param_uses(names), plan, coords.dp_rank, coords.dp_group,
                                                        coords.experts, pm.shard_map.experts, **buffer_kw)  # fmt: skip
        pm.install_grad_sync(self.buffers)
        self._pieces: dict[str, _Piece] = {}
        for slot, start, stop in self.buffers.shard_pieces():
            flat = slot.use.param.data.view(-1)[start:stop]
            master = nn.Parameter(flat if flat.dtype == torch.float32 else flat.float())
            self._pieces[slot.use.name] = _Piece(slot, start, stop, master)
        inner = [dict(g, params=[self._pieces[n].master for n in g["params"] if n in self._pieces]) for g in groups]
        self.optimizer = optimizer_class(inner, **kwargs)
        self._group_names = [[n for n in g["params"] if n in self._pieces] for g in groups]
        self._counting = pm.norm_counting(dp_rank=None)
        self._prepared = -1
        some = next(iter(self.buffers.slots.values()), None)
        master = some is not None and some.use.param.dtype != torch.float32
        self.step_definition = TrainingStep(
            runtime_precision(some.use.param.element_size() if some else 4, some.grad.element_size() if some else 4, master),
            distributed_optimizer=True,
        )
        if plan.dp == 1:
            warn_once(log, "DistributedOptimizer with dp=1 shards nothing: it saves no memory over a plain optimizer")
        if plan.precision and plan.precision != self.step_definition.precision:
            warn_once(log, "the plan assumed precision %s, this optimizer runs %s", plan.precision, self.step_definition.describe())

    @staticmethod
    def _groups(pm: ParallelModel, params: Any) -> list[dict[str, Any]]:
        """Param groups of parameter names; ValueError for tensors not in ``pm`` or trainable ones left out.
        Parameters the traced forward never reads (``plan.unread``) get no grad and are left out, so
        that they stay as they are, as a torch optimizer leaves a parameter without grad."""
        named = {id(p): n for n, p in pm.named_parameters()}
        unread = {u.name for u in pm.plan.unread}
        trainable = [n for n, p in pm.named_parameters() if p.requires_grad and n not in unread]
        if params is None:
            return [{"params": trainable}]
        given = list(params)
        raw = given if given and isinstance(given[0], dict) else [{"params": given}]
        groups, seen = [], set()
        for g, group in enumerate(raw):
            tensors = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
            names = []
            for i, t in enumerate(tensors):
                name = named.get(id(t))
                if name is None:
                    raise UserInputError(
                        f"tensor {i} of param group {g} (shape {tuple(t.shape)}, {t.dtype}) is not a parameter of this "
                        "ParallelModel (the model before parallelize is not trained); pass pm.parameters() or a subset"
                    )
                if name in seen:
                    raise UserInputError(f"{name} is in two param groups; put each parameter in one")
                seen.add(name)
                if name not in unread:
                    names.append(name)
            groups.append(dict(group, params=names))
        missing = [n for n in trainable if n not in seen]
        if missing:
            raise UserInputError(
                f"{missing[0]} (and {len(missing) - 1} more) require grad but are in no param group; add them, or "
                f"freeze them with pm.get_parameter('{missing[0]}').requires_grad_(False) before creating the optimizer"
            )
        return groups

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _prepare_grads(self) -> None:
        """Reduce-scatter (if ``train_step`` did not) and point the masters' grads at this rank's slices."""
        self.buffers.finish()
        if self._prepared == self.buffers.generation:
            return
        for piece in self._pieces.values():
            g = piece.grad_range()
            piece.master.grad = g if g.dtype == torch.float32 else g.float()
        self._prepared = self.buffers.generation

    def clip_grad_norm_(self, max_norm: float, error_if_nonfinite: bool = False) -> Tensor:
        """Clip by the global L2 norm (each parameter counted once over tp, pp and dp); returns the norm."""
        self._prepare_grads()
        parts = []
        for name, piece in self._pieces.items():
            g = piece.master.grad
            mask = self._counting.mask(name, tuple(piece.slot.use.param.shape), g.device)
            if mask is True:
                parts.append(g)
            elif mask is not False:
                parts.append(g[mask[piece.start : piece.stop]])
        norm = grad_norm.global_norm(grad_norm.sum_of_squares(parts, self._pm.device), error_if_nonfinite)
        grad_norm.clip_([p.master.grad for p in self._pieces.values()], norm, max_norm)
        return norm

    @torch.no_grad()
    def step(self) -> None:
        """Step this rank's slices, write them into the parameters, all-gather the parameters over dp
        (left in flight for the next forward with ``overlap_param_gather``)."""
        self.finish_param_gather()
        self._prepare_grads()
        self.optimizer.step()
        for piece in self._pieces.values():
            if piece.separate:
                piece.param_range().copy_(piece.master)
        self.buffers.gather_params()

    def finish_param_gather(self) -> None:
        """Wait for the parameters' all-gather of the last ``step``: read parameters directly only after it."""
        self.buffers.wait_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (``set_to_none`` is accepted for torch's signature; the buffers stay)."""
        del set_to_none
        self._pm.zero_grad()

    def state_bytes(self) -> int:
        """Bytes of optimizer state and separate master weights that this rank keeps."""
        total = sum(p.master.numel() * 4 for p in self._pieces.values() if p.separate)
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor) and v.dim())
        return total

    # ---- checkpoints ---------------------------------------------------------------

    def checkpoint_state(self, specs: dict[str, ShardSpec], mine: set[str], init: bool = False) -> dict[str, dict[str, Any]]:
        """This rank's ranges of the parameters in ``mine``, as DCP chunks of the global tensors
        (module docstring); ``init``: create the state first (for DCP to load into)."""
        self.finish_param_gather()
        if init:
            self._init_state()
        out: dict[str, dict[str, Any]] = {}
        for name, piece in self._pieces.items():
            if name not in mine:
                continue
            state = dict(self.optimizer.state.get(piece.master, {}))
            if piece.separate:
                state["master"] = piece.master.detach()
            out[name] = {
                k: FlatRangeLocal.wrap(v, specs[name], piece.start, piece.stop)
                if isinstance(v, Tensor) and v.shape == piece.master.shape else v
                for k, v in state.items()
            }  # fmt: skip
        return out

    def _init_state(self) -> None:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        grads = [p.master.grad for p in self._pieces.values()]
        for p in self._pieces.values():
            p.master.grad = None
        _init_optim_state(self.optimizer)
        for p, g in zip(self._pieces.values(), grads):
            p.master.grad = g

    @torch.no_grad()
    def loaded_checkpoint(self, state: dict[str, dict[str, Any]], param_groups: list[dict[str, Any]]) -> None:
        """Finish a DCP load into ``checkpoint_state``'s tensors: non-tensor values, hyperparameters,
        masters (from the checkpoint's, else from the loaded parameters); parameters without
        state in the checkpoint start fresh."""
        for name, piece in self._pieces.items():
            entry = state.get(name)
            if piece.separate:
                if entry is None or "master" not in entry:
                    piece.master.copy_(piece.param_range())
                else:
                    piece.param_range().copy_(piece.master)
            if not entry or set(entry) <= {"master"}:
                self.optimizer.state.pop(piece.master, None)
                continue
            for k, v in entry.items():
                if not isinstance(v, Tensor) and k != "master":
                    self.optimizer.state[piece.master][k] = v
        for group, saved in zip(self.optimizer.param_groups, param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def state_dict(self) -> dict[str, Any]:
        """This rank's slices, by parameter name (layout in the module docstring)."""
        self.finish_param_gather()
        groups = []
        for names, group in zip(self._group_names, self.optimizer.param_groups):
            groups.append({k: v for k, v in group.items() if k != "params"} | {"params": list(names)})
        state: dict[str, dict[str, Any]] = {}
        for name, piece in self._pieces.items():
            entry: dict[str, Any] = {"shape": tuple(piece.slot.use.param.shape), "start": piece.start, "stop": piece.stop}
            if piece.separate:
                entry["master"] = piece.master.detach().clone()
            for k, v in self.optimizer.state.get(piece.master, {}).items():
                entry[k] = v.detach().clone() if isinstance(v, Tensor) else v
            state[name] = entry
        plan, coords = self._pm.plan, self._pm.coords
        return {"format": FORMAT, "dp": plan.dp, "dp_rank": coords.dp_rank, "optimizer": type(self.optimizer).__name__,
                "param_groups": groups, "state": state}  # fmt: skip

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned on the same rank of the same layout; ValueError otherwise."""
        self.finish_param_gather()
        if sd.get("format") != FORMAT:
            raise UserInputError(f"not a DistributedOptimizer state dict (format {sd.get('format')!r}, expected {FORMAT!r})")
        dp = self._pm.plan.dp
        if sd["dp"] != dp:
            raise UserInputError(
                f"this optimizer state was saved with dp={sd['dp']} and this run has dp={dp}: each dp rank holds "
                f"different slices, so it cannot be loaded rank by rank; resume with dp={sd['dp']}, or load through a "
                "checkpoint that reshards (pm.load_checkpoint)"
            )
        if sd["optimizer"] != type(self.optimizer).__name__:
            raise UserInputError(f"the state is of {sd['optimizer']}, this optimizer steps with {type(self.optimizer).__name__}")
        if sd["dp_rank"] != self._pm.coords.dp_rank:
            raise UserInputError(f"the state was saved by dp rank {sd['dp_rank']}; this is dp rank {self._pm.coords.dp_rank}")
        if set(sd["state"]) != set(self._pieces) or len(sd["param_groups"]) != len(self.optimizer.param_groups):
            extra = sorted(set(sd["state"]) ^ set(self._pieces))[:3]
            raise UserInputError(f"the state's parameters or groups differ from this optimizer's (e.g. {extra}); load it into the same model")
        for name, piece in self._pieces.items():
            entry = sd["state"][name]
            if (entry["start"], entry["stop"]) != (piece.start, piece.stop):
                raise UserInputError(
                    f"{name}: the state covers elements [{entry['start']}, {entry['stop']}) and this rank owns "
                    f"[{piece.start}, {piece.stop}): the buckets differ (another bucket_bytes or model); use the same ones"
                )
            if "master" in entry:
                piece.master.copy_(entry["master"])
                piece.param_range().copy_(piece.master)
            keys = {"shape", "start", "stop", "master"}
            self.optimizer.state[piece.master] = {
                k: (v.clone() if k == "step" else v.to(piece.master.device, copy=True)) if isinstance(v, Tensor) else v
                for k, v in entry.items() if k not in keys
            }  # fmt: skip
        for group, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.buffers.gather_params()
