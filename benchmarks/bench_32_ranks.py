"""tp=8 x pp=4 = 32 ranks, validated for numerics on one CPU host (gloo).

Why real processes and not a simulator: the point is to exercise the code that runs at
this scale (32 process groups, Megatron rank order, P2P between pipeline stages, tied
parameter groups, KV heads replicated when tp > num_key_value_heads) and not a model of
it. 32 gloo processes of a tiny Llama fit in ~12 GB on a 2-core machine; the check takes
a few minutes, which is why it is a benchmark here and not a CI test.

    python benchmarks/bench_32_ranks.py

Every rank compares the loss and every parameter's gradient of one 1F1B train step
(8 microbatches) with the unmodified model on the same global batch, in fp32.
"""

from __future__ import annotations

import copy
import time

import torch

from autotp.runtime.processes.launcher import spawn_ranks

TP, PP, MICROBATCHES, BATCH, SEQ = 8, 4, 8, 8, 16


def _check(rank: int, world: int) -> dict[str, float]:
    import autotp
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                         num_attention_heads=8, num_key_value_heads=4)).eval()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    start = time.perf_counter()
    pm = autotp.parallelize(model, tp=TP, pp=PP, example_inputs={"input_ids": ids[:1], "labels": labels[:1]})
    compiled_s = time.perf_counter() - start
    loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=MICROBATCHES)
    ref_losses = [reference(input_ids=i, labels=l).loss for i, l in zip(ids.chunk(MICROBATCHES), labels.chunk(MICROBATCHES))]
    ref_loss = torch.stack(ref_losses).mean()
    ref_loss.backward()
    grads = pm.unshard_grads()
    worst = max(((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)).item() for n, p in reference.named_parameters())
    for n, p in reference.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {rank}: grad of {n}: {m}")
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "worst_grad_rel": worst, "compile_s": compiled_s,
            "local_params": sum(p.numel() for p in pm.parameters())}


def main() -> None:
    start = time.perf_counter()
    results = spawn_ranks(_check, TP * PP, backend="gloo", timeout_s=1500, num_threads=1)
    total = sum(p.numel() for p in __import__("transformers").LlamaForCausalLM(
        __import__("transformers").LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=8, num_attention_heads=8,
                                               num_key_value_heads=4)).parameters())
    losses = {round(r["loss"], 6) for r in results}
    print(f"{TP * PP} ranks (tp={TP} x pp={PP}), 1F1B with {MICROBATCHES} microbatches, gloo on CPU")
    print(f"loss on every rank: {sorted(losses)} vs unmodified {results[0]['ref_loss']:.6f}")
    print(f"worst relative grad error over all ranks and parameters: {max(r['worst_grad_rel'] for r in results):.2e}")
    print(f"parameters per rank: {min(r['local_params'] for r in results)}..{max(r['local_params'] for r in results)} of {total}")
    print(f"compile per rank: {max(r['compile_s'] for r in results):.1f} s; wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
