"""How many tokens the fused lm_head + cross entropy runs at a time (``plan.loss_chunk_tokens``).

``passes/fused_linear_cross_entropy`` replaces ``linear`` -> (cast) -> ``cross_entropy_loss``
by one op that computes ``chunk`` tokens' logits at a time, both gradients included
(``autotp.ir.fused_loss``). Against the unfused loss, with N tokens, a rank's V_l
vocabulary columns, hidden size H and 16-bit weights:

* **Memory.** Unfused, a microbatch holds its logits (N·V_l·2 bytes), their float32 copy and,
  backward, the float32 gradient: about N·V_l·10 bytes at the loss (5.2 GB at Llama-3's 128k
  vocabulary and 4096 tokens). Fused: one chunk, c·V_l·4 bytes of logits and gradient, plus
  the two gradients it computes ahead (N·H·2 + V_l·H·2 bytes), which the backward allocates anyway.
* **Time.** The same three GEMMs (2·N·H·V_l FLOPs each), all in the op's forward, and its
  float32 loss passes after each chunk's logits GEMM, on the same stream (they add to the
  GEMMs, they do not hide behind them): ``loss_bytes_per_logit`` bytes per logit, counted
  from ``autotp.ir.fused_loss``; under ``compile=True`` inductor fuses each chunk's elementwise
  work (the op traces through to its ``autograd.Function``), ``compiled_loss_bytes_per_logit``. Each chunk's weight-gradient GEMM adds its result to the running sum
  (V_l·H·2 bytes read and written per chunk), so chunks are as large as
  ``LOSS_CHUNK_BYTES`` of float32 logits allows: c = ``LOSS_CHUNK_BYTES`` // (4·V_l)
  (2048 tokens at 128k columns).

The fusion never costs memory and keeps the GEMMs, so the plan turns it on wherever the
graph has a loss to fuse (the pass leaves other graphs alone).
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule

LOSS_CHUNK_BYTES = 2**30
"""Float32 logits of one chunk of the fused loss."""

_LOSSES = frozenset({torch.ops.aten.cross_entropy_loss.default})


def loss_bytes_per_logit(itemsize: int) -> int:
    """Bytes the fused loss moves per logit of ``itemsize`` bytes, beside its GEMMs' operands.

    Per chunk (``autotp.ir.fused_loss``): the logits GEMM writes them (s); ``_stats`` makes a
    float32 copy (s read, 4 written; a float32 copy of float32 logits: 4 + 4), takes the row
    max (4), subtracts it and exponentiates in place (8 + 8) and sums (4); ``_logit_grad``
    makes the float32 copy again, subtracts the log-sum-exp and exponentiates in place
    (8 + 8), scales by the token weights (8) and casts back (4 read, s written; nothing for
    float32); the two gradient GEMMs read the result (2·s).
    """
    copy = 8 if itemsize == 4 else itemsize + 4
    back = 0 if itemsize == 4 else 4 + itemsize
    return itemsize + (copy + 4 + 16 + 4) + (copy + 16 + 8 + back) + 2 * itemsize


def compiled_loss_bytes_per_logit(itemsize: int) -> int:
    """What ``loss_bytes_per_logit`` counts, once inductor has fused a chunk's elementwise work: the logits
    GEMM writes them, the log-sum-exp's reduction reads them, the gradient's kernel reads them and writes the
    gradient in their dtype, and the two gradient GEMMs read it."""
    return 6 * itemsize


def loss_chunk_tokens(gm: GraphModule, tp: int, rows_sharded: set[str]) -> int:
    """Tokens per chunk of the fused loss of ``gm`` at ``tp`` (0: the graph has no loss to fuse);
    ``rows_sharded``: the parameters split on dim 0 (a column-parallel lm_head among them)."""
    vocab = max((n.args[0].meta["val"].shape[-1] for n in gm.graph.nodes if n.op == "call_function" and n.target in _LOSSES),
                default=0)  # fmt: skip
    if vocab == 0:
        return 0
    params = dict(gm.named_parameters())
    sharded = any(params[name].dim() == 2 and params[name].shape[0] == vocab for name in rows_sharded if name in params)
    local = math.ceil(vocab / tp) if sharded else vocab
    return max(1, LOSS_CHUNK_BYTES // (4 * local))
