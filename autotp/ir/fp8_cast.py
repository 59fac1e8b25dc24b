"""One-pass FP8 cast for delayed scaling: ``autotp::fp8_cast_transpose``.

Delayed scaling (``autotp.ir.fp8_delayed``) scales an operand by earlier steps' amaxes, so
its cast need not wait for this step's amax. This op makes, from a 2-d ``t`` [M, N] and the
window's amax ``window`` [1, 1] (0: an empty column), in one read of ``t``:

* ``q``  [M, N]: ``clamp(t·s, ±fp8_max)`` rounded to ``dtype``, ``s = fp8.to_scale(used)``,
  ``used = window`` if ``window > 0`` else this step's amax (the seeding of an empty column);
* ``qt`` [N, Mp]: ``q`` transposed, its columns zero-padded to ``Mp``, a multiple of
  ``cols_multiple`` (the weight gradient's operands in canonical form);
* ``inv`` [1, 1]: ``1 / s``, the scale the GEMMs multiply by;
* ``amax`` [1, 1]: this step's largest |value| of ``t``, float32, for the history.

The values are ``fp8.cast``'s, ``pad_fp8_cols(q.t())``'s and ``fp8.amax``'s, and every
device has that composition as its kernel (``reference``). On CUDA with Triton it is two
Triton kernels: one tiled pass that loads a tile, records its max with an atomic, scales,
rounds and writes the tile and its transpose (the transpose goes through shared memory so
that both stores are coalesced), and, before it, a seeding pass that reads ``t`` only where
``window`` is 0 (a grid of a few programs whose loop runs zero times otherwise).

Why an op of our own: under inductor the cast that writes the transposed copy is a 2-d
tiled pointwise kernel, and the amax (a reduction) did not join it: the output gradients of
a SwiGLU's projections were read twice, once for the amax and once for the cast. As a
Triton kernel registered with ``torch.library.triton_op`` the op stays one kernel under
``torch.compile``; its launch is a graph node that the partitioner does not recompute, so
the FP8 copies the backward reads are saved, not recast from the bf16 producer.
``FUSED`` switches the op on (else ``fp8.Fp8Linear`` casts through ``fp8.cast``), to
measure one against the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from autotp.ir import fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU machines: the op runs its reference composition
    triton = None

FUSED = False
"""Whether ``fp8.Fp8Linear`` casts delayed-scaled operands through this op (read when the op
is traced: a compiled graph keeps the choice it was traced with). Off until the whole 8B
step has been timed with it (docs/results.md, eighth run: the kernels equal the reference
on an H200 and are 1.2-1.3x faster than inductor's cast at the MLP's shapes; the compiled
model's run failed on the float64 ``limit`` fixed since)."""


@contextlib.contextmanager
def fused(on: bool) -> Iterator[None]:
    """``FUSED`` set to ``on`` inside the block (to run or compile the one and the other)."""
    global FUSED
    saved, FUSED = FUSED, on
    try:
        yield
    finally:
        FUSED = saved


def used_amax(t: Tensor, window: Tensor) -> Tensor:
    """The amax the cast scales by: the window's, or this step's where the window is empty."""
    return torch.where(window > 0, window, fp8.amax(t, fp8.WHOLE))


def reference(t: Tensor, window: Tensor, dtype: torch.dtype, cols_multiple: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's values as aten ops (every device's kernel without Triton; the tests' reference)."""
    q, inv = fp8.cast(t, used_amax(t, window), dtype, fp8.WHOLE, False)
    return q, fp8.pad_fp8_cols(q.t().contiguous(), cols_multiple), inv, fp8.amax(t, fp8.WHOLE)


def _padded_rows(m: int, multiple: int) -> int:
    return -(-m // multiple) * multiple


if triton is not None:

    @triton.jit
    def _seed_amax_kernel(t_ptr, window_ptr, amax_ptr, M, N, stride_m, stride_n, rounds, BM: tl.constexpr, BN: tl.constexpr):
        """``amax_ptr[0]`` = max |t| where ``window`` is 0; no load of ``t`` otherwise. Program
        p takes tiles p, p + programs, ... (``rounds`` of them at most)."""
        if tl.load(window_ptr) > 0:
            return
        tiles_n = tl.cdiv(N, BN)
        for r in range(rounds):
            tile = tl.program_id(0) + r * tl.num_programs(0)
            rm = (tile // tiles_n) * BM + tl.arange(0, BM)
            rn = (tile % tiles_n) * BN + tl.arange(0, BN)
            mask = (rm[:, None] < M) & (rn[None, :] < N)  # a tile past the last: rm >= M
            v = tl.load(t_ptr + rm[:, None] * stride_m + rn[None, :] * stride_n, mask=mask, other=0.0)
            tl.atomic_max(amax_ptr, tl.max(tl.abs(v.to(tl.float32))))

    @triton.autotune(
        configs=[
            triton.Config({"BM": 64, "BN": 64}, num_warps=4),
            triton.Config({"BM": 128, "BN": 64}, num_warps=4),
            triton.Config({"BM": 64, "BN": 128}, num_warps=4),
            triton.Config({"BM": 128, "BN": 128}, num_warps=8),
        ],
        key=["M", "N"],
    )
    @triton.jit
    def _cast_transpose_kernel(
        t_ptr, window_ptr, seed_ptr, q_ptr, qt_ptr, inv_ptr, amax_ptr, M, N, Mp, stride_m, stride_n, limit,
        BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        # ``limit``: fp8_max, a scalar argument (float32 from Triton's launcher, float64 from
        # inductor's), cast to float32: the correctly rounded divisions (``fp8.to_scale``'s and
        # ``reciprocal``'s) take float32 tensors, and the clamp must stay in float32
        limit = tl.cast(limit, tl.float32)
        window = tl.load(window_ptr)
        used = tl.where(window > 0, window, tl.load(seed_ptr))
        scale = tl.math.div_rn(limit, tl.maximum(used, 1e-12))
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(inv_ptr, tl.math.div_rn(limit * 0.0 + 1.0, scale))
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)  # rows M..Mp: zeros, the padding of qt
        v = tl.load(t_ptr + rm[:, None] * stride_m + rn[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
        tl.atomic_max(amax_ptr, tl.max(tl.abs(v)))
        q = tl.minimum(tl.maximum(v * scale, -limit), limit).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        tl.store(qt_ptr + rn[:, None] * Mp + rm[None, :], tl.trans(q), mask=(rn[:, None] < N) & (rm[None, :] < Mp))

    SEED_PROGRAMS = 264
    """Programs of the seeding pass (two per SM of an H100/H200; a loop over the tiles each)."""

    @torch.library.triton_op("autotp::fp8_cast_transpose", mutates_args=())
    def fp8_cast_transpose(t: Tensor, window: Tensor, dtype: torch.dtype, cols_multiple: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if t.device.type != "cuda":
            return reference(t, window, dtype, cols_multiple)
        m, n = t.shape
        mp = _padded_rows(m, cols_multiple)
        q = torch.empty(m, n, dtype=dtype, device=t.device)
        qt = torch.empty(n, mp, dtype=dtype, device=t.device)
        inv = torch.empty(1, 1, dtype=torch.float32, device=t.device)
        amax_ = torch.zeros(1, 1, dtype=torch.float32, device=t.device)  # atomics' targets
        seed = torch.zeros(1, dtype=torch.float32, device=t.device)
        tiles = triton.cdiv(m, 64) * triton.cdiv(n, 64)
        programs = min(tiles, SEED_PROGRAMS)
        torch.library.wrap_triton(_seed_amax_kernel)[(programs,)](
            t, window, seed, m, n, t.stride(0), t.stride(1), triton.cdiv(tiles, programs), BM=64, BN=64)  # fmt: skip

        def grid(meta):
            return (triton.cdiv(mp, meta["BM"]), triton.cdiv(n, meta["BN"]))

        torch.library.wrap_triton(_cast_transpose_kernel)[grid](
            t, window, seed, q, qt, inv, amax_, m, n, mp, t.stride(0), t.stride(1), torch.finfo(dtype).max)  # fmt: skip
        return q, qt, inv, amax_

else:

    @torch.library.custom_op("autotp::fp8_cast_transpose", mutates_args=())
    def fp8_cast_transpose(t: Tensor, window: Tensor, dtype: torch.dtype, cols_multiple: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return reference(t, window, dtype, cols_multiple)

    @fp8_cast_transpose.register_fake
    def _(t: Tensor, window: Tensor, dtype: torch.dtype, cols_multiple: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        m, n = t.shape
        scalar = t.new_empty(1, 1, dtype=torch.float32)
        return t.new_empty(m, n, dtype=dtype), t.new_empty(n, _padded_rows(m, cols_multiple), dtype=dtype), scalar, scalar.clone()


CAST_TRANSPOSE = torch.ops.autotp.fp8_cast_transpose.default
