"""Learning-rate schedules and gradient clipping of the optimizers the runner builds
(`shoal.experiments.algorithms.parts.Schedule`, ``clip``): the rate a built optimizer
applies at chosen steps against the warm-up + cosine (and linear) formulas by hand, an
inner optimizer counted in inner steps and an outer one in outer steps; the clip against
``g * min(1, c / ||g||)`` in NumPy, before the averaging or after it as each algorithm
says; the defaults add nothing to any algorithm's state; refusals name the field; the
three spellings give the same params; the DiLoCo study runs the paper's inner recipe."""

from __future__ import annotations

import dataclasses
import json
import math

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shoal.comms import AxisCollective
from shoal.dtypes import standard_promotion
from shoal.experiments.algorithms import ALGORITHMS, Context, resolve, resolve_all
from shoal.experiments.algorithms.diloco import DiLoCo
from shoal.experiments.algorithms.muloco import Muon
from shoal.experiments.algorithms.parts import AdamW, LocalSGD, OuterSGD, Schedule
from shoal.experiments.algorithms.streaming_diloco import StreamingDiLoCo
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner.cli import main
from shoal.trees import find_instances

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="simulated workers")


# ------------------------------------------------------------------ the formulas by hand


def rate(t: int, peak: float, kind: str, w: int, T: int, end: float = 0.0, init: float = 0.0):
    """The learning rate at step ``t`` (0-based): a linear warm-up from ``init * peak``
    over ``w`` steps, then ``kind`` down to ``end * peak`` at ``T``, held after it."""
    if t < w:
        return peak * (init + (1 - init) * t / w)
    if kind == "constant":
        return peak
    low = end * peak
    x = min(t - w, T - w) / (T - w)
    if kind == "linear":
        return low + (peak - low) * (1 - x)
    return low + (peak - low) * (1 + math.cos(math.pi * x)) / 2


@pytest.mark.parametrize(
    "schedule",
    [
        Schedule(kind="cosine", warmup_steps=4),
        Schedule(kind="cosine", warmup_steps=0, end_fraction=0.1),
        Schedule(kind="cosine", warmup_steps=3, init=0.25, end_fraction=0.2),
        Schedule(kind="linear", warmup_steps=5, end_fraction=0.5),
        Schedule(kind="linear"),
        Schedule(kind="constant", warmup_steps=6, init=0.5),
        Schedule(kind="cosine", warmup_steps=2, horizon=10),  # its own horizon, not the run's
    ],
)
def test_a_built_local_optimizer_applies_the_formula(schedule):
    """SGD without momentum on a gradient of ones: the update at step t is ``-lr_t``."""
    peak, steps = 0.3, 16
    sgd = LocalSGD(learning_rate=peak, momentum=0.0, schedule=schedule).make(steps)
    ones = jnp.ones(3)
    state, got = sgd.init(ones), []
    for _ in range(steps + 3):  # past the horizon too: the end value is held
        u, state = sgd.update(ones, state)
        got.append(-float(u[0]))
    T = schedule.horizon or steps
    end = schedule.end_fraction
    kind, w = schedule.kind, schedule.warmup_steps
    want = [rate(t, peak, kind, w, T, end, schedule.init) for t in range(steps + 3)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_hand_computed_cosine_points():
    """A few values worked out by hand: peak 1, W = 4, T = 12."""
    f = Schedule(kind="cosine", warmup_steps=4).make(1.0, 12)
    for t, want in [(0, 0.0), (1, 0.25), (3, 0.75), (4, 1.0), (8, 0.5), (12, 0.0), (20, 0.0)]:
        assert float(f(t)) == pytest.approx(want, abs=1e-7), t
    # (1 + cos(pi / 4)) / 2 at a quarter of the decay.
    assert float(f(6)) == pytest.approx((1 + math.sqrt(0.5)) / 2, rel=1e-6)


def test_adamw_applies_the_schedule():
    """Adam on a constant gradient moves by ``lr_t`` (its bias-corrected moments are the
    gradient and its square)."""
    schedule = Schedule(kind="cosine", warmup_steps=3, end_fraction=0.1)
    adamw = AdamW(learning_rate=1e-2, schedule=schedule).make(10)
    g = jnp.full(4, 0.5)
    state, got = adamw.init(g), []
    for _ in range(10):
        u, state = adamw.update(g, state, g)
        got.append(-float(u[0]))
    want = [rate(t, 1e-2, "cosine", 3, 10, 0.1) for t in range(10)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_muon_schedules_both_rates():
    """Muon's matrices and its AdamW leaves: each update is its rate at step t times the
    update of the same Muon at rate 1 (weight decay 0: the rate only scales)."""
    schedule = Schedule(kind="linear", warmup_steps=2, end_fraction=0.2)
    steps = 6
    sched = Muon(learning_rate=0.02, adam_learning_rate=1e-3, schedule=schedule).make(steps)
    unit = Muon(learning_rate=1.0, adam_learning_rate=1.0).make(steps)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3)}
    s1, s2 = sched.init(params), unit.init(params)
    for t in range(steps):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        u1, s1 = sched.update(g, s1, params)
        u2, s2 = unit.update(g, s2, params)
        for leaf, peak in (("w", 0.02), ("b", 1e-3)):
            want = rate(t, peak, "linear", 2, steps, 0.2) * np.asarray(u2[leaf])
            np.testing.assert_allclose(u1[leaf], want, rtol=2e-5, atol=1e-9, err_msg=leaf)


# ------------------------------------------------------------------ inside the runner's entries


def trajectory(entry, grads):
    """Every worker's params after each step of the runner's transformation for ``entry``,
    from params 0, with worker i's gradient at step t ``grads[i, t]`` (``[workers, steps,
    n]``)."""
    coll = AxisCollective("workers", grads.shape[0])
    tx = entry.build(coll)

    def worker(gs):
        params = jnp.zeros(gs.shape[1:])

        def body(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            return (p, s), p

        return jax.lax.scan(body, (params, tx.init(params)), gs)[1]

    return np.asarray(jax.jit(jax.vmap(worker, axis_name="workers"))(grads))


def test_ssgd_schedule_counts_the_runs_steps():
    steps = 12
    cfg = Config(algorithms=("ssgd",), workers=2, steps=steps, batch_size=8)
    entry = resolve(
        "ssgd[local.momentum=0;local.learning_rate=0.1;"
        "local.schedule.kind=cosine;local.schedule.warmup_steps=3]",
        cfg,
    )
    grads = np.ones((2, steps, 1), np.float32)
    got = -np.diff(trajectory(entry, grads)[0, :, 0], prepend=0.0)
    want = [rate(t, 0.1, "cosine", 3, steps) for t in range(steps)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_diloco_counts_inner_steps_and_outer_steps():
    """Inner SGD (no momentum) at a linear warm-up + cosine rate over the run's 12 inner
    steps, never restarted at a sync; the outer step (no momentum) at a linear decay over
    the 4 outer steps. Worker i's gradient is a constant c_i, so a round k takes worker i
    to ``theta_g - c_i S_k`` with ``S_k`` the sum of the round's inner rates, the outer
    gradient is ``mean(c) S_k`` and ``theta_g <- theta_g - lr_out(k) mean(c) S_k``."""
    H, rounds = 3, 4
    steps = H * rounds
    cfg = Config(algorithms=("diloco",), workers=2, steps=steps, batch_size=8)
    entry = resolve(
        f"diloco[sync_every={H};inner.use=sgd;inner.sgd.momentum=0;inner.sgd.learning_rate=0.2;"
        "inner.sgd.schedule.kind=cosine;inner.sgd.schedule.warmup_steps=2;"
        "outer.momentum=0;outer.learning_rate=0.9;outer.schedule.kind=linear]",
        cfg,
    )
    c = np.array([1.0, 3.0], np.float32)
    grads = np.broadcast_to(c[:, None, None], (2, steps, 1)).astype(np.float32)
    got = trajectory(entry, grads)[:, :, 0]

    inner = [rate(t, 0.2, "cosine", 2, steps) for t in range(steps)]
    outer = [rate(k, 0.9, "linear", 0, rounds) for k in range(rounds)]
    theta_g, want = 0.0, np.zeros((2, steps))
    for k in range(rounds):
        reached = theta_g
        for t in range(k * H, (k + 1) * H):
            reached = reached - c * inner[t]  # both workers' models after step t
            want[:, t] = reached
        theta_g -= outer[k] * c.mean() * sum(inner[k * H : (k + 1) * H])
        want[:, (k + 1) * H - 1] = theta_g  # the outer step lands every worker there
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Not a schedule restarted every round, nor a constant outer rate.
    assert outer[1] != outer[0] and inner[H] != inner[0]


def test_outer_horizon_is_the_most_outer_steps_a_fragment_takes():
    """``rounds``: DiLoCo's steps / H; Streaming DiLoCo's fragment p syncs on the updates
    t = 1 .. steps with ``(t - p H // F) % H == 0`` (counted here), at most ceil(steps / H)."""
    assert DiLoCo(sync_every=10).rounds(Config(steps=400)) == 40
    for steps, H, F in [(400, 100, 4), (430, 100, 4), (13, 4, 3), (12, 4, 4)]:
        counts = [sum((t - p * H // F) % H == 0 for t in range(1, steps + 1)) for p in range(F)]
        cfg = Config(steps=steps)
        assert StreamingDiLoCo(sync_every=H, fragments=F).rounds(cfg) == max(counts), counts


def test_defaults_add_no_schedule_to_any_state():
    """At the defaults every algorithm gets a float rate, as before the schedules: no step
    count of a schedule in its state (checkpoints keep their layout)."""
    cfg = Config(workers=4, steps=20)

    def model(*workers):  # 4 leaves: Streaming DiLoCo's 4 fragments need one each
        return {k: jax.ShapeDtypeStruct((*workers, 8, 8), jnp.float32) for k in "abcd"}

    for name, algo in ALGORITHMS.items():
        hyper = algo.params()
        world = AxisCollective("workers", cfg.workers)
        comms = world.split(hyper.group_size) if algo.two_tier else world
        tx = algo.build(hyper, Context(comms, cfg))
        if algo.two_tier:
            init = jax.vmap(jax.vmap(tx.init, axis_name="member"), axis_name="group")
            state = jax.eval_shape(init, model(2, 2))
        else:
            state = jax.eval_shape(jax.vmap(tx.init, axis_name="workers"), model(4))
        assert not find_instances(state, optax.ScaleByScheduleState), name


def test_default_parts_are_the_plain_optax_optimizers():
    """Bit for bit: the default parts update as the optax optimizers they were before."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.ones(4)}
    plain = {
        "LocalSGD": (LocalSGD().make(50), optax.sgd(0.05, momentum=0.9)),
        "AdamW": (AdamW().make(50), standard_promotion(optax.adamw(1e-3, weight_decay=0.0))),
        "OuterSGD": (OuterSGD().make(5), optax.sgd(0.7, momentum=0.9, nesterov=True)),
    }
    for name, (ours, theirs) in plain.items():
        s1, s2 = ours.init(params), theirs.init(params)
        assert jax.tree.structure(s1) == jax.tree.structure(s2), name
        for _ in range(3):
            g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
            u1, s1 = ours.update(g, s1, params)
            u2, s2 = theirs.update(g, s2, params)
            for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_schedule_shows_in_the_state():
    """The control of the test above: a varying rate keeps its step count in the state."""
    cfg = Config(workers=2, steps=20)
    entries = (
        "ssgd[local.schedule.kind=cosine]",
        "diloco[outer.schedule.warmup_steps=1]",
        "muloco[inner.schedule.kind=linear]",
        "demo[schedule.warmup_steps=2]",
    )
    for entry in entries:
        tx = resolve(entry, cfg).build(AxisCollective("workers", 2))
        params = {k: jax.ShapeDtypeStruct((2, 8, 8), jnp.float32) for k in "abcd"}
        state = jax.eval_shape(jax.vmap(tx.init, axis_name="workers"), params)
        assert find_instances(state, optax.ScaleByScheduleState), entry


def test_demo_steps_at_its_schedule():
    """DeMo's step is ``-lr_t sign(...)``: its largest move at step t is ``lr_t``."""
    steps = 8
    cfg = Config(algorithms=("demo",), workers=2, steps=steps, batch_size=8)
    entry = resolve(
        "demo[learning_rate=0.01;schedule.kind=linear;schedule.warmup_steps=2;"
        "schedule.end_fraction=0.25;chunk_size=4;topk=2]",
        cfg,
    )
    grads = np.random.default_rng(2).normal(size=(2, steps, 8)).astype(np.float32)
    got = np.abs(np.diff(trajectory(entry, grads)[0], axis=0, prepend=0.0)).max(axis=1)
    want = [rate(t, 0.01, "linear", 2, steps, 0.25) for t in range(steps)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------------ clipping


def clip(g: np.ndarray, c: float) -> np.ndarray:
    """The NumPy oracle: ``g * min(1, c / ||g||)``, ``||g||`` over every entry of ``g``."""
    return g * min(1.0, c / float(np.sqrt(np.sum(np.square(g, dtype=np.float64)))))


def test_local_clip_is_the_oracle():
    for norm in (0.5, 4.0):  # below and above the clip
        g = np.random.default_rng(3).normal(size=(5,)).astype(np.float32)
        g = g * norm / np.linalg.norm(g)
        params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
        grads = {"a": jnp.asarray(g[:2]), "b": jnp.asarray(g[2:])}  # one norm over both
        sgd = LocalSGD(learning_rate=1.0, momentum=0.0, clip=1.5).make(10)
        u, _ = sgd.update(grads, sgd.init(params))
        got = -np.concatenate([np.asarray(u["a"]), np.asarray(u["b"])])
        np.testing.assert_allclose(got, clip(g, 1.5), rtol=1e-6, atol=1e-7)


# Each worker's own gradient is clipped (the exchange or the averaging is inside or after).
PER_WORKER = (
    "diloco[sync_every=2;inner.adamw.clip=1.0]",
    "diloco[sync_every=2;inner.use=sgd;inner.sgd.clip=1.0]",
    "streaming_diloco[sync_every=2;fragments=1;inner.adamw.clip=1.0]",
    "muloco[sync_every=2;inner.clip=1.0]",
    "demo[clip=1.0;sign=false;chunk_size=4;topk=2]",
    "lamb[clip=1.0]",
    "sma[local.clip=1.0]",
    "bmuf[block_size=2;local.clip=1.0]",
)
# The mean gradient is clipped: the local optimizer follows the all-reduce.
AFTER_MEAN = ("ssgd[local.clip=1.0]", "ssgd_adamw[adamw.clip=1.0]")


def unclipped(entry: str) -> str:
    """The entry without its clip."""
    name, _, rest = entry.partition("[")
    keep = [a for a in rest.rstrip("]").split(";") if not a.endswith("clip=1.0")]
    return f"{name}[{';'.join(keep)}]" if keep else name


@pytest.mark.parametrize("entry", PER_WORKER + AFTER_MEAN)
def test_clip_is_the_oracle_on_the_right_gradient(entry):
    """The entry with ``clip`` on gradients of norms on both sides of 1 trains exactly as
    the entry without it on the NumPy-clipped gradients: each worker's own, or for S-SGD
    the workers' mean (which every worker then gets, so the mean is the same)."""
    steps, workers = 4, 2
    cfg = Config(algorithms=(entry,), workers=workers, steps=steps, batch_size=8)
    rng = np.random.default_rng(4)
    grads = rng.normal(size=(workers, steps, 4, 4)).astype(np.float32)
    grads *= rng.choice([0.1, 3.0], size=(workers, steps, 1, 1)).astype(np.float32)
    if entry in AFTER_MEAN:
        mean = grads.mean(axis=0, dtype=np.float64)
        reference = np.stack([[clip(m, 1.0) for m in mean]] * workers)
    else:
        reference = np.array([[clip(g, 1.0) for g in row] for row in grads])
    got = trajectory(resolve(entry, cfg), grads)
    want = trajectory(resolve(unclipped(entry), cfg), reference.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # The clip acted: without it the entry lands elsewhere.
    assert not np.allclose(got, trajectory(resolve(unclipped(entry), cfg), grads), atol=1e-4)


def test_ssgd_clips_after_the_mean_not_before():
    """Two workers, one large gradient: clipping the mean is not the mean of the clipped."""
    g = np.array([[[3.0, 0.0]], [[0.0, 0.2]]], np.float32)  # [workers, steps=1, n]
    cfg = Config(algorithms=("ssgd",), workers=2, steps=1, batch_size=8)
    entry = resolve("ssgd[local.clip=1.0;local.momentum=0;local.learning_rate=1]", cfg)
    got = -trajectory(entry, g)[0, 0]
    after = clip(g[:, 0].mean(axis=0), 1.0)
    before = np.mean([clip(x, 1.0) for x in g[:, 0]], axis=0)
    np.testing.assert_allclose(got, after, rtol=1e-6)
    assert not np.allclose(after, before, atol=1e-3)


# ------------------------------------------------------------------ refusals name the field


@pytest.mark.parametrize(
    "values, field",
    [
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"init": 1.5}, "init"),
        ({"horizon": 0}, "horizon"),
        ({"end_fraction": 1.5}, "end_fraction"),
        ({"end_fraction": -0.1, "kind": "cosine"}, "end_fraction"),
        ({"end_fraction": 0.5}, "end_fraction"),  # a constant rate has no end
        ({"kind": "cosine", "warmup_steps": 10, "horizon": 10}, "schedule.warmup_steps"),
        ({"kind": "exp"}, "kind"),
    ],
)
def test_bad_schedules_are_refused_naming_the_field(values, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        Schedule(**values)
    # The same through the parts that hold one, in a config's params.
    with pytest.raises(ConfigError, match=f"'{field}'"):
        Config(params={"diloco": {"inner": {"adamw": {"schedule": values}}}})


@pytest.mark.parametrize(
    "params",
    [
        {"ssgd": {"local": {"clip": 0.0}}},
        {"ssgd_adamw": {"adamw": {"clip": -1.0}}},
        {"muloco": {"inner": {"clip": 0}}},
        {"demo": {"clip": -0.5}},
        {"onebit_adam": {"clip": 0.0}},
    ],
)
def test_a_bad_clip_is_refused_naming_it(params):
    with pytest.raises(ConfigError, match="'clip' must be None \\(no clipping\\) or a float > 0"):
        Config(params=params)


def test_a_warmup_past_the_optimizers_own_horizon_is_refused():
    cfg = Config(algorithms=("diloco",), workers=2, steps=40, batch_size=8)
    # The inner optimizer's horizon is the run's 40 steps.
    inner = "inner.adamw.schedule.kind=cosine;inner.adamw.schedule.warmup_steps"
    with pytest.raises(ConfigError) as e:
        resolve(f"diloco[{inner}=40]", cfg)
    assert "'schedule.warmup_steps' must be less than" in str(e.value)
    assert "T = 40" in str(e.value) and "diloco[" in str(e.value)
    resolve(f"diloco[{inner}=39]", cfg)
    # The outer optimizer's is its 4 outer steps (40 / sync_every 10): a 5-step warm-up
    # never ends.
    with pytest.raises(ConfigError, match="'schedule.warmup_steps' must be at most .* T = 4"):
        resolve("diloco[outer.schedule.warmup_steps=5]", cfg)
    resolve("diloco[outer.schedule.warmup_steps=4]", cfg)
    # --set names its key.
    with pytest.raises(ConfigError, match="--set ssgd.local.schedule.warmup_steps=-2: "):
        apply_overrides(Config(), ["ssgd.local.schedule.warmup_steps=-2"])


def test_bmuf_refuses_a_schedule_its_reset_would_restart():
    for name in ("bmuf", "bmuf_gtc"):
        with pytest.raises(ConfigError, match="'local.schedule' must be constant"):
            Config(params={name: {"local": {"schedule": {"kind": "cosine"}}}})
        ok = {"reset_inner_state": False, "local": {"schedule": {"kind": "cosine"}}}
        assert Config(params={name: ok}).params[name].local.schedule.kind == "cosine"


def test_a_scheduled_run_resumes_exactly(tmp_path):
    """The schedules' step counts are optimizer state: a run stopped inside the warm-up
    and resumed from its checkpoint ends as the uninterrupted one, record for record."""
    entry = (
        "diloco[sync_every=4;inner.adamw.schedule.kind=cosine;inner.adamw.schedule."
        "warmup_steps=3;inner.adamw.clip=1.0;outer.schedule.kind=linear]"
    )
    sets = ["steps=8", "eval_every=4", "project_workers=0", "checkpoint_every=2",
            f"algorithms={entry}"]  # fmt: skip
    args = [str(harness.QUICKSTART), "--workers", "2", "--no-progress", "--set", *sets]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert main([*args, "--out", str(tmp_path / "split"), "--stop-after", "2"]) == 0
    assert main([*args, "--out", str(tmp_path / "split"), "--resume"]) == 0

    def records(out):
        rows = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
        return [{k: v for k, v in r.items() if k not in ("time_s", "wall_s")} for r in rows]

    whole = records(tmp_path / "whole")
    assert len(whole) == 8 and records(tmp_path / "split") == whole


# ------------------------------------------------------------------ spellings and the study


def test_the_three_spellings_give_the_same_schedule_and_clip(tmp_path):
    cfg = Config(algorithms=("diloco",), workers=2, steps=40, batch_size=8)
    keys = ["inner.adamw.schedule.kind=cosine", "inner.adamw.schedule.warmup_steps=5",
            "inner.adamw.clip=1.0"]  # fmt: skip
    sets = [f"diloco.{k}" for k in keys]
    bracket = f"diloco[{';'.join(keys)}]"
    schedule = {"kind": "cosine", "warmup_steps": 5}
    nested = {"inner": {"adamw": {"schedule": schedule, "clip": 1.0}}}
    got = [
        resolve("diloco", apply_overrides(cfg, sets)).params,
        resolve(bracket, cfg).params,
        resolve("diloco", dataclasses.replace(cfg, params={"diloco": nested})).params,
    ]
    adamw = AdamW(schedule=Schedule(kind="cosine", warmup_steps=5), clip=1.0)
    want = dataclasses.replace(DiLoCo(), inner=dataclasses.replace(DiLoCo().inner, adamw=adamw))
    assert all(p == want for p in got), got
    assert want != DiLoCo()


def test_the_diloco_study_runs_the_papers_inner_recipe():
    cfg = load_config("diloco_lm")
    p = cfg.params
    adamw = [p["ssgd_adamw"].adamw, p["diloco"].inner.adamw, p["streaming_diloco"].inner.adamw]
    for a in adamw:
        assert a.schedule.kind == "cosine" and 0 < a.schedule.warmup_steps < cfg.steps // 10
        assert a.clip == 1.0
    assert len({(a.learning_rate, a.schedule, a.clip) for a in adamw}) == 1  # a fair baseline
    # Every entry builds (on stand-in workers) at the study's length and at a short one.
    resolve_all(cfg)
    resolve_all(apply_overrides(cfg, ["steps=100"]))
