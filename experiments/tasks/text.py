"""A scalable language model on text that installs with the project (``task="text"``):
the decoder-only `shoal.experiments.tasks.lm.ByteTransformer` at any width, depth, heads
and context, predicting the next byte, with training, validation and test text held out
by file.

The corpus (config ``text_corpus``) is read from the machine at run time, so it exists
offline everywhere and nothing is downloaded:

* ``"stdlib"``: the ``*.py`` files directly in the standard library's folder (the ``lm``
  task's text; about 4.7 MB with Python 3.11);
* ``"stdlib_tree"``: every ``*.py`` under the standard library's folder, subpackages and
  their tests included, ``site-packages`` left out (about 31 MB);
* ``"installed"``: that and every ``*.py``, ``*.md``, ``*.rst`` and ``*.txt`` under the
  environment's ``site-packages`` (about 170 MB in shoal's own environment; it depends on
  what is installed, which `corpus_info` records).

Files are sorted by their path under their root, and split by position: every tenth file
from the sixth (positions 5, 15, ...) is validation, every tenth from the first (0, 10,
...) is test, the rest training; no file is in two splits. Tokens are bytes (vocabulary
256): the loss per token is the loss per byte, comparable across corpora and with no
tokenizer to train or cache. Each step every worker trains on ``batch_size`` windows of
``seq_len + 1`` bytes at offsets drawn uniformly over the training text, seeded by
``(seed, step)``, so a run sees fresh text for as long as the corpus lasts; validation
(``validation_size`` windows) and test (``test_size``) windows are evenly spaced over
their splits.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import sysconfig
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from shoal.experiments.config import Config
from shoal.experiments.tasks.classifier import ClassifierTask
from shoal.experiments.tasks.lm import ByteTransformer, windows

CORPORA = ("stdlib", "stdlib_tree", "installed")
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
VAL_OFFSET, TEST_OFFSET, EVERY = 5, 0, 10


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """A corpus split by file: each split's bytes concatenated, and its files' names."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    files: dict[str, tuple[str, ...]]  # split -> names, "root/relative/path"


def corpus_files(corpus: str, stdlib: Path | None = None, packages: Path | None = None):
    """``(name, path)`` of every file of ``corpus`` (`CORPORA`), sorted by name; ``stdlib``
    and ``packages`` default to the running Python's standard library and
    ``site-packages``."""
    if corpus not in CORPORA:
        raise ValueError(f"text_corpus must be one of {CORPORA}, got {corpus!r}")
    stdlib = Path(os.path.dirname(os.__file__) if stdlib is None else stdlib)
    packages = Path(sysconfig.get_paths()["purelib"] if packages is None else packages)
    if corpus == "stdlib":
        found = [("stdlib/" + p.name, p) for p in stdlib.glob("*.py")]
    else:
        found = [
            ("stdlib/" + p.relative_to(stdlib).as_posix(), p)
            for p in stdlib.rglob("*.py")
            if "site-packages" not in p.relative_to(stdlib).parts
        ]
    if corpus == "installed":
        found += [
            ("site-packages/" + p.relative_to(packages).as_posix(), p)
            for p in packages.rglob("*")
            if p.suffix in TEXT_SUFFIXES
        ]
    return sorted((name, p) for name, p in found if p.is_file())


def load_text(corpus: str, stdlib: Path | None = None, packages: Path | None = None):
    """`corpus_files` read and split by position (module docstring)."""
    files = corpus_files(corpus, stdlib, packages)
    if len(files) < EVERY:
        raise ValueError(f"text corpus {corpus!r}: {len(files)} files, fewer than {EVERY}")
    split = {"train": [], "val": [], "test": []}
    for i, entry in enumerate(files):
        which = {VAL_OFFSET: "val", TEST_OFFSET: "test"}.get(i % EVERY, "train")
        split[which].append(entry)
    read = lambda entries: np.frombuffer(b"".join(p.read_bytes() for _, p in entries), np.uint8)
    names = {k: tuple(n for n, _ in v) for k, v in split.items()}
    return TextCorpus(read(split["train"]), read(split["val"]), read(split["test"]), names)


class TextTask(ClassifierTask):
    """Next-byte prediction on `load_text`'s corpus with `ByteTransformer`.

    Reads ``text_corpus``, ``seq_len`` (bytes of context), ``batch_size`` (windows per
    worker and step), ``validation_size`` and ``test_size`` (windows), ``lm_width``,
    ``lm_layers``, ``lm_heads``. ``evaluate`` gives the loss in nats per token (= per
    byte), the next-byte accuracy and bits per byte; ``tokens_per_example`` lets the
    runner count the tokens seen.
    """

    error_name = "next-byte error"

    def __init__(self, cfg: Config, stdlib: Path | None = None, packages: Path | None = None):
        self.corpus = load_text(cfg.text_corpus, stdlib, packages)
        self.source = cfg.text_corpus
        if len(self.corpus.train) <= cfg.seq_len + 1:
            raise ValueError(f"text corpus {cfg.text_corpus!r}: too little training text")
        self.test = windows(self.corpus.test, cfg.test_size, cfg.seq_len + 1)
        self.tokens_per_example = cfg.seq_len
        model = ByteTransformer(cfg.lm_width, cfg.lm_layers, cfg.lm_heads, cfg.seq_len)
        super().__init__(cfg, model, jnp.zeros((1, cfg.seq_len), jnp.int32))

    def hold_out(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """``rows`` windows of the validation files (never trained on, never tested)."""
        w = windows(self.corpus.val, rows, self.cfg.seq_len + 1)
        return w[:, :-1], w[:, 1:]

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self.test[:, :-1], self.test[:, 1:]

    def batch(self, step: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)``, each ``[workers, batch_size, seq_len]`` int32, windows at offsets
        drawn over the training text from ``(seed, step)``; y is x shifted by one."""
        length = self.cfg.seq_len + 1
        rng = np.random.default_rng([self.cfg.seed, 2, step])
        starts = rng.integers(
            0, len(self.corpus.train) - length + 1, (workers, self.cfg.batch_size)
        )
        w = self.corpus.train[starts[..., None] + np.arange(length)].astype(np.int32)
        return w[..., :-1], w[..., 1:]

    def evaluate(self, params) -> dict[str, float]:
        """Loss (nats per token, here per byte), next-byte accuracy and bits per byte of
        the validation windows (with ``validation_size``) or else the test windows."""
        loss, accuracy = super().evaluate(params)
        return {"loss": loss, "accuracy": accuracy, "bits_per_byte": loss / math.log(2)}

    def corpus_info(self) -> dict[str, str]:
        """Where the text came from and how much of it each split holds."""
        c, files = self.corpus, self.corpus.files
        size = lambda k: f"{len(files[k]):,} files, {len(getattr(c, k)):,} bytes (= tokens)"
        return {
            "corpus": f"{self.source} (Python {sys.version.split()[0]}; byte-level tokens)",
            "train": size("train"),
            "validation": size("val"),
            "test": size("test"),
        }
