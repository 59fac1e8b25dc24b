"""FlexAttention on one GPU: autotp's step, eager and with ``compile=True`` (inductor's fused
Triton kernel), against the unmodified model run the same way, eager and under ``torch.compile``:
loss and every gradient (fp32; skipped without a GPU). The model's score function reads a
per-head buffer and a per-head parameter by the head index, its mask function the document ids
made from the inputs (the constructs of ``tests/plain_models_hops.py``, at a head size of 16,
the smallest inductor's kernel takes)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

pytestmark = pytest.mark.gpu
RTOL, ATOL = 1e-4, 1e-5  # fp32 on the GPU, reductions in another order than the reference's
VOCAB, DIM, HEADS, SEQ, EOS = 128, 64, 4, 32, 0


class DocumentAlibiAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-2 * (i + 1)) for i in range(HEADS)]))
        self.rel_bias = nn.Parameter(torch.randn(HEADS, 2 * SEQ - 1) * 0.1)

    def forward(self, x: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))

        def score(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
            return s + self.slopes[h] * (ki - qi) + self.rel_bias[h, qi - ki + SEQ - 1]

        def same_document(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
            return (docs[b, qi] == docs[b, ki]) & (qi >= ki)

        mask = create_block_mask(same_document, B, None, S, S, device=x.device)
        return self.o(flex_attention(q, k, v, score_mod=score, block_mask=mask).transpose(1, 2).reshape(B, S, DIM))


class FlexLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attentions = nn.ModuleList(DocumentAlibiAttention() for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(3))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        docs = torch.cumsum(input_ids == EOS, dim=1) - (input_ids == EOS).int()
        h = self.embed(input_ids)
        for norm, attention in zip(self.norms, self.attentions):
            h = h + attention(norm(h), docs)
        logits = self.output(self.norms[-1](h))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(1, VOCAB, (2, SEQ), generator=gen) for _ in range(2))
    ids[0, 9], ids[0, 20], ids[1, 13] = EOS, EOS, EOS
    return {"input_ids": ids.cuda(), "labels": labels.cuda()}


@pytest.mark.parametrize("options", [{}, {"compile": True}], ids=["eager", "compile"])
def test_flex_attention_trains_on_one_gpu(options: dict[str, Any]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import autotp

    model = FlexLM().cuda()
    reference = copy.deepcopy(model)
    batch = _batch()
    loss_ref = (torch.compile(reference) if options else reference)(**batch)["loss"]
    loss_ref.backward()
    pm = autotp.parallelize(model, tp=1, example_inputs=batch, **options)
    loss = pm.train_step(**batch)
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=RTOL, atol=ATOL)
    grads = pm.unshard_grads()
    assert reference.attentions[0].rel_bias.grad.abs().sum() > 0
    bad = [n for n, p in reference.named_parameters() if not torch.allclose(grads[n], p.grad, rtol=RTOL, atol=ATOL)]
    assert not bad, bad
