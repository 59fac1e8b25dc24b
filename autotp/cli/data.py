"""Training data for ``autotp run --data FILE``: read, tokenize, pack, split, shuffle, shard.

* **Read.** ``.txt`` (documents separated by blank lines) and ``.jsonl`` (one JSON object a
  line, the document under ``--data-field``, default ``text``) are tokenized with the
  tokenizer saved in the model's folder (``AutoTokenizer.from_pretrained(dir,
  local_files_only=True)``: nothing is downloaded), each document followed by the
  tokenizer's EOS token when it has one. ``.npy`` holds token ids of any integer dtype;
  ``.bin`` holds raw ids of ``--token-dtype`` (``uint16``, as nanoGPT writes them, or
  ``uint32``), which a raw file cannot say itself. Ids outside the vocabulary are refused.
* **Pack.** The token stream is cut into ``seq``-token sequences (the tail that does not
  fill one is dropped); each trains as ``input_ids`` = ``labels`` (the model shifts them).
* **Split.** The last ``eval_fraction`` of the sequences, in file order, is held out.
* **Shuffle and shard.** Epoch ``e`` visits the training sequences in the order of a
  permutation seeded by (seed, e); step ``s`` (0-based, counted over the whole run, resumes
  included) takes the next ``batch`` of that stream, so a resumed run sees what the
  uninterrupted one would have. Data-parallel rank ``r`` of ``dp`` takes rows
  ``[r * batch/dp, (r + 1) * batch/dp)`` of it and trains them with
  ``train_step(..., batch_is_local=True)``.

``tokenize`` runs once in the launching process and writes the ids as ``.npy``; the
workers only memory-map that file.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autotp.ir.errors import UserInputError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".npy", ".bin")
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


def _documents(path: Path, field: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        return [doc.strip("\n") for doc in text.split("\n\n") if doc.strip()]
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserInputError(f"{path} line {number} is not JSON ({e.msg}); write one JSON object per line") from e
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise UserInputError(f"{path} line {number} has no text under {field!r} (it has {keys}); "
                                 "pass --data-field with the key that holds the text")  # fmt: skip
        docs.append(record[field])
    return docs


def _tokenizer(folder: Path | None, data: Path):  # noqa: ANN202 - transformers' tokenizer classes
    from transformers import AutoTokenizer

    if folder is None:
        raise UserInputError(f"{data} is text and needs a tokenizer: pass --tokenizer DIR (a folder holding a saved "
                             "tokenizer), --model a folder that holds one, or pre-tokenized ids as .npy/.bin")  # fmt: skip
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserInputError(f"no tokenizer could be loaded from {folder} ({str(e).strip().splitlines()[0]}); save one "
                             "there with tokenizer.save_pretrained, pass --tokenizer DIR, or pre-tokenize to .npy") from e


def _read_ids(path: Path, token_dtype: str | None) -> np.ndarray:
    if path.suffix == ".npy":
        try:
            ids = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise UserInputError(f"{path} is not a readable .npy file ({e})") from e
        if not np.issubdtype(ids.dtype, np.integer):
            raise UserInputError(f"{path} holds {ids.dtype} values; token ids must be integers")
        return ids.reshape(-1)
    if token_dtype is None:
        raise UserInputError(f"{path} is raw token ids and does not record their width: pass --token-dtype "
                             "(uint16 as nanoGPT writes them, or uint32 for vocabularies over 65536)")  # fmt: skip
    width = np.dtype(token_dtype).itemsize
    size = path.stat().st_size
    if size % width:
        raise UserInputError(f"{path} has {size} bytes, not a whole number of {token_dtype} ids; check --token-dtype")
    return np.memmap(path, dtype=token_dtype, mode="r")


def tokenize(path: Path, out: Path, vocab: int, tokenizer_dir: Path | None, field: str = "text",
             token_dtype: str | None = None) -> int:  # fmt: skip
    """Write the token ids of ``path`` to ``out`` (.npy, int64); return how many there are."""
    if not path.is_file():
        raise UserInputError(f"--data {path} does not exist or is not a file")
    if path.suffix in TEXT_SUFFIXES:
        tokenizer = _tokenizer(tokenizer_dir, path)
        docs = _documents(path, field)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        pieces = [tokenizer(doc, add_special_tokens=False)["input_ids"] + eos for doc in docs]
        ids = np.fromiter((i for piece in pieces for i in piece), dtype=np.int64)
        log.info("tokenized %d documents of %s into %d tokens", len(docs), path, ids.size)
    elif path.suffix in TOKEN_SUFFIXES:
        ids = np.asarray(_read_ids(path, token_dtype), dtype=np.int64)
    else:
        raise UserInputError(f"--data {path}: unknown kind {path.suffix!r}; use {', '.join(TEXT_SUFFIXES + TOKEN_SUFFIXES)}")
    if ids.size == 0:
        raise UserInputError(f"--data {path} holds no tokens")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise UserInputError(f"--data {path} holds token ids from {low} to {high}, outside the model's vocabulary of "
                             f"{vocab}; tokenize with the model's tokenizer (or check --token-dtype)")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, ids)
    return int(ids.size)


@dataclass(frozen=True)
class PackedData:
    """Token ids packed into sequences, split into training and held-out ones."""

    ids: np.ndarray  # [sequences, seq], int64
    held_out: int  # the last ``held_out`` rows are the held-out split

    @staticmethod
    def load(tokens: Path, seq: int, eval_fraction: float) -> PackedData:
        ids = np.load(tokens, mmap_mode="r")
        rows = ids.size // seq
        if rows == 0:
            raise UserInputError(f"the data has {ids.size} tokens, fewer than one sequence of --seq {seq}")
        held_out = int(rows * eval_fraction)
        return PackedData(ids[: rows * seq].reshape(rows, seq), held_out)

    @property
    def train_rows(self) -> int:
        return self.ids.shape[0] - self.held_out

    def train_batch(self, step: int, batch: int, seed: int, dp_rank: int = 0, dp: int = 1) -> np.ndarray:
        """Rows of training step ``step`` (0-based) for dp rank ``dp_rank``: [batch/dp, seq]."""
        n = self.train_rows
        local = batch // dp
        positions = range(step * batch + dp_rank * local, step * batch + (dp_rank + 1) * local)
        orders: dict[int, np.ndarray] = {}
        rows = []
        for position in positions:
            epoch, index = divmod(position, n)
            if epoch not in orders:
                orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
            rows.append(orders[epoch][index])
        return np.asarray(self.ids[np.asarray(rows)])

    def eval_batches(self, batch: int) -> list[np.ndarray]:
        """The held-out rows in batches of ``batch`` (a last partial batch is left out)."""
        first = self.train_rows
        return [np.asarray(self.ids[first + i : first + i + batch]) for i in range(0, self.held_out - batch + 1, batch)]
