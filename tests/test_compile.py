"""Offline compilation (no process group): collective counts, plans, meta models, errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import autotp
from autotp.ir import ops
from autotp.ir.plan import ParallelPlan
from autotp.presets import build_model

_LAYER = re.compile(r"\.(\d+)(?:\.|$)")  # model.layers.3..., transformer.h.3...


def _layer_of(node: torch.fx.Node) -> int | None:
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        m = _LAYER.search(path)
        if m:
            return int(m.group(1))
    return None


def _count(gm: torch.fx.GraphModule, target: object) -> dict[int | None, int]:
    counts: dict[int | None, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is target:
            layer = _layer_of(node)
            counts[layer] = counts.get(layer, 0) + 1
    return counts


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "mixtral-tiny"])
def test_megatron_minimum_collectives_per_decoder_layer(name: str) -> None:
    model = build_model(name)
    ids = torch.zeros(2, 16, dtype=torch.long)
    compiled = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids, "labels": ids})
    layers = model.config.num_hidden_layers
    forward, backward = _count(compiled.graph, ops.REDUCE_FROM_TP), _count(compiled.graph, ops.COPY_TO_TP)
    for layer in range(layers):
        assert forward.get(layer) == 2, f"layer {layer}: forward all-reduces {forward}"
    # Outside the layers: one all-reduce completes the vocab-parallel embedding.
    assert forward.get(None) == 1, forward
    # Backward: the f before attention and before the MLP; Mixtral adds one on the
    # routing weights, which multiply the experts' partial output.
    per_layer_backward = 3 if name == "mixtral-tiny" else 2
    for layer in range(layers):
        assert backward.get(layer) == per_layer_backward, f"layer {layer}: backward all-reduces {backward}"
    # The loss is vocab-parallel: one parallel cross-entropy, no gathered logits on its path.
    assert sum(_count(compiled.graph, ops.VOCAB_PARALLEL_CROSS_ENTROPY).values()) == 1


def test_meta_model_plans_without_allocating() -> None:
    model = build_model("llama3-8b")  # 8B parameters on meta: 32 GB if anything allocated
    compiled = autotp.compile_rank(model, tp=8, example_inputs={"input_ids": torch.zeros(1, 128, dtype=torch.long)})
    kinds: dict[str, int] = {}
    for p in compiled.plan.params:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    # q, k, v, gate, up column and o, down row in each of the 32 layers; vocab-parallel embedding and lm_head
    assert kinds == {"column": 5 * 32 + 1, "row": 2 * 32, "vocab": 1}, kinds
    assert all(p.device.type == "meta" for p in model.parameters())
    k_proj = compiled.plan.layout_of("model.layers.0.self_attn.k_proj.weight")
    assert k_proj is not None and k_proj.sharding.local_size(8) == 128  # one of 8 KV heads per rank


def test_plan_round_trips_through_json() -> None:
    model = build_model("gpt2-tiny")
    compiled = autotp.compile_rank(model, tp=4)
    again = ParallelPlan.from_json(compiled.plan.to_json())
    assert again == compiled.plan
    qkv = again.layout_of("transformer.h.0.attn.c_attn.weight")
    assert qkv is not None and qkv.kind == "column" and qkv.dim == 1  # Conv1D stores [in, out]
    assert qkv.sharding.segments == (64, 64, 64)  # q, k and v sharded one by one


def test_plan_is_followed_when_given() -> None:
    model = build_model("llama-tiny")
    auto = autotp.compile_rank(model, tp=2).plan
    kept = ParallelPlan(tp=2, params=tuple(p for p in auto.params if "mlp" not in p.name))
    compiled = autotp.compile_rank(model, tp=2, plan=kept)
    assert _count(compiled.graph, ops.REDUCE_FROM_TP).get(0) == 1  # only attention is split now


def test_heads_not_divisible_by_tp_names_the_parameter() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128,
                                             num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=6))
    with pytest.raises(ValueError, match=r"q_proj.*tp=4|tp=4.*q_proj") as info:
        autotp.compile_rank(model, tp=4)
    assert "6 blocks" in str(info.value)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate(x).sum().item() > 0:  # host sync: export cannot follow this branch
            return x * 2
        return x


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_untraceable_op_names_module_and_line() -> None:
    with pytest.raises(ValueError) as info:
        autotp.compile_rank(_Wrapper(), tp=2, example_inputs={"x": torch.randn(2, 8)}, device="cpu")
    message = str(info.value)
    assert "block (_DataDependent)" in message
    assert "test_compile.py" in message and ".item()" in message


def test_lowering_leaves_the_traced_graph_alone() -> None:
    from autotp import compiler

    model = build_model("llama-tiny")
    planned = compiler.plan_model(model, None, "meta", tp=2, pp=1, dp=1, vpp=1, plan=None)
    before = planned.traced.code
    lowered = compiler.lower(planned.traced, planned.plan, tp_rank=1)
    assert planned.traced.code == before and lowered.graph.code != before
    assert compiler.lower(planned.traced, planned.plan, tp_rank=1).graph.code == lowered.graph.code
