"""Progress lines of the commands, on stderr so that stdout stays the result (no torch import)."""

from __future__ import annotations

import sys


def progress(message: str) -> None:
    print(f"autotp: {message} ...", file=sys.stderr, flush=True)
