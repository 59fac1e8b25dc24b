"""``attention_backend``: unmasked 16-bit SDPA calls run cuDNN's attention where the plan says so,
every other call keeps torch's dispatch; on a GPU the result equals the default kernel's."""

from __future__ import annotations

import copy
import operator
from dataclasses import replace

import pytest
import torch
from torch.fx import Graph, GraphModule

import autotp
from autotp.cost_model.attention import attention_backend as choose
from autotp.ir.plan import ATTENTION_CUDNN, ParallelPlan
from autotp.passes.attention_backend import CUDNN_SDPA, SDPA, attention_backend
from autotp.passes.runner import PassContext
from small_models import build, vocab_size


def _graph(heads_kv: int = 4, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16, **kwargs: object) -> GraphModule:
    graph = Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    for node, heads in ((q, 4), (k, heads_kv), (v, heads_kv)):
        node.meta["val"] = torch.empty(2, heads, 16, head_dim, dtype=dtype, device="meta")
    out = graph.call_function(SDPA, (q, k, v), {"is_causal": True, "scale": 0.125, **kwargs})
    out.meta["val"] = q.meta["val"]
    graph.output(out)
    return GraphModule(torch.nn.Module(), graph)


def _targets(gm: GraphModule, backend: str = ATTENTION_CUDNN, device: str = "cuda") -> set[object]:
    ctx = PassContext(plan=replace(ParallelPlan(), attention_backend=backend), device=torch.device(device))
    return {n.target for n in attention_backend(gm, ctx).graph.nodes if n.op == "call_function"}


def test_unmasked_attention_runs_cudnn() -> None:
    gm = _graph()
    assert _targets(gm) == {CUDNN_SDPA, operator.getitem}
    fused = next(n for n in gm.graph.nodes if n.target is CUDNN_SDPA)
    assert fused.args[6] is True and fused.kwargs["scale"] == 0.125, "is_causal and the scale are kept"
    assert fused.meta["val"][0].shape == (2, 4, 16, 64)


def test_grouped_query_attention_repeats_each_key_value_head_for_its_queries() -> None:
    gm = _graph(heads_kv=2, enable_gqa=True)
    assert _targets(gm) == {CUDNN_SDPA, torch.ops.aten.repeat_interleave.self_int, operator.getitem}
    repeats = [n for n in gm.graph.nodes if n.target is torch.ops.aten.repeat_interleave.self_int]
    assert [(n.args[1], n.kwargs["dim"], tuple(n.meta["val"].shape)) for n in repeats] == [(2, 1, (2, 4, 16, 64))] * 2


@pytest.mark.parametrize(
    "gm",
    [_graph(dtype=torch.float32), _graph(head_dim=256), _graph(heads_kv=2), _graph(dropout_p=0.1)],
    ids=["fp32", "head-dim-256", "unequal-heads-without-gqa", "dropout"],
)
def test_calls_cudnn_would_not_run_keep_the_default(gm: GraphModule) -> None:
    assert _targets(gm) == {SDPA}


def test_default_plan_and_cpu_keep_the_default() -> None:
    assert _targets(_graph(), backend="") == {SDPA}
    assert _targets(_graph(), device="cpu") == {SDPA}
    assert choose(torch.device("cpu")) == ""


@pytest.mark.gpu
def test_cudnn_attention_is_as_close_to_fp32_as_the_default_kernel_on_gpu() -> None:
    """bf16 training steps with either kernel against the fp32 model: cuDNN's loss and gradients
    are within twice the default kernel's relative error (plus bf16's resolution)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = build("llama", layers=2).to("cuda")
    ids = torch.randint(0, vocab_size(model), (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    expected = reference(**inputs).loss
    expected.backward()
    errors = {}
    for backend in ("", ATTENTION_CUDNN):
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        plan = autotp.parallelize(bf16, example_inputs=inputs).plan
        pm = autotp.parallelize(bf16, example_inputs=inputs, plan=replace(plan, attention_backend=backend))
        nodes = [n.target for n in pm._compiled_for(pm._as_kwargs((), inputs), ("loss",)).graph.graph.nodes]
        assert (CUDNN_SDPA in nodes) == (backend == ATTENTION_CUDNN)
        loss, grads = pm.train_step(**inputs).float(), pm.unshard_grads()
        errors[backend] = [abs(loss.item() / expected.item() - 1)] + [
            ((grads[n].float() - p.grad).norm() / p.grad.norm()).item() for n, p in reference.named_parameters()
        ]
    for default, cudnn in zip(errors[""], errors[ATTENTION_CUDNN]):
        assert cudnn <= 2 * default + 4e-3, (errors[""], errors[ATTENTION_CUDNN])
