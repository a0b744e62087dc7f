"""The language model's training data: a byte tokenizer, text corpora, a held-out split, the
unigram baseline, and packed batches that can be resumed at any step.

Tokens are bytes (ids 0..255) plus three specials: PAD, BOS and EOS. Each epoch shuffles the
documents reproducibly from (seed, epoch), turns each into BOS + bytes + EOS and packs them
greedily into rows of seq_len + 1 tokens: a document goes into the current row if it fits
there, else into a fresh row (the rest of the current one padded) if it fits a row, else it
fills the current row and continues in the next ones. Each piece of a document within a row is
a segment of its own (ids 1, 2, ... within the row, 0 for padding), with positions restarting at
0. The rows are shuffled too, so that a batch mixes documents.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

PAD = 256
BOS = 257
EOS = 258
VOCAB_SIZE = 259

TEXT_SUFFIXES = (".md", ".py", ".txt")
JSONL_SUFFIX = ".jsonl"
_COUNT_CHUNK = 1 << 20  # bytes counted at a time (bincount widens them to int64)


def encode(text: str | bytes) -> np.ndarray:
    """The token ids (int32, one per byte) of `text`, a str encoded as UTF-8 or raw bytes;
    no specials are added."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    if not isinstance(text, bytes | bytearray | memoryview):
        raise TypeError(f"encode takes str or bytes, got {type(text).__name__}")
    return np.frombuffer(text, np.uint8).astype(np.int32)


def decode(ids) -> str:
    """The text of token ids: specials (PAD, BOS, EOS) dropped, invalid UTF-8 replaced."""
    ids = np.asarray(ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"decode takes integer token ids, got dtype {ids.dtype}")
    ids = ids.astype(np.int64).reshape(-1)
    bad = ids[(ids < 0) | (ids >= VOCAB_SIZE)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside 0..{VOCAB_SIZE - 1}")
    return ids[ids < PAD].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Document:
    """One document of a corpus: a name (where it came from) and its bytes."""

    name: str
    data: bytes = field(repr=False)


def _text_or_none(data: bytes) -> bytes | None:
    """`data` if it is text (valid UTF-8 without NUL bytes), else None."""
    if b"\0" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def _check_corpus(docs: Sequence[Document], what: str) -> None:
    """Refuse a corpus without any bytes to learn from."""
    if not docs:
        raise ValueError(f"empty corpus: no documents in {what}")
    if not any(doc.data for doc in docs):
        raise ValueError(f"empty corpus: the {len(docs)} documents in {what} are all empty")


def stdlib_corpus() -> list[Document]:
    """The Python standard library's own `.py` files (site-packages left out), named by their
    path relative to the library and sorted by it, so that every machine with the same Python
    gets the same documents in the same order. Files that are not text (test data in other
    encodings) are skipped and their count logged."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts]
    docs, skipped = [], []
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        name = path.relative_to(root).as_posix()
        data = _text_or_none(path.read_bytes())
        if data is None:
            skipped.append(name)
        else:
            docs.append(Document(name, data))
    logger.info("stdlib corpus: %d files, %d not text skipped %s", len(docs), len(skipped), skipped)
    _check_corpus(docs, str(root))
    return docs


def _jsonl_documents(path: Path, data: bytes) -> list[Document]:
    """One document per non-blank line of a JSONL file: its "text" field."""
    docs = []
    for number, line in enumerate(data.decode("utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise ValueError(f'{where}: no "text" field')
        if not isinstance(record["text"], str):
            raise ValueError(f'{where}: "text" is a {type(record["text"]).__name__}, not a string')
        try:
            docs.append(Document(f"{path}:{number}", record["text"].encode("utf-8")))
        except UnicodeEncodeError:
            raise ValueError(f'{where}: "text" is not valid Unicode (a lone surrogate)') from None
    return docs


def _file_documents(path: Path) -> list[Document] | None:
    """The documents of one text or JSONL file, or None if it is not text."""
    data = _text_or_none(path.read_bytes())
    if data is None:
        return None
    if path.suffix == JSONL_SUFFIX:
        return _jsonl_documents(path, data)
    return [Document(str(path), data)]


def text_corpus(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Document]:
    """The documents of files and directories, in the order given.

    A directory contributes its `.txt`, `.md`, `.py` and `.jsonl` files (recursively, sorted by
    relative path), skipping and logging the count of those that are not text; a file must be
    one of those types and text (valid UTF-8 without NUL bytes). A `.jsonl` file gives one
    document per line, its "text" field (blank lines ignored); a line that is not a JSON object
    with a string "text" is an error naming the file and line. No documents, or only empty ones,
    is an error."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    paths = [Path(p) for p in paths]
    suffixes = (*TEXT_SUFFIXES, JSONL_SUFFIX)
    docs, skipped = [], []
    for path in paths:
        if path.is_dir():
            files = [p for p in path.rglob("*") if p.suffix in suffixes and p.is_file()]
            for file in sorted(files, key=lambda p: p.relative_to(path).as_posix()):
                file_docs = _file_documents(file)
                if file_docs is None:
                    skipped.append(str(file))
                else:
                    docs.extend(file_docs)
        elif path.is_file():
            if path.suffix not in suffixes:
                raise ValueError(
                    f"{path}: unknown file type {path.suffix!r} (expected one of {suffixes})"
                )
            file_docs = _file_documents(path)
            if file_docs is None:
                raise ValueError(f"{path}: not a text file (NUL bytes or invalid UTF-8)")
            docs.extend(file_docs)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    if skipped:
        logger.info("text corpus: %d files not text skipped %s", len(skipped), skipped)
    _check_corpus(docs, ", ".join(map(str, paths)))
    return docs


def split_documents(
    docs: Sequence[Document], held_out_fraction: float = 0.01, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """(train, held_out): round(held_out_fraction * len(docs)) documents (at least one, and at
    least one left to train on) drawn from `seed`, each document wholly in one split; both keep
    the corpus order. Both splits must hold some bytes."""
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    if len(docs) < 2:
        raise ValueError(f"a split needs at least 2 documents, got {len(docs)}")
    count = min(max(1, round(held_out_fraction * len(docs))), len(docs) - 1)
    held = np.zeros(len(docs), bool)
    held[np.random.default_rng(seed).permutation(len(docs))[:count]] = True
    train = [doc for doc, h in zip(docs, held) if not h]
    held_out = [doc for doc, h in zip(docs, held) if h]
    for name, split in (("train", train), ("held-out", held_out)):
        if not any(doc.data for doc in split):
            raise ValueError(
                f"the {name} split ({len(split)} documents, seed {seed}, "
                f"held_out_fraction {held_out_fraction}) has no bytes"
            )
    return train, held_out


def unigram_entropy_bits(docs: Sequence[Document]) -> float:
    """The entropy of the documents' byte frequencies in bits per byte: the loss of a model that
    ignores context, which a trained model's bits per byte must beat."""
    joined = np.frombuffer(b"".join(d.data for d in docs), np.uint8)
    counts = np.zeros(256, np.int64)
    for start in range(0, len(joined), _COUNT_CHUNK):
        counts += np.bincount(joined[start : start + _COUNT_CHUNK], minlength=256)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"no bytes in the {len(docs)} documents")
    p = counts[counts > 0] / total
    # fsum: the exactly rounded sum, whatever the order
    return -math.fsum(p * np.log2(p))


def _place(lengths: np.ndarray, row_len: int) -> tuple[np.ndarray, int]:
    """(offsets, rows): where each sequence of `lengths` starts in the flat token stream of rows
    of `row_len`, packed greedily, and the number of rows."""
    offsets = np.empty(len(lengths), np.int64)
    at = 0
    for i, n in enumerate(lengths.tolist()):
        column = at % row_len
        if column and n <= row_len < column + n:
            at += row_len - column
        offsets[i] = at
        at += n
    return offsets, -(-at // row_len)


def _batch_from_rows(rows: np.ndarray) -> dict[str, np.ndarray]:
    """The model's batch of packed token rows [B, S + 1]."""
    real = rows != PAD
    column = np.arange(rows.shape[1])
    # a segment starts at a document's BOS or at a row's first real token (a continued piece)
    starts = (rows == BOS) | ((column == 0) & real)
    segments = np.cumsum(starts, axis=1, dtype=np.int32) * real
    positions = np.where(real, column - np.maximum.accumulate(np.where(starts, column, 0), 1), 0)
    return {
        "inputs": rows[:, :-1].astype(np.int32),
        "targets": rows[:, 1:].astype(np.int32),
        "segment_ids": segments[:, :-1],
        "positions": positions[:, :-1].astype(np.int32),
        "loss_mask": (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0),
    }


def _check_int(name: str, value, low: int) -> int:
    """`value` if it is an int of at least `low`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class PackedBatches:
    """Batches of packed documents, deterministic in (docs, seq_len, batch_size, seed): batch
    `step` is the same whether reached by iteration, after `restore`, or by `batch_at`.

    A batch is a dict of numpy arrays [batch_size, seq_len]: `inputs`, `targets` (the inputs
    shifted by one), `segment_ids` and `positions` (of the inputs) as int32, and `loss_mask`
    (bool): whether the target is a real token of the input's segment.

    Each epoch packs every document once (see the module docstring); its last batch is filled
    with padding rows, or dropped if `drop_remainder`. Iteration runs for `num_epochs` epochs,
    or forever if None. One epoch's packed rows (2 bytes a token) are kept at a time."""

    def __init__(
        self,
        docs: Sequence[Document],
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        drop_remainder: bool = False,
        num_epochs: int | None = None,
    ):
        _check_corpus(docs, "PackedBatches")
        self.seq_len = _check_int("seq_len", seq_len, 2)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.num_epochs = None if num_epochs is None else _check_int("num_epochs", num_epochs, 1)
        self.drop_remainder = bool(drop_remainder)
        self._docs = [np.frombuffer(doc.data, np.uint8) for doc in docs]
        self._lengths = np.array([len(d) + 2 for d in self._docs], np.int64)
        self._counts: dict[int, int] = {}  # batches in each epoch counted so far
        self._batch_ends: list[int] = []  # the first step after each of epochs 0, 1, ...
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None
        self._epoch = self._index = 0
        self.batches_in_epoch(0)

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])

    def batches_in_epoch(self, epoch: int) -> int:
        """The number of batches of `epoch` (it varies a little: padding depends on the order)."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch not in self._counts:
            order = self._rng(epoch).permutation(len(self._docs))
            rows = _place(self._lengths[order], self.seq_len + 1)[1]
            count = rows // self.batch_size if self.drop_remainder else -(-rows // self.batch_size)
            if count == 0:
                raise ValueError(
                    f"epoch {epoch} packs {rows} rows, fewer than batch_size {self.batch_size} "
                    "(drop_remainder drops them all)"
                )
            self._counts[epoch] = count
        return self._counts[epoch]

    def _epoch_rows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows [R, seq_len + 1] uint16, the epoch's row order), packed once per epoch."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = None  # free the last epoch's rows before packing the next
            rng = self._rng(epoch)
            order = rng.permutation(len(self._docs))
            row_len = self.seq_len + 1
            offsets, rows = _place(self._lengths[order], row_len)
            flat = np.full(rows * row_len, PAD, np.uint16)
            for i, at in zip(order.tolist(), offsets.tolist()):
                n = len(self._docs[i])
                flat[at] = BOS
                flat[at + 1 : at + 1 + n] = self._docs[i]
                flat[at + 1 + n] = EOS
            self._cached = (epoch, flat.reshape(rows, row_len), rng.permutation(rows))
        return self._cached[1], self._cached[2]

    def _batch(self, epoch: int, index: int) -> dict[str, np.ndarray]:
        rows, order = self._epoch_rows(epoch)
        picked = order[index * self.batch_size : (index + 1) * self.batch_size]
        batch = np.full((self.batch_size, self.seq_len + 1), PAD, np.uint16)
        batch[: len(picked)] = rows[picked]
        return _batch_from_rows(batch)

    def _locate(self, step: int) -> tuple[int, int]:
        """(epoch, index in the epoch) of batch `step`."""
        while not self._batch_ends or self._batch_ends[-1] <= step:
            epoch = len(self._batch_ends)
            if self.num_epochs is not None and epoch >= self.num_epochs:
                raise IndexError(
                    f"step {step} is past the {self._batch_ends[-1]} batches of "
                    f"{self.num_epochs} epochs"
                )
            self._batch_ends.append(
                (self._batch_ends[-1] if epoch else 0) + self.batches_in_epoch(epoch)
            )
        epoch = bisect.bisect_right(self._batch_ends, step)
        return epoch, step - (self._batch_ends[epoch - 1] if epoch else 0)

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """Batch number `step` (from 0) of the iteration, without moving it."""
        return self._batch(*self._locate(_check_int("step", step, 0)))

    def state(self) -> dict[str, int]:
        """The iteration's position (JSON-able): the epoch and the index of the next batch in it."""
        return {"epoch": self._epoch, "index": self._index}

    def restore(self, state: dict[str, int]) -> None:
        """Continue the iteration from a `state()`."""
        if set(state) != {"epoch", "index"}:
            raise ValueError(f"a state has the keys epoch and index, got {sorted(state)}")
        epoch = _check_int("state epoch", state["epoch"], 0)
        index = _check_int("state index", state["index"], 0)
        if epoch == self.num_epochs:
            if index:
                raise ValueError(
                    f"state index {index} in epoch {epoch}: the {epoch} epochs are done"
                )
        elif self.num_epochs is not None and epoch > self.num_epochs:
            raise ValueError(f"state epoch {epoch} is past num_epochs {self.num_epochs}")
        elif index >= self.batches_in_epoch(epoch):
            raise ValueError(
                f"state index {index} is past the {self.batches_in_epoch(epoch)} batches "
                f"of epoch {epoch}"
            )
        self._epoch, self._index = epoch, index

    def __iter__(self) -> PackedBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        batch = self._batch(self._epoch, self._index)
        self._index += 1
        if self._index == self.batches_in_epoch(self._epoch):
            self._epoch, self._index = self._epoch + 1, 0
        return batch


def shard_batch(batch: dict[str, np.ndarray], num_shards: int, shard: int) -> dict[str, np.ndarray]:
    """Shard `shard` of `num_shards` of a batch: each array's rows split into contiguous blocks."""
    num_shards = _check_int("num_shards", num_shards, 1)
    shard = _check_int("shard", shard, 0)
    if shard >= num_shards:
        raise ValueError(f"shard {shard} is not below num_shards {num_shards}")
    sizes = {len(v) for v in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"the batch's arrays have different numbers of rows: {sorted(sizes)}")
    (size,) = sizes
    if size % num_shards:
        raise ValueError(f"batch size {size} does not split into {num_shards} shards")
    rows = size // num_shards
    return {k: v[shard * rows : (shard + 1) * rows] for k, v in batch.items()}
