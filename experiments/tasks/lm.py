"""A byte-level language model (``task="lm"``): a small causal transformer predicts the
next byte of Python source code.

The corpus is the source of the Python standard library that runs this code, read at
run time, so it exists offline on every machine and nothing is downloaded: the files
``*.py`` directly in ``os.path.dirname(os.__file__)`` (no subpackages, no tests), in
sorted name order. Every tenth file (sorted positions 5, 15, 25, ...) is held out for
validation, the rest are training files, so the two splits share no file. Each split is
the concatenation of its files' bytes; examples are ``seq_len + 1`` byte windows (input
and shifted target) at evenly spaced offsets over the split: ``train_size`` of them for
training, ``test_size`` for validation. The corpus, and thus the numbers, depend on the
Python version (recorded by `corpus_info`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from shoal.experiments.config import Config
from shoal.experiments.tasks.classifier import ClassifierTask

VOCAB = 256  # bytes
VAL_EVERY, VAL_OFFSET = 10, 5


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 bytes of the training files, concatenated
    val: np.ndarray  # uint8 bytes of the validation files
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The corpus files: ``*.py`` directly in ``root`` (default: the standard library
    of the running Python), sorted by name."""
    root = Path(os.path.dirname(os.__file__) if root is None else root)
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_corpus(root: str | Path | None = None) -> Corpus:
    """Read `stdlib_files` and split them by file (`VAL_EVERY`, `VAL_OFFSET`)."""
    files = stdlib_files(root)
    if len(files) <= VAL_OFFSET:
        raise ValueError(f"too few .py files for a train/validation split in {root}")
    val = [f for i, f in enumerate(files) if i % VAL_EVERY == VAL_OFFSET]
    train = [f for i, f in enumerate(files) if i % VAL_EVERY != VAL_OFFSET]
    read = lambda fs: np.frombuffer(b"".join(f.read_bytes() for f in fs), np.uint8)
    return Corpus(read(train), read(val), tuple(f.name for f in train), tuple(f.name for f in val))


def windows(stream: np.ndarray, count: int, length: int) -> np.ndarray:
    """``count`` windows of ``length`` bytes at evenly spaced offsets over ``stream``,
    ``[count, length]`` int32 (they overlap when the stream is shorter than
    ``count * length``)."""
    if len(stream) < length:
        raise ValueError(f"a stream of {len(stream)} bytes has no window of {length}")
    starts = np.linspace(0, len(stream) - length, count).round().astype(np.int64)
    return stream[starts[:, None] + np.arange(length)].astype(np.int32)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return x + h


class ByteTransformer(nn.Module):
    """Byte and position embeddings, ``layers`` causal blocks, logits over the bytes.

    The output layer is the byte embedding (tied weights). Besides saving parameters,
    this gives every embedding row a gradient on every step (through the softmax): about
    a third of the 256 bytes never occur in the corpus, and an untied row with a
    structurally zero gradient has a zero frozen variance, which 1-bit compression noise
    turns into a divergent update (see `shoal.optim.onebit_lamb`'s ``momentum_mask``).
    """

    width: int
    layers: int
    heads: int
    max_len: int

    @nn.compact
    def __call__(self, tokens):  # [batch, time] int -> [batch, time, VOCAB]
        # Small embeddings keep the initial logits near 0: loss ln(256) at init.
        embed = nn.Embed(VOCAB, self.width, embedding_init=nn.initializers.normal(0.02))
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.width))
        x = embed(tokens) + pos[: tokens.shape[-1]]
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x)
        return embed.attend(nn.LayerNorm()(x))


class ByteLMTask(ClassifierTask):
    """Next-byte prediction on the standard library's source with `ByteTransformer`.

    Reads ``seq_len`` (bytes per example), ``train_size`` and ``test_size`` (examples),
    ``batch_size`` (examples per worker and step), ``lm_width``, ``lm_layers``,
    ``lm_heads``. A `shoal.experiments.tasks.classifier.ClassifierTask`;
    ``evaluate`` gives the validation loss (nats per byte) and next-byte accuracy.
    """

    error_name = "next-byte error"

    def __init__(self, cfg: Config, root: str | Path | None = None):
        self.root = Path(os.path.dirname(os.__file__) if root is None else root)
        self.corpus = load_corpus(self.root)
        self.train = windows(self.corpus.train, cfg.train_size, cfg.seq_len + 1)
        self.val = windows(self.corpus.val, cfg.test_size, cfg.seq_len + 1)
        self.tokens_per_example = cfg.seq_len  # bytes: the runner counts the tokens seen
        model = ByteTransformer(cfg.lm_width, cfg.lm_layers, cfg.lm_heads, cfg.seq_len)
        super().__init__(cfg, model, jnp.zeros((1, cfg.seq_len), jnp.int32))

    def test_data(self):
        return self.val[:, :-1], self.val[:, 1:]

    def hold_out(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The last ``rows`` training windows, removed from training. They come from the
        training files (``test_data`` from other files), so they may share bytes with
        other training windows."""
        w, self.train = self.train[-rows:], self.train[:-rows]
        return w[:, :-1], w[:, 1:]

    def evaluate(self, params) -> tuple[float, float]:
        """``(validation loss in nats per byte, next-byte accuracy)``; bits per byte is
        the loss / ln 2."""
        return super().evaluate(params)

    def batch(self, step: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)``, each ``[workers, batch_size, seq_len]`` int32: y is x shifted by one."""
        w = self.train[self._batches.indices(step, workers)]
        return w[..., :-1], w[..., 1:]

    def corpus_info(self) -> dict[str, str]:
        """Where the text came from, for the run's summary."""
        c = self.corpus
        return {
            "corpus": f"`{self.root}/*.py` (Python {sys.version.split()[0]})",
            "train": f"{len(c.train_files)} files, {len(c.train):,} bytes",
            "validation": f"{len(c.val_files)} files, {len(c.val):,} bytes "
            f"({', '.join(c.val_files[:3])}, ...)",
        }
