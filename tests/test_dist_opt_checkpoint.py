"""DCP checkpoints of autotp.DistributedOptimizer (gloo, CPU, fp32): its per-dp-rank flat
ranges are saved as chunks of the global tensors, so a checkpoint written at tp=2 x dp=2
resumes at tp=1 x pp=2 x dp=2 and at tp=2 x pp=2 x dp=1, into a DistributedOptimizer or a
plain torch.optim.AdamW (and a plain one's into a DistributedOptimizer), with the next
step's loss and parameters of a run that never stopped; a killed save leaves the previous
checkpoint loadable."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from distributed import run_on_ranks
from small_models import build
from test_distributed_optimizer import HYPER

MAX_NORM = 0.5


def test_flat_ranges_map_onto_global_chunks_exactly() -> None:
    from autotp.runtime.state.shard_map import Piece, ShardSpec, _contiguous_boxes, flat_range_chunks

    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(2, 5) for _ in range(rng.randint(1, 3)))
        n = int(torch.tensor(shape).prod())
        start = rng.randint(0, n - 1)
        stop = rng.randint(start + 1, n)
        local = torch.arange(n, dtype=torch.float32).view(shape)
        covered = torch.zeros(n)
        for offset, (lo, sizes) in _contiguous_boxes(shape, start, stop):
            values = local[tuple(slice(a, a + s) for a, s in zip(lo, sizes))].reshape(-1)
            assert torch.equal(values, torch.arange(start + offset, start + offset + values.numel(), dtype=torch.float32))
            covered[values.long()] += 1
        assert covered[start:stop].eq(1).all() and covered.sum() == stop - start
        # the sharded dim d holds two pieces out of order in the global tensor, then a padding row
        d = rng.randrange(len(shape))
        k = rng.randint(1, shape[d] - 1)
        pieces = tuple(p for p in (Piece(3, 0, k), Piece(0, k, shape[d] - 1 - k)) if p.length)
        glob = list(shape)
        glob[d] = 3 + k
        spec = ShardSpec("w", tuple(glob), d, shape[d], pieces)
        got, expected = torch.zeros(glob), torch.zeros(glob)
        for (off, sizes), view in flat_range_chunks(spec, local.reshape(-1)[start:stop].clone(), start, stop):
            got[tuple(slice(a, a + s) for a, s in zip(off, sizes))] += view
        mask = torch.zeros(n)
        mask[start:stop] = 1
        held = local * mask.view(shape)
        for p in pieces:
            expected.narrow(d, p.global_start, p.length).add_(held.narrow(d, p.local_start, p.length))
        assert torch.equal(got, expected), (shape, start, stop, d)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [tuple(torch.randint(0, 128, (4, 12), generator=gen) for _ in range(2)) for _ in range(3)]


def _optimizer(pm: torch.nn.Module, kind: str) -> object:
    import autotp

    if kind == "distopt":
        return autotp.DistributedOptimizer(pm, torch.optim.AdamW, bucket_bytes=4096, **HYPER)
    return torch.optim.AdamW(pm.parameters(), **HYPER)


def _step(pm: torch.nn.Module, opt: object, ids: torch.Tensor, labels: torch.Tensor) -> float:
    loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=2)
    (opt.clip_grad_norm_ if hasattr(opt, "clip_grad_norm_") else pm.clip_grad_norm_)(MAX_NORM)  # type: ignore[attr-defined]
    opt.step()  # type: ignore[attr-defined]
    opt.zero_grad()  # type: ignore[attr-defined]
    return loss.item()


def _reshard(rank: int, world: int, folder: str) -> dict:
    import autotp

    batches = _batches()
    example = {"input_ids": batches[0][0][:1], "labels": batches[0][1][:1]}
    expected = {}
    for kind in ("distopt", "plain"):  # the run that never stops, saving after its first step
        pm = autotp.parallelize(build("llama"), tp=2, pp=1, example_inputs=example)
        opt = _optimizer(pm, kind)
        _step(pm, opt, *batches[0])
        pm.save_checkpoint(Path(folder) / kind, optimizer=opt, step=1)
        _step(pm, opt, *batches[1])
        expected[kind] = (pm.unshard_state_dict(), pm.train_step(input_ids=batches[2][0], labels=batches[2][1], num_microbatches=2).item())
    out = {}
    for saved, tp, pp, kind in (("distopt", 1, 2, "distopt"), ("distopt", 1, 2, "plain"), ("distopt", 2, 2, "distopt"),
                                ("plain", 1, 2, "distopt")):  # fmt: skip
        with torch.device("meta"):
            meta = build("llama")
        pm = autotp.parallelize(meta, tp=tp, pp=pp, example_inputs=example)
        opt = _optimizer(pm, kind)
        step = pm.load_checkpoint(Path(folder) / saved, optimizer=opt)
        _step(pm, opt, *batches[1])
        params, loss = pm.unshard_state_dict(), pm.train_step(input_ids=batches[2][0], labels=batches[2][1], num_microbatches=2).item()
        want_params, want_loss = expected[saved]
        for name, value in want_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{saved}->{kind} {tp}x{pp}x{pm.plan.dp} {name}: {m}")
        out[f"{saved}->{kind} tp{tp} pp{pp} dp{pm.plan.dp}"] = (step, loss, want_loss)
    return out


def test_distributed_optimizer_checkpoint_reshards_across_tp_pp_and_dp(tmp_path: Path) -> None:
    results = run_on_ranks(_reshard, 4, str(tmp_path), timeout_s=600)
    for r in results:
        assert set(r) == {"distopt->distopt tp1 pp2 dp2", "distopt->plain tp1 pp2 dp2", "distopt->distopt tp2 pp2 dp1",
                          "plain->distopt tp1 pp2 dp2"}  # fmt: skip
        for what, (step, loss, expected) in r.items():
            assert step == 1, what
            assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6), what


def _save_then_die(rank: int, world: int, folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    import autotp

    batches = _batches()
    pm = autotp.parallelize(build("llama"), tp=1)
    opt = _optimizer(pm, "distopt")
    _step(pm, opt, *batches[0])
    pm.save_checkpoint(Path(folder) / "ckpt", optimizer=opt, step=1)
    torch.save(pm.unshard_state_dict(), Path(folder) / f"first{rank}.pt")
    _step(pm, opt, *batches[1])

    def die(*args: object, **kwargs: object) -> None:
        os._exit(3)  # killed in the middle of writing

    dcp.FileSystemWriter.write_data = die
    pm.save_checkpoint(Path(folder) / "ckpt", optimizer=opt, step=2)


def _load_after_kill(rank: int, world: int, folder: str) -> dict:
    import autotp

    pm = autotp.parallelize(build("llama"), tp=1)
    refused = []
    params = list(pm.parameters())
    for wrong in (torch.optim.SGD(params, lr=0.1), torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}])):
        try:
            pm.load_checkpoint(Path(folder) / "ckpt", optimizer=wrong)
        except ValueError as e:
            refused.append(str(e))
    opt = _optimizer(pm, "distopt")
    step = pm.load_checkpoint(Path(folder) / "ckpt", optimizer=opt)
    first = torch.load(Path(folder) / f"first{rank}.pt")
    same = all(torch.equal(v, first[k]) for k, v in pm.unshard_state_dict().items())
    return {"step": step, "same": same, "refused": refused}


def test_killed_save_leaves_previous_distributed_optimizer_checkpoint_loadable(tmp_path: Path) -> None:
    from autotp.runtime.processes.launcher import RankError

    with pytest.raises(RankError):
        run_on_ranks(_save_then_die, 2, str(tmp_path))
    for r in run_on_ranks(_load_after_kill, 2, str(tmp_path)):
        assert r["step"] == 1 and r["same"]
        assert "holds AdamW optimizer state, but the optimizer is SGD" in r["refused"][0]
        assert "holds 1 param groups, the optimizer has 2; build it with the same groups" in r["refused"][1]
