"""Sweep every causal-LM architecture of the installed transformers at tp=2 and pp=2.

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: build the model from a
tiny config (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128; fp32, eval) and run
it unmodified once (a model that fails here "does not build"), trace it, plan it at tp=2 (share of the parameters sharded), then on two gloo ranks check the
loss, the logits and every grad against the unmodified model at tp=2 and at pp=2. Any
failure keeps its reason (the first line of the error); a numeric mismatch is checked again in
float64, and one that vanishes there is named as fp32 rounding. Writes a Markdown table:

    python benchmarks/sweep_registry.py                  # all, -> docs/registry_sweep.md
    python benchmarks/sweep_registry.py --only llama,gpt2 --out /tmp/sweep.md
    python benchmarks/sweep_registry.py --only bert --merge   # redo some rows of the table
    python benchmarks/sweep_registry.py --jobs 14 --stop-after-s 540   # one process per arch, 14 at a time

Prints the summary: of the architectures that build, how many match at tp=2 and pp=2.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

RTOL, ATOL = 1e-4, 1e-5
VOCAB, BATCH, SEQ = 128, 2, 16
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_local_experts=4, num_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    ffn_dim=128, d_model=64, encoder_layers=2, decoder_layers=2, hidden_dropout=0.0, attention_dropout=0.0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, encoder_hash_byte_group_vocab=VOCAB,
)  # fmt: skip


@dataclass
class Row:
    arch: str
    builds: bool = False
    traces: bool = False
    tp2: bool = False
    pp2: bool = False
    sharded: float | None = None
    reason: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _tiny_kwargs(cls: type[transformers.PretrainedConfig], sub: bool = False) -> dict[str, object]:
    """The TINY sizes ``cls`` takes, and its sub-configs (text, vision, audio...) made tiny
    alike (where a sub-config's field has the type of the TINY value)."""
    default = cls()

    def takes(k: str, v: object) -> bool:
        try:
            current = getattr(default, k)
        except Exception:  # noqa: BLE001 - absent, or per-layer only
            return False
        return not isinstance(getattr(cls, k, None), property) and (not sub or current is None or type(current) is type(v))

    kwargs: dict[str, object] = {k: v for k, v in TINY.items() if takes(k, v)}
    for name in getattr(cls, "sub_configs", None) or {}:
        config = getattr(default, name, None)
        if isinstance(config, transformers.PretrainedConfig):
            kwargs[name] = {"model_type": config.model_type, **_tiny_kwargs(type(config), sub=True)}
    return kwargs


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    cls = getattr(transformers, CONFIG_MAPPING_NAMES[arch])
    config = cls(**_tiny_kwargs(cls))
    text = config.get_text_config()
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[: text.num_hidden_layers]
    return config


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    return model_cls(tiny_config(arch)).float().eval()


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    cause = first.split("failed under torch.export: ")[-1].split(". Fix:")[0]  # a trace error: keep its cause
    return f"{type(e).__name__}: {cause}"[:300].replace("|", "/")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen))


def _loss_logits(out: object) -> tuple[torch.Tensor, torch.Tensor]:
    return (out["loss"], out["logits"]) if isinstance(out, dict) else (out.loss, out.logits)  # type: ignore[union-attr]


MODES = {"tp2": (2, 1), "pp2": (1, 2)}


def _check_on_rank(
    rank: int, world: int, arch: str, keys: tuple[str, ...] = tuple(MODES), dtype: torch.dtype = torch.float32
) -> dict[str, str]:
    """tp=2 and pp=2 on two ranks: '' when equal, else the reason."""
    import autotp
    from autotp.compiler import example_kwargs

    ids, labels = _inputs()
    results: dict[str, str] = {}
    for key in keys:
        tp, pp = MODES[key]
        try:
            model = build(arch).to(dtype)
            reference = copy.deepcopy(model)
            pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs={"input_ids": ids, "labels": labels}, timeout_s=120)
            # the reference runs as traced (use_cache=False where the forward takes it)
            ref_loss, ref_logits = _loss_logits(reference(**example_kwargs(reference, {"input_ids": ids, "labels": labels})))
            ref_loss.backward()
            if pp == 1:
                loss, logits = _loss_logits(pm(input_ids=ids, labels=labels))
                torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
                loss.backward()
            else:
                loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=2)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            grads = pm.unshard_grads()
            for name, p in reference.named_parameters():
                if p.grad is None:
                    continue
                got = grads.get(name)
                if got is None:
                    raise AssertionError(f"no grad for {name}")
                torch.testing.assert_close(got, p.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"grad of {n}: {m}")
            results[key] = ""
        except Exception as e:  # noqa: BLE001 - the reason goes into the table
            results[key] = _reason(e)
    return results


def _too_slow(signum: int, frame: object) -> None:
    raise TimeoutError("took longer than --arch-timeout seconds")


def sweep_one(arch: str, timeout_s: int = 300) -> Row:
    import autotp
    from autotp.analysis.trace import trace
    from autotp.compiler import example_kwargs
    from autotp.runtime.launcher import spawn_ranks

    row = Row(arch)
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(timeout_s)
    try:
        model = build(arch)
        ids, labels = _inputs()
        with torch.no_grad():  # the unmodified model must run on this config for the row to count
            model(**example_kwargs(model, {"input_ids": ids, "labels": labels}))
        row.builds = True
        trace(model, {"input_ids": ids, "labels": labels, "use_cache": False})
        row.traces = True
        plan = autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids, "labels": labels}).plan
        sharded = {p.name for p in plan.params}
        names: dict[int, list[str]] = {}
        tensors = {}
        for name, p in model.named_parameters(remove_duplicate=False):  # tied names count once
            names.setdefault(id(p), []).append(name)
            tensors[id(p)] = p
        total = sum(p.numel() for p in tensors.values())
        row.sharded = sum(p.numel() for i, p in tensors.items() if sharded & set(names[i])) / total
        signal.alarm(0)  # the ranks have their own deadline, and spawn_ranks kills them at it
        results = spawn_ranks(_check_on_rank, 2, arch, backend="gloo", timeout_s=timeout_s, num_threads=1)[0]
        mismatched = tuple(k for k, v in results.items() if v.startswith("AssertionError"))
        if mismatched:  # a bug shows in float64 too; fp32 rounding alone does not
            exact = spawn_ranks(_check_on_rank, 2, arch, mismatched, torch.float64, backend="gloo", timeout_s=timeout_s, num_threads=1)[0]
            for k in mismatched:
                if exact[k] == "":
                    results[k] = f"fp32 rounding only, equal in float64: {results[k]}"
        row.tp2, row.pp2 = results["tp2"] == "", results["pp2"] == ""
        row.reason = "; ".join(f"{k}: {v}" for k, v in results.items() if v)
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        row.reason = _reason(e) if not row.builds else (row.reason or _reason(e))
        if row.builds and not row.traces:
            row.reason = "trace: " + row.reason
        elif not row.builds:
            row.reason = "build: " + row.reason
        else:
            row.reason = row.reason or traceback.format_exc().splitlines()[-1]
    finally:
        signal.alarm(0)
    row.seconds = time.perf_counter() - start
    return row


def table(rows: list[Row]) -> str:
    built = [r for r in rows if r.builds]
    ok_tp, ok_pp = sum(r.tp2 for r in built), sum(r.pp2 for r in built)
    lines = [
        "# Registry sweep: causal-LM architectures of transformers " + transformers.__version__,
        "",
        "Regenerate: `python benchmarks/sweep_registry.py` (tiny configs, fp32, 2 gloo ranks; loss, logits "
        "and every grad against the unmodified model at tp=2 and pp=2).",
        "",
        f"{len(rows)} of the {len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} architectures swept; {len(built)} build from a tiny config; of those, {sum(r.traces for r in built)} trace, "
        f"{ok_tp} match at tp=2 ({ok_tp / max(len(built), 1):.0%}), {ok_pp} match at pp=2 ({ok_pp / max(len(built), 1):.0%}).",
        "",
        "| arch | builds | traces | equal tp=2 | equal pp=2 | params sharded (tp=2) | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    mark = {True: "yes", False: "no"}
    for r in rows:
        share = f"{r.sharded:.0%}" if r.sharded is not None else "-"
        lines.append(f"| {r.arch} | {mark[r.builds]} | {mark[r.traces]} | {mark[r.tp2]} | {mark[r.pp2]} | {share} | {r.reason} |")
    return "\n".join(lines) + "\n"


def read_table(path: Path) -> dict[str, Row]:
    """The rows of a table that ``table`` wrote (for ``--merge``)."""
    rows: dict[str, Row] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or cells[1] not in ("yes", "no"):
            continue
        arch, builds, traces, tp2, pp2, share, reason = cells
        sharded = float(share.rstrip("%")) / 100 if share != "-" else None
        rows[arch] = Row(arch, builds == "yes", traces == "yes", tp2 == "yes", pp2 == "yes", sharded, reason)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "registry_sweep.md")
    parser.add_argument("--arch-timeout", type=int, default=300, help="seconds per architecture (default: 300)")
    parser.add_argument("--merge", action="store_true", help="keep the other rows of the existing --out table")
    parser.add_argument("--jobs", type=int, default=1, help="architectures swept at once, each in its own process")
    parser.add_argument("--stop-after-s", type=float, default=None,
                        help="start no architecture after this many seconds (rows not swept keep their old value)")  # fmt: skip
    args = parser.parse_args()
    archs = [a for a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if not args.only or a in args.only.split(",")]
    kept = read_table(args.out) if args.merge else {}
    rows: list[Row] = []
    for row in _sweep(archs, args.jobs, args.arch_timeout, args.stop_after_s):
        kept[row.arch] = row
        rows = [kept[a] for a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if a in kept]
        print(f"{row.arch:28s} builds={row.builds} traces={row.traces} tp2={row.tp2} pp2={row.pp2} "
              f"sharded={row.sharded} {row.seconds:.0f}s {row.reason[:150]}", flush=True)  # fmt: skip
        args.out.write_text(table(rows))
    print(table(rows).splitlines()[4])


def _crash_reason(log: Path, proc: subprocess.Popen[bytes]) -> str:
    lines = log.read_text(errors="replace").strip().splitlines()
    return f"sweep process exited with {proc.returncode}: {lines[-1] if lines else ''}"[:300].replace("|", "/")


def _sweep(archs: list[str], jobs: int, timeout_s: int, stop_after_s: float | None) -> Iterator[Row]:
    """Rows as they finish: in this process for ``jobs == 1``, else one child process per architecture."""
    start = time.perf_counter()

    def may_start() -> bool:
        return stop_after_s is None or time.perf_counter() - start < stop_after_s

    if jobs == 1:
        for arch in archs:
            if not may_start():
                return
            yield sweep_one(arch, timeout_s)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(archs)
        running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
        while pending or running:
            while pending and len(running) < jobs and may_start():
                arch = pending.pop(0)
                cmd = [sys.executable, __file__, "--only", arch, "--out", f"{tmp}/{arch}.md", "--arch-timeout", str(timeout_s)]
                with open(f"{tmp}/{arch}.log", "wb") as log:
                    running[arch] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), time.perf_counter())
            if not may_start():
                pending.clear()
            for arch, (proc, began) in list(running.items()):
                if proc.poll() is None and time.perf_counter() - began < timeout_s + 60:
                    continue
                proc.kill()
                del running[arch]
                row = read_table(Path(f"{tmp}/{arch}.md")).get(arch) or Row(arch, reason=_crash_reason(Path(f"{tmp}/{arch}.log"), proc))
                row.seconds = time.perf_counter() - began
                yield row
            time.sleep(0.5)


if __name__ == "__main__":
    main()
