"""What one training step keeps per parameter: the definition the planner and the runtime share.

A step is a precision and whether the optimizer is sharded over the data-parallel
group (``autotp.DistributedOptimizer``, ZeRO-1, Megatron's distributed optimizer).
Bytes per parameter follow Megatron's table, with d the data-parallel size:

=====================  =====================================================  =======  ==========
precision               what the step keeps                                    plain    distributed
=====================  =====================================================  =======  ==========
``fp32``                fp32 params and grads, fp32 Adam state                 16       8 + 8/d
``bf16-fp32-grads``     bf16 params, fp32 main grads, fp32 master + Adam       18       6 + 12/d
``bf16``                bf16 params and grads, fp32 main grad copy, master,    20       4 + 16/d
                        Adam
``bf16-pure``           bf16 params and grads, bf16 Adam state (no master)     8        4 + 4/d
=====================  =====================================================  =======  ==========

The replicated part is the param and its grad; the sharded part is what the
optimizer keeps for its slice (master weights, the fp32 copy of a bf16 grad, Adam's two
moments). Which runtime runs which step:

* ``torch.optim.*`` on ``pm.parameters()``: ``fp32`` (fp32 model) or ``bf16-pure``
  (bf16 model), not sharded; grads are all-reduced over dp.
* ``autotp.DistributedOptimizer``: ``fp32`` (fp32 model), ``bf16-fp32-grads`` (bf16
  model, the default) or ``bf16`` (bf16 model, ``grad_dtype=torch.bfloat16``), sharded;
  grads are reduce-scattered over dp and the params all-gathered after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotp.ir.errors import UserInputError


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of state (0: not kept)."""

    param: int
    grad: int
    master: int  # fp32 master weights (0 where the param itself is fp32, or no master)
    grad_copy: int  # fp32 copy of a 16-bit grad that the optimizer steps on
    optimizer_state: int  # Adam's two moments
    description: str

    @property
    def sharded(self) -> int:
        """What the distributed optimizer keeps for its 1/d slice only."""
        return self.master + self.grad_copy + self.optimizer_state


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(4, 4, 0, 0, 8, "fp32 params, grads and Adam state"),
    "bf16-fp32-grads": Precision(2, 4, 4, 0, 8, "bf16 params, fp32 main grads, fp32 master weights and Adam state"),
    "bf16": Precision(2, 2, 4, 4, 8, "bf16 params and grads, fp32 master weights and Adam state"),
    "bf16-pure": Precision(2, 2, 0, 0, 4, "bf16 params, grads and Adam state, no master weights"),
}


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise UserInputError(f"unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class TrainingStep:
    """A precision (a key of ``PRECISIONS``) and whether the optimizer state is sharded over dp."""

    precision: str
    distributed_optimizer: bool

    def bytes_per_param(self, dp: int) -> float:
        p = precision(self.precision)
        return p.param + p.grad + (p.sharded / dp if self.distributed_optimizer else p.sharded)

    def describe(self) -> str:
        """The precision and the bytes it keeps per parameter, e.g. ``bf16-pure (...): 8 bytes per
        parameter (2 param, 2 grad, 4 Adam state), optimizer state on every dp rank``."""
        p = precision(self.precision)
        parts = ((p.master, "fp32 master"), (p.grad_copy, "fp32 grad copy"), (p.optimizer_state, "Adam state"))
        state = " + ".join(f"{n} {what}" for n, what in parts if n)
        if self.distributed_optimizer:
            return (f"{self.precision} ({p.description}): {p.param + p.grad} + {p.sharded}/dp bytes per parameter "
                    f"({p.param} param, {p.grad} grad, {state} sharded over dp: autotp.DistributedOptimizer)")
        return (f"{self.precision} ({p.description}): {p.param + p.grad + p.sharded} bytes per parameter "
                f"({p.param} param, {p.grad} grad, {state}), optimizer state on every dp rank")


def runtime_precision(param_bytes: int, grad_bytes: int, master: bool) -> str:
    """The ``PRECISIONS`` key of a runtime step: param and grad element sizes, fp32 master weights kept or not."""
    if param_bytes == 4:
        return "fp32"
    if not master:
        return "bf16-pure"
    return "bf16-fp32-grads" if grad_bytes == 4 else "bf16"
