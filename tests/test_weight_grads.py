"""The split backward of zero-bubble schedules (``autotp.runtime.execution.weight_grads``), in one
process: a pipeline chunk's input gradient first, its linear weights' gradients later,
together equal to the ordinary backward."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.ir import ops
from autotp.runtime.execution.pipeline import ChunkGraph
from autotp.runtime.execution.weight_grads import WeightGradStore
from small_models import build, vocab_size


def _chunks(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    model = build(name, layers=2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size(model), (2, 8), generator=gen)
    compiled = autotp.compile_rank(model, tp=1, pp=2, device="cpu", example_inputs={"input_ids": ids, "labels": ids})
    chunks = {c: ChunkGraph(p) for c, p in compiled.program.chunks.items()}
    real = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for gm in (g for cg in chunks.values() for g in cg.program.graphs()):  # compile_rank's graphs hold fake tensors: point them at the model's
        for node in gm.graph.nodes:
            if node.op == "get_attr" and str(node.target) in real:
                *path, leaf = str(node.target).split(".")
                setattr(gm.get_submodule(".".join(path)), leaf, real[str(node.target)])
    return chunks, {"input_ids": ids, "labels": ids}


def _grads(gm: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in gm.named_parameters()}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_input_gradient_first_weight_gradients_later(name: str) -> None:
    chunks, inputs = _chunks(name)
    first, last = chunks[0], chunks[1]

    def run(split: bool) -> tuple[torch.Tensor, dict, dict]:
        for cg in (first, last):
            cg.graph.zero_grad(set_to_none=True)
        graphs = [cg.program.deferred if split else cg.graph for cg in (first, last)]
        sent = graphs[0](*[inputs[n] for n in first.input_names])
        received = [t.detach().requires_grad_() for t in sent]
        out = graphs[1](*[inputs[n] for n in last.input_names], *received)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        stores = [WeightGradStore(), WeightGradStore()]
        with stores[1].collecting():
            loss.backward()
        before = _grads(last.graph)
        with stores[0].collecting():
            torch.autograd.backward(list(sent), [t.grad for t in received])
        for store in stores:
            store.apply()
        return received[0].grad, before, _grads(last.graph) | {f"first.{k}": v for k, v in _grads(first.graph).items()}

    ref_input_grad, _, ref = run(split=False)
    input_grad, before_w, after_w = run(split=True)
    torch.testing.assert_close(input_grad, ref_input_grad, rtol=1e-5, atol=1e-7)
    assert ref.keys() == after_w.keys()
    for k in ref:
        torch.testing.assert_close(after_w[k], ref[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
    linear_weights = {str(n.args[1].target) for n in last.graph.graph.nodes if n.target is torch.ops.aten.linear.default}
    assert linear_weights, "the chunk has linears"
    for k, g in before_w.items():  # after B: only the weights of linears still wait
        assert (g is None) == (k in linear_weights), k


def test_deferred_linear_outside_a_store_is_an_error() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match="outside WeightGradStore.collecting"):
        ops.DEFERRED_LINEAR(x, w).sum().backward()


def test_applied_weight_gradients_carry_no_autograd_history() -> None:
    """``x`` comes back from the saved tensors with its graph: a ``W`` recorded by autograd would give
    ``.grad`` a history holding every output gradient alive until the gradients are zeroed."""
    w = torch.nn.Parameter(torch.randn(5, 4))
    x = torch.randn(3, 4, requires_grad=True)
    expected = torch.zeros(5, 4)
    for _ in range(2):  # the first W sets .grad, the second adds into it
        h = x * 2
        grad_out = torch.randn(3, 5)
        store = WeightGradStore()
        with store.collecting():
            ops.DEFERRED_LINEAR(h, w).backward(grad_out)
        store.apply()
        expected += grad_out.t() @ h.detach()
        assert w.grad.grad_fn is None and not w.grad.requires_grad
    torch.testing.assert_close(w.grad, expected)
