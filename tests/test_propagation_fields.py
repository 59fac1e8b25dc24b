"""Constructs of the fourteenth round of issue 27 (``tests/plain_models_fields.py``,
``tests/plain_models_beyond.py``): a value written in place into a tensor of zeros (FNO's
spectrum) needs a gradient from the write on, and a complex value between stages carries one; einsums and convolutions are work for the
pipeline's cuts as matmuls are; a loss that adds a mean and a sum over the rows has its summed
term, and only it, scaled by the number of pieces. ``test_plain_suite`` checks the whole models
at every degree. A bag's ``offsets`` into the indices of every row mix the rows (a piece's slice
does not rebase them), and a sparse gradient comes back from ``unshard_grads`` dense."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
import plain_models_beyond as beyond
from autotp.analysis.batch_rows import batch_mixing_node
from autotp.analysis.propagation import propagate
from autotp.analysis.trace import trace
from autotp.cost_model.pipeline import plan_pipeline, unit_costs
from autotp.analysis.pipeline_units import units
from autotp.analysis.shapes import is_float
from autotp.ir import meta_keys
from autotp.ir.batch_denominators import BATCH_DENOMINATOR
from autotp.ir.program import Boundary
from autotp.passes.extract_chunks import _boundary
from autotp.report.strict_rule import check_on_rank
from distributed import run_on_ranks
from plain_models_fields import build, example_inputs
from test_loss_denominators import _assert_whole_batch


class ZeroSpectrum(nn.Module):
    """``out = zeros(...)``, ``out[:, :k] = x @ w``, then ``out`` and a view of it read."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], 12)
        head = out[:, :4]
        out[:, :8] = x @ self.w
        return out.sum() + head.sum()


def test_a_tensor_written_with_a_value_that_needs_a_gradient_needs_one() -> None:
    """FNO's ``out_ft[:, :, :modes] = einsum(...)`` into ``torch.zeros``: the zeros and every
    view of them were taken to need no gradient, so at pp=2 the inverse FFT sent to the next
    stage was traced without one and the runtime refused it."""
    gm = trace(ZeroSpectrum(), {"x": torch.randn(2, 8)})
    needs = propagate(gm, 1).needs_grad
    nodes = {n.name: n for n in gm.graph.nodes}
    zeros, reads = nodes["zeros"], [n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.default]
    assert needs[zeros] and all(needs[v] for v in zeros.users)  # the write's slice and the view taken before it
    assert all(needs[r] for r in reads)


def test_einsums_and_convolutions_are_work_for_the_pipeline_cut() -> None:
    """The FNO's spectral weights are read by ``einsum``, its skips by ``conv1d``: neither
    counted as work, the head's linear held it all, and the cut fell where the ties put it
    (72% of the parameters on a rank at pp=2). With them counted the cut splits 63/37."""
    name = "fno_complex_weights"
    gm = trace(build(name), example_inputs(name))
    costs = unit_costs(gm, units(gm))
    assert costs[0][0] == 32 * 32 * 4 and costs[1][0] == 32 * 32 + 32  # layers: convs.0, ws.0, convs.1, ws.1
    assert plan_pipeline(gm, 2, 1).layer_chunks == (0, 0, 0, 1)


class MixedLoss(nn.Module):
    """CapsNet's shape of loss: a mean over the rows plus a small summed reconstruction error."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec, self.loss = nn.Linear(16, 8), nn.Linear(8, 16), loss

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.enc(x))
        recon = self.dec(h)
        ce = F.cross_entropy(h, labels)
        kept = (x > 0.5).float()  # the rows keep different numbers of elements
        losses = {
            "mean_plus_summed": lambda: ce + 5e-4 * F.mse_loss(recon, x, reduction="sum"),
            "summed_minus_mean": lambda: F.l1_loss(recon, x, reduction="sum") * 0.1 - ce,
            "summed_elementwise_loss": lambda: F.binary_cross_entropy_with_logits(recon, (x > 0).float(), reduction="sum"),
            "mean_plus_summed_over_numel": lambda: ce + F.mse_loss(recon, x, reduction="sum") / x.numel(),  # a mean of the piece
            "mean_elementwise_loss": lambda: ce + F.smooth_l1_loss(recon, x),
            "summed_over_a_count": lambda: F.mse_loss(recon * kept, x * kept, reduction="sum") / kept.sum(),
        }
        return {"logits": h, "loss": losses[self.loss]()}


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"x": torch.randn(4, 16, generator=gen), "labels": torch.randint(0, 8, (4,), generator=gen)}


@pytest.mark.parametrize("microbatches", [2, 4])
@pytest.mark.parametrize(
    "loss", ["mean_plus_summed", "summed_minus_mean", "summed_elementwise_loss", "mean_plus_summed_over_numel", "mean_elementwise_loss", "summed_over_a_count"]
)
def test_a_summed_term_of_the_loss_sums_the_pieces(loss: str, microbatches: int) -> None:
    """Before, only a loss that was a sum as a whole was scaled, and ``mse_loss(reduction="sum")``
    was not seen as a sum: CapsNet's loss was 0.016 off at pp=2. A summed loss over a count of
    the data (``summed_over_a_count``) divides by the whole batch's count, as a summed
    ``cross_entropy`` did."""
    model = MixedLoss(loss)
    reference = copy.deepcopy(model)
    batch = _batch()
    pm = autotp.parallelize(model, tp=1, example_inputs={k: v[:2] for k, v in batch.items()})
    _assert_whole_batch(pm, reference, pm.train_step(**batch, num_microbatches=microbatches), batch)


def test_only_the_summed_term_is_scaled() -> None:
    gm = trace(MixedLoss("mean_plus_summed"), {k: v[:2] for k, v in _batch().items()}, split_batch=True)
    counts = [n for n in gm.graph.nodes if n.target is BATCH_DENOMINATOR]  # the pieces, and cross_entropy's token count
    scaled = [u.args[0] for c in counts for u in c.users if u.target is torch.ops.aten.mul.Tensor and u.args[1] is c]
    assert len(scaled) == 1 and scaled[0].args[0].target is torch.ops.aten.mse_loss.default  # 5e-4 * mse_loss(...)
    assert all(u.op != "output" for u in scaled[0].users)  # the mean term and the sum stay as they are


def test_a_complex_value_between_stages_carries_its_gradient() -> None:
    """Complex-valued layers pass a spectrum from one stage to the next: the boundary said a
    complex value takes no gradient, and at pp=2 the runtime refused the step (`chunk 0 sends a
    value that requires grad but was traced without`)."""
    gm = trace(build("complex_valued_layers"), example_inputs("complex_valued_layers"))
    needs = propagate(gm, 1).needs_grad
    spectra = [n for n in gm.graph.nodes if n.op == "call_function" and is_float(n) and n.meta["val"].dtype.is_complex and needs[n]]
    assert spectra
    for node in spectra:
        node.meta[meta_keys.NEEDS_GRAD] = True
        assert _boundary(node, 1) == Boundary(tuple(node.meta["val"].shape), torch.complex64, True)


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(16, 8, mode="sum"), nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.bag(ids, offsets)).mean()


def test_a_bags_offsets_into_the_indices_of_every_row_mix_the_rows() -> None:
    """DLRM's inputs: flat indices and each bag's offset into them, a count of the bags before
    it. A microbatch's slice of the offsets does not start at 0 (PyTorch raised `offsets[0] has
    to be 0` on a rank at pp=2); the walk now names the bag, and ``train_step`` refuses a split
    naming it. A bag per row of 2-D indices keeps the rows apart."""
    pm = autotp.parallelize(beyond.build("dlrm_offsets"), tp=1, example_inputs=beyond.example_inputs("dlrm_offsets"))
    assert "embedding_bag" in pm.plan.batch_mixing and "emb_l.0" in pm.plan.batch_mixing  # the offsets' rows: dim 1 of [tables, batch]
    ids = torch.randint(0, 16, (4, 3))
    assert batch_mixing_node(trace(Bags(), {"ids": ids}), 4) == ""
    assert "embedding_bag" in batch_mixing_node(trace(Bags(), {"ids": ids.flatten(), "offsets": torch.arange(0, 12, 3)}), 4)


def _sparse_grads(rank: int, world: int) -> tuple[str, str]:
    result = check_on_rank(beyond.build("dlrm_sparse_grads"), beyond.example_inputs("dlrm_sparse_grads"), tp=world, pp=1)
    return result.error, result.mismatch


def test_sparse_gradients_of_split_bags_are_gathered() -> None:
    """``EmbeddingBag(sparse=True)``: each rank's gradient of its columns of the table is a
    sparse tensor, which ``unshard_grads`` could not gather (`unsupported memory format option
    Contiguous`); it gathers them dense, equal to the unmodified model's sparse gradient."""
    assert run_on_ranks(_sparse_grads, 2) == [("", "")] * 2
