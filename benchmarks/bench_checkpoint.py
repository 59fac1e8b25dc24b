"""Checkpoint I/O at TP=2 on 2 GPUs (``--tp``: other degrees, one GPU per rank): shard-on-read load (cold and warm page cache),
``save_pretrained`` and DCP save, against ``from_pretrained`` + the narrow-and-copy path.

    python benchmarks/bench_checkpoint.py --dir /tmp/llama3-8b-synth [--layers 32] [--json out.json]
    (--write-only writes the checkpoint and stops; --tiny runs a small model on CPU)

The first run writes a synthetic Llama-3-8B-shaped bf16 HF checkpoint into ``--dir``
(random weights, 5 GB files, index, config.json; nothing is downloaded). Then, per rank:

- autotp: ``parallelize(meta model, tp=2, checkpoint=dir)`` after evicting the files from
  the page cache (cold), then the same read again (warm): load seconds, bytes read, peak
  host RSS, peak GPU memory; then ``save_pretrained`` and ``save_checkpoint`` (DCP) times.
- baseline (separate processes, so RSS is its own): ``from_pretrained(dir)`` on the CPU of
  every rank, then ``parallelize(model, tp=2)``, which narrows and copies each shard to the
  GPU (the path before shard-on-read). Cold and warm the same way.

Targets (issue 13): load ≤ 20 s cold, ≤ 5 s warm, host RSS ≤ model/tp + 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from autotp.runtime.processes.launcher import spawn_ranks

SEQ = 128


def _config(layers: int, tiny: bool) -> object:
    from transformers import LlamaConfig

    if tiny:  # a smoke test of this script on CPU
        return LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=2, dtype="bfloat16")  # fmt: skip
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gpu_peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def write_checkpoint(folder: Path, layers: int, tiny: bool = False) -> int:
    """A random bf16 HF checkpoint of Llama-3-8B's shapes, written tensor by tensor."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    if (folder / "model.safetensors.index.json").exists():
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(layers, tiny)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    files: list[dict[str, torch.Tensor]] = [{}]
    size, limit, weight_map, total = 0, 5 * 10**9, {}, 0
    names = []

    def flush() -> None:
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(files[-1], str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(files[-1], name))
        names.append(name)
        files.append({})

    for key, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) if len(shape) > 1 else torch.ones(shape, dtype=torch.bfloat16)
        if size + t.numel() * 2 > limit and files[-1]:
            flush()
            size = 0
        files[-1][key] = t
        size += t.numel() * 2
        total += t.numel() * 2
    flush()
    n = len(names)
    final = {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, name in enumerate(names)}
    for old, new in final.items():
        (folder / old).rename(folder / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(folder)
    return total


def evict(folder: Path) -> None:
    """Drop ``folder``'s files from the page cache (cold reads)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rss_gb() -> float:
    """This process's peak resident memory (``VmHWM``: unlike ``ru_maxrss`` it does not carry the parent's peak
    across ``fork`` + ``exec``, and the parent held the whole model while writing the checkpoint)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # KiB -> GiB
    raise RuntimeError("no VmHWM in /proc/self/status (needs Linux)")


def _ids(vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(0))
    return ids.cuda() if torch.cuda.is_available() else ids


def _autotp_worker(rank: int, world: int, folder: str, out: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    import autotp

    logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(folder)
    ids = _ids(config.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if rank == 0:
        evict(Path(folder))
    dist.barrier()
    start = time.perf_counter()
    pm = autotp.parallelize(model, tp=world, checkpoint=folder, example_inputs={"input_ids": ids})
    _sync()
    total_cold = time.perf_counter() - start
    r = {"cold_load_s": pm.materialize_s, "cold_total_s": total_cold, "bytes_read": pm.checkpoint_bytes_read,
         "rss_after_load_gb": _rss_gb(), "gpu_peak_gb": _gpu_peak_gb()}  # fmt: skip
    dist.barrier()
    pm.materialize(model, folder, 0)  # the same read with the files in the page cache
    _sync()
    r["warm_load_s"] = pm.materialize_s
    logits = pm(input_ids=ids).logits
    r["logit_checksum"] = float(logits.detach().float().abs().sum())
    for what, call in (("save_pretrained_s", lambda: pm.save_pretrained(Path(out) / "hf")),
                       ("dcp_save_s", lambda: pm.save_checkpoint(Path(out) / "dcp"))):  # fmt: skip
        dist.barrier()
        start = time.perf_counter()
        call()
        dist.barrier()
        r[what] = time.perf_counter() - start
    r["rss_peak_gb"] = _rss_gb()
    return r


def _baseline_worker(rank: int, world: int, folder: str, cold: bool) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    import autotp

    logging.set_verbosity_error()
    ids = _ids(AutoConfig.from_pretrained(folder).vocab_size)
    if cold and rank == 0:
        evict(Path(folder))
    dist.barrier()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    loaded = time.perf_counter()
    pm = autotp.parallelize(model, tp=world, example_inputs={"input_ids": ids})
    _sync()
    done = time.perf_counter()
    logits = pm(input_ids=ids).logits
    return {"from_pretrained_s": loaded - start, "parallelize_s": done - loaded, "total_s": done - start,
            "rss_peak_gb": _rss_gb(), "gpu_peak_gb": _gpu_peak_gb(),
            "logit_checksum": float(logits.detach().float().abs().sum())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/llama3-8b-synth"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-checkpoint-out"))
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3-8B)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tp", type=int, default=2, help="ranks, one per GPU (default: 2)")
    parser.add_argument("--tiny", action="store_true", help="a small model on gloo CPU ranks: checks the script runs")
    parser.add_argument("--write-only", action="store_true", help="only write the synthetic checkpoint")
    args = parser.parse_args()
    backend = "gloo" if args.tiny else "nccl"
    if not args.tiny and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} GPUs (or --tiny)")
    start = time.perf_counter()
    size = write_checkpoint(args.dir, args.layers, args.tiny)
    print(f"checkpoint {args.dir}: {size / 1e9:.2f} GB bf16 (written/found in {time.perf_counter() - start:.0f} s)")
    if args.write_only:
        return
    shutil.rmtree(args.out, ignore_errors=True)
    ours = spawn_ranks(_autotp_worker, args.tp, str(args.dir), str(args.out), backend=backend, timeout_s=3600)
    base_cold = spawn_ranks(_baseline_worker, args.tp, str(args.dir), True, backend=backend, timeout_s=3600)
    base_warm = spawn_ranks(_baseline_worker, args.tp, str(args.dir), False, backend=backend, timeout_s=3600)
    target_rss = size / args.tp / 2**30 + 2
    print(f"\n{'rank':>4} {'cold s':>7} {'warm s':>7} {'GB read':>8} {'RSS GiB':>8} {'GPU GiB':>8} "
          f"{'save_pretrained s':>17} {'DCP save s':>10}")  # fmt: skip
    for rank, r in enumerate(ours):
        print(f"{rank:>4} {r['cold_load_s']:7.1f} {r['warm_load_s']:7.1f} {r['bytes_read'] / 1e9:8.2f} "
              f"{r['rss_after_load_gb']:8.1f} {r['gpu_peak_gb']:8.1f} {r['save_pretrained_s']:17.1f} {r['dcp_save_s']:10.1f}")  # fmt: skip
    print(f"\nbaseline from_pretrained + narrow-and-copy (per rank 0): cold {base_cold[0]['total_s']:.1f} s "
          f"(from_pretrained {base_cold[0]['from_pretrained_s']:.1f} s), warm {base_warm[0]['total_s']:.1f} s, "
          f"RSS {base_cold[0]['rss_peak_gb']:.1f} GiB, GPU {base_cold[0]['gpu_peak_gb']:.1f} GiB")
    o = ours[0]
    print(f"autotp shard-on-read (rank 0): cold {o['cold_load_s']:.1f} s load / {o['cold_total_s']:.1f} s with "
          f"tracing, warm {o['warm_load_s']:.1f} s, RSS {o['rss_after_load_gb']:.1f} GiB (target ≤ {target_rss:.1f})")
    print(f"speedup vs baseline (load incl. tracing): cold {base_cold[0]['total_s'] / o['cold_total_s']:.2f}x; "
          f"host RSS ratio {base_cold[0]['rss_peak_gb'] / o['rss_after_load_gb']:.2f}x")
    print(f"bytes read per rank / checkpoint: {o['bytes_read'] / size:.3f} (1/tp plus replicated norms)")
    print(f"targets: cold ≤ 20 s {'OK' if o['cold_load_s'] <= 20 else 'MISSED'}, warm ≤ 5 s "
          f"{'OK' if o['warm_load_s'] <= 5 else 'MISSED'}, RSS {'OK' if o['rss_after_load_gb'] <= target_rss else 'MISSED'}")
    same = abs(o["logit_checksum"] - base_cold[0]["logit_checksum"]) <= 1e-3 * abs(base_cold[0]["logit_checksum"])
    print(f"logits agree with the baseline: {same} ({o['logit_checksum']:.6g} vs {base_cold[0]['logit_checksum']:.6g})")
    if args.json:
        args.json.write_text(json.dumps({"size": size, "autotp": ours, "baseline_cold": base_cold,
                                         "baseline_warm": base_warm}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
