"""The embedded default corpus and its byte-level batches: text that ships with every Python install.

`pydoc_data.topics` (the help texts) plus standard-library source files in sorted order, so no network is
needed. Tokens are bytes (vocabulary 256). The text is cut into chunks; every `val_every`-th chunk is the
validation split, so both splits hold help text and code. Batches depend only on (seed, step): a resumed run
sees the same data order as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig

import numpy as np

VOCAB_SIZE = 256


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Corpus size and split, batch shape and the seed of the data order."""

    batch_size: int = 16
    seq_len: int = 128
    max_bytes: int = 3_000_000
    chunk: int = 4096
    val_every: int = 20
    seed: int = 0


def _stdlib_sources():
    """Standard-library .py files (top level first, then packages), sorted so the order is reproducible."""
    root = sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "ensurepip", "turtledemo")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(out, key=lambda p: (os.path.relpath(p, root).count(os.sep), p))


@functools.lru_cache(maxsize=4)
def corpus_bytes(max_bytes: int = DataConfig.max_bytes) -> bytes:
    """The embedded corpus: pydoc topics, then standard-library sources, cut at `max_bytes`."""
    from pydoc_data.topics import topics
    parts = [f"{k}\n{topics[k]}\n".encode("utf-8") for k in sorted(topics)]
    size = sum(len(p) for p in parts)
    for path in _stdlib_sources():
        if size >= max_bytes:
            break
        try:
            with open(path, "rb") as f:
                b = f.read()
        except OSError:
            continue
        parts.append(b)
        size += len(b)
    return b"".join(parts)[:max_bytes]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Train and validation token arrays (uint8 bytes) and the config that drew them."""

    train: np.ndarray
    val: np.ndarray
    config: DataConfig

    @property
    def tokens_per_batch(self) -> int:
        return self.config.batch_size * self.config.seq_len

    def train_starts(self, step: int) -> np.ndarray:
        """Where the windows of a training step's batch start: drawn from (seed, step) only."""
        c = self.config
        rng = np.random.default_rng((c.seed, step))
        return rng.integers(0, len(self.train) - c.seq_len - 1, size=c.batch_size)

    def train_batch(self, step: int) -> dict:
        """The batch of a training step: random windows drawn from (seed, step) only."""
        return windows(self.train, self.train_starts(step), self.config.seq_len)

    def train_starts_table(self, first: int, count: int) -> np.ndarray:
        """train_starts of steps first .. first + count - 1 as one int32 [count, batch_size] array: with the train
        split on the device, a step can cut its batch there (`windows` in jnp), and no batch is sent from the host."""
        return np.stack([self.train_starts(s) for s in range(first, first + count)]).astype(np.int32)

    def val_batches(self, num_batches: int) -> list:
        """Fixed validation batches spread evenly over the split (the same for every recipe and step)."""
        c = self.config
        n = num_batches * c.batch_size
        starts = np.linspace(0, len(self.val) - c.seq_len - 1, n).astype(np.int64)
        return [windows(self.val, starts[i * c.batch_size:(i + 1) * c.batch_size], c.seq_len)
                for i in range(num_batches)]


def windows(tokens, starts, seq_len: int) -> dict:
    """The batch {inputs, targets} (int32 [len(starts), seq_len]) of the windows of `tokens` at `starts`: numpy
    arrays, or jnp arrays inside a jitted step (the same values)."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = tokens[idx].astype(np.int32)
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}


def load(config: DataConfig = DataConfig()) -> Dataset:
    """Split the corpus into train and validation by chunks (every `val_every`-th chunk is validation)."""
    data = np.frombuffer(corpus_bytes(config.max_bytes), np.uint8)
    n = len(data) // config.chunk
    if n < 2 * config.val_every:
        raise ValueError(f"corpus of {len(data)} bytes is too small for chunks of {config.chunk} bytes")
    chunks = data[:n * config.chunk].reshape(n, config.chunk)
    is_val = (np.arange(n) % config.val_every) == config.val_every - 1
    train, val = chunks[~is_val].reshape(-1), chunks[is_val].reshape(-1)
    if len(val) <= config.seq_len + 1:
        raise ValueError(f"validation split of {len(val)} bytes is shorter than seq_len={config.seq_len}")
    return Dataset(train=train, val=val, config=config)


def decode(tokens) -> str:
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")
