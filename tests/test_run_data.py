"""``autotp run --data``: a tiny model trained on a small text file, tokenized with the
tokenizer saved beside it, resumed, and its loss curve written; the data pipeline's
packing, split, shuffle and dp sharding; the learning-rate schedule."""

from __future__ import annotations

import csv
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autotp.cli.data import PackedData, tokenize
from autotp.cli.train import lr_at
from autotp.ir.errors import UserInputError

WORDS = "the a cat dog sat ran on under mat log big small red blue quickly slowly and then".split()


def _corpus(path: Path, documents: int = 120) -> Path:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) for _ in range(documents)]
    path.write_text("\n\n".join(docs) + "\n")
    return path


def _model_folder(folder: Path) -> Path:
    """llama-tiny's config and a word-level tokenizer of WORDS saved with transformers, offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from autotp import presets

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    presets.model_config("llama-tiny").save_pretrained(folder)
    return folder


def _autotp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotp", *args], capture_output=True, text=True, timeout=600, check=False)


def _losses(stdout: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+)  loss (\S+)  lr \S+  \S+ tokens/s  MFU \S+%", stdout, re.M)}


def _curve(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_run_trains_on_a_text_file_resumes_and_writes_the_curve(tmp_path: Path) -> None:
    model = _model_folder(tmp_path / "model")
    data = _corpus(tmp_path / "corpus.txt")
    common = ["--model", str(model), "--random-init", "--data", str(data), "--tp", "1", "--dp", "2", "--batch", "4",
              "--seq", "16", "--eval-fraction", "0.2", "--eval-every", "1", "--warmup", "1", "--lr", "3e-3"]  # fmt: skip
    first = _autotp("run", *common, "--steps", "2", "--total-steps", "4", "--save-checkpoint", str(tmp_path / "ckpt"),
                    "--out", str(tmp_path / "split"))  # fmt: skip
    assert first.returncode == 0, first.stderr
    resumed = _autotp("run", *common, "--steps", "2", "--resume", str(tmp_path / "ckpt"), "--out", str(tmp_path / "split"))
    assert resumed.returncode == 0, resumed.stderr
    straight = _autotp("run", *common, "--steps", "4", "--out", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    print(first.stdout, resumed.stdout, straight.stdout, sep="\n")

    assert "training and" in first.stderr and "held-out sequences of 16" in first.stderr
    printed = {**_losses(first.stdout), **_losses(resumed.stdout)}
    assert sorted(printed) == sorted(_losses(straight.stdout)) == [1, 2, 3, 4]
    assert "held-out loss" in straight.stdout
    assert "step-1 loss vs" not in resumed.stdout  # resumed weights are not the fresh model's

    split, whole = (_curve(tmp_path / name / "loss.csv") for name in ("split", "straight"))
    assert [int(r["step"]) for r in split] == [1, 2, 3, 4]
    assert all(r["eval_loss"] for r in split) and all(float(r["tokens_per_s"]) > 0 for r in split)
    assert [float(r["loss"]) for r in split] == pytest.approx([printed[s] for s in (1, 2, 3, 4)], abs=5e-5)
    for a, b in zip(split, whole):  # the resumed run saw the same batches, learning rates and AdamW state
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-5, abs=1e-6), a["step"]
        assert float(a["eval_loss"]) == pytest.approx(float(b["eval_loss"]), rel=1e-5, abs=1e-6), a["step"]
    assert float(whole[3]["loss"]) < float(whole[0]["loss"])
    png = (tmp_path / "split" / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_packing_split_shuffle_and_dp_shards(tmp_path: Path) -> None:
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.uint16))
    assert tokenize(tmp_path / "ids.npy", tmp_path / "tokens.npy", vocab=1000, tokenizer_dir=None) == 1000
    data = PackedData.load(tmp_path / "tokens.npy", seq=10, eval_fraction=0.1)
    assert data.ids.shape == (100, 10) and data.held_out == 10 and data.train_rows == 90
    held = np.concatenate(data.eval_batches(4))
    assert held.shape == (8, 10) and held[0, 0] == 900  # the last tenth in file order, whole batches only
    seen = []
    for step in range(45):  # two epochs of 90 training rows in global batches of 4 over dp = 2
        whole = data.train_batch(step, 4, seed=7)
        shards = [data.train_batch(step, 4, seed=7, dp_rank=r, dp=2) for r in range(2)]
        assert np.array_equal(np.concatenate(shards), whole)
        seen += list(whole[:, 0] // 10)
    assert sorted(seen[:90]) == list(range(90)) and sorted(seen[90:]) == list(range(90))[: len(seen) - 90]
    assert seen[:90] != seen[90:180] and int(max(seen)) < 90  # reshuffled each epoch, never a held-out row
    assert not np.array_equal(data.train_batch(0, 4, seed=7), data.train_batch(0, 4, seed=8))


def test_bad_data_is_refused_with_the_fix(tmp_path: Path) -> None:
    np.save(tmp_path / "big.npy", np.array([1, 2, 300]))
    with pytest.raises(UserInputError, match=r"token ids from 1 to 300, outside the model's vocabulary of 256"):
        tokenize(tmp_path / "big.npy", tmp_path / "t.npy", vocab=256, tokenizer_dir=None)
    (tmp_path / "raw.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    with pytest.raises(UserInputError, match="--token-dtype"):
        tokenize(tmp_path / "raw.bin", tmp_path / "t.npy", vocab=256, tokenizer_dir=None)
    assert tokenize(tmp_path / "raw.bin", tmp_path / "t.npy", vocab=256, tokenizer_dir=None, token_dtype="uint16") == 10
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "a b"}) + "\n" + json.dumps({"body": "c"}) + "\n")
    with pytest.raises(UserInputError, match=r"line 2 has no text under 'text' \(it has \['body'\]\).*--data-field"):
        tokenize(tmp_path / "docs.jsonl", tmp_path / "t.npy", vocab=256, tokenizer_dir=_model_folder(tmp_path / "m"))
    with pytest.raises(UserInputError, match="needs a tokenizer"):
        tokenize(tmp_path / "docs.jsonl", tmp_path / "t.npy", vocab=256, tokenizer_dir=None)


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    lrs = [lr_at(step, 1.0, warmup=2, total=6, min_ratio=0.1) for step in range(1, 7)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[3] > lrs[4] > lrs[5] == pytest.approx(0.1)
