"""Benchmark: shoal's simulated DiLoCo against the same DiLoCo written with drjax the way
MaxText structures it, and against the JAX floor.

Usage: ``.venv/bin/python benchmarks/sim_vs_jax_peer.py [--models mlp,lm] [--workers
4,8,16] [--sync-every H] [--reps R] [--lm-width 256 --lm-layers 5]`` (``make bench``
runs it with no options; a smoke run: ``--models mlp --workers 2 --reps 1 --mlp-width 32
--sync-every 2``).

Every system trains the same DiLoCo, from the same model on the same batches: N
simulated workers, each taking H = 10 inner AdamW steps (learning rate 1e-3) per round on
its own fixed batch, then the outer Nesterov SGD step (0.7, momentum 0.9) on the mean of
``theta_g - theta_i``, after which every worker continues from ``theta_g``. The inner
AdamW states persist across rounds (shoal's `diloco` never resets them; neither does the
drjax program). The systems:

* **shoal**: ``shoal.optim.diloco`` under ``jax.jit(jax.vmap(step))`` with
  `update_and_apply`, the parameters and state donated, one dispatch per inner step, every
  leaf per worker (what ``shoal-run`` ran before it held the state once);
* **shoal, held once**: the same, with DiLoCo's rank-uniform state (global model, outer
  optimizer state, counters) passed to vmap unbatched, one copy for all workers
  (`shoal.optim.helpers.uniform_axes`, `hold_uniform`): what ``shoal-run`` runs;
* **shoal, held once, scanned**: that, with the H inner steps of a round in one
  ``lax.scan`` inside one jitted, donated program (``shoal-run --set scan_steps=10``);
* **shoal, held once, in turn**: the round in one program, its H - 1 local steps one
  worker after another (`shoal.optim.helpers.take_turns`: a loop over the workers of each
  worker's scan), the exchange step under vmap (``shoal-run --set scan_steps=10 --set
  in_turn=true``);
* **drjax**: a drjax program (``drjax.program``, ``map_fn``, ``reduce_mean``,
  ``broadcast``) in MaxText's layout: the inner parameters and AdamW states placed, one
  per worker, the global model and the outer optimizer state held once; the H inner steps
  of a round in one ``lax.scan``, then the outer step (drjax is a benchmark extra,
  ``pip install -e '.[bench]'``, never a dependency of shoal);
* **JAX floor**: one worker's plain AdamW step (jitted, donated), H of them, times N: the
  time N workers' inner steps take with nothing else.

Timing: one untimed round per system (compiling), then ``reps`` rounds each, interleaved
(the order rotates every rep), each waited for; reported is the median seconds per round
and ratios of medians (above 1: shoal is faster). Memory: XLA's accounting of each
compiled program (arguments + outputs - aliased + temporaries; the per-step program for
shoal, the round for the others), and the bytes of the state carried between programs,
both over N. Agreement: after the first round, the largest difference between each
system's global model and shoal's (float32 rounding, not more: drjax averages
``theta_i`` in another order, and XLA fuses the unbatched and scanned programs
otherwise).

Models: ``mlp``, `sim_scale`'s 4-layer tanh MLP of width 512 (1.05M parameters, 32
examples per worker); ``lm``, the byte-level transformer of ``shoal.experiments.tasks.lm``
(width 256, 5 blocks, 4 heads: 4.0M parameters) on 8 windows of 64 random bytes per
worker.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from run_all import cpu_model  # benchmarks/ is on sys.path when this runs as a script
from sim_scale import ScaleTask, memory, n_params

from shoal.comms import AxisCollective
from shoal.experiments.runner import malloc
from shoal.optim import diloco, update_and_apply
from shoal.optim.helpers import hold_uniform, take_turns, uniform_axes

LR, OUTER_LR, MOMENTUM = 1e-3, 0.7, 0.9


def inner_tx():
    return optax.adamw(LR)


def outer_tx():
    return optax.sgd(OUTER_LR, momentum=MOMENTUM, nesterov=True)


# ----------------------------------------------------------------------------- models


class MLP(ScaleTask):
    """`sim_scale`'s task: its 4-layer tanh MLP and fixed batches, stacked for H steps."""

    def __init__(self, width: int, batch: int = 32):
        super().__init__(width, batch)
        self.label = f"MLP {n_params(width) / 1e6:.3g}M"

    def init(self) -> dict:
        return self.init_params()

    def batches(self, h: int, n: int):
        """[H, N, ...] inputs and labels: step k, worker i."""
        xs, ys = zip(*(self.batch(k, n) for k in range(h)))
        return jnp.asarray(np.stack(xs)), jnp.asarray(np.stack(ys))


class ByteLM:
    """`shoal.experiments.tasks.lm.ByteTransformer` on windows of random bytes."""

    def __init__(self, width: int, layers: int, heads: int, seq: int = 64, batch: int = 8):
        from shoal.experiments.tasks.lm import ByteTransformer

        self.model = ByteTransformer(width, layers, heads, seq)
        self.seq, self.batch = seq, batch
        shapes = jax.eval_shape(self.init)
        count = sum(x.size for x in jax.tree.leaves(shapes))
        self.label = f"GPT-style LM {count / 1e6:.3g}M"

    def init(self, seed: int = 0) -> Any:
        tokens = jnp.zeros((1, self.seq), jnp.int32)
        return self.model.init(jax.random.key(seed), tokens)["params"]

    def loss(self, params, tokens, targets):
        logits = self.model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def batches(self, h: int, n: int, seed: int = 1):
        rng = np.random.default_rng(seed)
        w = rng.integers(256, size=(h, n, self.batch, self.seq + 1)).astype(np.int32)
        return jnp.asarray(w[..., :-1]), jnp.asarray(w[..., 1:])


# ---------------------------------------------------------------------------- systems


def stacked(tree, n):
    return jax.tree.map(lambda a: jnp.array(jnp.broadcast_to(a, (n, *a.shape))), tree)


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


class Shoal:
    """shoal's `diloco` under vmap; ``held``: its rank-uniform state held once
    (`shoal.optim.helpers.uniform_axes`); ``scanned``: H inner steps per program;
    ``in_turn``: the H - 1 local steps of a round one worker after another
    (`shoal.optim.helpers.take_turns`), then the exchange step vmapped, in one program."""

    def __init__(self, model, n: int, h: int, *, held: bool, scanned: bool, in_turn=False):
        self.name = "shoal" + (", held once" if held else "") + (", scanned" if scanned else "")
        self.name += ", in turn" if in_turn else ""
        self.h, self.held, self.scanned = h, held, scanned or in_turn
        coll = AxisCollective("workers", n)
        tx = diloco(inner_tx(), collective=coll, sync_every=h, outer=outer_tx())

        def step(params, state, x, y):
            grads = jax.grad(model.loss)(params, x, y)
            return update_and_apply(tx, grads, state, params)

        def round_(params, state, xs, ys):
            def body(carry, batch):
                return step(*carry, *batch), None

            return jax.lax.scan(body, (params, state), (xs, ys))[0]

        params = stacked(model.init(), n)
        state = jax.jit(jax.vmap(tx.init, axis_name="workers"))(params)
        if held:
            state = hold_uniform(state)
        axes = uniform_axes(state) if held else 0
        self.state = (params, state)
        xs, ys = model.batches(h, n)
        if in_turn:
            sync = jax.vmap(step, axis_name="workers", in_axes=(0, axes, 0, 0), out_axes=(0, axes))

            def fn(params, state, xs, ys):  # xs: [N, H, ...]
                local = lambda p, s, x, y: (*step(p, s, x, y), ())
                params, state, _ = take_turns(local, coll, params, state, xs[:, :-1], ys[:, :-1])
                return sync(params, state, xs[:, -1], ys[:, -1])

            self.args = (jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ys, 0, 1))
        elif scanned:
            fn = jax.vmap(round_, axis_name="workers", in_axes=(0, axes, 1, 1), out_axes=(0, axes))
            self.args = (xs, ys)
        else:
            fn = jax.vmap(step, axis_name="workers", in_axes=(0, axes, 0, 0), out_axes=(0, axes))
            self.args = [(xs[k], ys[k]) for k in range(h)]
        example = self.args if self.scanned else self.args[0]
        self.program = jax.jit(fn, donate_argnums=(0, 1)).lower(*self.state, *example).compile()
        self.memory = memory(self.program)["peak"]
        self.state_bytes = nbytes(self.state)

    def round(self) -> None:
        if self.scanned:
            self.state = self.program(*self.state, *self.args)
        else:
            for batch in self.args:
                self.state = self.program(*self.state, *batch)
        jax.block_until_ready(self.state)

    def global_model(self):
        theta = self.state[1].global_params
        return theta if self.held else jax.tree.map(lambda a: a[0], theta)


class DrJAX:
    """DiLoCo as a drjax program, in MaxText's layout (module docstring)."""

    name = "drjax"

    def __init__(self, model, n: int, h: int):
        import drjax

        inner, outer = inner_tx(), outer_tx()

        def inner_step(params, opt, x, y):
            grads = jax.grad(model.loss)(params, x, y)
            updates, opt = inner.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt

        @drjax.program(placements={"workers": n})
        def round_(state, xs, ys):
            params, opts, theta_g, outer_opt = state

            def body(carry, batch):
                return drjax.map_fn(inner_step, (*carry, *batch)), None

            (params, opts), _ = jax.lax.scan(body, (params, opts), (xs, ys))
            delta = jax.tree.map(jnp.subtract, theta_g, drjax.reduce_mean(params))
            updates, outer_opt = outer.update(delta, outer_opt, theta_g)
            theta_g = optax.apply_updates(theta_g, updates)
            return drjax.broadcast(theta_g), opts, theta_g, outer_opt

        theta = model.init()
        params = stacked(theta, n)
        opts = jax.vmap(inner.init)(params)
        self.state = (params, opts, jax.tree.map(jnp.array, theta), outer.init(theta))
        self.args = model.batches(h, n)
        self.program = jax.jit(round_, donate_argnums=0).lower(self.state, *self.args).compile()
        self.memory = memory(self.program)["peak"]
        self.state_bytes = nbytes(self.state)

    def round(self) -> None:
        self.state = self.program(self.state, *self.args)
        jax.block_until_ready(self.state)

    def global_model(self):
        return self.state[2]


class Floor:
    """One worker's plain AdamW step, H of them per round; times N when reported."""

    name = "JAX floor"

    def __init__(self, model, n: int, h: int):
        inner = inner_tx()

        def step(params, opt, x, y):
            grads = jax.grad(model.loss)(params, x, y)
            updates, opt = inner.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt

        params = model.init()
        self.state = (params, inner.init(params))
        xs, ys = model.batches(h, n)
        self.args = [(xs[k, 0], ys[k, 0]) for k in range(h)]
        self.program = jax.jit(step, donate_argnums=(0, 1)).lower(*self.state, *self.args[0])
        self.program = self.program.compile()
        self.memory = memory(self.program)["peak"]
        self.state_bytes = nbytes(self.state)
        self.n = n

    def round(self) -> None:
        for batch in self.args:
            self.state = self.program(*self.state, *batch)
        jax.block_until_ready(self.state)


# ------------------------------------------------------------------------------ runs


def largest_difference(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def measure(model, n: int, h: int, reps: int, drjax: bool = True) -> dict[str, Any]:
    """Every system's round at ``n`` workers (without drjax unless ``drjax``): seconds
    (medians of ``reps`` interleaved rounds), memory and state per worker, and agreement."""
    systems = [
        Shoal(model, n, h, held=False, scanned=False),
        Shoal(model, n, h, held=True, scanned=False),
        Shoal(model, n, h, held=True, scanned=True),
        Shoal(model, n, h, held=True, scanned=False, in_turn=True),
        *([DrJAX(model, n, h)] if drjax else []),
        Floor(model, n, h),
    ]
    for s in systems:
        s.round()  # untimed: the first round (compiled above, but first runs allocate)
    reference = systems[0].global_model()
    agree = {s.name: largest_difference(s.global_model(), reference) for s in systems[1:-1]}
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    for rep in range(reps):
        k = rep % len(systems)
        for s in systems[k:] + systems[:k]:
            start = time.perf_counter()
            s.round()
            times[s.name].append(time.perf_counter() - start)
    out = {
        "model": model.label,
        "n": n,
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "memory": {s.name: s.memory / (1 if s.name == "JAX floor" else n) for s in systems},
        "state": {s.name: s.state_bytes / (1 if s.name == "JAX floor" else n) for s in systems},
        "agree": agree,
    }
    out["seconds"]["JAX floor"] *= n  # N workers' inner steps
    del systems
    gc.collect()
    return out


def report(results: list[dict[str, Any]], h: int, reps: int, wall: float, load) -> None:
    print(
        f"sim_vs_jax_peer: DiLoCo, H = {h} inner AdamW steps ({LR}) per round, outer Nesterov "
        f"SGD ({OUTER_LR}, {MOMENTUM}); median s/round of {reps} interleaved rounds per system"
    )
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"drjax {__import__('drjax').__version__}, load average (1 min) {load[0]:.2f} at start, "
        f"{os.getloadavg()[0]:.2f} at end; total {wall:.0f} s; malloc: {malloc.describe()}"
    )
    held, both, turn = "shoal, held once", "shoal, held once, scanned", "shoal, held once, in turn"
    print()
    print("### Seconds per round, and ratios (above 1: the first named is slower)")
    print()
    print(
        "| model | N | shoal | held once | held, scanned | held, in turn | drjax | JAX floor | "
        "drjax / scanned | drjax / in turn | scanned / floor | in turn / floor |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        s = r["seconds"]
        sh, he, hs, it, dr, fl = (s[k] for k in ("shoal", held, both, turn, "drjax", "JAX floor"))
        print(
            f"| {r['model']} | {r['n']} | {sh:.4g} | {he:.4g} | {hs:.4g} | {it:.4g} | {dr:.4g} | "
            f"{fl:.4g} | {dr / hs:.2f} | {dr / it:.2f} | {hs / fl:.2f} | {it / fl:.2f} |"
        )
    print()
    print("### Memory per worker (MB) and agreement after one round")
    print()
    print(
        "| model | N | XLA: shoal | held once | held, scanned | held, in turn | drjax | "
        "state: shoal | held once | drjax | max diff to shoal: held, scanned, in turn, drjax |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        m, st, a = r["memory"], r["state"], r["agree"]
        mb = lambda k, m=m: f"{m[k] / 1e6:.3g}"
        print(
            f"| {r['model']} | {r['n']} | {mb('shoal')} | {mb(held)} | {mb(both)} | {mb(turn)} | "
            f"{mb('drjax')} | {st['shoal'] / 1e6:.3g} | {st[held] / 1e6:.3g} | "
            f"{st['drjax'] / 1e6:.3g} | "
            f"{a[held]:.1e}, {a[both]:.1e}, {a[turn]:.1e}, {a['drjax']:.1e} |"
        )
    print()
    print(
        "The floor is one worker's plain AdamW step times N. XLA: its accounting of the "
        "compiled program (shoal's per-step program; the round for the scanned, in turn and "
        "drjax); state: the bytes carried between programs; both over N."
    )


def main() -> None:
    malloc.reexec_with_tunables(default="keep")  # as shoal-run for simulated workers
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,lm", help="mlp, lm or both (default mlp,lm)")
    p.add_argument("--workers", default="4,8,16", help="comma-separated N (default 4,8,16)")
    p.add_argument("--sync-every", type=int, default=10, help="H, inner steps per round")
    p.add_argument("--reps", type=int, default=5, help="timed rounds per system")
    p.add_argument("--mlp-width", type=int, default=512)
    p.add_argument("--lm-width", type=int, default=256)
    p.add_argument("--lm-layers", type=int, default=5)
    p.add_argument("--lm-heads", type=int, default=4)
    args = p.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - {"mlp", "lm"}:
        p.error(f"--models: expected mlp and/or lm, got {args.models!r}")
    try:
        workers = [int(n) for n in args.workers.split(",") if n.strip()]
    except ValueError:
        workers = []
    if not workers or min(workers) < 2:
        p.error(f"--workers: expected N >= 2, comma-separated, got {args.workers!r}")
    if args.sync_every < 1 or args.reps < 1:
        p.error("--sync-every and --reps must be >= 1")
    try:
        import drjax  # noqa: F401
    except ImportError:
        sys.exit("sim_vs_jax_peer: drjax is not installed: pip install -e '.[bench]'")
    # drjax warns at every trace that no device mesh is set: simulated workers have none.
    logging.getLogger("absl").setLevel(logging.ERROR)
    load, start = os.getloadavg(), time.perf_counter()
    results = []
    for name in models:
        model = (
            MLP(args.mlp_width)
            if name == "mlp"
            else ByteLM(args.lm_width, args.lm_layers, args.lm_heads)
        )
        for n in workers:
            print(f"# {model.label} x {n}", file=sys.stderr, flush=True)
            results.append(measure(model, n, args.sync_every, args.reps))
    report(results, args.sync_every, args.reps, time.perf_counter() - start, load)


if __name__ == "__main__":
    main()
