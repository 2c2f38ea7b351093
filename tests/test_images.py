"""The image task (procedural glyphs, small CNN) against NumPy checks, and a short
training run in which the CNN beats a linear model."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import harness
import jax
import numpy as np
import optax
import pytest

from shoal.experiments.config import Config
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import train
from shoal.experiments.tasks.images import (
    CNN,
    IMAGE_SIZE,
    ImageTask,
    generate_images,
    make_glyphs,
    matched_filter_predict,
)

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="single-process tests")

K = 10
# `task` is not read by ImageTask; "mixture" keeps Config's own checks satisfied.
CFG = Config(task="mixture", num_classes=K, train_size=4096, test_size=1024, hidden=(64,),
             workers=1, batch_size=64)  # fmt: skip


def shifted(glyph: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """``glyph`` moved by ``(dy, dx)`` pixels, zeros shifted in (no wrap-around)."""
    size = glyph.shape[0]
    out = np.zeros_like(glyph)
    src = glyph[max(-dy, 0) : size - max(dy, 0), max(-dx, 0) : size - max(dx, 0)]
    out[max(dy, 0) : size - max(-dy, 0), max(dx, 0) : size - max(-dx, 0)] = src
    return out


def test_shapes_dtypes_balance_and_determinism():
    x, y = generate_images(np.random.default_rng(0), K, 1003, glyph_seed=5)
    assert x.shape == (1003, IMAGE_SIZE, IMAGE_SIZE, 1) and x.dtype == np.float32
    assert y.shape == (1003,) and y.dtype == np.int32
    counts = np.bincount(y, minlength=K)
    assert counts.sum() == 1003 and set(counts) == {100, 101}
    # Labels are shuffled, not in blocks.
    assert np.mean(y[1:] == y[:-1]) < 0.2
    x2, y2 = generate_images(np.random.default_rng(0), K, 1003, glyph_seed=5)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    x3, _ = generate_images(np.random.default_rng(1), K, 1003, glyph_seed=5)
    assert not np.array_equal(x, x3)
    a, b = ImageTask(CFG), ImageTask(CFG)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    c = ImageTask(dataclasses.replace(CFG, seed=1))
    assert not np.array_equal(a.glyphs, c.glyphs)
    assert not np.array_equal(a.x_train, c.x_train)
    assert a.x_test.shape == (1024, IMAGE_SIZE, IMAGE_SIZE, 1)


def test_glyphs_differ_between_classes_at_every_shift():
    g = make_glyphs(K, seed=0)
    assert g.shape == (K, IMAGE_SIZE, IMAGE_SIZE)
    assert g.min() >= 0 and (g.max(axis=(1, 2)) == 1).all()
    np.testing.assert_array_equal(g, make_glyphs(K, seed=0))
    assert not np.allclose(g, make_glyphs(K, seed=1))
    # Cosine similarity of every pair of classes, at every relative shift of up to the
    # margin of 3 pixels: below make_glyphs' bound, and clearly below 1.
    sims = []
    for i in range(K):
        for j in range(i):
            for dy in range(-3, 4):
                for dx in range(-3, 4):
                    h = shifted(g[i], dy, dx)
                    sims.append((h * g[j]).sum() / np.linalg.norm(g[i]) / np.linalg.norm(g[j]))
    assert max(sims) <= 0.8 + 1e-9
    # Each glyph has a few strokes of ink, not a blank or a filled square.
    ink = (g > 0.5).sum(axis=(1, 2))
    assert ink.min() >= 10 and ink.max() <= 80


def test_examples_are_shifted_scaled_glyphs_plus_noise():
    rng = np.random.default_rng(3)
    glyphs = make_glyphs(K, seed=2).astype(np.float32)
    # Clean: every example is its own class's glyph at one of the 5 x 5 shifts.
    x, y = generate_images(rng, K, 300, glyph_seed=2, contrast=(1, 1), distractor=0, noise=0)
    seen = set()
    for xi, yi in zip(x[..., 0], y):
        hits = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                if np.allclose(xi, shifted(glyphs[yi], dy, dx), atol=1e-6)]  # fmt: skip
        assert hits
        seen.update(hits)
    assert len(seen) == 25
    assert (matched_filter_predict(x, glyphs) == y).all()
    # Contrast scales the glyph; noise alone has the requested standard deviation.
    x, y = generate_images(rng, K, 300, glyph_seed=2, contrast=(0.5, 1.5), distractor=0, noise=0)
    scale = x[..., 0].max(axis=(1, 2))
    assert 0.5 - 1e-6 <= scale.min() < 0.6 and 1.4 < scale.max() <= 1.5 + 1e-6
    x, _ = generate_images(rng, K, 300, glyph_seed=2, contrast=(0, 0), distractor=0, noise=0.4)
    assert abs(x.mean()) < 0.01 and x.std() == pytest.approx(0.4, rel=0.02)
    # The default task is hard but well posed: the true glyphs classify ~95% of it.
    x, y = generate_images(rng, K, 2000, glyph_seed=2)
    assert 0.90 < np.mean(matched_filter_predict(x, glyphs) == y) < 0.99


@pytest.mark.parametrize("hidden", [(), (64,), (32, 48)])
def test_cnn_parameter_count(hidden):
    model = CNN(hidden=hidden, num_classes=K)
    x = np.zeros((2, IMAGE_SIZE, IMAGE_SIZE, 1), np.float32)
    # Shapes only: nothing to compile.
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    count = sum(p.size for p in jax.tree.leaves(params))
    # 3x3 convs 1 -> 8 -> 16 channels with biases; two 2x2 pools leave 4 x 4 x 16.
    widths = [(IMAGE_SIZE // 4) ** 2 * 16, *hidden, K]
    dense = sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
    assert count == (9 * 1 * 8 + 8) + (9 * 8 * 16 + 16) + dense
    if hidden == (64,):
        assert count == 18346
    assert jax.eval_shape(model.apply, params, x).shape == (2, K)


class Linear(nn.Module):
    """Logistic regression on the pixels."""

    num_classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


def fit(task: ImageTask, model: nn.Module, steps: int) -> float:
    """Test accuracy after ``steps`` of SGD with momentum on the task's batches."""
    params = jax.jit(model.init)(jax.random.key(0), task.x_test[:1])["params"]
    local = CFG.params["ssgd"].local  # the runner's local optimizer
    tx = optax.sgd(local.learning_rate, momentum=local.momentum)

    def loss(p, x, y):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    for i in range(steps):
        x, y = task.batch(i, 1)
        params, state = step(params, state, x[0], y[0])
    logits = model.apply({"params": params}, task.x_test)
    return float(np.mean(np.asarray(logits.argmax(-1)) == task.y_test))


def test_cnn_beats_a_linear_model():
    task = ImageTask(CFG)
    init_loss, init_acc = task.evaluate(task.init_params())
    assert init_loss == pytest.approx(np.log(K), rel=0.2) and init_acc < 0.2
    cnn = fit(task, task.model, 150)
    linear = fit(task, Linear(K), 150)
    # Measured with seeds 0-5: CNN 0.78-0.82, linear 0.44-0.50; chance is 0.1.
    assert cnn > 0.65
    assert 0.25 < linear < 0.62
    assert cnn - linear > 0.15
    assert task.error_name == "test error"


def test_runs_under_the_training_loop_on_simulated_workers():
    cfg = dataclasses.replace(CFG, workers=2, batch_size=8, steps=10, eval_every=10)
    task = ImageTask(cfg)
    x, y = task.batch(0, 2)
    assert x.shape == (2, 8, IMAGE_SIZE, IMAGE_SIZE, 1) and y.shape == (2, 8)
    init_loss, _ = task.evaluate(task.init_params())
    result = train(cfg, task, SimBackend(2), "ssgd", progress=False)
    assert result.summary["test_loss"] < init_loss
