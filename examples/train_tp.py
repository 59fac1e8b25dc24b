"""Train llama-tiny with tensor parallelism under torchrun.

    torchrun --nproc-per-node 2 examples/train_tp.py

Every rank builds the same model (same seed), ``parallelize`` keeps this rank's shards,
and ``train_step`` runs forward and backward; the loss is the same on every rank.
Uses NCCL when each rank can have its own GPU, else gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotp import init_distributed, parallelize, presets

STEPS = 5


def main() -> None:
    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = presets.build_model("llama-tiny", device=device, dtype=torch.float32)
    input_ids = presets.example_inputs(model, batch=4, seq=32, seed=0)["input_ids"]

    pm = parallelize(model, tp=dist.get_world_size(), example_inputs={"input_ids": input_ids, "labels": input_ids})
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    for step in range(1, STEPS + 1):
        loss = pm.train_step(input_ids=input_ids, labels=input_ids, num_microbatches=2)
        pm.clip_grad_norm_(1.0)  # the global norm, each parameter counted once across ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step}  loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
