"""Your own model and data in ``shoal-run``: a small decoder-only transformer written with
flax.nnx, trained on sequences from a NumPy pipeline of this file, with every runner
feature (simulated, MPI or jax.distributed workers, checkpoints and ``--resume``, exact
bytes, reports and plots, the cost-model projection)::

    shoal-run examples/own_model.py --workers 4 --set steps=30 --out runs/own
    mpiexec -n 2 shoal-run examples/own_model.py --backend mpi --set steps=30
    shoal-run examples/own_model.py --set width=128 depth=4 algorithms=diloco
    shoal-run examples/own_model.py --set steps=40 diloco.sync_every=20 muloco.sync_every=20

A config file that defines ``get_task(config)`` trains on what it returns: an object with
``init_params()``, ``loss(params, x, y)``, ``batch(step, workers)`` and
``evaluate(params)`` (`shoal.experiments.tasks.Task`). ``--task module.path:factory``
names such a factory in any importable module instead. The config may be a subclass of
`shoal.experiments.config.Config` with fields of its own (here the model's sizes): they
are ``--set`` keys, type-checked, and part of what ``--resume`` compares.

The data: token sequences from a seeded Markov chain over ``VOCAB`` tokens in which each
token is followed by one of ``SUCCESSORS`` likely tokens (so a model can learn it: the
loss falls from ln 64 = 4.16 towards the chain's entropy, printed as ``entropy`` in the
report's data section), split into training and held-out test sequences.

The algorithms: S-SGD, DiLoCo (AdamW inside) and MuLoCo (Muon inside), the last two
syncing every ``SYNC_EVERY`` steps; each one's hyper-parameters are in ``params``
(``--set diloco.sync_every=...`` changes one for a run).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

from shoal.experiments.config import Config

VOCAB = 64
SUCCESSORS = 4
# DiLoCo's and MuLoCo's inner steps per outer step; steps must be a multiple of it.
SYNC_EVERY = 10


@dataclasses.dataclass(frozen=True)
class OwnConfig(Config):
    """The run's config plus this model's sizes (``--set width=128``)."""

    width: int = 64
    depth: int = 2
    heads: int = 4
    context: int = 32


class Block(nnx.Module):
    """Pre-LayerNorm block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
    """Token and position embeddings, ``depth`` causal blocks, logits over the tokens."""

    def __init__(self, cfg: OwnConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(VOCAB, cfg.width, embedding_init=init, rngs=rngs)
        self.pos = nnx.Param(init(rngs.params(), (cfg.context, cfg.width)))
        self.blocks = nnx.List([Block(cfg.width, cfg.heads, rngs) for _ in range(cfg.depth)])
        self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        # A small output layer: the loss starts near ln VOCAB, every token equally likely.
        self.head = nnx.Linear(cfg.width, VOCAB, kernel_init=init, rngs=rngs)

    def __call__(self, tokens):  # [batch, time] int32 -> [batch, time, VOCAB]
        x = self.embed(tokens) + self.pos[...][: tokens.shape[-1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def markov_chain(seed: int) -> np.ndarray:
    """``[VOCAB, VOCAB]`` transition probabilities: each row puts 90% of its mass on
    ``SUCCESSORS`` tokens, the rest spread over all."""
    rng = np.random.default_rng([seed, 7])
    p = np.full((VOCAB, VOCAB), 0.1 / VOCAB)
    for row in p:
        row[rng.choice(VOCAB, SUCCESSORS, replace=False)] += 0.9 / SUCCESSORS
    return p / p.sum(1, keepdims=True)


def sample(p: np.ndarray, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` sequences of ``length`` tokens of the chain ``p``, ``[count, length]``."""
    out = np.empty((count, length), np.int32)
    out[:, 0] = rng.integers(VOCAB, size=count)
    cdf = p.cumsum(1)
    for t in range(1, length):
        u = rng.random(count)[:, None]
        out[:, t] = np.minimum((u > cdf[out[:, t - 1]]).sum(1), VOCAB - 1)
    return out


class OwnTask:
    """Next-token prediction on the Markov chain's sequences with `TinyLM`."""

    error_name = "next-token error"

    def __init__(self, cfg: OwnConfig):
        self.cfg = cfg
        # The data from seed_of_data, the model and batches from seed: --seeds 0,1,2 then
        # repeats the run from other initial models and batch orders on the same data.
        self.chain = markov_chain(cfg.seed_of_data)
        rng = np.random.default_rng([cfg.seed_of_data, 8])
        # context + 1 tokens: the input and its shift by one.
        self.train = sample(self.chain, cfg.train_size, cfg.context + 1, rng)
        self.test = sample(self.chain, cfg.test_size, cfg.context + 1, rng)
        model = TinyLM(cfg, nnx.Rngs(cfg.seed))
        self.graph, state = nnx.split(model, nnx.Param)
        # Plain nested dicts of arrays: what shoal's transformations and checkpoints see.
        self.params = nnx.to_pure_dict(state)
        self._metrics = jax.jit(self._loss_and_accuracy)

    def init_params(self):
        return self.params

    def _loss_and_accuracy(self, params, x, y):
        logits = nnx.merge(self.graph, params)(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (logits.argmax(-1) == y).mean()

    def loss(self, params, x, y):
        return self._loss_and_accuracy(params, x, y)[0]

    def batch(self, step: int, workers: int):
        # Each step's rows drawn from (seed, step): the same on every process, and a
        # resumed run sees the batches it would have seen.
        rng = np.random.default_rng([self.cfg.seed, 9, step])
        idx = rng.integers(len(self.train), size=(workers, self.cfg.batch_size))
        w = self.train[idx]
        return w[..., :-1], w[..., 1:]

    def evaluate(self, params):
        loss, acc = self._metrics(params, self.test[:, :-1], self.test[:, 1:])
        return {"loss": float(loss), "accuracy": float(acc), "perplexity": float(np.exp(loss))}

    def corpus_info(self):
        p = self.chain
        entropy = -(p * np.log(p)).sum(1).mean()
        return {
            "data": f"a seeded Markov chain over {VOCAB} tokens, {SUCCESSORS} likely successors",
            "entropy": f"{entropy:.3f} nats per token (the best loss a model can reach)",
            "sequences": f"{self.cfg.train_size} training, {self.cfg.test_size} test, "
            f"{self.cfg.context} tokens each",
        }


def get_task(cfg: OwnConfig) -> OwnTask:
    return OwnTask(cfg)


def get_config() -> OwnConfig:
    return OwnConfig(
        name="own_model",
        algorithms=("ssgd", "diloco", "muloco"),
        workers=4,
        steps=60,  # a multiple of SYNC_EVERY: DiLoCo and MuLoCo end on an outer step
        batch_size=16,
        train_size=4096,
        test_size=512,
        eval_every=10,
        # S-SGD: momentum SGD at 0.1. DiLoCo: AdamW at 3e-3 inside; MuLoCo: Muon on the
        # matrices inside (its default 0.02), AdamW at 3e-3 on the other leaves; both the
        # outer Nesterov SGD (0.7, 0.9) every SYNC_EVERY steps.
        params={
            "ssgd": {"local": {"learning_rate": 0.1}},
            "diloco": {"sync_every": SYNC_EVERY, "inner": {"adamw": {"learning_rate": 3e-3}}},
            "muloco": {"sync_every": SYNC_EVERY, "inner": {"adam_learning_rate": 3e-3}},
        },
    )
