"""``autotp schedule``: a pipeline rank's order of forwards and backwards."""

from __future__ import annotations

import argparse

from autotp.ir.schedules import SCHEDULES, default_schedule, format_actions, format_megatron, schedule


def _schedule_command(args: argparse.Namespace) -> int:
    name = args.schedule or default_schedule(args.vpp)
    ranks = range(args.pp) if args.rank is None else [args.rank]
    fmt = format_megatron if args.format == "megatron" else format_actions
    for rank in ranks:
        order = fmt(schedule(name, args.pp, args.vpp, args.microbatches, rank))
        print(order if args.rank is not None else f"rank {rank}: {order}")
    return 0


def add_schedule_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``schedule``; its handler (``args.handler``) prints the order(s) and returns 0."""
    command = subparsers.add_parser(
        "schedule",
        help="print a rank's pipeline order of forwards and backwards",
        description="Print the order in which a pipeline rank runs forwards and backwards, in Megatron's "
        "notation (k = forward of local chunk k-1, -k = its backward) or as F<chunk>.<microbatch> actions.",
    )
    command.add_argument("--pp", type=int, required=True, help="pipeline stages")
    command.add_argument("--vpp", type=int, default=1, help="model chunks per rank (default: 1)")
    command.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    command.add_argument("--rank", type=int, help="pipeline rank to print (default: every rank, one per line)")
    command.add_argument(
        "--schedule", choices=SCHEDULES, help="default: interleaved when --vpp > 1, else 1f1b"
    )
    command.add_argument("--format", choices=("megatron", "actions"), default="megatron", help="default: megatron")
    command.set_defaults(handler=_schedule_command)
