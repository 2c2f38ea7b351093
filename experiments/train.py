"""The training loop: one algorithm, all workers, per-step metrics on the root."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from shoal.comms import wire_bytes
from shoal.experiments import algorithms, checkpoint, policies, projection
from shoal.experiments.checkpoint import Checkpointer
from shoal.experiments.config import Config, ConfigError
from shoal.optim.bmuf import BMUFState
from shoal.optim.diloco import DiLoCoState
from shoal.optim.gtc import sent_fraction
from shoal.optim.noise_scale import noise_scale
from shoal.optim.nonfinite import NonFiniteGradientError, skipped_steps
from shoal.optim.streaming_diloco import StreamingDiLoCoState

MB = 1e6  # bytes; reports say "MB" in decimal units


@dataclasses.dataclass
class RunResult:
    """What one algorithm's run produced.

    ``records`` (one dict per step) and ``summary`` exist on the root process only.
    ``params`` are the final parameters of this process's workers, whole leaves stacked on
    a leading axis (all workers for ``sim``, this rank's for ``mpi``, those whose first
    device is here for ``jax``). ``finished`` is False
    when the run stopped early (``max_steps``) after step ``step``; it continues with
    ``resume``. ``trained`` counts the steps this call ran.
    """

    algorithm: str
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None
    params: Any
    finished: bool = True
    step: int = 0
    trained: int = 0


def make_step(loss_fn, tx: optax.GradientTransformation, inject: bool = False, given: bool = False):
    """One worker's step: local gradient, the algorithm's update (which communicates),
    and the bytes the update put on and took off the wire. With ``inject`` the step takes
    one more argument, a float32 added to every gradient element (0, or NaN to inject a
    fault). With ``given`` the step takes ``(loss, grads)``, already computed, in place of
    ``(x, y)`` (`compile_step` with ``grad_chunk``)."""

    def step(params, opt_state, x, y, *fault):
        loss, grads = (x, y) if given else jax.value_and_grad(loss_fn)(params, x, y)
        if inject:
            grads = jax.tree.map(lambda g: g + fault[0].astype(g.dtype), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # This update's bytes; the host sums them, since a policy change may re-init the
        # exchange (and with it the state's totals since init) mid-run.
        wire = wire_bytes(opt_state, "step")
        # Sparsifiers move a fixed-capacity buffer; their density says how full it was.
        density = sent_fraction(opt_state)
        density = jnp.float32(jnp.nan) if density is None else density
        noise = noise_scale(opt_state)
        noise = jnp.float32(jnp.nan) if noise is None else noise
        skipped = skipped_steps(opt_state)
        skipped = jnp.int32(0) if skipped is None else skipped
        return params, opt_state, (loss, wire.sent, wire.received, density, noise, skipped)

    return step


# How the `make_step` metrics of a worker's devices make the worker's (`backend.by_worker`):
# the loss, noise scale and skip count are the worker's on each of its devices; each device
# sends and receives its own pieces; the density is per piece, and the pieces equal-sized.
METRIC_OPS = ("first", "sum", "sum", "mean", "first", "first")


def check_grad_chunk(grad_chunk: int, backend: str, workers: int) -> None:
    """Raise `ConfigError` unless ``grad_chunk`` (0: off) can run: simulated workers only,
    and a divisor of their number."""
    if not grad_chunk:
        return
    if backend != "sim":
        raise ConfigError(
            f"grad_chunk = {grad_chunk} applies to simulated workers only (--backend sim), "
            f"not --backend {backend}: drop grad_chunk (or set grad_chunk=0)"
        )
    if workers % grad_chunk:
        raise ConfigError(f"grad_chunk = {grad_chunk} must divide the number of workers {workers}")


def compile_step(backend, loss_fn, tx, *, inject=False, group_size=None, grad_chunk=0):
    """`make_step` for all of ``backend``'s workers (``backend.spmd``). With ``grad_chunk = K
    > 0`` (`SimBackend` only) the workers' gradients are computed K workers at a time
    (``jax.lax.map`` over the worker axis, K under ``vmap`` per iteration), so only K
    workers' activations are alive at once; the update, which communicates, still runs
    under ``vmap`` over all workers. Same results as ``grad_chunk = 0`` up to rounding."""
    if not grad_chunk:
        return backend.spmd(make_step(loss_fn, tx, inject=inject), group_size=group_size)
    check_grad_chunk(grad_chunk, backend.name, backend.size)
    update = backend.spmd(make_step(loss_fn, tx, inject=inject, given=True), group_size=group_size)
    grad = jax.value_and_grad(loss_fn)

    def step(params, opt_state, x, y, *fault):
        loss, grads = jax.lax.map(lambda a: grad(*a), (params, x, y), batch_size=grad_chunk)
        return update(params, opt_state, loss, grads, *fault)

    return jax.jit(step)


def evaluated_params(params: Any, opt_state: Any) -> Any:
    """The model to test: ``params``, or, when ``opt_state`` holds a `BMUFState`, a
    `DiLoCoState` or a `StreamingDiLoCoState`, the global model of the latest outer step
    (``W_g``, per fragment for Streaming DiLoCo; BMUF's filtered model ``W`` with
    ``nbm="chen_huo"``), which is what these methods deliver: mid-block (mid-round), the
    workers' models are local, unsynchronised ones."""
    kinds = (BMUFState, DiLoCoState, StreamingDiLoCoState)
    states = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
        if isinstance(s, kinds)
    ]
    if not states:
        return params
    state = states[0]
    if isinstance(state, (DiLoCoState, StreamingDiLoCoState)):
        return state.global_params
    return state.global_params if state.filtered is None else state.filtered


def carry_state(old: Any, new: Any) -> Any:
    """``new`` (a freshly initialised optimizer state) with every part that has the same
    structure, shapes and dtypes as in ``old`` taken from ``old``: after a policy changes
    the exchange of a ``chain(exchange, local optimizer)``, the local optimizer's momentum
    carries over and the exchange starts fresh."""

    def same(a, b):
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        return jax.tree.structure(a) == jax.tree.structure(b) and all(
            np.shape(x) == np.shape(y) and x.dtype == y.dtype for x, y in zip(la, lb)
        )

    if same(old, new):
        return old
    if isinstance(new, tuple) and isinstance(old, tuple) and len(old) == len(new):
        parts = [carry_state(o, n) for o, n in zip(old, new)]
        return type(new)(*parts) if hasattr(new, "_fields") else tuple(parts)
    return new


def _per_worker(values: np.ndarray) -> int | float:
    # Exact int when the workers agree (symmetric collectives), else the mean.
    return int(values[0]) if np.all(values == values[0]) else float(values.mean())


def train(
    cfg: Config,
    task,
    backend,
    algorithm: str,
    *,
    progress: bool = True,
    checkpoints: Checkpointer | None = None,
    resume: bool = False,
    max_steps: int | None = None,
) -> RunResult:
    """Train ``algorithm`` for ``cfg.steps`` steps on ``backend``'s workers.

    Every worker starts from rank 0's initial parameters (broadcast). The recorded
    loss is the mean over workers of their local batch losses; test metrics are those
    of the worker average of `evaluated_params` (for BMUF the global model, the same on
    every worker). Wire bytes are summed on the host in int64.

    A two-tier algorithm (`algorithms.group_size` not None) gets ``(intra, inter)``
    from ``backend.two_tier`` and runs under ``backend.spmd(..., group_size=...)``.

    With ``checkpoints``, the run saves every ``cfg.checkpoint_every`` steps, when it
    stops and at the end; with ``resume`` it continues from the newest good checkpoint
    (a finished run is returned as saved). ``max_steps`` stops after that many steps of
    this call (``finished`` is then False).
    """
    check_grad_chunk(cfg.grad_chunk, backend.name, backend.size)
    group_size = algorithms.group_size(algorithm, cfg)
    if group_size is None:
        comms = backend.collective
        from_root = lambda p: comms.broadcast(p, 0)
    else:
        comms = intra, inter = backend.two_tier(group_size)
        # Worker 0 is member 0 of group 0: to every group's member 0, then to its group.
        from_root = lambda p: intra.broadcast(inter.broadcast(p, 0), 0)
    spmd = functools.partial(backend.spmd, group_size=group_size)
    context = algorithms.BuildContext(task=task, servers=getattr(backend, "servers", None))
    tx = algorithms.build(algorithm, cfg, comms, context)
    policy_name = algorithms.ALGORITHMS[algorithms.parse_entry(algorithm)[0]].policy
    policy = policies.POLICIES[policy_name] if policy_name else None
    changes: dict[str, Any] = {}
    policy_changes: list[tuple[int, dict[str, Any]]] = []
    start = time.perf_counter()
    params = spmd(from_root)(backend.replicate(task.init_params()))
    opt_state = spmd(tx.init)(params)

    sent_total = np.zeros(backend.size, np.int64)
    received_total = np.zeros(backend.size, np.int64)
    records: list[dict[str, Any]] = []
    first = 1
    saved = checkpoints.load() if checkpoints is not None and resume else None
    if saved is not None:
        policy_changes = [(s, d) for s, d in json.loads(saved["policy_changes"])]
        for _, decision in policy_changes:
            changes.update(decision)
        if changes:
            tx = algorithms.build(algorithm, cfg, comms, context, changes)
            opt_state = spmd(tx.init)(params)
        state = checkpoint.unpack(saved, backend.stacked(params), backend.stacked(opt_state))
        params, opt_state = _unstacked(backend, state["params"], state["opt_state"])
        sent_total, received_total = state["sent_total"], state["received_total"]
        records = state["records"]
        start -= state["elapsed"]
        first = state["step"] + 1
        if state["finished"]:
            summary = state["summary"] if backend.is_root else None
            return RunResult(algorithm, records, summary, backend.whole_params(params),
                             step=cfg.steps)  # fmt: skip
        checkpoints.remove(newer_than=state["step"])  # stale ones, past a corrupt newest
    elif checkpoints is not None:
        checkpoints.remove()  # a fresh run: no old run's checkpoint may mix in
    injection = cfg.injection()
    # With cfg.grad_chunk the gradients run a chunk of workers at a time (`compile_step`).
    # A worker of several devices: each device differentiates `backend.device_loss`.
    compile_ = functools.partial(compile_step, backend, backend.device_loss(task.loss),
                                 inject=injection is not None, group_size=group_size,
                                 grad_chunk=cfg.grad_chunk)  # fmt: skip
    step_fn = compile_(tx)

    def save(step: int, finished: bool = False, summary: dict[str, Any] | None = None) -> None:
        state = checkpoint.pack(
            step=step,
            params=backend.stacked(params),
            opt_state=backend.stacked(opt_state),
            sent_total=sent_total,
            received_total=received_total,
            records=records,
            policy_changes=policy_changes,
            elapsed=time.perf_counter() - start,
            seed=cfg.seed,
            finished=finished,
            summary=summary,
        )
        checkpoints.save(step, state)

    stop = cfg.steps if max_steps is None else min(cfg.steps, first - 1 + max_steps)
    bar = tqdm(total=cfg.steps, initial=first - 1, desc=algorithm,
               disable=not (progress and backend.is_root))  # fmt: skip
    for step in range(first, stop + 1):
        x, y = task.batch(step - 1, backend.size)
        args = [backend.local(x), backend.local(y)]
        if injection is not None:
            fault = np.zeros(backend.size, np.float32)
            if step == injection[0]:
                fault[injection[1]] = np.nan
            args.append(backend.local(fault, batch=False))
        try:
            params, opt_state, metrics = step_fn(params, opt_state, *args)
            gathered = backend.gather(backend.stacked(metrics))
        except jax.errors.JaxRuntimeError as e:
            # nonfinite="raise": every rank raises here, at the same step.
            if NonFiniteGradientError.__name__ not in str(e):
                raise
            detail = re.search(r"NaN/Inf in the gradient of \d+ of \d+ workers", str(e))
            raise NonFiniteGradientError(
                f"step {step}: {detail.group(0) if detail else 'a non-finite gradient'} "
                f"(nonfinite='raise'; 'skip' would have skipped the step on every worker)"
            ) from None
        evaluate = step % cfg.eval_every == 0 or step == cfg.steps
        # Every rank takes part in the average; only the root evaluates it.
        avg = backend.mean_params(evaluated_params(params, opt_state)) if evaluate else None
        decision = None
        asked = step % cfg.policy_every == 0 and cfg.policy_after <= step < cfg.steps
        if policy is not None and asked:
            run_cfg = algorithms.entry_config(algorithm, dataclasses.replace(cfg, **changes))
            decision = backend.share(policy.decide(records, run_cfg) if backend.is_root else None)
            if decision:
                # Rebuild with the new settings; keep params and what the new state can use.
                changes.update(decision)
                policy_changes.append((step, dict(decision)))
                tx = algorithms.build(algorithm, cfg, comms, context, changes)
                opt_state = carry_state(opt_state, spmd(tx.init)(params))
                step_fn = compile_(tx)
        if backend.is_root:
            loss, sent, received, density, noise, skipped = gathered
            sent, received = np.asarray(sent), np.asarray(received)  # exact int64
            loss, sent, received, density, noise, skipped = backend.by_worker(
                (loss, sent, received, density, noise, skipped), METRIC_OPS
            )
            sent_total += sent
            received_total += received
            rec = {
                "algorithm": algorithm,
                "step": step,
                "loss": float(np.mean(loss, dtype=np.float64)),
                "bytes_sent": _per_worker(sent),
                "bytes_received": _per_worker(received),
                "mb_sent": float(sent_total.mean() / MB),
                "mb_received": float(received_total.mean() / MB),
            }
            if not np.isnan(density).any():
                rec["density"] = float(np.mean(density, dtype=np.float64))
            if not np.isnan(noise).all():
                rec["noise_scale"] = float(np.mean(noise, dtype=np.float64))
            if skipped.max() > 0:
                rec["skipped"] = int(skipped.max())  # steps skipped so far
            if decision:
                rec["policy"] = policies.describe(decision)
            if evaluate:
                rec["test_loss"], rec["test_accuracy"] = task.evaluate(avg)
            rec["time_s"] = time.perf_counter() - start
            records.append(rec)
            bar.update(1)
            if evaluate or step % 10 == 0:
                postfix = {"loss": f"{rec['loss']:.4f}", "MB sent": f"{rec['mb_sent']:.2f}"}
                bar.set_postfix(postfix)
        periodic = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        if checkpoints is not None and step < cfg.steps and (periodic or step == stop):
            save(step)
    bar.close()
    if stop < cfg.steps:
        return RunResult(algorithm, records, None, backend.whole_params(params), finished=False,
                         step=stop, trained=stop - first + 1)  # fmt: skip
    wall = time.perf_counter() - start

    summary = None
    if backend.is_root:
        last = records[-1]
        summary = {
            "algorithm": algorithm,
            "steps": cfg.steps,
            "loss": last["loss"],
            "test_loss": last["test_loss"],
            "test_accuracy": last["test_accuracy"],
            "test_error": 1.0 - last["test_accuracy"],
            "mb_sent": last["mb_sent"],
            "mb_received": last["mb_received"],
            # the most any one step sent (per worker): what a link must carry at once
            "peak_kb_sent": max(float(np.max(r["bytes_sent"])) for r in records) / 1e3,
            "density": float(np.mean([r["density"] for r in records]))
            if "density" in last
            else None,
            "skipped": last.get("skipped"),  # None: no step skipped
            "wall_s": wall,
        }
        if cfg.project_workers:
            summary.update(projection.project_run(cfg, algorithm, task, policy_changes))
    if checkpoints is not None:
        save(cfg.steps, finished=True, summary=summary)
    return RunResult(algorithm, records, summary, backend.whole_params(params), step=cfg.steps,
                     trained=cfg.steps - first + 1)  # fmt: skip


def _unstacked(backend, params: Any, opt_state: Any) -> tuple[Any, Any]:
    """``stacked`` (host) values back in the layout ``backend.spmd`` functions take: one
    MPI worker per process has no worker axis."""
    if backend.name == "mpi":
        return jax.tree.map(lambda a: a[0], (params, opt_state))
    return params, opt_state
