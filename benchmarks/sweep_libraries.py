"""Sweep models as other libraries ship them, unmodified, under the strict rule.

The plain-PyTorch suite (``tests/plain_models_*.py``) holds our own small models written the way
other libraries write theirs; this runs the libraries' own code: timm's vision models, litgpt's
GPT configs, torchtune's builders, vit-pytorch, x-transformers and diffusers' DiT, SD3 and Flux
transformers, each from a small config (fp32, eval), at tp=2, tp=4 and pp=2 on gloo ranks
(``autotp.report.strict_rule``: loss, logits and every grad equal to the unmodified model's, each
rank holding at most 1.3/(tp*pp) of the parameters, no matmul weight kept whole without a plan
entry). A numeric mismatch is checked again in float64; one that vanishes there is named fp32
rounding (it still fails).

The libraries are not dependencies of autotp. Install them beside it without their
dependencies, and name the modules they import at load time but these models never run
(torchvision's datasets and transforms, lightning, tokenizers...) with ``--stub``: each such
module, and every name in it, then imports as an empty placeholder::

    pip install --no-deps --target /tmp/libsite timm litgpt torchtune vit-pytorch x-transformers \\
        diffusers einx loguru frozendict torch-einops-utils pillow
    python benchmarks/sweep_libraries.py --site /tmp/libsite --modes tp2,tp4
    python benchmarks/sweep_libraries.py --site /tmp/libsite --only timm_ --modes pp2

A model whose library does not import is reported as such. Prints one line per model and
degree, then the passes per library.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

MODES = {"tp2": (2, 1), "tp4": (4, 1), "pp2": (1, 2)}
STUBS = ("torchvision", "lightning", "lightning_utilities", "jsonargparse", "psutil", "yaml", "tokenizers", "torchao",
         "torchtune.modules.low_precision", "torchtune.data", "torchtune.training", "datasets", "torchdata", "omegaconf",
         "sentencepiece", "tiktoken", "blobfile", "kagglehub")  # fmt: skip
# packages whose __init__ imports far more than their models (a CLI, trainers): their submodules load without it
BARE = ("litgpt", "torchtune")
LIBRARIES = ("timm", "litgpt", "torchtune", "vit_pytorch", "x_transformers", "diffusers", "peft")
VOCAB, SEQ, IMAGE = 256, 16, 32


class _Placeholder(types.ModuleType):
    """A stubbed module: every name in it is an empty class (an enum where one is read by member)."""

    def __getattr__(self, name: str) -> Any:
        if name == "__version__":
            return "99.0.0"
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return enum.Enum(name, "NEAREST NEAREST_EXACT BILINEAR BICUBIC BOX HAMMING LANCZOS")
        return type(name, (), {"__init__": lambda self, *a, **k: None})


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def setup(site: str, stubs: tuple[str, ...]) -> None:
    """Make the libraries in ``site`` importable, ``stubs`` placeholders (in each rank process too)."""
    if site and site not in sys.path:
        sys.path.insert(0, site)
    if not any(isinstance(f, _Stubs) for f in sys.meta_path):
        sys.meta_path.insert(0, _Stubs(stubs))
    for name in BARE:
        spec = importlib.util.find_spec(name) if name not in sys.modules else None
        if spec is not None and spec.submodule_search_locations:
            package = types.ModuleType(name)
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules[name] = package


# ---- inputs and losses ----------------------------------------------------------------------


def _tokens(key: str) -> Callable[[], dict[str, Any]]:
    return lambda: {key: torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))}


def _images(key: str, frames: int = 0) -> Callable[[], dict[str, Any]]:
    shape = (2, 3, frames, IMAGE, IMAGE) if frames else (2, 3, IMAGE, IMAGE)
    return lambda: {key: torch.randn(*shape, generator=torch.Generator().manual_seed(1))}


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def lm_loss(out: Any) -> torch.Tensor:
    logits = _first(out)
    target = (torch.arange(logits.shape[1]) * 7 + 3).expand(logits.shape[:2]) % logits.shape[-1]  # each row's, whatever the rows
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def class_loss(out: Any) -> torch.Tensor:
    logits = _first(out)
    return F.cross_entropy(logits, torch.full((logits.shape[0],), 3))


def sample_loss(out: Any) -> torch.Tensor:
    return _first(out).square().mean()


def _diffusion_inputs(inputs: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """``inputs`` maps each forward argument to a tensor of the pool below by name, or to a value passed as is."""

    def make() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        pool = {name: torch.randn(*shape, generator=gen) for name, shape in dict(
            image=(2, 4, 8, 8), video=(2, 4, 2, 8, 8), frames=(2, 2, 4, 8, 8), tokens=(2, 16, 16), text=(2, 6, 32), text2=(2, 6, 32),
            text_layers=(2, 2, 6, 32), pooled=(2, 32), ids3=(16, 3), ids4=(16, 4)).items()}  # fmt: skip
        pool |= {"step": torch.tensor([3.0, 700.0]), "flow": torch.tensor([0.3, 0.7]), "txt_ids3": torch.zeros(6, 3), "txt_ids4": torch.zeros(6, 4),
                 "mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])}  # fmt: skip
        return {k: pool[v] if isinstance(v, str) else v for k, v in inputs.items()} | {"return_dict": False}

    return make


# ---- the models: name -> (builder, inputs, loss) ----------------------------------------------

Model = tuple[Callable[[], torch.nn.Module], Callable[[], dict[str, Any]], Callable[[Any], torch.Tensor]]


def _call(path: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    module, name = path.rsplit(".", 1)
    return lambda: getattr(importlib.import_module(module), name)(**kwargs)


def _timm(name: str, **kwargs: Any) -> Model:
    return (lambda: importlib.import_module("timm").create_model(name, pretrained=False, num_classes=8, **kwargs)), _images("x"), class_loss


def _litgpt(name: str, **kwargs: Any) -> Model:
    def build() -> torch.nn.Module:
        config = importlib.import_module("litgpt.config").Config
        sizes = dict(n_layer=2, n_embd=64, n_head=4, padded_vocab_size=VOCAB, vocab_size=VOCAB, block_size=64)
        return importlib.import_module("litgpt.model").GPT(config.from_name(name, **sizes, **kwargs))

    return build, _tokens("idx"), lm_loss


def _torchtune(path: str, **kwargs: Any) -> Model:
    sizes = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, embed_dim=64, max_seq_len=64, intermediate_dim=128)
    return _call(f"torchtune.models.{path}", **sizes, **kwargs), _tokens("tokens"), lm_loss


def _vit_pytorch(path: str, key: str = "img", input_frames: int = 0, **kwargs: Any) -> Model:
    return _call(f"vit_pytorch.{path}", **kwargs), _images(key, input_frames), class_loss


def _x_transformers(**attn: Any) -> Model:
    def build() -> torch.nn.Module:
        xt = importlib.import_module("x_transformers")
        return xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=64, attn_layers=xt.Decoder(dim=64, depth=2, heads=4, **attn))

    return build, _tokens("x"), lm_loss


def _diffusers(cls: str, inputs: dict[str, Any], **kwargs: Any) -> Model:
    return _call(f"diffusers.{cls}", **kwargs), _diffusion_inputs(inputs), sample_loss


def _peft(kind: str, **kwargs: Any) -> Model:
    """A tiny HF Llama wrapped by PEFT's ``get_peft_model`` with ``<kind>Config(**kwargs)`` (adapters on every linear
    of the layers unless ``kwargs`` names them)."""

    def build() -> torch.nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        peft = importlib.import_module("peft")
        base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False))  # fmt: skip
        targets = {} if "num_virtual_tokens" in kwargs else {"target_modules": kwargs.pop("target_modules", "all-linear")}
        config = getattr(peft, f"{kind}Config")(task_type="CAUSAL_LM", **targets, **kwargs)
        model = peft.get_peft_model(base, config)
        for name, p in model.named_parameters():  # a freshly made adapter is an identity (B = 0): make it count
            if p.requires_grad and not p.abs().sum():
                torch.nn.init.normal_(p, std=0.02)
        return model

    return build, _tokens("input_ids"), lm_loss


VIT = dict(img_size=IMAGE, patch_size=8, embed_dim=64, depth=2, num_heads=4)
VP = dict(image_size=IMAGE, patch_size=8, num_classes=8, dim=64, depth=2, heads=4, mlp_dim=128, dim_head=16)
TT = dict(num_kv_heads=2)
HEADS = dict(num_attention_heads=4, attention_head_dim=16)
IMAGE_TEXT = dict(hidden_states="image", encoder_hidden_states="text", timestep="step")
VIDEO_TEXT = dict(hidden_states="video", encoder_hidden_states="text", timestep="step")
FLUX = dict(hidden_states="tokens", encoder_hidden_states="text", timestep="flow", img_ids="ids3", txt_ids="txt_ids3")
MODELS: dict[str, Model] = {
    **{f"timm_{n}": _timm(n, **VIT) for n in (
        "vit_base_patch16_224", "deit_base_distilled_patch16_224", "deit3_base_patch16_224", "beit_base_patch16_224",
        "beitv2_base_patch16_224", "vit_base_patch16_siglip_224", "vit_relpos_base_patch16_224", "vit_srelpos_medium_patch16_224",
        "vit_base_patch16_rope_reg1_gap_256", "aimv2_large_patch14_224", "vit_little_patch16_reg1_gap_256",
        "vit_betwixt_patch16_rope_reg4_gap_256", "flexivit_small", "vit_medium_patch16_gap_256", "vit_base_patch16_clip_224")},
    "timm_eva02_base_patch14_224": _timm("eva02_base_patch14_224", **VIT),
    "timm_eva02_tiny_patch14_224": _timm("eva02_tiny_patch14_224", **VIT),
    "timm_naflexvit_base_patch16_gap": _timm("naflexvit_base_patch16_gap", **VIT, pos_embed_grid_size=(4, 4)),
    "timm_cait_xxs24_224": _timm("cait_xxs24_224", **VIT, depth_token_only=1),
    "timm_xcit_tiny_12_p8_224": _timm("xcit_tiny_12_p8_224", **VIT, cls_attn_layers=1),
    "timm_convit_tiny": _timm("convit_tiny", **VIT, local_up_to_layer=1),
    "timm_samvit_base_patch16": _timm("samvit_base_patch16", **VIT, global_attn_indexes=(1,), window_size=2, neck_chans=32),
    "timm_swin_tiny_patch4_window7_224": _timm("swin_tiny_patch4_window7_224", img_size=IMAGE, patch_size=2, window_size=4,
                                               embed_dim=32, depths=(2, 2), num_heads=(4, 8)),  # fmt: skip
    "timm_swinv2_tiny_window8_256": _timm("swinv2_tiny_window8_256", img_size=IMAGE, patch_size=2, window_size=4, embed_dim=32,
                                          depths=(2, 2), num_heads=(4, 8)),  # fmt: skip
    "timm_pit_ti_224": _timm("pit_ti_224", img_size=IMAGE, patch_size=4, stride=2, base_dims=[16, 16], depth=[1, 1], heads=[4, 8]),
    "timm_twins_svt_small": _timm("twins_svt_small", img_size=IMAGE, patch_size=4, embed_dims=(32, 64), num_heads=(4, 8),
                                  mlp_ratios=(4, 4), depths=(1, 1), sr_ratios=(2, 1), wss=(2, 2)),  # fmt: skip
    "timm_pvt_v2_b0": _timm("pvt_v2_b0", embed_dims=(32, 64), num_heads=(4, 8), depths=(1, 1), sr_ratios=(2, 1), mlp_ratios=(4, 4)),
    "timm_davit_tiny": _timm("davit_tiny", embed_dims=(32, 64), num_heads=(4, 8), depths=(1, 1)),
    "timm_hiera_tiny_224": _timm("hiera_tiny_224", img_size=(IMAGE, IMAGE), embed_dim=32, num_heads=2, stages=(1, 1), q_pool=1,
                                 mask_unit_size=(2, 2)),  # fmt: skip
    "timm_crossvit_tiny_240": _timm("crossvit_tiny_240", img_size=[IMAGE, IMAGE], patch_size=[8, 16], embed_dim=[32, 64],
                                    depth=[[1, 1, 0]], num_heads=[4, 4], mlp_ratio=[2, 2, 1]),  # fmt: skip
    "timm_convnext_atto": _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(32, 64, 64, 64)),
    "timm_sequencer2d_s": _timm("sequencer2d_s", layers=(1, 1, 1, 1), embed_dims=(32, 64, 64, 64), hidden_sizes=(16, 32, 32, 32)),
    "litgpt_llama3": _litgpt("Llama-3.2-1B", n_query_groups=2, intermediate_size=128),
    "litgpt_gemma2": _litgpt("Gemma-2-2b", n_query_groups=2, intermediate_size=128, head_size=16),
    "litgpt_gemma3": _litgpt("Gemma-3-1b-it", n_query_groups=2, intermediate_size=128, head_size=16),
    "litgpt_phi2": _litgpt("phi-2", intermediate_size=128),
    "litgpt_phi3": _litgpt("Phi-3-mini-4k-instruct", intermediate_size=128),
    "litgpt_falcon7b": _litgpt("falcon-7b", n_query_groups=1),
    "litgpt_pythia": _litgpt("pythia-160m", intermediate_size=128),
    "litgpt_qwen25": _litgpt("Qwen2.5-0.5B", n_query_groups=2, intermediate_size=128),
    "litgpt_qwen3": _litgpt("Qwen3-0.6B", n_query_groups=2, intermediate_size=128, head_size=16),
    "litgpt_olmo": _litgpt("OLMo-1B-hf", intermediate_size=128),
    "litgpt_mixtral": _litgpt("Mixtral-8x7B-v0.1", n_query_groups=2, intermediate_size=128, n_expert=4, n_expert_per_token=2),
    "torchtune_llama3": _torchtune("llama3.llama3", **TT),
    "torchtune_llama3_2": _torchtune("llama3_2.llama3_2", **TT),
    "torchtune_qwen2": _torchtune("qwen2.qwen2", **TT, tie_word_embeddings=True),
    "torchtune_gemma": _torchtune("gemma.gemma", num_kv_heads=1, head_dim=16),
    "torchtune_gemma2": _torchtune("gemma2.gemma2", **TT, head_dim=16),
    "torchtune_phi3": _torchtune("phi3.phi3", num_kv_heads=4),
    "torchtune_mistral": _torchtune("mistral.mistral", **TT),
    "vit_pytorch_vit": _vit_pytorch("vit.ViT", **VP),
    "vit_pytorch_simple_vit": _vit_pytorch("simple_vit.SimpleViT", **VP),
    "vit_pytorch_cait": _vit_pytorch("cait.CaiT", **VP, cls_depth=1),
    "vit_pytorch_deepvit": _vit_pytorch("deepvit.DeepViT", **VP),
    "vit_pytorch_small_dataset": _vit_pytorch("vit_for_small_dataset.ViT", **VP),
    "vit_pytorch_xcit": _vit_pytorch("xcit.XCiT", **VP, cls_depth=1, local_patch_kernel_size=3, layer_dropout=0.0),
    "vit_pytorch_vit_3d": _vit_pytorch("vit_3d.ViT", key="video", input_frames=4, image_size=IMAGE, frames=4, image_patch_size=8,
                                       frame_patch_size=2, num_classes=8, dim=64, depth=2, heads=4, mlp_dim=128, dim_head=16),  # fmt: skip
    "vit_pytorch_cross_vit": _vit_pytorch("cross_vit.CrossViT", image_size=IMAGE, num_classes=8, sm_dim=32, lg_dim=64, sm_patch_size=8,
                                          lg_patch_size=16, sm_enc_depth=1, lg_enc_depth=1, cross_attn_depth=1, depth=1, sm_enc_heads=4,
                                          lg_enc_heads=4, cross_attn_heads=4, sm_enc_mlp_dim=64, lg_enc_mlp_dim=64, sm_enc_dim_head=8,
                                          lg_enc_dim_head=16, cross_attn_dim_head=8),  # fmt: skip
    "vit_pytorch_max_vit": _vit_pytorch("max_vit.MaxViT", key="x", num_classes=8, dim_conv_stem=32, dim=32, dim_head=8, depth=(1, 1),
                                        window_size=2, mbconv_expansion_rate=2, mbconv_shrinkage_rate=0.25, dropout=0.0),  # fmt: skip
    "vit_pytorch_twins_svt": _vit_pytorch("twins_svt.TwinsSVT", key="x", num_classes=8, peg_kernel_size=3, dropout=0.0, **{
        f"s{i}_{k}": v for i in range(1, 5) for k, v in dict(emb_dim=32 if i == 1 else 64, patch_size=4 if i == 1 else 2 if i == 2 else 1,
                                                              local_patch_size=2, global_k=2, depth=1).items()}),  # fmt: skip
    "vit_pytorch_cct": _vit_pytorch("cct.CCT", key="x", img_size=IMAGE, embedding_dim=64, n_conv_layers=1, kernel_size=3, stride=2, padding=1,
                                    pooling_kernel_size=3, pooling_stride=2, pooling_padding=1, num_layers=2, num_heads=4, mlp_ratio=2.0,
                                    num_classes=8, positional_embedding="learnable"),  # fmt: skip
    "vit_pytorch_regionvit": _vit_pytorch("regionvit.RegionViT", key="x", dim=(32, 64, 64, 64), depth=(1, 1, 1, 1), window_size=2,
                                          num_classes=8, tokenize_local_3_conv=False, use_peg=False),  # fmt: skip
    "x_transformers_plain": _x_transformers(),
    "x_transformers_rotary_glu_qk_norm": _x_transformers(rotary_pos_emb=True, ff_glu=True, attn_qk_norm=True),
    "x_transformers_alibi_memory_kv": _x_transformers(alibi_pos_bias=True, attn_num_mem_kv=2),
    "x_transformers_relative_bias": _x_transformers(rel_pos_bias=True),
    "x_transformers_macaron_sandwich_shift": _x_transformers(macaron=True, sandwich_norm=True, shift_tokens=1),
    "x_transformers_gqa_gated": _x_transformers(attn_kv_heads=2, gate_residual=True, attn_gate_values=True),
    "x_transformers_residual_attn_rmsnorm": _x_transformers(residual_attn=True, ff_swish=True, use_rmsnorm=True),
    "x_transformers_dynamic_pos_head_scale": _x_transformers(dynamic_pos_bias=True, attn_head_scale=True, ff_post_act_ln=True),
    "diffusers_dit": _diffusers("DiTTransformer2DModel", dict(hidden_states="image", timestep="step", class_labels=torch.tensor([1, 2])),
                                num_attention_heads=4, attention_head_dim=16, in_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                num_embeds_ada_norm=10),  # fmt: skip
    "diffusers_sd3": _diffusers("SD3Transformer2DModel", IMAGE_TEXT | dict(pooled_projections="pooled"), sample_size=8, patch_size=2,
                                in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                caption_projection_dim=64, pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16),  # fmt: skip
    "diffusers_flux": _diffusers("FluxTransformer2DModel", FLUX | dict(pooled_projections="pooled"), patch_size=1, in_channels=16,
                                 num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                 pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),  # fmt: skip
    "diffusers_pixart": _diffusers("PixArtTransformer2DModel", IMAGE_TEXT | dict(added_cond_kwargs={"resolution": None, "aspect_ratio": None}),
                                   **HEADS, in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=64, sample_size=8, patch_size=2,
                                   caption_channels=32),  # fmt: skip
    "diffusers_sana": _diffusers("SanaTransformer2DModel", IMAGE_TEXT, **HEADS, in_channels=4, out_channels=4, num_layers=2,
                                 num_cross_attention_heads=4, cross_attention_head_dim=16, cross_attention_dim=64, caption_channels=32,
                                 sample_size=8, patch_size=2),  # fmt: skip
    "diffusers_hunyuan_dit": _diffusers("HunyuanDiT2DModel", IMAGE_TEXT | dict(text_embedding_mask="mask", encoder_hidden_states_t5="text2",
                                        text_embedding_mask_t5="mask"), **HEADS, in_channels=4, patch_size=2, sample_size=8, hidden_size=64,
                                        num_layers=4, cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=32, text_len=6,
                                        text_len_t5=6, use_style_cond_and_image_meta_size=False),  # fmt: skip
    "diffusers_cogvideox": _diffusers("CogVideoXTransformer3DModel", dict(hidden_states="frames", encoder_hidden_states="text", timestep="step"),
                                      **HEADS, in_channels=4, out_channels=4, time_embed_dim=32, text_embed_dim=32, num_layers=2, sample_width=8,
                                      sample_height=8, sample_frames=5, max_text_seq_length=6),  # fmt: skip
    "diffusers_ltx_video": _diffusers("LTXVideoTransformer3DModel", dict(hidden_states="tokens", encoder_hidden_states="text", timestep="step",
                                      encoder_attention_mask="mask", num_frames=1, height=4, width=4), **HEADS, in_channels=16, out_channels=16,
                                      cross_attention_dim=64, num_layers=2, caption_channels=32),  # fmt: skip
    "diffusers_wan": _diffusers("WanTransformer3DModel", VIDEO_TEXT, **HEADS, in_channels=4, out_channels=4, text_dim=32, freq_dim=32,
                                ffn_dim=128, num_layers=2, rope_max_seq_len=32),  # fmt: skip
    "diffusers_skyreels_v2": _diffusers("SkyReelsV2Transformer3DModel", VIDEO_TEXT, **HEADS, in_channels=4, out_channels=4, text_dim=32,
                                        freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=32),  # fmt: skip
    "diffusers_hunyuan_video": _diffusers("HunyuanVideoTransformer3DModel", VIDEO_TEXT | dict(encoder_attention_mask="mask",
                                          pooled_projections="pooled"), **HEADS, in_channels=4, out_channels=4, num_layers=2, num_single_layers=4,
                                          num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(4, 6, 6),
                                          guidance_embeds=False),  # fmt: skip
    "diffusers_mochi": _diffusers("MochiTransformer3DModel", VIDEO_TEXT | dict(encoder_attention_mask="mask"), num_attention_heads=4,
                                  attention_head_dim=24, num_layers=2, pooled_projection_dim=48, in_channels=4, text_embed_dim=32,
                                  time_embed_dim=32, max_sequence_length=6),  # 8/3 of its widths divide by 8: SwiGLU's halves at tp=4; fmt: skip
    "diffusers_cosmos": _diffusers("CosmosTransformer3DModel", VIDEO_TEXT, **HEADS, in_channels=4, out_channels=4, num_layers=2, mlp_ratio=2.0,
                                   text_embed_dim=32, adaln_lora_dim=16, max_size=(4, 16, 16), concat_padding_mask=False),  # fmt: skip
    "diffusers_qwenimage": _diffusers("QwenImageTransformer2DModel", dict(hidden_states="tokens", encoder_hidden_states="text",
                                      encoder_hidden_states_mask="mask", timestep="flow", img_shapes=[(1, 4, 4)] * 2), in_channels=16,
                                      out_channels=4, num_layers=2, **HEADS, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),  # fmt: skip
    "diffusers_lumina2": _diffusers("Lumina2Transformer2DModel", IMAGE_TEXT | dict(timestep="flow", encoder_attention_mask="mask"), sample_size=8,
                                    in_channels=4, hidden_size=64, num_layers=2, num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2,
                                    multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32), cap_feat_dim=32),  # fmt: skip
    "diffusers_auraflow": _diffusers("AuraFlowTransformer2DModel", IMAGE_TEXT, sample_size=8, in_channels=4, num_mmdit_layers=1,
                                     num_single_dit_layers=3, **HEADS, joint_attention_dim=32, caption_projection_dim=64, out_channels=4,
                                     pos_embed_max_size=16),  # fmt: skip
    "diffusers_hidream": _diffusers("HiDreamImageTransformer2DModel", dict(hidden_states="image", timesteps="step", encoder_hidden_states_t5="text",
                                    encoder_hidden_states_llama3="text_layers", pooled_embeds="pooled"), patch_size=2, in_channels=4,
                                    num_layers=1, num_single_layers=1, **HEADS, caption_channels=[32, 32], text_emb_dim=32, axes_dims_rope=(8, 4, 4),
                                    max_resolution=(8, 8), llama_layers=[0, 1]),  # fmt: skip
    "diffusers_flux2": _diffusers("Flux2Transformer2DModel", FLUX | dict(img_ids="ids4", txt_ids="txt_ids4"), patch_size=1, in_channels=16,
                                  num_layers=1, num_single_layers=3, **HEADS, joint_attention_dim=32, timestep_guidance_channels=32,
                                  axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False),  # fmt: skip
    "diffusers_chroma": _diffusers("ChromaTransformer2DModel", FLUX, patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, **HEADS,
                                   joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=64,
                                   approximator_layers=1),  # fmt: skip
    "peft_lora": _peft("Lora", r=8, lora_alpha=16, lora_dropout=0.0),
    "peft_rslora": _peft("Lora", r=8, lora_alpha=16, use_rslora=True),
    "peft_dora": _peft("Lora", r=8, use_dora=True),
    "peft_loha": _peft("LoHa", r=8),
    "peft_lokr": _peft("LoKr", r=8),
    "peft_ia3": _peft("IA3", target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "peft_vera": _peft("Vera", r=8, target_modules=["q_proj", "v_proj"]),
    "peft_oft": _peft("OFT", r=0, oft_block_size=16, target_modules=["q_proj", "v_proj", "up_proj"]),
    "peft_boft": _peft("BOFT", boft_block_size=8, target_modules=["q_proj", "v_proj"]),
    "peft_fourierft": _peft("FourierFT", n_frequency=64, target_modules=["q_proj", "v_proj"]),
    "peft_prompt_tuning": _peft("PromptTuning", num_virtual_tokens=4),
    "peft_ptuning": _peft("PromptEncoder", num_virtual_tokens=4, encoder_hidden_size=32),
}


def _check_on_rank(rank: int, world: int, name: str, mode: str, dtype: torch.dtype, site: str, stubs: tuple[str, ...]) -> Any:
    from autotp.report.strict_rule import check_on_rank

    setup(site, stubs)
    build, inputs, loss = MODELS[name]
    torch.manual_seed(0)
    model = build().eval().to(dtype)
    example = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs().items()}
    tp, pp = MODES[mode]
    return check_on_rank(model, example, tp=tp, pp=pp, loss_fn=loss)


def verdict(name: str, mode: str, site: str, stubs: tuple[str, ...], timeout_s: float) -> str:
    """One line: passes with the rank's share, or why not (fp32 rounding named)."""
    from autotp.report.strict_rule import combine
    from autotp.runtime.processes.launcher import spawn_ranks

    tp, pp = MODES[mode]

    def run(dtype: torch.dtype) -> Any:
        return combine(spawn_ranks(_check_on_rank, tp * pp, name, mode, dtype, site, stubs, backend="gloo", timeout_s=timeout_s, num_threads=1))

    try:
        result = run(torch.float32)
    except Exception as e:  # noqa: BLE001 - the reason is the verdict
        return f"fails: {str(e).splitlines()[0][:300]}"
    if result.passed:
        return f"passes ({result.share:.0%} of the parameters on a rank)"
    reason = result.reason[:300]
    if result.mismatch and run(torch.float64).equal:  # a bug shows in float64 too; fp32 rounding alone does not
        reason = f"fp32 rounding only, equal in float64: {reason}"
    return f"fails: {reason}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", default="", help="a folder the libraries were installed into (pip install --target)")
    parser.add_argument("--stub", default=",".join(STUBS), help="modules imported as placeholders (default: %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated prefixes of model names (default: all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated degrees (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per model and degree")
    args = parser.parse_args()
    stubs = tuple(s for s in args.stub.split(",") if s)
    setup(args.site, stubs)
    prefixes = [p for p in args.only.split(",") if p]
    names = [n for n in MODELS if not prefixes or any(n.startswith(p) for p in prefixes)]
    passed: dict[tuple[str, str], list[bool]] = {}
    for mode in args.modes.split(","):
        for name in names:
            line = verdict(name, mode, args.site, stubs, args.timeout)
            print(f"{mode} {name}: {line}", flush=True)
            library = next(lib for lib in LIBRARIES if name.startswith(lib + "_"))
            passed.setdefault((library, mode), []).append(line.startswith("passes"))
    for (library, mode), results in passed.items():
        print(f"{library} at {mode}: {sum(results)}/{len(results)}")


if __name__ == "__main__":
    main()
