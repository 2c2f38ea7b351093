"""Optax's contract for shoal's transformations (after optax/contrib/_common_test.py):
they optimise a parabola, survive inject_hyperparams, and tree_map_params; and the
contract every shoal transformation shares: a collective is a Collective (never a
callable), and an update that reads the model refuses a missing params by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shoal.comms import AxisCollective
from shoal.optim import (
    allreduce_gradients,
    bfb_allreduce,
    bmuf,
    bmuf_gtc,
    demo,
    diloco,
    gradient_noise_scale,
    gtc,
    onebit_adam,
    onebit_lamb,
    partial_exchange,
    peer_averaging,
    powersgd,
    skip_nonfinite,
    sma,
    streaming_diloco,
    topk,
)

N = 4
COLL = AxisCollective("workers", N)

LR = 0.05
BMUF_STATIC = ("block_size", "nesterov", "nbm", "warmup_steps", "reset_inner_state")

# name -> (factory, kwargs, static_args for inject_hyperparams, chained before sgd?)
UNDER_TEST = {
    "allreduce_gradients": (allreduce_gradients, {}, (), True),
    "gtc": (gtc, {"threshold": 0.05, "capacity": 1.0}, ("capacity",), True),
    "bmuf": (
        lambda **kw: bmuf(optax.sgd(LR), **kw),
        {"block_size": 4},
        (),
        False,
    ),
    # Decaying learning rates: the compressed momentum is +-scale, never 0, so a constant
    # rate keeps the iterate jittering around the optimum.
    "onebit_lamb": (
        onebit_lamb,
        {"learning_rate": optax.linear_schedule(0.05, 0.0, 1500), "freeze_step": 300},
        ("freeze_step",),
        False,
    ),
    "onebit_adam": (
        onebit_adam,
        {"learning_rate": optax.linear_schedule(0.05, 0.0, 1500), "freeze_step": 300},
        ("freeze_step",),
        False,
    ),
    "bfb_allreduce": (bfb_allreduce, {"buffer_bytes": 8}, (), True),
    # One leaf here: only the whole tree fits a bin.
    "partial_exchange": (partial_exchange, {"budget_fraction": 1.0}, ("budget_fraction",), True),
    "gradient_noise_scale": (gradient_noise_scale, {"local_batch_size": 8}, (), True),
    "peer_averaging": (
        lambda **kw: peer_averaging(optax.sgd(LR), **kw),
        {"strategy": "random", "staleness": 1},
        (),
        False,
    ),
    "sma": (lambda **kw: sma(optax.sgd(LR), **kw), {"alpha": 0.5}, (), False),
    "diloco": (
        lambda **kw: diloco(optax.sgd(LR), outer=optax.sgd(0.7, momentum=0.9, nesterov=True), **kw),
        {"sync_every": 4},
        (),
        False,
    ),
    "topk": (topk, {"fraction": 0.5}, ("fraction", "chunk_size", "value_bits"), True),
    "powersgd": (
        powersgd,
        {"rank": 1},
        ("rank", "start_step", "warm_start", "min_compression", "seed"),
        True,
    ),
    # sign(mean momentum) steps are +-lr: decay the rate so the iterate settles.
    "demo": (
        lambda **kw: optax.chain(demo(**kw), optax.sgd(optax.linear_schedule(0.05, 0.0, 1500))),
        {"chunk_size": 4, "topk": 2, "momentum": 0.9},
        (),
        False,
    ),
}


# GTC sends at most +-threshold per step and keeps the rest as a residual, which acts
# like a large momentum when gradients dwarf the threshold: give it a flatter parabola.
LOSS_SCALE = {"gtc": 0.01}
OUTER_LR = {"gtc": 0.5}


def make(name):
    factory, kwargs, _, chained = UNDER_TEST[name]
    tx = factory(collective=COLL, **kwargs)
    return optax.chain(tx, optax.sgd(OUTER_LR.get(name, LR))) if chained else tx


def on_workers(fn, *args):
    """Run ``fn`` on N simulated workers that all hold the same ``args``."""
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *jnp.shape(x))), args)
    return jax.vmap(fn, axis_name="workers")(*stacked)


@pytest.mark.parametrize("name", UNDER_TEST)
def test_optimises_parabola(name):
    tx = make(name)
    target = jnp.array([1.0, -1.0, 1.0])
    scale = LOSS_SCALE.get(name, 1.0)
    grad = jax.grad(lambda p: scale * jnp.sum((p - target) ** 2))

    @jax.jit
    def run(params):
        def body(carry, _):
            p, s = carry
            u, s = tx.update(grad(p), s, p)
            return (optax.apply_updates(p, u), s), None

        state = optax.tree_utils.tree_map_params(tx, lambda v: v, tx.init(params))
        (p, _), _ = jax.lax.scan(body, (params, state), None, length=1500)
        return p

    # optax's start is [-1, 10, 1]: its last coordinate starts at the optimum, where the
    # gradient is exactly 0 forever. 1-bit Adam/LAMB freeze that variance at 0 and then
    # divide the +-scale compressed momentum by eps (see their `momentum_mask`).
    p = on_workers(run, jnp.array([-1.0, 10.0, 3.0]))
    np.testing.assert_allclose(p, np.broadcast_to(target, (N, 3)), rtol=3e-2, atol=3e-2)


INJECTABLE = {
    "allreduce_gradients": UNDER_TEST["allreduce_gradients"][:3],
    "gtc": UNDER_TEST["gtc"][:3],
    "bmuf": (bmuf, {"inner": optax.sgd(LR), "block_size": 1}, BMUF_STATIC),
    "onebit_lamb": (onebit_lamb, {"learning_rate": 0.01, "freeze_step": 1}, ("freeze_step",)),
    "onebit_adam": (onebit_adam, {"learning_rate": 0.01, "freeze_step": 1}, ("freeze_step",)),
    "bfb_allreduce": (bfb_allreduce, {"buffer_bytes": 12}, ("buffer_bytes",)),
    "partial_exchange": (partial_exchange, {"budget_fraction": 0.8}, ("budget_fraction",)),
    "gradient_noise_scale": (gradient_noise_scale, {"local_batch_size": 8}, ()),
    "peer_averaging": (
        peer_averaging,
        {"inner": optax.sgd(LR), "strategy": "random", "staleness": 1},
        ("strategy", "staleness", "seed"),
    ),
    "sma": (sma, {"inner": optax.sgd(LR), "alpha": 0.5}, ()),
    "topk": UNDER_TEST["topk"][:3],
    "powersgd": UNDER_TEST["powersgd"][:3],
    "demo": (demo, {"chunk_size": 4, "topk": 2}, ("chunk_size", "topk", "sign")),
    "diloco": (
        diloco,
        {"inner": optax.sgd(LR), "outer": optax.sgd(1.0), "sync_every": 1},
        ("sync_every",),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", INJECTABLE)
def test_can_be_wrapped_in_inject_hyperparams(name):
    factory, kwargs, static = INJECTABLE[name]
    params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), -jnp.ones((2, 5, 2)) * 0.5]
    plain = factory(collective=COLL, **kwargs)
    injected = optax.inject_hyperparams(factory, static_args=static)(collective=COLL, **kwargs)

    def step(tx, g, p):
        state = tx.init(p)
        return tx.update(g, state, p)

    u, s = jax.jit(lambda g, p: on_workers(lambda g, p: step(plain, g, p), g, p))(grads, params)
    ui, si = jax.jit(lambda g, p: on_workers(lambda g, p: step(injected, g, p), g, p))(
        grads, params
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), u, ui)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4), s, si.inner_state)


# name -> factory(collective) of every communicating transformation; bmuf_gtc gets the
# collective as both tiers.
FACTORIES = {
    "allreduce_gradients": lambda c: allreduce_gradients(collective=c),
    "bfb_allreduce": lambda c: bfb_allreduce(collective=c),
    "bmuf": lambda c: bmuf(optax.sgd(LR), collective=c, block_size=2),
    "bmuf_gtc": lambda c: bmuf_gtc(optax.sgd(LR), intra=c, inter=c, block_size=2, threshold=0.1),
    "demo": lambda c: demo(collective=c),
    "diloco": lambda c: diloco(optax.sgd(LR), collective=c, sync_every=2, outer=optax.sgd(1.0)),
    "gradient_noise_scale": lambda c: gradient_noise_scale(collective=c, local_batch_size=8),
    "gtc": lambda c: gtc(0.1, collective=c),
    "onebit_adam": lambda c: onebit_adam(0.01, collective=c, freeze_step=1),
    "onebit_lamb": lambda c: onebit_lamb(0.01, collective=c, freeze_step=1),
    "partial_exchange": lambda c: partial_exchange(1.0, collective=c),
    "peer_averaging": lambda c: peer_averaging(optax.sgd(LR), collective=c),
    "powersgd": lambda c: powersgd(1, collective=c),
    "skip_nonfinite": lambda c: skip_nonfinite(optax.sgd(LR), collective=c),
    "sma": lambda c: sma(optax.sgd(LR), collective=c),
    "streaming_diloco": lambda c: streaming_diloco(
        optax.sgd(LR), collective=c, sync_every=2, outer=optax.sgd(1.0), num_fragments=1
    ),
    "topk": lambda c: topk(0.5, collective=c),
}
# Those whose update reads the model: a missing params is refused by name.
NEEDS_PARAMS = (
    "bmuf",
    "bmuf_gtc",
    "diloco",
    "onebit_adam",
    "onebit_lamb",
    "peer_averaging",
    "sma",
    "streaming_diloco",
)


def test_every_transformation_is_listed():
    import inspect

    import shoal.optim as optim

    helpers = {
        "noise_scale",
        "onebit_moments",
        "peer_permutation",
        "pgx_partition",
        "update_and_apply",
    }
    public = {n for n in optim.__all__ if inspect.isfunction(getattr(optim, n))} - helpers
    assert set(FACTORIES) == public


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_collective_must_be_a_collective_not_a_callable(name):
    # optax.inject_hyperparams would call a callable argument as a schedule.
    with pytest.raises(TypeError, match="shoal Collective object, not a callable"):
        FACTORIES[name](lambda x: x)
    with pytest.raises(TypeError, match=r"must be a shoal Collective \(missing \.size.*got str"):
        FACTORIES[name]("workers")


@pytest.mark.parametrize("name", NEEDS_PARAMS)
def test_params_are_required(name):
    # Refused at trace time, before any collective runs.
    params = {"w": jnp.zeros((2, 3))}
    if name == "bmuf_gtc":  # two tiers: groups of one, two groups
        tx = bmuf_gtc(optax.sgd(LR), intra=AxisCollective("member", 1),
                      inter=AxisCollective("workers", 2), block_size=2, threshold=0.1)  # fmt: skip
    else:
        tx = FACTORIES[name](AxisCollective("workers", 2))
    state = jax.vmap(tx.init)(params)
    update = jax.vmap(lambda g, s: tx.update(g, s), axis_name="workers")
    with pytest.raises(ValueError, match=f"^{name} needs params: call update"):
        update(params, state)
