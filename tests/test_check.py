"""The numerics bisector (``autotp.report.check`` and ``autotp check``): silent on a
correct compile, and names the first diverging node, with its source line and layout,
when a pass is broken on purpose."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from distributed import run_on_ranks
from general_models import VOCAB, build_general


def _drop_one_all_reduce(gm: GraphModule, ctx: object) -> GraphModule:
    """A broken pass: the first all-reduce of layer 1 is skipped (its input is used as is)."""
    from autotp.ir import ops

    for node in gm.graph.nodes:
        if node.target is ops.REDUCE_FROM_TP and "blocks.1" in str(node.meta.get("nn_module_stack", "")):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            break
    return gm


def _check_on_rank(rank: int, world: int, broken: bool) -> tuple[bool, str, str, str, int, int]:
    import autotp.compiler
    from autotp.report.check import check_numerics

    if broken:
        index = next(i for i, p in enumerate(autotp.compiler.PASSES) if p.__name__ == "cancel_collectives")
        autotp.compiler.PASSES.insert(index + 1, _drop_one_all_reduce)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    report = check_numerics(build_general("per_head_scale"), tp=world, example_inputs={"input_ids": ids, "labels": ids})
    first = report.first
    return (report.ok, report.summary(), first.name if first else "", first.source if first else "",
            report.activations_compared, report.grads_compared)  # fmt: skip


def test_correct_compile_has_no_divergence() -> None:
    ok, summary, _, _, activations, grads = run_on_ranks(_check_on_rank, 2, False)[0]
    assert ok, summary
    assert activations > 50 and grads == len(list(build_general("per_head_scale").parameters())), summary


def test_names_the_first_node_after_a_missing_all_reduce() -> None:
    ok, summary, name, source, _, _ = run_on_ranks(_check_on_rank, 2, True)[0]
    assert not ok
    # the row-parallel o projection of layer 1 lost its all-reduce: the residual add after it diverges first
    assert "first divergence: activation" in summary, summary
    assert source.startswith(__file__.replace("test_check.py", "general_models.py")), summary
    assert name.startswith("add"), summary


_BROKEN: list[str] = []


def _gelu_becomes_relu_in_layer_1(gm: GraphModule, ctx: object) -> GraphModule:
    """A broken pass: layer 1's GELU computes ReLU (the node keeps its name)."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.gelu.default and "blocks.1" in str(node.meta.get("nn_module_stack", "")):
            node.target, node.args, node.kwargs = torch.ops.aten.relu.default, node.args[:1], {}
            _BROKEN.append(node.name)
            break
    return gm


def _check_pipeline_on_rank(rank: int, world: int, broken: bool) -> tuple[bool, str, str, int | None, str, int, int, str]:
    import autotp.compiler
    from autotp.report.check import check_numerics

    if broken:
        autotp.compiler.PASSES.append(_gelu_becomes_relu_in_layer_1)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    report = check_numerics(build_general("per_head_scale"), tp=1, pp=world, example_inputs={"input_ids": ids, "labels": ids})
    first = report.first
    return (report.ok, report.summary(), first.name if first else "", first.chunk if first else None,
            first.source if first else "", report.activations_compared, report.grads_compared,
            _BROKEN[-1] if _BROKEN else "")  # fmt: skip


def test_pipeline_compile_has_no_divergence() -> None:
    results = run_on_ranks(_check_pipeline_on_rank, 2, False)
    ok, summary, _, _, _, activations, grads, _ = results[0]
    assert ok, summary
    assert activations > 50 and grads == len(list(build_general("per_head_scale").parameters())), summary
    assert results[1][:2] == results[0][:2]  # every rank reports the same


def test_names_the_first_diverging_node_of_a_later_stage() -> None:
    ok, summary, name, chunk, source, _, _, broken = run_on_ranks(_check_pipeline_on_rank, 2, True)[0]
    assert not ok
    assert "first divergence: activation" in summary and "in pipeline chunk 1" in summary, summary
    assert name == broken and chunk == 1, summary
    assert source.startswith(__file__.replace("test_check.py", "general_models.py")), summary
