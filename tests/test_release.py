"""``del pm`` frees the model's parameters at once: no reference cycle holds them until the
garbage collector runs (a user who builds a second model would run out of memory)."""

from __future__ import annotations

import gc
import weakref

import torch

import moe_models
from distributed import run_on_ranks
from general_models import VOCAB
from small_models import build, vocab_size


def _dead_after_del(rank: int, world: int) -> dict[str, bool]:
    import autotp

    out = {}
    for case in ("tp2", "pp2", "dp2_distributed_optimizer", "dp2_plain", "ep2_distributed_optimizer"):
        model = moe_models.build("fused_index_add") if case.startswith("ep") else build("llama", layers=2)
        vocab = VOCAB if case.startswith("ep") else vocab_size(model)
        ids = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(0))
        degrees = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "ep2_distributed_optimizer": {"ep": 2}}.get(case, {"tp": 1})
        pm = autotp.parallelize(model, **degrees, example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
        opt = autotp.DistributedOptimizer(pm, torch.optim.AdamW, lr=1e-3) if "distributed" in case else torch.optim.AdamW(pm.parameters())
        for _ in range(2):  # grads, hooks, buffers, the optimizer's state
            pm.train_step(input_ids=ids, labels=ids, num_microbatches=2)
            opt.step()
            opt.zero_grad()
        refs = [weakref.ref(p) for p in pm.parameters()]
        gc.collect()
        gc.disable()
        try:
            del pm, opt
            out[case] = all(r() is None for r in refs)
        finally:
            gc.enable()
    return out


def test_del_pm_frees_its_parameters_without_the_garbage_collector() -> None:
    for result in run_on_ranks(_dead_after_del, 2):
        assert result == {"tp2": True, "pp2": True, "dp2_distributed_optimizer": True, "dp2_plain": True,
                          "ep2_distributed_optimizer": True}, result  # fmt: skip
