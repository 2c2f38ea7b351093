"""Churn (config ``churn``): the schedule's grammar and its errors; the join rule (global
model and a present worker's state, own error feedback); DiLoCo under churn against a
float64 NumPy oracle of the token-weighted outer step, bytes included; PowerSGD's error
feedback frozen while its worker is away; the simulated clock by hand; and through
`shoal-run`, an all-present schedule gives the run without churn bit for bit, a churned
run is the same twice, and what cannot churn is refused by name."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import QUICKSTART, UNDER_MPI

from shoal.comms import WireMeter
from shoal.costmodel import Cluster, Event
from shoal.costmodel.clock import simulate
from shoal.experiments.churn import Schedule
from shoal.experiments.fields import ConfigError
from shoal.experiments.runner import churn as churn_run
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.train import compile_step
from shoal.optim import diloco, powersgd
from shoal.optim.helpers import error_feedback_mask

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="simulated workers, one process")


# The schedule.


def test_schedule_by_hand():
    s = Schedule.parse("leave:1@2-3, join:2@3, leave:0+3@4", steps=5, workers=4)
    assert s.present.astype(int).tolist() == [
        [1, 1, 0, 1],
        [1, 0, 0, 1],
        [1, 0, 1, 1],
        [0, 1, 1, 0],
        [0, 1, 1, 0],
    ]
    assert s.joining().astype(int).tolist() == [
        [0, 0, 0, 0],
        [0, 0, 0, 0],
        [0, 0, 1, 0],
        [0, 1, 0, 0],
        [0, 0, 0, 0],
    ]
    assert s.sources().tolist() == [0, 0, 0, 0, 1]  # the lowest present the step before
    assert s.weights(window=2).tolist() == [
        [1, 1, 0, 1],
        [2, 0, 0, 2],
        [2, 0, 1, 2],
        [0, 1, 2, 0],
        [0, 2, 2, 0],
    ]
    assert Schedule.parse("", steps=3, workers=2).present.all()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("leave:1", "must be leave:W@S"),
        ("stay:1@2", "must be leave:W@S"),
        ("leave:1@0", "steps must be ints in 1-10"),
        ("leave:1@11", "steps must be ints in 1-10"),
        ("leave:1@x", "steps must be ints in 1-10"),
        ("leave:4@2", "must lie in 0-3"),
        ("leave:1@5-3", "E must be >= S"),
        ("join:1@2-3", "a range S-E is for leave only"),
        ("leave:1@2,leave:1@3", "worker 1 is absent at step 3 already"),
        ("join:1@3,join:1@5", "worker 1 is present at step 5 already"),
        ("leave:0-3@4-6", "no worker is present at step 4"),
    ],
)
def test_schedule_errors_name_the_term(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        Schedule.parse(spec, steps=10, workers=4)
    assert f"churn = {spec!r}" in str(e.value)


# The join rule, with a step that changes nothing.


class _State(NamedTuple):
    global_params: Any
    moments: Any
    error: Any
    wire: WireMeter

    RANK_UNIFORM = ("global_params",)
    ERROR_FEEDBACK = ("error",)


def test_a_joiner_takes_the_global_model_and_state_but_keeps_its_error_feedback():
    backend = SimBackend(3)
    step = churn_run.churned(lambda p, s, x, y: (p, s, ()), backend.collective)
    run = backend.spmd(step)
    meters = jax.tree.map(lambda a: jnp.stack([a + i for i in range(3)]), WireMeter.zero())
    state = _State(
        global_params=jnp.full(2, 7.0),  # held once
        moments=jnp.arange(6.0).reshape(3, 2),
        error=10 + jnp.arange(6.0).reshape(3, 2),
        wire=meters,
    )
    params = -jnp.arange(6.0).reshape(3, 2)
    rows = np.array([[1, 0, 0], [0, 0, 0], [1, 1, 0]], np.float32)  # 2 joins from worker 0
    x = y = jnp.zeros(3)
    new_params, new, _ = run(params, state, x, y, rows)
    np.testing.assert_array_equal(new_params[2], [7.0, 7.0])  # the global model
    np.testing.assert_array_equal(new_params[:2], params[:2])
    np.testing.assert_array_equal(new.moments[2], state.moments[0])  # worker 0's state
    np.testing.assert_array_equal(new.moments[:2], state.moments[:2])
    np.testing.assert_array_equal(new.error, state.error)  # its own error feedback
    for a, b in zip(jax.tree.leaves(new.wire), jax.tree.leaves(state.wire)):
        np.testing.assert_array_equal(a, b)  # and its own byte meters
    np.testing.assert_array_equal(new.global_params, state.global_params)
    # What the joiner receives: one worker's model (2 float32) and the moments it copies.
    assert churn_run.join_bytes(params[0], state, 3) == 8 + 8


# DiLoCo under churn against NumPy.

N, H, T, LR = 4, 3, 12, 0.3
SPEC = "leave:1@2-5,join:3@5,leave:0@7"
TARGETS = np.array([[1.0, -2.0, 0.5], [3.0, 0.0, 1.0], [-1.0, 1.0, 2.0], [0.0, 4.0, -3.0]])


def _loss(params, x, y):
    return 0.5 * jnp.sum((params - x) ** 2) + 0.0 * jnp.sum(y)


def _run(tx, schedule, window, record=lambda params, state: None, targets=TARGETS):
    backend = SimBackend(N)
    params = jnp.zeros(targets.shape)
    state = backend.init_state(tx.init, params)
    step = compile_step(backend, _loss, tx, churn=True)
    rows = churn_run.step_rows(schedule, window)
    x, y = jnp.asarray(targets, jnp.float32), jnp.zeros((N, 1))
    sent = []
    for t in range(schedule.present.shape[0]):
        params, state, metrics = step(params, state, x, y, rows[t])
        sent.append(metrics[1].numpy())
        record(params, state)
    return params, state, np.array(sent)


def _diloco_oracle(schedule):
    """The module's rule in float64: joiners restart from theta_g; the outer Nesterov step
    on the token-weighted mean over the workers present at the sync step."""
    present, joining = schedule.present, schedule.joining()
    weights = schedule.weights(H).astype(np.float64)
    theta, m = np.zeros(3), np.zeros(3)
    p = np.zeros((N, 3))
    trace, sent = [], []
    for t in range(T):
        here = present[t]
        p[joining[t]] = theta
        p[here] -= LR * (p[here] - TARGETS[here])
        bytes_t = np.zeros(N, np.int64)
        if (t + 1) % H == 0:
            w = weights[t][here]
            delta = (w[:, None] * (theta - p[here])).sum(0) / w.sum()
            m = delta + 0.9 * m
            theta = theta - 0.7 * (delta + 0.9 * m)
            p[here] = theta
            k = here.sum()
            bytes_t[here] = 2 * (k - 1) * 12 // k
        trace.append((p.copy(), theta.copy()))
        sent.append(bytes_t)
    return trace, np.array(sent)


def test_diloco_under_churn_matches_the_token_weighted_oracle():
    schedule = Schedule.parse(SPEC, steps=T, workers=N)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    coll = SimBackend(N).collective
    tx = diloco(optax.sgd(LR), collective=coll, sync_every=H, outer=outer)
    seen = []
    _, _, sent = _run(tx, schedule, H, lambda p, s: seen.append((p, s.global_params)))
    trace, oracle_sent = _diloco_oracle(schedule)
    for t, ((params, theta), (p_want, theta_want)) in enumerate(zip(seen, trace)):
        np.testing.assert_allclose(params, p_want, rtol=2e-6, atol=2e-6, err_msg=f"step {t + 1}")
        np.testing.assert_allclose(theta, theta_want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(sent, oracle_sent)
    # The weights mattered: worker 1 (back at 6) and 3 (joined at 5) weigh 1/9 and 2/9.
    assert churn_run.step_rows(schedule, H)[5, :, 0].tolist() == [3, 1, 3, 2]


def test_powersgd_error_feedback_stays_with_its_worker_while_away():
    schedule = Schedule.parse("leave:2@3-6", steps=9, workers=N)
    tx = optax.chain(powersgd(rank=1, collective=SimBackend(N).collective), optax.sgd(0.1))
    errors = []

    def record(params, state):
        mask = error_feedback_mask(state)
        errors.append([np.asarray(x) for x, m in zip(jax.tree.leaves(state),
                                                      jax.tree.leaves(mask)) if m])  # fmt: skip

    targets = np.random.default_rng(3).normal(size=(N, 6, 5))  # a matrix: compressed
    _run(tx, schedule, 1, record, targets)
    assert errors[0] and any(np.abs(e[2]).sum() > 0 for e in errors[1])
    for t in range(2, 6):  # steps 3-6: worker 2 is away, its error untouched
        for a, b in zip(errors[t], errors[1]):
            np.testing.assert_array_equal(a[2], b[2])
        assert any(not np.array_equal(a[0], b[0]) for a, b in zip(errors[t], errors[t - 1]))
    assert any(not np.array_equal(a[2], b[2]) for a, b in zip(errors[6], errors[5]))


# The clock.


def test_absent_workers_wait_for_no_one_and_start_where_the_job_is():
    c = Cluster(nodes=2, workers_per_node=1, intra_bandwidth=1e9, intra_latency=0.0,
                inter_bandwidth=1e9, inter_latency=0.0)  # fmt: skip
    sync = [Event("all_reduce", "world", nbytes=0)]
    compute = np.array([[1.0, 5.0], [1.0, 5.0], [1.0, 1.0]])
    present = np.array([[1, 1], [1, 0], [1, 1]], bool)
    t = simulate([sync, sync, sync], compute, c, present=present, keep_steps=3)
    # step 1: both, worker 0 waits 4 s; step 2: worker 0 alone; step 3: worker 1 is back
    # at the end of step 2 (6 s) and both finish at 7 s.
    assert t.end.tolist() == [5.0, 6.0, 7.0]
    assert t.idle.tolist() == [4.0, 0.0] and t.absent.tolist() == [0.0, 1.0]
    assert t.busy.tolist() == [3.0, 6.0]
    assert ("absent" in {k for *_, k in t.segments}) and t.shares()["absent"][1] == 1 / 7


# Through shoal-run.

BASE = ["--workers", "4", "--no-progress", "--set", "steps=12", "eval_every=6",
        "diloco.sync_every=3", "streaming_diloco.sync_every=4", "project_workers=0"]  # fmt: skip


def _cli(tmp_path, name, *sets):
    out = tmp_path / name
    assert main([str(QUICKSTART), *BASE, *sets, "--out", str(out)]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return out, [{k: v for k, v in json.loads(x).items() if k != "time_s"} for x in lines]


def test_an_all_present_schedule_is_the_run_without_churn_bit_for_bit(tmp_path):
    # compute_ms: the asynchronous entry's clock, given rather than measured
    algorithms = "algorithms=ssgd,diloco,streaming_diloco,powersgd,async_diloco"
    _, plain = _cli(tmp_path, "plain", algorithms, "compute_ms=5")
    _, churned = _cli(tmp_path, "churned", algorithms, "compute_ms=5", "churn=join:0@1")
    assert plain == churned


def test_a_churned_run_is_the_same_twice_clock_included(tmp_path):
    sets = ["algorithms=ssgd_adamw,diloco", "churn=leave:1@3-7,join:3@5", "speeds=pareto:2",
            "compute_ms=5", "project_cluster=wan-1gbps", "nonfinite=off"]  # fmt: skip
    a, rec = _cli(tmp_path, "a", *sets, "--workers", "8")
    b, _ = _cli(tmp_path, "b", *sets, "--workers", "8")
    assert (a / "metrics.jsonl").read_bytes() == (b / "metrics.jsonl").read_bytes()
    ssgd = [r for r in rec if r["algorithm"] == "ssgd_adamw"]
    # The model's bytes n from step 12 (all 8 present), then each present worker's ring
    # share: 7 present at step 1, 6 at step 3 (workers 1 and 3 away); the record is the
    # mean over all 8 workers, the absent counting 0.
    full = ssgd[11]["bytes_sent"]
    n = next(k for k in range(int(full * 8 / 14) - 2, int(full * 8 / 14) + 3)
             if 2 * 7 * k // 8 == full)  # fmt: skip
    assert ssgd[0]["bytes_sent"] == 7 / 8 * (2 * 6 * n // 7)
    assert ssgd[2]["bytes_sent"] == 6 / 8 * (2 * 5 * n // 6)
    # Step 5: worker 3 joins and receives the model and AdamW's two moments (and counters)
    # from worker 0; 7 workers present.
    joined = 8 * ssgd[4]["bytes_received"] - 7 * (2 * 6 * n // 7)
    assert 3 * n <= joined <= 3 * n + 64 and ssgd[4]["bytes_sent"] == ssgd[4]["bytes_received"]
    section = (a / "summary.md").read_text().split("## Simulated time")[1].split("## ")[0]
    assert "Churn `leave:1@3-7,join:3@5`" in section and " absent |" in section
    # Worker 1 away 5 of 12 steps, worker 3 4: the mean absent share is about 9/96.
    row = next(line for line in section.splitlines() if line.startswith("| diloco |"))
    assert 0.05 < float(row.split(" | ")[-1].rstrip(" |%")) / 100 < 0.15


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["algorithms=ssgd,gtc", "churn=leave:1@3"], "gtc cannot run with churn"),
        (["algorithms=diloco[exchange.codec=fp4]", "churn=leave:1@3"], "under churn"),
        (["algorithms=ssgd", "churn=leave:9@3"], "must lie in 0-3"),
        (["algorithms=ssgd", "churn=leave:1@3", "grad_chunk=2"], "grad_chunk"),
    ],
)
def test_what_cannot_churn_is_refused_by_name(tmp_path, capsys, sets, message):
    assert main([str(QUICKSTART), *BASE, *sets, "--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()  # before any entry trained


def test_churn_needs_simulated_workers():
    class Entry:
        label, group_size = "ssgd", None

    cfg = type("Cfg", (), {"churn": "leave:1@3"})()
    with pytest.raises(ConfigError, match=r"\(--backend sim\), not --backend mpi"):
        churn_run.check_run(cfg, "mpi", Entry())
