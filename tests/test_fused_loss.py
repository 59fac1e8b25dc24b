"""The fused lm_head + cross entropy (``passes/fused_linear_cross_entropy``, ``autotp.ir.fused_loss``):
the op against ``F.cross_entropy(h @ W.T)``, where the pass applies and where it must not, and
``train_step`` against the unmodified model at tp=1, tp=2 and pp=2 (fp32, CPU)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.compiler import LOSS_ONLY, lower
from autotp.cost_model.fused_loss import LOSS_CHUNK_BYTES, loss_bytes_per_logit, loss_chunk_tokens
from autotp.analysis.trace import trace
from autotp.ir import ops
from distributed import run_on_ranks
from small_models import build, vocab_size

RTOL, ATOL = 1e-4, 1e-6
CHUNK = 5  # tokens per chunk in the tests: never divides their 16- or 32-token microbatches


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(("reduction", "code"), [("mean", 1), ("sum", 2)])
@pytest.mark.parametrize("chunk", [1, 3, 14, 100])
def test_op_matches_cross_entropy_of_the_linear(reduction: str, code: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    target = torch.randint(0, 50, (14,), generator=gen)
    target[[3, 9]] = -100
    expected = F.cross_entropy((hidden @ weight.t()).view(-1, 50), target, reduction=reduction)
    grads = torch.autograd.grad(expected * 0.7, (hidden, weight))
    loss = ops.LINEAR_CROSS_ENTROPY(hidden, weight, target, 0, 50, -100, code, chunk, 1, "unused")
    _close(loss, expected, "loss")
    for got, want, what in zip(torch.autograd.grad(loss * 0.7, (hidden, weight)), grads, ("hidden", "weight")):
        _close(got, want, f"grad of {what}")


def test_op_refuses_labels_outside_the_vocabulary() -> None:
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ops.LINEAR_CROSS_ENTROPY(hidden, weight, torch.tensor([1, 2, 10, -100]), 0, 10, -100, 1, 2, 1, "unused")


def _traced(model: nn.Module, tp: int) -> tuple[torch.fx.GraphModule, autotp.ParallelPlan]:
    ids = torch.randint(0, vocab_size(model), (2, 16), generator=torch.Generator().manual_seed(0))
    plan = autotp.compile_rank(model, tp=tp, example_inputs={"input_ids": ids, "labels": ids}, device="meta").plan
    return trace(model, {"input_ids": ids, "labels": ids, "use_cache": False}, "meta"), plan


def _lowered(model: nn.Module, chunk: int, outputs_read: tuple[str, ...]) -> torch.fx.GraphModule:
    traced, plan = _traced(model, 1)
    return lower(traced, replace(plan, loss_chunk_tokens=chunk), outputs_read=outputs_read).graph


def _fused_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is ops.LINEAR_CROSS_ENTROPY]


def test_fuses_only_where_nothing_else_reads_the_logits() -> None:
    model = build("llama", layers=1)
    assert len(_fused_nodes(_lowered(model, CHUNK, LOSS_ONLY))) == 1
    assert not _fused_nodes(_lowered(model, CHUNK, ())), "the caller reads the logits: they must stay"
    assert not _fused_nodes(_lowered(model, 0, LOSS_ONLY)), "plan.loss_chunk_tokens = 0 switches the pass off"


class _SoftCapped(nn.Module):
    """Logits scaled by a tanh soft cap before the loss: not a plain linear -> loss."""

    def __init__(self, vocab: int = 40, hidden: int = 16, reduction: str = "mean", cap: bool = True) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
        self.reduction, self.cap = reduction, cap

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if self.cap:
            logits = 30.0 * torch.tanh(logits / 30.0)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction=self.reduction)
        return {"loss": loss if self.reduction != "none" else loss.mean(), "logits": logits}


@pytest.mark.parametrize(("reduction", "cap", "fused"), [("mean", True, False), ("none", False, False), ("sum", False, True)])
def test_leaves_other_losses_alone_and_matches_them(reduction: str, cap: bool, fused: bool) -> None:
    torch.manual_seed(0)
    model = _SoftCapped(reduction=reduction, cap=cap)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    pm = autotp.parallelize(model, tp=1, example_inputs=inputs)
    pm = autotp.parallelize(model, tp=1, example_inputs=inputs, plan=replace(pm.plan, loss_chunk_tokens=CHUNK))
    loss = pm.train_step(**inputs)
    assert bool(_fused_nodes(pm._compiled_for(pm._as_kwargs((), inputs), LOSS_ONLY).graph)) == fused
    expected = reference(**inputs)["loss"]
    expected.backward()
    _close(loss, expected.detach(), "loss")
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        _close(grads[name], p.grad, f"grad of {name}")


def _train_step_matches(rank: int, world: int, name: str, tp: int, pp: int) -> dict[str, float]:
    """``train_step`` (2 microbatches, ignored labels, chunks of ``CHUNK`` tokens) against the
    unmodified model on the whole batch: loss and every gradient. The first microbatch counts 5
    tokens fewer, so its mean weighs less than half (``autotp.ir.batch_denominators``). A
    router's load-balancing loss (mixtral_aux) is a product of means over the tokens, which
    train_step computes per microbatch, as Megatron and HF's Trainer do."""
    model = build(name)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size(model), (4, 16), generator=gen)
    labels = torch.randint(0, vocab_size(model), (4, 16), generator=gen)
    labels[0, :5] = -100
    micro = {"input_ids": ids[:2], "labels": labels[:2]}
    planned = autotp.compile_rank(model, tp=tp, pp=pp, example_inputs=micro, device="meta").plan
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs=micro, plan=replace(planned, loss_chunk_tokens=CHUNK))
    loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=2)
    fused = len(_fused_nodes(pm._compiled_for(pm._as_kwargs((), micro), LOSS_ONLY).graph))
    whole = reference(input_ids=ids, labels=labels)
    expected = whole.loss
    if getattr(whole, "aux_loss", None) is not None:
        coef = reference.config.router_aux_loss_coef
        per_micro = [reference(input_ids=ids[i : i + 2], labels=labels[i : i + 2]).aux_loss for i in (0, 2)]
        expected = expected - coef * whole.aux_loss + coef * sum(per_micro) / 2
    expected.backward()
    _close(loss, expected.detach(), "loss")
    grads = pm.unshard_grads()
    for pname, p in reference.named_parameters():
        _close(grads[pname], p.grad, f"grad of {pname}")
    return {"fused": fused, "loss": loss.item()}


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral_aux", "qwen2"])
def test_train_step_matches_at_tp1(name: str) -> None:
    assert _train_step_matches(0, 1, name, 1, 1)["fused"] == 1


@pytest.mark.parametrize(("name", "tp", "pp"), [("llama", 2, 1), pytest.param("gpt2", 2, 1, marks=pytest.mark.slow), ("llama", 1, 2)])
def test_train_step_matches_at_tp2_and_pp2(name: str, tp: int, pp: int) -> None:
    results = run_on_ranks(_train_step_matches, tp * pp, name, tp, pp, timeout_s=400)
    assert len({round(r["loss"], 6) for r in results}) == 1, results
    assert all(r["fused"] == 1 for r in results), "every rank's graph holds the fused loss (pp: in its whole graph)"


@pytest.mark.slow
def test_train_step_matches_with_a_padded_vocabulary_at_tp4() -> None:
    """gpt2-tiny's 130 tokens over 4 ranks: 33 rows each, the last rank's last 2 padded."""
    results = run_on_ranks(_train_step_matches, 4, "gpt2", 4, 1, timeout_s=600)
    assert all(r["fused"] == 1 for r in results)


def test_train_step_at_tp2_gathers_no_logits() -> None:
    traced, plan = _traced(build("llama", layers=1), 2)
    full, loss_only = (lower(traced, plan, outputs_read=read).graph for read in ((), LOSS_ONLY))
    assert any(n.target is ops.GATHER_FROM_TP for n in full.graph.nodes)
    assert not any(n.target is ops.GATHER_FROM_TP for n in loss_only.graph.nodes)
    assert len(_fused_nodes(loss_only)) == 1


def test_cost_model_chunks_a_large_vocabulary() -> None:
    """Llama-3's 128256 tokens: chunks of LOSS_CHUNK_BYTES of float32 logits, per tp rank's share."""
    from transformers import LlamaConfig

    from autotp.compiler import trace_for_planning

    config = LlamaConfig(vocab_size=128256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    costs = trace_for_planning(config, 64)
    assert loss_chunk_tokens(costs.gm, 1, set()) == LOSS_CHUNK_BYTES // (4 * 128256)
    assert loss_chunk_tokens(costs.gm, 2, {"lm_head.weight"}) == LOSS_CHUNK_BYTES // (4 * 64128)
    assert costs.rank(2, frozenset(), True).plan.loss_chunk_tokens == LOSS_CHUNK_BYTES // (4 * 64128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cost_model_counts_the_bytes_the_loss_moves(dtype: torch.dtype) -> None:
    """``loss_bytes_per_logit``: what the op's kernels read and write of logit-sized tensors, counted
    at dispatch (views move nothing; gather and scatter_add touch one logit per token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    tokens, hidden_size, vocab = 12, 16, 37  # chunks of 5, 5 and 2 tokens; a prime vocabulary: no other tensor's size is a multiple
    moved = [0]

    def logit_sized(t: object) -> bool:
        return isinstance(t, torch.Tensor) and t.numel() % vocab == 0 and 0 < t.numel() // vocab < hidden_size

    class CountBytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func.overloadpacket not in (aten.gather, aten.scatter_add_):
                leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
                moved[0] += sum(t.numel() * t.element_size() for t in leaves if logit_sized(t))
            return out

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    with CountBytes():
        ops.LINEAR_CROSS_ENTROPY(hidden, weight, target, 0, vocab, -100, 1, CHUNK, 1, "unused")
    assert moved[0] == loss_bytes_per_logit(dtype.itemsize) * tokens * vocab
