"""``autotp calibrate``: measure this machine and write a ``HardwareProfile`` as JSON.

The ranks that measure are ``autotp.cli.measure`` (imported when the command runs); the
fitting is ``autotp.cost_model.calibrate``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _calibrate_command(args: argparse.Namespace) -> int:
    from autotp.cli.measure import calibrate
    from autotp.cost_model.calibrate import describe
    from autotp.cost_model.hardware import save_profile

    profile, measured = calibrate(args.ranks, args.timeout)
    save_profile(profile, args.out)
    print(describe(profile, measured))
    print(f"wrote {args.out}; use it with autotp plan --hardware {args.out}")
    return 0


def add_calibrate_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``calibrate``; its handler (``args.handler``) measures, writes the profile and returns 0."""
    command = subparsers.add_parser(
        "calibrate",
        help="measure all-reduce, P2P, GEMM, memory and launch costs here and write a hardware profile",
        description="Spawn one rank per GPU (NCCL; gloo ranks on the CPU without GPUs), measure collective "
        "alpha/beta, GEMM throughput, memory bandwidth and eager per-op overheads, and write a JSON profile "
        "that autotp plan --hardware PATH reads.",
    )
    command.add_argument("--ranks", type=int, help="ranks to measure (default: every GPU, or 2 CPU ranks)")
    command.add_argument("--out", type=Path, default=Path("autotp-profile.json"), help="default: autotp-profile.json")
    command.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed (default: 600)")
    command.set_defaults(handler=_calibrate_command)
