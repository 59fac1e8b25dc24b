"""Sequence-first batches ([S, B, D]: ``nn.Transformer``'s and ``nn.MultiheadAttention``'s default,
SAM 2's memory attention, fairseq's layers) under a split step (pipeline microbatches, dp):

* attention whose key positions hold the rows mixes them: the walk of the batch's rows put them on
  dim 0, the sequence, and SDPA kept only its leading dims' rows, so a pipeline cut the sequence into
  microbatches and trained a wrong loss (0.8% off for ``nn.TransformerEncoder``), silently; so did
  ``nn.MultiheadAttention`` with a key padding mask (its scores by ``baddbmm``, which the walk did
  not count as a matmul: 1.6% off);
* the batch is then found on dim 1 where the rows never mix there (a batch-first padding mask keeps
  them on dim 0), and the step splits it there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_on_ranks

SEQ, BATCH, DIM, VOCAB = 16, 2, 32, 64


class SequenceFirstAttention(nn.Module):
    """Self-attention over ``[S, B, D]``, transposed to batch first around SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1)
        q, k, v = self.qkv(h).view(*h.shape[:2], 3, 4, DIM // 4).permute(2, 0, 3, 1, 4).unbind(0)
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(h.shape)).transpose(0, 1)


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` as PyTorch builds it by default (sequence first), over token ids [S, B]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(src)))


class SharedMemoryQueries(nn.Module):
    """Each row's queries (positions first) attending to a memory every row shares: no mixing."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = nn.Parameter(torch.randn(1, 1, 8, DIM))
        self.q, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).transpose(0, 1)[:, None]  # [B, 1, S, D]
        return self.o(F.scaled_dot_product_attention(q, self.memory, self.memory)[:, 0].transpose(0, 1))


class PaddedSeq2Seq(nn.Module):
    """``nn.Transformer`` (sequence first) with batch-first padding masks and a causal target mask."""

    def __init__(self) -> None:
        super().__init__()
        self.src, self.tgt = nn.Embedding(VOCAB, DIM), nn.Embedding(VOCAB, DIM)
        self.transformer = nn.Transformer(DIM, 4, 2, 2, 2 * DIM, dropout=0.0)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[0])
        h = self.transformer(self.src(src), self.tgt(tgt), tgt_mask=mask, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)
        return self.head(h)


class PaddedAttention(nn.Module):
    """Sequence-first ``nn.MultiheadAttention`` layers with a key padding mask, attention weights returned."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.attn = nn.ModuleList(nn.MultiheadAttention(DIM, 4) for _ in range(2))
        self.ff = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, src: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        h = self.embed(src)
        for attn, ff in zip(self.attn, self.ff):
            h = h + ff(attn(h, h, h, key_padding_mask=src_pad)[0]).relu()
        return self.head(h)


def _padded(target: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    pad[1, -3:] = True
    inputs = {"src": torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen), "src_pad": pad}
    return inputs | {"tgt": torch.randint(0, VOCAB, (SEQ // 2, BATCH), generator=gen)} if target else inputs


def _tokens() -> dict[str, torch.Tensor]:
    return {"src": torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(1))}


def _features() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(SEQ, BATCH, DIM, generator=torch.Generator().manual_seed(1))}


def test_attention_over_rows_on_key_positions_mixes_them() -> None:
    from autotp.analysis.batch_rows import batch_mixing_node, rows_past_dim0
    from autotp.analysis.trace import trace

    gm = trace(SequenceFirstAttention(), _features())
    assert "scaled_dot_product_attention" in batch_mixing_node(gm, SEQ)
    dims, (mixing, _, output_rows) = rows_past_dim0(gm, _features())
    assert dims == {"['x']": 1} and mixing == "" and output_rows == (1,)


def test_queries_attending_to_a_shared_memory_keep_their_rows() -> None:
    from autotp.analysis.batch_rows import batch_verdicts
    from autotp.analysis.trace import trace

    gm = trace(SharedMemoryQueries(), _features())
    assert batch_verdicts(gm, SEQ, [0])[0] == ""  # the positions are rows here, each its own query


def _strict(rank: int, world: int, name: str, tp: int, pp: int) -> tuple[str, tuple[tuple[str, int], ...], str]:
    from autotp.report.strict_rule import check_on_rank

    model, inputs = {"torch_encoder": (TorchEncoder, _tokens), "sequence_first_attention": (SequenceFirstAttention, _features),
                     "padded_seq2seq": (PaddedSeq2Seq, lambda: _padded(True)), "padded_attention": (PaddedAttention, lambda: _padded(False))}[name]
    torch.manual_seed(0)
    r = check_on_rank(model().eval(), inputs(), tp=tp, pp=pp, loss_fn=lambda out: out.square().mean())
    from autotp import parallelize

    torch.manual_seed(0)
    plan = parallelize(model().eval(), tp=tp, pp=pp, example_inputs=inputs()).plan
    return r.reason, plan.input_batch_dims, plan.batch_mixing


@pytest.mark.parametrize(("name", "tp", "pp"), [("torch_encoder", 1, 2), ("torch_encoder", 2, 1), ("sequence_first_attention", 2, 1),
                                                ("padded_seq2seq", 1, 2), ("padded_attention", 1, 2)])  # fmt: skip
def test_sequence_first_models_split_their_batch_on_dim_1(name: str, tp: int, pp: int) -> None:
    results = run_on_ranks(_strict, tp * pp, name, tp, pp)
    keys = {"sequence_first_attention": ("['x']",), "padded_seq2seq": ("['src']", "['tgt']")}.get(name, ("['src']",))
    assert results == [("", tuple((key, 1) for key in keys), "")] * (tp * pp)
