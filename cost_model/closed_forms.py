"""The cost model's closed forms as sympy expressions (``autotp plan --explain`` prints them).

Symbols: b microbatch size, s sequence length, h hidden size, a attention heads, e bytes
per activation element, t tensor-parallel size, p pipeline stages, v chunks per rank,
m microbatches, d data-parallel size, r a pipeline rank, n message bytes, alpha the
latency and B the bus bandwidth of a link, Psi the parameter count.

* Tensor parallelism (Megatron): every decoder layer all-reduces its [b, s, h]
  activations twice forward (after attention and after the MLP, *g*) and twice backward
  (their input gradients, *f*); a ring all-reduce of n bytes sends 2(t-1)/t·n per rank.
* Pipeline: each stage boundary carries the hidden state [b, s, h] forward and its
  gradient backward, once per microbatch.
* Data parallelism: one all-reduce of a rank's gradients, Psi/(t·p) of them, per step.
* Bubbles, activations in flight and bytes per parameter: ``bubble`` and ``memory``. A
  bubble is stated two ways: idle time over compute time, (p-1)/m for 1F1B (``BUBBLE``),
  and its share of an ideal step, (p-1)/(m+p-1) (``BUBBLE_SHARE``). ``autotp plan``'s
  bubble column is neither: the modelled idle time over the whole predicted step, which
  also counts communication, the optimizer and unequal stages.
* Activation bytes per layer of a GPT layer in 16-bit without sequence parallelism or
  recomputation (Korthikanti et al. 2022, eq. 2): s·b·h·(10 + 24/t + 5·a·s/(h·t)); the
  last term is the attention scores, which fused attention never stores.

``CLOSED_FORMS`` names every expression; ``explain`` substitutes numbers into them.
"""

from __future__ import annotations

import sympy

b, s, h, a, e, t, p, v, m, d, r, n, alpha, B, Psi = sympy.symbols("b s h a e t p v m d r n alpha B Psi", positive=True)

RING_ALL_REDUCE_S = alpha + 2 * (t - 1) / t * n / B
TP_ALL_REDUCE_BYTES_PER_LAYER = 4 * b * s * h * e
TP_COMM_S_PER_LAYER = 4 * RING_ALL_REDUCE_S.subs(n, b * s * h * e)
PP_P2P_BYTES_PER_MICROBATCH = 2 * b * s * h * e
DP_GRAD_BYTES = Psi / (t * p) * e
BUBBLE = {
    "gpipe": (p - 1) / m,
    "1f1b": (p - 1) / m,
    "interleaved": (p - 1) / (m * v),
    "zbh1": (p - 1) / (3 * m),
}
BUBBLE_SHARE = {  # bubble / (1 + bubble), simplified
    "gpipe": (p - 1) / (m + p - 1),
    "1f1b": (p - 1) / (m + p - 1),
    "interleaved": (p - 1) / (m * v + p - 1),
    "zbh1": (p - 1) / (3 * m + p - 1),
}
IN_FLIGHT = {
    "gpipe": m,
    "1f1b": sympy.Min(p - r, m),
    "interleaved": sympy.Min((p - r - 1) * 2 + (v - 1) * p + 1, m * v),
    "zbh1": sympy.Min(p, m),
}
BYTES_PER_PARAM = {
    "bf16": (sympy.Integer(20), 4 + 16 / d),
    "bf16-fp32-grads": (sympy.Integer(18), 6 + 12 / d),
    "fp32": (sympy.Integer(16), 8 + 8 / d),
    "bf16-pure": (sympy.Integer(8), 4 + 4 / d),
}
MEGATRON_ACTIVATION_BYTES_PER_LAYER = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))

CLOSED_FORMS: dict[str, sympy.Expr] = {
    "ring all-reduce time": RING_ALL_REDUCE_S,
    "tp all-reduce bytes per layer (2 fwd + 2 bwd)": TP_ALL_REDUCE_BYTES_PER_LAYER,
    "tp all-reduce time per layer": TP_COMM_S_PER_LAYER,
    "pp p2p bytes per boundary per microbatch": PP_P2P_BYTES_PER_MICROBATCH,
    "dp gradient bytes per rank": DP_GRAD_BYTES,
    "bubble / compute, 1f1b and gpipe": BUBBLE["1f1b"],
    "bubble / compute, interleaved 1f1b": BUBBLE["interleaved"],
    "bubble / compute, zb-h1": BUBBLE["zbh1"],
    "microbatches in flight on rank r, 1f1b": IN_FLIGHT["1f1b"],
    "chunks in flight on rank r, interleaved": IN_FLIGHT["interleaved"],
    "activation bytes per layer (Megatron, 16-bit)": MEGATRON_ACTIVATION_BYTES_PER_LAYER,
}


def forms_for(schedule: str, precision: str) -> dict[str, sympy.Expr]:
    """``CLOSED_FORMS`` with the bubble's share of the step for ``schedule`` and the bytes per
    parameter of the training step ``precision`` (plain optimizer and distributed optimizer)."""
    plain, distributed = BYTES_PER_PARAM[precision]
    return {
        **CLOSED_FORMS,
        f"bubble share of an ideal step, {schedule}": BUBBLE_SHARE[schedule],
        f"bytes per parameter, {precision} (plain optimizer)": plain,
        f"bytes per parameter, {precision} (distributed optimizer)": distributed,
    }


def explain(values: dict[sympy.Symbol, float], forms: dict[str, sympy.Expr] = CLOSED_FORMS) -> str:
    """One line per closed form: name, expression, and its value at ``values`` where all symbols are given."""
    width = max(map(len, forms))
    lines = []
    for name, expr in forms.items():
        value = expr.subs(values)
        shown = f"{float(value):.4g}" if value.is_number else str(value)
        lines.append(f"{name:<{width}}  {sympy.sstr(expr)}  = {shown}")
    return "\n".join(lines)
