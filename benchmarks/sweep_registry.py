"""Sweep every causal-LM architecture of the installed transformers under the strict rule
(``--task seq2seq``: every encoder-decoder one).

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``): build the model from a
tiny config (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128; fp32, eval; where those
sizes alone leave a config inconsistent, also the sizes that follow from them, ``TINY_DERIVED``)
and run it unmodified once (a model that fails here "does not build"), then on gloo ranks check it at
tp=2, tp=4 and pp=2 under the strict rule (``autotp.report.strict_rule``: loss, logits and
every grad equal to the unmodified model's, each rank holding at most 1.3/(tp*pp) of the
parameters, no matmul weight kept whole without a ``kept_whole`` plan entry). Any failure
keeps its reason; a numeric mismatch is checked again in float64, and one that vanishes
there is named as fp32 rounding (it still fails). Writes a Markdown table:

    python benchmarks/sweep_registry.py                  # all, -> docs/registry_sweep.md
    python benchmarks/sweep_registry.py --only llama,gpt2 --out /tmp/sweep.md
    python benchmarks/sweep_registry.py --only bert --merge   # redo some rows of the table
    python benchmarks/sweep_registry.py --modes tp2,tp4 --merge   # some degrees; the others keep their old cells
    python benchmarks/sweep_registry.py --jobs 14 --stop-after-s 540   # one process per arch, 14 at a time
    python benchmarks/sweep_registry.py --task seq2seq   # encoder-decoder models, -> docs/registry_sweep_seq2seq.md

Prints the summary: of the architectures that build, how many pass at each degree.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

VOCAB, BATCH, SEQ = 128, 2, 16
TASKS = {"causal-lm": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "seq2seq": MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}  # task -> model_type -> class name
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_local_experts=4, num_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    ffn_dim=128, d_model=64, encoder_layers=2, decoder_layers=2, hidden_dropout=0.0, attention_dropout=0.0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, encoder_hash_byte_group_vocab=VOCAB,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128, mamba_d_state=16, mamba_chunk_size=16,  # hybrids' Mamba2 mixers, 128 wide
)  # fmt: skip
# What a config takes where the TINY sizes alone leave it inconsistent (its model does not build or
# run on them; ``_needs_derived``): sizes that follow from TINY's hidden 64 / 4 heads of 16 / 2 layers,
# under the names TINY lacks. Only such a config takes them, so the configs of the architectures that
# TINY builds stay as they were. ``tiny_config`` also shrinks ``layer_types`` to the 2 layers keeping
# each layer type, and fills RoPE fields a sub-config lacks from the top-level config.
TINY_DERIVED = dict(
    # latent attention (MLA): ranks and head dims of 16-wide heads, a key head per query head (the
    # latent is expanded to every head), one dense layer before the MoE ones, one expert group
    num_key_value_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32,
    index_head_dim=32, index_n_heads=4, n_group=1, topk_group=1, first_k_dense_replace=1, num_dense_layers=1,
    n_shared_experts=1, zero_expert_num=2,
    # a rotary part of the 16-wide heads (GPT-J, CodeGen); 16-wide XLNet heads
    rotary_dim=8, d_head=16,
    # encoder/decoder heads and widths, FFN widths and the layer count under other names
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    ffn_hidden_size=128, d_inner=128, hidden_size_global=64, num_layers=2,
    # a 128-wide SSM (Mamba2): 8 heads of 16, a 16-wide state, one group, chunks of 16
    num_heads=8, state_size=16, n_groups=1, chunk_size=16,
    # one global/local pair (the pattern GPT-Neo repeats); no layer reading another's KV cache (2 layers
    # have none to share); DBRX's published qkv clip (its default None reaches a clamp that needs a bound)
    attention_types=[[["global", "local"], 1]], num_kv_shared_layers=0, clip_qkv=8.0,
)  # fmt: skip


_PRELOAD = ("torch", "transformers", "autotp.api", "autotp.report.strict_rule")  # and the arch's modeling module: imported once per arch, not per rank
MODES = {"tp2": (2, 1), "tp4": (4, 1), "pp2": (1, 2)}  # mode: (tp, pp)


@dataclass
class Cell:
    """One architecture at one degree: passed, the largest share of the parameters a rank
    held, and why it failed."""

    passed: bool = False
    share: float | None = None
    reason: str = ""


@dataclass
class Row:
    arch: str
    builds: bool = False
    cells: dict[str, Cell] = field(default_factory=dict)
    reason: str = ""  # why it does not build
    seconds: float = 0.0

    def passed(self, mode: str) -> bool:
        return mode in self.cells and self.cells[mode].passed


def _tiny_kwargs(cls: type[transformers.PretrainedConfig], sub: bool = False, sizes: dict[str, object] = TINY) -> dict[str, object]:
    """The ``sizes`` ``cls`` takes, and its sub-configs (text, vision, audio...) made tiny
    alike (where a sub-config's field has the type of the size)."""
    default = cls()

    def takes(k: str, v: object) -> bool:
        try:
            current = getattr(default, k)
        except Exception:  # noqa: BLE001 - absent, or per-layer only
            return False
        return not isinstance(getattr(cls, k, None), property) and (not sub or current is None or type(current) is type(v))

    kwargs: dict[str, object] = {k: v for k, v in sizes.items() if takes(k, v)}
    for name in getattr(cls, "sub_configs", None) or {}:
        config = getattr(default, name, None)
        if isinstance(config, transformers.PretrainedConfig):
            kwargs[name] = {"model_type": config.model_type, **_tiny_kwargs(type(config), sub=True, sizes=sizes)}
    return kwargs


def tiny_config(arch: str, derived: bool | None = None, task: str = "causal-lm") -> transformers.PretrainedConfig:
    """``arch``'s config at the TINY sizes; with ``derived``, also at the ``TINY_DERIVED`` ones
    (by default only where the TINY sizes alone do not build)."""
    if derived is None:
        derived = _needs_derived(arch, task)
    cls = getattr(transformers, CONFIG_MAPPING_NAMES[arch])
    kwargs = _tiny_kwargs(cls, sizes={**TINY, **TINY_DERIVED} if derived else TINY)
    layers = TINY["num_hidden_layers"]
    default = cls()
    types = getattr(default, "layer_types", None)
    if derived and types is None and hasattr(default, "layer_types"):  # a model that reads the types the default leaves out
        types = ["full_attention"] * layers
    if derived and isinstance(types, list) and not _read_only(default, "layer_types"):
        # a config that checks it against the layer count, or derives fields from it, under the name it stores
        kwargs[default.attribute_map.get("layer_types", "layer_types")] = _shrink(types, layers)
        if getattr(default, "rope_parameters", None) == {}:  # no RoPE in the default: the default RoPE per layer type
            kwargs["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in set(types)}
    config = _validated(cls, kwargs)
    if derived:  # a sub-config lacking the RoPE fields its model still reads takes the top-level ones
        for name in getattr(config, "sub_configs", None) or {}:
            sub = getattr(config, name, None)
            for k, v in (getattr(config, "rope_parameters", None) or {}).items():
                if isinstance(sub, transformers.PretrainedConfig) and not hasattr(sub, k):
                    setattr(sub, k, v)
    start = getattr(config, "decoder_start_token_id", None)
    if task == "seq2seq" and not (isinstance(start, int) and 0 <= start < VOCAB):
        # the decoder's first token inside the tiny vocabulary: T5's config has none, Marian's is its pad id, 58100
        config.decoder_start_token_id = 0
    text = _model_config(arch, config, task).get_text_config()
    if isinstance(getattr(text, "layer_types", None), list) and not _read_only(text, "layer_types"):
        text.layer_types = _shrink(text.layer_types, text.num_hidden_layers) if derived else text.layer_types[: text.num_hidden_layers]
    return config


def _validated(cls: type[transformers.PretrainedConfig], kwargs: dict[str, object]) -> transformers.PretrainedConfig:
    """``cls(**kwargs)``; a size the config's own validation refuses by name (ZAYA routes each
    token to one expert only) is left at the config's default."""
    while True:
        try:
            return cls(**kwargs)
        except Exception as e:  # noqa: BLE001 - validators raise several types
            refused = [k for k in kwargs if f"`{k}=" in str(e) or f"`{k}`" in str(e)]
            if not refused:
                raise
            for k in refused:
                del kwargs[k]


def _shrink(types: list[str], n: int) -> list[str]:
    """A per-layer list cut to ``n`` layers: its first ``n``, or, where those drop a layer type,
    the first layer of each type (a hybrid model keeps its attention and its recurrent layers)."""
    firsts = sorted({t: i for i, t in reversed(list(enumerate(types)))}.values())
    return types[:n] if len(set(types[:n])) == len(firsts) or len(firsts) > n else [types[i] for i in firsts] + types[len(firsts) : n]


def _read_only(config: transformers.PretrainedConfig, name: str) -> bool:
    """Whether ``config.name`` (or the field it is an alias of) is a property without a setter:
    derived from other fields (the layer count), so it follows them."""
    attr = getattr(type(config), getattr(config, "attribute_map", {}).get(name, name), None)
    return isinstance(attr, property) and attr.fset is None


def _model_config(arch: str, config: transformers.PretrainedConfig, task: str = "causal-lm") -> transformers.PretrainedConfig:
    """The config ``arch``'s class for ``task`` takes: ``config``, or its sub-config of the class's
    ``config_class`` (the text or decoder config of a composite one)."""
    want = getattr(transformers, TASKS[task][arch]).config_class
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", None) or {}]
    return next((sub for sub in subs if want is not None and not isinstance(config, want) and isinstance(sub, want)), config)


def _build(config: transformers.PretrainedConfig, arch: str, task: str = "causal-lm") -> torch.nn.Module:
    torch.manual_seed(0)
    model_cls = getattr(transformers, TASKS[task][arch])
    return model_cls(_model_config(arch, config, task)).float().eval()


def build(arch: str, task: str = "causal-lm") -> torch.nn.Module:
    return _build(tiny_config(arch, task=task), arch, task)


@functools.cache
def _needs_derived(arch: str, task: str = "causal-lm") -> bool:
    """Whether the TINY sizes alone leave ``arch``'s config inconsistent: its model does not
    build or run on them (then ``tiny_config`` adds the ``TINY_DERIVED`` ones)."""
    from autotp.compiler import example_kwargs

    try:
        model = _build(tiny_config(arch, derived=False, task=task), arch, task)
        with torch.no_grad():
            model(**example_kwargs(model, _inputs()))
        return False
    except Exception:  # noqa: BLE001 - any failure: try the derived sizes
        return True


def _reason(e: BaseException) -> str:
    text = [line.strip() for line in str(e).strip().splitlines()]
    first = " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else text[0] if text else ""  # a header line names no cause
    return f"{type(e).__name__}: {first}"[:300].replace("|", "/")


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen), "labels": torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)}


def _check_on_rank(rank: int, world: int, arch: str, mode: str, dtype: torch.dtype = torch.float32, task: str = "causal-lm") -> object:
    from autotp.report.strict_rule import check_on_rank

    tp, pp = MODES[mode]
    return check_on_rank(build(arch, task).to(dtype), _inputs(), tp=tp, pp=pp, timeout_s=120)


def _cell(arch: str, mode: str, timeout_s: int, task: str = "causal-lm") -> Cell:
    """``arch`` at ``mode`` on its ranks, a numeric mismatch checked again in float64."""
    from autotp.report.strict_rule import combine
    from autotp.runtime.processes.launcher import spawn_ranks

    tp, pp = MODES[mode]
    preload = (*_PRELOAD, getattr(transformers, TASKS[task][arch]).__module__)
    run = lambda dtype: combine(spawn_ranks(_check_on_rank, tp * pp, arch, mode, dtype, task, backend="gloo", timeout_s=timeout_s, num_threads=1, preload=preload))  # noqa: E731
    try:
        result = run(torch.float32)
        reason = result.reason
        if result.mismatch and run(torch.float64).equal:  # a bug shows in float64 too; fp32 rounding alone does not
            reason = f"fp32 rounding only, equal in float64: {reason}"
        return Cell(result.passed, result.share if not result.error else None, reason[:300].replace("|", "/"))
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        return Cell(False, None, _reason(e))


def _too_slow(signum: int, frame: object) -> None:
    raise TimeoutError("took longer than --arch-timeout seconds")


def sweep_one(arch: str, modes: list[str], timeout_s: int = 300, task: str = "causal-lm") -> Row:
    from autotp.compiler import example_kwargs

    row = Row(arch)
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(timeout_s)
    try:
        model = build(arch, task)
        with torch.no_grad():  # the unmodified model must run on this config for the row to count
            model(**example_kwargs(model, _inputs()))
        row.builds = True
    except Exception as e:  # noqa: BLE001 - the reason goes into the table
        row.reason = "build: " + _reason(e)
    finally:
        signal.alarm(0)  # the ranks have their own deadline, and spawn_ranks kills them at it
    if row.builds:
        for mode in modes:  # each degree gets what is left of the architecture's time
            row.cells[mode] = _cell(arch, mode, max(10, int(timeout_s - (time.perf_counter() - start))), task)
    row.seconds = time.perf_counter() - start
    return row


def summary(rows: list[Row], task: str = "causal-lm") -> str:
    built = [r for r in rows if r.builds]
    run = [m for m in MODES if any(m in r.cells for r in built)]
    counts = ", ".join(f"{sum(r.passed(m) for r in built)} pass at {_label(m)} ({sum(r.passed(m) for r in built) / max(len(built), 1):.0%})" for m in run)
    return f"{len(rows)} of the {len(TASKS[task])} architectures swept; {len(built)} build from a tiny config; of those, {counts}."


def _label(mode: str) -> str:
    tp, pp = MODES[mode]
    return f"tp={tp}" if pp == 1 else f"pp={pp}"


def table(rows: list[Row], task: str = "causal-lm") -> str:
    kind, flag = ("causal-LM", "") if task == "causal-lm" else ("encoder-decoder", " --task seq2seq")
    lines = [
        f"# Registry sweep: {kind} architectures of transformers " + transformers.__version__,
        "",
        f"Regenerate: `python benchmarks/sweep_registry.py{flag}` (tiny configs, fp32, gloo ranks). A cell passes under the strict "
        "rule (`autotp.report.strict_rule`): loss, logits and every grad equal to the unmodified model's (rtol 1e-4, atol 1e-6), "
        "each rank holding at most 1.3/(tp*pp) of the parameters, no matmul weight kept whole without a plan entry. "
        "The share is the largest fraction of the parameters one rank holds.",
        "",
        summary(rows, task),
        "",
        "| arch | builds | " + " | ".join(_label(m) for m in MODES) + " | " + " | ".join(f"held {_label(m)}" for m in MODES) + " | reason |",
        "|---" * (3 + 2 * len(MODES)) + "|",
    ]
    mark = {True: "yes", False: "no"}
    for r in rows:
        passed = [mark[r.passed(m)] if m in r.cells else "-" for m in MODES]
        held = [f"{r.cells[m].share:.0%}" if m in r.cells and r.cells[m].share is not None else "-" for m in MODES]
        reason = r.reason or "; ".join(f"{_label(m)}: {c.reason}" for m, c in r.cells.items() if not c.passed)
        lines.append(f"| {r.arch} | {mark[r.builds]} | " + " | ".join(passed + held) + f" | {reason} |")
    return "\n".join(lines) + "\n"


def read_table(path: Path) -> dict[str, Row]:
    """The rows of a table that ``table`` wrote (for ``--merge``)."""
    rows: dict[str, Row] = {}
    width = 3 + 2 * len(MODES)
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != width or cells[1] not in ("yes", "no"):
            continue
        arch, builds, rest, reason = cells[0], cells[1] == "yes", cells[2:-1], cells[-1]
        row = Row(arch, builds, reason="" if builds else reason)
        reasons = dict(part.split(": ", 1) for part in re.split(r"; (?=(?:tp|pp)=\d+: )", reason) if ": " in part) if builds else {}
        for i, m in enumerate(MODES):
            if rest[i] != "-":
                held = rest[len(MODES) + i]
                row.cells[m] = Cell(rest[i] == "yes", float(held.rstrip("%")) / 100 if held != "-" else None, reasons.get(_label(m), ""))
        rows[arch] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated degrees to check (default: {','.join(MODES)})")
    parser.add_argument("--task", default="causal-lm", choices=list(TASKS), help="the registry's causal-LM or encoder-decoder architectures")
    parser.add_argument("--out", type=Path, help="the table (default: docs/registry_sweep.md, or docs/registry_sweep_seq2seq.md for seq2seq)")
    parser.add_argument("--arch-timeout", type=int, default=300, help="seconds per architecture, all degrees (default: 300)")
    parser.add_argument("--merge", action="store_true", help="keep the other rows and degrees of the existing --out table")
    parser.add_argument("--jobs", type=int, default=1, help="architectures swept at once, each in its own process")
    parser.add_argument("--stop-after-s", type=float, default=None,
                        help="start no architecture after this many seconds (rows not swept keep their old value)")  # fmt: skip
    args = parser.parse_args()
    mapping = TASKS[args.task]
    args.out = args.out or Path(__file__).resolve().parents[1] / "docs" / ("registry_sweep.md" if args.task == "causal-lm" else "registry_sweep_seq2seq.md")
    # A CPU check on gloo. The ranks fork from a server that imported torch and transformers
    # (``_PRELOAD``); on a GPU machine a fork after CUDA's initialization cannot use CUDA.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    archs = [a for a in mapping if not args.only or a in args.only.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    kept = read_table(args.out) if args.merge else {}
    rows: list[Row] = []
    for row in _sweep(archs, modes, args.jobs, args.arch_timeout, args.stop_after_s, args.task):
        old = kept.get(row.arch)
        if old is not None and row.builds:
            row.cells = {**old.cells, **row.cells}
        kept[row.arch] = row
        rows = [kept[a] for a in mapping if a in kept]
        cells = " ".join(f"{m}={'pass' if c.passed else 'FAIL'}" for m, c in row.cells.items())
        why = row.reason or "; ".join(f"{m}: {c.reason}" for m, c in row.cells.items() if not c.passed)
        print(f"{row.arch:28s} builds={row.builds} {cells} {row.seconds:.0f}s {why[:200]}", flush=True)
        args.out.write_text(table(rows, args.task))
    print(summary(rows, args.task))


def _crash_reason(log: Path, proc: subprocess.Popen[bytes]) -> str:
    lines = log.read_text(errors="replace").strip().splitlines()
    return f"sweep process exited with {proc.returncode}: {lines[-1] if lines else ''}"[:300].replace("|", "/")


def _sweep(archs: list[str], modes: list[str], jobs: int, timeout_s: int, stop_after_s: float | None, task: str) -> Iterator[Row]:
    """Rows as they finish: in this process for ``jobs == 1``, else one child process per architecture."""
    start = time.perf_counter()

    def may_start() -> bool:
        return stop_after_s is None or time.perf_counter() - start < stop_after_s

    if jobs == 1:
        for arch in archs:
            if not may_start():
                return
            yield sweep_one(arch, modes, timeout_s, task)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(archs)
        running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
        while pending or running:
            while pending and len(running) < jobs and may_start():
                arch = pending.pop(0)
                cmd = [sys.executable, __file__, "--only", arch, "--modes", ",".join(modes), "--out", f"{tmp}/{arch}.md",
                       "--arch-timeout", str(timeout_s), "--task", task]  # fmt: skip
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
