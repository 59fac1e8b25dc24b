"""The DistributedOptimizer's parameter all-gather overlapped with the next forward (gloo, CPU, fp32).

The all-gather is replaced by one whose result lands in the parameters only when its work
is waited for, so any read before the wait sees last step's values. With the graph's waits
the training still equals torch.optim.AdamW on the unmodified model, and every bucket is
waited for by the forward, in order of first use, between its compute nodes; without
them (the control) it does not. Readers between ``step`` and the next forward (state
dicts, unsharding) finish the gathers first.
"""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_on_ranks
from small_models import build
from test_distributed_optimizer import HYPER, _reference_step


def _deferred_all_gather(events: list[tuple[str, int]], brought: dict[int, torch.Tensor]) -> object:
    """An all-gather that communicates at once but writes its output only in ``wait``;
    ``brought`` keeps what each output's latest all-gather carried."""
    import torch.distributed as dist

    class Work:
        def __init__(self, out: torch.Tensor, got: torch.Tensor) -> None:
            self.out, self.got = out, got

        def wait(self) -> None:
            self.out.copy_(self.got)
            events.append(("landed", self.out.data_ptr()))

    def all_gather(out: torch.Tensor, inp: torch.Tensor, group: object = None, async_op: bool = False) -> Work:
        got = torch.empty_like(out)
        dist.all_gather_into_tensor(got, inp, group=group)
        brought[out.data_ptr()] = got
        work = Work(out, got)
        if not async_op:
            work.wait()
        return work

    return all_gather


def _train(rank: int, world: int, waits_in_graph: bool) -> dict:
    import autotp
    from autotp.ir import program
    from autotp.passes.split_weight_grads import deferred_copy
    from autotp.runtime.gradients import grad_buffers
    from autotp.runtime.execution import parallel_model

    events: list[tuple[str, int]] = []
    brought: dict[int, torch.Tensor] = {}
    grad_buffers._all_gather = _deferred_all_gather(events, brought)
    if not waits_in_graph:
        parallel_model.ParallelModel._install_param_waits = lambda *a, **k: None  # type: ignore[method-assign]
    graph_wait = program.ParamWaits.forward
    program.ParamWaits.forward = lambda self, b: (events.append(("graph", b)), graph_wait(self, b))[1]  # type: ignore[method-assign]

    model = build("llama", layers=2)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, 128, (4, 12), generator=gen) for _ in range(2)) for _ in range(4)]
    pm = autotp.parallelize(model, tp=1, example_inputs={"input_ids": batches[0][0][:1], "labels": batches[0][1][:1]})
    opt = autotp.DistributedOptimizer(pm, torch.optim.AdamW, bucket_bytes=4096, **HYPER)
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)
    buffers = opt.buffers
    start_of = {b.params.data_ptr(): b.index for b in buffers.buckets}
    out: dict = {"losses": [], "ref_losses": [], "in_flight_after_step": [], "forward_waits": [], "readers": {}}
    for i, (ids, labels) in enumerate(batches):
        events.clear()
        out["losses"].append(pm.train_step(input_ids=ids, labels=labels, num_microbatches=2).item())
        out["forward_waits"].append([(kind, start_of.get(x, x)) for kind, x in events])
        opt.step()
        opt.zero_grad()
        out["ref_losses"].append(_reference_step(reference, ids, labels, 4).item())
        ref_opt.step()
        ref_opt.zero_grad()
        out["in_flight_after_step"].append(buffers.gathering)
        if waits_in_graph and i >= 2:  # the forwards of steps 1 and 2 are not preceded by a reader
            read = pm.unshard_state_dict if i == 2 else (lambda: dict(pm.state_dict()))
            state = read()
            finished = not buffers.gathering
            landed = all(torch.equal(b.params, brought[b.params.data_ptr()]) for b in buffers.buckets)
            out["readers"][i] = finished and landed and all(torch.equal(state[n], p.detach()) for n, p in pm.named_parameters())
    call = {"input_ids": batches[0][0][:1], "labels": batches[0][1][:1], "use_cache": False}
    gm = pm.graph_for(**call)
    # zero-bubble schedules run a copy of the graph with deferred weight gradients: it keeps the waits
    split = deferred_copy(gm)
    leaves = [torch.utils._pytree.tree_leaves(g(**call)) for g in (gm, split)]
    out["split"] = {"waits": sum(n.op == "call_module" for n in split.graph.nodes), "same": torch.equal(leaves[0][0], leaves[1][0])}
    kinds = ["wait" if n.op == "call_module" else "compute" for n in gm.graph.nodes if n.op in ("call_module", "call_function")]
    out["graph"] = {"waits": kinds.count("wait"), "last_wait": len(kinds) - 1 - kinds[::-1].index("wait") if "wait" in kinds else -1,
                    "first_compute": kinds.index("compute")}
    out["order"] = [b.index for b in buffers.gather_order]
    out["buckets"] = len(buffers.buckets)
    return out


def test_forward_waits_for_each_bucket_and_matches_adamw() -> None:
    results = run_on_ranks(_train, 2, True)
    for r in results:
        assert r["buckets"] > 3
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6)
        assert all(r["in_flight_after_step"])  # step returned with the all-gathers in flight
        # from the second step on, the forward waited for every bucket, in order of first use,
        # each right when the parameters landed, and the graph interleaves waits with compute
        for waits in r["forward_waits"][1:3]:
            graph = [b for kind, b in waits if kind == "graph"]
            landed = [b for kind, b in waits if kind == "landed"]
            assert landed == r["order"] and graph[: len(landed)] == landed, waits
        assert r["graph"]["waits"] == r["buckets"] and r["graph"]["last_wait"] > r["graph"]["first_compute"]
        assert r["readers"] == {2: True, 3: True}  # unshard_state_dict and state_dict finished the gathers
        assert r["split"] == {"waits": r["buckets"], "same": True}


def test_without_the_graph_waits_the_forward_reads_stale_parameters() -> None:
    results = run_on_ranks(_train, 2, False)
    for r in results:
        assert r["losses"][0] == pytest.approx(r["ref_losses"][0], rel=1e-5)
        assert not torch.allclose(torch.tensor(r["losses"][1:]), torch.tensor(r["ref_losses"][1:]), rtol=1e-4, atol=0)


def _refused(rank: int, world: int) -> str:
    import autotp

    ids = torch.randint(0, 128, (2, 8))
    pm = autotp.parallelize(build("llama"), tp=1, compile=True, example_inputs={"input_ids": ids[:1], "labels": ids[:1]})
    try:
        autotp.DistributedOptimizer(pm, torch.optim.AdamW, overlap_param_gather=True)
    except ValueError as e:
        return str(e)
    return ""


def test_overlap_with_compiled_graphs_is_refused() -> None:
    message = run_on_ranks(_refused, 2)[0]
    assert "overlap_param_gather=True" in message and "torch.compile" in message and "overlap_param_gather=False" in message
