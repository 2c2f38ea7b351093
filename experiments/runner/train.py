"""The training loop: one algorithm, all workers, per-step metrics on the root."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from shoal import vma
from shoal.comms import wire_bytes
from shoal.comms.presence import ChurnError
from shoal.comms.turns import TurnError, take_due
from shoal.experiments import algorithms
from shoal.experiments.algorithms import Entry
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.runner import (
    async_run,
    checkpoint,
    clock,
    elastic,
    memory,
    policies,
    projection,
)
from shoal.experiments.runner import churn as churn_run
from shoal.experiments.runner import turns as turns_run
from shoal.experiments.runner.backends import Backend
from shoal.experiments.runner.checkpoint import Checkpointer
from shoal.experiments.runner.progress import POSTFIX_EVERY, progress_bar
from shoal.experiments.runner.summary import base_summary, per_worker
from shoal.experiments.tasks.protocol import metrics_of
from shoal.optim import NonFiniteGradientError, update_and_apply
from shoal.optim.helpers import check_same_model, same_model_check, take_raised
from shoal.optim.readouts import READOUTS, evaluation_params, step_figures

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
        # The update and its application, in one in-place branch where the algorithm's
        # non-finite skip asks for it (`update_and_apply`).
        params, opt_state = update_and_apply(tx, grads, opt_state, params)
        # This update's bytes; the host sums them, since a policy change may re-init the
        # exchange (and with it the state's totals since init) mid-run.
        wire = wire_bytes(opt_state, "step")
        # The figures of `shoal.optim.readouts.READOUTS` this state holds, by name.
        return params, opt_state, (loss, wire.sent, wire.received, step_figures(opt_state))

    return step


def scanned(step, axis: int = 0):
    """``step(params, opt_state, *batch)`` over a chunk of steps in one ``jax.lax.scan``:
    every ``batch`` argument has the chunk's steps on ``axis``, and so do the metrics
    returned (the per-step metrics of ``step``, stacked)."""

    def steps(params, opt_state, *batches):
        def body(carry, batch):
            params, opt_state, metrics = step(*carry, *batch)
            return (params, opt_state), metrics

        to_front = lambda a: jax.numpy.moveaxis(a, axis, 0)
        carry, metrics = vma.scan(body, (params, opt_state), tuple(map(to_front, batches)))
        return *carry, jax.tree.map(lambda a: jax.numpy.moveaxis(a, 0, axis), metrics)

    return steps


# How the `make_step` metrics of a worker's devices make the worker's (`backend.by_worker`):
# the loss is the worker's on each of its devices; each device sends and receives its own
# pieces. The figures say their own (`Readout.by_device`).
METRIC_OPS = ("first", "sum", "sum")


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


def compile_step(backend, loss_fn, tx, *, inject=False, group_size=None, grad_chunk=0, scan=False,
                 churn=False):  # fmt: skip
    """`make_step` for all of ``backend``'s workers (``backend.spmd``). With ``grad_chunk = K
    > 0`` (`SimBackend` only) the workers' gradients are computed K workers at a time
    (``jax.lax.map`` over the worker axis, K under ``vmap`` per iteration), so only K
    workers' activations are alive at once; the update, which communicates, still runs
    under ``vmap`` over all workers. Same results as ``grad_chunk = 0`` up to rounding.

    With ``scan`` the program runs a chunk of steps (`scanned`): its batches and metrics
    have the steps on the axis after this process's rows (`Backend.steps_of`); each worker
    scans its own steps, so its collectives stay inside its program (MPI, mesh).

    With ``churn`` the step takes each worker's presence row last (`churn_run.churned`)."""
    if not grad_chunk:
        step = make_step(loss_fn, tx, inject=inject)
        if churn:
            step = churn_run.churned(step, backend.collective)
        return backend.spmd(scanned(step) if scan else step, group_size=group_size)
    check_grad_chunk(grad_chunk, backend.name, backend.size)
    update = backend.spmd(make_step(loss_fn, tx, inject=inject, given=True), group_size=group_size)
    grad = jax.value_and_grad(loss_fn)

    def step(params, opt_state, x, y, *fault):
        loss, grads = jax.lax.map(lambda a: grad(*a), (params, x, y), batch_size=grad_chunk)
        return update(params, opt_state, loss, grads, *fault)

    # The workers' steps in one program: scan the whole step, the workers' axis first.
    return jax.jit(scanned(step, axis=1) if scan else step)


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


@functools.lru_cache(maxsize=8)
def _same_model(backend: Backend, comms: Any, group_size: int | None):
    """`same_model_check` of all of ``backend``'s workers, compiled once for the entries of
    a run that share their collectives (a compile costs more than the check)."""
    check = functools.partial(same_model_check, collective=comms)
    return backend.spmd(check, group_size=group_size)


class _Run:
    """One algorithm's run in progress: its transformation, the workers' state, the host
    totals and records, and how each is resumed, changed by a policy, recorded and saved.
    `train` drives it step by step."""

    def __init__(self, cfg: Config, task, backend: Backend, entry: Entry):
        self.cfg, self.task, self.backend, self.entry = cfg, task, backend, entry
        group_size = entry.group_size
        if group_size is None:
            self.comms = backend.collective
            from_root = lambda p: self.comms.broadcast(p, 0)
        else:
            self.comms = intra, inter = backend.two_tier(group_size)
            # Worker 0 is member 0 of group 0: to every group's member 0, then to its group.
            from_root = lambda p: intra.broadcast(inter.broadcast(p, 0), 0)
        self.spmd = functools.partial(backend.spmd, group_size=group_size)
        self.build = functools.partial(entry.build, task=task, servers=backend.servers)
        self.policy = entry.policy
        self.changes: dict[str, Any] = {}
        self.policy_changes: list[tuple[int, dict[str, Any]]] = []
        self.start = time.perf_counter()
        self.tx = self.build(self.comms)
        self.params = self.spmd(from_root)(backend.replicate(task.init_params()))
        # Every worker starts from worker 0's model, bit for bit (two small all-reduces; the
        # same verdict on every process, so all raise alike).
        same = _same_model(backend, self.comms, group_size)(self.params)
        try:
            check_same_model(backend.stacked(same), self.params)
        except ValueError as e:  # a task whose init differs per process: one line, exit 2
            raise ConfigError(f"{entry.label}: {e}") from None
        self.opt_state = self.init_state()
        self.sent_total = np.zeros(backend.size, np.int64)
        self.received_total = np.zeros(backend.size, np.int64)
        self.records: list[dict[str, Any]] = []
        self.first = 1  # the next step to train
        self.summary: dict[str, Any] | None = None
        self.finished = False
        self.injection = cfg.injection()
        # Churn: each step's (weight, joining, source) per worker (`churn_run.step_rows`).
        self.churn = None
        if cfg.churn:
            self.churn = churn_run.step_rows(churn_run.schedule_of(cfg), churn_run.window(entry))
            self.join_bytes = churn_run.join_bytes(
                task.init_params(), backend.stacked(self.opt_state), backend.size
            )
        self.scan = cfg.steps_per_program() > 1  # programs of several steps (`run_steps`)
        # in_turn: a program's local steps one worker after another (`turns_run`), one
        # program per (local steps, all steps) pair met.
        every = turns_run.period(cfg, backend.name, entry)
        self.turns = None if every is None else turns_run.Plan(every)
        self.turn_programs: dict[tuple[int, int], Any] = {}
        # With cfg.grad_chunk the gradients run a chunk of workers at a time
        # (`compile_step`). A worker of several devices: each device differentiates
        # `backend.device_loss`.
        self.compile = functools.partial(
            compile_step,
            backend,
            backend.device_loss(task.loss),
            inject=self.injection is not None,
            group_size=group_size,
            grad_chunk=cfg.grad_chunk,
            scan=self.scan,
            churn=self.churn is not None,
        )
        self.step_fn = None  # compiled on the first step (a finished resume needs none)

    def init_state(self) -> Any:
        """The transformation's state at the start, where every worker has the same params
        (`Backend.init_state`: simulated workers hold rank-uniform state once)."""
        return self.backend.init_state(self.tx.init, self.params, self.entry.group_size)

    def resume(self, saved: dict[str, Any]) -> None:
        """Continue from a loaded checkpoint: the policy's changes, then the state."""
        self.policy_changes = [(s, d) for s, d in json.loads(saved["policy_changes"])]
        for _, decision in self.policy_changes:
            self.changes.update(decision)
        if self.changes:
            self.tx = self.build(self.comms, changes=self.changes)
            self.opt_state = self.init_state()
        backend = self.backend
        if saved.get("elastic_from") not in (None, self.cfg.workers):
            saved = elastic.resized(
                saved, self.entry.label, backend, self.params, self.opt_state, self.cfg.workers
            )
        state = checkpoint.unpack(
            saved,
            backend.stacked(self.params),
            backend.stacked(self.opt_state),
            held=backend.held(self.opt_state),
        )
        self.params, self.opt_state = backend.unstacked((state["params"], state["opt_state"]))
        self.sent_total, self.received_total = state["sent_total"], state["received_total"]
        self.records = state["records"]
        self.start -= state["elapsed"]
        self.first = state["step"] + 1
        self.finished = bool(state["finished"])
        self.summary = state["summary"] if backend.is_root else None

    def batch(self, step: int) -> list[Any]:
        """This process's rows of step ``step``'s batch (and of the injected fault)."""
        x, y = self.task.batch(step - 1, self.backend.size)
        args = [self.backend.local(x), self.backend.local(y)]
        if self.injection is not None:
            fault = np.zeros(self.backend.size, np.float32)
            if step == self.injection[0]:
                fault[self.injection[1]] = np.nan
            args.append(self.backend.local(fault, batch=False))
        if self.churn is not None:
            args.append(self.backend.local(self.churn[step - 1], batch=False))
        return args

    def present(self, step: int) -> np.ndarray | None:
        """Which workers are present at ``step`` under churn (None: all, no churn)."""
        return None if self.churn is None else self.churn[step - 1, :, 0] > 0

    def chunk_end(self, step: int, stop: int, saving: bool) -> int:
        """The last step of the program that starts at ``step``: ``scan_steps`` steps, or
        fewer to end at ``stop``, at an evaluation, at a policy consultation or, when
        ``saving``, at a periodic checkpoint: what follows a step on the host sees that
        step's params and state."""
        cfg = self.cfg
        last = min(step + cfg.steps_per_program() - 1, stop)
        if self.turns is not None:  # an exchange step only at a program's end
            last = self.turns.chunk_end(step, last, self.skipped())
        for s in range(step, last):
            periodic = saving and cfg.checkpoint_every and s % cfg.checkpoint_every == 0
            if s % cfg.eval_every == 0 or self.policy_due(s) or periodic:
                return s
        return last

    def run_steps(self, first: int, last: int) -> list[Any]:
        """Train steps ``first`` to ``last`` in one program (a scan with ``scan_steps > 1``);
        returns each step's metrics gathered on the root (else Nones)."""
        if self.step_fn is None:
            self.step_fn = self.compile(self.tx)
        backend, n = self.backend, last - first + 1
        step_fn = self.step_fn
        if self.turns is not None and self.scan:
            key = (self.turns.local_steps(first, last, self.skipped()), n)
            if key not in self.turn_programs:
                loss = backend.device_loss(self.task.loss)
                step = make_step(loss, self.tx, inject=self.injection is not None)
                self.turn_programs[key] = turns_run.compile_turns(backend, step, *key)
            step_fn = self.turn_programs[key]
        if self.scan:
            per_step = [self.batch(step) for step in range(first, last + 1)]
            batch = [backend.steps_of(arrays) for arrays in zip(*per_step)]
        else:
            batch = self.batch(first)
        try:
            if step_fn is self.step_fn:
                out = step_fn(self.params, self.opt_state, *batch)
            else:
                out = self.in_turn(step_fn, batch)
            self.params, self.opt_state, metrics = out
            memory.ready(metrics)  # an XLA out-of-memory raises here, not hangs in gather
            gathered = backend.gather(backend.stacked(metrics))
        except (ChurnError, TurnError) as e:  # traced on the first call: an exchange that
            # churn cannot mask, or that a step in turn cannot make
            raise ConfigError(f"{self.entry.label}: {e}") from None
        except jax.errors.JaxRuntimeError:
            # nonfinite="raise": every rank raises here, in the same program.
            raised = take_raised()
            if raised is None:
                raise
            if n > 1:
                # The state is the program's input still: the same steps again, one program
                # each, raise at the very step (the same NaN, on every rank).
                return self.replay(first, last)
            raise NonFiniteGradientError(
                f"step {first}: {str(raised).partition(';')[0]} "
                f"(nonfinite='raise'; 'skip' would have skipped the step on every worker)"
            ) from None
        if not self.scan:
            return [gathered]
        if gathered is None:
            return [None] * n
        # Rows first, then the chunk's steps.
        return [jax.tree.map(lambda a, k=k: np.asarray(a)[:, k], gathered) for k in range(n)]

    def in_turn(self, program: Any, batch: list[Any]) -> Any:
        """``program`` (`turns_run.compile_turns`) on ``batch``, or the same steps with the
        workers together (the non-finite skip and the exchanges exactly as without
        ``in_turn``) where a worker skipped a step in its turn or an exchange left out of
        a turn was due."""
        try:
            *out, redo = program(self.params, self.opt_state, *batch)
            if not bool(redo):
                return out
        except jax.errors.JaxRuntimeError:
            if take_due() is None:
                raise
        return self.step_fn(self.params, self.opt_state, *batch)

    def skipped(self) -> int:
        """Steps skipped so far, from the last record (its ``skipped`` readout, shown once
        a step was skipped; no device read): the algorithm's counter lags by as many."""
        return int(self.records[-1].get("skipped", 0)) if self.records else 0

    def replay(self, first: int, last: int) -> list[Any]:
        """Steps ``first`` to ``last`` again, a program of one step each (`run_steps`)."""
        scan, step_fn = self.scan, self.step_fn
        self.scan, self.step_fn = False, self.compile(self.tx, scan=False)  # compiled once
        try:
            return [self.run_steps(step, step)[0] for step in range(first, last + 1)]
        finally:
            self.scan, self.step_fn = scan, step_fn

    def policy_due(self, step: int) -> bool:
        """Whether the policy is to be asked after ``step``."""
        if self.policy is None or step >= self.cfg.steps:
            return False
        return self.policy.due(step, self.entry.changed(self.changes)[1])

    def consult_policy(self, step: int) -> dict[str, Any] | None:
        """The policy's decision after ``step`` (None: none asked or no change); a change
        rebuilds the transformation and keeps what the new state can use."""
        if not self.policy_due(step):
            return None
        params = self.entry.changed(self.changes)[1]
        root = self.backend.is_root
        decision = self.policy.decide(self.records, params) if root else None
        decision = self.backend.share(decision)
        if decision:
            self.changes.update(decision)
            self.policy_changes.append((step, dict(decision)))
            self.tx = self.build(self.comms, changes=self.changes)
            self.opt_state = carry_state(self.opt_state, self.spmd(self.tx.init)(self.params))
            self.step_fn = self.compile(self.tx)
        return decision

    def record(self, step: int, gathered: Any, decision: Any, avg: Any) -> dict[str, Any]:
        """The root's record of ``step`` from the gathered metrics; adds to the totals."""
        backend = self.backend
        loss, sent, received, figures = gathered
        sent, received = np.asarray(sent), np.asarray(received)  # exact int64
        found = [r for r in READOUTS if r.name in figures]
        loss, sent, received, *values = backend.by_worker(
            (loss, sent, received, *(figures[r.name] for r in found)),
            (*METRIC_OPS, *(r.by_device for r in found)),
        )
        if self.churn is not None:  # a joiner's copy of the model and state, from its source
            joining = self.churn[step - 1, :, 1] > 0
            sent, received = sent.copy(), received.copy()
            received[joining] += self.join_bytes
            sent[int(self.churn[step - 1, 0, 2])] += self.join_bytes * int(joining.sum())
        self.sent_total += sent
        self.received_total += received
        here = self.present(step)  # under churn, the loss of the workers present
        rec = {
            "algorithm": self.entry.label,
            "seed": self.cfg.seed,
            "step": step,
            "loss": float(np.mean(loss if here is None else loss[here], dtype=np.float64)),
            "bytes_sent": per_worker(sent),
            "bytes_received": per_worker(received),
            "mb_sent": float(self.sent_total.mean() / MB),
            "mb_received": float(self.received_total.mean() / MB),
        }
        for readout, value in zip(found, values, strict=True):
            value = readout.combine(value)
            if readout.shown(value):
                rec[readout.name] = value
        per_example = getattr(self.task, "tokens_per_example", None)
        if per_example is not None:  # tokens seen by the workers present, so far
            workers = len(loss) if here is None else int(here.sum())
            before = self.records[-1]["tokens"] if self.records else 0
            rec["tokens"] = before + workers * self.cfg.batch_size * per_example
        if decision:
            rec["policy"] = policies.describe(decision)
        if avg is not None:
            metrics = metrics_of(self.task.evaluate(avg), self.cfg.task)
            rec.update({f"test_{name}": value for name, value in metrics.items()})
        rec["time_s"] = time.perf_counter() - self.start
        self.records.append(rec)
        return rec

    def summarize(self) -> dict[str, Any]:
        """The root's summary of the finished run (with its projection, if asked for)."""
        records, cfg = self.records, self.cfg
        wall = time.perf_counter() - self.start
        summary = base_summary(self.entry.label, cfg, records, wall)
        if cfg.project_workers:
            summary.update(projection.project_run(cfg, self.entry, self.task, self.policy_changes))
        if cfg.speeds:
            summary.update(
                clock.clock_run(cfg, self.entry, self.task, self.policy_changes, records)
            )
        return summary

    def save(self, checkpoints: Checkpointer, step: int) -> None:
        backend = self.backend
        state = checkpoint.pack(
            step=step,
            params=backend.stacked(self.params),
            opt_state=backend.stacked(self.opt_state),
            held=backend.held(self.opt_state),
            sent_total=self.sent_total,
            received_total=self.received_total,
            records=self.records,
            policy_changes=self.policy_changes,
            elapsed=time.perf_counter() - self.start,
            seed=self.cfg.seed,
            finished=self.finished,
            summary=self.summary,
        )
        checkpoints.save(step, state)

    def result(self, step: int, trained: int) -> RunResult:
        whole = self.backend.whole_params(self.params)
        return RunResult(self.entry.label, self.records, self.summary, whole,
                         finished=self.finished, step=step, trained=trained)  # fmt: skip


def train(
    cfg: Config,
    task,
    backend: Backend,
    algorithm: str | Entry,
    *,
    progress: bool = True,
    checkpoints: Checkpointer | None = None,
    resume: bool = False,
    max_steps: int | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """Train ``algorithm`` (an `Entry`, or an entry of ``cfg.algorithms`` to resolve) for
    ``cfg.steps`` steps on ``backend``'s workers.

    Every worker starts from rank 0's initial parameters (broadcast). The recorded
    loss is the mean over workers of their local batch losses; test metrics are those
    of the worker average of `shoal.optim.readouts.evaluation_params` (for BMUF the
    global model, the same on every worker). Wire bytes are summed on the host in int64.

    A two-tier algorithm (`Entry.group_size` not None) gets ``(intra, inter)``
    from ``backend.two_tier`` and runs under ``backend.spmd(..., group_size=...)``.

    With ``checkpoints``, the run saves every ``cfg.checkpoint_every`` steps, when it
    stops and at the end; with ``resume`` it continues from the newest good checkpoint
    (a finished run is returned as saved). ``max_steps`` stops after that many steps of
    this call (``finished`` is then False).

    ``on_record`` (root process only) gets every record as soon as it exists: those a
    resumed run restores, then one per step (the runner appends them to ``metrics.jsonl``).
    """
    check_grad_chunk(cfg.grad_chunk, backend.name, backend.size)
    # An Entry comes resolved (the CLI and studies resolve every entry before training).
    entry = algorithm if isinstance(algorithm, Entry) else algorithms.resolve(algorithm, cfg)
    if cfg.churn:
        churn_run.check_run(cfg, backend.name, entry)
    if entry.algorithm.asynchronous is not None:  # rounds on the simulated clock
        return async_run.train(cfg, task, backend, entry, checkpoints=checkpoints,
                               resume=resume, on_record=on_record)  # fmt: skip
    run = _Run(cfg, task, backend, entry)
    saved = checkpoints.load() if checkpoints is not None and resume else None
    if saved is not None:
        run.resume(saved)
        if on_record is not None and backend.is_root:
            for rec in run.records:
                on_record(rec)
        if run.finished:
            return run.result(cfg.steps, 0)
        checkpoints.remove(newer_than=run.first - 1)  # stale ones, past a corrupt newest
    elif checkpoints is not None:
        checkpoints.remove()  # a fresh run: no old run's checkpoint may mix in

    first = run.first
    stop = cfg.steps if max_steps is None else min(cfg.steps, first - 1 + max_steps)
    # A bar on a terminal, plain lines in a log file (`progress_bar`).
    bar = progress_bar(cfg.steps, first - 1, run.entry.label, progress and backend.is_root)
    start = first
    while start <= stop:  # a program per chunk of steps (one step unless scan_steps > 1)
        last = run.chunk_end(start, stop, saving=checkpoints is not None)
        for step, gathered in zip(range(start, last + 1), run.run_steps(start, last)):
            evaluate = step % cfg.eval_every == 0 or step == cfg.steps
            # Every rank takes part in the average; only the root evaluates it.
            model = (
                evaluation_params(run.params, backend.spread(run.opt_state)) if evaluate else None
            )
            here = run.present(step)  # under churn the mean of the workers present
            if evaluate and here is not None:
                model = jax.tree.map(lambda a, h=here: np.asarray(a)[h], model)
                avg = jax.tree.map(lambda a: a.sum(0) / np.float32(len(a)), model)
            else:
                avg = backend.mean_params(model) if evaluate else None
            decision = run.consult_policy(step)
            if backend.is_root:
                rec = run.record(step, gathered, decision, avg)
                if on_record is not None:
                    on_record(rec)
                bar.update(1)
                if evaluate or step % POSTFIX_EVERY == 0:
                    postfix = {"loss": f"{rec['loss']:.4f}", "MB sent": f"{rec['mb_sent']:.2f}"}
                    bar.set_postfix(postfix)
            periodic = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
            if checkpoints is not None and step < cfg.steps and (periodic or step == stop):
                run.save(checkpoints, step)
        start = last + 1
    bar.close()
    if stop < cfg.steps:
        return run.result(stop, stop - first + 1)
    run.finished = True
    run.summary = run.summarize() if backend.is_root else None
    if checkpoints is not None:
        run.save(checkpoints, cfg.steps)
    return run.result(cfg.steps, cfg.steps - first + 1)
