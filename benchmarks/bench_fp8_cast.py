"""The one-pass FP8 cast (``autotp::fp8_cast_transpose``) against what inductor makes of the
same values written as aten ops (``fp8_cast.reference`` with the amax taken through rows, as
``fp8.Fp8Linear`` did before the op), per shape of an 8B Llama's operands (bf16, b2 s4096).

    python benchmarks/bench_fp8_cast.py [--json out.json]

Each row: microseconds per call (CUDA events, median of 50 after warm-up) and the GB/s of
the bytes the values need (read t once, write q and qt).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

SHAPES = {  # [M, N] of the cast's input: output gradients and activations (8192 tokens), weights
    "gate/up dy": (8192, 14336, torch.float8_e5m2),
    "q / o / down dy": (8192, 4096, torch.float8_e5m2),
    "down x": (8192, 14336, torch.float8_e4m3fn),
    "gate weight": (14336, 4096, torch.float8_e4m3fn),
}


def _time_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    import autotp.runtime.processes.collectives  # noqa: F401 - the ops' kernels
    from autotp.ir import fp8, fp8_cast

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    def inductor_cast(t: torch.Tensor, window: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        used = torch.where(window > 0, window, torch.zeros_like(window))  # delayed: no wait on this step's amax
        q, inv = fp8.cast(t, used, dtype, fp8.WHOLE, False)
        return q, fp8.pad_fp8_cols(q.t().contiguous(), 16), inv, fp8.amax(t, fp8.WHOLE, by_rows=True)

    compiled = torch.compile(inductor_cast)
    rows = []
    for name, (m, n, dtype) in SHAPES.items():
        t = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        window = torch.full((1, 1), 4.0, device="cuda")
        outs = {"triton op": functools.partial(fp8_cast.CAST_TRANSPOSE, t, window, dtype, 16),
                "inductor (aten)": functools.partial(compiled, t, window, dtype)}  # fmt: skip
        a, b = outs["triton op"](), outs["inductor (aten)"]()
        equal = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[:2], b[:2]))
        gb = m * n * (2 + 1 + 1) / 1e9
        for kind, fn in outs.items():
            us = _time_us(fn)
            rows.append({"shape": name, "m": m, "n": n, "kind": kind, "us": round(us, 1), "GB/s": round(gb / us * 1e6), "equal": equal})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
