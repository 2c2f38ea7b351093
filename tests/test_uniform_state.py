"""Rank-uniform state held once by simulated workers (`shoal.optim.helpers.uniform_axes`,
`hold_uniform`): DiLoCo's global model, outer state and counters (Streaming DiLoCo's per
fragment, BMUF's global model and block momentum) passed to vmap unbatched give the
stacked run's params and state, over rounds, with a compressed exchange and inside a
chain, to float32 rounding (XLA fuses the unbatched arithmetic otherwise: a multiply-add
contracted differently moves a value by an ulp, and AdamW's steps grow it); a declared
field that would differ per worker is refused at trace time; only the declared fields
are held once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from block_cases import linear_problem, loss
from harness import adamw

from shoal.comms import AxisCollective, Quantized
from shoal.optim import (
    BMUFState,
    DiLoCoState,
    bmuf,
    bmuf_gtc,
    diloco,
    skip_nonfinite,
    streaming_diloco,
    update_and_apply,
)
from shoal.optim.helpers import hold_uniform, uniform_axes

N = 4
PROBLEM = linear_problem(seed=3, n=N)


def outer():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def both_runs(tx, steps):
    """(stacked params, stacked state) and (params, held state) after ``steps`` steps."""
    coll_step = lambda p, s, x, y: update_and_apply(tx, jax.grad(loss)(p, x, y), s, p)
    p0 = jax.tree.map(lambda a: jnp.broadcast_to(a[0], a.shape), PROBLEM.p0)
    stacked = jax.vmap(tx.init, axis_name="workers")(p0)
    held = hold_uniform(stacked)
    axes = uniform_axes(held)
    plain = jax.jit(jax.vmap(coll_step, axis_name="workers"))
    once = jax.jit(
        jax.vmap(coll_step, axis_name="workers", in_axes=(0, axes, 0, 0), out_axes=(0, axes))
    )
    runs = [(p0, stacked), (p0, held)]
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = PROBLEM.x + rng.normal(scale=0.1, size=PROBLEM.x.shape).astype(np.float32)
        runs[0] = plain(*runs[0], x, PROBLEM.y)
        runs[1] = once(*runs[1], x, PROBLEM.y)
    return runs


# Float32 rounding, grown over 7 steps: AdamW divides by sqrt(v) of small gradients.
ULPS = dict(rtol=1e-4, atol=1e-6)


def assert_held_is_stacked(runs):
    (p1, s1), (p2, s2) = runs
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(a, b, **ULPS)

    def compare(axis, a, b):
        if a is None:  # an empty subtree (a fragment's outer state elsewhere)
            assert b is None
            return
        a, b = np.asarray(a), np.asarray(b)
        if axis is None:  # one copy: the stacked run's copies are all equal to it
            assert a.shape == (N, *b.shape)
            for row in a:
                np.testing.assert_allclose(row, b, **ULPS)
        else:
            np.testing.assert_allclose(a, b, **ULPS)

    jax.tree.map(compare, uniform_axes(s2), s1, s2, is_leaf=lambda a: a is None)


@pytest.mark.parametrize(
    ("inner", "exchange"),
    [
        (optax.sgd(0.1, momentum=0.9), None),
        (adamw(1e-2), None),
        (adamw(1e-2), Quantized("fp4", block=2)),
    ],
)
def test_diloco_held_once_is_the_stacked_run(inner, exchange):
    tx = diloco(
        inner,
        collective=AxisCollective("workers", N),
        sync_every=3,
        outer=outer(),
        exchange=exchange,
    )
    runs = both_runs(tx, steps=7)  # two outer steps and a round under way
    assert_held_is_stacked(runs)
    state = runs[1][1]
    assert int(state.rounds) == 2 and int(state.step) == 7
    assert state.global_params["w"].shape == PROBLEM.p0["w"].shape[1:]  # one copy
    assert state.outer_state[0].trace["w"].shape == PROBLEM.p0["w"].shape[1:]


@pytest.mark.parametrize("overlap", [0, 1])
def test_streaming_diloco_held_once_is_the_stacked_run(overlap):
    tx = streaming_diloco(
        adamw(1e-2),
        collective=AxisCollective("workers", N),
        sync_every=4,
        outer=outer(),
        num_fragments=2,
        overlap=overlap,
        exchange=Quantized("fp4", block=2),
    )
    runs = both_runs(tx, steps=9)  # both fragments synced twice, one mix pending or done
    assert_held_is_stacked(runs)
    state = runs[1][1]
    assert int(state.rounds) == 4
    assert state.global_params["w"].shape == PROBLEM.p0["w"].shape[1:]
    assert all(np.shape(p) == () for p in state.pending)
    # The per-worker error feedback of the compressed exchange stays per worker.
    assert jax.tree.leaves(state.exchange_memory)[0].shape[0] == N


@pytest.mark.parametrize("nbm", ["seed", "chen_huo"])
def test_bmuf_held_once_is_the_stacked_run(nbm):
    tx = bmuf(
        optax.sgd(0.1, momentum=0.9),
        collective=AxisCollective("workers", N),
        block_size=3,
        block_momentum=0.5,
        nbm=nbm,
    )
    runs = both_runs(tx, steps=7)
    assert_held_is_stacked(runs)
    state = runs[1][1]
    assert int(state.block) == 2
    assert state.delta["w"].shape == PROBLEM.p0["w"].shape[1:]
    assert (state.filtered is None) == (nbm == "seed")


def test_bmuf_over_groups_holds_its_state_per_worker():
    """BMUF_GTC's members compute their group's model each from their own params: its
    state declares nothing uniform (vmap would refuse it), and every leaf stays mapped."""
    intra, inter = AxisCollective("workers", N).split(2)
    tx = bmuf_gtc(optax.sgd(0.1), intra=intra, inter=inter, block_size=2, threshold=0.1)
    state = tx.init({"w": jnp.zeros(3)})
    assert isinstance(state, BMUFState)
    assert jax.tree.leaves(uniform_axes(state)) == [0] * len(jax.tree.leaves(state))


def test_held_inside_a_chain_and_a_wrapper():
    coll = AxisCollective("workers", N)
    tx = skip_nonfinite(
        diloco(optax.sgd(0.1), collective=coll, sync_every=2, outer=outer()), collective=coll
    )
    runs = both_runs(tx, steps=5)
    assert_held_is_stacked(runs)
    axes = uniform_axes(runs[1][1])
    found = [
        s
        for s in jax.tree.leaves(runs[1][1], is_leaf=lambda x: isinstance(x, DiLoCoState))
        if isinstance(s, DiLoCoState)
    ]
    assert len(found) == 1 and found[0].global_params["b"].shape == (PROBLEM.p0["b"].shape[1],)
    # Only DiLoCo's declared fields are held once: the wrapper's own state stays per worker.
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda a: a is None)
    assert flat_axes.count(None) == len(
        jax.tree.leaves(
            (found[0].outer_state, found[0].global_params, found[0].step, found[0].rounds)
        )
    )
    assert 0 in flat_axes


def test_a_declared_field_that_differs_per_worker_is_refused():
    """A state class that declares a per-worker field uniform: vmap refuses the None
    out-axis when tracing, instead of keeping one worker's value for all."""
    coll = AxisCollective("workers", N)
    tx = diloco(optax.sgd(0.1), collective=coll, sync_every=2, outer=outer())
    p0 = PROBLEM.p0  # a different model per worker: the inner state differs too
    stacked = jax.vmap(tx.init, axis_name="workers")(p0)

    class Wrong(DiLoCoState):
        RANK_UNIFORM = ("inner_state",)

    wrong = Wrong(*stacked)
    axes = uniform_axes(wrong)
    held = hold_uniform(wrong)
    step = lambda p, s, x, y: update_and_apply(tx, jax.grad(loss)(p, x, y), s, p)
    vm = jax.vmap(step, axis_name="workers", in_axes=(0, axes, 0, 0), out_axes=(0, axes))
    with pytest.raises(ValueError, match="out_axes"):
        vm(p0, held, PROBLEM.x, PROBLEM.y)


def test_axes_of_a_state_without_declarations_are_all_mapped():
    state = optax.adamw(1e-3).init({"w": jnp.ones(3)})
    axes = uniform_axes(state, axis=1)
    assert set(jax.tree.leaves(axes)) == {1}
    assert jax.tree.structure(axes) == jax.tree.structure(state)
