"""Exact checkpoints of one algorithm's run on orbax.checkpoint: save every K steps,
verify, resume (`Checkpointer`), and the state they hold (`pack`, `unpack`).

A checkpoint is everything the training loop needs to continue as if it had never
stopped: the parameters and the whole optimizer state of this process's workers (residuals,
error feedback, block momentum, variances, counters, wire counters), the step (which is
also the data position: batches are a pure function of the step and the seed), the host
byte totals, the records so far, the policy changes made so far and, once the run ended,
its summary. The batches' RNG is seeded by ``(seed, epoch)`` and the algorithms' own
randomness by the step, so the step and the config's seed are the whole RNG state.

Each process saves and restores its own workers' checkpoints, in a folder of its own; what
they are on disk (folders, commit marker, checksums) is
`shoal.experiments.runner.checkpoint_files`. The config recorded, and compared on resume,
is the fields the algorithm can depend on: the run's and the task's, and its own
hyper-parameters (``Config.params[name]``), not other algorithms', so a changed
``gtc.threshold`` does not stop ``ssgd`` from resuming.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from shoal.experiments.algorithms import ALGORITHMS, parse_entry
from shoal.experiments.algorithms.renamed import RENAMED
from shoal.experiments.config import Config
from shoal.experiments.overrides import flatten
from shoal.experiments.runner.checkpoint_files import (
    COMMITTED,
    FORMAT,
    KEEP,
    CheckpointError,
    commit,
    open_manager,
    read,
    read_meta,
    save_args,
    uncommit,
    writing,
)

# Fields that may change between a run and its resumption without changing the training
# (grad_chunk: how many workers' gradients are computed at once; scan_steps: how many steps
# one program runs; in_turn: whether local steps run one worker at a time; the same values).
IGNORED_FIELDS = frozenset(
    {"name", "algorithms", "checkpoint_every", "grad_chunk", "scan_steps", "in_turn"}
)


def config_fields(cfg: Config, algorithm: str | None = None) -> dict[str, str]:
    """The fields that must match for a checkpoint of ``algorithm`` (an entry of
    ``cfg.algorithms``; None: any algorithm) to resume, in their ``--set`` spelling."""
    skip = _skipped(algorithm)
    return {k: v for k, v in flatten(cfg) if k.split(".")[0] not in skip}


def _skipped(algorithm: str | None) -> frozenset[str]:
    """The first components of the keys a checkpoint of ``algorithm`` does not compare:
    `IGNORED_FIELDS` and every other algorithm's hyper-parameters."""
    if algorithm is None:
        return IGNORED_FIELDS
    return IGNORED_FIELDS | (frozenset(ALGORITHMS) - {parse_entry(algorithm)[0]})


def fingerprint(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


# The longest file name most file systems take (ext4, xfs, btrfs, tmpfs: 255 bytes).
NAME_MAX = 255


def folder_name(algorithm: str) -> str:
    """A file-system safe folder name for an algorithm entry (entries may carry overrides);
    `ValueError` for one too long to be a file name (`check_label` says it in advance)."""
    name = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", algorithm)
    if len(name) > NAME_MAX:
        raise ValueError(
            f"algorithm entry {algorithm[:40]}... is {len(name)} characters, more than a "
            f"file name holds ({NAME_MAX}): it names its checkpoint and log folders; set "
            "its fields in the config file instead of in brackets"
        )
    return name


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _host_leaves(tree: Any) -> tuple[dict[str, np.ndarray], str]:
    leaves, treedef = jax.tree.flatten(tree)
    out = {}
    for i, leaf in enumerate(leaves):
        if _is_key(leaf):
            leaf = jax.random.key_data(leaf)
        out[str(i)] = np.asarray(jax.device_get(leaf))
    return out, str(treedef)


def _restore_leaves(target: Any, saved: dict[str, np.ndarray], treedef: str, what: str) -> Any:
    """``saved`` leaves in ``target``'s structure, checked leaf by leaf."""
    leaves, target_def = jax.tree.flatten(target)
    if str(target_def) != treedef or len(saved) != len(leaves):
        raise CheckpointError(f"the saved {what} has a different structure than this run's")
    out = []
    for i, leaf in enumerate(leaves):
        value = saved[str(i)]
        if _is_key(leaf):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf))
        elif value.shape != np.shape(leaf) or value.dtype != np.asarray(leaf).dtype:
            raise CheckpointError(
                f"the saved {what} leaf {i} is {value.dtype}{list(value.shape)}, "
                f"this run's is {np.asarray(leaf).dtype}{list(np.shape(leaf))}"
            )
        out.append(value)
    return jax.tree.unflatten(target_def, out)


# Backends that resume a checkpoint of another worker count (`elastic`).
ELASTIC = ("sim", "mpi")


def committed_steps(folder: Path) -> list[int]:
    """Steps with a committed checkpoint in one process's folder, newest first (read from
    the folder's names and markers: no orbax manager, so any process may look)."""
    if not folder.is_dir():
        return []
    steps = [int(p.name[5:]) for p in folder.glob("step_*")
             if p.name[5:].isdigit() and (p / COMMITTED).is_file()]  # fmt: skip
    return sorted(steps, reverse=True)


class Checkpointer:
    """Saves and finds the checkpoints of one algorithm on one process.

    ``meta`` identifies the run (algorithm, workers, backend, devices per worker, config);
    `load` refuses a checkpoint whose workers, devices per worker or config differ.
    ``backend.gather_all`` (`shoal.experiments.runner.backends.Backend`) makes every
    process agree on the step they resume from.
    """

    def __init__(self, root: Path, algorithm: str, cfg: Config, backend: Any):
        # Absolute: orbax's OCDBT writer refuses a relative path (``--out runs/x``).
        self.folder = Path(root).absolute() / folder_name(algorithm)
        self.rank = backend.rank
        self.backend = backend
        self.every = cfg.checkpoint_every
        self.dir = self.folder / f"rank_{self.rank}"
        self._orbax: ocp.CheckpointManager | None = None
        fields = config_fields(cfg, algorithm)
        self.meta = {
            "format": FORMAT,
            "algorithm": algorithm,
            "workers": cfg.workers,
            "backend": backend.name,
            # A worker of K devices saves its devices' pieces: another K cannot read them.
            "devices_per_worker": backend.devices_per_worker,
            "rank": self.rank,
            "config_fingerprint": fingerprint(fields),
            "config": fields,
        }

    def _manager(self) -> ocp.CheckpointManager:
        # Made on first use: a Checkpointer that only looks (`steps`) creates nothing.
        if self._orbax is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._orbax = open_manager(self.dir)
            # A step without its marker is a save cut short (after orbax's rename, before
            # `commit`): never resumed, and it must not count among the KEEP latest, where
            # a stray one past the run's steps would push a good checkpoint out.
            for step in self._orbax.all_steps():
                if not (self.path(step) / COMMITTED).is_file():
                    self._orbax.delete(step)
        return self._orbax

    def path(self, step: int) -> Path:
        """The folder of this process's checkpoint of ``step``."""
        return self.dir / f"step_{step}"

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint of this process (finalized by orbax, then
        marked by `save`), newest first."""
        if not self.dir.is_dir():
            return []
        manager = self._manager()
        manager.reload()  # another Checkpointer of this folder may have saved or removed
        done = [s for s in manager.all_steps() if (self.path(s) / COMMITTED).is_file()]
        return sorted(done, reverse=True)

    def remove(self, newer_than: int = -1) -> None:
        """Delete this process's checkpoints after step ``newer_than`` (all by default)."""
        for step in self.steps():
            if step > newer_than:
                self._delete(step)

    def _delete(self, step: int) -> None:
        uncommit(self.path(step))  # first: a half-deleted step is never a committed one
        self._manager().delete(step)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` (see `pack`) as step ``step``; keep the latest `KEEP` ones.
        Returns when the checkpoint is complete on disk; `CheckpointWriteError` if it
        cannot be written."""
        with writing(self.path(step)):
            manager = self._manager()
            if step in manager.all_steps():
                self._delete(step)  # orbax never overwrites: a step saved again replaces it
            # The steps this save pushes out of the latest KEEP, which orbax deletes in `save`.
            for old in sorted({*manager.all_steps(), step})[:-KEEP]:
                uncommit(self.path(old))
            manager.save(step, args=save_args(state, {**self.meta, "step": step}), force=True)
            commit(self.path(step))
        return self.path(step)

    def check_compatible(self, step: int, path: Path | None = None) -> None:
        """Refuse a checkpoint of a different run (backend layout or config; another worker
        count only on ``--backend jax``, the others resume elastically,
        `shoal.experiments.runner.elastic`); the step (of ``path``, default this process's)
        must be readable (`read`)."""
        name = self.path(step) if path is None else path
        saved = read_meta(name)
        if saved.get("algorithm") != self.meta["algorithm"]:
            raise CheckpointError(f"{name} is of algorithm {saved.get('algorithm')!r}")
        k_saved, k_now = saved.get("devices_per_worker", 1), self.meta["devices_per_worker"]
        if k_saved != k_now:
            raise CheckpointError(
                f"cannot resume {self.meta['algorithm']} with --devices-per-worker {k_now}: "
                f"its checkpoint {name} holds workers of {k_saved} devices each (resume with "
                f"--devices-per-worker {k_saved})"
            )
        if saved.get("workers") != self.meta["workers"] and self.meta["backend"] not in ELASTIC:
            n = saved.get("workers")
            how = f"mpiexec -n {n}" if self.meta["backend"] == "mpi" else f"--workers {n}"
            raise CheckpointError(
                f"cannot resume {self.meta['algorithm']} with {self.meta['workers']} workers: "
                f"its checkpoint {name} has {n} (resume with {how})"
            )
        if saved.get("backend") != self.meta["backend"]:
            raise CheckpointError(
                f"cannot resume {self.meta['algorithm']} on backend {self.meta['backend']!r}: "
                f"its checkpoint {name} is from {saved.get('backend')!r}"
            )
        old, new = saved.get("config", {}), self.meta["config"]
        flat = sorted(k for k in old if k in RENAMED)
        if flat:
            # Written before each algorithm's hyper-parameters had a home of their own: its
            # fields cannot be compared with this run's one for one.
            raise CheckpointError(
                f"cannot resume {self.meta['algorithm']}: its checkpoint {name} was written "
                f"by an older shoal, with flat algorithm fields ({', '.join(flat[:3])}, ...) "
                "that are now each algorithm's own (e.g. ssgd.local.learning_rate); start "
                "the run again with --overwrite"
            )
        # Checkpoints may list fields this run's would not: compare the ones it would list.
        skip = _skipped(self.meta["algorithm"]) | {"workers"}  # compared above
        old = {k: v for k, v in old.items() if k.split(".")[0] not in skip}
        new = {k: v for k, v in new.items() if k.split(".")[0] not in skip}
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                raise CheckpointError(
                    f"cannot resume {self.meta['algorithm']}: config field {key!r} is "
                    f"{new.get(key)} now but {old.get(key)} in its checkpoint {name}"
                )

    def load(self) -> dict[str, Any] | None:
        """The newest checkpoint that is good on every process, or None if there is none
        at all. A bad one is reported on stderr and the previous one used; if checkpoints
        exist but none is good everywhere, raises `CheckpointError` naming the files.

        Every process decides together (one ``gather_all``): a refusal on any process (a
        checkpoint of another run, read from the steps that can be resumed, so an
        unreadable newest one does not hide it) is raised on every process, so none is
        left waiting for the others."""
        n_saved = self.saved_workers()
        if self.meta["backend"] == "mpi" and n_saved not in (None, self.meta["workers"]):
            return self._load_elastic(n_saved)
        steps = self.steps()
        good, states, problems = [], {}, []
        for step in steps:
            try:
                states[step] = read(self.path(step))
                good.append(step)
            except CheckpointError as e:
                problems.append(str(e))
        refusal = None
        for step in good:
            try:
                self.check_compatible(step)
            except CheckpointError as e:
                refusal = str(e)
                break
        everyone = self.backend.gather_all((bool(steps), good, problems, refusal))
        refusals = [r for *_, r in everyone if r is not None]
        if refusals:
            raise CheckpointError(refusals[0])
        if not any(found for found, *_ in everyone):
            return None
        common = set.intersection(*(set(g) for _, g, *_ in everyone))
        all_problems = [p for _, _, ps, _ in everyone for p in ps]
        if not common:
            raise CheckpointError(
                "no good checkpoint to resume from: " + "; ".join(all_problems or ["none saved"])
            )
        step = max(common)
        n_saved = read_meta(self.path(step)).get("workers")
        if n_saved != self.meta["workers"]:  # simulated workers: all in this process's folder
            states[step] = {**states[step], "elastic_from": n_saved}
        if self.rank == 0:
            for p in all_problems:
                print(f"shoal-run: warning: {p}", file=sys.stderr)
            if step != max(max(g, default=-1) for _, g, *_ in everyone) or all_problems:
                print(
                    f"shoal-run: resuming {self.meta['algorithm']} from the previous good "
                    f"checkpoint, step {step}",
                    file=sys.stderr,
                )
        return states[step]

    def saved_workers(self) -> int | None:
        """The worker count of rank 0's newest committed checkpoint (None: there is none):
        under MPI another count than this run's makes every rank read every saved rank's
        checkpoint (`_load_elastic`)."""
        first = self.folder / "rank_0"
        steps = committed_steps(first)
        if not steps:
            return None
        try:
            return read_meta(first / f"step_{steps[0]}").get("workers")
        except CheckpointError:
            return None  # unreadable: the usual path names the problem

    def _load_elastic(self, n_saved: int) -> dict[str, Any]:
        """MPI ranks resuming a checkpoint of ``n_saved`` ranks: every rank reads all of
        them at their newest common good step, and gets them stacked on the workers' axis
        (``elastic_from``: the saved count), for `elastic.resized`."""
        dirs = [self.folder / f"rank_{r}" for r in range(n_saved)]
        common = set.intersection(*(set(committed_steps(d)) for d in dirs))
        problems, refusal, states, found = [], None, [], None
        try:  # another run's checkpoint (a backend, a config) is refused as such first
            self.check_compatible(0, path=dirs[0] / f"step_{committed_steps(dirs[0])[0]}")
        except CheckpointError as e:
            refusal, common = str(e), set()
        for step in sorted(common, reverse=True):
            try:
                states = [read(d / f"step_{step}") for d in dirs]
            except CheckpointError as e:
                problems.append(str(e))
                continue
            try:
                self.check_compatible(step, path=dirs[0] / f"step_{step}")
            except CheckpointError as e:
                refusal = str(e)
            found = step
            break
        everyone = self.backend.gather_all((found, refusal))
        refusals = [r for _, r in everyone if r is not None]
        if refusals:
            raise CheckpointError(refusals[0])
        if found is None or any(f != found for f, _ in everyone):
            raise CheckpointError(
                f"no good checkpoint of all {n_saved} saved ranks to resume from: "
                + "; ".join(problems or ["none saved by every rank"])
            )
        state = dict(states[0])  # records, totals and summary are rank 0's
        for key in ("params", "opt_state"):
            state[key] = {i: np.concatenate([s[key][i] for s in states]) for i in state[key]}
        state["elastic_from"] = n_saved
        if self.rank == 0:
            print(f"shoal-run: resuming {self.meta['algorithm']} on {self.meta['workers']} "
                  f"ranks from a checkpoint of {n_saved} (step {found}; "
                  "shoal.experiments.runner.elastic)", file=sys.stderr)  # fmt: skip
        return state


def pack(
    *,
    step: int,
    params: Any,
    opt_state: Any,
    held: Sequence[int] = (),
    sent_total: np.ndarray,
    received_total: np.ndarray,
    records: list[dict[str, Any]],
    policy_changes: list[tuple[int, dict[str, Any]]],
    elapsed: float,
    seed: int,
    finished: bool,
    summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state dict of a checkpoint; ``params`` and ``opt_state`` in ``stacked`` layout
    (a leading axis over this process's workers), except the ``opt_state`` leaves listed in
    ``held`` (`Backend.held`: rank-uniform state simulated workers hold once), saved once.
    Records, policy changes and summary go as JSON text: it round-trips Python floats
    exactly and keeps their types."""
    p_leaves, p_def = _host_leaves(params)
    o_leaves, o_def = _host_leaves(opt_state)
    return {
        "step": step,
        "params": p_leaves,
        "opt_state": o_leaves,
        "treedefs": {"params": p_def, "opt_state": o_def},
        "held": list(held),
        "sent_total": np.asarray(sent_total, np.int64),
        "received_total": np.asarray(received_total, np.int64),
        "records": json.dumps(records),
        "policy_changes": json.dumps(policy_changes),
        "summary": json.dumps(summary),
        # Batches are a pure function of (seed, step): this is the data position and RNG.
        "data": {"next_step": step, "seed": seed},
        "elapsed": float(elapsed),
        "finished": finished,
    }


def unpack(
    state: dict[str, Any], params: Any, opt_state: Any, *, held: Sequence[int] = ()
) -> dict[str, Any]:
    """`pack`'s fields back, ``params`` and ``opt_state`` restored into the structures of
    the given (freshly initialised, ``stacked`` layout, ``held`` leaves once) ones.

    Raises:
      CheckpointError: for a checkpoint whose state is held in another layout: one written
        before simulated workers held rank-uniform state once, or by another backend."""
    saved_held = state.get("held", [])
    if list(saved_held) != list(held):
        raise CheckpointError(
            "the saved optimizer state holds its rank-uniform leaves (DiLoCo's global model "
            "and outer state, BMUF's block momentum) "
            + (f"once at leaves {list(saved_held)}" if saved_held else "once per worker")
            + ", this run "
            + (f"once at leaves {list(held)}" if held else "once per worker")
            + ": it was written by a shoal before simulated workers held that state once "
            "(or by a changed algorithm); resume it with the shoal that wrote it, or start "
            "again with --overwrite"
        )
    out = dict(state)
    out["params"] = _restore_leaves(params, state["params"], state["treedefs"]["params"], "params")
    out["opt_state"] = _restore_leaves(
        opt_state, state["opt_state"], state["treedefs"]["opt_state"], "optimizer state"
    )
    # Writable copies: the loop adds to the totals in place.
    out["sent_total"] = np.array(state["sent_total"], np.int64)
    out["received_total"] = np.array(state["received_total"], np.int64)
    out["records"] = json.loads(state["records"])
    out["policy_changes"] = [(s, d) for s, d in json.loads(state["policy_changes"])]
    out["summary"] = json.loads(state["summary"])
    return out
