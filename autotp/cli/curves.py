"""The loss curve of ``autotp run``: ``loss.csv`` and ``loss.png`` in the run's output folder.

The CSV has one row per step (``step, loss, lr, tokens_per_s, eval_loss``; ``eval_loss``
empty where the held-out split was not evaluated). A resumed run keeps the rows of the
steps before its checkpoint and appends its own. The PNG is drawn by matplotlib when it
is installed (``pip install autotp[plot]``), with axes and a legend; without it, a plain
raster of the same curves (training loss blue, held-out loss orange, the axes grey, no text).
"""

from __future__ import annotations

import csv
import struct
import zlib
from pathlib import Path

COLUMNS = ("step", "loss", "lr", "tokens_per_s", "eval_loss")


def read_rows(path: Path, before_step: int) -> list[dict[str, str]]:
    """The rows of ``path`` for steps up to ``before_step`` (what a resumed run keeps)."""
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [row for row in csv.DictReader(f) if int(row["step"]) <= before_step]


def write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _series(rows: list[dict[str, str]], key: str) -> list[tuple[float, float]]:
    return [(float(r["step"]), float(r[key])) for r in rows if r.get(key)]


def write_png(path: Path, rows: list[dict[str, str]], title: str) -> None:
    train, held_out = _series(rows, "loss"), _series(rows, "eval_loss")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _write_raster(path, [(train, (31, 119, 180)), (held_out, (255, 127, 14))])
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(*zip(*train), label="training loss")
    if held_out:
        ax.plot(*zip(*held_out), "o-", label="held-out loss")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _write_raster(path: Path, curves: list[tuple[list[tuple[float, float]], tuple[int, int, int]]],
                  width: int = 640, height: int = 400, margin: int = 30) -> None:  # fmt: skip
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def dot(x: int, y: int, color: tuple[int, int, int], size: int = 1) -> None:
        for yy in range(y - size + 1, y + size):
            for xx in range(x - size + 1, x + size):
                if 0 <= xx < width and 0 <= yy < height:
                    pixels[yy][3 * xx : 3 * xx + 3] = bytes(color)

    for x in range(margin, width - margin):
        dot(x, height - margin, (128, 128, 128))
    for y in range(margin, height - margin):
        dot(margin, y, (128, 128, 128))
    points = [p for curve, _ in curves for p in curve]
    if points:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)

        def place(x: float, y: float) -> tuple[int, int]:
            px = margin + (x - x0) / ((x1 - x0) or 1) * (width - 2 * margin - 1)
            py = height - margin - (y - y0) / ((y1 - y0) or 1) * (height - 2 * margin - 1)
            return round(px), round(py)

        for curve, color in curves:
            placed = [place(x, y) for x, y in curve]
            for (ax, ay), (bx, by) in zip(placed, placed[1:]):
                steps = max(abs(bx - ax), abs(by - ay), 1)
                for i in range(steps + 1):
                    dot(round(ax + (bx - ax) * i / steps), round(ay + (by - ay) * i / steps), color)
            for x, y in placed:
                dot(x, y, color, size=2)
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
