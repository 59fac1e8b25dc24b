"""Bad checkpoints and save targets give a clear ValueError, and a failed save loses nothing
(one process, no process group; one-layer models keep the traces short)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from small_models import build


def _meta(name: str = "llama") -> torch.nn.Module:
    with torch.device("meta"):
        return build(name, layers=1)


def _parallelize(checkpoint: Path, name: str = "llama") -> object:
    import autotp

    return autotp.parallelize(_meta(name), tp=1, checkpoint=checkpoint)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "llama"
    build("llama", layers=1).save_pretrained(folder, max_shard_size="20KB")
    return folder


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _file_of(folder: Path, key: str) -> Path:
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "c")
    key = "model.layers.0.mlp.up_proj.weight"
    path = _file_of(folder, key)
    tensors = load_file(path)
    del tensors[key]
    save_file(tensors, path, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*model.layers.0.mlp.up_proj.weight"):
        _parallelize(folder)


def test_shape_mismatch_names_tensor_file_and_shapes(tmp_path: Path) -> None:
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                 num_attention_heads=8, num_key_value_heads=2)).save_pretrained(tmp_path / "c")  # fmt: skip
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight: the checkpoint holds shape \[96, 64\] "
                                         r"\(model.layers.0.mlp.gate_proj.weight in model.safetensors\).*expects \[128, 64\]"):  # fmt: skip
        _parallelize(tmp_path / "c")


def test_dtype_that_cannot_convert(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "c")
    key = "model.norm.weight"
    path = _file_of(folder, key)
    tensors = load_file(path)
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.norm.weight in .* is torch.int32, which does not convert"):
        _parallelize(folder)


def test_bf16_checkpoint_converts_to_fp32(tmp_path: Path) -> None:
    model = build("llama", layers=1)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "c", max_shard_size="20KB")
    pm = _parallelize(tmp_path / "c")
    state = pm.unshard_state_dict()  # type: ignore[attr-defined]
    for k, v in model.state_dict().items():
        assert state[k].dtype == torch.float32
        assert torch.equal(state[k], v.float()), k


def test_truncated_file(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "c")
    path = _file_of(folder, "model.embed_tokens.weight")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{path.name} is truncated"):
        _parallelize(folder)


def test_corrupt_header(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "c")
    path = _file_of(folder, "model.norm.weight")
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops" + path.read_bytes()[13:])
    with pytest.raises(ValueError, match=rf"{path.name} is not a readable safetensors file"):
        _parallelize(folder)


def test_index_naming_a_missing_file(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "c")
    path = _file_of(folder, "model.norm.weight")
    path.unlink()
    with pytest.raises(ValueError, match=rf"names 1 file\(s\) that do not exist: \['{path.name}'\]"):
        _parallelize(folder)


def test_checkpoint_of_another_architecture(tmp_path: Path) -> None:
    build("gpt2", layers=1).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"is a 'gpt2' model .* but the model is 'llama'"):
        _parallelize(tmp_path / "gpt2")


def test_folder_without_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
        _parallelize(tmp_path)


def test_meta_buffer_the_init_cannot_rebuild() -> None:
    import autotp

    from small_models import PlainTransformer

    with torch.device("meta"):
        model = PlainTransformer()
        model.register_buffer("table", torch.empty(4))
    with pytest.raises(ValueError, match=r"table was built on meta and the model's initializer does not fill it"):
        autotp.parallelize(model, tp=1, example_inputs={"input_ids": torch.zeros(1, 4, dtype=torch.long)})


def test_unwritable_target_and_failed_save_keep_the_old_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    import autotp

    pm = autotp.parallelize(build("llama", layers=1), tp=1)
    opt = torch.optim.AdamW(pm.parameters())
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot write a checkpoint to .*file/ckpt.*choose a writable folder"):
        pm.save_checkpoint(tmp_path / "file" / "ckpt")

    pm.save_checkpoint(tmp_path / "ckpt", optimizer=opt, step=5)
    before = {k: v.clone() for k, v in pm.unshard_state_dict().items()}
    for p in pm.parameters():
        p.data.add_(1.0)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    real = dcp.FileSystemWriter.write_data
    dcp.FileSystemWriter.write_data = disk_full  # type: ignore[method-assign]
    try:
        with pytest.raises(ValueError, match="failed on rank 0: .*No space left on device.*previous checkpoint there stays"):
            pm.save_checkpoint(tmp_path / "ckpt", optimizer=opt, step=6)
    finally:
        dcp.FileSystemWriter.write_data = real  # type: ignore[method-assign]
    assert not (tmp_path / "ckpt.tmp").exists()
    with pytest.raises(ValueError, match="holds AdamW optimizer state, but the optimizer is SGD"):
        pm.load_checkpoint(tmp_path / "ckpt", optimizer=torch.optim.SGD(pm.parameters(), lr=0.1))
    assert pm.load_checkpoint(tmp_path / "ckpt", optimizer=opt) == 5
    for k, v in pm.unshard_state_dict().items():
        assert torch.equal(v, before[k]), k


def test_dcp_checkpoint_of_another_model(tmp_path: Path) -> None:
    import autotp

    autotp.parallelize(build("gpt2", layers=1), tp=1).save_checkpoint(tmp_path / "gpt2")
    pm = autotp.parallelize(build("llama", layers=1), tp=1)
    with pytest.raises(ValueError, match=r"lacks \d+ tensor\(s\) this model needs"):
        pm.load_checkpoint(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="does not exist"):
        pm.load_checkpoint(tmp_path / "nothing")
