"""Batches at dp > 1 (gloo, CPU, fp32): ``train_step`` takes one global batch that every rank
passes alike, and says so when the dp ranks pass different ones (the DDP habit, which
silently dropped half of each); ``batch_is_local=True`` takes each dp rank's own shard."""

from __future__ import annotations

import copy

import torch

from distributed import run_on_ranks
from small_models import build, vocab_size


def _batches(rank: int, world: int) -> dict:
    import autotp

    model = build("llama")
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(4)
    ids, labels = (torch.randint(0, vocab_size(model), (4, 8), generator=gen) for _ in range(2))
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids[:2], "labels": labels[:2]})
    assert pm.plan.dp == 2
    mine = slice(2 * rank, 2 * rank + 2)  # this rank's shard, as a DistributedSampler hands it out
    out: dict = {}
    try:
        pm.train_step(input_ids=ids[mine], labels=labels[mine])
        out["global_mode"] = ""
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["global_mode"] = f"{type(e).__name__}: {e}"
    pm.zero_grad()
    out["loss"] = pm.train_step(input_ids=ids[mine], labels=labels[mine], batch_is_local=True).item()
    grads = pm.unshard_grads()
    expected = reference(input_ids=ids, labels=labels).loss
    expected.backward()
    out["expected"] = expected.item()
    out["grad_errors"] = [name for name, p in reference.named_parameters()
                          if not torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6)]  # fmt: skip
    pm.zero_grad()
    try:
        pm.train_step(input_ids=ids[: 2 + 2 * rank], labels=labels[: 2 + 2 * rank], batch_is_local=True)
        out["local_sizes"] = ""
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["local_sizes"] = f"{type(e).__name__}: {e}"
    return out


def test_dp_ranks_with_their_own_batches_are_refused_or_taken_as_local() -> None:
    for rank, out in enumerate(run_on_ranks(_batches, 2)):
        print(rank, out)
        assert out["global_mode"].startswith("UserInputError"), out["global_mode"]
        assert "dp group" in out["global_mode"] and "batch_is_local=True" in out["global_mode"]
        assert abs(out["loss"] - out["expected"]) < 1e-5
        assert out["grad_errors"] == []
        assert out["local_sizes"].startswith("UserInputError") and "input shapes" in out["local_sizes"]
