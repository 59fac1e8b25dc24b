"""autotp's registered ops (``autotp.ir.ops``): fake kernels, autograd formulas, the group
registry, dead-code elimination, and what compiled rank graphs hold.

In-process checks use ``meta``/FakeTensor, a one-rank group (every op local) and
torch's ``fake`` process group (world 2, collectives do nothing: enough to trace and
compile). Multi-rank numerics run on two gloo ranks.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import autotp
from autotp.ir import ops
from autotp.runtime.processes import collectives
from autotp.runtime.execution import rng
from autotp.runtime.processes.launcher import spawn_ranks
from distributed import run_on_ranks
from small_models import build, vocab_size

KEY = "ops-test"

# (op, args after the tensor, expected output shape for a [4, 6] input)
SHAPES = [
    (ops.COPY_TO_TP, (KEY,), (4, 6)),
    (ops.REDUCE_FROM_TP, (KEY,), (4, 6)),
    (ops.GATHER_FROM_TP, (1, 11, KEY), (4, 11)),
    (ops.SCATTER_TO_TP, (1, 3, KEY), (4, 3)),
    (ops.ALL_GATHER, (0, 2, KEY), (8, 6)),
    (ops.REDUCE_SCATTER, (1, 2, KEY), (4, 3)),
    (ops.STAGE_BOUNDARY, (1,), (4, 6)),
    (ops.TP_DROPOUT, (0.5, True, ops.SHARDED), (4, 6)),
]


@pytest.mark.parametrize(("op", "args", "shape"), SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_fake_kernels_give_shape_and_dtype_without_a_group(op: Any, args: tuple[Any, ...], shape: tuple[int, ...]) -> None:
    out = op(torch.empty(4, 6, device="meta", dtype=torch.bfloat16), *args)
    assert out.shape == shape and out.dtype == torch.bfloat16 and out.device.type == "meta"
    with torch._subclasses.FakeTensorMode():
        out = op(torch.empty(4, 6, dtype=torch.bfloat16), *args)
    assert out.shape == shape and out.dtype == torch.bfloat16


def test_fake_kernels_of_the_vocab_ops() -> None:
    logits = torch.empty(5, 4, device="meta", dtype=torch.bfloat16)
    target = torch.zeros(5, dtype=torch.long, device="meta")
    for reduction, shape in ((0, (5,)), (1, ()), (2, ())):
        loss = ops.VOCAB_PARALLEL_CROSS_ENTROPY(logits, target, 4, 7, -100, reduction, KEY)
        assert loss.shape == shape and loss.dtype == torch.bfloat16
    nll, row_max, sum_exp = ops.VOCAB_PARALLEL_NLL(logits, target, 4, 7, KEY)
    assert all(t.shape == (5,) and t.dtype == torch.float32 for t in (nll, row_max, sum_exp))
    weight = torch.empty(4, 8, device="meta")
    assert ops.VOCAB_PARALLEL_EMBEDDING(weight, target.view(1, 5), 4, 7, 7, -1).shape == (1, 5, 8)
    with pytest.raises(ValueError, match="does not split into 4 equal parts"):
        ops.REDUCE_SCATTER(logits, 0, 4, KEY)


def test_unknown_group_key_raises_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_GROUPS", {})
    collectives.register_group("tp4", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no process group is registered as 'tp2' \(registered: tp4\)"):
        ops.REDUCE_FROM_TP(torch.ones(3), "tp2")


@pytest.fixture
def group_of(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``group_of(world)``: this process as rank 0 of a ``fake`` group of ``world`` ranks, registered as KEY."""
    monkeypatch.setattr(collectives, "_GROUPS", {})

    def init(world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        collectives.register_group(KEY, dist.group.WORLD)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_of_one_rank_makes_every_op_local(group_of: Any) -> None:
    group_of(1)
    x = torch.randn(4, 6, requires_grad=True)
    outputs = {
        "f": ops.COPY_TO_TP(x, KEY),
        "g": ops.REDUCE_FROM_TP(x, KEY),
        "gather": ops.GATHER_FROM_TP(x, 1, 6, KEY),
        "all_gather": ops.ALL_GATHER(x, 0, 1, KEY),
        "reduce_scatter": ops.REDUCE_SCATTER(x, 1, 1, KEY),
    }
    assert all(torch.equal(out, x) for out in outputs.values())
    assert torch.equal(ops.SCATTER_TO_TP(x, 1, 3, KEY), x[:, :3])
    assert outputs["f"]._base is x  # f is a view: no copy of the activation
    assert all(out.data_ptr() != x.data_ptr() for name, out in outputs.items() if name != "f")
    with pytest.raises(ValueError, match="expects 2 ranks in group 'ops-test', but it has 1"):
        ops.ALL_GATHER(x, 0, 2, KEY)


def test_gather_backward_keeps_this_ranks_slice_padded(group_of: Any) -> None:
    group_of(1)
    x = torch.randn(2, 4, requires_grad=True)
    ops.GATHER_FROM_TP(x, 1, 3, KEY).backward(torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    assert torch.equal(x.grad, torch.tensor([[1.0, 2, 3, 0], [4, 5, 6, 0]]))


@pytest.mark.parametrize("size", [3, 4])
def test_a_gathered_value_can_be_written_in_place(group_of: Any, size: int) -> None:
    """A reader may write into the gathered value (a Switch MoE's ``out = x.clone();
    out[mask] = expert(...)`` with ``x`` gathered from sequence parallelism): the op's
    output must not be a view, which autograd forbids modifying in place."""
    group_of(1)
    x = torch.randn(2, 4, requires_grad=True)
    y = ops.GATHER_FROM_TP(x, 1, size, KEY)
    y[:, 0] = 0.0
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[0.0] + [1.0] * (size - 1) + [0.0] * (4 - size)] * 2))


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("positions", [(), (3,), (2, 3)])
def test_vocab_parallel_cross_entropy_on_one_rank_is_cross_entropy(group_of: Any, reduction: int, positions: tuple[int, ...]) -> None:
    """Logits [N, C] or [N, C, d1, ...] (the class dim second, as ``F.cross_entropy`` takes them)."""
    group_of(1)
    logits = torch.randn(6, 8, *positions, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 7, (6, *positions), generator=torch.Generator().manual_seed(0)).flatten()
    target[[2, 4]] = -100
    target = target.view(6, *positions)
    loss = ops.VOCAB_PARALLEL_CROSS_ENTROPY(logits, target, 0, 7, -100, reduction, KEY)  # column 7 is padding
    expected = F.cross_entropy(logits[:, :7], target, reduction=("none", "mean", "sum")[reduction])
    torch.testing.assert_close(loss, expected)
    grad = torch.rand_like(loss)
    (got,) = torch.autograd.grad(loss, logits, grad)
    (want,) = torch.autograd.grad(expected, logits, grad)
    torch.testing.assert_close(got, want)
    assert not got[:, 7].any()


def _input_grad(op: Any, args: tuple[Any, ...], x: torch.Tensor) -> torch.Tensor:
    out = op(x, *args)
    return torch.autograd.grad(out, x, torch.ones_like(out))[0]


def test_backward_formulas_call_the_dual_collective() -> None:
    """The joint graph (traced on meta, no group needed) of each op has its dual in backward."""
    duals = [
        (ops.COPY_TO_TP, (KEY,), ops.REDUCE_FROM_TP),
        (ops.GATHER_FROM_TP, (1, 6, KEY), ops.SCATTER_TO_TP),
        (ops.SCATTER_TO_TP, (1, 3, KEY), ops.GATHER_FROM_TP),
        (ops.ALL_GATHER, (1, 2, KEY), ops.REDUCE_SCATTER),
        (ops.REDUCE_SCATTER, (1, 2, KEY), ops.ALL_GATHER),
    ]
    for op, args, dual in duals:
        joint = functools.partial(_input_grad, op, args)
        gm = make_fx(lambda x: joint(x))(torch.empty(4, 6, device="meta", requires_grad=True))
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert dual in targets, (op, targets)
        assert joint(torch.empty(4, 6, device="meta", requires_grad=True)).shape == (4, 6)
    # g's backward is an identity: no collective.
    gm = make_fx(lambda x: torch.autograd.grad(ops.REDUCE_FROM_TP(x, KEY).sum(), x)[0])(torch.empty(3, device="meta", requires_grad=True))
    assert [n.target for n in gm.graph.nodes].count(ops.REDUCE_FROM_TP) == 1


def test_ops_survive_dead_code_elimination() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(op, (x, *args)) for op, args, _ in SHAPES]
    graph.output(x)
    graph.eliminate_dead_code()
    assert all(n in graph.nodes for n in nodes)
    assert all(node.is_impure() for node in nodes)


def test_compiled_rank_graphs_hold_autotp_ops() -> None:
    model = build("llama")
    ids = torch.randint(0, vocab_size(model), (2, 8))
    compiled = autotp.compile_rank(model, tp=2, pp=2, example_inputs={"input_ids": ids, "labels": ids})
    counts = Counter(n.target for n in compiled.graph.graph.nodes if ops.is_autotp_op(n.target))
    layers = model.config.num_hidden_layers
    assert counts[ops.REDUCE_FROM_TP] == 2 * layers + 1  # attention, MLP, vocab-parallel embedding
    assert counts[ops.COPY_TO_TP] >= 2 * layers
    assert counts[ops.VOCAB_PARALLEL_EMBEDDING] == counts[ops.VOCAB_PARALLEL_CROSS_ENTROPY] == 1
    assert counts[ops.STAGE_BOUNDARY] >= 1
    assert set(counts) <= ops.ALL
    names = {n.name for n in compiled.graph.graph.nodes if n.target in (ops.COPY_TO_TP, ops.REDUCE_FROM_TP, ops.STAGE_BOUNDARY)}
    assert {"copy_to_tp", "reduce_from_tp", "stage_boundary"} <= names  # dumps name them by op
    assert "torch.ops.autotp.reduce_from_tp.default(" in compiled.graph.code


def _graph_of_ops(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    h = ops.COPY_TO_TP(x, KEY) @ w
    h = ops.TP_DROPOUT(h, 0.5, True, ops.SHARDED)
    h = ops.REDUCE_FROM_TP(ops.STAGE_BOUNDARY(h, 1), KEY)
    return ops.VOCAB_PARALLEL_CROSS_ENTROPY(h, target, 0, h.shape[-1], -100, 1, KEY)


def test_torch_compile_traces_and_runs_the_ops(group_of: Any) -> None:
    group_of(2)
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, 5, requires_grad=True)
    target = torch.tensor([0, 4, 2, -100])
    losses, grads = [], []
    for run in (_graph_of_ops, torch.compile(_graph_of_ops, fullgraph=True)):
        rng.seed_tp_rng(0, 0)  # the same dropout masks: compile keeps tp_rand's generator
        loss = run(x, w, target)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, (x, w)))
    torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# ---- two gloo ranks -------------------------------------------------------------------


def _collectives_on_ranks(rank: int, world: int, device: str) -> dict[str, bool]:
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_default_device(device)
    collectives.register_group(KEY, dist.group.WORLD)
    seeded = torch.Generator().manual_seed(0)
    full = torch.randn(world * 2, 3, generator=seeded, device="cpu").to(device)  # the same on every rank
    mine = full[rank * 2 : rank * 2 + 2].clone().requires_grad_()
    up = torch.full((world * 2, 3), float(rank + 1))  # each rank's upstream grad differs
    ok: dict[str, bool] = {}

    x = full.clone().requires_grad_()
    y = ops.COPY_TO_TP(x, KEY)
    y.backward(up)
    ok["f"] = torch.equal(y, full) and torch.equal(x.grad, torch.full_like(full, 3.0))

    x = mine.detach().clone().requires_grad_()
    y = ops.REDUCE_FROM_TP(x, KEY)
    y.backward(up[:2])
    ok["g"] = torch.allclose(y, full[:2] + full[2:]) and torch.equal(x.grad, up[:2])

    x = mine.detach().clone().requires_grad_()
    y = ops.ALL_GATHER(x, 0, world, KEY)
    y.backward(up)
    ok["all_gather"] = torch.equal(y, full) and torch.equal(x.grad, torch.full_like(mine, 3.0))

    x = full.clone().requires_grad_()
    y = ops.REDUCE_SCATTER(x, 0, world, KEY)
    y.backward(up[:2])
    ok["reduce_scatter"] = torch.allclose(y, 2 * full[rank * 2 : rank * 2 + 2]) and torch.equal(x.grad, torch.cat([torch.ones(2, 3), torch.full((2, 3), 2.0)]))

    padded = torch.cat([full, torch.zeros(4, 1)], 1)  # 3 columns, 2 per rank
    x = padded[:, rank * 2 : rank * 2 + 2].clone().requires_grad_()
    y = ops.GATHER_FROM_TP(x, 1, 3, KEY)
    y.backward(torch.arange(12.0).view(4, 3))
    grad = torch.arange(12.0).view(4, 3)[:, rank * 2 : rank * 2 + 2]
    ok["gather"] = torch.equal(y, full) and torch.equal(x.grad, grad if rank == 0 else torch.cat([grad, torch.zeros(4, 1)], 1))

    logits = torch.randn(5, 7, generator=seeded, dtype=torch.float64, device="cpu").to(device)
    target = torch.tensor([1, 6, -100, 0, 4])
    local = torch.cat([logits, torch.zeros(5, 1, dtype=torch.float64)], 1)[:, rank * 4 : rank * 4 + 4].clone().requires_grad_()
    loss = ops.VOCAB_PARALLEL_CROSS_ENTROPY(local, target, rank * 4, 7, -100, 1, KEY)
    loss.backward()
    reference = logits.clone().requires_grad_()
    expected = F.cross_entropy(reference, target)
    expected.backward()
    want = torch.cat([reference.grad, torch.zeros(5, 1, dtype=torch.float64)], 1)[:, rank * 4 : rank * 4 + 4]
    ok["vocab_cross_entropy"] = torch.allclose(loss, expected) and torch.allclose(local.grad, want)
    return ok


def test_collectives_match_hand_computed_values_on_two_ranks() -> None:
    for result in run_on_ranks(_collectives_on_ranks, 2, "cpu"):
        assert all(result.values()), result


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_collectives_match_hand_computed_values_on_two_gpus_through_nccl() -> None:
    for result in spawn_ranks(_collectives_on_ranks, 2, "cuda", backend="nccl"):
        assert all(result.values()), result


def _compiled_matches_eager(rank: int, world: int) -> dict[str, float]:
    model = build("llama")
    ids = torch.randint(0, vocab_size(model), (2, 8), generator=torch.Generator().manual_seed(0))
    results = []
    for compile in (False, True):
        pm = autotp.parallelize(copy.deepcopy(model), tp=world, example_inputs={"input_ids": ids, "labels": ids}, compile=compile)
        out = pm(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in pm.named_parameters()}))
    (loss, logits, grads), (closs, clogits, cgrads) = results
    return {
        "loss": (loss - closs).abs().item(),
        "logits": (logits - clogits).abs().max().item(),
        "grads": max((g - cgrads[n]).abs().max().item() for n, g in grads.items()),
    }


def test_parallelize_with_torch_compile_matches_eager() -> None:
    for result in run_on_ranks(_compiled_matches_eager, 2):
        assert max(result.values()) < 1e-5, result
