"""``autotp calibrate``'s fits (``autotp.cost_model.calibrate``), shared with ``benchmarks/measure_constants.py``:
GEMM rows as GPU time, causal attention over shapes, one-rank calibrations. The GPU measurement itself runs on
a device (``python -m autotp calibrate``); these check the fitting on synthetic rows."""

from __future__ import annotations

import torch
import pytest

from autotp.cost_model import calibrate
from autotp.cost_model.flops import attention_flops, node_cost
from autotp.cost_model.hardware import H100, HardwareProfile
from autotp.ir.op_facts import Collective


def _sdpa_node_flops(shape: tuple[int, ...]) -> int:
    """What the cost model counts for the causal attention node a traced model holds at ``shape``."""

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.zeros(shape, device="meta")
    gm = torch.export.export(Attention(), (q, q, q)).module()
    (node,) = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    return node_cost(node).flops


def _attention_rows(profile: HardwareProfile, shapes: list[tuple[int, int, int, int]]) -> list[dict]:
    """Rows as ``autotp.cli.measure.attention_row`` writes them, for kernels that run as ``profile`` says."""
    rows = []
    for shape in shapes:
        forward = float(profile.attention_time_s(_sdpa_node_flops(shape)))
        rows.append({"shape": list(shape), "forward_s": 2 * forward, "both_s": 9 * forward,  # host-timed: ignored
                     "gpu_forward_s": forward, "gpu_both_s": forward * (1 + profile.attention_backward_factor)})
    return rows


def test_attention_fit_counts_the_flops_the_cost_model_charges() -> None:
    """Kernels timed at the FLOPs of the traced node give back that rate (the H100 fit once halved the count again,
    and every attention node then cost twice its measured time)."""
    truth = HardwareProfile("gpu", 700e12, 3e12, 300e9, 25e-6, attention_flops_per_s=500e12, attention_latency_s=12e-6,
                            attention_backward_factor=3.0)  # fmt: skip
    shapes = [(1, 16, 1024, 128), (4, 16, 1024, 128), (8, 16, 2048, 128), (2, 16, 4096, 128)]
    assert _sdpa_node_flops(shapes[0]) == attention_flops(shapes[0], shapes[0], shapes[0], causal=True)
    fitted = calibrate.fit_attention(_attention_rows(truth, shapes))
    assert fitted["attention_flops_per_s"] == pytest.approx(500e12, rel=1e-6)
    assert fitted["attention_latency_s"] == pytest.approx(12e-6, rel=1e-6)
    assert fitted["attention_backward_factor"] == pytest.approx(3.0)


def test_gemm_curve_takes_gpu_time_and_bins_shapes_by_flops() -> None:
    """GPU time where captured (the host's issue cost is the queue's), host-timed otherwise; equal-FLOP shapes merge."""
    def row(m: int, k: int, n: int, gpu: list | None, host: float) -> dict:
        return {"m": m, "k": k, "n": n, "flops": 2.0 * m * k * n, "forward_s": host, "input_grad_s": host,
                "weight_grad_s": host, "gpu_s": gpu}  # fmt: skip

    rows = [row(1024, 1024, 1024, [1e-5, 2e-5, 3e-5], 9e-5), row(1024, 1024, 1024, [2e-5, 2e-5, 2e-5], 9e-5),
            row(4096, 4096, 4096, [None, None, None], 4e-4)]  # fmt: skip
    curve = calibrate.gemm_curve(rows)
    assert [f for f, _ in curve] == pytest.approx([2.0 * 1024**3, 2.0 * 4096**3])
    assert curve[0][1] == pytest.approx(2e-5) and curve[1][1] == pytest.approx(4e-4)


def _host_run(layers: int) -> dict[str, float]:
    calls, grads = 10 + 40 * layers, 8 + 30 * layers
    forward = calls * 10e-6
    return {"tp": 1, "layers": layers, "forward_s": forward, "both_s": forward + grads * 40e-6 + 1e-3, "calls": calls,
            "grad_calls": grads, "forward_collectives": 0, "backward_collectives": 0}  # fmt: skip


def test_one_gpu_calibration_keeps_the_links_it_cannot_measure() -> None:
    """One rank measures no collective: the links and the tp collective's host cost stay the built-in profile's."""
    assert "collective_host_s" not in calibrate.fit_host([_host_run(2), _host_run(6)])
    shapes = [(1, 16, 1024, 128), (8, 16, 2048, 128), (2, 16, 4096, 128)]
    measured = {
        "device_name": "NVIDIA H100 80GB HBM3",
        "host": [_host_run(2), _host_run(6)],
        "gemm": [{"m": m, "k": 4096, "n": 4096, "flops": 2.0 * m * 4096 * 4096, "forward_s": 1.0, "input_grad_s": 1.0,
                  "weight_grad_s": 1.0, "gpu_s": [5e-6 + 2.0 * m * 4096 * 4096 / 700e12] * 3} for m in (1024, 4096, 16384)],
        "attention": _attention_rows(H100, shapes),
        "memory_bytes_per_s": 3e12, "elementwise_backward_factor": 2.2, "memory_capacity_bytes": 80e9,
    }  # fmt: skip
    profile = calibrate.fit_profile(measured, 1)
    assert (profile.intra_node, profile.p2p_link, profile.collective_host_s) == (H100.intra_node, H100.p2p_link, H100.collective_host_s)
    assert profile.op_overhead_s == pytest.approx(10e-6) and profile.backward_op_overhead_s == pytest.approx(40e-6)
    assert profile.matmul_flops_per_s == pytest.approx(700e12, rel=1e-3)
    assert profile.attention_flops_per_s == pytest.approx(H100.attention_flops_per_s, rel=1e-6)
    assert Collective.ALL_REDUCE not in calibrate.fit_errors(profile, measured)
    assert "links       not measured" in calibrate.describe(profile, measured)


def test_layer_runs_time_train_step_at_each_layer_count() -> None:
    """The layer scale's runs go through ``train_step`` (the path training takes); on CPU ranks too."""
    from autotp import presets
    from autotp.cli.measure import layer_runs

    def config(layers: int) -> object:
        c = presets.model_config("llama-tiny")
        c.num_hidden_layers = layers
        return c

    runs = layer_runs(config, (1, 2), (1, 16), torch.device("cpu"), torch.float32)
    assert [r["layers"] for r in runs] == [1, 2] and all(r["both_s"] > 0 for r in runs)
