"""``causal_attention``: masks proven causal-only become SDPA ``is_causal=True``; any mask that
an input can change stays; numerics equal the unmodified model either way (fp32, CPU)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.ir import meta_keys
from autotp.ir.plan import ParallelPlan
from autotp.passes.causal_attention import CAUSAL, SDPA, causal_attention
from autotp.passes.runner import PassContext
from distributed import run_on_ranks
from small_models import build, vocab_size

RTOL, ATOL = 1e-5, 1e-6


def _sdpa_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is SDPA]


def _check(pm: nn.Module, reference: nn.Module, **kwargs: torch.Tensor) -> None:
    out, expected = pm(**kwargs), reference(**kwargs)
    torch.testing.assert_close(out.logits, expected.logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=ATOL)
    out.loss.backward()
    expected.loss.backward()
    grads = pm.unshard_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad of {name}: {m}")
        p.grad = None
    for p in pm.parameters():
        p.grad = None


def _inputs(model: nn.Module, padded: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size(model), (2, 12), generator=gen)
    kwargs = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, :5] = 0  # left padding on the first sequence
        kwargs["attention_mask"] = mask
    return kwargs


@pytest.mark.parametrize("name", ["llama", "gpt2", "mixtral", "qwen2"])
def test_causal_mask_becomes_is_causal_and_padding_mask_stays(name: str) -> None:
    model = build(name, layers=1)
    reference = copy.deepcopy(model)
    plain, padded = _inputs(model, False), _inputs(model, True)
    pm = autotp.parallelize(model, tp=1, example_inputs=plain)
    assert pm.plan.causal_attention_nodes, "the plan records the rewritten attention"

    nodes = _sdpa_nodes(pm.graph_for(**plain))
    assert nodes and all(n.meta[meta_keys.CAUSAL_MASK] == CAUSAL for n in nodes)
    assert all(n.args[3] is None and n.args[5] is True for n in nodes)
    _check(pm, reference, **plain)

    nodes = _sdpa_nodes(pm.graph_for(**padded))
    assert nodes and all("attention_mask" in n.meta[meta_keys.CAUSAL_MASK] for n in nodes)
    assert all(isinstance(n.args[3], torch.fx.Node) for n in nodes)
    _check(pm, reference, **padded)


def test_all_ones_attention_mask_input_is_kept() -> None:
    """An all-ones ``attention_mask`` is causal today, but the input could change: keep it."""
    model = build("llama", layers=1)
    kwargs = _inputs(model, False) | {"attention_mask": torch.ones(2, 12, dtype=torch.long)}
    pm = autotp.parallelize(model, tp=1, example_inputs=kwargs)
    assert pm.plan.causal_attention_nodes == ()
    assert all(isinstance(n.args[3], torch.fx.Node) for n in _sdpa_nodes(pm.graph_for(**kwargs)))


def test_bidirectional_encoder_is_not_made_causal() -> None:
    model = build("bert")
    ids = torch.randint(0, vocab_size(model), (2, 12))
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": ids})
    nodes = _sdpa_nodes(pm.graph_for(input_ids=ids))
    assert all(not (len(n.args) > 5 and n.args[5]) for n in nodes)
    torch.testing.assert_close(pm(input_ids=ids).logits, model(input_ids=ids).logits, rtol=RTOL, atol=ATOL)


def test_plan_switch_keeps_the_mask() -> None:
    model = build("llama", layers=1)
    plain = _inputs(model, False)
    plan = replace(ParallelPlan(), causal_attention=False)
    pm = autotp.parallelize(model, tp=1, example_inputs=plain, plan=plan)
    nodes = _sdpa_nodes(pm.graph_for(**plain))
    assert nodes and all(isinstance(n.args[3], torch.fx.Node) for n in nodes)
    assert pm.plan.causal_attention_nodes == ()


class _MaskedAttention(nn.Module):
    """SDPA with a mask built from the shapes: ``kind`` picks causal, shifted or biased."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        pos = torch.arange(s, device=x.device)
        if self.kind == "causal_bool":
            mask = pos[None, :] <= pos[:, None]
        elif self.kind == "causal_float":
            mask = torch.zeros(s, s, device=x.device).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        elif self.kind == "shifted":  # allows one future token
            mask = pos[None, :] <= pos[:, None] + 1
        else:  # causal with an ALiBi-like bias
            mask = torch.where(pos[None, :] <= pos[:, None], (pos[None, :] - pos[:, None]).float() * 0.1, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None].expand(b, 1, s, s)).sum(1)


@pytest.mark.parametrize(
    ("kind", "rewritten"), [("causal_bool", True), ("causal_float", True), ("shifted", False), ("biased", False)]
)
def test_only_the_exact_causal_pattern_is_rewritten(kind: str, rewritten: bool) -> None:
    from autotp.analysis.trace import trace

    model = _MaskedAttention(kind)
    x = torch.randn(2, 6, 16)
    gm = trace(model, {"x": x})
    gm = causal_attention(gm, PassContext(plan=ParallelPlan()))
    gm.recompile()
    (node,) = _sdpa_nodes(gm)
    assert (node.meta[meta_keys.CAUSAL_MASK] == CAUSAL) is rewritten, node.meta[meta_keys.CAUSAL_MASK]
    assert (node.args[3] is None) is rewritten
    gm.load_state_dict(model.state_dict(), strict=False, assign=True)
    torch.testing.assert_close(gm(x=x), model(x), rtol=RTOL, atol=ATOL)


def _tp2_on_rank(rank: int, world: int) -> None:
    model = build("llama")
    reference = copy.deepcopy(model)
    pm = autotp.parallelize(model, tp=world, example_inputs=_inputs(model, False))
    assert pm.plan.causal_attention_nodes
    _check(pm, reference, **_inputs(model, False))
    _check(pm, reference, **_inputs(model, True))


def test_tp2_with_and_without_padding() -> None:
    run_on_ranks(_tp2_on_rank, 2)
