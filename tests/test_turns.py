"""Simulated workers taking turns (`shoal.comms.turns`, `shoal.optim.helpers.take_turns`,
``shoal-run --set in_turn=true``): a worker's local steps traced alone give its rank, pass
uniform values through and refuse every exchange; DiLoCo's local steps in turn equal the
vmapped steps (and a hand-computed SGD case exactly); a non-finite skip in a turn and an
exchange that was due are found and the steps run again together; ``shoal-run`` with
``in_turn`` gives the records of the run without it, skips and bytes included, and
refuses what cannot take turns by name."""

from __future__ import annotations

import dataclasses

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import QUICKSTART

from shoal.comms import AxisCollective, MPICollective
from shoal.comms.turns import TurnError, current, in_turn, leave_out, take_due
from shoal.experiments import algorithms
from shoal.experiments.config import ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner import turns as turns_run
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import NonFiniteGradientError, diloco, skip_nonfinite, update_and_apply
from shoal.optim.helpers import hold_uniform, take_turns, uniform_axes

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="simulated workers, one process")

N = 4
COLL = AxisCollective("workers", N)


# ------------------------------------------------------------------ the collective in a turn


def test_a_turn_gives_the_workers_rank_and_passes_uniform_values_through():
    def one(x, rank):
        with in_turn(COLL, rank):
            assert current("workers") is not None and current("other") is None
            return x * 10 + COLL.rank().astype(x.dtype), COLL.uniform(x), COLL.simulated()

    ranked, uniform, simulated = jax.jit(lambda x: jax.lax.map(lambda a: one(*a), x))(
        (jnp.arange(N, dtype=jnp.float32), jnp.arange(N))
    )
    np.testing.assert_array_equal(ranked, [0, 11, 22, 33])
    np.testing.assert_array_equal(uniform, [0, 1, 2, 3])
    assert bool(jnp.all(simulated))
    assert current("workers") is None  # nothing outlives the block


@pytest.mark.parametrize(
    "exchange",
    [
        lambda x: COLL.all_reduce(x),
        lambda x: COLL.all_reduce(x, "max"),
        lambda x: COLL.all_gather(x),
        lambda x: COLL.all_to_all(jnp.stack([x] * N)),
        lambda x: COLL.reduce_scatter(jnp.stack([x] * N)),
        lambda x: COLL.broadcast(x, 0),
        lambda x: COLL.ppermute(x, [(i, (i + 1) % N) for i in range(N)]),
    ],
    ids=["mean", "max", "all_gather", "all_to_all", "reduce_scatter", "broadcast", "ppermute"],
)
def test_every_exchange_in_a_turn_raises_naming_it(exchange):
    def one(x):
        with in_turn(COLL, 0):
            return exchange(x)

    with pytest.raises(TurnError, match=r"AxisCollective\.\w+ inside a step traced for one"):
        jax.jit(one)(jnp.ones(3))


def test_turns_need_simulated_workers_and_do_not_nest():
    with pytest.raises(ValueError, match="needs simulated workers.*MPICollective"):
        with in_turn(MPICollective.__new__(MPICollective), 0):
            pass
    with in_turn(COLL, 0):
        with pytest.raises(ValueError, match="do not nest"):
            with in_turn(COLL, 1):
                pass


def test_an_exchange_left_out_that_was_due_raises_when_run():
    def one(due):
        with in_turn(COLL, 2):
            leave_out(COLL, due)
            return due

    f = jax.jit(one)
    assert not bool(f(False)) and take_due() is None  # not due: runs, nothing recorded
    with pytest.raises(jax.errors.JaxRuntimeError, match="worker 2's step was traced as local"):
        jax.block_until_ready(f(True))
    assert isinstance(take_due(), TurnError) and take_due() is None


# -------------------------------------------------------------------------- take_turns


def _diloco(h, inner=None):
    return diloco(inner or harness.adamw(1e-2), collective=COLL, sync_every=h,
                  outer=optax.sgd(0.7, momentum=0.9, nesterov=True))  # fmt: skip


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)


def _problem(k, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(5, 6)), jnp.float32) * 0.5,
              "v": jnp.asarray(rng.normal(size=(6,)), jnp.float32)}  # fmt: skip
    stacked = jax.tree.map(lambda a: jnp.stack([a] * N), params)
    x = jnp.asarray(rng.normal(size=(N, k, 8, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(N, k, 8)), jnp.float32)
    return stacked, x, y


def _step(tx):
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        p, s = update_and_apply(tx, g, s, p)
        return p, s, loss

    return step


def _vmapped(tx, params, state, x, y):
    """The same steps with every worker under vmap (the runner's program without turns)."""
    axes = uniform_axes(state)

    def worker(p, s, xs, ys):
        def body(c, b):
            p, s, loss = _step(tx)(*c, *b)
            return (p, s), loss

        (p, s), losses = jax.lax.scan(body, (p, s), (xs, ys))
        return p, s, losses

    f = jax.vmap(worker, axis_name="workers", in_axes=(0, axes, 0, 0), out_axes=(0, axes, 0))
    return jax.jit(f)(params, state, x, y)


def test_diloco_local_steps_in_turn_equal_the_vmapped_steps():
    """A round of 5 with AdamW: 4 steps in turn, then the exchange step under vmap, against
    the whole round under vmap; the held global model untouched in the turns."""
    h = 5
    tx = _diloco(h)
    params, x, y = _problem(h)
    state = hold_uniform(jax.vmap(tx.init, axis_name="workers")(params))
    axes = uniform_axes(state)
    ref_p, ref_s, ref_loss = _vmapped(tx, params, state, x, y)

    @jax.jit
    def in_turn_then_exchange(params, state, x, y):
        p, s, losses = take_turns(_step(tx), COLL, params, state, x[:, :-1], y[:, :-1])
        assert s.global_params["w"].shape == (5, 6)  # held once, in and out
        mid = (p, s)
        sync = jax.vmap(_step(tx), axis_name="workers", in_axes=(0, axes, 0, 0),
                        out_axes=(0, axes, 0))  # fmt: skip
        p, s, last = sync(p, s, x[:, -1], y[:, -1])
        return p, s, jnp.concatenate([losses, last[:, None]], 1), mid

    p, s, losses, (mid_p, mid_s) = in_turn_then_exchange(params, state, x, y)
    assert int(mid_s.step) == h - 1 and int(mid_s.rounds) == 0
    np.testing.assert_array_equal(mid_s.global_params["w"], state.global_params["w"])
    assert int(s.rounds) == 1 and int(s.step) == h
    np.testing.assert_allclose(losses, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves((ref_p, ref_s)), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7)


def test_sgd_in_turn_by_hand():
    """Two workers, SGD 0.5 on (p - t)^2 / 2 with t = 1 and 3, three local steps of a round
    of four: p <- p - 0.5 (p - t), so p_k = t (1 - 0.5^k), exactly."""
    coll = AxisCollective("workers", 2)
    tx = diloco(optax.sgd(0.5), collective=coll, sync_every=4, outer=optax.sgd(1.0))
    params = jnp.zeros((2, 1))
    state = hold_uniform(jax.vmap(tx.init, axis_name="workers")(params))

    def step(p, s, t):
        p, s = update_and_apply(tx, p - t, s, p)
        return p, s, p[0]

    targets = jnp.array([[[1.0]] * 3, [[3.0]] * 3])
    p, s, outs = take_turns(step, coll, params, state, targets)
    k = np.arange(1, 4)
    np.testing.assert_array_equal(outs, [1 - 0.5**k, 3 * (1 - 0.5**k)])
    np.testing.assert_array_equal(p[:, 0], [0.875, 2.625])
    assert int(s.step) == 3 and int(s.rounds) == 0


def test_a_skip_in_a_turn_is_the_workers_own_and_counts_the_flags_bytes():
    tx = skip_nonfinite(_diloco(10), collective=COLL)
    params, x, y = _problem(2)
    x = x.at[1, 1].set(jnp.nan)  # worker 1's second step
    state = hold_uniform(jax.vmap(tx.init, axis_name="workers")(params))
    _, s, _ = jax.jit(lambda *a: take_turns(_step(tx), COLL, *a))(params, state, x, y)
    np.testing.assert_array_equal(s.skipped, [0, 1, 0, 0])  # alone: run it again together
    # The flag's all-reduce is counted as the vmapped run counts it: 2 (N - 1) / N * 4.
    np.testing.assert_array_equal(s.wire.total.sent, [12, 12, 12, 12])


def test_an_exchange_step_in_a_turn_raises_when_it_runs():
    h = 3
    tx = _diloco(h)
    params, x, y = _problem(h)
    state = hold_uniform(jax.vmap(tx.init, axis_name="workers")(params))
    f = jax.jit(lambda *a: take_turns(_step(tx), COLL, *a))
    jax.block_until_ready(f(params, state, x[:, :2], y[:, :2]))  # steps 1 and 2: local
    with pytest.raises(jax.errors.JaxRuntimeError, match="exchange over 'workers' was due"):
        jax.block_until_ready(f(params, state, x, y))  # step 3 is DiLoCo's outer step
    assert take_due() is not None


# ----------------------------------------------------------------------------- shoal-run


WORKERS = 4
SETS = [f"workers={WORKERS}", "steps=15", "eval_every=5", "scan_steps=8", "project_workers=0",
        "diloco.sync_every=3", "muloco.sync_every=3", "sparseloco.sync_every=3",
        "sparseloco.topk.chunk_size=64"]  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    cfg = apply_overrides(load_config(QUICKSTART), SETS)
    return cfg, GaussianMixtureTask(cfg)


def _same_records(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra.keys() - {"time_s"}:
            if isinstance(ra[key], float):
                np.testing.assert_allclose(rb[key], ra[key], rtol=1e-5, atol=1e-6, err_msg=key)
            else:
                assert rb[key] == ra[key], key  # bytes and counts exact


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        ("diloco", {}),
        ("muloco", {}),
        ("sparseloco", {}),
        ("diloco", {"inject_nonfinite": "4:2"}),
    ],  # fmt: skip
    ids=["diloco", "muloco", "sparseloco", "diloco-skip"],
)
def test_a_run_in_turn_is_the_run_without(setup, algorithm, extra):
    """Rounds of 3 in programs of up to 8 steps, ending at every exchange and evaluation
    (3, 5, 6, 9, 10, ...); with a NaN injected at step 4 every worker skips it, and
    DiLoCo's rounds end a step later."""
    cfg, task = setup
    cfg = dataclasses.replace(cfg, **extra)
    runs = [
        train(
            dataclasses.replace(cfg, in_turn=on),
            task,
            SimBackend(WORKERS),
            algorithm,
            progress=False,
        )  # fmt: skip
        for on in (False, True)
    ]
    _same_records(runs[0].records, runs[1].records)
    records = runs[1].records
    exchanges = [
        r["step"] for r, b in zip(records[1:], records) if r["mb_sent"] > b["mb_sent"] + 1e-3
    ]
    assert exchanges == ([3, 6, 9, 12, 15] if not extra else [3, 7, 10, 13])


def test_a_raise_in_a_turn_names_the_step(setup):
    cfg, task = setup
    cfg = dataclasses.replace(cfg, in_turn=True, nonfinite="raise", inject_nonfinite="5:1")
    with pytest.raises(NonFiniteGradientError, match=r"^step 5: NaN/Inf in the gradient of 1 of 4"):
        train(cfg, task, SimBackend(WORKERS), "diloco", progress=False)


def test_a_wrong_plan_runs_the_steps_together(setup, monkeypatch):
    """A plan that calls the exchange step local: the program raises when it runs, and the
    runner trains those steps with the workers together: the same records."""
    cfg, task = setup
    reference = train(cfg, task, SimBackend(WORKERS), "diloco", progress=False)
    monkeypatch.setattr(turns_run.Plan, "chunk_end", lambda self, step, last, skipped: last)
    monkeypatch.setattr(turns_run.Plan, "local_steps", lambda self, a, b, s: b - a + 1)
    run = train(dataclasses.replace(cfg, in_turn=True), task, SimBackend(WORKERS), "diloco",
                progress=False)  # fmt: skip
    _same_records(reference.records, run.records)


@pytest.mark.parametrize(
    "sets, backend, match",
    [
        ({"scan_steps": 1}, "sim", "set scan_steps >= 2"),
        ({"churn": "leave:1@3"}, "sim", "does not combine with churn"),
        ({"grad_chunk": 2}, "sim", "does not combine with grad_chunk"),
        ({}, "mpi", "applies to simulated workers"),
    ],
)
def test_what_cannot_take_turns_is_refused_by_name(setup, sets, backend, match):
    cfg = dataclasses.replace(setup[0], in_turn=True, **sets)
    with pytest.raises(ConfigError, match=match):
        turns_run.period(cfg, backend, algorithms.resolve("diloco", cfg))


def test_only_the_registered_entries_take_turns(setup):
    cfg = dataclasses.replace(setup[0], in_turn=True)
    taking = {n for n in algorithms.ALGORITHMS if algorithms.ALGORITHMS[n].turns}
    assert taking == {"diloco", "muloco", "sparseloco"}
    assert turns_run.period(cfg, "sim", algorithms.resolve("diloco", cfg)) == 3
    assert turns_run.period(cfg, "sim", algorithms.resolve("ssgd", cfg)) is None


def test_the_cli_refuses_before_training(tmp_path, capsys):
    from shoal.experiments.runner.cli import main

    code = main(["quickstart", "--set", "algorithms=ssgd,diloco", "--set", "in_turn=true",
                 "--out", str(tmp_path / "run")])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "in_turn runs the local steps of a program: set scan_steps >= 2" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_entry_whose_local_steps_exchange_is_a_config_error(setup, monkeypatch):
    """Streaming DiLoCo syncs a fragment inside a round: registered to take turns by
    mistake, its exchange raises when traced."""
    cfg, task = setup
    cfg = dataclasses.replace(cfg, in_turn=True)
    entry = algorithms.resolve("streaming_diloco", cfg)
    entry = dataclasses.replace(entry, algorithm=dataclasses.replace(entry.algorithm, turns=True))
    with pytest.raises(ConfigError, match=r"streaming_diloco: AxisCollective\.\w+ inside a step"):
        train(cfg, task, SimBackend(WORKERS), entry, progress=False)
