"""Plot tokens/s against GPU count from ``bench_tp.py --json`` output.

    python benchmarks/plot_tp.py benchmarks/results/tp_h200x4_compile.json benchmarks/results/tp_scaling.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = json.load(open(src))
    single = next(r for r in rows if r["setup"] == "1 GPU")
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["tp"] == 1:
            continue
        name = r["setup"].rsplit(" TP=", 1)[0] + (" +compile" if "compile" in r["setup"] else "")
        series.setdefault(name, [(1, single["tokens_per_s"])]).append((r["tp"], r["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        ax.plot([p[0] for p in points], [p[1] / 1e3 for p in points], marker="o", label=name)
    gpus = sorted({p[0] for pts in series.values() for p in pts})
    ax.plot(gpus, [single["tokens_per_s"] * g / 1e3 for g in gpus], "k:", label="linear scaling")
    ax.set_xticks(gpus)
    ax.set_xlabel("GPUs (tensor-parallel degree)")
    ax.set_ylabel("thousand tokens/s")
    ax.set_title("Llama 4 x 8B-shaped layers, bf16, b=4, s=2048, H200")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
