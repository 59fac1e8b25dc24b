"""The ``autotp`` command line (also ``python -m autotp``).

Building the parser imports neither torch nor transformers, so ``autotp --help`` answers
at once; a command's handler imports them when it runs. User errors
(``autotp.ir.errors.UserInputError``, or a worker that raised one) print one line and
exit with code 2; an internal error keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from autotp import presets
from autotp.cli.calibrate import add_calibrate_command
from autotp.cli.check import add_check_command
from autotp.cli.checkpoint_args import add_convert_command
from autotp.cli.plan import add_plan_command
from autotp.cli.ranks import add_ranks_command
from autotp.cli.run_args import add_run_command
from autotp.cli.schedule import add_schedule_command
from autotp.cost_model.hardware import PROFILES
from autotp.ir.errors import UserInputError
from autotp.report import DUMP_FORMATS


def _lazy(name: str) -> Callable[[argparse.Namespace], int]:
    """The handler ``name`` of ``autotp.cli.commands``, imported when called."""

    def handler(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module("autotp.cli.commands"), name)(args)

    return handler


def _one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split("\n")).strip()


def _add_inspection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help=f"a preset ({', '.join(presets.preset_names())}) or a local folder holding config.json; "
        "built on the meta device, nothing is allocated or downloaded",
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: 2)")
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline stages; the planner cuts the layers between them (default: 1)"
    )
    parser.add_argument("--batch", type=int, default=1, help="batch size of the example input_ids (default: 1)")
    parser.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"sequence length (default: {presets.INSPECTION_SEQ}, or the model's max_position_embeddings if smaller)",
    )
    parser.add_argument("--dtype", choices=presets.DTYPE_NAMES, default="bfloat16", help="parameter dtype (default: bfloat16)")
    parser.add_argument(
        "--no-labels",
        action="store_true",
        help="trace without labels= (by default labels are passed, so the vocab-parallel loss shows)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="compile with sequence parallelism (Megatron SP: reduce-scatters and all-gathers instead of all-reduces)",
    )
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree of the MoE layers (etp=1; default: 1)")
    parser.add_argument("--moe-dispatch", choices=("dropless", "sync_free"), help="how rows reach their experts "
                        "(default: dropless with --ep > 1)")
    parser.add_argument("--moe-capacity-factor", type=float, help="sync-free capacity factor (default: 1.25)")
    parser.add_argument("--recompute", choices=("none", "full"), help="recompute every decoder layer's activations in the "
                        "backward (full) or none (default: the layers the model checkpoints itself)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotp", description="Compile HuggingFace models into tensor-parallel per-rank graphs."
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log progress (-v: INFO, -vv: DEBUG); default: warnings only"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_command(commands)

    dump_cmd = commands.add_parser(
        "dump",
        help="write one rank's rewritten graph as annotated code, DOT, SVG or JSON",
        description="Compile one tp rank offline and write its graph. Every node is annotated with its "
        "layout (Replicate, Partial, Shard(dim:local/global)), its collectives with bytes and estimated time, "
        "its pipeline stage (stage boundaries are nodes, shown with their point-to-point bytes), and its "
        "forward FLOPs and estimated time, and its CUDA-graph region when the plan asks for CUDA graphs. "
        "DOT and SVG expand layer 0 and collapse the other decoder layers into one summary node each.",
    )
    _add_inspection_options(dump_cmd)
    dump_cmd.add_argument("--rank", type=int, default=0, help="tp rank to compile (default: 0)")
    dump_cmd.add_argument(
        "--stage",
        type=int,
        help="with --pp > 1: only this pipeline stage (its nodes, the repeated ones they read, its boundaries); "
        "default: the whole rank graph with every node's stage",
    )
    dump_cmd.add_argument(
        "--format",
        choices=DUMP_FORMATS,
        default="code",
        help="code: annotated listing; dot; svg: rendered by Graphviz's dot (DOT only, with a message, "
        "when it is missing); json: every node and the per-layer summary (default: code)",
    )
    dump_cmd.add_argument("--out", type=Path, default=Path("autotp-dump"), help="output folder (default: autotp-dump)")
    dump_cmd.add_argument(
        "--after",
        metavar="PASS",
        help="write the graph as it was after this pass (traced, or a pass name such as annotate_layouts) "
        "instead of the final one: the plain code the pass runner saves (only with --format code)",
    )
    dump_cmd.add_argument("--dump-dir", type=Path, help="also write the code after every pass here (NN_<pass>.py)")
    dump_cmd.add_argument(
        "--hardware", choices=tuple(PROFILES), default="h200", help="profile for estimated times (default: h200)"
    )
    dump_cmd.set_defaults(handler=_lazy("dump_command"))

    explain = commands.add_parser(
        "explain",
        help="collectives, bytes, parameters and FLOPs per layer, against Megatron's minimum",
        description="Compile tp rank 0 offline and tabulate per layer: all-reduces and all-gathers by "
        "direction with their bytes, parameter bytes per rank and forward FLOPs per rank; then totals and "
        "Megatron's minimum of 2 forward + 2 backward all-reduces per decoder layer.",
    )
    _add_inspection_options(explain)
    explain.add_argument("--format", choices=("table", "json"), default="table", help="default: table")
    explain.add_argument(
        "--cudagraphs", action="store_true", help="list CUDA-graph regions and blockers (JSON key cudagraph_regions)"
    )
    explain.set_defaults(handler=_lazy("explain_command"), stage=None)
    add_ranks_command(commands)
    add_schedule_command(commands)
    add_plan_command(commands)
    add_calibrate_command(commands)
    add_convert_command(commands)
    add_check_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose >= 2 else logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        return args.handler(args)
    except UserInputError as e:
        print(f"autotp: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the launcher's errors, by name: importing it loads torch
        if type(e).__name__ == "RankError" and e.user_error:  # type: ignore[attr-defined]
            print(f"autotp: error: {_one_line(e.message)}", file=sys.stderr)  # type: ignore[attr-defined]
            return 2
        if type(e).__name__ in ("RankError", "TimeoutError"):
            print(f"autotp: {e}", file=sys.stderr)
            return 1
        raise
