"""``autotp dump``: annotated code, JSON, DOT with collapsed layers, SVG, passes, stages."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from autotp.passes import PASSES

import autotp.report.dump
from autotp.cli import main


def _dump(tmp_path: Path, *args: str, model: str = "llama-tiny") -> Path:
    assert main(["dump", model, "--tp", "2", "--seq", "32", "--out", str(tmp_path), *args]) == 0
    return tmp_path


def test_code_annotates_layouts_collectives_and_flops(tmp_path: Path) -> None:
    code = (_dump(tmp_path, "--format", "code") / "llama-tiny_tp2_rank0.py").read_text()
    assert "# ---- embedding ----" in code and "# ---- layer 1 ----" in code and "# ---- head ----" in code
    # q_proj is column-parallel: this rank computes 32 of 64 output features.
    assert re.search(r"^linear: bf16\[1, 32, 32\] = aten\.linear\.default\(copy_to_tp, \S+\)  # Shard\(2:32/64\) \| 131\.1 kFLOP", code, re.MULTILINE), code
    assert re.search(r"^reduce_from_tp_\d+: .* # Replicate \| all_reduce forward 4\.1 kB over 2 ranks, \d+\.\d µs$", code, re.MULTILINE)
    assert re.search(r"^copy_to_tp: .* \| all_reduce backward 4\.1 kB over 2 ranks", code, re.MULTILINE)
    assert re.search(r"^cross_entropy_loss: .*all_reduce forward 128 B .*all_reduce forward 256 B", code, re.MULTILINE)
    assert "CUDA-graph regions: set when the plan asks for CUDA graphs" in code


def test_json_lists_every_node_with_its_annotations(tmp_path: Path) -> None:
    data = json.loads((_dump(tmp_path, "--format", "json") / "llama-tiny_tp2_rank0.json").read_text())
    nodes = {n["name"]: n for n in data["nodes"]}
    linear = nodes["linear"]
    assert (linear["layer"], linear["stage"], linear["layout"], linear["shapes"]) == (0, 0, "Shard(2:32/64)", [[1, 32, 32]])
    assert linear["cudagraph_region"] is None and linear["flops"] == 2 * 32 * 64 * 32 and linear["est_time_s"] > 0
    forward = [c for n in data["nodes"] for c in n["collectives"] if c["kind"] == "all_reduce" and c["direction"] == "forward"]
    assert len(forward) == data["totals"]["collectives"]["all_reduce"]["forward"] == 7
    assert data["hardware"]["name"] == "H200"


def _config_folder(tmp_path: Path, layers: int) -> Path:
    folder = tmp_path / "llama-6"
    folder.mkdir()
    config = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_dot_expands_layer_0_and_collapses_the_others(tmp_path: Path) -> None:
    folder = _config_folder(tmp_path, layers=6)
    out = _dump(tmp_path / "out", "--format", "dot", model=str(folder))
    dot = (out / "llama-6_tp2_rank0.dot").read_text()
    for layer in range(1, 6):
        assert re.search(rf'^  layer_{layer} \[label="layer {layer}, collapsed\\n\d+ ops', dot, re.MULTILINE), dot
    assert "subgraph cluster_0 {" in dot and "subgraph cluster_1 {" not in dot
    assert "all-reduce 2 fwd + 2 bwd" in dot
    assert "  layer_1 -> layer_2;" in dot
    assert dot.count("model_layers_0_") > 0 and "n_model_layers_3_" not in dot


def test_svg_renders_with_graphviz(tmp_path: Path) -> None:
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed (apt-get install graphviz)")
    svg = (_dump(tmp_path, "--format", "svg") / "llama-tiny_tp2_rank0.svg").read_text()
    assert "<svg" in svg and "reduce_from_tp" in svg and "layer 1, collapsed" in svg


def test_svg_falls_back_to_dot_without_graphviz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(autotp.report.dump.shutil, "which", lambda name: None)
    out = _dump(tmp_path, "--format", "svg")
    assert (out / "llama-tiny_tp2_rank0.dot").is_file() and not (out / "llama-tiny_tp2_rank0.svg").exists()
    assert "SVG needs Graphviz's `dot` program (apt-get install graphviz); wrote DOT instead" in capsys.readouterr().err


def test_after_a_pass_and_dump_dir(tmp_path: Path) -> None:
    passes = tmp_path / "passes"
    out = _dump(tmp_path / "out", "--after", "annotate_layouts", "--dump-dir", str(passes))
    before = (out / "llama-tiny_tp2_rank0_after_02_annotate_layouts.py").read_text()
    assert "reduce_from_tp" not in before and "aten.linear.default" in before
    written = sorted(p.name for p in passes.iterdir())
    inserted = f"{[p.__name__ for p in PASSES].index('insert_collectives') + 1:02d}_insert_collectives.py"
    assert written[0] == "00_traced.py" and inserted in written
    assert "reduce_from_tp" in (passes / inserted).read_text()


def test_after_needs_code_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", "llama-tiny", "--out", str(tmp_path), "--after", "traced", "--format", "dot"]) == 2
    assert "use --format code" in capsys.readouterr().err


def test_stage_view_shows_its_boundary(tmp_path: Path) -> None:
    code = (_dump(tmp_path, "--pp", "2", "--stage", "1") / "llama-tiny_tp2_rank0_pp2_stage1.py").read_text()
    assert "pipeline stage 1 of 2" in code
    assert re.search(r"^stage_boundary: bf16\[1, 32, 64\] = stage_boundary\(add_\d+, 1\)  # .*p2p forward 4\.1 kB", code, re.MULTILINE)
    assert "# ---- layer 1 ----" in code and "# ---- layer 0 ----" not in code
