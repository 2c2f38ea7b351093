"""Shared cases of the block-model tests (BMUF, BMUF-GTC, DiLoCo, streaming DiLoCo): a
linear least-squares problem with different data on every worker, its NumPy gradient, the
NumPy oracles of the block (outer) updates, and the workers' training loop.

The oracles run in float64: the per-worker inner steps are the test's own, then
`bmuf_block_update` (Chen & Huo's eqs. (1)-(4)) or `nesterov_outer_step` (DiLoCo's outer
Nesterov SGD on ``theta_g - mean_i theta_i``) at every synchronisation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from shoal.comms import wire_bytes
from shoal.optim import update_and_apply

# bmuf's keyword arguments of each variant of `bmuf_block_update`.
BMUF_VARIANTS = {
    "classic": dict(nesterov=False),
    "seed": dict(nesterov=True, nbm="seed"),
    "chen_huo": dict(nesterov=True, nbm="chen_huo"),
}


@dataclasses.dataclass(frozen=True)
class Linear:
    """``y = x w + b`` with ``K`` outputs: per worker ``x [S, D]``, ``y [S, K]`` and a
    different initial model ``{"b": [K], "w": [D, K]}`` (the workers broadcast rank 0's
    before init), each stacked over the ``N`` workers."""

    x: np.ndarray  # [N, S, D]
    y: np.ndarray  # [N, S, K]
    p0: dict  # {"b": [N, K], "w": [N, D, K]}

    @property
    def n_elements(self) -> int:
        return self.p0["b"].shape[-1] + self.p0["w"][0].size

    @property
    def n_bytes(self) -> int:
        """The float32 bytes of one worker's model."""
        return 4 * self.n_elements

    def grad(self, theta, i):
        """Worker ``i``'s gradient of `loss` at the flat model ``theta`` (`flat`'s order:
        b, then w), in ``theta``'s precision."""
        k = self.p0["b"].shape[-1]
        b, w = theta[:k], theta[k:].reshape(-1, k)
        r = self.x[i] @ w + b - self.y[i]
        return np.concatenate([r.mean(0), (self.x[i].T @ r / self.x.shape[1]).ravel()])


def linear_problem(seed: int, n: int, d: int = 4, k: int = 2, s: int = 8) -> Linear:
    """`Linear` data for ``n`` workers from ``np.random.default_rng(seed)``: the inputs,
    a shared true model plus a per-worker offset, then the initial models."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, s, d)).astype(np.float32)
    y = (x @ rng.normal(size=(d, k)) + rng.normal(size=(n, 1, k))).astype(np.float32)
    p0 = {
        "b": rng.normal(size=(n, k)).astype(np.float32),
        "w": rng.normal(size=(n, d, k)).astype(np.float32),
    }
    return Linear(x, y, p0)


def loss(p, x, y):
    """One worker's mean squared error (halved) of `Linear`'s model."""
    return 0.5 * jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=-1))


def flat(p):
    """`Linear`'s param tree (leading axes allowed) -> vector in jax.tree.leaves order: b,
    then w."""
    b, w = np.asarray(p["b"]), np.asarray(p["w"])
    return np.concatenate([b.reshape(*b.shape[:-1], -1), w.reshape(*w.shape[:-2], -1)], -1)


def bmuf_block_update(w_g, filtered, delta, mean, zeta, eta, eta_next, variant):
    """One BMUF step (Chen & Huo, eqs. (1)-(4)) from the workers' ``mean`` model:
    ``delta = eta delta + zeta (mean - w_g)``, then the new global model: ``w_g + delta``
    (``"classic"``), ``w_g + delta + eta_next delta`` (``"seed"``, Nesterov), or
    ``filtered + eta_next delta`` with ``filtered += delta`` (``"chen_huo"``). Returns
    ``(w_g, filtered, delta)``."""
    delta = eta * delta + zeta * (mean - w_g)
    if variant == "classic":
        w_g = w_g + delta
    elif variant == "seed":
        w_g = w_g + delta + eta_next * delta
    else:
        filtered = filtered + delta
        w_g = filtered + eta_next * delta
    return w_g, filtered, delta


def nesterov_outer_step(theta_g, trace, mean, lr, mu):
    """DiLoCo's outer step: Nesterov SGD (``optax.sgd(lr, momentum=mu, nesterov=True)``)
    on ``delta = theta_g - mean``. Returns ``(theta_g, trace)``."""
    delta = theta_g - mean
    trace = delta + mu * trace
    return theta_g - lr * (delta + mu * trace), trace


def block_worker(make_tx, steps, loss_fn=loss, apply=False, reference=None):
    """Worker fn ``(collective, p0, x, y)`` for `harness.run_workers`: broadcast rank 0's
    params, init ``make_tx(collective)``, then ``steps`` updates on ``loss_fn``. Returns
    the params, ``reference(state)`` (default: the global params) and this step's wire
    bytes after every step, and the final state. ``apply``: each step by
    `update_and_apply` (the params in the synchronisation's branch), else the optax way."""
    if reference is None:
        reference = lambda s: s.global_params  # noqa: E731

    def worker(coll, p0, x, y):
        params = coll.broadcast(p0, 0)
        opt = make_tx(coll)
        state = opt.init(params)

        def body(carry, _):
            p, s = carry
            if apply:
                p, s = update_and_apply(opt, jax.grad(loss_fn)(p, x, y), s, p)
            else:
                u, s = opt.update(jax.grad(loss_fn)(p, x, y), s, p)
                p = optax.apply_updates(p, u)
            return (p, s), (p, reference(s), wire_bytes(s, "step"))

        (_, state), traj = lax.scan(body, (params, state), None, length=steps)
        return traj, state

    return worker


def optax_outer_reference(problem, outer, lr, steps_per_block, blocks, workers):
    """Block training with an optax ``outer`` optimizer: from the float32 global model,
    ``steps_per_block`` SGD steps at ``lr`` on each worker's data (float64), then
    ``outer.update(theta - mean_i theta_i)`` applied to the global model. Returns the
    global model after each block, ``[blocks, n]``."""
    theta = jnp.asarray(flat(problem.p0)[0])
    state = outer.init(theta)
    restarts = []
    for _ in range(blocks):
        local = np.tile(np.asarray(theta, np.float64), (workers, 1))
        for _ in range(steps_per_block):
            local = local - lr * np.stack([problem.grad(local[i], i) for i in range(workers)])
        u, state = outer.update(theta - jnp.asarray(local.mean(0), jnp.float32), state, theta)
        theta = optax.apply_updates(theta, u)
        restarts.append(np.asarray(theta))
    return np.stack(restarts)
