"""Built-in model presets and local config folders, built without downloading anything.

torch and transformers are imported when a model or config is built, not on import,
so that the command line starts (and ``autotp --help`` answers) without them.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotp.ir.errors import UserInputError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""The parameter dtypes the commands accept, by name (``DTYPES`` maps them to torch dtypes)."""


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module 'autotp.presets' has no attribute '{name}'")


def _llama_tiny() -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )


def _gpt2_tiny() -> PretrainedConfig:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=255, eos_token_id=255
    )


def _mixtral_tiny() -> PretrainedConfig:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )


def _gpt2_small() -> PretrainedConfig:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)


def _llama3(hidden: int, intermediate: int, layers: int, heads: int) -> PretrainedConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


def _mixtral_8x7b() -> PretrainedConfig:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )


_PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-tiny": _llama_tiny,
    "gpt2-tiny": _gpt2_tiny,
    "mixtral-tiny": _mixtral_tiny,
    "gpt2-small": _gpt2_small,
    "llama3-8b": lambda: _llama3(hidden=4096, intermediate=14336, layers=32, heads=32),
    "llama3-70b": lambda: _llama3(hidden=8192, intermediate=28672, layers=80, heads=64),
    "mixtral-8x7b": _mixtral_8x7b,
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def _config_for(name_or_path: str) -> PretrainedConfig:
    if name_or_path in _PRESETS:
        return _PRESETS[name_or_path]()
    path = Path(name_or_path)
    if path.is_dir():
        return _folder_config(path)
    raise UserInputError(
        f"unknown model {name_or_path!r}; use one of the presets {', '.join(_PRESETS)} "
        "or a local folder holding a config.json"
    )


def _folder_config(path: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    file = path / "config.json"
    if not file.is_file():
        raise UserInputError(f"folder {path} has no config.json; point at the folder that holds the model's config.json")
    try:
        json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"{file} is not valid JSON ({e}); fix the file or regenerate it with config.save_pretrained") from e
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserInputError(f"{file} is not a transformers config: {first}; it needs a known model_type and that model's fields") from e


def model_config(name_or_path: str) -> PretrainedConfig:
    """The config of a preset or a local folder holding config.json; nothing is built."""
    return _config_for(name_or_path)


def build_model(
    name_or_path: str,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """Build a preset or a local config folder's model in eval mode, with random weights on `device`.

    On the default `meta` device nothing is allocated, so any size builds in seconds.
    """
    return build_from_config(_config_for(name_or_path), device, dtype)


def build_from_config(
    config: PretrainedConfig,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """``build_model`` for a config object."""
    import torch

    config.use_cache = False
    with torch.device(device):
        model = _auto_class(config).from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _auto_class(config: PretrainedConfig) -> type:
    """The auto class that builds ``config``'s model: with a language-modelling head where transformers has one."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return AutoModelForCausalLM if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModel


def model_class(config: PretrainedConfig) -> type | None:
    """The transformers class ``build_from_config`` builds for ``config``, importing its modeling code (which happens
    on first use otherwise: a caller can time building and tracing apart from importing); None if no auto class
    knows the config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    mapping = next((m for m in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING) if type(config) in m), None)
    return None if mapping is None else mapping[type(config)]


def example_inputs(model: torch.nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random `input_ids` below the model's vocabulary, identical for equal `seed` on every rank.

    They live on the model's CUDA device if it has one, else on CPU (also for meta models).
    """
    import torch

    vocab_size = model.config.get_text_config().vocab_size
    param = next(model.parameters())
    device = param.device if param.device.type == "cuda" else torch.device("cpu")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    return {"input_ids": input_ids.to(device)}


INSPECTION_SEQ = 2048


def inspection_inputs(model: torch.nn.Module, batch: int = 1, seq: int | None = None, labels: bool = True) -> dict[str, torch.Tensor]:
    """Zero ``input_ids`` [batch, seq] (and the same as ``labels``, so the loss shows) for
    compiling a model offline; ``seq`` defaults to 2048 or the model's position limit."""
    import torch

    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if seq is None:
        seq = min(INSPECTION_SEQ, limit) if limit else INSPECTION_SEQ
    elif limit is not None and seq > limit:
        raise UserInputError(f"--seq {seq} exceeds the model's max_position_embeddings ({limit}); pass --seq {limit} or less")
    ids = torch.zeros((batch, seq), dtype=torch.long)
    inputs = {"input_ids": ids}
    if labels and "labels" in inspect.signature(model.forward).parameters:
        inputs["labels"] = ids
    return inputs
