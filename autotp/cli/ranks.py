"""``autotp ranks``: the rank groups of every parallel dimension."""

from __future__ import annotations

import argparse
import json

from autotp.ir.rank_groups import format_groups, rank_groups


def _ranks_command(args: argparse.Namespace) -> int:
    groups = rank_groups(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp)
    print(json.dumps(groups) if args.format == "json" else format_groups(groups))
    return 0


def add_ranks_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``ranks``; its handler (``args.handler``) prints the groups and returns 0."""
    ranks = subparsers.add_parser(
        "ranks",
        help="print the rank groups of each parallel dimension (Megatron order tp-cp-ep-dp-pp)",
        description="Lay WORLD_SIZE ranks out as Megatron does (tp fastest, then cp, dp, pp; experts fold the "
        "same ranks as etp, ep, edp, pp) and print the groups of every dimension.",
    )
    ranks.add_argument("--world-size", type=int, required=True, help="number of ranks")
    ranks.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default: 1)")
    ranks.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default: 1)")
    ranks.add_argument("--cp", type=int, default=1, help="context-parallel degree (default: 1)")
    ranks.add_argument("--ep", type=int, help="expert-parallel degree; adds the etp, ep and edp groups")
    ranks.add_argument("--etp", type=int, help="expert tensor-parallel degree (default: --tp)")
    ranks.add_argument("--format", choices=("text", "json"), default="text", help="default: text")
    ranks.set_defaults(handler=_ranks_command)
