"""Which source of layout rules covers the aten ops of real traces: autotp's own rules
(``autotp.analysis.op_rules``) or the sharding strategies DTensor registers.

For each model (the plain-PyTorch suite of ``tests/plain_models_*.py``; with
``--registry`` also every causal-LM architecture of the installed transformers, from the
tiny configs of ``benchmarks/sweep_registry.py``) it traces the model, plans tp, walks the
plan as the passes do and counts:

* **ops**: the distinct aten overloads in the traces; which have an autotp rule (a
  ``RULES`` entry, the pointwise tag or a grouped matmul) and which a DTensor strategy.
* **sharded nodes**: every node with a sharded input in the final plan, and what
  DTensor's strategy derives from the same input placements: the same sharded output
  (``agrees``), a move of the inputs (``redistributes``: the sharding would be lost), no
  strategy, an input autotp shards in a way DTensor cannot express (two sharded dims,
  partial), or an error.
* **fallback**: nodes whose layout came from the DTensor-derived fallback
  (``dtensor_rules``: no autotp rule, a strategy that keeps the split).

    python benchmarks/rule_coverage.py                 # the plain suite at tp=2
    python benchmarks/rule_coverage.py --tp 4 --registry
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from autotp.analysis.dtensor_rules import _propagate, has_strategy  # noqa: E402
from autotp.analysis.op_rules import rule_for  # noqa: E402
from autotp.analysis.propagation import propagate  # noqa: E402
from autotp.analysis.trace import trace  # noqa: E402
from autotp.compiler import example_kwargs  # noqa: E402
from autotp.cost_model.tensor_parallel import plan_tensor_parallel  # noqa: E402
from autotp.ir.layouts import Layout  # noqa: E402


def _models(registry: bool) -> list[tuple[str, object, dict]]:
    import plain_models_mixers as plain

    found = [(name, lambda n=name: plain.build(n), plain.example_inputs(name)) for name in sorted(plain.MODELS)]
    if registry:
        import sweep_registry as sweep
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        ids = torch.randint(0, sweep.VOCAB, (sweep.BATCH, sweep.SEQ), generator=torch.Generator().manual_seed(0))
        for arch in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            found.append((arch, lambda a=arch: sweep.build(a), {"input_ids": ids, "labels": ids}))
    return found


def _classify(node: torch.fx.Node, layouts: dict, tp: int) -> str:
    lays = {a: layouts.get(a) for a in node.all_input_nodes}
    if any(not isinstance(l, Layout) or l.partial or len(l.dims) > 1 for l in lays.values() if l is not None and l != ()):
        return "not expressible"
    if not has_strategy(node.target):
        return "no strategy"
    lays = {a: (l if isinstance(l, Layout) else Layout()) for a, l in lays.items()}
    try:
        outputs = _propagate(node.target, node, lays, tp)
    except Exception:  # noqa: BLE001 - counted as what it is
        return "error"
    if outputs is None:
        return "redistributes"
    mine = layouts.get(node)
    mine = mine if isinstance(mine, tuple) else (mine,)
    for (_, placement), lay in zip(outputs, mine):
        ours = [d for d, _ in lay.dims] if isinstance(lay, Layout) else []
        if placement == "partial":
            if not (isinstance(lay, Layout) and lay.partial):
                return "redistributes"
        elif ([placement] if placement is not None else []) != ours:
            return "redistributes"
    return "agrees"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--registry", action="store_true")
    args = parser.parse_args()
    ops_rule: set[str] = set()
    ops_strategy: set[str] = set()
    ops_all: set[str] = set()
    sharded: Counter[str] = Counter()
    by_op: dict[str, Counter[str]] = {}
    fallback: Counter[str] = Counter()
    failed = []
    for name, make, inputs in _models(args.registry):
        try:
            model = make()
            gm = trace(model, example_kwargs(model, inputs))
            plan = plan_tensor_parallel(gm, args.tp)
            prop = propagate(gm, args.tp, plan=plan)
        except Exception as e:  # noqa: BLE001 - the sweep reports it and goes on
            failed.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            continue
        for node in gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            op = str(node.target)
            ops_all.add(op)
            has_rule = rule_for(node.target) is not None
            if has_rule:
                ops_rule.add(op)
            if has_strategy(node.target):
                ops_strategy.add(op)
            inputs_sharded = any(isinstance(prop.layouts.get(a), Layout) and prop.layouts[a].dims for a in node.all_input_nodes)
            if not inputs_sharded:
                continue
            verdict = _classify(node, prop.layouts, args.tp)
            sharded[verdict] += 1
            by_op.setdefault(op, Counter())[verdict] += 1
            if not has_rule:
                fallback[op] += 1
    print(f"models: {len(_models(args.registry)) - len(failed)} traced and planned at tp={args.tp}, {len(failed)} failed")
    for f in failed:
        print(f"  failed: {f}")
    print(f"distinct aten ops: {len(ops_all)}; with an autotp rule: {len(ops_rule & ops_all)}; "
          f"with a DTensor strategy: {len(ops_strategy & ops_all)}; both: {len(ops_rule & ops_strategy)}; "
          f"neither: {len(ops_all - ops_rule - ops_strategy)} {sorted(ops_all - ops_rule - ops_strategy)}")  # fmt: skip
    total = sum(sharded.values())
    print(f"nodes with a sharded input: {total}; what DTensor's strategy derives for them:")
    for verdict, n in sharded.most_common():
        print(f"  {verdict:16s} {n:6d} ({n / total:.0%})")
    print("ops where DTensor does not keep autotp's split (nodes):")
    for op, counts in sorted(by_op.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k != "agrees")):
        lost = sum(v for k, v in counts.items() if k != "agrees")
        if lost:
            print(f"  {op:45s} {dict(counts)}")
    print(f"nodes placed by the DTensor-derived fallback (no autotp rule): {sum(fallback.values())} {dict(fallback)}")


if __name__ == "__main__":
    main()
