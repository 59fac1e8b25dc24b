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
    pip install --no-deps --target /tmp/libsite2 PaLM-pytorch MEGABYTE-pytorch Mega-pytorch \
        simple-hierarchical-transformer recurrent-memory-transformer-pytorch \
        block-recurrent-transformer-pytorch soft-moe-pytorch st-moe-pytorch mixture-of-experts \
        gateloop-transformer perceiver-pytorch h-transformer-1d local-attention conformer \
        nystrom-attention colt5-attention bs-roformer PoPE-pytorch mixture-of-attention \
        tab-transformer-pytorch x-mlps-pytorch discrete-continuous-embed-readout hyper-connections torchscale xlstm \
        mambapy performer-pytorch linformer g-mlp-pytorch enformer-pytorch denoising-diffusion-pytorch reformer-pytorch \
        linear-attention-transformer axial-positional-embedding product-key-memory sinkhorn-transformer routing-transformer \
        memory-efficient-attention-pytorch iTransformer hourglass-transformer-pytorch CoCa-pytorch mmdit rin-pytorch \
        vector-quantize-pytorch compressive-transformer-pytorch mogrifier native-sparse-attention-pytorch \
        rotary-embedding-torch taylor-series-linear-attention beartype
    pip install --no-deps --target /tmp/libsite3 torchtitan==0.2.0 fair-esm hiera-transformer open_clip_torch \
        "transformer-lens<3" typeguard better-abc fancy-einsum jaxtyping labml-nn
    pip install --no-deps --target /tmp/libsite4 monai flamingo-pytorch einops-exts PEER-pytorch FLASH-pytorch minGRU-pytorch \
        charformer-pytorch agent-attention-pytorch gated-state-spaces-pytorch TimeSformer-pytorch invariant-point-attention \
        halonet-pytorch egnn-pytorch En-transformer graph-transformer-pytorch isab-pytorch lambda-networks memory-transformer-xl \
        perceiver-ar-pytorch ponder-transformer rela-transformer segformer-pytorch slot-attention triangle-multiplicative-module \
        bottleneck-transformer-pytorch VN-transformer axial-attention bidirectional-cross-attention compositional-attention-pytorch \
        hamburger-pytorch kronecker-attention-pytorch memory-compressed-attention omninet-pytorch point-transformer-pytorch \
        tranception-pytorch uformer-pytorch mlp-mixer-pytorch res-mlp-pytorch MaMMUT-pytorch ring-attention-pytorch
    pip install --no-deps --target /tmp/libsite17 ibm-fms moshi sam2 infini-transformer-pytorch transfusion-pytorch \
        x-transformers rotary-embedding-torch einops einx beartype hyper-connections assoc-scan axial-positional-embedding \
        torchdiffeq jaxtyping wadler-lindig loguru torch-einops-utils iopath portalocker pillow frozendict
    pip install --no-deps --target /tmp/libsite18 esm attrs  # EvolutionaryScale's ESM C: a site without FAIR's esm
    pip install --no-deps --target /tmp/libsite19 torch-geometric xxhash
    pip install --no-deps --target /tmp/libsite20 torchmultimodal-nightly iopath portalocker
    pip install --no-deps --target /tmp/libsite22 pi-zero-pytorch e2-tts-pytorch coconut-pytorch PaLM-rlhf-pytorch \
        x-transformers einops einx beartype rotary-embedding-torch hyper-connections jaxtyping wadler-lindig ema-pytorch \
        torchdiffeq assoc-scan accelerated-scan axial-positional-embedding frozendict loguru torch-einops-utils x-mlps-pytorch \
        accelerate memmap-replay-buffer adam-atan2-pytorch hl-gauss-pytorch evolutionary-policy-optimization vocos encodec \
        mean-conc-beta g2p-en x-ppo nltk x-evolution inflect jaraco.functools more-itertools typeguard jaraco.text \
        jaraco.context autocommand
    pip install --no-deps --target /tmp/libsite23 sockeye kornia kornia_rs timesfm titans-pytorch tensordict speechbrain \
        hyperpyyaml ruamel.yaml tabpfn narwhals scikit-learn joblib threadpoolctl einops einx beartype rotary-embedding-torch \
        hyper-connections x-transformers axial-positional-embedding assoc-scan jaxtyping wadler-lindig loguru frozendict \
        torch-einops-utils x-mlps-pytorch
    pip install --no-deps --target /tmp/libsite25 kan-gpt pykan unit-scaling docstring_parser bitnet ai2-olmo omegaconf \
        antlr4-python3-runtime==4.9.3  # and zeta's SimpleRMSNorm as zeta/nn/modules/simple_rmsnorm.py (zeta-torch is not on
        # the index: F.normalize(x, dim=-1) * dim**0.5, as zeta defines it) with an empty zeta/nn/__init__.py naming OutputHead
    pip install --no-deps --target /tmp/libsite24 audiocraft chronos-forecasting uni2ts stable-audio-tools x-clip retro-pytorch \
        dalle-pytorch toolformer-pytorch einops einx beartype rotary-embedding-torch x-transformers vector-quantize-pytorch \
        local-attention jaxtyping wadler-lindig loguru frozendict torch-einops-utils hyper-connections axial-positional-embedding \
        assoc-scan x-mlps-pytorch accelerate joblib pillow  # with HF_HUB_OFFLINE=1
    pip install --no-deps --target /tmp/libsite26 OpenNMT-py neuralforecast gluonts rtdl-revisiting-models tabm rtdl-num-embeddings \
        toolz pytorch-lightning lightning-utilities torchmetrics pandas pytz tzdata configargparse
    # neuralforecast's models are Lightning modules and read pandas at import: run this site with
    # --stub=-lightning_utilities,-torchmetrics,-pandas,-pyarrow,-gluonts,-yaml,-lightning (pytorch-forecasting: not swept, see docs)
    pip install --no-deps --target /tmp/libsite27 k-diffusion meshgpt-pytorch muse-maskgit-pytorch soundstorm-pytorch \
        einops einx beartype x-transformers rotary-embedding-torch classifier-free-guidance-pytorch gateloop-transformer \
        local-attention taylor-series-linear-attention vector-quantize-pytorch jaxtyping wadler-lindig hyper-connections \
        audiolm-pytorch spear-tts-pytorch memory-efficient-attention-pytorch loguru frozendict torch-einops-utils \
        axial-positional-embedding assoc-scan x-mlps-pytorch environs marshmallow python-dotenv accelerate dctorch jsonmerge \
        torchsde trampoline torchdiffeq torch-geometric xxhash x-clip open_clip_torch encodec joblib pillow
        # and k-diffusion's package from github.com/crowsonkb/k-diffusion (4601bf0: PyPI's 0.1.1 has no image_transformer_v2) over
        # it; sweep with --stub=-k_diffusion,-marshmallow,-dotenv,+skimage,+cleanfid,+clip
    python benchmarks/sweep_libraries.py --site /tmp/libsite:/tmp/libsite2 --modes tp2,tp4
    python benchmarks/sweep_libraries.py --site /tmp/libsite --only timm_ --modes pp2

Model code that is not on PyPI (nanochat, nanoGPT, lingua, OLMo-core, Whisper, CLIP, SAM, DINOv2,
I-JEPA, DiT, guided-diffusion; DINOv3's ``dinov3`` package, MiniMind's ``model/model_minimind.py`` as
``minimind_model.py``, gpt-fast's ``model.py`` and ``mixtral-moe/model.py`` as ``gptfast_model.py`` and ``gptfast_moe.py``) is read from the repositories' sources in another folder on
``--site`` (docs/propagation.md, eighteenth and twenty-fifth rounds). Time-Series-Library (github.com/thuml/Time-Series-Library,
models named ``tslib_*``) is its ``models``, ``layers`` and ``utils`` packages in a folder of their own on ``--site``
(they import each other by those top-level names); its Reformer and Crossformer import reformer-pytorch and
local-attention from the second install line above.

A model whose library does not import is reported as such. Prints one line per model and
degree, then the passes per library.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import importlib.abc
import importlib.machinery
import inspect
import os
import random
import sys
import types
import typing_extensions
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

MODES = {"tp2": (2, 1), "tp4": (4, 1), "pp2": (1, 2)}
STUBS = ("torchvision", "lightning", "lightning_utilities", "jsonargparse", "psutil", "yaml", "tokenizers", "torchao",
         "torchtune.modules.low_precision", "torchtune.data", "torchtune.training", "datasets", "torchdata", "omegaconf",
         "sentencepiece", "tiktoken", "blobfile", "kagglehub", "cached_path", "bettermap", "numba", "ftfy", "xformers", "librosa",
         "fairscale", "mamba_ssm", "polars", "ema_pytorch", "pytorch_fid", "pyfaidx", "kipoiseq", "tensordict", "tyro", "wandb", "pandas",
         "torch.utils.tensorboard", "torchtitan.models.moe.kernels", "labml", "labml_helpers", "matplotlib", "zstd", "cloudpathlib",
         "tenacity", "biotite", "brotli", "msgpack", "msgpack_numpy", "Bio", "httpx", "torchaudio", "sklearn", "boto3", "botocore",
         "google", "importlib_resources", "rich", "requests",
         "soundfile", "av", "julius",
         "torchmetrics", "num2words", "spacy", "flashy", "hydra", "demucs", "audiotools", "argbind", "pytorch_custom_utils", "faiss",
         "autofaiss", "torchode", "gradio", "k_diffusion", "laion_clap", "alias_free_torch", "auraloss", "prefigure", "webdataset", "pywt",
         "fairseq", "taming", "hydra_zen", "gluonts", "pyarrow", "orjson", "dotenv", "marshmallow", "lion_pytorch", "pytorch_warmup", "jax",
         "cv2", "pkg_resources", "dora", "pyonmttok", "ahocorasick", "rapidfuzz", "fasttext", "utilsforecast", "coreforecast", "ray",
         "optuna")  # fmt: skip
# packages whose __init__ imports far more than their models (a CLI, trainers): their submodules load without it
BARE = ("litgpt", "torchtune", "torchtitan.models.llama3", "torchtitan.models.qwen3", "torchtitan.models.deepseek_v3", "sam2", "palm_rlhf_pytorch",
        "pi_zero_pytorch", "e2_tts_pytorch", "speechbrain", "tabpfn")
LIBRARIES = ("timm", "litgpt", "torchtune", "vit_pytorch", "x_transformers", "diffusers", "peft", "nanochat", "olmo_core", "whisper",
             "segment_anything", "clip", "dinov2", "dit", "nanogpt",
             "lingua", "guided_diffusion", "ijepa", "palm_pytorch", "MEGABYTE_pytorch", "simple_hierarchical_transformer",
             "recurrent_memory_transformer_pytorch", "block_recurrent_transformer_pytorch", "soft_moe_pytorch", "st_moe_pytorch",
             "mixture_of_experts", "gateloop_transformer", "mega_pytorch", "perceiver_pytorch", "h_transformer_1d", "local_attention",
             "conformer", "nystrom_attention", "colt5_attention", "bs_roformer", "mixture_of_attention", "tab_transformer", "ft_transformer",
             "torchscale", "xlstm", "mambapy", "performer_pytorch", "linformer", "g_mlp_pytorch", "enformer_pytorch", "reformer_pytorch",
             "linear_attention_transformer", "denoising_diffusion_pytorch", "sinkhorn_transformer", "memory_efficient_attention_pytorch",
             "iTransformer", "hourglass_transformer_pytorch", "coca_pytorch", "mmdit", "vector_quantize_pytorch",
             "compressive_transformer_pytorch", "native_sparse_attention_pytorch", "rin_pytorch", "torchtitan", "esm", "hiera",
             "transformer_lens", "open_clip", "labml_nn", "monai", "flamingo_pytorch", "PEER_pytorch", "flash_pytorch", "minGRU_pytorch",
             "charformer_pytorch", "agent_attention_pytorch", "gated_state_spaces_pytorch", "timesformer_pytorch",
             "invariant_point_attention", "halonet_pytorch", "egnn_pytorch", "en_transformer", "graph_transformer_pytorch", "isab_pytorch",
             "lambda_networks", "memory_transformer_xl", "perceiver_ar_pytorch", "ponder_transformer", "rela_transformer", "segformer_pytorch",
             "slot_attention", "triangle_multiplicative_module", "bottleneck_transformer_pytorch", "VN_transformer", "axial_attention",
             "bidirectional_cross_attention", "compositional_attention_pytorch", "hamburger_pytorch", "kronecker_attention_pytorch",
             "memory_compressed_attention", "omninet_pytorch", "point_transformer_pytorch", "tranception_pytorch", "uformer_pytorch",
             "mlp_mixer_pytorch", "res_mlp_pytorch", "mammut_pytorch", "ring_attention_pytorch", "tslib", "fms", "moshi", "sam2",
             "infini_transformer_pytorch", "transfusion_pytorch", "dinov3", "minimind", "esmc", "torch_geometric",
             "gptfast", "torchmultimodal", "palm_rlhf_pytorch", "coconut_pytorch", "pi_zero_pytorch",
             "e2_tts_pytorch", "sockeye", "kornia", "timesfm", "titans", "speechbrain", "tabpfn", "audiocraft", "chronos", "uni2ts",
             "stable_audio", "x_clip", "retro_pytorch", "dalle_pytorch", "toolformer", "kan_gpt",
             "unit_scaling", "bitnet", "ai2_olmo", "k_diffusion", "muse", "meshgpt", "soundstorm", "onmt", "neuralforecast", "gluonts", "rtdl", "tabm")  # fmt: skip
VOCAB, SEQ, IMAGE = 256, 16, 32
# run in training mode (no dropout in their configs): reformer's reversible layers record the random state they
# replay in backward only while training (in eval mode its own backward fails)
TRAINING = frozenset({"reformer_pytorch", "torchmultimodal_mae", "x_clip", "x_clip_built_before_process_group", "retro_pytorch"})  # MAE masks patches only while training;
# x-clip and RETRO return their losses only while training


class _Placeholder(types.ModuleType):
    """A stubbed module: every name in it is an empty class (an enum where one is read by member)."""

    def __getattr__(self, name: str) -> Any:
        if name == "__version__":
            return "99.0.0"
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return enum.Enum(name, "NEAREST NEAREST_EXACT BILINEAR BICUBIC BOX HAMMING LANCZOS")
        return _PlaceholderClass(name, (), _PLACEHOLDER_METHODS)


class _PlaceholderClass(type(typing_extensions.Protocol)):  # type: ignore[misc]
    """A stubbed module's name: a class whose attributes are such classes too (``S3Client.recoverable_errors``). Its
    metaclass is a protocol's, so that a class may derive from it and from an ABC or a protocol
    (``class Loader(StatefulDataLoader, Stateful)``)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _PlaceholderClass(name, (), _PLACEHOLDER_METHODS)

    def __add__(cls, other: Any) -> Any:  # ``SchemeClient.recoverable_errors + (...)``: what is added
        return other


# an instance called returns what it was given: a stubbed decorator (``@numba.jit(nopython=True)``) leaves its function
_PLACEHOLDER_METHODS = {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: a[0] if a else None}


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
    for folder in reversed([f for f in site.split(os.pathsep) if f]):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    if not any(isinstance(f, _Stubs) for f in sys.meta_path):
        sys.meta_path.insert(0, _Stubs(stubs))
    for name in BARE:
        try:
            spec = importlib.util.find_spec(name) if name not in sys.modules else None
        except ModuleNotFoundError:  # a dotted name whose parent package this site lacks
            spec = None
        if spec is not None and spec.submodule_search_locations:
            package = types.ModuleType(name)
            package.__path__ = list(spec.submodule_search_locations)
            sys.modules[name] = package


# ---- inputs and losses ----------------------------------------------------------------------


def _tokens(key: str) -> Callable[[], dict[str, Any]]:
    return lambda: {key: torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))}


def _images(key: str, frames: int = 0, size: int = IMAGE, channels: int = 3) -> Callable[[], dict[str, Any]]:
    shape = (2, channels, frames, size, size) if frames else (2, channels, size, size)
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


def _timm(name: str, size: int = IMAGE, **kwargs: Any) -> Model:
    """timm's ``name`` on ``size``-pixel images (hybrid convolution-attention models downsample 32-fold: 64)."""
    return (lambda: importlib.import_module("timm").create_model(name, pretrained=False, num_classes=8, **kwargs)), _images("x", size=size), class_loss


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


def _reinit_zeros(model: torch.nn.Module) -> torch.nn.Module:
    """Give the parameters a library initializes to zeros (adaLN gates, output projections) random values, so
    that every gradient of the check is nonzero."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    return model


def _nanochat() -> torch.nn.Module:
    os.environ["NANOCHAT_DTYPE"] = "float32"  # it computes in bf16 where CUDA has it, whatever its weights' dtype
    gpt = importlib.import_module("nanochat.gpt")
    model = gpt.GPT(gpt.GPTConfig(sequence_len=SEQ, vocab_size=VOCAB - 6, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                                  window_pattern="SL"))  # a vocabulary it pads to 64 rows and slices its logits back to; fmt: skip
    model.init_weights()
    return _reinit_zeros(model)


def _olmo_core(kind: str, **kwargs: Any) -> Model:
    """OLMo-core's ``TransformerConfig.<kind>`` (``attn_backend="torch"``: SDPA, where the config takes a backend)."""

    def build() -> torch.nn.Module:
        config = importlib.import_module("olmo_core.nn.transformer").TransformerConfig
        return _reinit_zeros(getattr(config, kind)(vocab_size=VOCAB, **kwargs).build(init_device="cpu"))

    return build, _tokens("input_ids"), lm_loss


def _whisper() -> torch.nn.Module:
    model = importlib.import_module("whisper.model")
    whisper = model.Whisper(model.ModelDimensions(n_mels=16, n_audio_ctx=8, n_audio_state=64, n_audio_head=4, n_audio_layer=2,
                                                 n_vocab=VOCAB, n_text_ctx=SEQ, n_text_state=64, n_text_head=4, n_text_layer=2))  # fmt: skip
    torch.nn.init.normal_(whisper.decoder.positional_embedding, std=0.02)  # torch.empty: a checkpoint fills it
    return whisper


def _whisper_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"mel": torch.randn(2, 16, 16, generator=gen), "tokens": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}


class _SamTraining(torch.nn.Module):
    """SAM fine-tuned on point prompts the way its users train it: the image encoder, the prompt encoder and the mask
    decoder called per image (``Sam.forward`` itself runs under ``no_grad``)."""

    def __init__(self) -> None:
        super().__init__()
        modeling = importlib.import_module("segment_anything.modeling")
        self.image_encoder = modeling.ImageEncoderViT(img_size=IMAGE, patch_size=8, embed_dim=64, depth=2, num_heads=4, out_chans=32,
                                                      use_rel_pos=True, window_size=2, global_attn_indexes=(1,))  # fmt: skip
        self.prompt_encoder = modeling.PromptEncoder(embed_dim=32, image_embedding_size=(4, 4), input_image_size=(IMAGE, IMAGE),
                                                     mask_in_chans=8)  # fmt: skip
        transformer = modeling.TwoWayTransformer(depth=2, embedding_dim=32, mlp_dim=64, num_heads=4)
        self.mask_decoder = modeling.MaskDecoder(transformer_dim=32, transformer=transformer, num_multimask_outputs=3,
                                                 iou_head_hidden_dim=32)  # fmt: skip

    def forward(self, image: torch.Tensor, points: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        embeddings = self.image_encoder(image)
        masks = []
        for i in range(image.shape[0]):
            sparse, dense = self.prompt_encoder(points=(points[i : i + 1], labels[i : i + 1]), boxes=None, masks=None)
            low_res, iou = self.mask_decoder(image_embeddings=embeddings[i : i + 1], image_pe=self.prompt_encoder.get_dense_pe(),
                                             sparse_prompt_embeddings=sparse, dense_prompt_embeddings=dense, multimask_output=True)  # fmt: skip
            masks.append(low_res * iou[..., None, None])
        return torch.cat(masks)


def _sam_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"image": torch.randn(2, 3, IMAGE, IMAGE, generator=gen), "points": torch.rand(2, 3, 2, generator=gen) * IMAGE,
            "labels": torch.tensor([[1, 0, 1], [1, 1, 0]])}  # fmt: skip


def _clip(**vision: Any) -> Model:
    def build() -> torch.nn.Module:
        sizes = dict(vision_width=64) | vision
        model = importlib.import_module("clip.model").CLIP(embed_dim=32, image_resolution=IMAGE, vision_patch_size=8,
                                                           context_length=SEQ, vocab_size=VOCAB, transformer_width=64,
                                                           transformer_heads=4, transformer_layers=2, **sizes)  # fmt: skip
        model.initialize_parameters()
        return _reinit_zeros(model)  # its ResNet's last batch norm of each block starts at zero

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        return {"image": torch.randn(2, 3, IMAGE, IMAGE, generator=gen), "text": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}

    def contrastive(out: Any) -> torch.Tensor:
        per_image, per_text = out
        target = torch.arange(per_image.shape[0])
        return (F.cross_entropy(per_image, target) + F.cross_entropy(per_text, target)) / 2

    return build, inputs, contrastive


class _Dinov2Features(torch.nn.Module):
    """DINOv2's student on iBOT-masked crops: ``forward_features`` with patch masks, both token outputs."""

    def __init__(self) -> None:
        super().__init__()
        os.environ["XFORMERS_DISABLED"] = "1"  # its own switch: the stubbed xformers (lingua imports it) is no kernel
        self.vit = importlib.import_module("dinov2.models.vision_transformer").vit_small(
            img_size=IMAGE, patch_size=8, block_chunks=0, init_values=1e-5, num_register_tokens=2, ffn_layer="swiglufused")
        self.vit.blocks = self.vit.blocks[:2]

    def forward(self, x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        out = self.vit.forward_features(x, masks=masks)
        return torch.cat([out["x_norm_clstoken"][:, None], out["x_norm_patchtokens"]], dim=1)


def _dinov2_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 3, IMAGE, IMAGE, generator=gen), "masks": torch.rand(2, 16, generator=gen) < 0.4}


def _dit() -> torch.nn.Module:
    return _reinit_zeros(importlib.import_module("dit_models").DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2,
                                                                   num_heads=4, num_classes=10))  # fmt: skip


def _dit_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 4, 8, 8, generator=gen), "t": torch.tensor([3, 700]), "y": torch.tensor([1, 7])}


def _nanogpt() -> Model:
    def build() -> torch.nn.Module:
        model = importlib.import_module("nanogpt_model")
        return model.GPT(model.GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True))

    def inputs() -> dict[str, Any]:  # its training call: with targets it returns every position's logits and the loss
        ids = _tokens("idx")()["idx"]
        return {"idx": ids, "targets": ids.roll(-1, dims=1)}

    return build, inputs, lambda out: out[1]


def _lingua() -> Model:
    def build() -> torch.nn.Module:
        lm = importlib.import_module("lingua_lm")
        model = lm.LMTransformer(lm.LMTransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seqlen=SEQ,
                                                      multiple_of=16))  # fmt: skip
        model.reset_parameters()
        return model

    return build, _tokens("token_values"), lm_loss


def _guided_diffusion() -> torch.nn.Module:
    unet = importlib.import_module("guided_diffusion.unet")
    return _reinit_zeros(unet.UNetModel(image_size=8, in_channels=4, model_channels=32, out_channels=4, num_res_blocks=1,
                                        attention_resolutions=(2,), channel_mult=(1, 2), num_classes=10, num_heads=4,
                                        use_scale_shift_norm=True, resblock_updown=True))  # output convs start at zero; fmt: skip


def _guided_diffusion_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 4, 8, 8, generator=gen), "timesteps": torch.tensor([3, 700]), "y": torch.tensor([1, 7])}


class _IJepaContext(torch.nn.Module):
    """I-JEPA's step without its target encoder: the context encoder on the kept patches, the predictor on
    the masked ones (``src.train``'s ``forward_context``)."""

    def __init__(self) -> None:
        super().__init__()
        vit = importlib.import_module("src.models.vision_transformer")
        self.encoder = vit.VisionTransformer(img_size=[IMAGE], patch_size=8, embed_dim=64, depth=2, num_heads=4)
        self.predictor = vit.VisionTransformerPredictor(num_patches=16, embed_dim=64, predictor_embed_dim=32, depth=2, num_heads=4)

    def forward(self, imgs: torch.Tensor, context: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z = self.encoder(imgs, [context])
        return self.predictor(z, [context], [target])


def _ijepa_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    order = torch.stack([torch.randperm(16, generator=gen) for _ in range(2)])
    return {"imgs": torch.randn(2, 3, IMAGE, IMAGE, generator=gen), "context": order[:, :10].sort(1).values,
            "target": order[:, 10:].sort(1).values}  # fmt: skip


def _tabular(numeric: str) -> Callable[[], dict[str, Any]]:
    """Two rows of a table: five categorical columns (ids below each column's 5 categories) and four numeric ones."""

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        return {"x_categ": torch.randint(0, 5, (2, 5), generator=gen), numeric: torch.randn(2, 4, generator=gen)}

    return inputs


def _audio() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"raw_audio": torch.randn(2, 512, generator=gen), "target": torch.randn(2, 512, generator=gen)}


# BS-RoFormer on a 64-point STFT: 33 frequencies in four bands, two-resolution STFT loss
_BAND_SPLIT = dict(dim=64, depth=1, time_transformer_depth=1, freq_transformer_depth=1, freqs_per_bands=(8, 8, 8, 9), dim_freqs_in=33,
                   stft_n_fft=64, stft_hop_length=16, stft_win_length=64, dim_head=16, heads=4, flash_attn=False, mask_estimator_depth=1,
                   multi_stft_resolutions_window_sizes=(64, 32), multi_stft_hop_size=16)  # fmt: skip


class _LayersLM(torch.nn.Module):
    """A token mixer or expert layer of a library (``path`` called with ``kwargs``) in a small language model: an
    embedding, two residual layers, a norm and a head; returns the logits and the sum of the layers' auxiliary
    losses (an MoE's balance and router terms), which ``_lm_and_aux`` adds to the loss."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 64)
        self.layers = torch.nn.ModuleList(_call(path, **kwargs)() for _ in range(2))
        self.norm, self.head = torch.nn.LayerNorm(64), torch.nn.Linear(64, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.embed(ids), torch.zeros(())
        for layer in self.layers:
            out = layer(x)
            if isinstance(out, tuple):
                out, aux = out[0], aux + sum(o for o in out[1:] if isinstance(o, torch.Tensor) and o.dim() == 0)
            x = x + out
        return self.head(self.norm(x)), aux


def _lm_and_aux(out: Any) -> torch.Tensor:
    return lm_loss(out[0]) + out[1]


class _LabmlLM(torch.nn.Module):
    """labml_nn's annotated transformers: two of its pre-norm layers (sequence first, ``[S, B, D]``) with the attention
    module ``attn`` (a path under ``labml_nn.transformers``), or its Switch transformer's layers with 4 experts, between its
    learned-position embedding and its generator; returns the logits and the Switch layers' load-balancing loss."""

    def __init__(self, attn: str, causal: bool = True, gated: bool = False, switch: bool = False, **attn_kwargs: Any) -> None:
        super().__init__()
        t = "labml_nn.transformers"
        models, ff = importlib.import_module(f"{t}.models"), importlib.import_module(f"{t}.feed_forward")
        mixer = _call(f"{t}.{attn}", **attn_kwargs)()
        mlp = ff.FeedForward(64, 128, 0.0, torch.nn.SiLU() if gated else torch.nn.ReLU(), is_gated=gated, bias1=not gated, bias2=not gated)
        if switch:
            moe = importlib.import_module(f"{t}.switch")
            experts = moe.SwitchFeedForward(capacity_factor=1.0, drop_tokens=False, is_scale_prob=True, n_experts=4, expert=mlp, d_model=64)
            self.layers = moe.SwitchTransformer(moe.SwitchTransformerLayer(d_model=64, attn=mixer, feed_forward=experts, dropout_prob=0.0), 2)
        else:
            self.layers = models.Encoder(models.TransformerLayer(d_model=64, self_attn=mixer, feed_forward=mlp, dropout_prob=0.0), 2)
        self.embed, self.generator = models.EmbeddingsWithLearnedPositionalEncoding(64, VOCAB, 64), models.Generator(VOCAB, 64)
        self.causal, self.switch = causal, switch

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = ids.t()
        mask = importlib.import_module("labml_nn.transformers.utils").subsequent_mask(x.shape[0]) if self.causal else None
        out = self.layers(self.embed(x), mask)
        if not self.switch:
            return self.generator(out).transpose(0, 1), torch.zeros(())
        x, counts, route_prob, _, _ = out
        balance = 4 * (counts / counts.sum(-1, keepdim=True) * route_prob / route_prob.sum(-1, keepdim=True)).sum()
        return self.generator(x).transpose(0, 1), 0.01 * balance


def _labml(attn: str, **kwargs: Any) -> Model:
    return (lambda: _LabmlLM(attn, **kwargs)), _tokens("ids"), _lm_and_aux


def _layers_lm(path: str, **kwargs: Any) -> Model:
    return (lambda: _LayersLM(path, **kwargs)), _tokens("ids"), _lm_and_aux


def _own_loss(path: str, key: str = "x", **kwargs: Any) -> Model:
    """A library's language model that computes its own loss (``return_loss=True``); its first output."""
    return _call(path, **kwargs), (lambda: _tokens(key)() | {"return_loss": True}), _first


def _torchscale(kind: str, config: str, **kwargs: Any) -> Model:
    """Microsoft's torchscale decoders (``kind``: ``retnet.RetNetDecoder`` or ``decoder.Decoder``), tokens in, logits out."""

    def build() -> torch.nn.Module:
        cfg = _call(f"torchscale.architecture.config.{config}", vocab_size=VOCAB, decoder_embed_dim=64, decoder_ffn_embed_dim=128,
                    decoder_layers=2, **kwargs)()  # fmt: skip
        return _call(f"torchscale.architecture.{kind}", args=cfg, embed_tokens=torch.nn.Embedding(VOCAB, 64))()

    return build, _tokens("prev_output_tokens"), lm_loss


def _xlstm() -> torch.nn.Module:
    """NX-AI's xLSTM language model of two mLSTM blocks (its PyTorch cell: a parallel form with gates and a causal convolution)."""
    from xlstm import xLSTMLMModel, xLSTMLMModelConfig
    from xlstm.blocks.mlstm.block import mLSTMBlockConfig
    from xlstm.blocks.mlstm.layer import mLSTMLayerConfig

    layer = mLSTMLayerConfig(num_heads=4, conv1d_kernel_size=4, qkv_proj_blocksize=4)
    model = xLSTMLMModel(xLSTMLMModelConfig(vocab_size=VOCAB, embedding_dim=64, num_blocks=2, context_length=SEQ,
                                            mlstm_block=mLSTMBlockConfig(mlstm=layer)))  # fmt: skip
    model.reset_parameters()
    return model


def _mambapy() -> torch.nn.Module:
    """alxndrTL's pure-PyTorch Mamba (mambapy): a selective scan by its parallel scan (``pscan``)."""
    from mambapy.lm import LM, MambaConfig

    return LM(MambaConfig(d_model=64, n_layers=2, pscan=True), vocab_size=VOCAB)


def _enformer() -> torch.nn.Module:
    """lucidrains' Enformer: a convolution tower with attention pooling, a transformer with relative positions, a head."""
    from enformer_pytorch import Enformer

    return Enformer.from_hparams(dim=96, depth=2, heads=4, output_heads=dict(human=8), target_length=4, num_downsamples=3,
                                 dim_divisible_by=8)  # fmt: skip


def _dna() -> dict[str, Any]:
    """One-hot bases: Enformer turns integer bases into one-hot only where ``type(x) == torch.Tensor``, which a traced
    forward's fake tensors are not (the trace would run its convolution on integers)."""
    bases = torch.randint(0, 4, (2, 64), generator=torch.Generator().manual_seed(1))
    return {"x": F.one_hot(bases, 4).float()}


def _noised_images(times: list[float] | list[int]) -> Callable[[], dict[str, Any]]:
    """Two 16-pixel images and their diffusion times (integer steps or fractions, as the model takes them)."""
    return lambda: {"x": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)), "time": torch.tensor(times)}


def _human(out: Any) -> torch.Tensor:
    return out["human"].square().mean()


def _variates() -> dict[str, Any]:
    return {"x": torch.randn(2, SEQ, 8, generator=torch.Generator().manual_seed(1))}


def _squares(out: Any) -> torch.Tensor:
    """The mean square of every tensor the model returns (a dict of forecasts, a tuple of modalities)."""
    return sum(t.square().mean() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


def _captioned_images() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"text": torch.randint(0, VOCAB, (2, SEQ), generator=gen), "image_tokens": torch.randn(2, 9, 32, generator=gen), "return_loss": True}


def _two_modalities() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"modality_tokens": (torch.randn(2, 8, 64, generator=gen), torch.randn(2, 6, 32, generator=gen)),
            "time_cond": torch.randn(2, 16, generator=gen)}  # fmt: skip



def _vectors() -> dict[str, Any]:
    return {"x": torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))}


def _video() -> dict[str, Any]:
    """Two clips of two 16-pixel frames, frames first (``[B, T, C, H, W]``)."""
    return {"video": torch.randn(2, 2, 3, 16, 16, generator=torch.Generator().manual_seed(1))}


def _residue_frames() -> dict[str, Any]:
    """AlphaFold's structure-module inputs: per-residue features, pair features, and each residue's frame (a rotation
    matrix, orthonormalized from random ones by QR, and a translation)."""
    gen = torch.Generator().manual_seed(1)
    rotations = torch.linalg.qr(torch.randn(2, SEQ, 3, 3, generator=gen)).Q
    return {"x": torch.randn(2, SEQ, 64, generator=gen), "pairwise_repr": torch.randn(2, SEQ, SEQ, 16, generator=gen),
            "rotations": rotations, "translations": torch.randn(2, SEQ, 3, generator=gen)}  # fmt: skip


def _graph() -> dict[str, Any]:
    """A dense graph per sample: node features, edge features, every node present."""
    gen = torch.Generator().manual_seed(1)
    return {"nodes": torch.randn(2, SEQ, 64, generator=gen), "edges": torch.randn(2, SEQ, SEQ, 16, generator=gen),
            "mask": torch.ones(2, SEQ, dtype=torch.bool)}  # fmt: skip


# Time-Series-Library's run.py arguments, small: 8 series, 16 steps in, 8 forecast from an 8-step decoder start token
_TSLIB = dict(task_name="long_term_forecast", features="M", seq_len=SEQ, label_len=8, pred_len=8, enc_in=8, dec_in=8, c_out=8, d_model=32,
              n_heads=4, e_layers=2, d_layers=1, d_ff=64, moving_avg=5, factor=3, distil=True, dropout=0.0, embed="timeF", freq="h",
              activation="gelu", output_attention=False, top_k=2, num_kernels=2, channel_independence=1, decomp_method="moving_avg",
              use_norm=1, down_sampling_layers=1, down_sampling_window=2, down_sampling_method="avg", seg_len=4, patch_len=4, stride=2,
              expand=2, d_conv=4, d_state=4, node_dim=8, gcn_depth=2, gcn_dropout=0.0, propalpha=0.3, conv_channel=8, skip_channel=8,
              individual=False, alpha=0.1, top_p=0.5, pos=1, p_hidden_dims=[16, 16], p_hidden_layers=2, num_class=3)  # fmt: skip


def _tslib(name: str, **overrides: Any) -> Model:
    """Time-Series-Library's (thuml) ``models.<name>.Model(configs)``, forecasting: the encoder's series and time
    features (``timeF``: each in [-0.5, 0.5]), the decoder's start tokens and their time features, by the first four
    names of its ``forward``; trained on the forecast's mean square."""
    config = _TSLIB | overrides

    def build() -> torch.nn.Module:
        return importlib.import_module(f"models.{name}").Model(types.SimpleNamespace(**config))

    def inputs() -> dict[str, Any]:
        forward = importlib.import_module(f"models.{name}").Model.forward
        names = list(inspect.signature(forward).parameters)[1:5]
        gen = torch.Generator().manual_seed(1)
        steps = config["label_len"] + config["pred_len"]
        series = (torch.randn(2, config["seq_len"], config["enc_in"], generator=gen), torch.rand(2, config["seq_len"], 4, generator=gen) - 0.5,
                  torch.randn(2, steps, config["dec_in"], generator=gen), torch.rand(2, steps, 4, generator=gen) - 0.5)  # fmt: skip
        return dict(zip(names, series))

    return build, inputs, _squares


def _fms(module: str, cls: str, config: str, **kwargs: Any) -> Model:
    """IBM's foundation-model-stack: ``fms.models.<module>.<cls>(<config>(...))`` of 2 layers over VOCAB tokens, after
    its ``post_init`` (the RoPE tables). Its ``reset_parameters`` leaves some parameters as ``torch.empty`` made them,
    so every parameter is drawn here at its scale (0.02), norms' gains around one."""

    def build() -> torch.nn.Module:
        package = importlib.import_module(f"fms.models.{module}")
        settings = getattr(package, config)(src_vocab_size=VOCAB, nlayers=2, **kwargs)
        model = getattr(package, cls)(settings)
        if hasattr(model, "post_init"):
            model.post_init()
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                gain = name.endswith(("ln.weight", "norm.weight"))
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if gain else 0.02) + gain)
        return model

    return build, _tokens("x"), lm_loss


def _moshi_codes() -> dict[str, Any]:
    """Moshi's streams: a text token stream and two audio codebooks of 32 entries, 16 steps."""
    return {"codes": torch.randint(0, 32, (2, 3, SEQ), generator=torch.Generator().manual_seed(1))}


def _moshi_loss(out: Any) -> torch.Tensor:
    """Both streams' cross-entropy where Moshi's masks say a step is predicted (its logits are NaN where not)."""
    audio = out.logits.masked_fill(~out.mask[..., None], 0.0)
    return lm_loss(audio.flatten(0, 1)) + lm_loss(out.text_logits.masked_fill(~out.text_mask[..., None], 0.0)[:, 0])


def _sam2_memory() -> torch.nn.Module:
    """SAM 2's memory attention: self-attention over the current frame's 4x4 features and cross-attention to two
    frames of memory, both with axial RoPE (complex numbers), sequence first."""
    modules = importlib.import_module("sam2.modeling.memory_attention")
    rope = importlib.import_module("sam2.modeling.sam.transformer").RoPEAttention
    layer = modules.MemoryAttentionLayer(
        activation="relu", d_model=64, dim_feedforward=128, dropout=0.0, pos_enc_at_attn=False, pos_enc_at_cross_attn_keys=True,
        pos_enc_at_cross_attn_queries=False, self_attention=rope(embedding_dim=64, num_heads=4, feat_sizes=(4, 4)),
        cross_attention=rope(embedding_dim=64, num_heads=4, feat_sizes=(4, 4), rope_k_repeat=True, kv_in_dim=32))  # fmt: skip
    return modules.MemoryAttention(d_model=64, pos_enc_at_input=True, layer=layer, num_layers=2)


def _sam2_memory_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"curr": torch.randn(SEQ, 2, 64, generator=gen), "memory": torch.randn(2 * SEQ, 2, 32, generator=gen),
            "curr_pos": torch.randn(SEQ, 2, 64, generator=gen), "memory_pos": torch.randn(2 * SEQ, 2, 32, generator=gen)}  # fmt: skip


def _dinov3() -> torch.nn.Module:
    """DINOv3's ViT (axial RoPE, storage tokens, masked k bias, SwiGLU, layer scale) of 2 layers, its own init."""
    vit = importlib.import_module("dinov3.models.vision_transformer").DinoVisionTransformer(
        img_size=IMAGE, patch_size=8, embed_dim=64, depth=2, num_heads=4, ffn_layer="swiglu", n_storage_tokens=2, mask_k_bias=True,
        layerscale_init=1e-5, pos_embed_rope_dtype="fp32")  # fmt: skip
    vit.init_weights()
    return _reinit_zeros(vit)


def _dinov3_inputs() -> dict[str, Any]:
    return _dinov2_inputs() | {"is_training": True}


def _dino_tokens(out: Any) -> torch.Tensor:
    """The student's class and patch tokens (every third channel: they leave a norm)."""
    return _strided_squares(out["x_norm_clstoken"]) + _strided_squares(out["x_norm_patchtokens"])


def _minimind(**kwargs: Any) -> Model:
    """MiniMind (jingyaogong/minimind): a Qwen-style decoder of its own, dense or with a loop over its experts."""

    def build() -> torch.nn.Module:
        mm = importlib.import_module("minimind_model")
        return mm.MiniMindForCausalLM(mm.MiniMindConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, num_attention_heads=4,
                                                        num_key_value_heads=2, intermediate_size=128, **kwargs))  # fmt: skip

    return build, _tokens("input_ids"), lambda out: lm_loss(out.logits)


def _gpt_fast(module: str, **kwargs: Any) -> Model:
    """pytorch-labs/gpt-fast's Llama (``model.py`` as ``gptfast_model.py``) or Mixtral (``mixtral-moe/model.py`` as
    ``gptfast_moe.py``: each token's experts' weights gathered by index, then einsums): fused QKV split by sizes,
    GQA by ``repeat_interleave``, RoPE tables and the causal mask sized by ``setup_caches`` and read at the positions
    passed in; its KV caches (inference only) are dropped. Its MoE layer flattens the tokens and returns them flat, which
    adds to the residual only for a batch of one."""

    def build() -> torch.nn.Module:
        gf = importlib.import_module(module)
        model = gf.Transformer(gf.ModelArgs(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                                            intermediate_size=128, **kwargs))  # fmt: skip
        model.setup_caches(2, SEQ)
        for block in model.layers:
            block.attention.kv_cache = None
        for p in model.parameters():  # its parameters are made with torch.empty (a checkpoint fills them)
            torch.nn.init.normal_(p, std=0.05)
        return model

    batch = 1 if "num_experts" in kwargs else 2
    inputs = lambda: {"idx": _tokens("idx")()["idx"][:batch], "input_pos": torch.arange(SEQ)}  # noqa: E731
    return build, inputs, lm_loss


def _torchmultimodal_coca() -> torch.nn.Module:
    """torchmultimodal's CoCa for pretraining: a ViT with attention poolers, a causal text decoder and a
    cross-attending multimodal decoder; its contrastive and captioning losses."""
    coca = importlib.import_module("torchmultimodal.models.coca.coca_model")
    return coca.coca_for_pretraining(vision_patch_size=8, vision_dim_feedforward=128, vision_n_layer=2, vision_n_head=4, vocab_size=VOCAB,
                                     num_text_positions=SEQ, text_hidden_dim=64, text_n_layer=2, text_n_head=4, text_dim_feedforward=128,
                                     text_output_dim=64, fusion_n_layer=2, fusion_n_head=4, fusion_dim_feedforward=128,
                                     pooler_input_embed_dim=64, pooler_output_embed_dim=64, pooler_n_head=4, image_size=IMAGE,
                                     pooler_n_queries=8, cascaded_pooler=False, multimodal_output_projection_dim=VOCAB)  # fmt: skip


def _mae_loss(out: Any) -> torch.Tensor:
    """MAE's loss: the pixels' squared error over the masked patches."""
    per_patch = ((out.decoder_pred - out.label_patches) ** 2).mean(dim=-1)
    return (per_patch * out.mask).sum() / out.mask.sum()


def _esmc() -> Model:
    """EvolutionaryScale's ESM C (``esm`` 3.x, installed apart from FAIR's ``esm``, whose name it shares): its
    transformer stack without flash attention (LayerNorm'd fused QKV, q/k LayerNorms over all heads, SwiGLU),
    protein tokens (4 to 23) with its own padding mask."""

    def build() -> torch.nn.Module:
        esmc = importlib.import_module("esm.models.esmc")
        return esmc.ESMC(d_model=64, n_heads=4, n_layers=2, tokenizer=types.SimpleNamespace(pad_token_id=1), use_flash_attn=False)

    tokens = lambda: {"sequence_tokens": torch.randint(4, 24, (2, SEQ), generator=torch.Generator().manual_seed(1))}  # noqa: E731
    return build, tokens, lambda out: lm_loss(out.sequence_logits)


class _PygGraph(torch.nn.Module):
    """PyTorch Geometric's graph layers by message passing over an edge list (scatter softmax over each
    node's incoming edges, sums into the nodes): two ``conv`` layers of 4 heads and a node classifier; with
    ``gps``, each a GPS layer (a GIN message pass beside multi-head attention over each graph's nodes)."""

    def __init__(self, conv: str) -> None:
        super().__init__()
        nn = importlib.import_module("torch_geometric.nn")
        if conv == "GPSConv":
            mlp = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))  # noqa: E731
            self.embed = torch.nn.Linear(32, 64)
            self.layers = torch.nn.ModuleList(nn.GPSConv(64, nn.GINConv(mlp()), heads=4, dropout=0.0) for _ in range(2))
        else:
            self.embed = torch.nn.Identity()
            self.layers = torch.nn.ModuleList(getattr(nn, conv)(i, 16, heads=4) for i in (32, 64))
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, edge_index, batch=batch).relu() if isinstance(self.embed, torch.nn.Linear) else layer(h, edge_index).relu()
        return self.head(h)


def _graph_batch() -> dict[str, Any]:
    """Two graphs of 8 nodes (32 features each) with 20 random edges inside each, as PyG batches them: one
    node list, the edge list offset per graph, and each node's graph."""
    gen = torch.Generator().manual_seed(1)
    edges = torch.cat([torch.randint(0, 8, (2, 20), generator=gen) + 8 * g for g in range(2)], dim=1)
    return {"x": torch.randn(16, 32, generator=gen), "edge_index": edges, "batch": torch.arange(2).repeat_interleave(8)}


def _points(tokens: bool) -> Callable[[], dict[str, Any]]:
    """Point clouds of SEQ points in 3-D with a token or 32 features per point."""

    def make() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        feats = torch.randint(0, VOCAB, (2, SEQ), generator=gen) if tokens else torch.randn(2, SEQ, 32, generator=gen)
        return {"feats": feats, "coors": torch.randn(2, SEQ, 3, generator=gen)}

    return make


def _strided_squares(out: Any) -> torch.Tensor:
    """The mean square of every third channel of the first output (a normed output's whole mean square is its gain's)."""
    return _first(out)[..., ::3].square().mean()


def _media_captions() -> dict[str, Any]:
    """Tokens with media tokens (id 3) at positions 0 and 8, and two media of 5 embeddings each per sample."""
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(4, VOCAB, (2, SEQ), generator=gen).index_fill_(1, torch.tensor([0, 8]), 3)
    return {"text": text, "images": torch.randn(2, 2, 5, 64, generator=gen)}


def _torchtitan(family: str, model: str, args: str, **kwargs: Any) -> Model:
    """torchtitan's own model code (0.2, the last release with SDPA attention) from its ``ModelArgs``."""

    def build() -> torch.nn.Module:
        package = f"torchtitan.models.{family}.model"
        model_args = _call(f"{package}.args.{args}", vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, max_seq_len=SEQ, **kwargs)()
        built = _call(f"{package}.model.{model}", model_args=model_args)()
        built.init_weights()
        return built

    return build, _tokens("tokens"), lm_loss


def _esm2() -> Model:
    """FAIR's ESM-2 protein language model; its tokens are the 20 amino acids of its alphabet (indices 4 to 23)."""
    tokens = lambda: {"tokens": torch.randint(4, 24, (2, SEQ), generator=torch.Generator().manual_seed(1))}  # noqa: E731
    return _call("esm.ESM2", num_layers=2, embed_dim=64, attention_heads=4), tokens, lambda out: lm_loss(out["logits"])


def contrastive_loss(out: Any) -> torch.Tensor:
    """CLIP's symmetric loss over the batch (open_clip returns the normalized features and the logit scale), plus a
    captioner's cross-entropy where the model returns one."""
    image, text, scale = (out["image_features"], out["text_features"], out["logit_scale"]) if isinstance(out, dict) else out[:3]
    logits = scale * image @ text.t()
    target = torch.arange(logits.shape[0])
    loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
    if isinstance(out, dict) and "labels" in out:
        loss = loss + F.cross_entropy(out["logits"].flatten(0, 1), out["labels"].flatten())
    return loss


def _open_clip(vision: dict[str, Any], text: dict[str, Any], captioner: bool = False) -> Model:
    """mlfoundations' open_clip: CLIP, or CoCa with a multimodal captioning decoder, towers of 2 layers, width 64."""

    def build() -> torch.nn.Module:
        cfg = importlib.import_module("open_clip.model")
        towers = dict(vision_cfg=cfg.CLIPVisionCfg(layers=2, width=64, head_width=16, patch_size=8, image_size=IMAGE, **vision),
                      text_cfg=cfg.CLIPTextCfg(context_length=SEQ, vocab_size=VOCAB, width=64, heads=4, layers=2, **text))  # fmt: skip
        if not captioner:
            return cfg.CLIP(embed_dim=64, **towers)
        coca = importlib.import_module("open_clip.coca_model")
        decoder = coca.MultimodalCfg(context_length=SEQ, vocab_size=VOCAB, width=64, heads=4, layers=2, attn_pooler_heads=4)
        model = coca.CoCa(embed_dim=64, multimodal_cfg=decoder, **towers)
        # its constructor leaves the output projection uninitialized (torch.empty) and its init_parameters is stale: as open_clip's text tower
        torch.nn.init.normal_(model.text_decoder.text_projection, std=64**-0.5)
        return model

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        return {"image": torch.randn(2, 3, IMAGE, IMAGE, generator=gen), "text": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}

    return build, inputs, contrastive_loss


def _hooked_transformer(**kwargs: Any) -> Model:
    """TransformerLens' HookedTransformer (2.x): weights stored per head ``[n_heads, d_model, d_head]``, applied by einsum,
    a hook point around every activation."""

    def build() -> torch.nn.Module:
        tl = importlib.import_module("transformer_lens")
        return tl.HookedTransformer(tl.HookedTransformerConfig(n_layers=2, d_model=64, d_head=16, n_heads=4, d_mlp=128, d_vocab=VOCAB,
                                                               n_ctx=64, **kwargs))  # fmt: skip

    return build, _tokens("input"), lm_loss


VIT = dict(img_size=IMAGE, patch_size=8, embed_dim=64, depth=2, num_heads=4)
VP = dict(image_size=IMAGE, patch_size=8, num_classes=8, dim=64, depth=2, heads=4, mlp_dim=128, dim_head=16)
TT = dict(num_kv_heads=2)
HEADS = dict(num_attention_heads=4, attention_head_dim=16)


def _weighted(out: Any) -> torch.Tensor:
    """A loss reading every feature with its own weight (a normalized output's plain square mean is constant)."""
    t = _first(out).float()
    return (t * torch.linspace(-1, 1, t.shape[-1])).mean() + t.square().mean()


def _sockeye(decoder: str) -> Model:
    """AWS Sockeye's NMT transformer (its own attention and positional embeddings), ``decoder``: transformer or
    ssru_transformer (Simpler Simple Recurrent Units), initialized as its trainer does."""

    def build() -> torch.nn.Module:
        sockeye = {n: importlib.import_module(f"sockeye.{n}") for n in ("model", "transformer", "encoder", "data_io")}

        def layers(kind: str) -> Any:
            return sockeye["transformer"].TransformerConfig(
                model_size=64, attention_heads=4, feed_forward_num_hidden=256, act_type="relu", num_layers=2, dropout_attention=0.0,
                dropout_act=0.0, dropout_prepost=0.0, positional_embedding_type="fixed", preprocess_sequence="n", postprocess_sequence="r",
                max_seq_len_source=SEQ, max_seq_len_target=SEQ, depth_key_value=64, decoder_type=kind)  # fmt: skip

        embed = sockeye["encoder"].EmbeddingConfig(vocab_size=VOCAB, num_embed=64, dropout=0.0)
        data = sockeye["data_io"].DataConfig(data_statistics=None, max_seq_len_source=SEQ, max_seq_len_target=SEQ, num_source_factors=1,
                                             num_target_factors=1)  # fmt: skip
        config = sockeye["model"].ModelConfig(config_data=data, vocab_source_size=VOCAB, vocab_target_size=VOCAB, config_embed_source=embed,
                                              config_embed_target=embed, config_encoder=layers("transformer"), config_decoder=layers(decoder))  # fmt: skip
        model = sockeye["model"].SockeyeModel(config)
        model.apply(sockeye["model"].initialize_parameters)
        return model

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        source, target = (torch.randint(1, VOCAB, (2, SEQ, 1), generator=gen) for _ in range(2))
        lengths = torch.tensor([[SEQ, 0], [SEQ - 3, 0]])
        return {"source": source, "source_length": lengths, "target": target, "target_length": lengths}

    return build, inputs, lambda out: lm_loss(out["logits"])


def _kornia(path: str, config: str, inputs: Callable[[], dict[str, Any]], loss: Callable[[Any], torch.Tensor], **sizes: Any) -> Model:
    """kornia's own implementations of new architectures (``kornia.models``), from a small config."""

    def build() -> torch.nn.Module:
        made = {k: v() if callable(v) else v for k, v in sizes.items()}
        return _call(f"kornia.models.{path}", config=_call(f"kornia.models.{config}", **made)())()

    return build, inputs, loss


def _siglip_vision() -> Any:
    return _call("kornia.models.siglip2.config.SigLip2VisionConfig", image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=128)()  # fmt: skip


def _paligemma_loss(logits: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits[:, -SEQ:])


def _timesfm() -> torch.nn.Module:
    """Google's TimesFM 2.5 (its PyTorch module) with a small definition in place of the 200M one."""
    configs, base = importlib.import_module("timesfm.configs"), importlib.import_module("timesfm.timesfm_2p5.timesfm_2p5_base")
    block = configs.ResidualBlockConfig
    definition = base.TimesFM_2p5_200M_Definition(
        input_patch_len=8, output_patch_len=16, output_quantile_len=32,
        tokenizer=block(input_dims=16, hidden_dims=64, output_dims=64, use_bias=True, activation="swish"),
        stacked_transformers=configs.StackedTransformersConfig(num_layers=2, transformer=configs.TransformerConfig(
            model_dims=64, hidden_dims=64, num_heads=4, attention_norm="rms", feedforward_norm="rms", qk_norm="rms", use_bias=False,
            use_rotary_position_embeddings=True, ff_activation="swish", fuse_qkv=True)),
        output_projection_point=block(input_dims=64, hidden_dims=64, output_dims=64, use_bias=False, activation="swish"),
        output_projection_quantiles=block(input_dims=64, hidden_dims=64, output_dims=320, use_bias=False, activation="swish"))  # fmt: skip
    module = importlib.import_module("timesfm.timesfm_2p5.timesfm_2p5_torch").TimesFM_2p5_200M_torch_module
    return type("SmallTimesFM", (module,), {"config": definition})()


def _timesfm_inputs() -> dict[str, Any]:
    masks = torch.zeros(2, 8, 8, dtype=torch.bool)
    masks[1, :2] = True  # the second series starts two patches late
    return {"inputs": torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1)), "masks": masks}


def _timesfm_loss(out: Any) -> torch.Tensor:
    (_, _, point, quantiles), _ = out
    return point.square().mean() + quantiles.abs().mean()


def _titans(**kwargs: Any) -> Model:
    build = _call("titans_pytorch.MemoryAsContextTransformer", num_tokens=VOCAB, dim=64, depth=2, segment_len=8, num_persist_mem_tokens=2,
                  num_longterm_mem_tokens=2, dim_head=16, heads=4, **kwargs)  # fmt: skip

    def tokens() -> dict[str, Any]:
        return {"x": torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1)), "return_loss": True}

    return build, tokens, _first


def _speechbrain(**kwargs: Any) -> Model:
    """SpeechBrain's TransformerASR (encoder and decoder, its own attention kinds), features in; no output head."""
    build = _call("speechbrain.lobes.models.transformer.TransformerASR.TransformerASR", tgt_vocab=64, input_size=20, d_model=64, nhead=4,
                  num_encoder_layers=2, num_decoder_layers=2, d_ffn=128, dropout=0.0, causal=False, **kwargs)  # fmt: skip

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        return {"src": torch.randn(2, SEQ, 20, generator=gen), "tgt": torch.randint(1, 64, (2, 12), generator=gen)}

    return build, inputs, lambda out: out[0].square().mean() + _weighted(out[1])


def _tabpfn() -> torch.nn.Module:
    arch = importlib.import_module("tabpfn.architectures.tabpfn_v3")
    return arch.get_architecture(arch.TabPFNV3Config(
        max_num_classes=4, embed_dim=32, dist_embed_num_blocks=1, dist_embed_num_heads=2, dist_embed_num_inducing_points=8, feat_agg_num_blocks=1,
        feat_agg_num_heads=2, nlayers=2, icl_num_heads=2, decoder_head_dim=16, decoder_num_heads=2))  # fmt: skip


def _tabpfn_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(12, 2, 6, generator=gen), "y": torch.randint(0, 4, (8, 2), generator=gen).float()}  # rows first, 8 labelled


def _kan_gpt(implementation: str) -> Model:
    """KAN-GPT (AdityaNG/kan-gpt): minGPT whose MLPs and head are Kolmogorov-Arnold layers, B-spline bases of each input
    feature read by a ``[out, in * bases]`` weight (``EFFICIENT_KAN``) or pykan's per-edge splines (``ORIGINAL_KAN``);
    its forward returns (logits, the loss of the targets)."""

    def build() -> torch.nn.Module:
        gpt = importlib.import_module("kan_gpt.model").GPT
        config = gpt.get_default_config()
        config.merge_from_dict(dict(model_type=None, n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, block_size=SEQ, embd_pdrop=0.0,
                                    resid_pdrop=0.0, attn_pdrop=0.0, kan_implementation=implementation))  # fmt: skip
        model = gpt(config)
        # the splines' coefficients come from a least-squares fit of noise whose last bits differ between processes (autotp
        # refuses ranks that built different models): drawn again, at the fit's scale
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("spline_weight", ".coef")):
                    p.copy_(torch.randn_like(p) * float(f"{p.std().item():.1g}"))
        return model

    def inputs() -> dict[str, Any]:
        ids = _tokens("idx")()["idx"]
        return {"idx": ids, "targets": ids.roll(-1, dims=1)}

    return build, inputs, lambda out: out[1]


def _olmo(**kwargs: Any) -> Model:
    """AI2's OLMo (the ``ai2-olmo`` package, OLMo 1 and 2's training code): fused q/k/v and SwiGLU projections split by
    sizes and ``chunk``, its own RoPE and norms; options for q/k norms over all heads, norms after the blocks, ALiBi, QKV
    clipping, multi-query attention and blocks grouped in lists of lists."""

    def build() -> torch.nn.Module:
        config = importlib.import_module("olmo.config")
        sizes = dict(d_model=64, n_heads=4, n_layers=2, mlp_ratio=4, vocab_size=VOCAB, embedding_size=VOCAB, max_sequence_length=SEQ,
                     init_device="cpu", flash_attention=False, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0)
        return importlib.import_module("olmo.model").OLMo(config.ModelConfig(**(sizes | kwargs)))

    return build, _tokens("input_ids"), lambda out: lm_loss(out.logits)


class _UnitScaledLoss(torch.nn.Module):
    """A training step as unit_scaling's docs write it: the decoder's own ``loss``, a unit-scaled cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = _call("unit_scaling.TransformerDecoder", hidden_size=64, vocab_size=VOCAB, layers=2, heads=4)()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.loss(input_ids)
def _musicgen() -> torch.nn.Module:
    """audiocraft's MusicGen language model: 4 codebooks in the delay pattern, cross-attention to given condition tensors."""
    conditioners = importlib.import_module("audiocraft.modules.conditioners")
    patterns = importlib.import_module("audiocraft.modules.codebooks_patterns")
    fuser = conditioners.ConditionFuser({"cross": ["description"], "prepend": [], "sum": [], "input_interpolate": []})
    return importlib.import_module("audiocraft.models.lm").LMModel(
        patterns.DelayedPatternProvider(n_q=4), conditioners.ConditioningProvider({}), fuser, n_q=4, card=VOCAB, dim=64, num_heads=4,
        num_layers=2, hidden_scale=2, cross_attention=True, causal=True, norm_first=True)  # fmt: skip


def _musicgen_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"sequence": torch.randint(0, VOCAB, (2, 4, SEQ), generator=gen), "conditions": [],
            "condition_tensors": {"description": (torch.randn(2, 6, 64, generator=gen), torch.ones(2, 6, dtype=torch.long))}}  # fmt: skip


def _codebooks_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``[B, K, S, card]`` logits against each codebook step's target, whatever the rows."""
    b, k, s, card = logits.shape
    target = ((torch.arange(k * s) * 7 + 3) % card).view(k, s).expand(b, k, s)
    return F.cross_entropy(logits.flatten(0, 2), target.flatten())


def _chronos(module: str, name: str, config: str, **chronos: Any) -> Callable[[], torch.nn.Module]:
    """Amazon's Chronos-Bolt (a T5 over patches) or Chronos-2 (group attention across the batch) from a small config."""

    def build() -> torch.nn.Module:
        *path, cls = config.rsplit(".", 1)
        cfg = getattr(importlib.import_module(path[0]), cls)(
            d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
            initializer_factor=0.05,  # the released models' (T5's 1.0 gives logits whose fp32 rounding fails the rule at tp=2)
            chronos_config=dict(context_length=32, input_patch_size=4, input_patch_stride=4, quantiles=[0.1, 0.5, 0.9], use_reg_token=True,
                                **chronos))  # fmt: skip
        return getattr(importlib.import_module(module), name)(cfg)

    return build


def _series(target: str, **extra: Any) -> Callable[[], dict[str, Any]]:
    """32 points of a random walk as the context, its next 8 as ``target``."""

    def make() -> dict[str, Any]:
        walk = torch.randn(2, 40, generator=torch.Generator().manual_seed(1)).cumsum(-1)
        return {"context": walk[:, :32], target: walk[:, 32:]} | extra

    return make


def _moirai2_inputs() -> dict[str, Any]:
    gen, n = torch.Generator().manual_seed(1), 12
    return {"target": torch.randn(2, n, 4, generator=gen), "observed_mask": torch.ones(2, n, 4, dtype=torch.bool),
            "sample_id": torch.ones(2, n, dtype=torch.long), "time_id": torch.arange(n).expand(2, n),
            "variate_id": torch.zeros(2, n, dtype=torch.long), "prediction_mask": torch.arange(n).expand(2, n) >= 9}  # fmt: skip


def _moirai2_loss(out: Any) -> torch.Tensor:
    preds, target = out
    return (preds - target.repeat(1, 1, preds.shape[-1] // target.shape[-1])).square().mean()


def _stable_audio_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 8, SEQ, generator=gen), "t": torch.tensor([0.3, 0.7]), "cross_attn_cond": torch.randn(2, 6, 32, generator=gen),
            "global_embed": torch.randn(2, 32, generator=gen)}  # fmt: skip


def _text_image_loss() -> dict[str, Any]:
    return {"text": _tokens("t")()["t"], "image": _images("i")()["i"], "return_loss": True}


def _built_before_process_group(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """``build`` as before ``init_process_group``: x-clip's CLIP chooses when built to gather its batch over the ranks."""

    def before() -> torch.nn.Module:
        from autotp.analysis.trace_guards import one_process_view

        with one_process_view():
            return build()

    return before


X_CLIP = dict(dim_text=64, dim_image=64, dim_latent=32, num_text_tokens=VOCAB, text_enc_depth=2, text_seq_len=SEQ, text_heads=4, text_dim_head=16,
              visual_enc_depth=2, visual_image_size=IMAGE, visual_patch_size=8, visual_heads=4, visual_dim_head=16, visual_patch_dropout=0.0)


def _dalle() -> torch.nn.Module:
    vae = _call("dalle_pytorch.DiscreteVAE", image_size=IMAGE, num_layers=2, num_tokens=64, codebook_dim=32, hidden_dim=16)()
    return _call("dalle_pytorch.DALLE", dim=64, vae=vae, num_text_tokens=VOCAB, text_seq_len=SEQ, depth=2, heads=4, dim_head=16)()


def _retro_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)  # 2 chunks of 8 tokens, 2 neighbours of 16 each
    return {"seq": torch.randint(1, VOCAB, (2, 17), generator=gen), "retrieved": torch.randint(1, VOCAB, (2, 2, 2, 16), generator=gen),
            "return_loss": True}  # fmt: skip


class _KDiffusionLoss(torch.nn.Module):
    """k-diffusion's HDiT (image_transformer_v2, global attention at every level: NATTEN's neighbourhood attention is a
    CUDA extension) in its Karras preconditioner, returning the per-image losses as its trainer does (``model.loss``)."""

    def __init__(self) -> None:
        super().__init__()
        hdit = importlib.import_module("k_diffusion.models.image_transformer_v2")
        levels = [hdit.LevelSpec(depth=1, width=32, d_ff=64, self_attn=hdit.GlobalAttentionSpec(d_head=16), dropout=0.0),
                  hdit.LevelSpec(depth=2, width=64, d_ff=128, self_attn=hdit.GlobalAttentionSpec(d_head=16), dropout=0.0)]  # fmt: skip
        inner = hdit.ImageTransformerDenoiserModelV2(levels=levels, mapping=hdit.MappingSpec(depth=1, width=64, d_ff=128, dropout=0.0),
                                                     in_channels=3, out_channels=3, patch_size=(2, 2), num_classes=4)  # fmt: skip
        self.denoiser = importlib.import_module("k_diffusion.layers").Denoiser(_reinit_zeros(inner), sigma_data=0.5)

    def forward(self, reals: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, class_cond: torch.Tensor) -> torch.Tensor:
        return self.denoiser.loss(reals, noise, sigma, class_cond=class_cond)


def _k_diffusion_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"reals": torch.randn(2, 3, 16, 16, generator=gen), "noise": torch.randn(2, 3, 16, 16, generator=gen),
            "sigma": torch.tensor([0.4, 2.0]), "class_cond": torch.tensor([1, 3])}  # fmt: skip


def _muse_maskgit() -> torch.nn.Module:
    """MUSE's MaskGitTransformer; its T5 text encoder's config is put in the library's own cache of configs (the model
    reads only ``d_model`` at build time, and is given the encoded texts)."""
    importlib.import_module("muse_maskgit_pytorch.t5").T5_CONFIGS["t5-tiny"] = {"config": importlib.import_module("transformers").T5Config(d_model=32)}
    return importlib.import_module("muse_maskgit_pytorch").MaskGitTransformer(num_tokens=VOCAB, seq_len=SEQ, dim=64, depth=2, dim_head=16, heads=4,
                                                                               t5_name="t5-tiny")  # fmt: skip


def _muse_inputs() -> dict[str, Any]:
    """As MaskGit trains: a random subset of the image tokens replaced by the mask id, the loss on those alone."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    masked = torch.rand(2, SEQ, generator=gen) < 0.5
    return {"x": ids.masked_fill(masked, VOCAB), "labels": ids.masked_fill(~masked, -1), "ignore_index": -1,
            "text_embeds": torch.randn(2, 6, 32, generator=gen)}  # fmt: skip


def _meshgpt() -> torch.nn.Module:
    """MeshGPT's MeshTransformer on the codes of a small (frozen, as it trains) MeshAutoencoder."""
    meshgpt = importlib.import_module("meshgpt_pytorch")
    autoencoder = meshgpt.MeshAutoencoder(num_discrete_coors=32, encoder_dims_through_depth=(32, 32), decoder_dims_through_depth=(32, 32),
                                          dim_codebook=32, codebook_size=64, num_quantizers=2, attn_encoder_depth=0, attn_decoder_depth=0,
                                          dim_coor_embed=16, dim_area_embed=8, dim_normal_embed=16, dim_angle_embed=8)  # fmt: skip
    return meshgpt.MeshTransformer(autoencoder, dim=64, max_seq_len=48, flash_attn=False, attn_depth=2, attn_dim_head=16, attn_heads=4,
                                   fine_attn_depth=1, fine_attn_dim_head=16, fine_attn_heads=4, coarse_pre_gateloop_depth=0,
                                   fine_pre_gateloop_depth=0)  # fmt: skip


IMAGE_TEXT = dict(hidden_states="image", encoder_hidden_states="text", timestep="step")
VIDEO_TEXT = dict(hidden_states="video", encoder_hidden_states="text", timestep="step")
FLUX = dict(hidden_states="tokens", encoder_hidden_states="text", timestep="flow", img_ids="ids3", txt_ids="txt_ids3")
class _Method(torch.nn.Module):
    """A library's module trained through one of its methods (gluonts' ``loss``), or through its output head applied
    after ``forward`` (OpenNMT's generator, applied by its loss): ``method`` is the method's name, or ``head`` the
    attribute of the head."""

    def __init__(self, build: Callable[[], torch.nn.Module], method: str = "forward", head: str = "") -> None:
        super().__init__()
        self.model, self.method, self.head = build(), method, head

    def forward(self, **inputs: Any) -> Any:
        out = getattr(self.model, self.method)(**inputs)
        return getattr(self.model, self.head)(_first(out)) if self.head else out


def _onmt(**options: Any) -> Model:
    """OpenNMT-py's model from its own option parser's defaults and ``options`` (a 64-wide, 2-layer transformer by
    default), initialized as its trainer does (uniform in +-param_init); the generator applied to the decoder output as
    its loss does; token ids with one feature, as its batches carry them."""

    def build() -> torch.nn.Module:
        opts, parse = importlib.import_module("onmt.opts"), importlib.import_module("onmt.utils.parse")
        parser = parse.ArgumentParser()
        opts.train_opts(parser)
        opt = parser.parse_known_args(["-data", "none", "-src_vocab", "none"])[0]
        defaults = dict(encoder_type="transformer", decoder_type="transformer", layers=2, hidden_size=64, word_vec_size=64, heads=4,
                        transformer_ff=128, position_encoding=True, dropout=[0.0], attention_dropout=[0.0])  # fmt: skip
        for key, value in (defaults | options).items():
            setattr(opt, key, value)
        parse.ArgumentParser.update_model_opts(opt)
        parse.ArgumentParser.validate_model_opts(opt)
        vocabs = {"src": _Vocab(), "tgt": _Vocab(), "data_task": opt.model_task}
        model = importlib.import_module("onmt.model_builder").build_base_model(opt, vocabs)
        for p in model.parameters():
            torch.nn.init.uniform_(p, -opt.param_init, opt.param_init)
        return model

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        src = torch.randint(4, VOCAB, (2, SEQ, 1), generator=gen)
        return {"src": src, "tgt": torch.randint(4, VOCAB, (2, SEQ + 1, 1), generator=gen), "src_len": torch.tensor([SEQ, SEQ - 3])}

    return (lambda: _Method(build, head="generator")), inputs, lm_loss


class _Vocab:
    """What OpenNMT's model builder reads of a vocabulary: its length, and the id of its padding token."""

    def __len__(self) -> int:
        return VOCAB

    def __getitem__(self, token: str) -> int:
        return 1


def _neuralforecast(name: str, multivariate: bool = False, exog: bool = False, **kwargs: Any) -> Model:
    """Nixtla's neuralforecast ``name`` (its Lightning model itself) on a window as its training step cuts one: 32
    points of context, a horizon of 8 (4 series for a multivariate model; for ``exog``, 2 future-known, 1 past and
    1 static feature), with its default loss, MAE, against the horizon."""
    series = 4 if multivariate else 1
    extra = dict(futr_exog_list=["f0", "f1"], hist_exog_list=["h0"], stat_exog_list=["s0"]) if exog else {}

    def build() -> torch.nn.Module:
        model = getattr(importlib.import_module("neuralforecast.models"), name)(h=8, input_size=32, **extra, **kwargs,
                                                                                 **({"n_series": series} if multivariate else {}))
        return model

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        batch = {"insample_y": torch.randn(2, 32, series, generator=gen), "insample_mask": torch.ones(2, 32, series),
                 "futr_exog": torch.randn(2, 40, 2, generator=gen) if exog else None,
                 "hist_exog": torch.randn(2, 32, 1, generator=gen) if exog else None,
                 "stat_exog": torch.randn(2, 1, generator=gen) if exog else None}  # fmt: skip
        return {"windows_batch": batch}

    return build, inputs, _horizon_mae


def _horizon_mae(out: Any) -> torch.Tensor:
    """MAE against a target each row shares (a ramp over the horizon and the series), whatever the rows."""
    forecast = _first(out)
    return (forecast - torch.linspace(-1, 1, forecast[0].numel()).reshape(forecast.shape[1:])).abs().mean()


def _gluonts(module: str, features: dict[str, tuple[int, ...]] | None = None, context: int = 32, variates: tuple[int, ...] = (),
             **kwargs: Any) -> Model:
    """gluonts' torch model ``module`` (``<package>.module.<class>``), trained through its own ``loss`` (a StudentT's
    negative log-likelihood, or quantile loss) on 32 points of past (``context`` of them the context; a lagged
    model reads lags from the rest) and a horizon of 8, of one series or of ``variates``; the mean of the per-item
    losses, as its Lightning module weighs them. ``features``: the shapes of the further inputs it takes (static
    categorical ones, named ``*_cat``, all zeros)."""
    path = f"gluonts.torch.model.{module}"

    def inputs() -> dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        walk = torch.randn(2, 40, *variates, generator=gen).cumsum(1)
        extra = {k: torch.zeros(s, dtype=torch.long) if k.endswith("_cat") else torch.randn(s, generator=gen) for k, s in (features or {}).items()}
        return {"past_target": walk[:, :32], "past_observed_values": torch.ones(2, 32, *variates), "future_target": walk[:, 32:],
                "future_observed_values": torch.ones(2, 8, *variates)} | extra  # fmt: skip

    return (lambda: _Method(_call(path, prediction_length=8, context_length=context, **kwargs), method="loss")), inputs, _mean


def _mean(out: Any) -> torch.Tensor:
    return _first(out).mean()


def _rtdl_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"x_cont": torch.randn(2, 4, generator=gen), "x_cat": torch.randint(0, 5, (2, 3), generator=gen)}


def _tabm_inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    return {"x_num": torch.randn(2, 4, generator=gen), "x_cat": torch.randint(0, 5, (2, 3), generator=gen)}


def _tabm_loss(out: Any) -> torch.Tensor:
    """TabM's loss: each of its k submodels' prediction against the label, the mean over the batch and the k."""
    logits = _first(out)
    return F.cross_entropy(logits.flatten(0, 1), torch.full((logits.shape[0] * logits.shape[1],), 2))


def _tabm(**kwargs: Any) -> Callable[[], torch.nn.Module]:
    return lambda: importlib.import_module("tabm").TabM.make(n_num_features=4, cat_cardinalities=[5, 5, 5], d_out=3, k=4, n_blocks=2,
                                                               d_block=64, dropout=0.0, **kwargs)  # fmt: skip


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
    **{f"timm_{n}": _timm(n) for n in ("resnet18", "efficientnet_b0", "mobilenetv3_small_100", "regnetx_002", "resnext26ts",
                                       "regnety_002")},  # fmt: skip
    **{f"timm_{n}": _timm(n, size=64) for n in ("mobilevit_xxs", "efficientvit_b0", "fastvit_t8", "edgenext_xx_small", "repvit_m0_9")},
    **{f"timm_{n}": _timm(n, size=64, img_size=64) for n in ("levit_128s", "coat_lite_tiny", "efficientformerv2_s0")},
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
    "vit_pytorch_levit": _vit_pytorch("levit.LeViT", image_size=IMAGE, num_classes=8, dim=(32, 64, 64), depth=1, heads=(2, 4, 4),
                                      mlp_mult=2, stages=3, dim_key=16, dim_value=16),  # fmt: skip
    "vit_pytorch_pit": _vit_pytorch("pit.PiT", image_size=IMAGE, patch_size=8, num_classes=8, dim=32, depth=(1, 1), heads=4, mlp_dim=64, dim_head=8),
    "vit_pytorch_vivit": _vit_pytorch("vivit.ViViT", key="video", input_frames=4, image_size=IMAGE, image_patch_size=8, frames=4,
                                      frame_patch_size=2, num_classes=8, dim=64, spatial_depth=1, temporal_depth=1, heads=4, mlp_dim=128,
                                      dim_head=16, use_flash_attn=False),  # fmt: skip
    "vit_pytorch_nest": _vit_pytorch("nest.NesT", image_size=IMAGE, patch_size=4, num_classes=8, dim=32, heads=4, num_hierarchies=2,
                                     block_repeats=(1, 1), dim_head=8),  # fmt: skip
    "vit_pytorch_t2t": _vit_pytorch("t2t.T2TViT", image_size=IMAGE, num_classes=8, dim=64, depth=2, heads=4, mlp_dim=128, dim_head=16,
                                    t2t_layers=((7, 4), (3, 2))),  # fmt: skip
    "vit_pytorch_cvt": _vit_pytorch("cvt.CvT", key="x", num_classes=8, s1_emb_dim=16, s2_emb_dim=32, s2_heads=2, s2_depth=1, s3_emb_dim=64,
                                    s3_heads=4, s3_depth=1),  # fmt: skip
    "vit_pytorch_rvt": _vit_pytorch("rvt.RvT", **VP),
    "vit_pytorch_scalable_vit": _vit_pytorch("scalable_vit.ScalableViT", num_classes=8, dim=16, depth=(1, 1, 1, 1), heads=(1, 2, 4, 4),
                                             reduction_factor=(4, 2, 1, 1), window_size=(2, 2, None, None), iwsa_dim_key=8,
                                             iwsa_dim_value=8, ssa_dim_key=8, ssa_dim_value=8),  # fmt: skip
    "vit_pytorch_look_vit": _vit_pytorch("look_vit.LookViT", dim=64, image_size=IMAGE, num_classes=8, depth=2, patch_size=8, heads=4,
                                         dim_head=16, highres_patch_size=4, cross_attn_heads=4, cross_attn_dim_head=16,
                                         patch_conv_kernel_size=3, dropout=0.0),  # fmt: skip
    "vit_pytorch_normalized_vit": _vit_pytorch("normalized_vit.nViT", key="images", **VP),
    "vit_pytorch_parallel_vit": _vit_pytorch("parallel_vit.ViT", **VP),
    "vit_pytorch_register_tokens": _vit_pytorch("simple_vit_with_register_tokens.SimpleViT", **VP),
    "vit_pytorch_qk_norm": _vit_pytorch("simple_vit_with_qk_norm.SimpleViT", **VP),
    "vit_pytorch_patch_merger": _vit_pytorch("vit_with_patch_merger.ViT", **VP, patch_merge_layer=1, patch_merge_num_tokens=4),
    "vit_pytorch_fft": _vit_pytorch("simple_vit_with_fft.SimpleViT", **VP, freq_patch_size=8),
    # its feed-forwards take an expansion factor where the other ViTs take a width
    "vit_pytorch_jumbo": _vit_pytorch("jumbo_vit.JumboViT", **(VP | dict(mlp_dim=2)), num_jumbo_cls=1, jumbo_cls_k=2, jumbo_ff_mult=1 / 64),
    "vit_pytorch_vit_5": _vit_pytorch("vit_5.ViT", **VP),
    "vit_pytorch_hyper_connections": _vit_pytorch("simple_vit_with_hyper_connections.SimpleViT", **VP, num_residual_streams=2),
    "vit_pytorch_value_residual": _vit_pytorch("simple_vit_with_value_residual.SimpleViT", **VP),
    "vit_pytorch_looped": _vit_pytorch("looped_vit.LoopedViT", key="x", num_classes=8, dim=64, image_size=IMAGE, patch_size=8,
                                       pre_loop_depth=1, num_looped_blocks=2, post_loop_depth=1, loop_depth=1, heads=4, dim_head=16,
                                       mlp_dim=128),  # fmt: skip
    "x_transformers_plain": _x_transformers(),
    "x_transformers_rotary_glu_qk_norm": _x_transformers(rotary_pos_emb=True, ff_glu=True, attn_qk_norm=True),
    "x_transformers_alibi_memory_kv": _x_transformers(alibi_pos_bias=True, attn_num_mem_kv=2),
    "x_transformers_relative_bias": _x_transformers(rel_pos_bias=True),
    "x_transformers_macaron_sandwich_shift": _x_transformers(macaron=True, sandwich_norm=True, shift_tokens=1),
    "x_transformers_gqa_gated": _x_transformers(attn_kv_heads=2, gate_residual=True, attn_gate_values=True),
    "x_transformers_residual_attn_rmsnorm": _x_transformers(residual_attn=True, ff_swish=True, use_rmsnorm=True),
    "x_transformers_dynamic_pos_head_scale": _x_transformers(dynamic_pos_bias=True, attn_head_scale=True, ff_post_act_ln=True),
    "x_transformers_talking_heads_topk": _x_transformers(attn_pre_talking_heads=True, attn_post_talking_heads=True, attn_sparse_topk=4),
    "x_transformers_one_kv_head_xpos": _x_transformers(attn_one_kv_head=True, rotary_pos_emb=True, rotary_xpos=True),
    "x_transformers_latent_qkv": _x_transformers(attn_use_latent_q=True, attn_dim_latent_q=32, attn_use_latent_kv=True, attn_dim_latent_kv=32),
    "x_transformers_cope_softclamp": _x_transformers(attn_use_cope=True, attn_softclamp_logits=True),
    "x_transformers_value_residual_laser": _x_transformers(add_value_residual=True, attn_laser=True),
    "x_transformers_data_dependent_alibi": _x_transformers(attn_data_dependent_alibi=True),
    "x_transformers_grouped_qk_norm_swiglu_values": _x_transformers(attn_qk_norm=True, attn_qk_norm_groups=2, attn_swiglu_values=True,
                                                                     ff_relu_squared=True),  # fmt: skip
    "x_transformers_output_gates_simple_rmsnorm": _x_transformers(attn_output_gate=True, attn_gate_value_heads=True, use_simple_rmsnorm=True),
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
    "diffusers_unet2d_condition": _diffusers("UNet2DConditionModel", dict(sample="image", timestep="step", encoder_hidden_states="text"),
                                             sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                                             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D",
                                             "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8),  # fmt: skip
    "diffusers_unet2d": _diffusers("UNet2DModel", dict(sample="image", timestep="step"), sample_size=8, in_channels=4, out_channels=4,
                                   layers_per_block=1, block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                   up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8),  # fmt: skip
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
    "nanochat_gpt": (_nanochat, _tokens("idx"), lm_loss),
    "olmo_core_olmo2": _olmo_core("llama_like", d_model=64, n_layers=2, n_heads=4, block_name="reordered_norm", qk_norm=True,
                                  attn_backend="torch"),
    "olmo_core_gemma3": _olmo_core("gemma3_like", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_size=128, head_dim=16,
                                   local_window_size=8, global_layer_interval=2, attn_backend="torch"),  # fmt: skip
    "olmo_core_ngpt": _olmo_core("ngpt_like", d_model=64, n_layers=2, n_heads=4, hidden_size_multiple_of=16),
    "whisper_model": (_whisper, _whisper_inputs, lm_loss),
    "segment_anything_training": (_SamTraining, _sam_inputs, sample_loss),
    "clip_vit": _clip(vision_layers=2),
    "clip_resnet": _clip(vision_layers=(1, 1, 1, 1), vision_width=4),
    "dinov2_masked": (_Dinov2Features, _dinov2_inputs, sample_loss),
    "dit_class_conditional": (_dit, _dit_inputs, sample_loss),
    "nanogpt_model": _nanogpt(),
    "lingua_lm": _lingua(),
    "guided_diffusion_unet": (_guided_diffusion, _guided_diffusion_inputs, sample_loss),
    "ijepa_context": (_IJepaContext, _ijepa_inputs, sample_loss),
    "palm_pytorch": (_call("palm_pytorch.PaLM", dim=64, num_tokens=VOCAB, depth=2, dim_head=16, heads=4), _tokens("input"), lm_loss),
    "MEGABYTE_pytorch": _own_loss("MEGABYTE_pytorch.MEGABYTE", key="ids", num_tokens=VOCAB, dim=(64, 32), depth=(2, 1),
                                  max_seq_len=(4, 4), dim_head=16, heads=4),  # fmt: skip
    "simple_hierarchical_transformer": _own_loss("simple_hierarchical_transformer.HierarchicalTransformer", key="ids",
                                                 num_tokens=VOCAB, dim=64, depth=2, seq_len=SEQ, hierarchies=(1, 2),
                                                 window_sizes=(8, 4), dim_head=16, heads=4),  # fmt: skip
    "recurrent_memory_transformer_pytorch": (_call("recurrent_memory_transformer_pytorch.RecurrentMemoryTransformer", num_tokens=VOCAB,
                                             num_memory_tokens=4, dim=64, depth=2, seq_len=SEQ, causal=True, dim_head=16, heads=4),
                                             _tokens("x"), lm_loss),  # fmt: skip
    "block_recurrent_transformer_pytorch": (_call("block_recurrent_transformer_pytorch.BlockRecurrentTransformer", num_tokens=VOCAB, dim=64,
                                            depth=2, dim_head=16, heads=4, max_seq_len=SEQ, block_width=8, num_state_vectors=8,
                                            recurrent_layers=(2,)), _tokens("x"), lm_loss),  # fmt: skip
    "soft_moe_pytorch": _layers_lm("soft_moe_pytorch.SoftMoE", dim=64, seq_len=SEQ, num_experts=4, is_distributed=False,
                                   offload_unused_experts_to_cpu=False),  # fmt: skip
    "st_moe_pytorch": _layers_lm("st_moe_pytorch.MoE", dim=64, num_experts=4, gating_top_n=2, is_distributed=False),
    "mixture_of_experts": _layers_lm("mixture_of_experts.MoE", dim=64, num_experts=4, hidden_dim=128),
    "gateloop_transformer": (_call("gateloop_transformer.Transformer", dim=64, num_tokens=VOCAB, depth=2, dim_head=16, heads=4,
                                   checkpoint_gate_looped_attn=False), _tokens("x"), lm_loss),  # fmt: skip
    "mega_pytorch": (_call("mega_pytorch.Mega", dim=64, num_tokens=VOCAB, depth=2), _tokens("x"), lm_loss),
    "perceiver_pytorch": (_call("perceiver_pytorch.PerceiverLM", dim=64, num_tokens=VOCAB, max_seq_len=SEQ, depth=2, num_latents=8,
                                latent_dim=64, cross_heads=1, latent_heads=4, cross_dim_head=16, latent_dim_head=16),
                          _tokens("x"), lm_loss),  # fmt: skip
    "h_transformer_1d": (_call("h_transformer_1d.HTransformer1D", num_tokens=VOCAB, dim=64, depth=2, max_seq_len=SEQ, causal=True, heads=4,
                               dim_head=16, block_size=4), _tokens("x"), lm_loss),  # fmt: skip
    "local_attention": (_call("local_attention.LocalTransformer", num_tokens=VOCAB, max_seq_len=SEQ, dim=64, depth=2, local_attn_window_size=4,
                              dim_head=16, heads=4), _tokens("x"), lm_loss),  # fmt: skip
    "conformer": _layers_lm("conformer.ConformerBlock", dim=64, dim_head=16, heads=4, conv_kernel_size=7),
    "nystrom_attention": _layers_lm("nystrom_attention.NystromAttention", dim=64, dim_head=16, heads=4, num_landmarks=4,
                                    residual_conv_kernel=3),  # fmt: skip
    "bs_roformer": (_call("bs_roformer.BSRoformer", **_BAND_SPLIT), _audio, _first),
    "bs_roformer_pope": (_call("bs_roformer.BSRoformer", **_BAND_SPLIT, use_pope=True), _audio, _first),
    "mixture_of_attention": (_call("mixture_of_attention.transformer.Transformer", dim=64, num_tokens=VOCAB, depth=2, seq_len=SEQ,
                                   local_attn_window_size=4, num_routed_queries=2, num_routed_key_values=4, num_experts=2, dim_head=16,
                                   heads=4, use_triton=False), _tokens("x"), lm_loss),  # fmt: skip
    "tab_transformer": (_call("tab_transformer_pytorch.TabTransformer", categories=(5,) * 5, num_continuous=4, dim=32, depth=2, heads=4,
                              dim_out=3, mlp_act=torch.nn.ReLU()), _tabular("x_cont"), sample_loss),  # fmt: skip
    "ft_transformer": (_call("tab_transformer_pytorch.FTTransformer", categories=(5,) * 5, num_continuous=4, dim=32, depth=2, heads=4,
                             dim_out=3), _tabular("x_numer"), sample_loss),  # fmt: skip
    "mambapy": (_mambapy, _tokens("tokens"), lm_loss),
    "performer_pytorch": (_call("performer_pytorch.PerformerLM", num_tokens=VOCAB, max_seq_len=SEQ, dim=64, depth=2, heads=4, dim_head=16,
                                causal=True, nb_features=16), _tokens("x"), lm_loss),  # fmt: skip
    "linformer": (_call("linformer.LinformerLM", num_tokens=VOCAB, dim=64, seq_len=SEQ, depth=2, heads=4, k=8), _tokens("x"), lm_loss),
    "g_mlp_pytorch": (_call("g_mlp_pytorch.gMLP", num_tokens=VOCAB, dim=64, depth=2, seq_len=SEQ, causal=True), _tokens("x"), lm_loss),
    "enformer_pytorch": (_enformer, _dna, _human),
    "reformer_pytorch": (_call("reformer_pytorch.ReformerLM", num_tokens=VOCAB, dim=64, depth=2, max_seq_len=SEQ, heads=4, bucket_size=4,
                               causal=True), _tokens("x"), lm_loss),  # fmt: skip
    "linear_attention_transformer": (_call("linear_attention_transformer.LinearAttentionTransformerLM", num_tokens=VOCAB, dim=64, heads=4,
                                           depth=2, max_seq_len=SEQ, causal=True), _tokens("x"), lm_loss),  # fmt: skip
    "denoising_diffusion_pytorch": (_call("denoising_diffusion_pytorch.Unet", dim=16, dim_mults=(1, 2), channels=3, attn_dim_head=8,
                                          attn_heads=2), _noised_images([3, 7]), sample_loss),  # fmt: skip
    "sinkhorn_transformer": (_call("sinkhorn_transformer.SinkhornTransformerLM", num_tokens=VOCAB, dim=64, heads=4, depth=2, max_seq_len=SEQ,
                                   bucket_size=4, causal=True), _tokens("x"), lm_loss),  # fmt: skip
    "memory_efficient_attention_pytorch": _layers_lm("memory_efficient_attention_pytorch.Attention", dim=64, dim_head=16, heads=4, causal=True,
                                                     memory_efficient=True, q_bucket_size=4, k_bucket_size=4),  # fmt: skip
    "iTransformer": (_call("iTransformer.iTransformer", num_variates=8, lookback_len=SEQ, dim=64, depth=2, heads=4, dim_head=16,
                           pred_length=(4,)), _variates, _squares),  # fmt: skip
    "hourglass_transformer_pytorch": (_call("hourglass_transformer_pytorch.HourglassTransformerLM", num_tokens=VOCAB, dim=64, max_seq_len=SEQ,
                                            depth=(2, 2, 2), shorten_factor=2, heads=4, dim_head=16), _tokens("x"), lm_loss),  # fmt: skip
    "coca_pytorch": (_call("coca_pytorch.CoCa", dim=64, num_tokens=VOCAB, unimodal_depth=1, multimodal_depth=1, dim_head=16, heads=4,
                           img_encoder=None, image_dim=32), _captioned_images, _first),  # fmt: skip
    "mmdit": (_call("mmdit.mmdit_generalized_pytorch.MMDiT", depth=2, dim_modalities=(64, 32), dim_cond=16, qk_rmsnorm=True), _two_modalities,
              _squares),  # fmt: skip
    "vector_quantize_pytorch": _layers_lm("vector_quantize_pytorch.VectorQuantize", dim=64, codebook_size=32, decay=0.8, commitment_weight=1.0),
    "compressive_transformer_pytorch": (_call("compressive_transformer_pytorch.CompressiveTransformer", num_tokens=VOCAB, dim=64, depth=2,
                                              seq_len=SEQ, mem_len=SEQ, cmem_len=4, cmem_ratio=4, heads=4), _tokens("x"), lm_loss),  # fmt: skip
    "native_sparse_attention_pytorch": _layers_lm("native_sparse_attention_pytorch.SparseAttention", dim=64, dim_head=16, heads=4,
                                                  sliding_window_size=4, compress_block_size=4, compress_block_sliding_stride=4,
                                                  selection_block_size=4, num_selected_blocks=2),  # fmt: skip
    "rin_pytorch": (_call("rin_pytorch.RIN", dim=64, image_size=16, patch_size=4, depth=2, num_latents=8, dim_latent=64, latent_self_attn_depth=1),
                    _noised_images([0.3, 0.7]), sample_loss),  # fmt: skip
    "torchscale_retnet": _torchscale("retnet.RetNetDecoder", "RetNetConfig", decoder_retention_heads=4, decoder_value_embed_dim=128),
    "torchscale_decoder_xpos": _torchscale("decoder.Decoder", "DecoderConfig", decoder_attention_heads=4, xpos_rel_pos=True,
                                           rel_pos_buckets=32, max_rel_pos=64),  # fmt: skip
    "xlstm": (_xlstm, _tokens("idx"), lm_loss),
    "colt5_attention": _layers_lm("colt5_attention.ConditionalRoutedTransformerBlock", dim=64, num_heavy_attn_tokens_q=8,
                                  num_heavy_attn_tokens_kv=8, num_heavy_ff_tokens=8, light_dim_head=16, light_heads=4, light_window_size=4,
                                  heavy_dim_head=16, heavy_heads=4),  # fmt: skip
    "torchtitan_llama3": _torchtitan("llama3", "Transformer", "TransformerModelArgs", n_kv_heads=2, multiple_of=32),
    "torchtitan_qwen3": _torchtitan("qwen3", "Qwen3Model", "Qwen3ModelArgs", n_kv_heads=2, head_dim=16, qk_norm=True, hidden_dim=128,
                                    enable_weight_tying=True),  # fmt: skip
    "torchtitan_deepseek_v3_mla": _torchtitan("deepseek_v3", "DeepSeekV3Model", "DeepSeekV3ModelArgs", inter_dim=128, n_dense_layers=2,
                                              kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),  # fmt: skip
    "esm": _esm2(),
    "hiera": (_call("hiera.Hiera", num_classes=8, input_size=(64, 64), embed_dim=32, num_heads=1, stages=(1, 1, 2, 1), q_pool=2),
              _images("x", size=64), class_loss),  # fmt: skip
    "transformer_lens_gelu_ln": _hooked_transformer(act_fn="gelu", normalization_type="LN"),
    "transformer_lens_rotary_gqa_rms": _hooked_transformer(act_fn="silu", normalization_type="RMS", gated_mlp=True,
                                                           positional_embedding_type="rotary", n_key_value_heads=2),  # fmt: skip
    "open_clip_clip": _open_clip({}, {}),
    "open_clip_custom_blocks": _open_clip(dict(qk_norm=True, scale_heads=True, scale_attn_inner=True, scale_fc=True),
                                          dict(qk_norm=True, scale_heads=True, scale_attn_inner=True, scale_fc=True)),  # fmt: skip
    "open_clip_coca": _open_clip(dict(attentional_pool=True, attn_pooler_queries=5, attn_pooler_heads=4, output_tokens=True),
                                 dict(embed_cls=True, output_tokens=True), captioner=True),  # fmt: skip
    "labml_nn_mha": _labml("mha.MultiHeadAttention", heads=4, d_model=64, dropout_prob=0.0),
    "labml_nn_rope_gated": _labml("rope.RotaryPEMultiHeadAttention", heads=4, d_model=64, dropout_prob=0.0, rope_percentage=0.5, gated=True),
    "labml_nn_alibi": _labml("alibi.AlibiMultiHeadAttention", heads=4, d_model=64, dropout_prob=0.0),
    "labml_nn_relative_xl": _labml("xl.relative_mha.RelativeMultiHeadAttention", heads=4, d_model=64, dropout_prob=0.0),
    "labml_nn_primer_ez": _labml("primer_ez.MultiDConvHeadAttention", heads=4, d_model=64, dropout_prob=0.0),
    "labml_nn_fnet": _labml("fnet.FNetMix", causal=False),
    "labml_nn_aft_local": _labml("aft.AFTLocal", d_model=64, seq_len=SEQ, local_window_size=4),
    "labml_nn_switch": _labml("mha.MultiHeadAttention", heads=4, d_model=64, dropout_prob=0.0, switch=True),
    "monai_vit": (_call("monai.networks.nets.ViT", in_channels=3, img_size=(16, 16), patch_size=(4, 4), hidden_size=64, mlp_dim=128,
                        num_layers=2, num_heads=4, classification=True, num_classes=8, spatial_dims=2), _images("x", size=16), class_loss),  # fmt: skip
    "monai_unetr": (_call("monai.networks.nets.UNETR", in_channels=1, out_channels=2, img_size=(16, 16), feature_size=8, hidden_size=64,
                          mlp_dim=128, num_heads=4, spatial_dims=2), _images("x_in", size=16, channels=1), sample_loss),  # fmt: skip
    "monai_swin_unetr": (_call("monai.networks.nets.SwinUNETR", in_channels=1, out_channels=2, feature_size=12, spatial_dims=2,
                               depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8)), _images("x_in", size=64, channels=1), sample_loss),  # fmt: skip
    # a forward that freezes the language model's parameters (``requires_grad_(False)``) whenever media are passed
    "flamingo_pytorch": (_call("flamingo_pytorch.FlamingoPaLM", dim=64, num_tokens=VOCAB, depth=2, dim_head=16, heads=4, cross_attn_every=1,
                               perceiver_num_latents=4, perceiver_depth=1, img_encoder=torch.nn.Identity()), _media_captions, lm_loss),  # fmt: skip
    "PEER_pytorch": _layers_lm("PEER_pytorch.PEER", dim=64, heads=4, num_experts=64, num_experts_per_head=4, dim_key=16, pre_rmsnorm=True),
    "flash_pytorch": (_call("flash_pytorch.FLASHTransformer", dim=64, num_tokens=VOCAB, depth=2, group_size=8, query_key_dim=32, causal=True),
                      _tokens("x"), lm_loss),  # fmt: skip
    "minGRU_pytorch": (_call("minGRU_pytorch.minLM.minLM", num_tokens=VOCAB, dim=64, depth=2, enable_conv=True), _tokens("x"), lm_loss),
    "minGRU_pytorch_lstm": (_call("minGRU_pytorch.minLM.minLM", num_tokens=VOCAB, dim=64, depth=2, use_lstm=True), _tokens("x"), lm_loss),
    "charformer_pytorch": (_call("charformer_pytorch.GBST", num_tokens=VOCAB, dim=64, max_block_size=4, downsample_factor=4), _tokens("x"),
                           _squares),  # fmt: skip
    "agent_attention_pytorch": (_call("agent_attention_pytorch.AgentTransformer", dim=64, num_agent_tokens=4, depth=2, heads=4, dim_head=16),
                                _vectors, _strided_squares),  # fmt: skip
    "gated_state_spaces_pytorch_gss": (_call("gated_state_spaces_pytorch.GatedStateSpacesLM", num_tokens=VOCAB, dim=64, depth=2,
                                             dss_kernel_N=32, dss_kernel_H=64), _tokens("x"), lm_loss),  # fmt: skip
    "gated_state_spaces_pytorch_dsconv": (_call("gated_state_spaces_pytorch.GatedDsConvLM", num_tokens=VOCAB, dim=64, depth=2, max_seq_len=SEQ),
                                          _tokens("x"), lm_loss),  # fmt: skip
    "gated_state_spaces_pytorch_mhesa": (_call("gated_state_spaces_pytorch.GatedExponentialSmoothingLM", num_tokens=VOCAB, dim=64, depth=2,
                                               heads=4), _tokens("x"), lm_loss),  # fmt: skip
    "invariant_point_attention": (_call("invariant_point_attention.IPABlock", dim=64, heads=4, scalar_key_dim=16, scalar_value_dim=16,
                                        point_key_dim=4, point_value_dim=4, pairwise_repr_dim=16), _residue_frames, _strided_squares),  # fmt: skip
    "halonet_pytorch": (_call("halonet_pytorch.HaloAttention", dim=16, block_size=4, halo_size=1, dim_head=8, heads=4),
                        _images("x", size=16, channels=16), sample_loss),  # fmt: skip
    "egnn_pytorch": (_call("egnn_pytorch.EGNN_Network", num_tokens=VOCAB, dim=32, depth=2, num_positions=SEQ), _points(tokens=True), _squares),
    "en_transformer": (_call("en_transformer.EnTransformer", dim=32, depth=2, dim_head=32, heads=2, coors_hidden_dim=16), _points(tokens=False),
                       _squares),  # fmt: skip
    "graph_transformer_pytorch": (_call("graph_transformer_pytorch.GraphTransformer", dim=64, depth=2, dim_head=16, heads=4, edge_dim=16,
                                        with_feedforwards=True, rel_pos_emb=True), _graph, _squares),  # fmt: skip
    "isab_pytorch": (_call("isab_pytorch.ISAB", dim=64, heads=4, num_latents=8), _vectors, _squares),
    "lambda_networks": (_call("lambda_networks.LambdaLayer", dim=16, dim_k=16, r=3, heads=4, dim_out=16), _images("x", size=8, channels=16),
                        sample_loss),  # fmt: skip
    "memory_transformer_xl": (_call("memory_transformer_xl.MemoryTransformerXL", num_tokens=VOCAB, dim=64, seq_len=SEQ, depth=2, heads=4,
                                    mem_len=8, lmem_len=4), _tokens("x"), lm_loss),  # fmt: skip
    "perceiver_ar_pytorch": (_call("perceiver_ar_pytorch.PerceiverAR", num_tokens=VOCAB, dim=64, depth=2, max_seq_len=SEQ, cross_attn_seq_len=8,
                                   dim_head=32, heads=2), _tokens("x"), lm_loss),  # fmt: skip
    "ponder_transformer": (_call("ponder_transformer.PonderTransformer", num_tokens=VOCAB, dim=64, max_seq_len=SEQ, dim_head=16, heads=4),
                           _tokens("x"), lm_loss),  # fmt: skip
    "rela_transformer": (_call("rela_transformer.ReLATransformer", num_tokens=VOCAB, dim=64, depth=2, max_seq_len=SEQ, heads=4, dim_head=16),
                         _tokens("x"), lm_loss),  # fmt: skip
    "segformer_pytorch": (_call("segformer_pytorch.Segformer", dims=(16, 32, 64, 64), heads=(1, 2, 4, 4), ff_expansion=(2, 2, 2, 2),
                                reduction_ratio=(4, 2, 1, 1), num_layers=1, decoder_dim=32, num_classes=4), _images("x"), sample_loss),  # fmt: skip
    "slot_attention": (_call("slot_attention.MultiHeadSlotAttention", num_slots=4, dim=64, heads=4, dim_head=16, iters=3),
                       lambda: {"inputs": _vectors()["x"]}, _squares),  # fmt: skip
    "triangle_multiplicative_module": (_call("triangle_multiplicative_module.TriangleMultiplicativeModule", dim=32, hidden_dim=32, mix="ingoing"),
                                       lambda: {"x": torch.randn(2, SEQ, SEQ, 32, generator=torch.Generator().manual_seed(1))}, _squares),  # fmt: skip
    "bottleneck_transformer_pytorch": (_call("bottleneck_transformer_pytorch.BottleStack", dim=16, fmap_size=8, dim_out=64, proj_factor=4,
                                             num_layers=2, heads=4, dim_head=8, downsample=True, rel_pos_emb=True),
                                       _images("x", size=8, channels=16), sample_loss),  # fmt: skip
    "VN_transformer": (_call("VN_transformer.VNTransformer", dim=64, depth=2, dim_head=16, heads=4, dim_feat=0),
                       lambda: {"coors": torch.randn(2, SEQ, 3, generator=torch.Generator().manual_seed(1))}, _squares),  # fmt: skip
    "axial_attention": (_call("axial_attention.AxialImageTransformer", dim=16, depth=2, heads=4, dim_heads=4, reversible=False),
                        _images("x", size=8, channels=16), sample_loss),  # fmt: skip
    "bidirectional_cross_attention": (_call("bidirectional_cross_attention.BidirectionalCrossAttentionTransformer", dim=64, depth=2,
                                            context_dim=32, heads=4, dim_head=16),
                                      lambda: _vectors() | {"context": torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))},
                                      _squares),  # fmt: skip
    "compositional_attention_pytorch": _layers_lm("compositional_attention_pytorch.CompositionalAttention", dim=64, dim_head=16, num_searches=4,
                                                  num_retrievals=2, causal=True),  # fmt: skip
    "hamburger_pytorch": (_call("hamburger_pytorch.Hamburger", dim=16, n=64, inner_dim=16, ratio=4, K=3), _images("x", size=8, channels=16),
                          sample_loss),  # fmt: skip
    "kronecker_attention_pytorch": (_call("kronecker_attention_pytorch.KroneckerSelfAttention", dim=16, heads=4, dim_heads=8),
                                    _images("x", size=8, channels=16), sample_loss),  # fmt: skip
    "memory_compressed_attention": _layers_lm("memory_compressed_attention.MemoryCompressedAttention", dim=64, heads=4, compression_factor=2),
    "omninet_pytorch": (_call("omninet_pytorch.Omninet", dim=64, depth=2, dim_head=16, heads=4, pool_layer_tokens_every=2), _vectors,
                        _strided_squares),  # fmt: skip
    "point_transformer_pytorch": (_call("point_transformer_pytorch.MultiheadPointTransformerLayer", dim=64, heads=4, dim_head=16,
                                        pos_mlp_hidden_dim=32, attn_mlp_hidden_mult=2),
                                  lambda: _vectors() | {"pos": torch.randn(2, SEQ, 3, generator=torch.Generator().manual_seed(2))},
                                  _squares),  # fmt: skip
    "tranception_pytorch": (_call("tranception_pytorch.Tranception", dim=64, depth=2, num_tokens=VOCAB, heads=4, dim_head=16), _tokens("x"),
                            lm_loss),  # fmt: skip
    "uformer_pytorch": (_call("uformer_pytorch.Uformer", dim=16, stages=2, num_blocks=1, dim_head=8, window_size=4, heads=2),
                        _images("x", size=16), sample_loss),  # fmt: skip
    "mlp_mixer_pytorch": (_call("mlp_mixer_pytorch.MLPMixer", image_size=IMAGE, channels=3, patch_size=8, dim=64, depth=2, num_classes=8),
                          _images("input"), class_loss),  # fmt: skip
    "res_mlp_pytorch": (_call("res_mlp_pytorch.ResMLP", image_size=IMAGE, patch_size=8, dim=64, depth=2, num_classes=8), _images("input"),
                        class_loss),  # fmt: skip
    "mammut_pytorch": (_call("mammut_pytorch.MaMMUT", dim=64, num_tokens=VOCAB, depth=2, dim_latents=32, image_dim=32, num_img_queries=4,
                             dim_head=16, heads=4), _captioned_images, _first),  # fmt: skip
    "ring_attention_pytorch": (_call("ring_attention_pytorch.RingTransformer", num_tokens=VOCAB, dim=64, depth=2, causal=True, dim_head=16,
                                     heads=4, num_grouped_query_heads=2, bucket_size=4), _tokens("x"), lm_loss),  # fmt: skip
    "timesformer_pytorch": (_call("timesformer_pytorch.TimeSformer", dim=64, num_frames=2, num_classes=8, image_size=16, patch_size=4, depth=2,
                                  heads=4, dim_head=16), _video, class_loss),  # fmt: skip
    "tslib_autoformer": _tslib("Autoformer"),
    "tslib_crossformer": _tslib("Crossformer"),
    "tslib_dlinear": _tslib("DLinear"),
    "tslib_fedformer": _tslib("FEDformer"),
    "tslib_film": _tslib("FiLM"),
    "tslib_frets": _tslib("FreTS"),
    "tslib_informer": _tslib("Informer"),
    "tslib_lightts": _tslib("LightTS"),
    "tslib_msgnet": _tslib("MSGNet"),
    "tslib_mambasimple": _tslib("MambaSimple"),
    "tslib_nonstationary_transformer": _tslib("Nonstationary_Transformer"),
    "tslib_pattn": _tslib("PAttn"),
    "tslib_patchtst": _tslib("PatchTST"),
    "tslib_pyraformer": _tslib("Pyraformer"),
    "tslib_reformer": _tslib("Reformer"),
    "tslib_scinet": _tslib("SCINet"),
    "tslib_segrnn": _tslib("SegRNN"),
    "tslib_tsmixer": _tslib("TSMixer"),
    "tslib_tide": _tslib("TiDE"),
    "tslib_timefilter": _tslib("TimeFilter"),
    "tslib_timemixer": _tslib("TimeMixer"),
    "tslib_timexer": _tslib("TimeXer"),
    "tslib_timesnet": _tslib("TimesNet"),
    "tslib_transformer": _tslib("Transformer"),
    "tslib_itransformer": _tslib("iTransformer"),
    "tslib_etsformer": _tslib("ETSformer", d_layers=2),  # its decoder has a layer per encoder layer
    "tslib_micn": _tslib("MICN", label_len=SEQ),  # its decoder input is the whole input window and the forecast
    "tslib_multipatchformer": _tslib("MultiPatchFormer", seq_len=96),  # its widest patch is 32 steps
    "tslib_temporalfusiontransformer": _tslib("TemporalFusionTransformer", data="ETTh1", enc_in=7, dec_in=7, c_out=7),  # its covariates by dataset
    "fms_llama": _fms("llama", "LLaMA", "LLaMAConfig", emb_dim=64, nheads=4, kvheads=2, multiple_of=32),
    "fms_granite": _fms("granite", "Granite", "GraniteConfig", emb_dim=64, nheads=4, head_dim=16, kvheads=2, multiple_of=32, embedding_multiplier=12.0,
                        logits_scaling=10.0, residual_multiplier=0.28, attention_multiplier=0.0078125),  # fmt: skip
    "fms_granite_swa": _fms("granite_swa", "GraniteSWA", "GraniteSWAConfig", emb_dim=64, nheads=4, head_dim=16, kvheads=2, multiple_of=32,
                            is_swa_layer=[True, False], window_length=8, pad_id=0),  # fmt: skip
    "fms_qwen3": _fms("qwen3", "Qwen3", "Qwen3Config", emb_dim=64, nheads=4, kvheads=2, head_dim=16, multiple_of=32, hidden_grow_factor=2),
    "fms_bamba": _fms("bamba", "Bamba", "BambaConfig", emb_dim=64, nheads=4, kvheads=2, head_dim=16, attn_layer_indices=[1], state_size=16,
                      mamba_n_heads=8, n_groups=2, chunk_size=8, multiple_of=32),  # fmt: skip
    "fms_gpt_bigcode": _fms("gpt_bigcode", "GPTBigCode", "GPTBigCodeConfig", emb_dim=64, nheads=4, max_expected_seq_len=64),
    "fms_roberta": _fms("roberta", "RoBERTa", "RoBERTaConfig", emb_dim=64, nheads=4, max_pos=64, p_dropout=0.0),
    "fms_mpnet": _fms("mpnet", "Mpnet", "MpnetConfig", emb_dim=64, nheads=4, intermediate_size=128, hidden_dropout_prob=0.0, p_dropout=0.0,
                      max_expected_seq_len=64),  # fmt: skip
    "moshi_lm": (_call("moshi.models.lm.LMModel", delays=[0, 1, 1], n_q=2, dep_q=2, card=32, text_card=64, dim=64, num_heads=4, num_layers=2,
                       hidden_scale=2, depformer_dim=32, depformer_num_layers=1, depformer_num_heads=2, depformer_dim_feedforward=64,
                       positional_embedding="rope", norm="rms_norm_f32", gating="silu"), _moshi_codes, _moshi_loss),  # fmt: skip
    "sam2_hiera": (_call("sam2.modeling.backbones.hieradet.Hiera", embed_dim=32, num_heads=1, q_pool=1, stages=(1, 2), global_att_blocks=(2,),
                         window_spec=(4, 4), window_pos_embed_bkg_spatial_size=(4, 4), return_interm_layers=False), _images("x"), _squares),  # fmt: skip
    "sam2_memory_attention": (_sam2_memory, _sam2_memory_inputs, _strided_squares),
    "dinov3_masked": (_dinov3, _dinov3_inputs, _dino_tokens),
    "minimind": _minimind(),
    "minimind_moe": _minimind(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "esmc": _esmc(),
    "torchmultimodal_coca": (_torchmultimodal_coca, lambda: _images("images")() | {"texts": _tokens("texts")()["texts"]},
                             lambda out: out["contrastive"] + out["captioning"]),
    "torchmultimodal_mae": (_call("torchmultimodal.models.masked_auto_encoder.model.image_mae", image_size=IMAGE, patch_size=8, encoder_layers=2,
                                  encoder_hidden_dim=64, encoder_heads=4, encoder_dim_feedforward=128, decoder_layers=2, decoder_hidden_dim=32,
                                  decoder_heads=4, decoder_dim_feedforward=64), _images("x"), _mae_loss),  # fmt: skip
    "torchmultimodal_flava": (_call("torchmultimodal.models.flava.model.flava_model_for_classification", num_classes=10, classifier_in_dim=64,
                                    classifier_hidden_sizes=64, classifier_dropout=0.0, pretrained=False, image_hidden_size=64,
                                    image_num_attention_heads=4, image_num_hidden_layers=2, image_intermediate_size=128, image_size=IMAGE,
                                    patch_size=8, text_hidden_size=64, text_num_attention_heads=4, text_num_hidden_layers=2,
                                    text_intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ, multimodal_hidden_size=64,
                                    multimodal_num_attention_heads=4, multimodal_num_hidden_layers=2, multimodal_intermediate_size=128,
                                    text_and_image_proj_size=32),
                              lambda: _images("image")() | {"text": _tokens("text")()["text"], "labels": torch.tensor([3, 7])},
                              lambda out: out.loss),  # fmt: skip
    "gptfast_model": _gpt_fast("gptfast_model"),
    "gptfast_moe": _gpt_fast("gptfast_moe", num_experts=4, num_activated_experts=2),
    "torch_geometric_transformer_conv": (lambda: _PygGraph("TransformerConv"), _graph_batch, _squares),
    "torch_geometric_gat": (lambda: _PygGraph("GATv2Conv"), _graph_batch, _squares),
    "torch_geometric_gps": (lambda: _PygGraph("GPSConv"), _graph_batch, _squares),
    "infini_transformer_pytorch": (_call("infini_transformer_pytorch.InfiniTransformer", num_tokens=VOCAB, dim=64, depth=2, dim_head=16, heads=4),
                                   _tokens("x"), lm_loss),  # fmt: skip
    "transfusion_pytorch": (_call("transfusion_pytorch.Transfusion", num_text_tokens=VOCAB, dim_latent=16,
                                  transformer=dict(dim=64, depth=2, dim_head=16, heads=4)), lambda: _tokens("modalities")() | {"return_loss": False},
                            lm_loss),  # fmt: skip
    "palm_rlhf_pytorch": _own_loss("palm_rlhf_pytorch.palm.PaLM", num_tokens=VOCAB, dim=64, depth=2, dim_head=16, heads=4),
    "coconut_pytorch": (_call("coconut_pytorch.Coconut", num_reasoning_steps=2, transformer=dict(num_tokens=VOCAB, dim=64, depth=2,
                                                                                                  dim_head=16, heads=4)),
                        lambda: {"prompt": _tokens("p")()["p"], "answer": _tokens("a")()["a"][:, :6]}, _first),  # fmt: skip
    "pi_zero_pytorch": (_call("pi_zero_pytorch.pi_zero.PiZero", dim=64, dim_action_input=6, dim_joint_state=12, num_tokens=VOCAB, depth=2,
                              dim_head=16, heads=4),
                        lambda: {"images": torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1)), "token_ids": _tokens("t")()["t"],
                                 "joint_state": torch.randn(2, 12, generator=torch.Generator().manual_seed(2)),
                                 "actions": torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(3))}, _first),  # fmt: skip
    "e2_tts_pytorch": (_call("e2_tts_pytorch.e2_tts.E2TTS", transformer=dict(dim=64, depth=2, heads=4, dim_head=16, max_seq_len=64), num_channels=20,
                                         use_vocos=False),
                       lambda: {"inp": torch.randn(2, SEQ, 20, generator=torch.Generator().manual_seed(1)),
                                "text": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))},
                       lambda out: out.loss),  # fmt: skip
    "sockeye_transformer": _sockeye("transformer"),
    "sockeye_ssru": _sockeye("ssru_transformer"),
    "kornia_qwen25_vision": _kornia("qwen25.vision.Qwen25VisionTransformer", "qwen25.config.Qwen25VisionConfig", _images("images", size=56),
                                    sample_loss, depth=2, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=32,
                                    fullatt_block_indexes=(1,), window_size=56),
    "kornia_moonvit": _kornia("kimi_vl.moonvit.MoonViT", "kimi_vl.config.MoonViTConfig", _images("pixel_values", size=56), _weighted,
                              image_size=56, patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128),
    "kornia_siglip2": _kornia("siglip2.model.SigLip2Model", "siglip2.config.SigLip2Config",
                              lambda: _images("pixel_values")() | {"input_ids": _tokens("t")()["t"], "return_loss": True}, lambda out: out.loss,
                              vision_config=_siglip_vision, text_config=_call("kornia.models.siglip2.config.SigLip2TextConfig", vocab_size=VOCAB,
                              hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=SEQ)),
    "kornia_paligemma": _kornia("paligemma.modeling_paligemma.PaliGemma", "paligemma.configuration_paligemma.PaliGemmaConfig",
                                lambda: _tokens("input_ids")() | _images("pixel_values")(), _paligemma_loss, vision_config=_siglip_vision,
                                vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=16, image_token_index=VOCAB - 1),
    "kornia_tiny_vit": (_call("kornia.models.tiny_vit.TinyViT", img_size=64, embed_dims=[16, 32, 64, 128], depths=[1, 1, 2, 1],
                              num_heads=[1, 2, 4, 4], window_sizes=[2, 2, 2, 1], num_classes=8), _images("x", size=64), class_loss),
    "timesfm_2p5": (_timesfm, _timesfm_inputs, _timesfm_loss),
    "titans_mac": _titans(num_residual_streams=1, neural_memory_layers=()),
    "titans_mac_hyper_connections": _titans(num_residual_streams=4, neural_memory_layers=()),
    "titans_mac_neural_memory": _titans(num_residual_streams=1, neural_memory_layers=(2,), neural_memory_segment_len=4),
    "speechbrain_transformer": _speechbrain(),
    "speechbrain_conformer": _speechbrain(normalize_before=True, encoder_module="conformer", attention_type="RelPosMHAXL", kernel_size=7),
    "speechbrain_branchformer": _speechbrain(normalize_before=True, encoder_module="branchformer", attention_type="RelPosMHAXL", kernel_size=7,
                                             csgu_linear_units=128),
    "speechbrain_rope": _speechbrain(attention_type="RoPEMHA"),
    "tabpfn_v3": (_tabpfn, _tabpfn_inputs, _weighted),
    "kan_gpt": _kan_gpt("EFFICIENT_KAN"),
    "kan_gpt_original": _kan_gpt("ORIGINAL_KAN"),
    "unit_scaling_decoder": (_call("unit_scaling.TransformerDecoder", hidden_size=64, vocab_size=VOCAB, layers=2, heads=4), _tokens("input"),
                             lm_loss),
    "unit_scaling_loss": (_UnitScaledLoss, _tokens("input_ids"), lambda out: out),
    "ai2_olmo": _olmo(rope=True, block_type="sequential", weight_tying=False),
    "ai2_olmo_2": _olmo(rope=True, block_type="sequential", n_kv_heads=2, attention_layer_norm=True, norm_after=True, layer_norm_type="rms",
                    layer_norm_with_affine=True, weight_tying=False),
    "ai2_olmo_alibi_grouped": _olmo(alibi=True, clip_qkv=8.0, multi_query_attention=True, block_group_size=2, include_bias=True, weight_tying=True),
    "bitnet": (_call("bitnet.BitNetTransformer", dim=64, depth=2, num_tokens=VOCAB, heads=4, ff_mult=4), _tokens("x"), lm_loss),
    "audiocraft_musicgen": (_musicgen, _musicgen_inputs, _codebooks_loss),
    "chronos_bolt": (_chronos("chronos.chronos_bolt", "ChronosBoltModelForForecasting", "transformers.T5Config", prediction_length=8),
                     _series("target"), lambda out: out.loss),
    "chronos_2": (_chronos("chronos.chronos2.model", "Chronos2Model", "chronos.chronos2.config.Chronos2CoreConfig", output_patch_size=4,
                           max_output_patches=2), _series("future_target", num_output_patches=2), lambda out: out.loss),
    "uni2ts_moirai2": (_call("uni2ts.model.moirai2.module.Moirai2Module", d_model=64, d_ff=128, num_layers=2, patch_size=4, max_seq_len=32,
                             attn_dropout_p=0.0, dropout_p=0.0), _moirai2_inputs, _moirai2_loss),
    "stable_audio_dit": (_call("stable_audio_tools.models.dit.DiffusionTransformer", io_channels=8, embed_dim=128, depth=2, num_heads=2,
                               cond_token_dim=32, global_cond_dim=32), _stable_audio_inputs, sample_loss),
    "x_clip": (_call("x_clip.CLIP", **X_CLIP), _text_image_loss, _first),
    "x_clip_built_before_process_group": (_built_before_process_group(_call("x_clip.CLIP", **X_CLIP)), _text_image_loss, _first),
    "retro_pytorch": (_call("retro_pytorch.RETRO", num_tokens=VOCAB, max_seq_len=64, enc_dim=64, enc_depth=2, dec_depth=2, dec_cross_attn_layers=(2,),
                            heads=2, dec_dim=64, dim_head=32, chunk_size=8), _retro_inputs, _first),
    "dalle_pytorch": (_dalle, _text_image_loss, _first),
    "toolformer_palm": (_call("toolformer_pytorch.palm.PaLM", dim=64, num_tokens=VOCAB, depth=2, heads=4, dim_head=16), _tokens("x"), lm_loss),
    "k_diffusion_hdit": (_KDiffusionLoss, _k_diffusion_inputs, torch.mean),
    "muse_maskgit": (_muse_maskgit, _muse_inputs, lambda out: out),
    "soundstorm_conformer": (_call("soundstorm_pytorch.ConformerWrapper", codebook_size=32, num_quantizers=2,
                                   conformer=dict(dim=64, depth=2, dim_head=16, heads=4, conv_kernel_size=7, attn_flash=False,
                                                  num_residual_streams=1)),
                             lambda: {"x": torch.randint(0, 32, (2, 2 * SEQ), generator=torch.Generator().manual_seed(1))},
                             lm_loss),  # fmt: skip
    "meshgpt_transformer": (_meshgpt, lambda: {"codes": torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1)),
                                               "vertices": None, "faces": None},  # the codes given: the autoencoder does not run
                            lambda out: out),  # fmt: skip
    "onmt_transformer": _onmt(),
    "onmt_transformer_relpos_shared": _onmt(position_encoding=False, max_relative_positions=8, share_decoder_embeddings=True),
    "onmt_lm_rotary_gqa": _onmt(model_task="lm", decoder_type="transformer_lm", position_encoding=False, max_relative_positions=-1,
                                layer_norm="rms", pos_ffn_activation_fn="gated-gelu", num_kv=2, add_qkvbias=True),
    "neuralforecast_patchtst": _neuralforecast("PatchTST", hidden_size=64, n_heads=4, encoder_layers=2, linear_hidden_size=128, patch_len=8,
                                               stride=8, dropout=0.0, fc_dropout=0.0, head_dropout=0.0, attn_dropout=0.0),
    "neuralforecast_tft": _neuralforecast("TFT", exog=True, hidden_size=64, n_head=4, dropout=0.0, attn_dropout=0.0),
    "neuralforecast_informer": _neuralforecast("Informer", hidden_size=64, n_head=4, conv_hidden_size=64, encoder_layers=2, decoder_layers=1,
                                               dropout=0.0),
    "neuralforecast_autoformer": _neuralforecast("Autoformer", hidden_size=64, n_head=4, conv_hidden_size=64, encoder_layers=2,
                                                 decoder_layers=1, dropout=0.0),
    "neuralforecast_fedformer": _neuralforecast("FEDformer", hidden_size=64, n_head=8, conv_hidden_size=64, encoder_layers=2, decoder_layers=1,
                                                dropout=0.0, modes=4),
    "neuralforecast_vanilla_transformer": _neuralforecast("VanillaTransformer", hidden_size=64, n_head=4, conv_hidden_size=64, encoder_layers=2,
                                                          decoder_layers=1, dropout=0.0),
    "neuralforecast_itransformer": _neuralforecast("iTransformer", multivariate=True, hidden_size=64, n_heads=4, e_layers=2, d_ff=128,
                                                   dropout=0.0),
    "neuralforecast_timexer": _neuralforecast("TimeXer", multivariate=True, hidden_size=64, n_heads=4, e_layers=2, d_ff=128, dropout=0.0,
                                              patch_len=8),
    "gluonts_patch_tst": _gluonts("patch_tst.module.PatchTSTModel", patch_len=8, stride=8, padding_patch="end", d_model=64, nhead=4,
                                  dim_feedforward=128, num_feat_dynamic_real=0, dropout=0.0, activation="relu", norm_first=False,
                                  num_encoder_layers=2, scaling="mean"),
    "gluonts_lag_tst": _gluonts("lag_tst.module.LagTSTModel", context=24, freq="h", lags_seq=[1, 2, 3, 4, 8], d_model=64, nhead=4,
                                dim_feedforward=128, dropout=0.0, activation="gelu", norm_first=True, num_encoder_layers=2, scaling="std"),
    "gluonts_i_transformer": _gluonts("i_transformer.module.ITransformerModel", variates=(4,), d_model=64, nhead=4, dim_feedforward=128,
                                      dropout=0.0, activation="relu", norm_first=False, num_encoder_layers=2, scaling="mean"),
    "gluonts_tft": _gluonts("tft.module.TemporalFusionTransformerModel", features=dict(feat_static_real=(2, 1), feat_static_cat=(2, 1),
                            feat_dynamic_real=(2, 40, 1)), num_heads=4, d_hidden=64, d_var=16, dropout_rate=0.0),
    "rtdl_ft_transformer": (_call("rtdl_revisiting_models.FTTransformer", n_cont_features=4, cat_cardinalities=[5, 5, 5], d_out=8, n_blocks=2,
                                  d_block=64, attention_n_heads=4, attention_dropout=0.0, ffn_d_hidden=None, ffn_d_hidden_multiplier=4 / 3,
                                  ffn_dropout=0.0, residual_dropout=0.0), _rtdl_inputs, class_loss),
    "rtdl_ft_transformer_linformer": (_call("rtdl_revisiting_models.FTTransformer", n_cont_features=4, cat_cardinalities=[5, 5, 5], d_out=8,
                                            n_blocks=2, d_block=64, attention_n_heads=4, attention_dropout=0.0, ffn_d_hidden=None,
                                            ffn_d_hidden_multiplier=4 / 3, ffn_dropout=0.0, residual_dropout=0.0, ffn_activation="ReLU",
                                            linformer_kv_compression_ratio=0.5, linformer_kv_compression_sharing="headwise"),
                                      _rtdl_inputs, class_loss),
    "tabm": (_tabm(), _tabm_inputs, _tabm_loss),
    "tabm_packed": (_tabm(arch_type="tabm-packed"), _tabm_inputs, _tabm_loss),
}


def _check_on_rank(rank: int, world: int, name: str, mode: str, dtype: torch.dtype, site: str, stubs: tuple[str, ...]) -> Any:
    from autotp.report.strict_rule import check_on_rank

    setup(site, stubs)
    build, inputs, loss = MODELS[name]
    torch.manual_seed(0)
    random.seed(0)  # every rank builds the same model: some libraries draw from Python's generator (hyper-connections' stream)
    model = build().train(name in TRAINING).to(dtype)
    example = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs().items()}
    tp, pp = MODES[mode]
    return check_on_rank(model, example, tp=tp, pp=pp, loss_fn=loss)


def verdict(name: str, mode: str, site: str, stubs: tuple[str, ...], timeout_s: float) -> str:
    """One line: passes with the rank's share, or why not (fp32 rounding named)."""
    from autotp.report.strict_rule import combine
    from autotp.runtime.processes.launcher import spawn_ranks

    tp, pp = MODES[mode]

    def run(dtype: torch.dtype) -> Any:
        return combine(spawn_ranks(_check_on_rank, tp * pp, name, mode, dtype, site, stubs, backend="gloo", timeout_s=timeout_s, num_threads=1,
                                   preload=("autotp.api", "autotp.report.strict_rule")))  # fmt: skip

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


def stub_names(spec: str) -> tuple[str, ...]:
    """The placeholders ``--stub`` names: its names, or the default with ``+name`` added and ``-name`` taken away (a
    site that holds a default placeholder's library for real, or needs one that another site's library is)."""
    names = [n for n in spec.split(",") if n]
    if not any(n[0] in "+-" for n in names):
        return tuple(names)
    taken = {n[1:] for n in names if n[0] == "-"}
    return tuple(n for n in STUBS if n not in taken) + tuple(n[1:] for n in names if n[0] == "+")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", default="", help="folders the libraries were installed into (pip install --target), "
                        f"separated by {os.pathsep!r}")
    parser.add_argument("--stub", default=",".join(STUBS), help="modules imported as placeholders (default: %(default)s); "
                        "names written +name or -name add to or take from the default instead")
    parser.add_argument("--only", default="", help="comma-separated prefixes of model names (default: all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated degrees (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per model and degree")
    args = parser.parse_args()
    stubs = stub_names(args.stub)
    setup(args.site, stubs)
    prefixes = [p for p in args.only.split(",") if p]
    names = [n for n in MODELS if not prefixes or any(n.startswith(p) for p in prefixes)]
    passed: dict[tuple[str, str], list[bool]] = {}
    for mode in args.modes.split(","):
        for name in names:
            line = verdict(name, mode, args.site, stubs, args.timeout)
            print(f"{mode} {name}: {line}", flush=True)
            library = next(lib for lib in LIBRARIES if name == lib or name.startswith(lib + "_"))
            passed.setdefault((library, mode), []).append(line.startswith("passes"))
    for (library, mode), results in passed.items():
        print(f"{library} at {mode}: {sum(results)}/{len(results)}")


if __name__ == "__main__":
    main()
