"""``autotp explain`` and the FLOP counts behind it: golden JSON, tables, pipelines, errors.

The golden files are the ``--format json`` output less what the trace alone decides
(``tests/goldens.py``). After an intended change, regenerate them with
``AUTOTP_UPDATE_GOLDEN=1 python -m pytest -q tests/test_explain.py`` and review the diff.
"""

from __future__ import annotations

import json

import pytest
import torch

from autotp import compile_rank, presets
from autotp.cli import main
from autotp.cost_model.flops import TensorInfo, global_tensors, node_cost, op_name
from autotp.cost_model.graph_costs import build_report
from goldens import check_golden



def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["explain", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-small"])
def test_explain_json_matches_golden(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, model, "--tp", "2", "--seq", "128", "--format", "json")
    check_golden(f"explain_{model}_tp2.json", json.loads(out))


def test_llama_decoder_layers_meet_megatrons_minimum(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(_explain(capsys, "llama-tiny", "--tp", "2", "--seq", "64", "--format", "json"))
    layers = {entry["layer"]: entry for entry in data["layers"]}
    assert list(layers) == ["embedding", 0, 1, "head"]
    for index in (0, 1):
        assert layers[index]["collectives"]["all_reduce"] == {"forward": 2, "backward": 2}
        # [1, 64, 64] bf16 activations: 8192 bytes per all-reduce.
        assert layers[index]["collective_bytes"]["all_reduce"] == {"forward": 2 * 8192, "backward": 2 * 8192}
    assert layers["embedding"]["collectives"]["all_reduce"] == {"forward": 1, "backward": 0}
    # The vocab-parallel loss: row max [64] and [2, 64] sums, float32; the f before lm_head.
    assert layers["head"]["collectives"]["all_reduce"] == {"forward": 2, "backward": 1}
    assert layers["head"]["collective_bytes"]["all_reduce"]["forward"] == 64 * 4 + 2 * 64 * 4
    assert data["megatron_minimum"] == {
        "decoder_layers": 2,
        "all_reduce": {"forward": 4, "backward": 4},
        "plan_all_reduce": {"forward": 4, "backward": 4},
        "meets": True,
    }
    assert data["totals"]["collectives"]["all_reduce"] == {"forward": 7, "backward": 5}


def test_table_collapses_identical_layers(capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "llama-tiny", "--tp", "2", "--seq", "64")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line and line.split()[0] in ("embedding", "0-1", "head", "total")}
    assert rows["0-1"][1:6] == ["(each)", "2", "2", "0", "0.0"], out
    assert rows["total"][1:4] == ["7", "5", "1"], out
    assert "Megatron minimum for 2 decoder layers: 4 forward + 4 backward all-reduces; this plan: 4 + 4 (meets it)" in out


def test_replicated_kv_heads_add_gradient_all_reduces_to_their_layer(capsys: pytest.CaptureFixture[str]) -> None:
    # tp=8 > 4 KV heads: k_proj and v_proj are held by pairs of ranks, whose grads f sums.
    data = json.loads(_explain(capsys, "llama-tiny", "--tp", "8", "--seq", "32", "--format", "json"))
    layers = {entry["layer"]: entry for entry in data["layers"]}
    assert layers[0]["collectives"]["all_reduce"] == {"forward": 2, "backward": 4}
    assert layers["embedding"]["collectives"]["all_reduce"] == {"forward": 1, "backward": 0}
    assert not data["megatron_minimum"]["meets"]


def test_pipeline_stages_split_layers_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(_explain(capsys, "llama-tiny", "--tp", "2", "--pp", "2", "--seq", "64", "--format", "json"))
    assert [(e["layer"], e["stage"]) for e in data["layers"]] == [("embedding", 0), (0, 0), (1, 1), ("head", 1)]
    assert [s["stage"] for s in data["stages"]] == [0, 1]
    # One boundary carries layer 0's [1, 64, 64] bf16 output into stage 1, and its grad back.
    assert data["totals"]["collectives"]["p2p"] == {"forward": 1, "backward": 1}
    assert data["totals"]["collective_bytes"]["p2p"] == {"forward": 8192, "backward": 8192}
    params = sum(s["param_bytes_per_rank"] for s in data["stages"])
    assert params == data["totals"]["param_bytes_per_rank"]
    table = _explain(capsys, "llama-tiny", "--tp", "2", "--pp", "2", "--seq", "64")
    assert "stage 0 total" in table and "stage 1 total" in table


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pp", "2", "--stage", "2"], "--stage 2 does not exist with --pp 2; pick 0..1"),
        (["--seq", "4096"], "--seq 4096 exceeds the model's max_position_embeddings (256)"),
        (["--tp", "0"], "--tp must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_the_fix(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    command = "dump" if "--stage" in args else "explain"
    assert main([command, "llama-tiny", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


# ---- FLOPs and bytes -------------------------------------------------------------------


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_flops_of_llama_layer_follow_the_formulas() -> None:
    seq, tp = 64, 2
    model = presets.build_model("llama-tiny", dtype=torch.bfloat16)
    ids = torch.zeros(1, seq, dtype=torch.long)
    compiled = compile_rank(model, tp=tp, example_inputs={"input_ids": ids})
    report = build_report(compiled.graph, compiled.plan, 0)
    by_target = {}
    for r in report.nodes:
        if r.layer == 0 and r.op in ("linear", "scaled_dot_product_attention"):
            by_target.setdefault(r.op, []).append(r)
    # Local linears: q 64->32, k and v 64->16, o 32->64, gate and up 64->64, down 64->64 (row: K=64).
    linear = [r.flops for r in by_target["linear"]]
    assert linear == [2 * seq * k * n for k, n in [(64, 32), (64, 16), (64, 16), (32, 64), (64, 64), (64, 64), (64, 64)]]
    (attention,) = by_target["scaled_dot_product_attention"]
    heads, head_dim = 4, 8  # 8 heads / tp 2; HF's mask is proven causal and dropped, so half of L x S is counted
    assert attention.flops == 2 * 2 * heads * seq * seq * head_dim // 2
    assert attention.tensors == (TensorInfo((1, heads, seq, head_dim), torch.bfloat16),)


class _CausalAttention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(2, 16, 32) * 2


def test_causal_attention_counts_half_and_views_are_free() -> None:
    q = torch.randn(2, 4, 16, 8)
    graph = torch.export.export(_CausalAttention(), (q, q, q)).graph_module.graph
    costs = {op_name(n.target): node_cost(n) for n in graph.nodes if n.op == "call_function"}
    assert costs["scaled_dot_product_attention"].flops == (2 * 8 * 16 * 16 * 8 * 2) // 2
    assert costs["scaled_dot_product_attention"].bytes == 4 * (2 * 4 * 16 * 8 * 4)  # q, k, v, out in f32
    assert costs["transpose"].flops == costs["transpose"].bytes == 0
    assert costs["mul"].flops == 2 * 16 * 32


def test_grouped_mm_and_embedding_costs() -> None:
    model = presets.build_model("mixtral-tiny", dtype=torch.bfloat16)
    ids = torch.zeros(1, 16, dtype=torch.long)
    compiled = compile_rank(model, tp=1, example_inputs={"input_ids": ids})
    grouped = [n for n in compiled.graph.graph.nodes if "grouped_mm" in str(n.target)]
    assert grouped
    for n in grouped:
        (out,) = global_tensors(n)
        k = global_tensors(n.args[0])[0].shape[-1]
        assert node_cost(n).flops == 2 * out.numel * k
    embedding = next(n for n in compiled.graph.graph.nodes if n.target is torch.ops.aten.embedding.default)
    (out,) = global_tensors(embedding)
    assert node_cost(embedding).flops == 0
    assert node_cost(embedding).bytes == 16 * 8 + 2 * out.nbytes  # int64 ids, rows read, output written


def test_sequence_parallel_table_counts_reduce_scatters(capsys: pytest.CaptureFixture[str]) -> None:
    out = _explain(capsys, "llama-tiny", "--tp", "2", "--seq", "64", "--sequence-parallel")
    header = next(line for line in out.splitlines() if line.startswith("layer"))
    assert header.split()[:12] == ["layer", "fwd", "AR", "bwd", "AR", "fwd", "AG", "bwd", "AG", "fwd", "RS", "bwd"]
    each = next(line for line in out.splitlines() if line.startswith("0-1 (each)")).split()
    # per decoder layer: the all-reduces became 2 reduce-scatters and 2 all-gathers, each the other's backward
    assert each[2:8] == ["0", "2", "2", "2", "2", "2"] and "RS reduce-scatter" in out
    plain = _explain(capsys, "llama-tiny", "--tp", "2", "--seq", "64")
    assert "RS" not in plain
