"""Constructs of the fifth round of issue 27 (``tests/plain_models_recipes.py``): what the
planner decides for them in one process. ``test_plain_suite`` checks the numerics of the
whole models; ``test_loss_denominators`` the losses split over microbatches."""

from __future__ import annotations

import torch
from torch import nn

from autotp.analysis.trace import trace
from autotp.cost_model.tensor_parallel import plan_tensor_parallel
from autotp.ir.plan import KEPT_WHOLE_READ_WHOLE
from plain_models_attention import DIM, VOCAB
from plain_models_recipes import build, example_inputs


def test_expert_weights_gathered_per_token_split_like_stacked_experts() -> None:
    """``w1[expert_ids]`` then ``bmm``: the gathered weights stay a view of the parameter, so
    w1 is split on its hidden dim (column) and w2 on the same dim (row); it was read whole."""
    gm = trace(build("gathered_expert_weights"), example_inputs("gathered_expert_weights"))
    layouts = {p.name: p for p in plan_tensor_parallel(gm, 2).params}
    assert (layouts["layers.0.feed_forward.w1"].kind, layouts["layers.0.feed_forward.w1"].dim) == ("column", 2)
    assert (layouts["layers.0.feed_forward.w2"].kind, layouts["layers.0.feed_forward.w2"].dim) == ("row", 1)


class _LSTMAfterEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm, self.head = nn.Embedding(VOCAB, DIM), nn.LSTM(DIM, DIM, batch_first=True), nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(input_ids))[0])


def test_weights_read_by_an_op_without_a_rule_name_that_op() -> None:
    """``aten.lstm`` in training mode reads its weights in a list: they are kept whole, and the
    plan entry names the op (it said "no op reads it"). The walk crashed on it before: the op
    is tagged random (its dropout between layers), and its probability is named ``dropout``."""
    gm = trace(_LSTMAfterEmbedding(), {"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    kept = {k.name: k for k in plan_tensor_parallel(gm, 2).kept_whole}
    entry = kept["lstm.weight_ih_l0"]
    assert entry.reason == KEPT_WHOLE_READ_WHOLE and entry.op == "lstm" and "lstm" in entry.detail, entry
