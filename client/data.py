"""Training text: sources, tokenizers, sharding and packing, with ``datasets``.

Documents are dealt round-robin into ``num_shards`` shards, so shards are
disjoint by construction; the last shard is never trained on and serves as the
held-out set. Each peer walks the training shards in an order seeded by its peer
id, so peers that start together read different text.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import random
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import datasets
import torch

from client.byte_tokenizer import ByteTokenizer
from client.sources import DataSource, hub_name
from swarm import DatasetSpec, SwarmError, TokenizerSpec
from swarm.manifest import DatasetSource, TokenizerKind

logger = logging.getLogger(__name__)
_BUILD_LOCK = threading.Lock()

EVAL_PER_DOCUMENT = 2  # held-out sequences taken from one document at most


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """A transformers tokenizer (``hub_tokenizer``'s), as packing uses it."""

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = len(self._tok)
        eos = self._tok.eos_token_id
        self.eos_id = int(eos if eos is not None else self._tok.sep_token_id or 0)

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """A batch goes to the Rust tokenizer at once, which spreads it over the cores."""
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def hub_tokenizer(name: str) -> HFTokenizer:
    """``AutoTokenizer``'s tokenizer of ``name`` from the hub (or its cache), never a directory on this machine."""
    from transformers import AutoTokenizer

    hub_name(name, "tokenizer.name")
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(name))
    except Exception as e:
        logger.debug("loading the tokenizer failed", exc_info=True)
        raise SwarmError(f"Could not load tokenizer '{name}' from the hub: {e}") from None


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    return ByteTokenizer() if spec.kind is TokenizerKind.bytes else hub_tokenizer(spec.name or "")


def stdlib_sources() -> list[Path]:
    """The Python standard library's own source files: a corpus every machine already has.

    In a fixed pseudo-random order (by a hash of each file's path under the library), not by name: in
    name order every shard reaches the same package at the same time (all peers trained on ``encodings/``'s
    codec tables in the same round, and the held-out loss jumped), and the held-out set was one or two files.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # site-packages is pruned, not walked and filtered: it can hold far more than the library (685 MB here,
        # where walking it made this listing 0.75 s of every peer's start, and it is listed once per pass)
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        files += [p for p in (Path(folder, n) for n in names if n.endswith(".py")) if p.is_file()]
    if not files:
        raise SwarmError(f"No Python source files found under {root} for the built-in corpus.")
    return sorted(files, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest())


def _builtin_documents() -> Iterator[dict]:
    for path in stdlib_sources():
        try:
            yield {"text": path.read_text(encoding="utf-8", errors="replace")}
        except OSError:
            continue


def load_documents(source: DataSource) -> datasets.IterableDataset:
    """The raw documents as an iterable ``datasets`` pipeline with a ``text`` column."""
    # datasets patches a builder module's globals (open, os.path.join, ...) when it builds that module's first
    # streaming pipeline, and not under a lock: the prefetch thread and the held-out set build theirs at once
    with _BUILD_LOCK:
        return _load_documents(source)


def read_documents(docs: datasets.IterableDataset, source: DataSource) -> Iterator[dict]:
    """The rows of a documents pipeline. A file that cannot be read or parsed (broken JSON, bad encoding, a
    connection lost mid-stream) ends the run with one message instead of the reader's traceback."""
    try:
        yield from docs
    except SwarmError:
        raise
    except Exception as e:
        logger.debug("reading the dataset failed", exc_info=True)
        raise SwarmError(
            f"The {source} could not be read: {type(e).__name__}: {e}. Fix or remove the file it names (or check "
            f"the connection), then start again."
        ) from None


def _load_documents(source: DataSource) -> datasets.IterableDataset:
    spec = source.spec
    if spec.source is DatasetSource.builtin:
        return datasets.IterableDataset.from_generator(_builtin_documents)
    if spec.source is DatasetSource.local:  # this peer's own files (--data-path)
        files = list(source.files)
        if not all(f.endswith((".json", ".jsonl")) for f in files):
            return datasets.load_dataset("text", data_files=files, split="train", streaming=True, sample_by="document")
        ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    else:
        _check_hub_dataset(spec.path or "")
        try:
            ds = datasets.load_dataset(spec.path, spec.config, split=spec.split, streaming=spec.streaming)
        except Exception as e:
            raise SwarmError(f"Could not open dataset '{spec.path}' ({spec.config}, {spec.split}): {e}") from None
        if not spec.streaming:
            ds = ds.to_iterable_dataset()
    if spec.text_field != "text":
        ds = ds.rename_column(spec.text_field, "text")
    return ds.select_columns(["text"])


def _check_hub_dataset(name: str) -> None:
    """A hub dataset's name must reach the hub: ``datasets`` reads a directory of that name here instead, and its
    file readers (``json``, ``text``, ...) without data files read the current directory's."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    if name in _PACKAGED_DATASETS_MODULES:
        raise SwarmError(
            f"The run's dataset.path {name!r} is the name of one of the datasets library's file readers, which would "
            "read files on this machine, not a hub dataset. This peer does not train on it."
        )
    hub_name(name, "dataset.path")


def shard_documents(docs: datasets.IterableDataset, num_shards: int, shard: int) -> datasets.IterableDataset:
    """Shard ``shard`` of ``num_shards``; shards never overlap.

    A dataset made of at least ``num_shards`` files (C4's train split has 1024) is cut into
    groups of whole files, so a peer reads only its own: dealing documents round-robin would
    make it stream the whole dataset and drop all but one document in ``num_shards``. Smaller
    ones (the built-in corpus, a few local files) are dealt round-robin.
    """
    if docs.n_shards >= num_shards:
        return docs.shard(num_shards=num_shards, index=shard)
    return docs.filter(lambda _, index: index % num_shards == shard, with_indices=True)


def pack(texts: Iterator[str], tokenizer: Tokenizer, seq_len: int, batch: int = 32) -> Iterator[torch.Tensor]:
    """Concatenate tokenized documents, separated by EOS, and cut fixed-length sequences.

    Documents are tokenized ``batch`` at a time (a fast tokenizer spreads a batch over the cores).
    """
    buffer: list[int] = []
    texts = iter(texts)
    while chunk := list(itertools.islice(texts, batch)):
        for ids in tokenizer.encode_batch(chunk):
            buffer.extend(ids)
            buffer.append(tokenizer.eos_id)
            start = 0
            while len(buffer) - start >= seq_len:
                yield torch.tensor(buffer[start : start + seq_len], dtype=torch.long)
                start += seq_len
            del buffer[:start]


@dataclass
class DataPosition:
    """Where a peer is in its walk over the shards; saved in checkpoints."""

    order_index: int = 0  # which shard in this peer's order
    sequences: int = 0  # sequences consumed from that shard


def shard_order(spec: DatasetSpec, peer_seed: str) -> list[int]:
    order = list(range(spec.num_shards - 1))  # the last shard is held out
    random.Random(peer_seed).shuffle(order)
    return order


class SequenceStream:
    """Endless packed training sequences for one peer, resumable from a DataPosition."""

    def __init__(
        self,
        source: DataSource,
        tokenizer: Tokenizer,
        seq_len: int,
        peer_seed: str,
        position: DataPosition | None = None,
    ):
        self.source, self.spec, self.tokenizer, self.seq_len = source, source.spec, tokenizer, seq_len
        self.order = shard_order(source.spec, peer_seed)
        self.position = position or DataPosition()
        self._iterator = self._sequences()

    def _shard_sequences(self, shard: int) -> Iterator[torch.Tensor]:
        docs = shard_documents(load_documents(self.source), self.spec.num_shards, shard)
        return pack((row["text"] for row in read_documents(docs, self.source)), self.tokenizer, self.seq_len)

    def _sequences(self) -> Iterator[torch.Tensor]:
        empty_in_a_row = 0
        while True:
            shard = self.order[self.position.order_index % len(self.order)]
            produced = 0
            for index, seq in enumerate(self._shard_sequences(shard)):
                if index < self.position.sequences:
                    continue
                produced += 1
                self.position.sequences += 1
                yield seq
            empty_in_a_row = empty_in_a_row + 1 if produced == 0 else 0
            if empty_in_a_row > len(self.order):
                raise SwarmError(f"The dataset yields no sequence of {self.seq_len} tokens; is it empty?")
            self.position = DataPosition(self.position.order_index + 1, 0)

    def next_batch(self, size: int) -> torch.Tensor:
        return torch.stack([next(self._iterator) for _ in range(size)])


def eval_batches(
    source: DataSource, tokenizer: Tokenizer, seq_len: int, num_sequences: int, batch_size: int = 8
) -> list[torch.Tensor]:
    """Fixed held-out sequences from the last shard, the same on every peer: at most ``EVAL_PER_DOCUMENT``
    from any one document (the rest of it is skipped), so that the set spans many documents."""
    spec = source.spec
    docs = shard_documents(load_documents(source), spec.num_shards, spec.num_shards - 1)
    sequences: list[torch.Tensor] = []
    buffer: list[int] = []
    for row in read_documents(docs, source):
        buffer.extend(tokenizer.encode(row["text"]))
        buffer.append(tokenizer.eos_id)
        taken = 0
        while len(buffer) >= seq_len and taken < EVAL_PER_DOCUMENT and len(sequences) < num_sequences:
            sequences.append(torch.tensor(buffer[:seq_len], dtype=torch.long))
            del buffer[:seq_len]
            taken += 1
        if taken == EVAL_PER_DOCUMENT:
            buffer.clear()
        if len(sequences) == num_sequences:
            break
    if not sequences:
        raise SwarmError("The held-out shard yields no sequence; the dataset is too small for its num_shards.")
    return [torch.stack(sequences[i : i + batch_size]) for i in range(0, len(sequences), batch_size)]


class Prefetcher:
    """The next batches, built on a background thread while the current inner step runs.

    Tokenizing and packing text is Python work; on a GPU it would otherwise sit on the
    training thread between steps, idling the accelerator. ``position`` is where the
    batches handed out so far end (what a checkpoint must record), not how far the
    thread has read ahead.
    """

    def __init__(self, stream: SequenceStream, batch_size: int, depth: int = 2):
        self._stream, self._batch_size = stream, batch_size
        self.position = DataPosition(stream.position.order_index, stream.position.sequences)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._fill, name="swarm-data", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while True:
            try:
                batch = self._stream.next_batch(self._batch_size)
                position = self._stream.position
                self._queue.put((batch, DataPosition(position.order_index, position.sequences), None))
            except BaseException as e:  # handed to the training thread, which raises it
                self._queue.put((None, None, e))
                return

    def next_batch(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        batch, position, error = self._queue.get()
        if error is not None:
            self._error = error
            raise error
        self.position = position
        return batch
