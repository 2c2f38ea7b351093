"""`shoal.optim.skip_nonfinite`, the one mechanism for non-finite gradients, around every
communicating transformation of shoal. One contract, parametrised over all of them:

(a) a NaN/Inf in one worker's gradient: every worker makes a zero update, the wrapped
    state stays bit for bit what it was (its wire meters report an idle step), the
    wrapper's ``skipped`` is 1 on every worker, and the run equals, bit for bit, the
    run without that step;
(b) a finite step is the unwrapped transformation's step, bit for bit (but for the
    last bits where XLA:CPU fuses an optimizer's moments differently, `FMA_CASES`);
(c) ``"raise"`` raises on every worker (a ``JaxRuntimeError`` naming
    ``NonFiniteGradientError``);
(d) the flag's bytes are counted: one int32 ring all-reduce per step and tier.

In one process on 4 simulated workers (vmap, `AxisCollective`) and under mpiexec -n 4."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from contract_table import ROWS, public_factories, public_helpers, rows
from harness import UNDER_MPI, adam, n_workers, run_two_tier, run_workers
from jax import lax

import shoal.optim as optim
from shoal.comms import AxisCollective, WireMeter, wire_bytes
from shoal.comms.wire import all_reduce_bytes
from shoal.optim import (
    NonFiniteGradientError,
    allreduce_gradients,
    skip_nonfinite,
    update_and_apply,
)
from shoal.optim._gtc import residual_tree
from shoal.optim._nonfinite import skipped_steps

pytestmark = pytest.mark.mpi

N = n_workers()
T, BAD_STEP, BAD_WORKER = 5, 2, 1
RNG = np.random.default_rng(7)
P0 = {"b": RNG.normal(size=3).astype(np.float32), "w": RNG.normal(size=(2, 3)).astype(np.float32)}
GRADS = {  # [worker, step, ...]
    "b": (0.1 * RNG.normal(size=(N, T, 3))).astype(np.float32),
    "w": (0.1 * RNG.normal(size=(N, T, 2, 3))).astype(np.float32),
}
LR = 0.1
GROUP = 2  # workers per group of the two-tier case
# The flag: one int32, ring all-reduced over all N workers, or within the group and then
# across the groups.
FLAG = all_reduce_bytes(4, N)[0]
FLAG_TWO_TIER = all_reduce_bytes(4, GROUP)[0] + all_reduce_bytes(4, N // GROUP)[0]
# name -> factory(collective) of the unwrapped transformation (two-tier: of (intra, inter)):
# every row of the contract table but the wrapper itself, and a chain with Adam.
CASES = {row.name: row.nonfinite for row in ROWS if not isinstance(row.nonfinite, str)}
# A whole chain skips as one: Adam's moments and count do not move either.
CASES["allreduce_gradients+adam"] = lambda c: optax.chain(
    allreduce_gradients(collective=c), adam(LR)
)
TWO_TIER = set(rows(two_tier=True))
BAD_VALUES = (np.nan, np.inf, -np.inf)
# Under mpiexec, one case per kind of exchange (all-reduce, all-gather, two tiers,
# ppermute): the wrapper is the same code for all; every case runs in one process.
MPI_CASES = {"allreduce_gradients", "gtc", "bmuf_gtc", "peer_averaging"}
# XLA:CPU contracts a multiply and an add into one FMA in some fusions and not in others,
# and the wrapper (its select or its loop) changes the fusions, so wrapped and unwrapped
# runs may differ in the last bits: Adam-style moments of an all-reduced mean (measured: at
# most 3 ulp with XLA's fusion emitters, 9 with the loop emitters the tests compile with,
# tests/conftest.py), and with the loop emitters also a momentum update mixed with other
# workers' parameters or a noise estimate (up to 3e-8 absolute): the rows marked
# nonfinite_fma. Every other case is bit for bit.
FMA_CASES = {"allreduce_gradients+adam", *rows(nonfinite_fma=True)}


def skip_most_under_mpi(name):
    if UNDER_MPI and name not in MPI_CASES:
        pytest.skip("checked in one process; under MPI only " + ", ".join(sorted(MPI_CASES)))


def flag_bytes(name):
    return FLAG_TWO_TIER if name in TWO_TIER else FLAG


def trajectory(tx, p0, grads):
    """Run ``tx`` over this worker's gradients: final params, and every step's updates and
    state."""
    state = tx.init(p0)

    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), (u, s)

    (p, _), (updates, states) = lax.scan(body, (p0, state), grads)
    return p, updates, states


def applied_trajectory(tx, p0, grads):
    """`trajectory` with each step taken by `update_and_apply`: final params, no updates
    (None), every step's state."""
    state = tx.init(p0)

    def body(carry, g):
        p, s = update_and_apply(tx, g, carry[1], carry[0])
        return (p, s), s

    (p, _), states = lax.scan(body, (p0, state), grads)
    return p, None, states


def _run(name, grads, nonfinite, in_place=None):
    """``{rank: (params, updates per step, state per step)}``; ``nonfinite=None``: the
    transformation unwrapped; ``in_place="apply"``: each step by `update_and_apply`."""

    def make(*comms):
        tx = CASES[name](comms if name in TWO_TIER else comms[0])
        if nonfinite is None:
            return tx
        return skip_nonfinite(tx, collective=comms, nonfinite=nonfinite, in_place=in_place)

    steps = applied_trajectory if in_place == "apply" else trajectory
    p0 = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), P0)
    if name in TWO_TIER:
        fn = lambda intra, inter, p, g: steps(make(intra, inter), p, g)
        return run_two_tier(fn, GROUP, p0, grads)
    return run_workers(lambda c, p, g: steps(make(c), p, g), p0, grads)


def poisoned(value, step=BAD_STEP, worker=BAD_WORKER):
    g = jax.tree.map(np.copy, GRADS)
    g["w"][worker, step, 1, 2] = value
    return g


def without_step(grads, step=BAD_STEP):
    return jax.tree.map(lambda a: np.delete(a, step, axis=1), grads)


def bad_value(name):
    return BAD_VALUES[sorted(CASES).index(name) % len(BAD_VALUES)]


# Each run compiles once and serves several tests.
@functools.cache
def run(name, variant):
    if variant == "bad":
        return _run(name, poisoned(bad_value(name)), "skip")
    if variant in ("bad in place", "bad select", "clean in place", "clean select"):
        grads = poisoned(bad_value(name)) if variant.startswith("bad") else GRADS
        return _run(name, grads, "skip", variant.endswith("in place"))
    if variant in ("bad apply", "clean apply"):
        grads = poisoned(bad_value(name)) if variant == "bad apply" else GRADS
        return _run(name, grads, "skip", "apply")
    if variant == "without":  # the run that never saw the bad step
        return _run(name, without_step(GRADS), "skip")
    if variant == "clean":
        return _run(name, GRADS, "skip")
    assert variant == "plain"
    return _run(name, GRADS, None)


def at(tree, t):
    return jax.tree.map(lambda x: x[t], tree)


def meters_and_rest(state):
    """(the `WireMeter` s in ``state``, every other leaf)."""
    is_meter = lambda x: isinstance(x, WireMeter)
    leaves = jax.tree.leaves(state, is_leaf=is_meter)
    return [x for x in leaves if is_meter(x)], [np.asarray(x) for x in leaves if not is_meter(x)]


def assert_trees_equal(a, b):
    """Bit for bit, same structure (NaN == NaN)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def assert_trees_close(a, b):
    """Floats within rounding (FMA contraction, measured above: rtol 1e-5, atol 1e-8; a
    step taken or skipped wrongly moves them by ~1e-3), everything else (counters, byte
    counts) bit for bit."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)
        else:
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_step_is_skipped_everywhere_and_poisons_nothing(name):
    skip_most_under_mpi(name)
    for rank, (p, updates, states) in run(name, "bad").items():
        p_ref, updates_ref, states_ref = run(name, "without")[rank]
        # Every worker, not only the one with the NaN/Inf, made a zero update.
        for u in jax.tree.leaves(updates):
            np.testing.assert_array_equal(u[BAD_STEP], 0.0)
        # The wrapped state is bit for bit what it was, its meters idle: this step moved
        # none of its bytes, and the totals since init stay.
        before = at(states.inner_state, BAD_STEP - 1)
        after = at(states.inner_state, BAD_STEP)
        meters, rest = meters_and_rest(after)
        meters_before, rest_before = meters_and_rest(before)
        assert len(rest) == len(rest_before) and len(meters) == len(meters_before)
        for a, b in zip(rest, rest_before):
            np.testing.assert_array_equal(a, b)
        for m, m0 in zip(meters, meters_before):
            assert all(int(w) == 0 for w in jax.tree.leaves(m.step))
            assert_trees_equal(m.total, m0.total)
        # skipped: 0 before the bad step, 1 from it on, on every worker.
        want = [0] * BAD_STEP + [1] * (T - BAD_STEP)
        assert np.asarray(states.skipped).tolist() == want
        assert int(skipped_steps(at(states, T - 1))) == 1
        # As if the step never happened: the other steps' updates, the final params and
        # the whole final wrapped state equal the run without the bad step.
        assert_trees_equal(jax.tree.map(lambda u: np.delete(u, BAD_STEP, 0), updates), updates_ref)
        assert_trees_equal(p, p_ref)
        assert_trees_equal(at(states.inner_state, T - 1), at(states_ref.inner_state, T - 2))
        assert all(np.isfinite(x).all() for x in jax.tree.leaves((p, states)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_b_finite_steps_are_the_unwrapped_steps(name):
    skip_most_under_mpi(name)
    same = assert_trees_close if name in FMA_CASES else assert_trees_equal
    for rank, (p, updates, states) in run(name, "clean").items():
        p_ref, updates_ref, states_ref = run(name, "plain")[rank]
        same(updates, updates_ref)
        same(states.inner_state, states_ref)
        # The params are the test's own ``p + u``, which XLA may contract with the update's
        # last multiply (-lr u) in one program and not in the other (seen under MPI).
        assert_trees_close(p, p_ref)
        assert np.asarray(states.skipped).tolist() == [0] * T
        assert skipped_steps(at(states_ref, T - 1)) is None  # no count without the wrapper


@pytest.mark.parametrize("name", sorted(CASES))
def test_c_raise_raises_on_every_worker(name):
    skip_most_under_mpi(name)
    # Every rank raises at the same step (the count is all-reduced): nobody waits.
    message = f"NonFiniteGradientError: NaN/Inf in the gradient of 1 of {N} workers"
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _run(name, poisoned(np.nan), "raise")
        jax.effects_barrier()


@pytest.mark.parametrize("name", sorted(CASES))
def test_d_the_flag_bytes_are_counted(name):
    skip_most_under_mpi(name)
    flag = flag_bytes(name)
    for variant in ("clean", "bad"):
        for rank, (_, _, states) in run(name, variant).items():
            # The wrapper's own meter: the flag, every step, skipped or not.
            np.testing.assert_array_equal(np.asarray(states.wire.step.sent), [flag] * T)
            np.testing.assert_array_equal(np.asarray(states.wire.step.received), [flag] * T)
            assert int(at(states.wire.total.sent, T - 1)) == T * flag
            # All meters together: the unwrapped run's bytes plus the flag's (the bad
            # step's flag on top of the run without it).
            total = wire_bytes(at(states, T - 1), "total")
            if variant == "clean":
                plain, extra = run(name, "plain")[rank][2], T * flag
            else:
                plain, extra = run(name, "without")[rank][2], flag
            total_ref = wire_bytes(at(plain, -1), "total")
            assert int(total.sent) == int(total_ref.sent) + extra
            assert int(total.received) == int(total_ref.received) + extra
            # On the skipped step, the flag is all that moved.
            if variant == "bad":
                step = wire_bytes(at(states, BAD_STEP), "step")
                assert (int(step.sent), int(step.received)) == (flag, flag)


def test_raise_error_class():
    assert issubclass(NonFiniteGradientError, FloatingPointError)


def test_unwrapped_lets_nan_through():
    # Without the wrapper nothing checks: the mean is NaN on every worker; GTC keeps the
    # NaN in the bad worker's residual (|NaN| > tau is false, so it is never sent) for ever.
    for p, *_ in _run("allreduce_gradients", poisoned(np.nan), None).values():
        assert np.isnan(p["w"][1, 2])
    for rank, (p, _, states) in _run("gtc", poisoned(np.nan), None).items():
        residual = residual_tree(at(states[0], T - 1), p)["w"][1, 2]
        assert np.isnan(residual) == (rank == BAD_WORKER)
        assert np.isfinite(p["w"]).all()


def test_several_bad_workers_and_steps():
    # NaN and Inf on several workers and steps, across 1-bit LAMB's switch from warm-up to
    # compression: each such step skipped, the error feedback stays finite.
    skip_most_under_mpi("onebit_lamb")
    g = poisoned(np.nan, step=1, worker=0)
    g["b"][N - 1, 1, 0] = np.inf
    g["b"][0, 4, 0] = -np.inf
    out = _run("onebit_lamb", g, "skip")
    clean = jax.tree.map(lambda a: np.delete(a, [1, 4], axis=1), GRADS)
    reference = _run("onebit_lamb", clean, "skip")  # the run without those steps
    for rank, (p, _, states) in out.items():
        assert_trees_equal(p, reference[rank][0])
        assert np.asarray(states.skipped).tolist() == [0, 1, 1, 1, 2]
        final = at(states.inner_state, T - 1)
        assert jnp.all(jnp.isfinite(final.worker_error))
        assert jnp.all(jnp.isfinite(final.server_error))


def test_an_update_that_changes_the_dtype_is_skipped_too():
    # The wrapped update returns bfloat16 updates for float32 gradients, so the step cannot
    # run in place: the skip takes a branch, whose zeros have the update's dtype.
    coll = AxisCollective("workers", 2)
    to_bf16 = optax.stateless(lambda u, p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), u))
    tx = skip_nonfinite(optax.chain(allreduce_gradients(collective=coll), to_bf16), collective=coll)

    def step(g):
        u, s = tx.update(g, tx.init(g))
        return u, s.skipped, s.inner_state[0].wire.step.sent

    good = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    u, skipped, sent = jax.vmap(step, axis_name="workers")(good)
    assert u.dtype == jnp.bfloat16 and np.asarray(skipped).tolist() == [0, 0]
    np.testing.assert_array_equal(np.asarray(u, np.float32), [[2.0, 3.0], [2.0, 3.0]])
    assert np.asarray(sent.numpy()).tolist() == [all_reduce_bytes(8, 2)[0]] * 2
    u, skipped, sent = jax.vmap(step, axis_name="workers")(good.at[0, 1].set(jnp.inf))
    assert u.dtype == jnp.bfloat16 and np.asarray(skipped).tolist() == [1, 1]
    np.testing.assert_array_equal(np.asarray(u, np.float32), np.zeros((2, 2)))
    assert np.asarray(sent.numpy()).tolist() == [0, 0]


@pytest.mark.parametrize("bad", ["ignore", None, "off"])
def test_bad_policy_is_refused_by_name(bad):
    c = AxisCollective("w", 4)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        skip_nonfinite(optax.sgd(0.1), collective=c, nonfinite=bad)
    with pytest.raises(
        ValueError, match="in_place must be None, True, False or 'apply', got 'yes'"
    ):
        skip_nonfinite(optax.sgd(0.1), collective=c, in_place="yes")


# Both ways of skipping (a 0-or-1-trip loop in place, a select) give the same run, bit for
# bit but for FMA contraction (FMA_CASES): an update that mixes in other workers' values, an
# all-reduce, and a state that passes through (by default in place).
@pytest.mark.parametrize("name", ["peer_averaging", "allreduce_gradients", "bmuf"])
def test_skipping_in_place_or_by_select_is_the_same_run(name):
    skip_most_under_mpi(name)
    same = assert_trees_close if name in FMA_CASES else assert_trees_equal
    for rank, want in run(name, "bad").items():
        for variant in ("bad in place", "bad select"):
            same(run(name, variant)[rank], want)


# The skip around the update and its application (`update_and_apply`): the same run as the
# optax form, params and every step's state (the skipped count and idle meters included),
# with a bad step and without.
@pytest.mark.parametrize(
    "name", ["sma", "peer_averaging", "allreduce_gradients", "bmuf", "bmuf_gtc", "diloco"]
)
@pytest.mark.parametrize("variant", ["bad", "clean"])
def test_the_skip_around_update_and_apply_is_the_same_run(name, variant):
    skip_most_under_mpi(name)
    for rank, (p, _, states) in run(name, variant).items():
        p_apply, _, states_apply = run(name, f"{variant} apply")[rank]
        # The parameters: ``p + u`` is contracted into FMAs differently in the loop.
        assert_trees_close(p_apply, p)
        (assert_trees_close if name in FMA_CASES else assert_trees_equal)(states_apply, states)


# Each row's preferred skip (its `skip_in_place`, what a training step should pass to the
# wrapper) is the same run as the default skip, with a bad step and without: bit for bit
# but for FMA contraction, the parameters of "apply" (``p + u`` in the loop) within rounding.
PREFERRED = {row.name: row.skip_in_place for row in ROWS if row.skip_in_place is not None}


@pytest.mark.parametrize("name", sorted(PREFERRED))
@pytest.mark.parametrize("variant", ["bad", "clean"])
def test_the_preferred_skip_is_the_same_run(name, variant):
    skip_most_under_mpi(name)
    mode = PREFERRED[name]
    suffix = {True: "in place", False: "select", "apply": "apply"}[mode]
    same = assert_trees_close if name in FMA_CASES else assert_trees_equal
    for rank, (p, updates, states) in run(name, variant).items():
        p_pref, updates_pref, states_pref = run(name, f"{variant} {suffix}")[rank]
        (assert_trees_close if mode == "apply" else same)(p_pref, p)
        if mode != "apply":  # "apply" returns no updates
            same(updates_pref, updates)
        same(states_pref, states)


def test_the_skip_around_update_and_apply_raises_too():
    message = f"NonFiniteGradientError: NaN/Inf in the gradient of 1 of {N} workers"
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _run("allreduce_gradients", poisoned(np.nan), "raise", "apply")
        jax.effects_barrier()


def test_update_and_apply_of_any_other_transformation_is_optax():
    c = AxisCollective("w", 2)
    g, p = jnp.array([[1.0, -2.0], [3.0, 0.25]]), jnp.array([[0.5, 0.5], [1.0, 2.0]])
    for tx in (optax.sgd(0.1), skip_nonfinite(optax.sgd(0.1), collective=c, in_place=True)):

        def both(p, g, tx=tx):
            u, s = tx.update(g, tx.init(p), p)
            return (optax.apply_updates(p, u), s), update_and_apply(tx, g, tx.init(p), p)

        want, got = jax.vmap(both, axis_name="w")(p, g)
        assert_trees_equal(got, want)
        np.testing.assert_allclose(got[0], p - 0.1 * g)
    assert skip_nonfinite(optax.sgd(0.1), collective=c).apply_step is None


FUNCTIONS = sorted((public_factories() | public_helpers()) - {"skip_nonfinite"})
STATES = sorted({row.state.__name__ for row in ROWS})


@pytest.mark.parametrize("name", FUNCTIONS)
def test_no_transformation_has_a_nonfinite_flag_of_its_own(name):
    # One mechanism: the wrapper. No factory (nor helper) takes nonfinite= ...
    assert "nonfinite" not in inspect.signature(getattr(optim, name)).parameters


@pytest.mark.parametrize("name", STATES)
def test_only_the_wrapper_counts_skipped_steps(name):
    # ... and no state but the wrapper's counts skipped steps.
    fields = getattr(optim, name)._fields
    assert ("skipped" in fields) == (name == "SkipNonFiniteState"), fields
