"""An acoustic-modelling stand-in (``task="hmm"``): an LSTM labels every frame of
sequences drawn from a hidden Markov model with Gaussian emissions.

In speech, frames are emitted by phonetic states (senones) that last several frames
and follow each other in a constrained order, and an acoustic model predicts the state
of every frame. The generated data has the same structure at CPU scale: ``num_classes``
states, each staying put with probability ``hmm_self_loop`` and otherwise moving to one
of ``hmm_successors`` other states; frames are ``num_features``-dimensional unit
Gaussians around per-state means. With weak emissions (small ``class_sep``) one frame
says little, and the context of earlier frames is what a good model exploits: compare
`HMM.frame_ml_error` with `HMM.filter_error`, the causal Bayes floor.

The model and the data are generated from the config's seed with NumPy; nothing is
downloaded.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from shoal.experiments.config import Config
from shoal.experiments.tasks.classifier import ClassifierTask


@dataclasses.dataclass(frozen=True)
class HMM:
    """A hidden Markov model with isotropic unit-variance Gaussian emissions."""

    initial: np.ndarray  # [K] probabilities of the first state
    transitions: np.ndarray  # [K, K], row i: the distribution of the state after state i
    means: np.ndarray  # [K, F] emission means

    def sample(self, n: int, length: int, rng: np.random.Generator):
        """``n`` sequences of ``length`` frames: ``(x [n, length, F] float32, states [n,
        length] int32)``."""
        k = len(self.initial)
        cum = np.cumsum(self.transitions, axis=1)
        states = np.empty((n, length), np.int64)
        states[:, 0] = rng.choice(k, size=n, p=self.initial)
        for t in range(1, length):
            # Inverse-CDF draw from each sequence's row; the clip guards float round-off.
            u = rng.random(n)[:, None]
            states[:, t] = np.minimum((cum[states[:, t - 1]] < u).sum(axis=1), k - 1)
        x = self.means[states] + rng.normal(size=(n, length, self.means.shape[1]))
        return x.astype(np.float32), states.astype(np.int32)

    def _likelihoods(self, x: np.ndarray) -> np.ndarray:
        # Per-frame emission likelihoods up to a per-frame constant, [n, T, K].
        x = np.asarray(x, np.float64)
        d2 = (x**2).sum(-1)[..., None] - 2 * x @ self.means.T + (self.means**2).sum(-1)
        ll = -0.5 * d2
        return np.exp(ll - ll.max(axis=-1, keepdims=True))

    def frame_ml_error(self, x: np.ndarray, states: np.ndarray) -> float:
        """Frame error of labelling each frame by its most likely state, without context."""
        return float(np.mean(self._likelihoods(x).argmax(-1) != states))

    def filter_error(self, x: np.ndarray, states: np.ndarray) -> float:
        """Frame error of the causal Bayes classifier: the argmax of the forward-filtered
        posterior ``p(s_t | x_1..x_t)``, the best any model reading the frames left to
        right (such as a unidirectional LSTM) can do on average."""
        e = self._likelihoods(x)
        alpha = self.initial * e[:, 0]
        wrong = 0
        for t in range(x.shape[1]):
            if t:
                alpha = (alpha @ self.transitions) * e[:, t]
            alpha = alpha / np.maximum(alpha.sum(-1, keepdims=True), np.finfo(float).tiny)
            wrong += int(np.sum(alpha.argmax(-1) != states[:, t]))
        return wrong / states.size


def random_hmm(
    *, states: int, features: int, self_loop: float, successors: int, sep: float, seed: int
) -> HMM:
    """A seeded sticky HMM: uniform first state; from state ``i``, stay with probability
    ``self_loop`` or move to one of ``successors`` distinct other states, drawn at random,
    with Dirichlet(1) weights; emission means drawn from ``N(0, sep^2 I)``."""
    rng = np.random.default_rng([seed, 0])
    a = np.zeros((states, states))
    for i in range(states):
        others = np.delete(np.arange(states), i)
        nxt = rng.choice(others, size=successors, replace=False)
        a[i, nxt] = (1.0 - self_loop) * rng.dirichlet(np.ones(successors))
        a[i, i] = self_loop
    means = rng.normal(scale=sep, size=(states, features))
    return HMM(np.full(states, 1.0 / states), a, means)


class LSTMFrameClassifier(nn.Module):
    """Stacked unidirectional LSTM layers, then per-frame ``num_classes`` logits."""

    hidden: tuple[int, ...]
    num_classes: int

    @nn.compact
    def __call__(self, x):  # [batch, time, features] -> [batch, time, classes]
        for width in self.hidden:
            x = nn.RNN(nn.OptimizedLSTMCell(width))(x)
        return nn.Dense(self.num_classes)(x)


class HMMFrameTask(ClassifierTask):
    """Frame classification of HMM sequences with `LSTMFrameClassifier`.

    Reads ``num_classes`` (states), ``num_features``, ``class_sep``, ``seq_len``,
    ``hmm_self_loop``, ``hmm_successors``, ``hidden`` (LSTM widths), and ``train_size``,
    ``test_size``, ``batch_size`` counted in sequences. A
    `shoal.experiments.tasks.classifier.ClassifierTask`; ``evaluate`` gives frame accuracy
    (the frame error is one minus it).
    """

    error_name = "frame error"

    def __init__(self, cfg: Config):
        self.hmm = random_hmm(
            states=cfg.num_classes,
            features=cfg.num_features,
            self_loop=cfg.hmm_self_loop,
            successors=cfg.hmm_successors,
            sep=cfg.class_sep,
            seed=cfg.seed_of_data,
        )
        rng = np.random.default_rng([cfg.seed_of_data, 2])
        self.x_train, self.y_train = self.hmm.sample(cfg.train_size, cfg.seq_len, rng)
        self.x_test, self.y_test = self.hmm.sample(cfg.test_size, cfg.seq_len, rng)
        model = LSTMFrameClassifier(hidden=cfg.hidden, num_classes=cfg.num_classes)
        example = jnp.zeros((1, cfg.seq_len, cfg.num_features), jnp.float32)
        super().__init__(cfg, model, example)

    def references(self) -> dict[str, float]:
        """Test frame errors of classifiers that know the true HMM."""
        return {
            "frame error, true HMM, forward filter (causal Bayes)": self.hmm.filter_error(
                self.x_test, self.y_test
            ),
            "frame error, true HMM, each frame alone (max likelihood)": self.hmm.frame_ml_error(
                self.x_test, self.y_test
            ),
        }
