"""CUDA-graph capture on GPUs through NCCL, fp32: identical to eager autotp (skipped without GPUs).

Three training steps of two microbatches each, with an SGD update in between, so that
most forwards and backwards are replays that read updated parameters in place. With
pp = 2 the first stage holds both microbatches in flight, so it captures twice.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from autotp.runtime.processes.launcher import spawn_ranks
from small_models import build, train_side_by_side, vocab_size

TOLERANCE = 1e-6


def _compare(rank: int, world: int, pp: int, sp: bool, compile_: bool = False) -> dict[str, dict[str, Any]]:
    import autotp
    from autotp.report.cudagraphs import cudagraph_report

    torch.cuda.set_device(rank)
    results = {}
    # Mixtral's fp32 dropless dispatch splits its graph into 5 regions (test_cudagraphs).
    for name in ("llama", "gpt2", "mixtral"):
        model = build(name).cuda()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab_size(model), (4, 32), generator=gen).cuda()
        batch = {"input_ids": ids, "labels": ids}
        eager = autotp.parallelize(copy.deepcopy(model), tp=world // pp, pp=pp, example_inputs=batch, sequence_parallel=sp,
                                   compile=compile_)  # fmt: skip
        graphed = autotp.parallelize(model, tp=world // pp, pp=pp, example_inputs=batch, cuda_graphs=True, sequence_parallel=sp,
                                     compile=compile_)  # fmt: skip
        worst: dict[str, Any] = dict(train_side_by_side(eager, graphed, batch, num_microbatches=2))
        # train_step's captures alone: the call below reads every output, another input signature with its own capture
        worst["slots"] = graphed.cudagraph_slots
        micro = {k: v[:2] for k, v in batch.items()}
        with torch.no_grad():
            logits = [pm(**micro).logits for pm in (eager, graphed)]
        worst["logits"] = (logits[0] - logits[1]).abs().max().item()
        worst["regions"] = len(cudagraph_report(graphed.graph_for(**micro), graphed.plan)["cudagraph_regions"])
        results[name] = worst
    return results


@pytest.mark.gpu
@pytest.mark.parametrize(("tp", "pp", "sp"), [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True), (2, 2, True)])
def test_captured_training_matches_eager(tp: int, pp: int, sp: bool) -> None:
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} CUDA GPUs, found {torch.cuda.device_count()}")
    for rank, rank_results in enumerate(spawn_ranks(_compare, tp * pp, pp, sp, backend="nccl", timeout_s=300)):
        stage = rank // tp
        for name, r in rank_results.items():
            print(f"tp={tp} pp={pp} sp={sp} rank {rank}", name, r)
            assert r["regions"] >= 1, (name, r)
            assert r["loss"] <= TOLERANCE and r["grad"] <= TOLERANCE and r["logits"] <= TOLERANCE, (name, r)
            assert list(r["slots"].values()) == [pp - stage], (name, r)  # one capture per microbatch in flight


@pytest.mark.gpu
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2)])
def test_captured_compiled_training_matches_compiled(tp: int, pp: int) -> None:
    """compile=True with cuda_graphs=True replays the compiled regions: equal to compile=True alone."""
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} CUDA GPUs, found {torch.cuda.device_count()}")
    for rank, rank_results in enumerate(spawn_ranks(_compare, tp * pp, pp, False, True, backend="nccl", timeout_s=600)):
        for name, r in rank_results.items():
            print(f"compiled tp={tp} pp={pp} rank {rank}", name, r)
            assert r["regions"] >= 1, (name, r)
            assert r["loss"] <= TOLERANCE and r["grad"] <= TOLERANCE and r["logits"] <= TOLERANCE, (name, r)
