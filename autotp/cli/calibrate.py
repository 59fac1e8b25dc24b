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
    from autotp.cost_model.hardware import calibrated_profile_path, save_profile

    profile, measured = calibrate(args.ranks, args.timeout)
    out = args.out or calibrated_profile_path(str(measured["device_name"]))
    save_profile(profile, out)
    print(describe(profile, measured))
    if args.out:
        print(f"wrote {out}; use it with autotp plan --hardware {out}")
    else:
        print(f"cached {out}: autotp plan --hardware <this GPU kind> and parallelize(plan='auto') use it on this machine")
    return 0


def add_calibrate_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``calibrate``; its handler (``args.handler``) measures, writes the profile and returns 0."""
    command = subparsers.add_parser(
        "calibrate",
        help="measure all-reduce, P2P, GEMM, memory and launch costs here and write a hardware profile",
        description="Spawn one rank per GPU (NCCL; gloo ranks on the CPU without GPUs), measure collective "
        "alpha/beta, GEMM throughput, memory bandwidth and eager per-op overheads, and write a JSON profile: "
        "cached for this machine (autotp plan and parallelize(plan='auto') find it), or at --out.",
    )
    command.add_argument("--ranks", type=int, help="ranks to measure (default: every GPU, or 2 CPU ranks)")
    command.add_argument(
        "--out", type=Path, help="write the profile here (default: cache it for this machine, in ~/.cache/autotp/profiles or $AUTOTP_CACHE_DIR)"
    )
    command.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are killed (default: 600)")
    command.set_defaults(handler=_calibrate_command)
