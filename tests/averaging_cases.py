"""Shared cases of the model-averaging tests (peer averaging, SMA): per-worker models and
gradients, the local optimizers the NumPy oracles model, and a scan over steps."""

import numpy as np
import optax
from harness import n_workers, run_workers
from jax import lax

from shoal.comms import wire_bytes

N = n_workers()
LR = 0.1
N_BYTES = 4 * (3 + 2 * 3)  # the float32 leaves b [3] and w [2, 3]
# name -> (optax inner, momentum, weight decay) for the oracle. Weight decay reads the
# params, so it shows whether the inner update sees the model before or after averaging.
INNERS = {
    "sgd": (lambda: optax.sgd(LR), 0.0, 0.0),
    "momentum_wd": (
        lambda: optax.chain(optax.add_decayed_weights(0.5), optax.sgd(LR, momentum=0.9)),
        0.9,
        0.5,
    ),
}


def make_case(seed: int, steps: int):
    """Different models per worker (so every exchange shows in the values) and gradients
    ``[N, steps, ...]``."""
    rng = np.random.default_rng(seed)
    p0 = {
        "b": rng.normal(size=(N, 3)).astype(np.float32),
        "w": rng.normal(size=(N, 2, 3)).astype(np.float32),
    }
    grads = {
        "b": rng.normal(size=(N, steps, 3)).astype(np.float32),
        "w": rng.normal(size=(N, steps, 2, 3)).astype(np.float32),
    }
    return p0, grads


def flat(p):
    """Param tree (leading axes allowed) -> vector in jax.tree.leaves order: b, then w."""
    b, w = np.asarray(p["b"]), np.asarray(p["w"])
    return np.concatenate([b, w.reshape(*w.shape[:-2], -1)], -1)


def train(make_tx, p0, grads):
    """Every worker runs ``make_tx(collective)`` over its gradients; returns
    ``{rank: ((params after each step, wire bytes of each step), final state)}``."""

    def worker(coll, p0, grads):
        tx = make_tx(coll)
        state = tx.init(p0)

        def body(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            return (p, s), (p, wire_bytes(s, "step"))

        (_, state), traj = lax.scan(body, (p0, state), grads)
        return traj, state

    return run_workers(worker, p0, grads)
