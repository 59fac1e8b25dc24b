"""One GPU: what the ``causal_attention`` pass buys, against the unmodified HF model.

HF's eager SDPA path drops its causal mask when nothing pads the batch (``is_causal=True``,
the flash kernel); a traced graph keeps the mask it built, which rules that kernel out.
The pass proves the traced mask causal-only and restores ``is_causal=True``. This runs
fwd+bwd (``labels=``) of a Llama with 8B widths on one GPU, bf16, median of timed steps
after warm-up, for: HF eager, HF compiled (the user's single-GPU baseline), autotp tp=1
compiled with the pass, and autotp tp=1 compiled with the pass switched off
(``plan.causal_attention=False``). It prints step time, ratio to compiled HF, MFU
(6·N·tokens + causal attention over 989 TFLOP/s) and peak memory, and the loss of each
(equal up to bf16 noise)::

    python benchmarks/bench_attention_mask.py [--layers 4] [--batch 4] [--seq 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autotp.runtime.processes.launcher import spawn_ranks

PEAK_FLOPS = 989.4e12
WARMUP, STEPS = 3, 10


def _model(layers: int, device: str = "cuda") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(use_cache=False, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def _flops(model: torch.nn.Module, batch: int, seq: int) -> float:
    params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    attention = 4 * batch * seq * seq * cfg.hidden_size * cfg.num_hidden_layers / 2  # causal: half the scores
    return 6 * params * batch * seq + 3 * attention


def _time(step: Callable[[], torch.Tensor]) -> tuple[float, float, float]:
    """(median seconds, peak GiB, loss) of ``step`` (forward + backward)."""
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], 0.0
    for i in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step().item()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, loss


def _worker(rank: int, world: int, layers: int, batch: int, seq: int) -> list[dict]:
    import autotp
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.cuda.set_device(rank)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    rows = []

    def hf(compiled: bool) -> Callable[[], torch.Tensor]:
        model = _model(layers)
        run = torch.compile(model) if compiled else model

        def step() -> torch.Tensor:
            loss = run(**inputs).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    def autotp_step(causal: bool) -> Callable[[], torch.Tensor]:
        model = _model(layers)
        plan = autotp.parallelize(model, tp=1, example_inputs=inputs, compile=True).plan
        pm = autotp.parallelize(model, tp=1, example_inputs=inputs, compile=True,
                                plan=dataclasses.replace(plan, causal_attention=causal))  # fmt: skip

        def step() -> torch.Tensor:
            loss = pm.train_step(**inputs)
            for p in pm.parameters():
                p.grad = None
            return loss.detach()

        rows.append({"setup": f"causal nodes ({'on' if causal else 'off'})", "nodes": len(pm.plan.causal_attention_nodes)})
        return step

    flops = _flops(_model(layers, "meta"), batch, seq)
    for name, make in (("HF eager", lambda: hf(False)), ("HF compiled", lambda: hf(True)),
                       ("autotp tp=1 compiled, causal_attention on", lambda: autotp_step(True)),
                       ("autotp tp=1 compiled, causal_attention off", lambda: autotp_step(False))):  # fmt: skip
        seconds, peak, loss = _time(make())
        rows.append({"setup": name, "step_ms": seconds * 1e3, "peak_gib": peak, "loss": loss,
                     "mfu": flops / seconds / PEAK_FLOPS})  # fmt: skip
        torch.cuda.empty_cache()
    dist.barrier()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rows = spawn_ranks(_worker, 1, args.layers, args.batch, args.seq, backend="nccl", timeout_s=1200)[0]
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, Llama 8B widths, {args.layers} layers, "
          f"vocab 32000, b{args.batch} s{args.seq}, bf16, fwd+bwd")
    timed = [r for r in rows if "step_ms" in r]
    baseline = next(r for r in timed if r["setup"] == "HF compiled")
    print(f"{'setup':45s} {'ms':>8s} {'vs HF compiled':>14s} {'MFU':>6s} {'GiB':>6s} {'loss':>8s}")
    for r in timed:
        print(f"{r['setup']:45s} {r['step_ms']:>8.1f} {baseline['step_ms'] / r['step_ms']:>13.3f}x {r['mfu']:>6.1%} "
              f"{r['peak_gib']:>6.1f} {r['loss']:>8.4f}")
    for r in rows:
        if "nodes" in r:
            print(f"SDPA calls made is_causal by the pass, {r['setup']}: {r['nodes']}")


if __name__ == "__main__":
    main()
