"""MuLoCo (`shoal.experiments.algorithms.muloco`): DiLoCo with Muon inside. The runner's
entry against an oracle whose outer step is NumPy (the inner steps are optax's own Muon,
which MuLoCo uses as it is); the entry trains the bundled task, moves DiLoCo's bytes, and
refuses a run whose last step is not an outer step."""

from __future__ import annotations

import dataclasses

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import QUICKSTART
from jax import lax
from optax import contrib

from shoal.comms import AxisCollective, TopK
from shoal.dtypes import standard_promotion
from shoal.experiments.algorithms import resolve
from shoal.experiments.algorithms.muloco import MuLoCo, Muon
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import diloco

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="simulated workers")

WORKERS, D, K, S = 2, 6, 4, 8  # workers, features, outputs, samples per worker
H, ROUNDS = 3, 2  # inner steps per round, outer steps
RNG = np.random.default_rng(3)
X = RNG.normal(size=(WORKERS, S, D)).astype(np.float32)
# Each worker's own targets: their inner steps part, so the average is not any one's.
Y = (X @ RNG.normal(size=(D, K)) + RNG.normal(size=(WORKERS, 1, K))).astype(np.float32)
# One matrix (Muon) and one vector (AdamW inside Muon).
P0 = {"b": RNG.normal(size=K).astype(np.float32), "w": RNG.normal(size=(D, K)).astype(np.float32)}
# Not the defaults, so that each must reach the transformation.
INNER_LR, ADAM_LR, BETA = 0.05, 0.01, 0.9
OUTER_LR, OUTER_MU = 0.5, 0.8
ENTRY = (f"muloco[sync_every={H};inner.learning_rate={INNER_LR};"
         f"inner.adam_learning_rate={ADAM_LR};inner.beta={BETA};"
         f"outer.learning_rate={OUTER_LR};outer.momentum={OUTER_MU}]")  # fmt: skip
CFG = Config(algorithms=(ENTRY,), workers=WORKERS, steps=H * ROUNDS, batch_size=8)


def loss(p, x, y):
    return 0.5 * jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, axis=-1))


def oracle(workers: int = WORKERS) -> dict[str, np.ndarray]:
    """The global model after ``ROUNDS`` rounds: each of ``workers`` takes ``H`` steps of optax's
    Muon (its state kept across rounds: DiLoCo never resets it) from the global model;
    then, in float64 NumPy, the outer Nesterov SGD on the average progress
    ``delta = theta_g - mean_i theta_i``: ``m = mu m + delta``,
    ``theta_g <- theta_g - lr (mu m + delta)``."""
    # optax's Muon as it is (its AdamW part needs standard promotion: the session is strict).
    inner = standard_promotion(
        contrib.muon(INNER_LR, beta=BETA, ns_steps=5, adam_learning_rate=ADAM_LR)
    )
    step = jax.jit(lambda p, s, x, y: inner.update(jax.grad(loss)(p, x, y), s, p))
    theta_g = {k: v.astype(np.float64) for k, v in P0.items()}
    m = {k: np.zeros_like(v) for k, v in theta_g.items()}
    states = [inner.init(P0) for _ in range(workers)]
    for _ in range(ROUNDS):
        reached = []
        for i in range(workers):
            p = {k: jnp.asarray(v, jnp.float32) for k, v in theta_g.items()}
            for _ in range(H):
                u, states[i] = step(p, states[i], X[i], Y[i])
                p = optax.apply_updates(p, u)
            reached.append({k: np.asarray(v, np.float64) for k, v in p.items()})
        for k in theta_g:
            delta = theta_g[k] - np.mean([r[k] for r in reached], axis=0)
            m[k] = OUTER_MU * m[k] + delta
            theta_g[k] = theta_g[k] - OUTER_LR * (OUTER_MU * m[k] + delta)
    return theta_g


def run_entry(entry, steps: int, workers: int = WORKERS):
    """``steps`` updates of the runner's transformation for ``entry`` on ``workers``
    simulated workers (vmap over a named axis): every worker's params after each step."""
    coll = AxisCollective("workers", workers)
    tx = entry.build(coll)

    def worker(x, y):
        params = jax.tree.map(jnp.asarray, P0)  # the same model on every worker

        def body(carry, _):
            p, s = carry
            u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
            p = optax.apply_updates(p, u)
            return (p, s), p

        _, trajectory = lax.scan(body, (params, tx.init(params)), None, length=steps)
        return trajectory

    return jax.jit(jax.vmap(worker, axis_name="workers"))(X[:workers], Y[:workers])


@pytest.mark.parametrize("workers", [WORKERS, 1])
def test_entry_matches_muon_inside_and_a_numpy_outer_step(workers):
    """K = 2, and K = 1 (the paper's single worker: the outer Nesterov step on one
    worker's H-step progress)."""
    entry = resolve(ENTRY, dataclasses.replace(CFG, workers=workers))
    p = entry.params
    assert p == MuLoCo(
        sync_every=H,
        inner=Muon(learning_rate=INNER_LR, adam_learning_rate=ADAM_LR, beta=BETA),
        outer=dataclasses.replace(MuLoCo().outer, learning_rate=OUTER_LR, momentum=OUTER_MU),
    )
    trajectory = run_entry(entry, H * ROUNDS, workers)
    want = oracle(workers)
    for k in want:
        got = np.asarray(trajectory[k])  # [workers, steps, ...]
        # After the last outer step every worker holds the global model.
        for w in range(workers):
            np.testing.assert_allclose(got[w, -1], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
        if workers > 1:  # between outer steps the workers part (their data differ)
            assert not np.allclose(got[0, H - 2], got[1, H - 2])
    # The outer step matters: plain averaging of the workers' models is another model.
    moved = {k: np.asarray(trajectory[k])[0, -1] for k in want}
    assert any(np.abs(moved[k] - np.asarray(P0[k])).max() > 1e-2 for k in want)


def test_compressed_exchange_with_error_feedback():
    """The paper's compressed MuLoCo: the outer gradient as a top-k with 2-bit values and
    error feedback (``exchange.codec=topk``): the entry is `shoal.optim.diloco` with Muon
    inside and that `shoal.comms.TopK`, bit for bit, and sends its bytes each round."""
    entry_text = (
        ENTRY[:-1]
        + ";exchange.codec=topk;exchange.topk.fraction=0.25;"
        + ("exchange.topk.chunk_size=4;exchange.topk.value_bits=2]")
    )
    entry = resolve(entry_text, CFG)
    codec = entry.params.exchange.make()
    assert codec == TopK(0.25, chunk_size=4, value_bits=2) and codec.error_feedback
    got = run_entry(entry, H * ROUNDS)
    plain = run_entry(resolve(ENTRY, CFG), H * ROUNDS)
    inner = standard_promotion(
        contrib.muon(INNER_LR, beta=BETA, ns_steps=5, adam_learning_rate=ADAM_LR)
    )
    outer = optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)
    coll = AxisCollective("workers", WORKERS)
    tx = diloco(inner, collective=coll, sync_every=H, outer=outer, exchange=codec)

    def worker(x, y):
        def body(carry, _):
            p, s = carry
            u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
            p = optax.apply_updates(p, u)
            return (p, s), (p, s.wire.step.sent)

        p0 = jax.tree.map(jnp.asarray, P0)
        _, out = lax.scan(body, (p0, tx.init(p0)), None, length=H * ROUNDS)
        return out

    want, sent = jax.jit(jax.vmap(worker, axis_name="workers"))(X, Y)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    n = sum(np.size(v) for v in P0.values())  # 28 values: 7 chunks of 4, one sent of each
    assert np.asarray(sent[0]).tolist() == [0, 0, codec.wire_bytes(n, WORKERS)[0]] * ROUNDS
    assert any(not np.allclose(got[k], plain[k]) for k in P0)  # compression changes the run


def test_oracle_is_not_diloco_with_adamw():
    """The inner optimizer is Muon: DiLoCo's entry with the same outer step and AdamW at
    the same rate inside lands elsewhere."""
    adamw = (f"diloco[sync_every={H};inner.adamw.learning_rate={INNER_LR};outer.learning_rate="
             f"{OUTER_LR};outer.momentum={OUTER_MU}]")  # fmt: skip
    cfg = dataclasses.replace(CFG, algorithms=(adamw,))
    other = run_entry(resolve(adamw, cfg), H * ROUNDS)
    want = oracle()
    assert any(
        not np.allclose(np.asarray(other[k])[0, -1], want[k], rtol=1e-3, atol=1e-4) for k in want
    )


def test_muloco_trains_the_bundled_task_with_diloco_bytes():
    steps, every = 20, 5
    cfg = apply_overrides(load_config(QUICKSTART), [
        "workers=4", f"steps={steps}", "eval_every=10", "project_workers=0",
        f"muloco.sync_every={every}", f"diloco.sync_every={every}",
    ])  # fmt: skip
    task, backend = GaussianMixtureTask(cfg), SimBackend(4)
    muloco = train(cfg, task, backend, "muloco", progress=False)
    diloco = train(cfg, task, backend, "diloco", progress=False)
    losses = [r["loss"] for r in muloco.records]
    assert len(losses) == steps and np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    init_loss, _ = task.evaluate(task.init_params())
    assert muloco.summary["test_loss"] < init_loss
    # The same exchange: an all-reduce of the model every `every` steps, the flag between.
    sent = [r["bytes_sent"] for r in muloco.records]
    assert sent == [r["bytes_sent"] for r in diloco.records]
    assert [r["bytes_received"] for r in muloco.records] == sent
    big = [i + 1 for i, b in enumerate(sent) if b > min(sent)]
    assert big == list(range(every, steps + 1, every))
    # Other training: Muon is not AdamW.
    assert losses != [r["loss"] for r in diloco.records]
    # The last step is an outer step: every worker holds the global model.
    for leaf in jax.tree.leaves(muloco.params):
        np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), atol=1e-6)


def test_last_step_must_be_an_outer_step(capsys, tmp_path):
    cfg = Config(algorithms=("muloco",), steps=20)
    with pytest.raises(ConfigError, match="steps = 20 must be a multiple of sync_every = 7"):
        resolve("muloco[sync_every=7]", cfg)
    with pytest.raises(ConfigError, match="sync_every = 7"):
        resolve("muloco", apply_overrides(cfg, ["muloco.sync_every=7"]))
    assert resolve("muloco[sync_every=5]", cfg).params.sync_every == 5
    argv = [str(QUICKSTART), "--set", "steps=20", "algorithms=muloco[sync_every=7]",
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("shoal-run: error:") and "muloco[sync_every=7]" in line
    assert "sync_every = 7" in line
    assert not (tmp_path / "run").exists()


def test_muon_knobs_are_checked():
    for bad, field in [({"learning_rate": 0.0}, "learning_rate"), ({"beta": 1.0}, "beta"),
                       ({"ns_steps": 0}, "ns_steps"), ({"weight_decay": -1.0}, "weight_decay"),
                       ({"adam_learning_rate": 0.0}, "adam_learning_rate")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"'{field}' must be"):
            Config(params={"muloco": {"inner": bad}})
    with pytest.raises(ConfigError, match="'sync_every' must be an int >= 1"):
        Config(params={"muloco": {"sync_every": 0}})
