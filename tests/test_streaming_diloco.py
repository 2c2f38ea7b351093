"""shoal.optim.streaming_diloco against a NumPy oracle of Streaming DiLoCo's equations,
on simulated workers and under mpiexec -n 4 (the tests marked mpi are rank-agnostic)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from block_cases import block_worker, nesterov_outer_step
from harness import adam, n_workers, run_workers
from jax import lax

from shoal.comms import AxisCollective, Float32, Quantized, wire_bytes
from shoal.optim import diloco, skip_nonfinite
from shoal.optim._streaming_diloco import (
    StreamingDiLoCoState,
    split_fragments,
    streaming_diloco,
)

N = n_workers()
K, S = 2, 8  # outputs, samples per worker
# Three input blocks, one weight leaf each, and a bias: pred = x1 a + b + x2 c + x3 e.
SPLIT = (4, 6)  # x1 = x[:, :4], x2 = x[:, 4:6], x3 = x[:, 6:]
D = 8
RNG = np.random.default_rng(7)
X = RNG.normal(size=(N, S, D)).astype(np.float32)
Y = (X @ RNG.normal(size=(D, K)) + RNG.normal(size=(N, 1, K))).astype(np.float32)
# Different initial params per worker: the workers must broadcast rank 0's before init.
P0 = {
    "a": RNG.normal(size=(N, 4, K)).astype(np.float32),
    "b": RNG.normal(size=(N, K)).astype(np.float32),
    "c": RNG.normal(size=(N, 2, K)).astype(np.float32),
    "e": RNG.normal(size=(N, 2, K)).astype(np.float32),
}
# jax.tree.leaves order a (32 bytes), b (8), c (16), e (16); 3 fragments by bytes:
# cut 1 nearest 24 bytes -> after a (32); cut 2 nearest 48 -> after b (40) or c (56),
# a tie, the smaller: fragments [a], [b], [c, e] of 32, 8 and 32 bytes.
FRAGMENTS = ((0,), (1,), (2, 3))
FLAT = {0: slice(0, 8), 1: slice(8, 10), 2: slice(10, 18)}  # in the flat vector
FRAGMENT_BYTES = (32, 8, 32)
LR, MU = 0.1, 0.9  # inner SGD with momentum
OUTER_LR, OUTER_MU = 0.7, 0.9  # DiLoCo's outer Nesterov SGD
H, F = 6, 3
TOL = dict(rtol=2e-5, atol=2e-5)


def nesterov_outer():
    return optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)


def loss(p, x, y):
    x1, x2, x3 = x[:, : SPLIT[0]], x[:, SPLIT[0] : SPLIT[1]], x[:, SPLIT[1] :]
    pred = x1 @ p["a"] + p["b"] + x2 @ p["c"] + x3 @ p["e"]
    return 0.5 * jnp.mean(jnp.sum((pred - y) ** 2, axis=-1))


def flat(p):
    """Param tree (leading axes allowed) -> vector in jax.tree.leaves order: a, b, c, e."""
    parts = []
    for key, nd in (("a", 2), ("b", 1), ("c", 2), ("e", 2)):
        v = np.asarray(p[key])
        parts.append(v.reshape(*v.shape[: v.ndim - nd], -1))
    return np.concatenate(parts, -1)


def grad_np(theta, i):
    a, b = theta[:8].reshape(4, K), theta[8:10]
    c, e = theta[10:14].reshape(2, K), theta[14:18].reshape(2, K)
    x = X[i].astype(np.float64)
    x1, x2, x3 = x[:, : SPLIT[0]], x[:, SPLIT[0] : SPLIT[1]], x[:, SPLIT[1] :]
    r = x1 @ a + b + x2 @ c + x3 @ e - Y[i]
    return np.concatenate(
        [(x1.T @ r / S).ravel(), r.mean(0), (x2.T @ r / S).ravel(), (x3.T @ r / S).ravel()]
    )


def syncing(t, sync_every=H, num_fragments=F):
    """Fragments whose outer step runs on update t (1-based)."""
    return [
        p for p in range(num_fragments) if (t - p * sync_every // num_fragments) % sync_every == 0
    ]


def oracle(workers, steps, overlap, mix):
    """Streaming DiLoCo in float64: inner SGD with momentum MU on each worker; fragment p
    (offset p H / F) runs its outer Nesterov SGD step on update t when (t - p H/F) % H == 0
    on delta_p = theta_g[p] - mean_i theta_i[p], with its own momentum; the workers'
    fragment is mixed with it on the same update (overlap 0) or ``overlap`` updates
    later: theta_i[p] <- mix theta_i[p] + (1 - mix) theta_g[p]. Returns every
    worker's params and theta_g after every step, and the count of outer steps."""
    theta_g = flat(P0)[0].astype(np.float64)
    theta = np.tile(theta_g, (workers, 1))
    mom = np.zeros_like(theta)
    trace = np.zeros_like(theta_g)  # fragment p's momentum lives in its own slice
    params, glob, outer_steps = [], [], 0
    for step in range(steps):
        t = step + 1
        g = np.stack([grad_np(theta[i], i) for i in range(workers)])
        mom = MU * mom + g
        theta = theta - LR * mom
        for p in range(F):
            sl, offset = FLAT[p], p * H // F
            if (t - offset) % H == 0:
                theta_g[sl], trace[sl] = nesterov_outer_step(
                    theta_g[sl], trace[sl], theta[:, sl].mean(0), OUTER_LR, OUTER_MU
                )
                outer_steps += 1
            if t - overlap >= 1 and (t - overlap - offset) % H == 0:
                theta[:, sl] = mix * theta[:, sl] + (1 - mix) * theta_g[sl]
        params.append(theta.copy())
        glob.append(theta_g.copy())
    return np.stack(params), np.stack(glob), outer_steps


def worker_fn(tx, steps):
    """`block_worker` on this file's model: the params, theta_g and this step's wire
    bytes after every step, and the final state."""
    return block_worker(tx, steps, loss)


def streaming(**kwargs):
    kwargs.setdefault("outer", nesterov_outer())
    kwargs.setdefault("sync_every", H)
    kwargs.setdefault("num_fragments", F)
    return lambda c: streaming_diloco(optax.sgd(LR, momentum=MU), collective=c, **kwargs)


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [0, 2])
def test_matches_oracle(overlap):
    steps, mix = 14, 0.5  # two rounds and two updates more: every fragment syncs twice
    out = run_workers(worker_fn(streaming(overlap=overlap, mix=mix), steps), P0, X, Y)
    expect, expect_g, outer_steps = oracle(N, steps, overlap, mix)
    assert outer_steps == 7  # fragment 0 on 6, 12; 1 on 2, 8, 14; 2 on 4, 10
    for rank, ((params, theta_g, _), state) in out.items():
        np.testing.assert_allclose(flat(params), expect[:, rank], **TOL)
        np.testing.assert_allclose(flat(theta_g), expect_g, **TOL)
        assert isinstance(state, StreamingDiLoCoState)
        assert int(state.step) == steps and int(state.rounds) == outer_steps
        assert len(state.outer_states) == F and len(state.exchange_memory) == F
        # Fragment 1 synced on update 14: with an overlap its merge is due on 14 + 2.
        due = [0, steps + overlap, 0] if overlap else [0, 0, 0]
        assert [int(d) for d in state.pending] == due
        # The inner momentum was never reset.
        assert all(np.abs(np.asarray(m)).max() > 0 for m in jax.tree.leaves(state.inner_state))


@pytest.mark.mpi
def test_overlap_differs_from_no_overlap_and_mix_one_keeps_local():
    """The oracle's two knobs matter: an overlap changes the trajectory, and mix=1 never
    pulls the workers to theta_g (each keeps its own fragment)."""
    steps = 8
    out = run_workers(worker_fn(streaming(overlap=1, mix=1.0), steps), P0, X, Y)
    expect, expect_g, _ = oracle(N, steps, 1, 1.0)
    no_overlap, _, _ = oracle(N, steps, 0, 0.5)
    assert np.abs(expect - no_overlap).max() > 1e-3
    for rank, ((params, theta_g, _), _) in out.items():
        np.testing.assert_allclose(flat(params), expect[:, rank], **TOL)
        np.testing.assert_allclose(flat(theta_g), expect_g, **TOL)


@pytest.mark.parametrize("mix", [0.0, 0.25, 0.5, 1.0])
def test_mix_applies_without_overlap(mix):
    """overlap=0 merges as the paper and torchft's ``DiLoCo(fragment_sync_delay=0,
    fragment_update_alpha=mix)`` do, by hand: two workers at 0 step by SGD (lr 0.5)
    towards 1 and 3 (0.5 and 1.5); outer SGD (lr 1) sets theta_g to their mean 1; each
    worker keeps ``mix x + (1 - mix) 1``. (shoal replaced the fragment, whatever mix.)"""
    coll = AxisCollective("workers", 2)
    tx = streaming_diloco(
        optax.sgd(0.5), collective=coll, sync_every=1, outer=optax.sgd(1.0),
        num_fragments=1, mix=mix,
    )  # fmt: skip

    def step(params, target):
        updates, _ = tx.update(params - target, tx.init(params), params)
        return params + updates

    got = jax.vmap(step, axis_name="workers")(jnp.zeros((2, 1)), jnp.array([[1.0], [3.0]]))
    want = [mix * x + (1 - mix) * 1.0 for x in (0.5, 1.5)]
    np.testing.assert_allclose(got.ravel(), want, rtol=1e-7)


@pytest.mark.mpi
@pytest.mark.parametrize("outer", ["nesterov", "adam"])
def test_one_fragment_is_diloco(outer):
    """num_fragments=1, overlap=0, mix=0, exchange=None is diloco, bit for bit: params, theta_g,
    the outer state and bytes after every update."""
    sync_every, steps = 3, 10
    make = {"nesterov": nesterov_outer, "adam": lambda: adam(0.3)}[outer]
    inner = lambda: optax.sgd(LR, momentum=MU)
    got = run_workers(
        worker_fn(
            lambda c: streaming_diloco(
                inner(), collective=c, sync_every=sync_every, outer=make(), num_fragments=1,
                mix=0.0,
            ),
            steps,
        ),
        P0, X, Y,
    )  # fmt: skip
    want = run_workers(
        worker_fn(
            lambda c: diloco(inner(), collective=c, sync_every=sync_every, outer=make()), steps
        ),
        P0, X, Y,
    )  # fmt: skip
    for rank, ((params, theta_g, wire), state) in got.items():
        (d_params, d_global, d_wire), d_state = want[rank]
        np.testing.assert_array_equal(flat(params), flat(d_params))
        np.testing.assert_array_equal(flat(theta_g), flat(d_global))
        assert np.asarray(wire.sent).tolist() == np.asarray(d_wire.sent).tolist()
        assert np.asarray(wire.received).tolist() == np.asarray(d_wire.received).tolist()
        assert int(state.rounds) == int(d_state.rounds) == steps // sync_every
        same = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        jax.tree.map(same, state.outer_states[0], d_state.outer_state)


def test_split_balances_bytes_in_leaf_order():
    one = jax.tree.map(lambda a: a[0], P0)
    assert split_fragments(one, 3) == FRAGMENTS
    sizes = [a.nbytes for a in jax.tree.leaves(one)]
    assert [sum(sizes[i] for i in f) for f in FRAGMENTS] == list(FRAGMENT_BYTES)
    assert split_fragments(one, 1) == ((0, 1, 2, 3),)
    assert split_fragments(one, 4) == ((0,), (1,), (2,), (3,))
    # Six equal leaves (keys sort: leaf order is jax.tree.leaves order, not insertion).
    six = {k: jnp.zeros(5) for k in "fedcba"}
    assert list(six) != sorted(six)
    assert split_fragments(six, 3) == ((0, 1), (2, 3), (4, 5))
    assert split_fragments(six, 4) == ((0,), (1, 2), (3,), (4, 5))  # cuts nearest 1.5, 3, 4.5
    # One big leaf takes a fragment of its own; the rest share the other.
    big = [jnp.zeros(100), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1)]
    assert split_fragments(big, 2) == ((0,), (1, 2, 3, 4))
    assert split_fragments(big, 3) == ((0,), (1,), (2, 3, 4))  # every fragment >= 1 leaf
    # Bytes, not values: a bfloat16 leaf of 8 values weighs 4 float32 values.
    mixed = [jnp.zeros(8, jnp.bfloat16), jnp.zeros(4), jnp.zeros(4)]
    assert split_fragments(mixed, 2) == ((0,), (1, 2))
    assert split_fragments(mixed, 3) == ((0,), (1,), (2,))


@pytest.mark.mpi
def test_wire_bytes_per_syncing_fragment():
    steps = 2 * H
    out = run_workers(worker_fn(streaming(), steps), P0, X, Y)
    expect = [
        sum(2 * (N - 1) * FRAGMENT_BYTES[p] // N for p in syncing(t)) for t in range(1, steps + 1)
    ]
    assert [len(syncing(t)) for t in range(1, steps + 1)] == [0, 1] * H  # one at a time
    for (_, _, wire), state in out.values():
        assert np.asarray(wire.sent).tolist() == expect
        assert np.asarray(wire.received).tolist() == expect
        assert int(state.wire.total.sent) == sum(expect)


def test_peak_bytes_are_one_fragment():
    """F equal fragments: the largest update moves 1/F of diloco's bytes, and a round
    of H updates moves what diloco's one sync does."""
    workers, sync_every, fragments = 4, 6, 3
    coll = AxisCollective("w", workers)
    params = {k: jnp.ones((workers, 4)) for k in "abcdef"}  # 6 leaves of 16 bytes
    targets = jnp.arange(workers, dtype=jnp.float32)[:, None]

    def run(tx):
        def one(p, target):
            state = tx.init(p)

            def body(carry, _):
                p, s = carry
                g = jax.tree.map(lambda x: x - target, p)
                u, s = tx.update(g, s, p)
                return (optax.apply_updates(p, u), s), wire_bytes(s, "step").sent

            return lax.scan(body, (p, state), None, length=2 * sync_every)[1]

        return np.asarray(jax.jit(jax.vmap(one, axis_name="w"))(params, targets))

    kw = dict(collective=coll, sync_every=sync_every, outer=optax.sgd(1.0))
    stream = run(streaming_diloco(optax.sgd(0.1), num_fragments=fragments, **kw))
    base = run(diloco(optax.sgd(0.1), **kw))
    total = 6 * 16
    assert base.max() == 2 * (workers - 1) * total // workers == 144
    assert stream.max() == 2 * (workers - 1) * (total // fragments) // workers == 48
    assert stream.max() * fragments == base.max()
    assert (stream.sum(axis=1) == base.sum(axis=1)).all()
    # Offsets 0, 2, 4: fragment 1 syncs on updates 2, 8; 2 on 4, 10; 0 on 6, 12.
    assert stream[0].tolist() == [0, 48] * sync_every


# In one process only: the quantized all-reduce's MPI path is tests/test_quantized_allreduce.py,
# streaming DiLoCo's exchange under MPI the float32 and one-fragment tests.
def test_quantized_exchange_is_the_compressor_mean():
    """exchange=Quantized: the fragment's averaged delta is exchange.mean of the flattened
    theta_g[p] - theta_i[p], error feedback per fragment included, and each syncing
    update moves exchange.wire_bytes of its fragment (checked against calling the
    compressor directly in the same run)."""
    codec = Quantized("fp4", block=8)
    steps = 2 * H
    inner = lambda: optax.sgd(LR, momentum=MU)

    def worker(coll, p0, x, y):
        params = coll.broadcast(p0, 0)
        tx = streaming_diloco(inner(), collective=coll, sync_every=H, outer=optax.sgd(1.0),
                              num_fragments=F, exchange=codec)  # fmt: skip
        state = tx.init(params)
        got, want, mem_got, mem_want, sent = [], [], [], [], []
        for step in range(steps):  # unrolled: which fragment syncs is static
            g = jax.grad(loss)(params, x, y)
            for p in syncing(step + 1):
                # The same inner step the transformation takes, then the direct mean.
                u, _ = inner().update(g, state.inner_state, params)
                local = jax.tree.leaves(optax.apply_updates(params, u))
                theta = jax.tree.leaves(state.global_params)
                vec = jnp.concatenate([(theta[i] - local[i]).ravel() for i in FRAGMENTS[p]])
                y_direct, memory = codec.mean(vec, state.exchange_memory[p], collective=coll)
                old = jnp.concatenate([theta[i].ravel() for i in FRAGMENTS[p]])
                want.append(old - y_direct)  # outer sgd(1): theta_g[p] - mean
                mem_want.append(memory)
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
            for p in syncing(step + 1):
                theta = jax.tree.leaves(state.global_params)
                got.append(jnp.concatenate([theta[i].ravel() for i in FRAGMENTS[p]]))
                mem_got.append(state.exchange_memory[p])
            sent.append(wire_bytes(state, "step").sent)
        return got, want, mem_got, mem_want, jnp.stack([s.lo for s in sent])

    for got, want, mem_got, mem_want, sent in run_workers(worker, P0, X, Y).values():
        assert len(got) == steps // 2
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        for a, b in zip(mem_got, mem_want):
            assert len(a) == 2  # worker and server error
            for x, y in zip(a, b):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        sizes = [8, 2, 8]
        expect = [
            sum(codec.wire_bytes(sizes[p], N)[0] for p in syncing(t)) for t in range(1, steps + 1)
        ]
        assert np.asarray(sent).tolist() == expect


@pytest.mark.mpi
def test_float32_exchange_equals_plain_all_reduce():
    steps = 2 * H + 2
    plain = run_workers(worker_fn(streaming(overlap=2), steps), P0, X, Y)
    codec = run_workers(worker_fn(streaming(overlap=2, exchange=Float32()), steps), P0, X, Y)
    for rank, ((params, theta_g, wire), state) in codec.items():
        (p_params, p_global, p_wire), _ = plain[rank]
        np.testing.assert_allclose(flat(params), flat(p_params), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(flat(theta_g), flat(p_global), rtol=1e-6, atol=1e-6)
        assert np.asarray(wire.sent).tolist() == np.asarray(p_wire.sent).tolist()
        assert state.exchange_memory == ((), (), ())


def test_nonfinite_gradient_skips_the_step_on_every_worker():
    # In skip_nonfinite, with a merge pending (overlap 1): nothing moves.
    workers = 2
    coll = AxisCollective("w", workers)
    tx = skip_nonfinite(streaming(sync_every=2, num_fragments=2, overlap=1)(coll), collective=coll)
    params = {"b": jnp.ones((workers, K)), "w": jnp.ones((workers, 3, K))}
    state = jax.vmap(tx.init)(params)
    _, state = jax.jit(jax.vmap(tx.update, axis_name="w"))(params, state, params)
    _, state = jax.jit(jax.vmap(tx.update, axis_name="w"))(params, state, params)
    assert np.asarray(state.inner_state.pending[0]).tolist() == [3, 3]  # due at update 3
    bad = jax.tree.map(lambda p: p.at[1].set(jnp.nan), params)  # worker 1's gradient
    u, new = jax.jit(jax.vmap(tx.update, axis_name="w"))(bad, state, params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
    assert np.asarray(new.skipped).tolist() == [1, 1]
    assert np.asarray(new.inner_state.step).tolist() == [2, 2]
    same = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kept = lambda s: (s.inner_state, s.outer_states, s.global_params, s.pending, s.rounds)
    jax.tree.map(same, kept(new.inner_state), kept(state.inner_state))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_fragments=0), "num_fragments must be an int >= 1"),
        (dict(num_fragments=2.0), "num_fragments must be an int >= 1"),
        (dict(num_fragments=True), "num_fragments must be an int >= 1"),
        (dict(mix=1.5), r"mix must be a number in \[0, 1\]"),
        (dict(mix=-0.1), r"mix must be a number in \[0, 1\]"),
        (dict(mix="half"), r"mix must be a number in \[0, 1\]"),
        (dict(overlap=-1), rf"overlap must be an int in \[0, {H - 1}\] \(< sync_every"),
        (dict(overlap=H), rf"overlap must be an int in \[0, {H - 1}\] \(< sync_every"),
        (dict(overlap=1.0), rf"overlap must be an int in \[0, {H - 1}\] \(< sync_every"),
        (dict(exchange="fp4"), "exchange must be None or a shoal.comms.Compressor"),
        (dict(exchange=optax.sgd(1.0)), "exchange must be None or a shoal.comms.Compressor"),
        (dict(sync_every=0), "sync_every must be an int >= 1"),
        (dict(outer=optax.sgd), r"outer must be an optax.GradientTransformation.*called"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        streaming(**kwargs)(AxisCollective("w", 2))


def test_more_fragments_than_leaves():
    tx = streaming(num_fragments=5)(AxisCollective("w", 2))
    params = jax.tree.map(lambda a: a[0], P0)  # 4 leaves
    with pytest.raises(ValueError, match=r"num_fragments must be <= the number of parameter"):
        tx.init(params)
    with pytest.raises(ValueError, match="num_fragments must be <="):
        split_fragments(params, 5)
