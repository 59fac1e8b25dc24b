from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from autotp.presets import build_model, example_inputs, preset_names


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds_on_meta(name: str) -> None:
    model = build_model(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not model.training
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "sdpa"


def test_preset_shapes() -> None:
    llama = build_model("llama3-8b").config
    assert (llama.vocab_size, llama.hidden_size, llama.intermediate_size) == (128256, 4096, 14336)
    assert (llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads) == (32, 32, 8)
    assert llama.rope_parameters["rope_theta"] == 500000.0
    mixtral = build_model("mixtral-8x7b").config
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.vocab_size) == (8, 2, 32000)
    gpt2 = build_model("gpt2-small").config
    assert (gpt2.vocab_size, gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_positions) == (50257, 768, 12, 12, 1024)


def test_llama3_8b_parameter_count() -> None:
    assert _num_params(build_model("llama3-8b")) == pytest.approx(8.03e9, rel=0.01)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "mixtral-tiny"])
def test_tiny_presets_run_on_cpu(name: str) -> None:
    model = build_model(name, device="cpu")
    inputs = example_inputs(model, batch=2, seq=8)
    assert inputs["input_ids"].device.type == "cpu"
    assert int(inputs["input_ids"].max()) < model.config.vocab_size
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (2, 8, model.config.vocab_size)


def test_dtype_is_applied() -> None:
    model = build_model("llama-tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_example_inputs_are_reproducible_and_on_cpu_for_meta_models() -> None:
    model = build_model("llama-tiny")
    first, second = example_inputs(model, seed=3), example_inputs(model, seed=3)
    assert first["input_ids"].device.type == "cpu"
    assert first["input_ids"].shape == (2, 16)
    assert torch.equal(first["input_ids"], second["input_ids"])


def test_local_config_folder_loads(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    config.save_pretrained(tmp_path)
    model = build_model(str(tmp_path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.hidden_size == 32
    assert not model.training


def test_unknown_name_lists_presets_and_mentions_folders() -> None:
    with pytest.raises(ValueError, match="llama-tiny.*config.json"):
        build_model("no-such-model")


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        build_model(str(tmp_path))
