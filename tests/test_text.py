"""The scalable text task (``task="text"``): its corpora read from disk and split by file
into training, validation and test (by hand on synthetic folders; disjoint and
deterministic on the real ones), batches drawn over the training text from (seed, step),
evaluation on validation or test windows with bits per byte, the transformer's parameter
count by formula up to 125M, and the runner's count of tokens seen."""

from __future__ import annotations

import dataclasses
import math

import harness
import jax
import numpy as np
import pytest

from shoal.experiments.config import Config, ConfigError
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import make_task
from shoal.experiments.tasks.lm import ByteTransformer, stdlib_files
from shoal.experiments.tasks.text import TextTask, corpus_files, load_text

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="single-process tests")

TINY = Config(
    name="text_tiny", task="text", algorithms=("ssgd_adamw",), workers=2, steps=4,
    batch_size=3, seq_len=16, test_size=8, eval_every=2, lm_width=16, lm_layers=1,
    lm_heads=2, text_corpus="stdlib", project_workers=0,
)  # fmt: skip


@pytest.fixture
def folders(tmp_path):
    """A standard library of 14 modules (one in a subpackage, one under site-packages)
    and a site-packages of text files and a binary one."""
    lib, packages = tmp_path / "lib", tmp_path / "site"
    (lib / "pkg").mkdir(parents=True)
    (lib / "site-packages").mkdir()
    for i in range(12):
        (lib / f"m{i:02d}.py").write_bytes(bytes([65 + i]) * (i + 1))
    (lib / "pkg" / "inner.py").write_bytes(b"inner")
    (lib / "site-packages" / "third.py").write_bytes(b"never from the stdlib walk")
    (lib / "notes.txt").write_bytes(b"not python")
    (packages / "p").mkdir(parents=True)
    for name in ("a.py", "b.md", "c.rst", "d.txt", "e.json"):
        (packages / "p" / name).write_bytes(name.encode())
    return lib, packages


def test_corpora_on_synthetic_folders(folders):
    lib, packages = folders
    names = lambda corpus: [n for n, _ in corpus_files(corpus, lib, packages)]
    top = [f"stdlib/m{i:02d}.py" for i in range(12)]
    assert names("stdlib") == top
    assert names("stdlib_tree") == sorted(top + ["stdlib/pkg/inner.py"])
    assert names("installed") == [  # sorted by name: site-packages/ before stdlib/
        "site-packages/p/a.py", "site-packages/p/b.md", "site-packages/p/c.rst",
        "site-packages/p/d.txt",
    ] + sorted(top + ["stdlib/pkg/inner.py"])  # fmt: skip
    # Positions 0 and 10 are test, 5 is validation, the rest training.
    c = load_text("stdlib", lib, packages)
    assert c.files["test"] == ("stdlib/m00.py", "stdlib/m10.py")
    assert c.files["val"] == ("stdlib/m05.py",)
    assert c.test.tobytes() == b"A" + b"K" * 11 and c.val.tobytes() == b"F" * 6
    train = [i for i in range(12) if i not in (0, 5, 10)]
    assert c.train.tobytes() == b"".join(bytes([65 + i]) * (i + 1) for i in train)
    with pytest.raises(ValueError, match="text_corpus must be one of"):
        corpus_files("web", lib, packages)


def test_the_real_corpora_are_disjoint_and_deterministic():
    a, b = load_text("stdlib"), load_text("stdlib")
    assert a.train.tobytes() == b.train.tobytes() and a.files == b.files
    # The top-level modules are the lm task's files.
    assert sorted(n.split("/")[1] for k in a.files for n in a.files[k]) == sorted(
        f.name for f in stdlib_files()
    )
    tree = load_text("stdlib_tree")
    sets = [set(v) for v in tree.files.values()]
    assert all(x.isdisjoint(y) for i, x in enumerate(sets) for y in sets[i + 1 :])
    assert len(tree.train) > 5 * len(a.train)  # subpackages add most of the text
    total = sum(len(getattr(tree, k)) for k in ("train", "val", "test"))
    assert total == sum(p.stat().st_size for _, p in corpus_files("stdlib_tree"))


def test_batches_are_windows_of_the_training_text_from_seed_and_step():
    task = make_task(TINY)
    x, y = task.batch(3, 2)
    assert x.shape == y.shape == (2, 3, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])  # y is x shifted by one
    np.testing.assert_array_equal(task.batch(3, 2)[0], x)  # a pure function of the step
    assert not np.array_equal(task.batch(4, 2)[0], x)
    other = make_task(dataclasses.replace(TINY, seed=1))
    assert not np.array_equal(other.batch(3, 2)[0], x)
    text = task.corpus.train.tobytes()
    for window in np.concatenate([x, y[..., -1:]], -1).reshape(-1, 17):
        assert bytes(window.astype(np.uint8)) in text


def test_evaluation_on_validation_or_test_files_in_bits_per_byte():
    task = make_task(TINY)
    params = task.init_params()
    got = task.evaluate(params)
    assert set(got) == {"loss", "accuracy", "bits_per_byte"}
    assert got["bits_per_byte"] == pytest.approx(got["loss"] / math.log(2))
    assert got["loss"] == pytest.approx(math.log(256), rel=0.05)  # small initial logits
    held = make_task(dataclasses.replace(TINY, validation_size=8))
    vx, _ = held.validation
    assert vx.shape == (8, 16)
    assert bytes(vx[0].astype(np.uint8)) in held.corpus.val.tobytes()
    assert held.evaluate(params)["loss"] != pytest.approx(got["loss"], rel=1e-6)
    info = task.corpus_info()
    assert info["corpus"].startswith("stdlib (Python") and "tokens" in info["train"]


@pytest.mark.parametrize("width, layers, heads, length", [(16, 1, 2, 16), (768, 12, 12, 1024)])
def test_the_transformer_scales_by_formula(width, layers, heads, length):
    """Embedding 256 d, positions L d, per block 12 d^2 + 13 d (attention 4 (d^2 + d), MLP
    8 d^2 + 5 d, two LayerNorms 4 d), a final LayerNorm 2 d: 85.9M at GPT-2 small's size."""
    model = ByteTransformer(width, layers, heads, length)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.numpy.zeros((1, length), int))
    count = sum(x.size for x in jax.tree.leaves(shapes))
    d = width
    assert count == 256 * d + length * d + layers * (12 * d * d + 13 * d) + 2 * d


def test_the_runner_counts_the_tokens_seen(tmp_path):
    result = train(TINY, TextTask(TINY), SimBackend(2), "ssgd_adamw", progress=False)
    per_step = TINY.workers * TINY.batch_size * TINY.seq_len
    assert [r["tokens"] for r in result.records] == [per_step * s for s in range(1, 5)]
    assert "test_bits_per_byte" in result.records[1]
    assert result.summary["tokens_m"] == 4 * per_step / 1e6


def test_a_corpus_name_is_checked():
    with pytest.raises(ConfigError, match="text_corpus"):
        dataclasses.replace(TINY, text_corpus="web").check()
