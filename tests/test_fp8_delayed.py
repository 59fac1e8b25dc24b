"""Delayed FP8 scaling (``fp8="tensorwise-delayed"``, ``autotp.ir.fp8_delayed``): the op against a
hand-written reference over several steps (first step seeded, history rolling, saturation), the
model compiled against eager, the tp=2 model against tp=1 over several steps, the plan, the cost
model and the refusals."""

from __future__ import annotations

import warnings
import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import autotp
from autotp.analysis.local_shapes import local_tensors
from autotp.cost_model.fp8 import cast_bytes
from autotp.ir import fp8_delayed, ops
from autotp.ir.errors import UserInputError
from autotp.ir.plan import ParallelPlan
from distributed import run_on_ranks
from test_fp8 import _llama

DELAYED = "tensorwise-delayed"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RTOL, ATOL = 1e-4, 1e-6


def _rounded(t: torch.Tensor, amax: float, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to FP8 with the scale of ``amax`` (saturating), as float32 again."""
    fmax = torch.finfo(dtype).max
    scale = torch.tensor(fmax, dtype=torch.float32) / torch.tensor(max(amax, 1e-12), dtype=torch.float32)
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() * scale.reciprocal()


class Reference:
    """The recipe written out: per operand a list of its amaxes, newest last; the scale of a
    step from the max of the last ``length`` (the first step: its own amax)."""

    def __init__(self, length: int) -> None:
        self.length, self.amaxes = length, {"x": [], "w": [], "dy": []}

    def window(self, operand: str, now: torch.Tensor) -> float:
        seen = self.amaxes[operand]
        used = max(seen[-self.length :]) if seen else now.abs().max().item()
        seen.append(now.abs().max().item())
        return used

    def step(self, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xq, wq = _rounded(x, self.window("x", x), E4M3), _rounded(w, self.window("w", w), E4M3)
        dyq = _rounded(dy, self.window("dy", dy), E5M2)
        return xq @ wq.t(), dyq @ wq, dyq.t() @ xq

    def rows(self, operand: str) -> list[float]:
        """The history column as the op keeps it: newest first, the first step filling every row."""
        seen = self.amaxes[operand]
        padded = [seen[0]] * self.length + seen
        return padded[::-1][: self.length]


def test_op_equals_the_hand_written_recipe_over_steps() -> None:
    """Five steps with a window of 3: inputs that grow (the cast saturates: values past the
    window's amax clamp) and shrink; outputs, grads and the history rows each step."""
    torch.manual_seed(0)
    w = torch.randn(48, 32) / 10
    history = fp8_delayed.new_history(3, 1, torch.device("cpu"))
    reference = Reference(3)
    for step, gain in enumerate((1.0, 4.0, 0.5, 0.25, 2.0)):
        x = (torch.randn(40, 32) * gain).requires_grad_()
        wp = w.clone().requires_grad_()
        (y,) = ops.FP8_LINEAR(x, [wp], [None], DELAYED, 0, [0], -1, 1, "", history)
        dy = torch.randn_like(y) * gain
        dx, dw = torch.autograd.grad([y], [x, wp], [dy])
        ey, edx, edw = reference.step(x.detach(), w, dy)
        for what, actual, expected in (("y", y, ey), ("dx", dx, edx), ("dw", dw, edw)):
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {what}: {m}")
        for column, operand in enumerate(("x", "w", "dy")):
            assert history[:, column].tolist() == pytest.approx(reference.rows(operand), rel=1e-6), (step, operand)
    assert reference.amaxes["x"][1] > max(reference.amaxes["x"][:1])  # step 2 did saturate


def test_first_step_equals_the_dynamic_recipe() -> None:
    torch.manual_seed(1)
    x, w = torch.randn(2, 24, 64).requires_grad_(), torch.randn(96, 64).requires_grad_()
    dy = torch.randn(2, 24, 96)
    (dynamic,) = ops.FP8_LINEAR(x, [w], [None], "tensorwise", 0, [0], -1, 1, "")
    expected = (dynamic, *torch.autograd.grad([dynamic], [x, w], [dy]))
    history = fp8_delayed.new_history(4, 1, torch.device("cpu"))
    (y,) = ops.FP8_LINEAR(x, [w], [None], DELAYED, 0, [0], -1, 1, "", history)
    actual = (y, *torch.autograd.grad([y], [x, w], [dy]))
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)
    assert bool((history[0] > 0).all()) and bool((history == history[0]).all())  # every row seeded


def test_compiled_first_step_seeds_the_histories_as_the_dynamic_recipe_scales() -> None:
    """The first step runs compiled (``aot_eager``: the AOT graphs, eager kernels), no eager
    seeding step: it computes what ``tensorwise`` computes, bit for bit, and fills every row."""
    model, (ids,) = _llama(), _batches(128, 1)
    example = {"input_ids": ids, "labels": ids}
    runs = {}
    for recipe, backend in (("tensorwise", False), (DELAYED, "aot_eager")):
        with pytest.warns(UserWarning, match="on the CPU"):
            pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=example, fp8=recipe, compile=backend)
        runs[recipe] = pm.train_step(**example).item(), pm.unshard_grads(), _histories(pm)
    (dynamic_loss, dynamic_grads, _), (loss, grads, histories) = runs["tensorwise"], runs[DELAYED]
    assert loss == dynamic_loss
    assert all(torch.equal(grads[n], dynamic_grads[n]) for n in dynamic_grads)
    assert len(histories) == 8 and all(bool((h > 0).all()) and torch.equal(h, h[0].expand_as(h)) for h in histories.values())


def _steps(pm: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of SGD steps over ``batches``, and the final parameters."""
    optimizer = torch.optim.SGD(pm.parameters(), lr=0.5)
    losses = []
    for ids in batches:
        optimizer.zero_grad(set_to_none=True)
        losses.append(pm.train_step(input_ids=ids, labels=ids).item())
        optimizer.step()
    return losses, {n: p.detach().clone() for n, p in pm.named_parameters()}


def _batches(vocab: int, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (2, 16), generator=gen) for _ in range(steps)]


@pytest.mark.slow
def test_compiled_model_equals_eager_over_steps() -> None:
    """``compile="aot_eager"`` (the AOT graphs, history updates as graph mutations) equals eager
    bit for bit over 3 optimizer steps; the histories moved."""
    model, batches = _llama(), _batches(128)
    runs = {}
    for backend in (False, "aot_eager"):
        with pytest.warns(UserWarning, match="on the CPU"):
            pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs={"input_ids": batches[0], "labels": batches[0]},
                                    fp8=DELAYED, compile=backend)  # fmt: skip
        losses, params = _steps(pm, batches)
        histories = _histories(pm)
        runs[backend] = losses, params, histories
    (el, ep, eh), (cl, cp, ch) = runs[False], runs["aot_eager"]
    assert el == cl
    assert all(torch.equal(ep[n], cp[n]) for n in ep)
    assert len(eh) == 8 and all(torch.equal(eh[n], ch[n]) for n in eh)
    first = eh[fp8_delayed.history_name("model.layers.0.self_attn.q_proj.weight")]
    assert first.shape == (16, 7) and not torch.equal(first[0], first[-1])  # rows differ after 3 steps


def _histories(pm: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in pm.named_buffers() if n.startswith(fp8_delayed.HISTORY_PREFIX)}


def _tp_steps(rank: int, world: int, sp: bool, given: list[dict[str, torch.Tensor]] | None) -> list[dict[str, object]]:
    """Three steps (three batches, the parameters fixed): per step the histories it starts from
    (with ``given``: set to those first), its loss, every grad and the histories after it."""
    model, batches = _llama(kv_heads=8), _batches(128)  # every decoder GEMM in FP8 at tp=1 and tp=2
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": batches[0], "labels": batches[0]}, fp8=DELAYED,
                            sequence_parallel=sp, gather_outputs=False)  # fmt: skip
    held = dict(pm.named_buffers())
    steps = []
    for k, ids in enumerate(batches):
        if given is not None and k > 0:
            for name, value in given[k].items():
                held[name].copy_(value)
        before = _histories(pm)
        for p in pm.parameters():
            p.grad = None
        loss = pm.train_step(input_ids=ids, labels=ids).item()
        steps.append({"before": before, "loss": loss, "grads": pm.unshard_grads(), "after": _histories(pm)})
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_equals_tp1_over_steps(sp: bool) -> None:
    """Amaxes max-reduced over the group into each history: from the same history, tp=2 computes
    each step's loss and grads as tp=1 and records the same amaxes. Each step starts from tp=1's
    histories: the fp32 amaxes of the two runs differ in their last bit (sums in another order),
    and one ulp of a scale may flip an FP8 rounding (a grad element off by up to 1/4 of its
    value), which a later step would carry."""
    expected = _tp_steps(0, 1, False, None)
    for steps in run_on_ranks(_tp_steps, 2, sp, [e["before"] for e in expected]):
        for k, (step, want) in enumerate(zip(steps, expected)):
            close = lambda a, b, what: torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {k}, {what}: {m}")  # noqa: E731
            close(torch.tensor(step["loss"]), torch.tensor(want["loss"]), "loss")
            for name, grad in want["grads"].items():
                close(step["grads"][name], grad, f"grad of {name}")
            for name, history in want["after"].items():
                close(step["after"][name], history, name)
        assert not torch.equal(steps[-1]["after"][name][0], steps[-1]["after"][name][1])  # the rows moved


def test_plan_round_trips_the_history_length_and_the_pass_makes_one_history_per_op() -> None:
    model = _llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="on the CPU"):
        pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs={"input_ids": ids, "labels": ids}, fp8=DELAYED)
    plan = replace(pm.plan, fp8_amax_history=5)
    assert ParallelPlan.from_json(plan.to_json()).fp8_amax_history == 5
    assert all(e.recipe == DELAYED for e in plan.fp8_linears if e.recipe)
    with pytest.warns(UserWarning, match="on the CPU"):
        pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs={"input_ids": ids, "labels": ids}, plan=plan)
    graph = pm.graph_for(input_ids=ids, labels=ids)
    nodes = [n for n in graph.graph.nodes if n.target is ops.FP8_LINEAR]
    shapes = {n.args[-1].target: tuple(getattr(graph, n.args[-1].target).shape) for n in nodes}
    assert len(shapes) == len(nodes) == 8 and set(shapes) == set(_histories(pm))  # the model holds them
    assert sorted(shapes.values()) == [(5, 3)] * 4 + [(5, 5)] * 2 + [(5, 7)] * 2  # o, down: 1 weight; gate/up 2; q/k/v 3


def test_pipeline_is_refused() -> None:
    model = _llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UserInputError, match="pipeline"):
        autotp.compile_rank(model, tp=1, pp=2, example_inputs={"input_ids": ids, "labels": ids}, fp8=DELAYED)


def test_cuda_graphs_are_refused() -> None:
    """Captured regions copy the histories in as static inputs and would never advance them."""
    model = _llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(UserInputError, match="cuda_graphs=True is not supported"):
        autotp.parallelize(model, example_inputs={"input_ids": ids, "labels": ids}, fp8=DELAYED, cuda_graphs=True)


def test_cost_model_prices_one_pass_casts() -> None:
    """A delayed cast reads its operand once (the dynamic one twice: amax, then cast)."""
    model = _llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    costs = {}
    for recipe in ("tensorwise", DELAYED):
        graph = autotp.compile_rank(model, tp=1, example_inputs={"input_ids": ids, "labels": ids}, fp8=recipe).graph
        node = next(n for n in graph.graph.nodes if n.target is ops.FP8_LINEAR)
        costs[recipe] = cast_bytes(node, lambda n: local_tensors(n, 1))
    x, weights = node.args[0].meta["val"], [w.meta["val"] for w in node.args[1]]
    read_once = x.numel() * x.element_size() + sum(w.numel() * w.element_size() for w in weights)
    assert costs["tensorwise"][0] - costs[DELAYED][0] == read_once
    assert costs["tensorwise"][1] - costs[DELAYED][1] == sum(o.numel() * o.element_size() for o in node.meta["val"])


def test_checkpoint_round_trip_continues_bit_for_bit(tmp_path) -> None:
    """Two steps, save (histories, parameters, optimizer), a third step; a new model loaded from
    the checkpoint takes the same third step: loss, parameters and histories bit for bit. A
    checkpoint without histories (saved without FP8) loads too: they stay empty, to be seeded."""
    model, batches = _llama(), _batches(128)
    example = {"input_ids": batches[0], "labels": batches[0]}

    def build(recipe: str | None) -> tuple[nn.Module, torch.optim.Optimizer]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autotp.parallelize(copy.deepcopy(model), tp=1, example_inputs=example, fp8=recipe)
        return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def step(pm: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = pm.train_step(input_ids=ids, labels=ids).item()
        optimizer.step()
        return loss

    pm, optimizer = build(DELAYED)
    for ids in batches[:2]:
        step(pm, optimizer, ids)
    pm.save_checkpoint(tmp_path / "ckpt", optimizer, step=2)
    expected = step(pm, optimizer, batches[2]), dict(pm.named_parameters()), _histories(pm)
    loaded, optimizer = build(DELAYED)
    assert loaded.load_checkpoint(tmp_path / "ckpt", optimizer) == 2
    assert all(h.any() for h in _histories(loaded).values())
    actual = step(loaded, optimizer, batches[2]), dict(loaded.named_parameters()), _histories(loaded)
    assert actual[0] == expected[0]
    for got, want in zip(actual[1:], expected[1:]):
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)

    plain, _ = build(None)
    plain.save_checkpoint(tmp_path / "plain")
    fresh, _ = build(DELAYED)
    fresh.load_checkpoint(tmp_path / "plain")
    assert not any(h.any() for h in _histories(fresh).values())
    step(fresh, torch.optim.SGD(fresh.parameters()), batches[0])
    assert all(h.any() for h in _histories(fresh).values())  # seeded by that step
