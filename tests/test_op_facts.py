"""The op facts every layer reads: views and in-place writes from schemas, collective kinds."""

from __future__ import annotations

import operator

import torch

from autotp.ir import ops
from autotp.ir.op_facts import (
    TAG_COMMUNICATION,
    Collective,
    CollectiveTag,
    Direction,
    copies_if_strided,
    draws_random,
    is_conversion,
    is_inplace,
    is_reshape,
    is_view,
    strides_output,
)

aten = torch.ops.aten


def test_views_come_from_schemas_not_from_a_list() -> None:
    # never named anywhere in autotp: the schema's alias annotation says they are views
    for op in (aten.diagonal.default, aten.as_strided.default, aten.movedim.int, aten.view_as_real.default, aten.swapaxes.default):
        assert is_view(op), op
    for op in (aten.view.default, aten.transpose.int, aten.expand.default, aten.split.Tensor, aten.reshape.default):
        assert is_view(op), op
    # a tuple's element, a view its schema hides, autotp's identities
    assert is_view(operator.getitem) and is_view(aten._unsafe_view.default)
    assert all(is_view(op) for op in (ops.COPY_TO_TP, ops.STAGE_BOUNDARY, ops.PARTIAL_GRAD))


def test_copies_and_writes_are_not_views() -> None:
    for op in (aten.add.Tensor, aten.clone.default, aten._to_copy.default, aten.contiguous.default, aten.to.dtype):
        assert not is_view(op), op
    assert is_conversion(aten.to.dtype) and is_conversion(aten.type_as.default) and not is_conversion(aten.add.Tensor)
    for op in (aten.add_.Tensor, aten.index_put_.default, aten.copy_.default):
        assert is_inplace(op) and not is_view(op), op
    assert not is_inplace(aten.view.default)
    assert ops.REDUCE_FROM_TP not in ops.IDENTITIES and not is_view(ops.REDUCE_FROM_TP)


def test_reshape_likes_copy_what_striding_views_make() -> None:
    assert copies_if_strided(aten.reshape.default) and copies_if_strided(aten.contiguous.default)
    assert not copies_if_strided(aten.view.default)
    assert strides_output(aten.transpose.int) and strides_output(aten.expand.default) and not strides_output(aten.view.default)
    assert is_reshape(aten.view.default) and is_reshape(aten.reshape.default) and not is_reshape(aten.transpose.int)


def test_every_collective_tag_says_what_it_communicates() -> None:
    assert set(TAG_COMMUNICATION) == set(CollectiveTag)
    forward = {tag: [c.collective for c in comms if c.direction == Direction.FORWARD] for tag, comms in TAG_COMMUNICATION.items()}
    assert forward[CollectiveTag.ALL_REDUCE] == [Collective.ALL_REDUCE] and forward[CollectiveTag.ALL_REDUCE_BACKWARD] == []
    assert forward[CollectiveTag.SEQUENCE_ALL_GATHER] == [Collective.ALL_GATHER]
    assert all(c.overlapped for c in TAG_COMMUNICATION[CollectiveTag.ALL_GATHER_MATMUL])
    assert CollectiveTag.ALL_REDUCE == "all_reduce"  # tags are strings in node meta and JSON


def test_random_draws_come_from_the_seeded_tag_and_an_eval_dropout_draws_nothing() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    calls = {
        "rand": graph.call_function(aten.rand.default, ([2, 3],)),
        "bernoulli": graph.call_function(aten.bernoulli.default, (x,)),
        "feature_dropout_train": graph.call_function(aten.feature_dropout.default, (x, 0.1, True)),
        "feature_dropout_eval": graph.call_function(aten.feature_dropout.default, (x, 0.1, False)),
        "dropout_eval_kw": graph.call_function(aten.dropout.default, (x, 0.1), {"train": False}),
        "dropout_p0": graph.call_function(aten.dropout.default, (x, 0.0, True)),
        "attention": graph.call_function(aten.scaled_dot_product_attention.default, (x, x, x)),
        "attention_dropout": graph.call_function(aten.scaled_dot_product_attention.default, (x, x, x), {"dropout_p": 0.1}),
        "add": graph.call_function(aten.add.Tensor, (x, x)),
    }
    drawing = {name for name, node in calls.items() if draws_random(node)}
    assert drawing == {"rand", "bernoulli", "feature_dropout_train", "attention_dropout"}
