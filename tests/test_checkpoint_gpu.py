"""Checkpoints on GPUs through NCCL (skipped without 2 GPUs): a bf16 HF checkpoint read
shard by shard onto the GPUs is bitwise the checkpoint, and save_pretrained / DCP write it
back bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autotp.runtime.processes.launcher import spawn_ranks
from small_models import build


def _load_save(rank: int, world: int, folder: str) -> str:
    import autotp

    root = Path(folder)
    results = []
    for name in ("llama", "gpt2", "mixtral"):
        with torch.device("meta"):
            meta = build(name).to(torch.bfloat16)
        pm = autotp.parallelize(meta, tp=world, checkpoint=root / name)
        assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in pm.parameters())
        pm.save_pretrained(root / f"{name}-out", max_shard_size="30KB")
        pm.save_checkpoint(root / f"{name}-dcp")
        state = pm.unshard_state_dict(to_rank=0)
        if rank == 0:
            torch.save({k: v.cpu() for k, v in state.items()}, root / f"{name}-state.pt")
        results.append(name)
    return ",".join(results)


@pytest.mark.gpu
def test_bf16_checkpoint_loads_onto_gpus_and_saves_back_bitwise(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    from transformers import AutoModelForCausalLM

    for name in ("llama", "gpt2", "mixtral"):
        build(name).to(torch.bfloat16).save_pretrained(tmp_path / name, max_shard_size="20KB")
    spawn_ranks(_load_save, 2, str(tmp_path), backend="nccl", timeout_s=300)
    for name in ("llama", "gpt2", "mixtral"):
        original = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.bfloat16).state_dict()
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-out", dtype=torch.bfloat16).state_dict()
        gathered = torch.load(tmp_path / f"{name}-state.pt")
        assert list(gathered) == list(original)
        for k, v in original.items():
            assert torch.equal(gathered[k], v), (name, k)
            assert torch.equal(exported[k], v), (name, k)
        assert (tmp_path / f"{name}-dcp" / ".metadata").exists()
