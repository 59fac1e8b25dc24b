"""``autotp check``: the numerics bisector on local worker processes."""

from __future__ import annotations

import argparse
import functools

from autotp.ir.errors import UserInputError
from autotp import presets
from autotp.cli.progress import progress


def _check_worker(model_name: str, tp: int, pp: int, batch: int, seq: int, seed: int, rtol: float, atol: float,
                  rank: int, world: int) -> tuple[bool, str]:  # fmt: skip
    import torch
    from transformers.utils import logging as hf_logging

    from autotp.report.check import check_numerics

    hf_logging.set_verbosity_error()
    if rank == 0:
        progress(f"rank 0: building {model_name}, compiling it at tp={tp} pp={pp} and running it against the unmodified model")
    torch.manual_seed(seed)
    model = presets.build_model(model_name, device="cpu", dtype=torch.float32).eval()
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    report = check_numerics(model, tp=tp, pp=pp, example_inputs={"input_ids": ids, "labels": labels}, rtol=rtol, atol=atol)
    return report.ok, report.summary()


def _check_command(args: argparse.Namespace) -> int:
    from autotp.cli.commands import positive_timeout
    from autotp.report.check import ATOL, RTOL
    from autotp.runtime.processes.launcher import spawn_ranks

    for name in ("tp", "pp", "batch", "seq"):
        if getattr(args, name) < 1:
            raise UserInputError(f"--{name} must be >= 1, got {getattr(args, name)}")
    positive_timeout(args.timeout)
    rtol, atol = RTOL if args.rtol is None else args.rtol, ATOL if args.atol is None else args.atol
    worker = functools.partial(_check_worker, args.model, args.tp, args.pp, args.batch, args.seq, args.seed,
                               rtol, atol)  # fmt: skip
    progress(f"starting {args.tp * args.pp} gloo workers for {args.model}")
    ok, summary = spawn_ranks(worker, args.tp * args.pp, backend="gloo", timeout_s=args.timeout, num_threads=1)[0]
    print(summary)
    return 0 if ok else 1


def add_check_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``check``; its handler prints the report and returns 0 when nothing diverges, else 1."""
    check = subparsers.add_parser(
        "check",
        help="numerics bisector: the first node where the parallel model diverges from the reference",
        description="Build MODEL in fp32 with random weights, parallelize it on tp*pp local gloo workers and "
        "run it against the unmodified model on the same random batch: every forward activation (made whole: "
        "partial values summed, shards gathered; with --pp > 1, each stage's on its rank) and every parameter's "
        "grad (with --pp > 1, over pp microbatches) is compared, and the first node beyond tolerance is named with "
        "its source line, layout and pipeline chunk. Exit status 1 when one diverges.",
    )
    check.add_argument("model", metavar="MODEL", help=f"a preset ({', '.join(presets.preset_names())}) or a local "
                       "folder holding config.json; small models only (built on the CPU in fp32)")  # fmt: skip
    check.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default: 2)")
    check.add_argument("--pp", type=int, default=1, help="pipeline stages (default: 1)")
    check.add_argument("--batch", type=int, default=2, help="batch size (default: 2)")
    check.add_argument("--seq", type=int, default=16, help="sequence length (default: 16)")
    check.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch (default: 0)")
    check.add_argument("--rtol", type=float, help="relative tolerance (default: autotp.report.check.RTOL)")
    check.add_argument("--atol", type=float, help="absolute tolerance (default: autotp.report.check.ATOL)")
    check.add_argument("--timeout", type=float, default=600, help="seconds before the workers are killed (default: 600)")
    check.set_defaults(handler=_check_command)
