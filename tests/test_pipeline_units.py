"""Pipeline units split where one is too large to balance: a hierarchical model's last stage is
cut between its own blocks, inside its one block, between a numbered pair inside it, or inside
one of two blocks that no cut between them balances, or inside a layer of a chunk crowded with parameters
(``cost_model.pipeline.balanceable_units``, ``analysis.pipeline_units``); the units of a model
whose layers are small enough stay its layers, and so do modules holding values sized by the
data (fp32, gloo, the strict rule at pp=2)."""

from __future__ import annotations

import torch
from torch import nn

from autotp.analysis.pipeline_units import chunk_bases, split_units, units
from autotp.analysis.trace import trace
from autotp.cost_model.pipeline import balanceable_units, plan_pipeline
from autotp.ir.plan import ParallelPlan
from autotp.report.strict_rule import StrictResult, check_on_rank, combine
from distributed import run_on_ranks
from plain_models_attention import DecoderLM, NanoGPTAttention, PreNormBlock
import plain_models_novel
from plain_models_hierarchy import build, example_inputs


def _traced(name: str) -> torch.fx.GraphModule:
    return trace(build(name), example_inputs(name))


def _chunks_of_modules(gm: torch.fx.GraphModule, plan: ParallelPlan) -> dict[str, set[int]]:
    """The chunks the parameter reads of each module run in (``chunk_bases``), by module path."""
    found: dict[str, set[int]] = {}
    for node, chunk in chunk_bases(gm, plan).items():
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                found.setdefault(str(a.target).rpartition(".")[0], set()).add(chunk)
    return found


def test_the_last_stage_is_cut_where_its_blocks_balance() -> None:
    """Between the last stage's blocks the first chunk would hold 62% of the model; inside its first block, 50%."""
    gm = _traced("swin_stages")
    cuts = plan_pipeline(gm, 2, 1)
    assert cuts.layer_chunks == (0, 0) and cuts.module_chunks == (("layers.1.blocks.0.fc2", 1), ("layers.1.blocks.1", 1))
    plan = ParallelPlan(pp=2, **cuts._asdict())
    assert split_units(plan) == {"layers", "layers.1", "layers.1.blocks", "layers.1.blocks.0"}
    assert ParallelPlan.from_json(plan.to_json()) == plan
    chunks = _chunks_of_modules(gm, plan)
    assert chunks["layers.0.blocks.0.fc1"] == chunks["layers.1.downsample.reduction"] == chunks["layers.1.blocks.0.fc1"] == {0}
    assert chunks["layers.1.blocks.0.fc2"] == chunks["layers.1.blocks.1.fc1"] == chunks["head"] == {1}


def test_a_stage_of_one_block_is_cut_inside_it() -> None:
    of, split = balanceable_units(_traced("convnext_stages"), 2)
    assert split == {"stages.1", "stages.1.blocks", "stages.1.blocks.0"}  # the block list of one block too
    assert [u for u in dict.fromkeys(of.values()) if str(u).startswith("stages.1")] == [
        "stages.1.downsample", "stages.1.blocks.0.dwconv", "stages.1.blocks.0.norm", "stages.1.blocks.0.fc1", "stages.1.blocks.0.fc2"
    ]  # fmt: skip


def test_three_levels_of_numbered_lists_split_by_the_same_rule() -> None:
    cuts = plan_pipeline(_traced("dual_block_stages"), 2, 1)
    assert cuts.module_chunks == (("layers.1.blocks.0.0.fc2", 1), ("layers.1.blocks.0.1", 1))


def test_a_block_under_a_chunks_share_is_split_where_no_cut_between_blocks_balances() -> None:
    """The last stage's two blocks hold 45% and 28%: a cut between them leaves 70% on the first chunk, so the
    first block is cut too, before its projection shortcut (the last of its parts to run)."""
    cuts = plan_pipeline(_traced("bottleneck_stages"), 2, 1)
    assert cuts.module_chunks == (("stages.1.blocks.0.shortcut", 1), ("stages.1.blocks.1", 1))


def test_a_chunk_crowded_with_parameters_has_a_layer_split() -> None:
    """ConvNeXt-atto's shape: no stage is over half the model, but the best cut between whole stages
    leaves the second chunk 66% of the parameters (over 1.3 of its half); a cut between the third
    stage's downsampling and its block leaves it 56%."""
    cuts = plan_pipeline(_traced("pyramid_stages"), 2, 1)
    assert cuts.layer_chunks == (0, 0, 0, 1) and cuts.module_chunks == (("stages.2.blocks", 1),)


def test_more_chunks_split_more() -> None:
    gm = _traced("swin_stages")
    cuts = plan_pipeline(gm, 2, 2)  # a block is more than a quarter: split into its attention and linears
    assert cuts.layer_chunks == (0, 0)
    assert [path for path, _ in cuts.module_chunks] == [
        "layers.1.blocks", "layers.1.blocks.0.fc2", "layers.1.blocks.1", "layers.1.blocks.1.norm2", "layers.1.blocks.1.fc1", "layers.1.blocks.1.fc2"
    ]  # fmt: skip
    chunks = _chunks_of_modules(gm, ParallelPlan(pp=2, vpp=2, **cuts._asdict()))
    assert [chunks[m] for m in ("layers.1.downsample.reduction", "layers.1.blocks.0.attn", "layers.1.blocks.0.fc2", "layers.1.blocks.1.fc2")] == [
        {0}, {1}, {2}, {3}
    ]  # fmt: skip


def test_layers_small_enough_stay_the_units() -> None:
    gm = trace(DecoderLM(lambda: PreNormBlock(NanoGPTAttention(), nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)))),
               {"input_ids": torch.zeros(2, 8, dtype=torch.long)})  # fmt: skip
    of, split = balanceable_units(gm, 2)
    assert not split and of == units(gm)
    assert plan_pipeline(gm, 2, 1).module_chunks == ()


def test_a_module_of_values_sized_by_the_data_stays_whole() -> None:
    """DeepSeek-V3's MoE layers each hold more than a quarter of the model, but a cut between
    its experts would send tokens routed at run time, of a size no receiver knows."""
    gm = trace(plain_models_novel.build("deepseek_v3_routing"), plain_models_novel.example_inputs("deepseek_v3_routing"))
    of, split = balanceable_units(gm, 4)
    assert not split and of == units(gm)


class _HugeHead(nn.Module):
    """Two small layers and a classifier larger than the rest: a leaf, so it stays one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_large_module_without_parts_stays_whole() -> None:
    gm = trace(_HugeHead(), {"x": torch.randn(2, 8)})
    of, split = balanceable_units(gm, 2)
    assert not split and list(dict.fromkeys(of.values())) == [0, 1, "head"]


def _strict_on_rank(rank: int, world: int, name: str) -> StrictResult:
    return check_on_rank(build(name), example_inputs(name), tp=1, pp=2)


def test_split_stages_pass_the_strict_rule_at_pp2() -> None:
    for name in ("swin_stages", "convnext_stages", "bottleneck_stages", "pyramid_stages"):
        result = combine(run_on_ranks(_strict_on_rank, 2, name, timeout_s=400))
        assert result.passed, f"{name}: {result.reason}"
        assert result.share <= 0.65, f"{name}: {result.share:.0%} of the parameters on a rank"
