"""FP8 training GEMMs: the recipes, how they scale, and ``torch._scaled_mm`` calls.

Every GEMM of a linear ``y = x·Wᵀ`` is written as ``A · Btᵀ`` with both operands stored
row-major with the contraction dim last (``canonical form``), which is also what cuBLAS
wants (``_scaled_mm``'s second operand column-major):

* forward  ``y  = x  · Wᵀ``:  A = x [M, K],   Bt = W [N, K];
* dgrad    ``dx = dy · W``:   A = dy [M, N],  Bt = Wᵀ [K, N];
* wgrad    ``dW = dyᵀ · x``:  A = dyᵀ [N, M], Bt = xᵀ [K, M].

**Scaling** (dynamic, from this step's values): an operand is cut into blocks of
``(rows, cols)`` elements (0: the whole dim), ``amax`` is the largest |value| of a
block, its scale ``s = fp8_max / max(amax, 1e-12)`` in float32 (``pow2``: rounded down
to a power of two, so that scaling is exact), the FP8 value ``clamp(v·s, ±fp8_max)``
rounded to nearest, and the GEMM multiplies by ``1/s``. A weight whose scale blocks are
symmetric (tensorwise, blockwise's 128×128) is quantized once per step: the forward
saves its FP8 copy transposed for dgrad (under ``torch.compile`` the partitioner may
recompute it in the backward instead; the values are the same).

**Recipes** (``RECIPES``), as torchao's float8 training and DeepSeek-V3 define them:

* ``tensorwise``: one scale per operand. x and W in E4M3; output gradients in E5M2 (the
  hybrid format of torchao's default and Transformer Engine: one scale for a whole
  gradient tensor has to cover its wide range, and E5M2 spans 2^-16..57344 against
  E4M3's 2^-9..448). The forward GEMM uses cuBLAS's fast accumulation, the backward not.
  The weight gradient reuses the forward's FP8 input (transposed in the forward, next to
  its cast) and the dgrad's FP8 output gradient.
* ``rowwise``: one power-of-two scale per row of each operand along its contraction dim
  (x per token, W per output feature; backward dy per token and W per input feature for
  dgrad, dy and x per feature over the tokens for wgrad). E4M3 throughout.
* ``blockwise`` (DeepSeek-V3): activations and gradients in 1×128 tiles along the
  contraction dim, weights in 128×128 blocks (the same blocks forward and dgrad). E4M3
  throughout. cuBLAS runs it on SM90 only; the CPU computes the same numbers by
  dequantizing (``torch._scaled_mm`` on the CPU has no blockwise scales).

**Tensor parallelism.** A block that spans a dim split over the tp group is reduced over
it (``ops.ALL_REDUCE_MAX`` of the amaxes, batched into one call per direction), so a
sharded operand gets the scale the whole tensor would: tp ranks compute what one rank
computes. Tiles never span a split dim: the planner keeps blockwise linears to shards
aligned to 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from autotp.ir import fp8_delayed, ops

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
TENSORWISE, ROWWISE, BLOCKWISE = "tensorwise", "rowwise", "blockwise"
DELAYED = "tensorwise-delayed"
DEFAULT_RECIPE = TENSORWISE
BLOCK = 128
EPS = 1e-12
FP8_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later."""

Block = tuple[int, int]
"""Elements per scale along (rows, cols) of a canonical operand; 0 means the whole dim."""
WHOLE: Block = (0, 0)
ROW: Block = (1, 0)
TILE: Block = (1, BLOCK)
SQUARE: Block = (BLOCK, BLOCK)


@dataclass(frozen=True)
class Recipe:
    """One FP8 training recipe: scale blocks per operand kind, FP8 formats, and the dim
    multiple that local GEMM dims need (``align``)."""

    name: str
    activation: Block
    weight: Block
    grad_dtype: torch.dtype
    pow2: bool
    align: int
    fast_accum_forward: bool
    min_capability: tuple[int, int]
    max_capability: tuple[int, int] | None = None
    delayed: bool = False  # scales from earlier steps' amaxes (``autotp.ir.fp8_delayed``)

    @property
    def whole(self) -> bool:
        """One scale per operand (tensorwise): the FP8 copies serve every GEMM, transposed."""
        return self.activation == WHOLE and self.weight == WHOLE


RECIPES: dict[str, Recipe] = {
    TENSORWISE: Recipe(TENSORWISE, WHOLE, WHOLE, E5M2, False, 16, True, FP8_MIN_CAPABILITY),
    DELAYED: Recipe(DELAYED, WHOLE, WHOLE, E5M2, False, 16, True, FP8_MIN_CAPABILITY, delayed=True),
    ROWWISE: Recipe(ROWWISE, ROW, ROW, E4M3, True, 16, True, FP8_MIN_CAPABILITY),
    BLOCKWISE: Recipe(BLOCKWISE, TILE, SQUARE, E4M3, False, BLOCK, False, (9, 0), (9, 0)),
}


# ---- scaling ------------------------------------------------------------------------


def spans_split(block: Block, rows_split: bool, cols_split: bool) -> bool:
    """Whether a block reaches across a dim that the tp group splits (its amax must be reduced)."""
    return (block[0] == 0 and rows_split) or (block[1] == 0 and cols_split)


def _grid(t: Tensor, block: Block) -> tuple[int, int, int, int]:
    """(rows per block, cols per block, row blocks, col blocks) of 2-d ``t``."""
    rows, cols = t.shape
    br, bc = block[0] or rows, block[1] or cols
    return br, bc, math.ceil(rows / br), math.ceil(cols / bc)


def _padded(t: Tensor, rows: int, cols: int) -> Tensor:
    """``t`` zero-padded to multiples of ``rows`` and ``cols`` (zeros change no amax and add
    nothing to a GEMM)."""
    pad_r, pad_c = -t.shape[0] % rows, -t.shape[1] % cols
    return F.pad(t, (0, pad_c, 0, pad_r)) if pad_r or pad_c else t


def amax(t: Tensor, block: Block, by_rows: bool = False) -> Tensor:
    """Float32 [row blocks, col blocks]: the largest |value| of each block of 2-d ``t``.
    ``by_rows``: a whole block's through each row's first (the same value), a reduction over
    the cast's own iteration space, so that inductor can compute it in the cast's kernel when
    the cast does not wait for it (delayed scaling)."""
    a = t.detach().abs()
    if block == WHOLE:
        return (a.amax(dim=1).amax() if by_rows else a.amax()).float().reshape(1, 1)
    if block == ROW:
        return a.amax(dim=1, keepdim=True).float()
    br, bc, nr, nc = _grid(t, block)
    return _padded(a, br, bc).reshape(nr, br, nc, bc).amax(dim=(1, 3)).float()


def to_scale(amax_: Tensor, dtype: torch.dtype, pow2: bool) -> Tensor:
    """``fp8_max / max(amax, 1e-12)`` in float32 (rounded down to a power of two with ``pow2``)."""
    clamped = amax_.float().clamp(min=EPS)
    scale = torch.full_like(clamped, torch.finfo(dtype).max) / clamped  # correctly rounded (a Python numerator is not)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def _by_block(t: Tensor, per_block: Tensor, block: Block, dtype: torch.dtype = torch.float32) -> Tensor:
    """``t`` times ``per_block`` [row blocks, col blocks] in ``dtype``, each value over its block."""
    t, per_block = t.to(dtype), per_block.to(dtype)
    if block in (WHOLE, ROW):
        return t * per_block
    br, bc, nr, nc = _grid(t, block)
    return (t.reshape(nr, br, nc, bc) * per_block[:, None, :, None]).reshape(t.shape)


def cast(t: Tensor, amax_: Tensor, dtype: torch.dtype, block: Block, pow2: bool, cols_multiple: int = 1) -> tuple[Tensor, Tensor]:
    """(FP8 ``t``, row-major, its columns zero-padded to whole tiles and to a multiple of
    ``cols_multiple``; its inverse scales [row blocks, col blocks], float32)."""
    scale = to_scale(amax_, dtype, pow2)
    t = _padded(t, 1, math.lcm(block[1] or 1, cols_multiple))
    limit = torch.finfo(dtype).max
    q = _by_block(t, scale, block).clamp(-limit, limit).to(dtype).contiguous()
    return q, scale.reciprocal()


# ---- the GEMM -----------------------------------------------------------------------


def _scaled_mm_blockwise_cuda(a: Tensor, sa: Tensor, bt: Tensor, sb: Tensor, b_block: Block, out_dtype: torch.dtype) -> Tensor:
    """cuBLAS's DeepSeek kernels (SM90): A in 1×128 tiles, B in 1×128 tiles or 128×128 blocks."""
    recipe_b = F.ScalingType.BlockWise128x128 if b_block == SQUARE else F.ScalingType.BlockWise1x128
    if b_block == SQUARE:  # [N/128, K/128] -> [round_up(K/128, 4), N/128], K-blocks contiguous
        k_blocks = sb.shape[1]
        sb = F.pad(sb, (0, -k_blocks % 4)).contiguous().t()
    else:  # [N, K/128] with the N dim contiguous
        sb = sb.t().contiguous().t()
    return F.scaled_mm(a, bt.t(), sa.t().contiguous().t(), F.ScalingType.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


def _dequantized(q: Tensor, inv: Tensor, block: Block, dtype: torch.dtype = torch.float32) -> Tensor:
    return _by_block(q, inv, block, dtype)


def scaled_gemm(
    a: Tensor, sa: Tensor, a_block: Block, bt: Tensor, sb: Tensor, b_block: Block, out_dtype: torch.dtype, fast_accum: bool
) -> Tensor:
    """``A · Btᵀ`` of FP8 operands in canonical form with their inverse scales."""
    if out_dtype == torch.float64:
        # a float64 model (numerics checks): FP8 values times their float32 scales are exact in
        # float64 and the sums round at 1e-16, so the order of a sum (K split over ranks, a
        # kernel's blocking) does not move a later cast across an FP8 rounding boundary
        return _dequantized(a, sa, a_block, out_dtype) @ _dequantized(bt, sb, b_block, out_dtype).t()
    if a_block == TILE:
        if a.device.type == "cuda":
            return _scaled_mm_blockwise_cuda(a, sa, bt, sb, b_block, out_dtype)
        return (_dequantized(a, sa, a_block) @ _dequantized(bt, sb, b_block).t()).to(out_dtype)
    if a_block == ROW:
        sa, sb = sa.reshape(-1, 1), sb.reshape(1, -1)
    else:
        sa, sb = sa.reshape(()), sb.reshape(())
    if a.device.type != "cuda":  # the CPU kernels scale rows only into float32 outputs
        return torch._scaled_mm(a, bt.t(), sa, sb, out_dtype=torch.float32).to(out_dtype)
    return torch._scaled_mm(a, bt.t(), sa, sb, out_dtype=out_dtype, use_fast_accum=fast_accum)


def pad_fp8_cols(q: Tensor, multiple: int) -> Tensor:
    """FP8 ``q`` with zero columns up to a multiple of ``multiple`` (through its bytes: a
    zero byte is 0.0 in both formats)."""
    if q.shape[1] % multiple == 0:
        return q
    return F.pad(q.view(torch.uint8), (0, -q.shape[1] % multiple)).view(q.dtype)


# ---- the op: autotp::fp8_linear ----------------------------------------------------

X_ROWS, X_K = 1, 2
"""Bits of ``fp8_linear``'s ``x_split``: the group splits x's token dims / its last dim (K)."""
CUDA_DIM_MULTIPLE = 16
"""cuBLAS FP8 GEMMs need the contraction dim (the tokens, for the weight gradient) a multiple of 16."""


@dataclass(frozen=True)
class Fp8Call:
    """``fp8_linear``'s arguments other than tensors: the recipe, which dims the tp group
    splits (x's token dims and K; each weight's N), and the FP8 all-gather of x, if any."""

    recipe: Recipe
    rows_split: bool
    k_split: bool
    n_split: tuple[bool, ...]
    gather_dim: int
    group_size: int
    group: str

    @property
    def gathers(self) -> bool:
        return self.gather_dim >= 0


def group_amaxes(items: list[tuple[Tensor, Block, bool, bool]], group: str, by_rows: bool = False) -> list[Tensor]:
    """The amax of each (2-d tensor, block, rows split, cols split); those spanning a split
    dim are max-reduced over ``group`` in one collective."""
    amaxes = [amax(t, block, by_rows) for t, block, _, _ in items]
    spanning = [i for i, (_, block, rows, cols) in enumerate(items) if spans_split(block, rows, cols)]
    if group and spanning:
        flat = ops.ALL_REDUCE_MAX(torch.cat([amaxes[i].reshape(-1) for i in spanning]), group)
        for i, part in zip(spanning, flat.split([amaxes[i].numel() for i in spanning])):
            amaxes[i] = part.reshape(amaxes[i].shape)
    return amaxes


def _symmetric(block: Block) -> bool:
    """A block shape whose blocks of Wᵀ are those of W transposed (its amax is reused)."""
    return block[0] == block[1]


class Fp8Linear(torch.autograd.Function):
    """``[x·Wᵢᵀ + bᵢ]`` with every GEMM (forward, dgrad, wgrad) in FP8 under ``call.recipe``;
    a delayed recipe scales from and records into ``history`` (``autotp.ir.fp8_delayed``)."""

    @staticmethod
    def forward(ctx, x: Tensor, call: Fp8Call, history: Tensor | None, *params: Tensor | None) -> tuple[Tensor, ...]:  # type: ignore[override]
        n = len(call.n_split)
        weights, biases = params[:n], params[n:]
        recipe, k = call.recipe, x.shape[-1]
        x2 = x.reshape(-1, k)
        items = [(x2, recipe.activation, call.rows_split, call.k_split)]
        items += [(w, recipe.weight, split, call.k_split) for w, split in zip(weights, call.n_split)]
        amaxes = group_amaxes(items, call.group, recipe.delayed)
        ctx.history = history
        if history is not None:
            amaxes = fp8_delayed.scales_then_record(history, list(range(n + 1)), amaxes)
        x_amax, *w_amaxes = amaxes
        x8, sx = cast(x2, x_amax, E4M3, recipe.activation, recipe.pow2)
        lead = x.shape[:-1]
        if call.gathers:  # the group's tokens travel in FP8: half the bytes of x
            full = ops.ALL_GATHER(x8.view(x.shape).view(torch.uint8), call.gather_dim, call.group_size, call.group)
            x8, lead = full.view(E4M3).reshape(-1, k), full.shape[:-1]
        outs, for_dgrad = [], []
        for w, b, w_amax in zip(weights, biases, w_amaxes):
            w8, sw = cast(w, w_amax, E4M3, recipe.weight, recipe.pow2)
            y = scaled_gemm(x8, sx, recipe.activation, w8, sw, recipe.weight, x.dtype, recipe.fast_accum_forward)
            outs.append((y if b is None else y + b).reshape(*lead, -1))
            # Wᵀ's blocks are W's transposed: its FP8 copy is this one's, made here while
            # the cast reads W (the backward reads no bf16 weight)
            for_dgrad += [w8.t().contiguous(), sw.t()] if _symmetric(recipe.weight) else [w, w_amax]
        if recipe.whole:  # wgrad's xᵀ: the FP8 x transposed, made with it
            m_multiple = CUDA_DIM_MULTIPLE if x.device.type == "cuda" else 1
            keep = (pad_fp8_cols(x8.t().contiguous(), m_multiple), sx)
        else:
            keep = (x2, sx)
        ctx.save_for_backward(*keep, *for_dgrad)
        ctx.call, ctx.x_shape, ctx.w_dtypes = call, x.shape, [w.dtype for w in weights]
        ctx.bias_grads = [b is not None and b.requires_grad for b in biases]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        call: Fp8Call = ctx.call
        recipe, n = call.recipe, len(call.n_split)
        xs, sx, *for_dgrad = ctx.saved_tensors
        act, gdt, tensorwise = recipe.activation, recipe.grad_dtype, recipe.whole
        rows_split = call.rows_split and not call.gathers  # a gathered x holds every token
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return (None,) * (3 + 2 * n)
        dys = {i: grads[i].reshape(-1, grads[i].shape[-1]) for i in present}
        # Every amax the backward needs, reduced in one call: per output, dy (dgrad A), Wᵀ
        # (dgrad Bt, unless its blocks are W's) and dyᵀ (wgrad A); then xᵀ (wgrad Bt).
        # Tensorwise reuses the FP8 dy and x for the weight gradient (same single scale).
        items: list[tuple[Tensor, Block, bool, bool]] = []
        for i in present:
            items.append((dys[i], act, rows_split, call.n_split[i]))
            if not _symmetric(recipe.weight):
                items.append((for_dgrad[2 * i].t(), recipe.weight, call.k_split, call.n_split[i]))
            if not tensorwise:
                items.append((dys[i].t(), act, call.n_split[i], rows_split))
        if not tensorwise:
            items.append((xs.t(), act, call.k_split, rows_split))
        amaxes = group_amaxes(items, call.group, recipe.delayed)
        if ctx.history is not None:  # tensorwise: one amax per output gradient
            amaxes = fp8_delayed.scales_then_record(ctx.history, [1 + n + i for i in present], amaxes)
        m_multiple = CUDA_DIM_MULTIPLE if xs.device.type == "cuda" else 1
        if tensorwise:
            xt8, sxt = xs, sx
        else:
            xt8, sxt = cast(xs.t(), amaxes.pop(), E4M3, act, recipe.pow2, m_multiple)
        taken = iter(amaxes)
        dx: Tensor | None = None
        grad_w: list[Tensor | None] = [None] * n
        grad_b: list[Tensor | None] = [None] * n
        for i in present:
            dy = dys[i]
            dy8, sdy = cast(dy, next(taken), gdt, act, recipe.pow2)
            if _symmetric(recipe.weight):
                wt8, swt = for_dgrad[2 * i], for_dgrad[2 * i + 1]
            else:
                wt8, swt = cast(for_dgrad[2 * i].t(), next(taken), E4M3, recipe.weight, recipe.pow2)
            part = scaled_gemm(dy8, sdy, act, wt8, swt, recipe.weight, dy.dtype, False)
            dx = part if dx is None else dx + part
            if tensorwise:
                dyt8, sdyt = pad_fp8_cols(dy8.t().contiguous(), m_multiple), sdy
            else:
                dyt8, sdyt = cast(dy.t(), next(taken), gdt, act, recipe.pow2, m_multiple)
            grad_w[i] = scaled_gemm(dyt8, sdyt, act, xt8, sxt, act, ctx.w_dtypes[i], False)
            if ctx.bias_grads[i]:
                grad_b[i] = dy.sum(0)
        lead = list(ctx.x_shape[:-1])
        if call.gathers:  # the grad of the gathered tokens goes back to their ranks, summed
            lead[call.gather_dim] *= call.group_size
            dx = ops.REDUCE_SCATTER(dx.reshape(*lead, -1), call.gather_dim, call.group_size, call.group)
        return (dx.reshape(ctx.x_shape), None, None, *grad_w, *grad_b)


def reduced_amaxes(call: Fp8Call, m: int, k: int, ns: list[int]) -> tuple[int, int]:
    """How many amax values one call max-reduces over its group, forward and backward, for
    ``m`` local tokens, K = ``k`` and the weights' N (the cost model's count of what
    ``Fp8Linear`` reduces)."""

    def count(rows: int, cols: int, block: Block, rows_split: bool, cols_split: bool) -> int:
        if not spans_split(block, rows_split, cols_split):
            return 0
        return math.ceil(rows / (block[0] or rows)) * math.ceil(cols / (block[1] or cols))

    r = call.recipe
    act, tensorwise = r.activation, r.whole
    forward = count(m, k, act, call.rows_split, call.k_split)
    forward += sum(count(n, k, r.weight, split, call.k_split) for n, split in zip(ns, call.n_split))
    rows = call.rows_split and not call.gathers
    m_all = m * call.group_size if call.gathers else m
    backward = 0 if tensorwise else count(k, m_all, act, call.k_split, rows)
    for n, split in zip(ns, call.n_split):
        backward += count(m_all, n, act, rows, split)
        backward += 0 if _symmetric(r.weight) else count(k, n, r.weight, call.k_split, split)
        backward += 0 if tensorwise else count(n, m_all, act, split, rows)
    return forward, backward


def call_of(recipe: str, x_split: int, n_split: list[int], gather_dim: int, group_size: int, group: str) -> Fp8Call:
    return Fp8Call(RECIPES[recipe], bool(x_split & X_ROWS), bool(x_split & X_K), tuple(bool(s) for s in n_split),
                   gather_dim, group_size, group)  # fmt: skip


def fp8_linear(
    x: Tensor, weights: list[Tensor], biases: list[Tensor | None], recipe: str, x_split: int, n_split: list[int],
    gather_dim: int, group_size: int, group: str, history: Tensor | None = None,
) -> list[Tensor]:  # fmt: skip
    """``autotp::fp8_linear``'s composite kernel (``autotp.runtime.processes.collectives`` registers it)."""
    call = call_of(recipe, x_split, n_split, gather_dim, group_size, group)
    assert not call.gathers or call.recipe.name == TENSORWISE, "only tensorwise scales survive an FP8 all-gather whole"
    assert (history is not None) == call.recipe.delayed, f"{recipe}: an amax history goes with a delayed recipe"
    return list(Fp8Linear.apply(x, call, history, *weights, *biases))
