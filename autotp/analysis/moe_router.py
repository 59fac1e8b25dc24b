"""The router of an MoE layer, read from the graph: which ``topk`` (or ``max``/``argmax``)
picks each token's experts, and from what scores.

``find_router`` walks back from what the experts are grouped by (a grouped matmul's
``offs``, a loop's ``choice == e``) through the ops that turn expert indices into counts
or masks (sort, histc/bincount, cumsum, views, casts) to the index output of the choice.
From there it reads the scores: a ``softmax`` or ``sigmoid`` of a linear (or any other
op, named), an optional correction bias added before the choice (a parameter or buffer,
DeepSeek-V3's ``e_score_correction_bias``) and a group limit (a ``masked_fill`` of the
scores from an earlier ``topk`` over groups).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Node

from autotp.ir.op_facts import op_name

# Ops between an expert-index tensor and the counts/offsets/masks built from it.
_INDEX_TO_COUNTS = frozenset({
    "cumsum", "histc", "bincount", "to", "_to_copy", "sort", "reshape", "view", "flatten", "_unsafe_view",
    "clamp", "clamp_", "alias", "contiguous", "clone", "squeeze", "select",
})  # fmt: skip
_CHOICES = frozenset({"topk", "max", "argmax"})
_PASS_SCORES = frozenset({"to", "_to_copy", "view", "reshape", "alias", "contiguous", "clone", "float"})


@dataclass(frozen=True)
class Router:
    """``node``: the op choosing the experts; ``score``: what its scores are (``softmax``,
    ``sigmoid`` or another op's name); ``correction_bias``: the parameter or buffer added to
    the scores for the choice only; ``group_limited``: the choice is masked to the best groups;
    ``weight``: the router's linear weight and ``tokens`` the node it reads ("" when the
    scores do not come from a linear)."""

    node: str
    score: str
    correction_bias: str
    group_limited: bool
    top_k: int
    weight: str = ""
    tokens: str = ""

    def describe(self) -> str:
        parts = [f"top-{self.top_k} over {self.score}"]
        if self.correction_bias:
            parts.append(f"+ bias {self.correction_bias}")
        if self.group_limited:
            parts.append("group-limited")
        return " ".join(parts)


def _choice_op(node: Node) -> Node | None:
    """The topk/max/argmax node whose index output ``node`` is, else None."""
    if node.op != "call_function":
        return None
    if op_name(node.target) == "argmax":
        return node
    if node.target is operator.getitem and node.args[1] == 1:
        src = node.args[0]
        if isinstance(src, Node) and src.op == "call_function" and op_name(src.target) in ("topk", "max"):
            return src
    return None


def find_router(start: Node) -> tuple[Router | None, Node]:
    """The router behind ``start``, or (None, the node where the walk stopped)."""
    node = start
    seen = set()
    while node not in seen:
        seen.add(node)
        choice = _choice_op(node)
        if choice is not None:
            return _describe(choice), choice
        if node.op != "call_function":
            return None, node
        name = op_name(node.target)
        if node.target is operator.getitem and isinstance(node.args[0], Node) and op_name(node.args[0].target) == "sort":
            node = node.args[0]
            continue
        if name not in _INDEX_TO_COUNTS or not node.args or not isinstance(node.args[0], Node):
            return None, node
        node = node.args[0]
    return None, node


def _describe(choice: Node) -> Router:
    name = op_name(choice.target)
    top_k = int(choice.args[1]) if name == "topk" else 1
    scores = choice.args[0]
    bias, limited = "", False
    while isinstance(scores, Node) and scores.op == "call_function":
        op = op_name(scores.target)
        if op == "masked_fill":
            limited = True
            scores = scores.args[0]
        elif op in _PASS_SCORES:
            scores = scores.args[0]
        elif op == "add" and isinstance(scores.args[1], Node) and scores.args[1].op == "get_attr":
            bias = str(scores.args[1].target)
            scores = scores.args[0]
        else:
            break
    score = op_name(scores.target) if isinstance(scores, Node) and scores.op == "call_function" else str(scores)
    score = {"_softmax": "softmax"}.get(score, score)
    logits = scores.args[0] if isinstance(scores, Node) and scores.args else None
    while isinstance(logits, Node) and logits.op == "call_function" and op_name(logits.target) in _PASS_SCORES:
        logits = logits.args[0]
    weight = tokens = ""
    if isinstance(logits, Node) and logits.op == "call_function" and op_name(logits.target) == "linear":
        w = logits.args[1]
        while isinstance(w, Node) and w.op == "call_function" and op_name(w.target) in _PASS_SCORES:
            w = w.args[0]
        weight = str(w.target) if isinstance(w, Node) and w.op == "get_attr" else ""
        tokens = logits.args[0].name
    return Router(choice.name, score, bias, limited, top_k, weight, tokens)

