"""Graph passes: plain functions ``pass_fn(gm, ctx) -> gm``, one per file."""

from autotp.passes.annotate_layouts import annotate_layouts
from autotp.passes.batch_draws import batch_draws
from autotp.passes.cancel_collectives import cancel_collectives
from autotp.passes.contiguous_norm_grads import contiguous_norm_grads
from autotp.passes.causal_attention import causal_attention
from autotp.passes.extract_chunks import extract_chunks
from autotp.passes.expert_parallel import expert_parallel
from autotp.passes.drop_unread_outputs import drop_unread_outputs
from autotp.passes.gather_activations import gather_activations
from autotp.passes.fused_linear_cross_entropy import fused_linear_cross_entropy
from autotp.passes.flex_attention_rank import flex_attention_rank
from autotp.passes.fp8_linear import fp8_linear
from autotp.passes.insert_collectives import insert_collectives
from autotp.passes.insert_param_waits import insert_param_waits
from autotp.passes.find_cudagraph_candidates import find_cudagraph_candidates
from autotp.passes.mark_cudagraph_regions import mark_cudagraph_regions
from autotp.passes.mask_padding import mask_padding
from autotp.passes.recompute_layers import recompute_layers
from autotp.passes.rewrite_shapes import rewrite_shapes
from autotp.passes.slice_replicated import slice_replicated
from autotp.passes.sharded_statistics import sharded_statistics
from autotp.passes.split_cudagraph_regions import split_cudagraph_regions
from autotp.passes.split_weight_grads import split_weight_grads
from autotp.passes.sequence_parallel import sequence_parallel
from autotp.passes.split_stages import split_stages
from autotp.passes.runner import Pass
from autotp.passes.tp_dropout import tp_dropout
from autotp.passes.tp_overlap import tp_overlap
from autotp.passes.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy
from autotp.passes.vocab_parallel_embedding import vocab_parallel_embedding

PASSES: list[Pass] = [
    causal_attention,
    annotate_layouts,
    batch_draws,
    rewrite_shapes,
    mask_padding,
    vocab_parallel_embedding,
    vocab_parallel_cross_entropy,
    tp_dropout,
    slice_replicated,
    flex_attention_rank,
    sharded_statistics,
    gather_activations,
    insert_collectives,
    cancel_collectives,
    expert_parallel,
    sequence_parallel,
    drop_unread_outputs,
    fused_linear_cross_entropy,
    fp8_linear,
    tp_overlap,
    split_stages,
    contiguous_norm_grads,
    find_cudagraph_candidates,
    mark_cudagraph_regions,
]

PROGRAM_PASSES: list[Pass] = [
    extract_chunks,
    recompute_layers,
    split_cudagraph_regions,
    insert_param_waits,
    split_weight_grads,
]
"""The passes after ``PASSES`` that build the rank program's chunk graphs (``autotp.ir.program``)."""
