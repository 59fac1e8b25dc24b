"""Patterns of models that autotp has no specific code for (issue 20), each on a small
model of our own (``general_models``): the parallel model matches the unmodified one
(loss, logits, every grad; fp32, gloo) and holds a real shard, or autotp refuses it
with an error that names the cause."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import autotp
from distributed import run_on_ranks
from general_models import VOCAB, build_general
from plain_models_library import RecomputingCheckpoint

RTOL, ATOL = 1e-4, 1e-6
SHARDED = ["exact_function", "custom_function", "per_head_scale", "per_head_bias", "einsum", "expert_loop", "buffer", "cache", "no_grad_scorer"]


def _check_on_rank(rank: int, world: int, names: list[str], tp: int, pp: int) -> dict[str, float]:
    import autotp

    out: dict[str, float] = {}
    for name in names:
        model = build_general(name)
        reference = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(1)
        ids, labels = (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2))
        pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs={"input_ids": ids, "labels": labels})
        expected = reference(input_ids=ids, labels=labels)
        expected["loss"].backward()
        if pp == 1:
            got = pm(input_ids=ids, labels=labels)
            torch.testing.assert_close(got["logits"], expected["logits"], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} logits: {m}")
            got["loss"].backward()
            loss = got["loss"]
        else:
            loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=2)
        torch.testing.assert_close(loss, expected["loss"], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} loss: {m}")
        grads = pm.unshard_grads()
        for pname, p in reference.named_parameters():
            if p.grad is None:  # read by no op
                assert grads[pname] is None, f"{name}: {pname} has a grad"
                continue
            assert grads[pname] is not None, f"{name}: no grad for {pname}"
            torch.testing.assert_close(grads[pname], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} grad of {pname}: {m}")
        local = sum(p.numel() for p in pm.parameters())
        out[name] = local / sum(p.numel() for p in reference.parameters())
    return out


def test_patterns_match_at_tp2_and_hold_a_shard() -> None:
    fractions = run_on_ranks(_check_on_rank, 2, SHARDED, 2, 1, timeout_s=500)[0]
    # q/k/v/o, the MLP or the experts are sharded: a rank holds about half of the model
    for name, fraction in fractions.items():
        assert fraction < 0.6, f"{name}: a rank holds {fraction:.0%} of the parameters"


def test_buffer_read_by_a_later_stage_only_at_pp2() -> None:
    fractions = run_on_ranks(_check_on_rank, 2, ["buffer", "expert_loop"], 1, 2, timeout_s=500)
    assert all(f < 0.75 for r in fractions for f in r.values()), fractions


def test_repeated_values_at_pp2() -> None:
    """A frozen parameter that chunk 1 reads through a repeated op is bound on its rank (no
    FakeTensor left), and in-place writes into a repeated label buffer run in every chunk
    that reads it (no silent NaN loss)."""
    fractions = run_on_ranks(_check_on_rank, 2, ["frozen_bias", "shifted_targets"], 1, 2, timeout_s=500)
    assert all(f < 0.75 for r in fractions for f in r.values()), fractions


def _train_on_rank(rank: int, world: int, name: str, tp: int, pp: int, steps: int) -> list[float]:
    """Losses of ``steps`` SGD steps of the parallel model, each checked against the unmodified
    model's loss and every grad on the same data."""
    import autotp

    model = build_general(name)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2))
    pm = autotp.parallelize(model, tp=tp, pp=pp, example_inputs={"input_ids": ids, "labels": labels})
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        loss = pm.train_step(input_ids=ids, labels=labels, num_microbatches=2)
        expected = reference(input_ids=ids, labels=labels)["loss"]
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} step {step} loss: {m}")
        grads = pm.unshard_grads()
        for pname, p in reference.named_parameters():
            torch.testing.assert_close(grads[pname], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} step {step} grad of {pname}: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("name", ["running_stats", "detached_scale"])
def test_writes_and_detached_reads_across_stages_at_pp2(name: str) -> None:
    """running_stats: each stage's layers write activation statistics through a view into one
    buffer made from the input's shape, which the head reads (every write must reach it).
    detached_scale: the head's stage reads the first layer's weight detached, so both stages
    hold it and only one computes its grad (both must step it alike, or step 2 diverges)."""
    losses = run_on_ranks(_train_on_rank, 2, name, 1, 2, 3, timeout_s=300)
    assert losses[0] == losses[1] and losses[0][2] < losses[0][0], losses


def test_forward_that_writes_a_parameter_is_refused_with_its_name() -> None:
    import autotp

    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(ValueError, match=r"writes its parameter blocks\.0\.o\.weight in place \(aten\.div_.*general_models\.py"):
        autotp.compile_rank(build_general("rescaling"), tp=2, example_inputs={"input_ids": ids, "labels": ids})
    model = build_general("rescaling")
    model(input_ids=ids)  # the write happens once, before parallelize: nothing left to refuse
    autotp.compile_rank(model, tp=2, example_inputs={"input_ids": ids, "labels": ids})


def test_per_head_vector_follows_the_heads() -> None:
    import autotp

    ids = torch.randint(0, VOCAB, (2, 8))
    for name, param in (("per_head_scale", "head_scale"), ("per_head_bias", "slopes")):
        plan = autotp.compile_rank(build_general(name), tp=2, example_inputs={"input_ids": ids, "labels": ids}).plan
        sharded = {p.name for p in plan.params}
        assert {f"blocks.{i}.{w}.weight" for i in range(2) for w in "qkvo"} <= sharded, name
        if name == "per_head_scale":  # read through a view only: sharded with the heads
            assert {f"blocks.{i}.{param}" for i in range(2)} <= sharded


def test_custom_autograd_function_runs_its_own_backward_sharded() -> None:
    """A straight-through estimator (backward: the identity; its forward's derivative: zero) is
    one elementwise node between the sharded up and down projections, also when traced under
    no_grad (the graph may later train); the multi-rank check is SHARDED's "custom_function"."""
    import autotp
    from autotp.ir import ops

    ids = torch.randint(0, VOCAB, (2, 8))
    for grad_mode in (torch.enable_grad, torch.no_grad):
        with grad_mode():
            compiled = autotp.compile_rank(build_general("custom_function"), tp=2, example_inputs={"input_ids": ids, "labels": ids})
        functions = [n for n in compiled.graph.graph.nodes if n.target is ops.ELEMENTWISE_FUNCTION]
        assert [n.args[2] for n in functions] == ["general_models._Router"] * 2
        sharded = {p.name for p in compiled.plan.params}
        assert {f"blocks.{i}.{w}.weight" for i in range(2) for w in ("up", "down")} <= sharded


def test_a_function_giving_no_gradient_to_a_tensor_it_made_is_traced_through() -> None:
    """LoHa's weight delta in a Function whose backward returns None for ``torch.tensor(scale)``,
    made in the forward: that None is never read, so its forward's ops are traced and split; the
    column layer's left factors follow its rows, through the product of two parameters (the
    multi-rank check is the plain suite's "hadamard_adapter")."""
    import autotp
    import plain_models_structure as models
    from autotp.ir import ops

    name = "hadamard_adapter"
    compiled = autotp.compile_rank(models.build(name), tp=4, example_inputs=models.example_inputs(name))
    assert not [n for n in compiled.graph.graph.nodes if n.target in (ops.FUNCTION, ops.ELEMENTWISE_FUNCTION)]
    dims = {p.name: p.dim for p in compiled.plan.params}
    for i in range(2):
        up = f"layers.{i}.ffn.up"
        assert dims[f"{up}.base.weight"] == dims[f"{up}.w1a"] == dims[f"{up}.w2a"] == 0


class _DampedCheckpoint(RecomputingCheckpoint):
    """An activation checkpoint (the forward, inherited, runs ``fn`` under no_grad; the backward
    runs it again and differentiates it against the inputs and ``params``) whose backward also
    halves the gradients: neither its forward's derivative nor a recomputation of it, so kept whole."""

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return RecomputingCheckpoint.backward(ctx, grad * 0.5)


class _CheckpointedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _DampedCheckpoint.apply(self._forward, 1, x, *self.parameters())


def test_a_kept_function_handed_a_modules_bound_method_is_refused_naming_it() -> None:
    """A Function kept whole runs its ``fn`` at every step; a bound method reads the module's
    parameters itself, which in the traced copy are fake: refused at ``parallelize``, naming the
    Function, the module and the way out, instead of failing at the first forward. (A plain
    checkpoint written so, the plain suite's ``checkpoint_by_hand``, is traced through.)"""
    import autotp
    from autotp.ir.errors import UserInputError

    with pytest.raises(UserInputError, match=r"_DampedCheckpoint in module <root>.*bound method _CheckpointedBlock\._forward.*differs.*torch\.utils\.checkpoint"):
        autotp.compile_rank(_CheckpointedBlock(), tp=2, example_inputs={"x": torch.randn(2, 4, 16)})


class _CountingDamped(torch.autograd.Function):
    """Runs a module on ``x`` under no_grad, counting its calls in a dict it is handed (as Reformer's
    reversible Function sets flags in its keyword arguments); its backward only halves the gradient."""

    @staticmethod
    def forward(ctx, x, block, options):  # type: ignore[no-untyped-def]
        options["calls"] += 1
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * 0.5, None, None


class _CountedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _CountingDamped.apply(x, self.mlp, {"calls": 0})


def test_a_kept_function_that_changes_its_arguments_is_refused_naming_why() -> None:
    """The refusal looked its reason up by the call's arguments, which the check had changed
    (the dict's count): a KeyError instead of the error naming the Function."""
    import autotp
    from autotp.ir.errors import UserInputError

    with pytest.raises(UserInputError, match=r"_CountingDamped in module <root>.*a Sequential module.*differs"):
        autotp.compile_rank(_CountedBlock(), tp=2, example_inputs={"x": torch.randn(2, 4, 16)})


class _GatheredContrastive(torch.nn.Module):
    """A contrastive loss over every rank's batch, gathered in the forward (CoCa's, open_clip's)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        everyone = [torch.empty_like(z) for _ in range(2)]
        torch.distributed.all_gather(everyone, z)
        return (z @ torch.cat(everyone).T).logsumexp(-1).mean()


def test_a_forward_calling_a_collective_is_refused_naming_it() -> None:
    """The trace ran the model's own ``all_gather`` on fake tensors over whichever group it found
    (on gloo ranks: "allgather_coalesced: invalid size of output tensor")."""
    import autotp
    from autotp.ir.errors import UserInputError

    with pytest.raises(UserInputError, match=r"test_generality.py:\d+ \(torch.distributed.all_gather\(everyone, z\)\).*calls torch\.distributed\.all_gather.*Fix"):
        autotp.compile_rank(_GatheredContrastive(), tp=2, example_inputs={"x": torch.randn(4, 16)}, device="cpu")


class _GatherChosenWhenBuilt(torch.nn.Module):
    """x-clip's CLIP: whether to gather the batch over the ranks is decided when built (``requires_all_gather``,
    true once a process group exists), and the gather asserts one."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)
        self.requires_all_gather = True  # built after init_process_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        if self.requires_all_gather:
            assert torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        return (z @ z.T).logsumexp(-1).mean()


def test_a_forward_that_chose_when_built_to_gather_is_refused_saying_so() -> None:
    """The trace's one-process view fails the model's assertion of a process group; the refusal said
    only "AssertionError" with advice about data-dependent code."""
    import autotp
    from autotp.ir.errors import UserInputError

    with pytest.raises(UserInputError, match=r"test_generality.py:\d+ \(assert torch.distributed.is_initialized.*False while autotp traces.*before init_process_group"):
        autotp.compile_rank(_GatherChosenWhenBuilt(), tp=2, example_inputs={"x": torch.randn(4, 16)}, device="cpu")


class _ContrastiveWhenDistributed(torch.nn.Module):
    """torchmultimodal's contrastive loss: the batch's embeddings gathered over the ranks only when a
    process group exists; the temperature read through ``.data`` (``clamp``: written through it)."""

    def __init__(self, clamp: bool = False) -> None:
        super().__init__()
        self.clamp = clamp
        self.image, self.text = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.clamp:
            self.logit_scale.data.clamp_(0, 4.6)
        a, b = F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1)
        labels = torch.arange(a.shape[0])
        if torch.distributed.is_initialized():
            everyone = [torch.empty_like(b) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(everyone, b)
            b, labels = torch.cat(everyone), labels + a.shape[0] * torch.distributed.get_rank()
        return F.cross_entropy(a @ b.T * self.logit_scale.data.exp(), labels)


def _contrastive_on_rank(rank: int, world: int) -> tuple[bool, str, float]:
    from autotp.report.strict_rule import check_on_rank

    torch.manual_seed(0)
    inputs = {"x": torch.randn(4, 16), "y": torch.randn(4, 16)}
    result = check_on_rank(_ContrastiveWhenDistributed(), inputs, tp=2, loss_fn=lambda out: out)
    pm = autotp.parallelize(_ContrastiveWhenDistributed(), tp=2, example_inputs=inputs)
    before = pm(**inputs).item()
    with torch.no_grad():
        pm.get_parameter("logit_scale").add_(1.0)
    return result.passed, result.reason, pm(**inputs).item() - before


def test_a_forward_asking_for_a_process_group_is_traced_as_one_process() -> None:
    """autotp parallelizes the model as one process runs it: ``is_initialized()`` is False in the
    trace (the gather was refused before), and ``.data`` reads follow their parameter (they were
    constants frozen at the trace, which the rank graph then lacked)."""
    for passed, reason, moved in run_on_ranks(_contrastive_on_rank, 2):
        assert passed, reason
        assert abs(moved) > 1e-3  # the temperature read through .data is the parameter's value now


def test_a_parameter_written_through_data_is_refused_naming_it() -> None:
    """CLIP's clamp of its temperature in the forward wrote a lifted constant, which the graph never reads."""
    from autotp.ir.errors import UserInputError

    with pytest.raises(UserInputError, match=r"writes its parameter logit_scale in place \(aten\.clamp_\.default"):
        autotp.compile_rank(_ContrastiveWhenDistributed(clamp=True), tp=1, example_inputs={"x": torch.randn(4, 16), "y": torch.randn(4, 16)},
                            device="cpu")  # fmt: skip


def _seq2seq(name: str) -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    if name == "t5":  # relative position buckets, a decoder with cross-attention, a tied head
        config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
        return T5ForConditionalGeneration(config).eval()
    config = BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2)  # fmt: skip
    return BartForConditionalGeneration(config).eval()


def _check_seq2seq(rank: int, world: int, name: str, tp: int, pp: int) -> str:
    from autotp.report.strict_rule import check_on_rank

    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(3, VOCAB, (2, 16), generator=gen), "labels": torch.randint(3, VOCAB, (2, 12), generator=gen)}
    return check_on_rank(_seq2seq(name), inputs, tp=tp, pp=pp).reason


@pytest.mark.parametrize("name, tp, pp", [("t5", 2, 1), ("bart", 1, 2)])
def test_an_encoder_decoder_model_equals_the_unmodified_one(name: str, tp: int, pp: int) -> None:
    """HF's encoder-decoder models used to be refused by their config flag; both stacks split
    (the encoder's and the decoder's self- and cross-attention) and the pipeline cuts across them."""
    assert run_on_ranks(_check_seq2seq, tp * pp, name, tp, pp) == ["", ""]


def test_per_head_interleaved_qkv_is_sharded() -> None:
    """Bloom ([heads, 3, head_dim] rows, heads merged into the batch for baddbmm with ALiBi)
    and Falcon's new decoder ([kv, group + 2, head_dim] rows, indexed k/v)."""
    import autotp
    from small_models import build
    from test_equivalence import _grads_on_rank

    ids = torch.randint(0, 128, (2, 8))
    for name in ("bloom", "falcon"):
        plan = autotp.compile_rank(build(name), tp=2, example_inputs={"input_ids": ids, "labels": ids}).plan
        assert {f"transformer.h.{i}.self_attention.query_key_value.weight" for i in range(2)} <= {p.name for p in plan.params}
        assert run_on_ranks(_grads_on_rank, 2, name)[0] < 0.6
