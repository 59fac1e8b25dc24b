"""Pipeline and data parallelism (gloo, CPU): train_step's loss and every gradient match
the unmodified model on the same global batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from distributed import run_on_ranks
from small_models import build, vocab_size

RTOL, ATOL = 1e-4, 1e-6
BATCH, SEQ = 8, 12


def _reference_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, parts: int) -> torch.Tensor:
    """Mean over ``parts`` equal slices of each slice's mean loss, backward included."""
    losses = [model(input_ids=i, labels=l).loss for i, l in zip(ids.chunk(parts), labels.chunk(parts))]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach()


def _pipeline_on_rank(rank: int, world: int, name: str, tp: int, pp: int, vpp: int, microbatches: int,
                      schedule: str | None = None, compile: bool = False, layers: int = 4) -> dict:  # fmt: skip
    import autotp

    model = build(name, layers=layers)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab_size(model), (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab_size(model), (BATCH, SEQ), generator=gen)
    pm = autotp.parallelize(model, tp=tp, pp=pp, vpp=vpp, compile=compile,
                            example_inputs={"input_ids": ids[:2], "labels": labels[:2]})  # fmt: skip
    dp = pm.plan.dp
    # Two steps, the second on the first one's receive buffers.
    pm.train_step(input_ids=ids, labels=labels, num_microbatches=microbatches, schedule=schedule)
    pm.zero_grad(set_to_none=True)
    buffers = {c: {k: [t.data_ptr() for t in v] for k, v in cg._buffers.items()} for c, cg in pm._first_compiled().chunks.items()}
    loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=microbatches, schedule=schedule)
    after = {c: {k: [t.data_ptr() for t in v] for k, v in cg._buffers.items()} for c, cg in pm._first_compiled().chunks.items()}
    assert after == buffers, "the second step allocated receive buffers"
    expected = _reference_step(reference, ids, labels, dp * microbatches)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    for pname, p in reference.named_parameters():
        torch.testing.assert_close(grads[pname], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad of {pname}: {m}")
    local = sum(p.numel() for p in pm.parameters())
    full = sum(p.numel() for p in reference.parameters())
    return {"loss": loss.item(), "local_fraction": local / full, "dp": dp}


CASES = [
    # (model, world, tp, pp, vpp, microbatches, schedule)
    *[(m, 4, 2, 2, 1, 4, None) for m in ("gpt2", "llama", "mixtral")],  # tp=2 x pp=2
    *[(m, 4, 1, 2, 1, 2, None) for m in ("gpt2", "llama", "mixtral")],  # pp=2 x dp=2
    *[(m, 2, 1, 2, 2, 2, None) for m in ("gpt2", "llama", "mixtral")],  # pp=2, vpp=2 (interleaved)
    *[(m, 2, 1, 2, 1, 4, "zbh1") for m in ("gpt2", "llama", "mixtral")],  # pp=2, zero bubble
    ("llama", 4, 2, 2, 1, 4, "zbh1"),  # tp=2 x pp=2, zero bubble
    ("llama", 2, 1, 2, 1, 4, "gpipe"),
]


# One model per mechanism runs by default (tp x pp, pp x dp, interleaved, zero bubble, gpipe); the
# other models of each are the slow sweep (the default suite's time on CI's 2 cores).
DEFAULT_CASES = {("llama", 4, 2, 2, 1, 4, None), ("gpt2", 4, 1, 2, 1, 2, None), ("llama", 2, 1, 2, 2, 2, None),
                 *[(m, 2, 1, 2, 1, 4, "zbh1") for m in ("llama", "mixtral")]}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "world", "tp", "pp", "vpp", "microbatches", "schedule"),
    [pytest.param(*c, marks=() if c in DEFAULT_CASES else pytest.mark.slow) for c in CASES],
    ids=[f"{c[0]}-tp{c[2]}-pp{c[3]}-vpp{c[4]}-w{c[1]}-{c[6] or 'default'}" for c in CASES],
)
def test_pipeline_matches_unmodified_model(name: str, world: int, tp: int, pp: int, vpp: int, microbatches: int,
                                           schedule: str | None) -> None:  # fmt: skip
    results = run_on_ranks(_pipeline_on_rank, world, name, tp, pp, vpp, microbatches, schedule, timeout_s=400)
    assert len({round(r["loss"], 6) for r in results}) == 1, results
    assert results[0]["dp"] == world // (tp * pp)
    assert max(r["local_fraction"] for r in results) < 0.8  # no rank holds the whole model


def test_compiled_pipeline_matches_unmodified_model() -> None:
    """compile=True with pp=2 (each chunk through torch.compile) equals the eager model."""
    results = run_on_ranks(_pipeline_on_rank, 2, "llama", 1, 2, 1, 2, "1f1b", True, 2, timeout_s=900)
    assert len({round(r["loss"], 6) for r in results}) == 1, results


def _zero_bubble_refuses_compile(rank: int, world: int) -> str:
    import autotp

    ids = torch.zeros(4, 8, dtype=torch.long)
    pm = autotp.parallelize(build("llama", layers=2), pp=2, compile=True, example_inputs={"input_ids": ids, "labels": ids})
    with pytest.raises(ValueError) as err:
        pm.train_step(input_ids=ids, labels=ids, num_microbatches=2, schedule="zbh1")
    return str(err.value)


def test_zero_bubble_refuses_compiled_chunks_before_any_communication() -> None:
    for message in run_on_ranks(_zero_bubble_refuses_compile, 2):
        assert "torch.compile and CUDA graphs run a chunk's backward as one piece" in message


def _pipeline_errors(rank: int, world: int) -> list[str]:
    import autotp

    messages = []
    try:
        autotp.parallelize(build("llama", layers=2), pp=2, vpp=2)
    except ValueError as e:
        messages.append(str(e))
    pm = autotp.parallelize(build("llama", layers=2), pp=2)
    for batch, microbatches in ((6, 4), (4, 1)):
        ids = torch.zeros(batch, 8, dtype=torch.long)
        try:
            pm.train_step(input_ids=ids, labels=ids, num_microbatches=microbatches)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_pipeline_errors_say_what_is_allowed() -> None:
    too_many_chunks, batch, too_few = run_on_ranks(_pipeline_errors, 2)[0]
    assert "pp*vpp = 2*2 = 4 pipeline chunks but the model has 2 layers" in too_many_chunks
    assert "global batch of 6 does not split into dp=1 x 4 microbatches" in batch
    assert "1F1B needs at least as many microbatches as pipeline stages" in too_few


def _accumulate_two_steps(rank: int, world: int) -> dict:
    """Two train_steps without zero_grad: GPT-2's tied embedding (held by both stages) must
    accumulate like any other grad, not sum the first step's stage-summed grad twice."""
    import autotp

    model = build("gpt2", layers=2)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, vocab_size(model), (BATCH, SEQ), generator=gen) for _ in range(2)]
    pm = autotp.parallelize(model, tp=1, pp=2, example_inputs={"input_ids": batches[0][:2], "labels": batches[0][:2]})
    for ids in batches:
        pm.train_step(input_ids=ids, labels=ids, num_microbatches=2)
        _reference_step(reference, ids, ids, 2)
    grads = pm.unshard_grads()
    worst = {n: ((grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in reference.named_parameters()}
    return worst


def test_grads_accumulate_over_train_steps_for_parameters_shared_by_stages() -> None:
    for worst in run_on_ranks(_accumulate_two_steps, 2, timeout_s=400):
        assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


class _StridedHead(torch.nn.Module):
    """Two layers, and logits returned as a strided view (``[:, 0]`` of two heads' outputs),
    as ProphetNet's main stream is."""

    def __init__(self, vocab: int = 32, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(2))
        self.heads = torch.nn.Linear(hidden, 2 * vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        both = self.heads(h).view(*input_ids.shape, 2, -1).transpose(1, 2)  # [B, 2, S, V]
        logits = both[:, 0]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def _strided_outputs_on_rank(rank: int, world: int) -> None:
    import autotp

    torch.manual_seed(0)  # the same weights on both stages' ranks
    model = _StridedHead()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    pm = autotp.parallelize(model, pp=2, example_inputs={"input_ids": ids, "labels": ids})
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids, labels=ids)["logits"], reference(ids, ids)["logits"], rtol=RTOL, atol=ATOL)


def test_every_pipeline_rank_gets_strided_outputs_whole() -> None:
    # The last stage broadcast a strided view's memory as if it were contiguous: row 1 garbled on rank 0.
    run_on_ranks(_strided_outputs_on_rank, 2)


class _FairseqOutputs(_StridedHead):
    """Outputs as fairseq-style decoders return them (torchscale's): the logits and a dict of extras holding None."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        out = super().forward(input_ids, labels)
        return out["logits"], {"loss": out["loss"], "attn": None, "states": [None, out["logits"].mean()]}


def _outputs_holding_none_on_rank(rank: int, world: int) -> None:
    import autotp

    torch.manual_seed(0)
    model = _FairseqOutputs()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    pm = autotp.parallelize(model, pp=2, example_inputs={"input_ids": ids, "labels": ids})
    with torch.no_grad():
        logits, extras = pm(input_ids=ids, labels=ids)
        want_logits, want = reference(ids, ids)
    assert extras["attn"] is None and extras["states"][0] is None
    torch.testing.assert_close((logits, extras["loss"], extras["states"][1]), (want_logits, want["loss"], want["states"][1]), rtol=RTOL, atol=ATOL)


def test_every_pipeline_rank_gets_the_outputs_the_model_returns_as_none() -> None:
    # The last stage's outputs were broadcast leaf by leaf as tensors: a None among them raised on every rank.
    run_on_ranks(_outputs_holding_none_on_rank, 2)


def _float64_step(rank: int, world: int, pp: int, microbatches: int) -> tuple[str, float]:
    import autotp

    torch.manual_seed(0)
    model = _StridedHead().double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(3))
    pm = autotp.parallelize(model, tp=world // pp, pp=pp, example_inputs={"input_ids": ids, "labels": ids})
    loss = pm.train_step(input_ids=ids, labels=ids, num_microbatches=microbatches)
    expected = torch.stack([reference(input_ids=part, labels=part)["loss"] for part in ids.chunk(microbatches)]).mean()
    return str(loss.dtype), abs(loss.item() - expected.item())


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (1, 2)])
def test_a_float64_model_returns_its_loss_in_float64(pp: int, microbatches: int) -> None:
    """The step summed its microbatches' losses in float32 (at pp > 1 also the stages' zeros)."""
    for dtype, error in run_on_ranks(_float64_step, 2, pp, microbatches):
        assert dtype == "torch.float64" and error < 1e-12, (dtype, error)


def _one_row_microbatches(rank: int, world: int, schedule: str) -> list[str]:
    import plain_models_classics

    from autotp import parallelize

    name = "cait_class_attention"
    model = plain_models_classics.build(name)
    inputs = plain_models_classics.example_inputs(name)
    reference = copy.deepcopy(model)
    reference(**inputs)["loss"].backward()
    pm = parallelize(model, pp=world, example_inputs=inputs)
    pm.train_step(**inputs, num_microbatches=2, schedule=schedule)
    grads = pm.unshard_grads()
    return [n for n, p in reference.named_parameters() if not torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_parameter_whose_grad_is_the_received_gradient_accumulates_every_microbatch(schedule: str) -> None:
    """CaiT's class token lives on the first stage and reaches the second through the boundary,
    ``cls.expand(1, -1, -1)`` for a one-row microbatch: its gradient is a view of the gradient
    the first stage receives, which autograd keeps as ``cls.grad``. With one receive buffer
    reused per microbatch, the second microbatch's receive overwrote it: the class token's
    gradient was twice the second row's."""
    assert run_on_ranks(_one_row_microbatches, 2, schedule) == [[], []]
