"""Batches at dp > 1 (gloo, CPU, fp32): ``train_step`` takes one global batch that every rank
passes alike, and says so when the dp ranks pass different ones (the DDP habit, which
silently dropped half of each); ``batch_is_local=True`` takes each dp rank's own shard."""

from __future__ import annotations

import copy

import pytest
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


class _BatchDictLM(torch.nn.Module):
    """``forward(batch)`` with a dict of tensors, as Lightning-style training code passes it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.embed(batch["input_ids"])
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = self.head(h)
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())}


def _nested_batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    ids, labels = (torch.randint(0, 32, (4, 8), generator=gen) for _ in range(2))
    labels[0, 2:] = -100
    return {"batch": {"input_ids": ids, "labels": labels}}


def _nested_train(rank: int, world: int, pp: int) -> dict:
    import autotp
    from autotp.runtime.execution.guards import signature_key

    model = _BatchDictLM()
    reference = copy.deepcopy(model)
    first = _nested_batch(0)
    pm = autotp.parallelize(model, tp=1, pp=pp, example_inputs={"batch": {k: v[:2] for k, v in first["batch"].items()}})
    for step in range(2):
        pm.zero_grad()
        loss = pm.train_step(**_nested_batch(step), num_microbatches=2)
    expected = reference(**_nested_batch(1))["loss"]
    expected.backward()
    grads = pm.unshard_grads()
    return {"loss": loss.item(), "expected": expected.item(),
            "grad_errors": [n for n, p in reference.named_parameters() if not torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6)],
            "signatures": [{item[0]: item[1:] for item in key[1]} for key in pm._graphs],
            "half": signature_key({"batch": {k: v[:2] for k, v in first["batch"].items()}}, True)}  # fmt: skip


def test_tensors_nested_in_the_inputs_are_split_and_keyed_by_shape() -> None:
    """``train_step(batch={...})``: every nested tensor is cut into the microbatches, and a graph
    is traced per shape, not per value (two steps of other values trace nothing new)."""
    out = _nested_train(0, 1, 1)
    assert abs(out["loss"] - out["expected"]) < 1e-5 and out["grad_errors"] == []
    assert len(out["signatures"]) == 2, out["signatures"]  # the example inputs' graph and the split step's
    assert all(s["batch.input_ids"][0] == (2, 8) for s in out["signatures"])


def test_nested_inputs_reach_every_pipeline_stage() -> None:
    for out in run_on_ranks(_nested_train, 2, 2):
        assert abs(out["loss"] - out["expected"]) < 1e-5 and out["grad_errors"] == [], out


def test_flat_inputs_are_keyed_as_the_pytree_names_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without nesting, ``flat_call`` skips the pytree walk (once per step); the names, order and
    values are those of the walk."""
    from autotp.runtime.execution import guards

    ids = torch.zeros(2, 8, dtype=torch.long)
    call = {"labels": ids, "input_ids": ids.clone(), "use_cache": False, "scale": 0.5, "mode": "causal", "n": 3}
    fast = guards.flat_call(call)
    monkeypatch.setattr(guards, "_FLAT_LEAVES", frozenset())
    walked = guards.flat_call(call)
    assert list(fast) == list(walked) == ["input_ids", "labels", "mode", "n", "scale", "use_cache"]
    assert all(fast[k] is walked[k] for k in fast)
    assert list(guards.flat_call({"batch": {"labels": ids}, "n": 3})) == ["batch.labels", "n"]


def test_a_step_of_one_piece_takes_the_batch_whole() -> None:
    from autotp.runtime.execution.batch_pieces import microbatches

    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "labels": torch.ones(4, 8, dtype=torch.long)}
    assert microbatches(batch, 1, 0, 1, False)[0] is batch
    assert microbatches(batch, 2, 1, 1, True)[0] is batch
    halves = microbatches(batch, 2, 1, 1, False)
    assert len(halves) == 1 and torch.equal(halves[0]["labels"], batch["labels"][2:])
