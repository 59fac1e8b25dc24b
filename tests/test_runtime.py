"""Runtime behaviour on gloo ranks: new input shapes, dropout RNG, bad degrees, timeouts."""

from __future__ import annotations

import copy
import time

import torch

from distributed import run_on_ranks
from small_models import DropoutAttention, PlainTransformer, build


def _new_shapes(rank: int, world: int) -> int:
    import autotp

    model = build("llama")
    reference = copy.deepcopy(model)
    pm = autotp.parallelize(model, tp=world)  # traced with the default [2, 16] input_ids
    gen = torch.Generator().manual_seed(3)
    for batch, seq in ((3, 9), (1, 24), (3, 9)):
        ids = torch.randint(0, 128, (batch, seq), generator=gen)
        out, expected = pm(ids, labels=ids), reference(ids, labels=ids)
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-6)
    return len(pm._graphs)


def test_other_batch_and_sequence_lengths_retrace_once_each() -> None:
    graphs = run_on_ranks(_new_shapes, 2)
    assert graphs == [3, 3]  # [2,16] without labels, [3,9] and [1,24] with labels; [3,9] reused


def _dropout_streams(rank: int, world: int) -> dict[str, object]:
    import autotp
    from autotp.ir import ops
    from autotp.ir.ops import REPLICATED, SHARDED

    torch.manual_seed(0)
    model = PlainTransformer(dropout=0.5).train()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": ids, "labels": ids}, seed=7)
    graph = pm.graph_for(input_ids=ids, labels=ids)
    streams = [n.args[3] for n in graph.graph.nodes if n.target is ops.TP_DROPOUT]
    out = pm(input_ids=ids, labels=ids)
    x = torch.ones(4, 64)
    return {
        "streams": streams,
        "loss": out["loss"].item(),
        "replicated_mask": ops.TP_DROPOUT(x, 0.5, True, REPLICATED),
        "sharded_mask": ops.TP_DROPOUT(x, 0.5, True, SHARDED),
    }


def test_dropout_follows_megatron_rng_rule() -> None:
    r0, r1 = run_on_ranks(_dropout_streams, 2)
    # proj's output is replicated (after the all-reduce); the MLP hidden state is sharded.
    assert r0["streams"] == ["replicated", "sharded"] * 2
    assert torch.equal(r0["replicated_mask"], r1["replicated_mask"])
    assert not torch.equal(r0["sharded_mask"], r1["sharded_mask"])
    assert r0["loss"] == r1["loss"]  # replicas stayed in sync through the dropped-out residuals


def _attention_dropout(rank: int, world: int) -> dict[str, object]:
    import autotp
    from autotp.ir import ops
    from plain_models_attention import DecoderLM, PreNormBlock

    model = DecoderLM(lambda: PreNormBlock(DropoutAttention())).train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": ids, "labels": ids}, seed=7)
    graph = pm.graph_for(input_ids=ids, labels=ids)
    streams = [n.args[-1] for n in graph.graph.nodes if n.target is ops.TP_ATTENTION_DROPOUT]
    loss = pm(input_ids=ids, labels=ids)["loss"]
    loss.backward()
    q = torch.randn(1, 2, 6, 16, generator=torch.Generator().manual_seed(1))
    return {"streams": streams, "loss": loss.item(), "dropped": ops.TP_ATTENTION_DROPOUT(q, q, q, None, 0.5, True, None, False, ops.SHARDED)}


def test_attention_dropout_over_split_heads_draws_from_the_sharded_stream() -> None:
    """SDPA draws its dropout from the default generator, the same on every rank: each rank
    would drop the same positions of its own heads. Over split heads it runs as its math with
    the mask from the sharded stream, other on each rank; the replicas stay in sync."""
    r0, r1 = run_on_ranks(_attention_dropout, 2)
    assert r0["streams"] == ["sharded"] * 2
    assert r0["loss"] == r1["loss"]
    assert not torch.equal(r0["dropped"], r1["dropped"])


def test_attention_dropout_op_is_sdpa_without_dropout_and_drops_the_probabilities_with_it() -> None:
    from autotp.ir import ops
    from autotp.runtime.execution import rng

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    kv = k[:, :2], v[:, :2]
    mask = torch.rand(6, 6, generator=gen) > 0.3
    mask.fill_diagonal_(True)
    for args, kwargs in (((q, k, v), {"is_causal": True}), ((q, k, v), {"attn_mask": mask, "scale": 0.3}), ((q, *kv), {"enable_gqa": True})):
        expected = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
        got = ops.TP_ATTENTION_DROPOUT(*args, kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False), kwargs.get("scale"),
                                       kwargs.get("enable_gqa", False), ops.SHARDED)  # fmt: skip
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    rng.seed_tp_rng(5, 0)
    dropped = ops.TP_ATTENTION_DROPOUT(q, k, v, None, 0.25, True, None, False, ops.SHARDED)
    rng.seed_tp_rng(5, 0)
    keep = ops.TP_RAND(torch.empty(2, 4, 6, 6), ops.SHARDED) >= 0.25  # the stream's numbers, shaped as the probabilities
    scores = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(dropped, (scores.softmax(-1) * keep / 0.75) @ v, rtol=1e-5, atol=1e-6)


def _bad_degrees(rank: int, world: int) -> list[str]:
    import autotp

    messages = []
    for kwargs in ({"tp": 8}, {"tp": 2, "dp": 2}, {"tp": 1, "pp": 3}):
        try:
            autotp.parallelize(build("llama"), **kwargs)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_world_size_errors_say_how_to_fix() -> None:
    too_big, mismatch, not_factor = run_on_ranks(_bad_degrees, 2)[0]
    assert "tp=8 is larger than the world size 2" in too_big
    assert "2*1*2 = 4 does not match the world size 2" in mismatch
    assert "tp*pp = 1*3 = 3 does not divide the world size 2" in not_factor and "dp=0" not in not_factor


def _one_rank_stalls(rank: int, world: int) -> str:
    import autotp

    pm = autotp.parallelize(build("llama"), tp=world, timeout_s=3)
    if rank == 1:
        time.sleep(12)  # never reaches the forward's collectives
        return "stalled"
    start = time.monotonic()
    try:
        pm(torch.zeros(2, 16, dtype=torch.long))
    except RuntimeError as e:
        return f"{time.monotonic() - start:.0f}s: {e}"
    return "no error"


def test_collective_times_out_with_a_message() -> None:
    message = run_on_ranks(_one_rank_stalls, 2, timeout_s=120)[0]
    assert "a collective timed out on rank 0" in message
    assert "another rank did not reach the same collective" in message
    assert float(message.split("s:", 1)[0]) < 11  # failed on the 3 s timeout, not when rank 1 woke up
