"""autotp.DistributedOptimizer (ZeRO-1 over dp, gloo, CPU, fp32): after 5 AdamW steps with
weight decay and clipping every parameter equals the unmodified model trained by
torch.optim.AdamW on one process; each rank keeps 1/dp of the optimizer state; bad input
is refused with the fix."""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_on_ranks
from small_models import build, vocab_size

RTOL, ATOL = 1e-5, 1e-6  # atol: elements near 0 (weights are ~0.1)
# Adam divides by sqrt(v) + eps, which turns fp32 rounding of a near-zero gradient (summed
# in another order over microbatches and ranks) into an O(lr) step; eps = 1e-6 bounds that.
STEPS, MAX_NORM, HYPER = 5, 0.5, {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-6}


def _reference_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, parts: int) -> torch.Tensor:
    losses = [model(input_ids=i, labels=l).loss for i, l in zip(ids.chunk(parts), labels.chunk(parts))]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach()


def _train(rank: int, world: int, name: str, tp: int, pp: int, microbatches: int, bucket_bytes: int | None, device: str = "cpu",
           overlap: bool | None = None) -> dict:  # fmt: skip
    import autotp

    if device == "cuda":
        torch.cuda.set_device(rank)
    model = build(name, layers=2)
    reference = copy.deepcopy(model).to(device)
    gen = torch.Generator().manual_seed(7)
    vocab = vocab_size(model)
    batches = [tuple(torch.randint(0, vocab, (8, 12), generator=gen).to(device) for _ in range(2)) for _ in range(STEPS)]
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs={"input_ids": batches[0][0][:2], "labels": batches[0][1][:2]})
    dp = pm.plan.dp
    opt = autotp.DistributedOptimizer(pm, torch.optim.AdamW, bucket_bytes=bucket_bytes, overlap_param_gather=overlap, **HYPER)
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)
    norms = []
    early: list[int] = []  # buckets the backward hooks launched before train_step's finish
    finish = opt.buffers.finish
    opt.buffers.finish = lambda: (opt.buffers.reduced or early.append(opt.buffers._next), finish())[1]  # type: ignore[method-assign]
    for ids, labels in batches:
        loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=microbatches)
        norm = opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        expected = _reference_step(reference, ids, labels, dp * microbatches)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        norms.append(norm.item())
    state = pm.unshard_state_dict()
    for pname, p in reference.named_parameters():
        torch.testing.assert_close(state[pname], p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{pname} after {STEPS} steps: {m}")
    local = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    full_state = 2 * 4 * local  # AdamW's exp_avg and exp_avg_sq, fp32, of this rank's shards
    return {"state_bytes": opt.state_bytes(), "full_state": full_state, "padding_bytes": 2 * 4 * opt.buffers.padding(),
            "bucket_pad": max(b.grads.numel() // dp for b in opt.buffers.buckets) * 8, "buckets": len(opt.buffers.buckets),
            "dp": dp, "norms": norms, "early": early, "deferred": sum(b.deferred for b in opt.buffers.buckets)}


def _check(results: list[dict]) -> None:
    assert len({tuple(r["norms"]) for r in results}) == 1  # clipped by the same norm everywhere
    assert results[0]["norms"][0] > MAX_NORM  # clipping was active
    for r in results:
        # reduce-scatters overlap the backward: the hooks launched every bucket but the tied
        # parameters' (launched by finish, after their sum over the stages)
        assert r["early"] == [r["buckets"] - r["deferred"]] * STEPS, r
        share = r["full_state"] / r["dp"]
        assert abs(r["state_bytes"] - share) <= r["padding_bytes"] + 2 * 4 * 64 * r["buckets"], r


CASES = [
    # (model, world, tp, pp, microbatches, bucket bytes)
    pytest.param("llama", 2, 1, 1, 2, 4096, id="llama-tp1-dp2-small-buckets"),
    pytest.param("mixtral", 2, 1, 1, 1, None, id="mixtral-tp1-dp2", marks=pytest.mark.slow),
    pytest.param("llama", 4, 2, 1, 1, None, id="llama-tp2-dp2", marks=pytest.mark.slow),
    pytest.param("mixtral", 4, 2, 1, 2, 8192, id="mixtral-tp2-dp2", marks=pytest.mark.slow),
    pytest.param("llama", 8, 2, 2, 2, 8192, id="llama-tp2-pp2-dp2", marks=pytest.mark.slow),
    pytest.param("mixtral", 8, 2, 2, 2, None, id="mixtral-tp2-pp2-dp2", marks=pytest.mark.slow),
    pytest.param("gpt2", 4, 1, 2, 2, None, id="gpt2-tied-pp2-dp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("name", "world", "tp", "pp", "microbatches", "bucket_bytes"), CASES)
def test_matches_adamw_on_the_unmodified_model(name: str, world: int, tp: int, pp: int, microbatches: int, bucket_bytes: int | None) -> None:
    _check(run_on_ranks(_train, world, name, tp, pp, microbatches, bucket_bytes, timeout_s=600))


def _bad_input(rank: int, world: int) -> dict:
    import logging

    import autotp

    messages: dict[str, str] = {}
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 8), generator=gen)
    pm = autotp.parallelize(build("llama"), tp=1, example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    for key, make in (
        ("class", lambda: autotp.DistributedOptimizer(pm, torch.optim.LBFGS, lr=1.0)),
        ("foreign", lambda: autotp.DistributedOptimizer(pm, torch.optim.AdamW, params=[torch.nn.Parameter(torch.zeros(3))])),
        ("partial", lambda: autotp.DistributedOptimizer(pm, torch.optim.AdamW, params=list(pm.parameters())[:1])),
        ("not_pm", lambda: autotp.DistributedOptimizer(build("llama"), torch.optim.AdamW)),
    ):
        try:
            make()
        except ValueError as e:
            messages[key] = str(e)
    opt = autotp.DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-2)
    pm.train_step(input_ids=ids, labels=ids)
    for key, call in (("pm_clip", lambda: pm.clip_grad_norm_(1.0)), ("twice", lambda: autotp.DistributedOptimizer(pm, torch.optim.AdamW))):
        try:
            call()
        except ValueError as e:
            messages[key] = str(e)
    try:
        pm.train_step(input_ids=ids, labels=ids)  # no zero_grad after the reduce-scatter
    except RuntimeError as e:
        messages["no_zero_grad"] = str(e)
    opt.zero_grad()

    # load_state_dict restores the optimizer: the same step from the same state gives the same parameters.
    pm.train_step(input_ids=ids, labels=ids)
    opt.step()
    opt.zero_grad()
    saved, params = opt.state_dict(), [p.detach().clone() for p in pm.parameters()]
    pm.train_step(input_ids=ids, labels=ids)
    opt.step()
    opt.zero_grad()
    after = [p.detach().clone() for p in pm.parameters()]
    with torch.no_grad():
        for p, v in zip(pm.parameters(), params):
            p.copy_(v)
    opt.load_state_dict(saved)
    pm.train_step(input_ids=ids, labels=ids)
    opt.step()
    opt.zero_grad()
    replayed = all(torch.equal(p, a) for p, a in zip(pm.parameters(), after))
    other = dict(saved, dp=4)
    try:
        opt.load_state_dict(other)
    except ValueError as e:
        messages["dp"] = str(e)

    zb = autotp.parallelize(build("llama"), pp=2, example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    autotp.DistributedOptimizer(zb, torch.optim.AdamW, lr=1e-2)
    try:
        zb.train_step(input_ids=ids, labels=ids, num_microbatches=2, schedule="zbh1")
    except ValueError as e:
        messages["zbh1"] = str(e)

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("autotp.runtime.gradients.distributed_optimizer").addHandler(handler)
    pm1 = autotp.parallelize(build("llama"), tp=2, example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    autotp.DistributedOptimizer(pm1, torch.optim.AdamW, lr=1e-2)
    return {"messages": messages, "replayed": replayed, "dp1_log": records}


def test_bad_input_is_refused_with_the_fix() -> None:
    results = run_on_ranks(_bad_input, 2)
    r = results[0]
    m = r["messages"]
    assert "LBFGS cannot be sharded over dp" in m["class"] and "AdamW" in m["class"] and "SGD" in m["class"]
    assert "tensor 0 of param group 0 (shape (3,), torch.float32) is not a parameter of this ParallelModel" in m["foreign"]
    assert "require grad but are in no param group" in m["partial"]
    assert "needs the ParallelModel that autotp.parallelize returned, got LlamaForCausalLM" in m["not_pm"]
    assert "call opt.clip_grad_norm_" in m["pm_clip"]
    assert "already has a DistributedOptimizer" in m["twice"]
    assert "call opt.zero_grad() after opt.step()" in m["no_zero_grad"]
    assert "saved with dp=4 and this run has dp=2" in m["dp"] and "reshards" in m["dp"]
    assert "schedule 'zbh1' adds the linear weight gradients outside autograd" in m["zbh1"] and "'1f1b'" in m["zbh1"]
    assert r["replayed"]
    assert any("dp=1 shards nothing" in line for line in r["dp1_log"])
    assert not any("shards nothing" in line for line in results[1]["dp1_log"])  # said once, by rank 0


def _bf16(rank: int, world: int) -> dict:
    import autotp

    model = build("llama")
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (4, 12), generator=gen)
    pm = autotp.parallelize(model.to(torch.bfloat16), tp=1, example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    opt = autotp.DistributedOptimizer(pm, torch.optim.AdamW, bucket_bytes=8192, **HYPER)
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)
    losses, ref_losses = [], []
    for _ in range(3):
        losses.append(pm.train_step(input_ids=ids, labels=ids, num_microbatches=2).item())
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        ref_losses.append(_reference_step(reference, ids, ids, 4).item())
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
    pieces = opt._pieces.values()
    written = all(torch.equal(p.param_range(), p.master.detach().to(torch.bfloat16)) for p in pieces)
    finer = any(not torch.equal(p.master.detach().to(torch.bfloat16).float(), p.master.detach()) for p in pieces)
    return {"losses": losses, "ref_losses": ref_losses, "written": written, "finer": finer, "step": opt.step_definition.precision,
            "grad_dtypes": {str(s.grad.dtype) for s in opt.buffers.slots.values()},
            "master_dtypes": {str(p.master.dtype) for p in pieces}, "param_dtypes": {str(p.dtype) for p in pm.parameters()},
            "grads_none": all(p.grad is None for p in pm.parameters()),
            "state_bytes": opt.state_bytes(), "params": sum(p.numel() for p in pm.parameters()), "padding": opt.buffers.padding()}


def test_bf16_params_train_on_fp32_main_grads_and_masters() -> None:
    for r in run_on_ranks(_bf16, 2):
        assert r["step"] == "bf16-fp32-grads"
        assert r["grad_dtypes"] == {"torch.float32"} and r["master_dtypes"] == {"torch.float32"}
        assert r["param_dtypes"] == {"torch.bfloat16"} and r["grads_none"]  # bf16 .grad is added into main_grad and freed
        # 4 bytes of master + 8 of Adam state per parameter of this rank's half
        assert abs(r["state_bytes"] - 12 * r["params"] / 2) <= 12 * (r["padding"] + 64 * 4)
        assert r["written"]  # the parameters hold the masters rounded to bf16
        assert r["finer"]  # and the masters keep what bf16 cannot
        # the fp32 model's trajectory, within bf16 rounding
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=2e-2)
