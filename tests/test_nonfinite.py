"""The non-finite policy of every communicating transformation (shoal.optim.nonfinite): a
NaN/Inf in one worker's gradient makes every worker skip the step, and a skipped step is
one that never happened: the run with the bad step equals, bit for bit, the run without it
(params and every state leaf but ``skipped``). Also ``"raise"`` and ``None``. In one
process on 4 simulated workers and under mpiexec -n 4."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import UNDER_MPI, n_workers, run_two_tier, run_workers
from jax import lax

from shoal.comms import wire_bytes
from shoal.comms.wire import all_gather_bytes, all_reduce_bytes
from shoal.optim import (
    NonFiniteGradientError,
    allreduce_gradients,
    bfb_allreduce,
    bmuf,
    bmuf_gtc,
    diloco,
    gradient_noise_scale,
    gtc,
    onebit_adam,
    onebit_lamb,
    partial_exchange,
    peer_averaging,
    skip_nonfinite,
    sma,
)
from shoal.optim.gtc import residual_tree

pytestmark = pytest.mark.mpi

N = n_workers()
T, BAD_STEP, BAD_WORKER = 6, 2, 1
RNG = np.random.default_rng(7)
P0 = {"b": RNG.normal(size=3).astype(np.float32), "w": RNG.normal(size=(2, 3)).astype(np.float32)}
GRADS = {  # [worker, step, ...]
    "b": (0.1 * RNG.normal(size=(N, T, 3))).astype(np.float32),
    "w": (0.1 * RNG.normal(size=(N, T, 2, 3))).astype(np.float32),
}
FLAG = all_reduce_bytes(4, N)[0]  # the int32 count, ring all-reduce over N workers
LR = 0.1

# name -> factory(collective, nonfinite) (or, two-tier, factory(intra, inter, nonfinite))
CASES = {
    "allreduce_gradients": lambda c, nf: optax.chain(
        allreduce_gradients(collective=c, nonfinite=nf), optax.sgd(LR)
    ),
    "gtc": lambda c, nf: optax.chain(
        gtc(0.05, collective=c, capacity=4, nonfinite=nf), optax.sgd(LR)
    ),
    "bmuf": lambda c, nf: bmuf(
        optax.sgd(LR, momentum=0.9), collective=c, block_size=2, nonfinite=nf
    ),
    "onebit_lamb": lambda c, nf: onebit_lamb(1e-2, collective=c, freeze_step=2, nonfinite=nf),
    "onebit_adam": lambda c, nf: onebit_adam(1e-2, collective=c, freeze_step=2, nonfinite=nf),
    "bfb_allreduce": lambda c, nf: optax.chain(
        bfb_allreduce(collective=c, buffer_bytes=8, nonfinite=nf), optax.sgd(LR)
    ),
    "partial_exchange": lambda c, nf: optax.chain(
        partial_exchange(0.7, collective=c, nonfinite=nf), optax.sgd(LR)
    ),
    "gradient_noise_scale": lambda c, nf: optax.chain(
        gradient_noise_scale(collective=c, local_batch_size=4, nonfinite=nf), optax.sgd(LR)
    ),
    "peer_averaging": lambda c, nf: peer_averaging(
        optax.sgd(LR, momentum=0.9), collective=c, strategy="random", staleness=1, nonfinite=nf
    ),
    "sma": lambda c, nf: sma(optax.sgd(LR, momentum=0.9), collective=c, nonfinite=nf),
    "diloco": lambda c, nf: diloco(
        optax.sgd(LR, momentum=0.9), collective=c, sync_every=2, outer=optax.sgd(0.7), nonfinite=nf
    ),
    # A whole chain skips as one: Adam's moments and count do not move either.
    "skip_nonfinite(chain)": lambda c, nf: skip_nonfinite(
        optax.chain(allreduce_gradients(collective=c, nonfinite=None), optax.adam(LR)),
        collective=c,
        nonfinite=nf,
    ),
    "bmuf_gtc": lambda intra, inter, nf: bmuf_gtc(
        optax.sgd(LR),
        intra=intra,
        inter=inter,
        block_size=2,
        threshold=0.05,
        capacity=4,
        nonfinite=nf,
    ),
}
TWO_TIER = {"bmuf_gtc": 2}  # group size
# Bytes of the skipped step: the flag's all-reduce; GTC's flag rides in its all-gather
# header instead (cap 4 words + 1 header, int32), which still happens.
SKIPPED_STEP_BYTES = {
    "gtc": all_gather_bytes(4 * 5, N)[0],
    "bmuf_gtc": all_reduce_bytes(4, 2)[0] + all_reduce_bytes(4, N // 2)[0],
}
BAD_VALUES = (np.nan, np.inf, -np.inf)
# Under mpiexec, one case per kind of flag exchange (all-reduce, GTC's header, two tiers,
# ppermute-based): the guard is the same code for all; every case runs in one process.
MPI_CASES = {"allreduce_gradients", "gtc", "bmuf_gtc", "peer_averaging"}


def skip_most_under_mpi(name):
    if UNDER_MPI and name not in MPI_CASES:
        pytest.skip("checked in one process; under MPI only " + ", ".join(sorted(MPI_CASES)))


def trajectory(make, p0, grads):
    """Run ``tx`` over this worker's gradients; final params and state, every update and
    the bytes of every step."""
    tx = make()
    state = tx.init(p0)

    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), (u, wire_bytes(s, "step"))

    (p, s), (updates, wire) = lax.scan(body, (p0, state), grads)
    return p, s, updates, wire


def run(name, grads, nonfinite="skip"):
    factory = CASES[name]
    p0 = jax.tree.map(lambda x: np.broadcast_to(x, (N, *x.shape)), P0)
    if name in TWO_TIER:
        fn = lambda intra, inter, p, g: trajectory(lambda: factory(intra, inter, nonfinite), p, g)
        return run_two_tier(fn, TWO_TIER[name], p0, grads)
    fn = lambda c, p, g: trajectory(lambda: factory(c, nonfinite), p, g)
    return run_workers(fn, p0, grads)


def poisoned(value, step=BAD_STEP, worker=BAD_WORKER):
    g = jax.tree.map(np.copy, GRADS)
    g["w"][worker, step, 1, 2] = value
    return g


def without_step(grads, step=BAD_STEP):
    return jax.tree.map(lambda a: np.delete(a, step, axis=1), grads)


def split_skipped(state):
    """(every leaf but the ``skipped`` counters and the wire meters, the counters); the
    meters' totals count the skipped step's flag, so the tests check them by hand."""
    rest, skipped = [], []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = {getattr(k, "name", None) for k in path}
        if "wire" not in names:
            (skipped if "skipped" in names else rest).append(np.asarray(leaf))
    return rest, skipped


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_step_is_skipped_everywhere_and_nothing_is_poisoned(name):
    skip_most_under_mpi(name)
    bad = BAD_VALUES[sorted(CASES).index(name) % len(BAD_VALUES)]
    with_bad = run(name, poisoned(bad))
    reference = run(name, without_step(GRADS))
    for rank, (p, s, updates, wire) in with_bad.items():
        p_ref, s_ref, _, wire_ref = reference[rank]
        # Every worker, not only the one with the NaN/Inf, made a zero update.
        for u in jax.tree.leaves(updates):
            np.testing.assert_array_equal(u[BAD_STEP], 0.0)
        # As if the step never happened: same params and state, bit for bit.
        jax.tree.map(np.testing.assert_array_equal, p, p_ref)
        rest, skipped = split_skipped(s)
        rest_ref, skipped_ref = split_skipped(s_ref)
        assert len(rest) == len(rest_ref)
        for a, b in zip(rest, rest_ref):
            np.testing.assert_array_equal(a, b)
        assert max(int(k) for k in skipped) == 1 and all(int(k) == 0 for k in skipped_ref)
        # Bytes: unchanged on the other steps; the skipped step moved only the flag.
        sent = np.asarray(wire.sent)
        np.testing.assert_array_equal(np.delete(sent, BAD_STEP), np.asarray(wire_ref.sent))
        assert int(sent[BAD_STEP]) == SKIPPED_STEP_BYTES.get(name, FLAG)
        # The totals since init add up every step, the skipped one's flag included.
        total, total_ref = wire_bytes(s, "total"), wire_bytes(s_ref, "total")
        assert int(total.sent) == int(total_ref.sent) + SKIPPED_STEP_BYTES.get(name, FLAG)
        assert int(total.sent) == int(sent.sum())
        assert int(total.received) == int(np.asarray(wire.received).sum())
        assert int(total_ref.sent) == int(np.asarray(wire_ref.sent).sum())
        assert all(np.isfinite(x).all() for x in jax.tree.leaves((p, s)))


@pytest.mark.parametrize("name", ["allreduce_gradients", "gtc", "bmuf_gtc"])
def test_clean_run_counts_the_flag_and_skips_nothing(name):
    skip_most_under_mpi(name)
    (p, s, _, wire), *_ = run(name, GRADS).values()
    (p0, s0, _, wire0), *_ = run(name, GRADS, nonfinite=None).values()
    jax.tree.map(np.testing.assert_array_equal, p, p0)
    assert all(int(k) == 0 for k in split_skipped(s)[1])
    flag = SKIPPED_STEP_BYTES.get(name, FLAG) if name == "bmuf_gtc" else FLAG
    extra = 0 if name == "gtc" else flag  # GTC's flag is in the header it always sends
    np.testing.assert_array_equal(np.asarray(wire.sent), np.asarray(wire0.sent) + extra)


@pytest.mark.parametrize("name", ["allreduce_gradients", "gtc"])
def test_raise_policy_raises_on_every_worker(name):
    # Every rank raises at the same step (the count is all-reduced): nobody waits.
    message = re.escape("NonFiniteGradientError: NaN/Inf in the gradient of 1 of")
    with pytest.raises(Exception, match=message):
        run(name, poisoned(np.nan), nonfinite="raise")
        jax.effects_barrier()
    # A clean run with "raise" is the "skip" run.
    (p, *_), *_ = run(name, GRADS, nonfinite="raise").values()
    (p0, *_), *_ = run(name, GRADS).values()
    jax.tree.map(np.testing.assert_array_equal, p, p0)


def test_raise_error_class():
    assert issubclass(NonFiniteGradientError, FloatingPointError)


def test_none_policy_lets_nan_through():
    # No check: the mean is NaN on every worker; GTC keeps the NaN in the bad worker's
    # residual (|NaN| > tau is false, so it is never sent) for ever.
    for p, *_ in run("allreduce_gradients", poisoned(np.nan), nonfinite=None).values():
        assert np.isnan(p["w"][1, 2])
    for rank, (p, s, *_) in run("gtc", poisoned(np.nan), nonfinite=None).items():
        assert np.isnan(residual_tree(s[0], p)["w"][1, 2]) == (rank == BAD_WORKER)
        assert np.isfinite(p["w"]).all()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_policy_is_refused_by_name(name):
    from shoal.comms import AxisCollective

    c = AxisCollective("w", 4)
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        CASES[name](*([c, c] if name in TWO_TIER else [c]), "ignore")


def test_several_bad_workers_and_steps():
    skip_most_under_mpi("onebit_lamb")
    g = poisoned(np.nan, step=1, worker=0)
    g["b"][N - 1, 1, 0] = np.inf
    g["b"][0, 4, 0] = -np.inf
    out = run("onebit_lamb", g)
    reference = run("onebit_lamb", jax.tree.map(lambda a: np.delete(a, [1, 4], axis=1), GRADS))
    for rank, (p, s, *_) in out.items():
        jax.tree.map(np.testing.assert_array_equal, p, reference[rank][0])
        assert int(s.skipped) == 2
        assert jnp.all(jnp.isfinite(s.worker_error)) and jnp.all(jnp.isfinite(s.server_error))
