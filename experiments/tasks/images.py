"""A small image classification task (``task="images"``): a CNN labels procedurally drawn
16x16 glyphs.

Each class is one fixed random glyph: a few blurred strokes drawn once from the seed.
An example is its class glyph shifted by up to ``max_shift`` pixels in each direction,
scaled in contrast, with a random distractor blob and Gaussian pixel noise on top. The
class lives in the spatial arrangement of the strokes, not in any fixed pixel, so a
convolutional network with pooling does much better than a linear model on the pixels.

Glyphs and examples are generated from the config's seed with NumPy; nothing is
downloaded.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from shoal.experiments.config import Config
from shoal.experiments.tasks.classifier import ClassifierTask

IMAGE_SIZE = 16


def _strokes(size: int, segments: np.ndarray, width: float) -> np.ndarray:
    """``[size, size]`` image of blurred line segments ``[s, 2 (end), 2 (row, col)]``:
    each pixel takes ``exp(-d^2 / (2 width^2))`` of its distance ``d`` to the nearest one."""
    grid = np.stack(np.meshgrid(np.arange(size), np.arange(size), indexing="ij"), -1)
    p = grid.reshape(-1, 1, 2).astype(np.float64)  # [pixels, 1, 2]
    a, b = segments[None, :, 0], segments[None, :, 1]  # [1, s, 2]
    ab = b - a
    t = np.clip(((p - a) * ab).sum(-1) / np.maximum((ab**2).sum(-1), 1e-12), 0.0, 1.0)
    d2 = ((p - a - t[..., None] * ab) ** 2).sum(-1).min(-1)
    return np.exp(-d2 / (2 * width**2)).reshape(size, size)


def make_glyphs(
    num_classes: int,
    size: int = IMAGE_SIZE,
    *,
    seed: int = 0,
    strokes: int = 3,
    margin: int = 3,
    width: float = 0.7,
    max_similarity: float = 0.8,
) -> np.ndarray:
    """``[num_classes, size, size]`` float64 glyphs in ``[0, 1]`` (peak 1), one per class,
    from ``seed``: ``strokes`` connected blurred segments (a random polyline) with vertices
    in the square ``[margin, size - 1 - margin]``, so the strokes of a glyph shifted by up
    to ``margin`` pixels stay in the frame.

    A candidate is redrawn while its cosine similarity with an earlier glyph, at any
    relative shift of up to ``margin`` pixels, exceeds ``max_similarity``: two classes
    are never near-copies of each other up to a translation.
    """
    if size - 1 - 2 * margin < 2:
        raise ValueError(f"size must be at least 2 * margin + 3 = {2 * margin + 3}, got {size}")
    rng = np.random.default_rng([seed, 3])
    glyphs: list[np.ndarray] = []
    for _ in range(1000 * num_classes):
        points = rng.uniform(margin, size - 1 - margin, size=(strokes + 1, 2))
        g = _strokes(size, np.stack([points[:-1], points[1:]], 1), width)
        g /= g.max()  # vertices fall between pixel centres
        if all(_max_shifted_similarity(g, h, margin) <= max_similarity for h in glyphs):
            glyphs.append(g)
            if len(glyphs) == num_classes:
                return np.stack(glyphs)
    raise ValueError(
        f"could not draw {num_classes} glyphs with max_similarity = {max_similarity}; "
        "lower num_classes or raise max_similarity"
    )


@functools.lru_cache(maxsize=16)
def _glyphs(num_classes: int, size: int, seed: int) -> np.ndarray:
    # The rejection sampling takes seconds for many classes; train and test share it.
    glyphs = make_glyphs(num_classes, size, seed=seed)
    glyphs.flags.writeable = False
    return glyphs


def _max_shifted_similarity(g: np.ndarray, h: np.ndarray, max_shift: int) -> float:
    # Cosine similarity of h with g shifted by up to max_shift pixels, zeros shifted in.
    size = g.shape[0]
    canvas = np.pad(g, max_shift)
    dots = [
        (canvas[dy : dy + size, dx : dx + size] * h).sum()
        for dy in range(2 * max_shift + 1)
        for dx in range(2 * max_shift + 1)
    ]
    return float(max(dots) / (np.linalg.norm(g) * np.linalg.norm(h)))


def generate_images(
    rng: np.random.Generator,
    num_classes: int,
    n: int,
    size: int = IMAGE_SIZE,
    *,
    glyph_seed: int = 0,
    max_shift: int = 2,
    contrast: tuple[float, float] = (0.5, 1.5),
    distractor: float = 1.0,
    noise: float = 0.4,
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` labelled examples: ``(x [n, size, size, 1] float32, y [n] int32)``.

    The glyphs come from ``glyph_seed`` (`make_glyphs`), everything else from ``rng``, so
    calls with the same ``glyph_seed`` draw from the same distribution. Labels are
    balanced (``n // num_classes`` or one more per class) in random order. Example ``i``
    is ``c_i * shift(glyph[y_i]) + b_i * blob_i + noise * N(0, I)``, with the shift
    uniform in ``{-max_shift..max_shift}^2``, contrast ``c_i ~ U(contrast)``, and a
    Gaussian blob (sd 1.5 pixels) at a uniform position with height ``b_i ~ U(0,
    distractor)``.
    """
    if max_shift < 0:
        raise ValueError(f"max_shift must be an int >= 0, got {max_shift}")
    glyphs = _glyphs(num_classes, size, glyph_seed).astype(np.float32)
    y = rng.permutation(np.arange(n) % num_classes)
    # Integer shifts as crops of a zero-padded canvas.
    canvas = np.pad(glyphs, ((0, 0), (max_shift, max_shift), (max_shift, max_shift)))
    dy, dx = rng.integers(0, 2 * max_shift + 1, size=(2, n))
    rows = dy[:, None] + np.arange(size)
    cols = dx[:, None] + np.arange(size)
    x = canvas[y[:, None, None], rows[:, :, None], cols[:, None, :]]
    x *= rng.uniform(*contrast, size=(n, 1, 1)).astype(np.float32)
    # A stroke-sized bump that belongs to no class: "is there ink here" is not enough.
    centre = rng.uniform(0, size - 1, size=(n, 2, 1, 1)).astype(np.float32)
    grid = np.arange(size, dtype=np.float32)
    d2 = (grid[:, None] - centre[:, 0]) ** 2 + (grid[None, :] - centre[:, 1]) ** 2
    height = rng.uniform(0, distractor, size=(n, 1, 1)).astype(np.float32)
    x += height * np.exp(-d2 / np.float32(2 * 1.5**2))
    x += np.float32(noise) * rng.standard_normal(size=x.shape, dtype=np.float32)
    return x[..., None], y.astype(np.int32)


def matched_filter_predict(x: np.ndarray, glyphs: np.ndarray, max_shift: int = 2) -> np.ndarray:
    """The class whose glyph, at some shift of up to ``max_shift`` pixels, best explains
    each image ``x [n, size, size, 1]`` up to a contrast: the argmax over classes and
    shifts of ``<x, g> / |g|`` (least squares over the contrast; it ignores the distractor
    and the contrast range, so it is a near-Bayes reference, not the exact optimum)."""
    k, size = glyphs.shape[0], glyphs.shape[1]
    canvas = np.pad(glyphs, ((0, 0), (max_shift, max_shift), (max_shift, max_shift)))
    x = np.asarray(x, np.float64)[..., 0]
    best = np.full((len(x), k), -np.inf)
    for dy in range(2 * max_shift + 1):
        for dx in range(2 * max_shift + 1):
            g = canvas[:, dy : dy + size, dx : dx + size]
            g = g / np.linalg.norm(g.reshape(k, -1), axis=1)[:, None, None]
            best = np.maximum(best, np.einsum("nij,kij->nk", x, g))
    return best.argmax(-1)


def _max_pool_2x2(x):
    # A reshape and a max instead of nn.max_pool: the gradient of the latter
    # (select_and_scatter) made a vmapped training step ~1.5x slower on CPU.
    b, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def _conv_stages(x, channels: tuple[int, ...]):
    """3x3 convolution + ReLU + 2x2 max-pool per entry of ``channels``, then flattened:
    the feature extractor `CNN` and `EvenCNN` share (called inside their ``compact``)."""
    for c in channels:
        x = _max_pool_2x2(nn.relu(nn.Conv(c, (3, 3), padding="SAME")(x)))
    return x.reshape(x.shape[0], -1)


class CNN(nn.Module):
    """Two 3x3 convolution + ReLU + 2x2 max-pool stages (``channels``), then ReLU dense
    layers of the ``hidden`` widths and ``num_classes`` logits."""

    hidden: tuple[int, ...]
    num_classes: int
    channels: tuple[int, ...] = (8, 16)

    @nn.compact
    def __call__(self, x):  # [batch, height, width, 1] -> [batch, classes]
        x = _conv_stages(x, self.channels)
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class BlockDense(nn.Module):
    """``Dense(features)`` whose kernel and bias are stored as ``blocks`` column blocks
    (``blocks`` leaves each): the same layer, but partial gradient exchange, which packs
    whole leaves into bins, gets leaves of ``1 / blocks`` of its size."""

    features: int
    blocks: int

    @nn.compact
    def __call__(self, x):
        if self.features % self.blocks:
            raise ValueError(f"blocks={self.blocks} must divide features={self.features}")
        width = self.features // self.blocks
        return jnp.concatenate([nn.Dense(width)(x) for _ in range(self.blocks)], axis=-1)


class EvenCNN(nn.Module):
    """`CNN` (two conv stages, one hidden dense layer) with the hidden layer as a
    `BlockDense` of ``blocks`` column blocks. With hidden width 64 and 16 blocks the
    largest leaf is 6% of the parameters (the second convolution's kernel), so partial
    gradient exchange works down to a fraction of 0.1; as a function it is `CNN`."""

    num_classes: int
    hidden: int = 64
    blocks: int = 16
    channels: tuple[int, ...] = (8, 16)

    @nn.compact
    def __call__(self, x):  # [batch, height, width, 1] -> [batch, classes]
        x = nn.relu(BlockDense(self.hidden, self.blocks)(_conv_stages(x, self.channels)))
        return nn.Dense(self.num_classes)(x)


class ImageTask(ClassifierTask):
    """`CNN` on `generate_images` glyphs of ``IMAGE_SIZE`` pixels a side.

    Reads ``num_classes``, ``train_size``, ``test_size``, ``cnn`` ("small": `CNN` with
    dense widths ``hidden`` after the convolutions; "even": `EvenCNN`) and ``seed``
    (glyphs and examples); train and test share the glyphs.
    """

    error_name = "test error"

    def __init__(self, cfg: Config):
        self.glyphs = _glyphs(cfg.num_classes, IMAGE_SIZE, cfg.seed_of_data)
        rng = np.random.default_rng([cfg.seed_of_data, 2])
        draw = lambda n: generate_images(rng, cfg.num_classes, n, glyph_seed=cfg.seed_of_data)
        self.x_train, self.y_train = draw(cfg.train_size)
        self.x_test, self.y_test = draw(cfg.test_size)
        if cfg.cnn == "even":
            model = EvenCNN(num_classes=cfg.num_classes)
        else:
            model = CNN(hidden=cfg.hidden, num_classes=cfg.num_classes)
        example = jnp.zeros((1, IMAGE_SIZE, IMAGE_SIZE, 1), jnp.float32)
        super().__init__(cfg, model, example)

    def references(self) -> dict[str, float]:
        """Test error of a classifier that knows the true glyphs."""
        pred = matched_filter_predict(self.x_test, self.glyphs)
        return {
            "test error, true glyphs, matched filter over shifts": float(
                np.mean(pred != self.y_test)
            )
        }
