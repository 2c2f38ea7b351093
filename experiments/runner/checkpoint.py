"""Exact checkpoints of one algorithm's run on orbax.checkpoint: save every K steps,
verify, resume.

A checkpoint is everything the training loop needs to continue as if it had never
stopped: the parameters and the whole optimizer state of this process's workers (residuals,
error feedback, block momentum, variances, counters, wire counters), the step (which is
also the data position: batches are a pure function of the step and the seed), the host
byte totals, the records so far, the policy changes made so far and, once the run ended,
its summary. The batches' RNG is seeded by ``(seed, epoch)`` and the algorithms' own
randomness by the step, so the step and the config's seed are the whole RNG state.

Layout: one orbax ``CheckpointManager`` per process, in ``<out>/checkpoints/<algorithm>/
rank_<rank>/`` (every MPI rank and every ``jax.distributed`` process its own, each saving
and restoring its own workers; in simulation one process holds all stacked workers). A
step is the folder ``step_<N>/``:

* ``arrays/``: an orbax PyTree (tensorstore, OCDBT) of ``params`` and ``opt_state`` (their
  leaves by index) and the host byte totals ``sent_total``, ``received_total``; plain
  ``orbax.checkpoint.PyTreeCheckpointer().restore`` reads it;
* ``meta/meta.json``: the run's identity (algorithm entry, step, workers, backend, devices
  per worker, config), the rest of the state (records, policy changes, summary, tree
  structures, elapsed time), the sha256 of every array, and the sha256 of itself (`seal`).

`read` gives a step folder's verified state. The config recorded, and compared on resume,
is the fields the algorithm can depend on: not the fields other algorithms declare as
their own (`shoal.experiments.algorithms.unused_fields`), so a changed ``gtc_threshold``
does not stop ``ssgd`` from resuming. Orbax writes a step under a temporary name and
renames it when complete; `save` then fsyncs every file of it and writes ``COMMITTED``
last, and only a step with that marker counts (a job killed while saving once left a
renamed step with a truncated data file). The checksums catch what neither does
(tensorstore reads a flipped byte in its data without complaint). The latest `KEEP` steps
are kept. Saving is synchronous (it returns with the step on disk) and orbax's INFO
logging is muted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

from shoal.experiments.algorithms import unused_fields
from shoal.experiments.config import Config, flatten

FORMAT = 2
KEEP = 2
# Fields that may change between a run and its resumption without changing the training
# (grad_chunk: how many workers' gradients are computed at once, the same values).
IGNORED_FIELDS = frozenset({"name", "algorithms", "checkpoint_every", "grad_chunk"})
_PARTS = ("params", "opt_state")  # dicts of leaves by index
_TOTALS = ("sent_total", "received_total")
_META_FILE = "meta.json"
COMMITTED = "COMMITTED"  # in a step folder: the step is complete (see `_commit`)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, or from an incompatible run."""


def config_fields(cfg: Config, algorithm: str | None = None) -> dict[str, str]:
    """The fields that must match for a checkpoint of ``algorithm`` (an entry of
    ``cfg.algorithms``; None: any algorithm) to resume, in their ``--set`` spelling."""
    skip = IGNORED_FIELDS | (unused_fields(algorithm) if algorithm is not None else set())
    return {k: v for k, v in flatten(cfg) if k.split(".")[0] not in skip}


def fingerprint(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def folder_name(algorithm: str) -> str:
    """A file-system safe folder name for an algorithm entry (entries may carry overrides)."""
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", algorithm)


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


def _sha256(a: np.ndarray) -> str:
    h = hashlib.sha256(f"{a.dtype.name}{list(a.shape)}".encode())
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return h.hexdigest()


def _checksums(state: dict[str, Any]) -> dict[str, str]:
    sums = {f"{p}/{k}": _sha256(a) for p in _PARTS for k, a in state[p].items()}
    return {**sums, **{p: _sha256(state[p]) for p in _TOTALS}}


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with ``sha256`` set to the checksum of the rest (after an edit, re-seal)."""
    rest = {k: v for k, v in meta.items() if k != "sha256"}
    return {**rest, "sha256": hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()}


class _OwnArraysHandler(ocp.type_handlers.NumpyHandler):
    """orbax's NumpyHandler, writing on every process. orbax takes host arrays to be
    replicated and writes them on process 0 only (whatever the primary host); here each
    ``jax.distributed`` process saves its own workers' arrays into its own folder. The
    write is orbax's own, without that condition; it uses orbax internals (0.12), so the
    ``jax`` backend test of tests/test_checkpoint.py fails should they change."""

    async def _background_serialize(self, values, infos, args=None):
        writes = []
        for value, info, arg in zip(values, infos, args, strict=True):
            await info.await_path_creation()
            ocdbt = info.is_ocdbt_checkpoint
            spec = ts_utils.build_array_write_spec(
                info=info,
                arg=arg,
                global_shape=value.shape,
                local_shape=value.shape,
                dtype=value.dtype,
                use_ocdbt=ocdbt,
                process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=ocdbt),
                metadata_key=self._metadata_key,
            )
            writes.append(self._open_and_write(value, spec.json, info.ts_context))
        await asyncio.gather(*writes)

    async def deserialize(self, infos, args=None):
        # orbax stops at the first failed read of a corrupt checkpoint and closes its event
        # loop; the reads still in flight then end on the closed loop and tensorstore
        # prints their tracebacks. Each read on its own, all waited for, then the error.
        read = super().deserialize
        args = args or [ocp.type_handlers.RestoreArgs()] * len(infos)
        done = await asyncio.gather(
            *(read([i], [a]) for i, a in zip(infos, args, strict=True)), return_exceptions=True
        )
        for result in done:
            if isinstance(result, BaseException):
                raise result
        return [result[0] for result in done]


def _orbax_info(record: logging.LogRecord) -> bool:
    """Drop orbax's INFO records (several lines per save and restore)."""
    return record.levelno >= logging.WARNING or "/orbax/" not in record.pathname


logging.getLogger("absl").addFilter(_orbax_info)


def _only_me() -> ocp.options.MultiprocessingOptions:
    """orbax options that involve no other process: orbax's multi-process defaults (process
    0 writes, barriers over all processes) would leave the other ``jax.distributed``
    processes' checkpoints empty."""
    me = jax.process_index()  # orbax's process index: 0 on every MPI rank
    return ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"shoal{me}"
    )


def _arrays_handler() -> ocp.PyTreeCheckpointHandler:
    types = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, _OwnArraysHandler(deepcopy_host_arrays=False)),  # saving is synchronous
        (jax.Array, ocp.type_handlers.ArrayHandler()),  # unused; orbax warns without one
    )
    return ocp.PyTreeCheckpointHandler(multiprocessing_options=_only_me(),
                                       type_handler_registry=types)  # fmt: skip


def _manager(folder: Path) -> ocp.CheckpointManager:
    """The orbax manager of this process's folder: steps, atomic saves, keep-N."""
    only_me = _only_me()
    arrays = _arrays_handler()
    meta = ocp.handlers.JsonCheckpointHandler(_META_FILE, multiprocessing_options=only_me)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("arrays", ocp.args.PyTreeSave, arrays)
    registry.add("meta", ocp.args.JsonSave, meta)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=KEEP,
        step_name_format=ocp.step.standard_name_format(step_prefix="step"),
        enable_async_checkpointing=False,
        cleanup_tmp_directories=True,  # what a crash while saving left
        multiprocessing_options=only_me,
        create=False,  # orbax refuses create with active_processes: `Checkpointer` creates it
    )
    return ocp.CheckpointManager(folder, options=options, handler_registry=registry)


def _commit(step: Path) -> None:
    """Mark the step folder ``step`` committed once every file of it is on disk: orbax's
    rename alone is not enough (a job killed by SIGKILL while saving left a renamed step
    whose data file was truncated, tests/test_faults.py), so the data is fsynced first
    and the marker is the last thing written."""
    for path in sorted(step.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    marker = step / COMMITTED
    tmp = marker.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step.name}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)
    fd = os.open(step, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def read_meta(step: Path) -> dict[str, Any]:
    """The verified JSON part of the checkpoint folder ``step`` (``.../step_<N>``)."""
    where = step / "meta" / _META_FILE
    try:
        meta = json.loads(where.read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"unreadable checkpoint {where}: {_first_line(e)}") from None
    if not isinstance(meta, dict) or seal(meta)["sha256"] != meta.get("sha256"):
        raise CheckpointError(
            f"corrupt checkpoint {where}: its checksum does not match (overwritten)"
        )
    if f"step_{meta.get('step')}" != step.name:
        raise CheckpointError(f"corrupt checkpoint {where}: it says step {meta.get('step')}")
    return meta


def read(step: Path) -> dict[str, Any]:
    """The verified state (`pack`'s dict) of the checkpoint folder ``step``
    (``.../rank_<r>/step_<N>``); `CheckpointError` naming the file if it is bad."""
    meta = read_meta(step)
    where = step / "arrays"
    try:
        reader = ocp.Checkpointer(_arrays_handler(), multiprocessing_options=_only_me())
        arrays = reader.restore(where, args=ocp.args.PyTreeRestore())
    except Exception as e:  # tensorstore, orbax and OS errors: all mean "cannot read"
        raise CheckpointError(f"corrupt checkpoint {where}: orbax: {_first_line(e)}") from None
    state = dict(meta["state"])
    try:
        for part in _PARTS:
            leaves = {k: np.asarray(a) for k, a in arrays.get(part, {}).items()}
            for k, (dtype, shape) in meta["empty"][part].items():
                leaves[k] = np.zeros(shape, jnp.dtype(dtype))
            state[part] = leaves
        for part in _TOTALS:
            state[part] = np.asarray(arrays[part])
        sums = _checksums(state)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"corrupt checkpoint {where}: missing {e}") from None
    if sums.keys() != meta["arrays"].keys():
        raise CheckpointError(f"corrupt checkpoint {where}: other arrays than it lists")
    bad = [name for name, digest in sums.items() if meta["arrays"][name] != digest]
    if bad:
        raise CheckpointError(
            f"corrupt checkpoint {where}: {', '.join(bad)} do not match their checksums "
            f"(truncated or overwritten)"
        )
    return state


class Checkpointer:
    """Saves and finds the checkpoints of one algorithm on one process.

    ``meta`` identifies the run (algorithm, workers, backend, devices per worker, config);
    `load` refuses a checkpoint whose workers, devices per worker or config differ.
    ``backend.gather_all`` (`shoal.experiments.runner.backends.Backend`) makes every
    process agree on the step they resume from.
    """

    def __init__(self, root: Path, algorithm: str, cfg: Config, backend: Any):
        self.folder = Path(root) / folder_name(algorithm)
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
            self._orbax = _manager(self.dir)
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
                self._manager().delete(step)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` (see `pack`) as step ``step``; keep the latest `KEEP` ones.
        Returns when the checkpoint is complete on disk."""
        manager = self._manager()
        if step in manager.all_steps():
            manager.delete(step)  # orbax never overwrites: a step saved again replaces it
        arrays, empty = {p: state[p] for p in _TOTALS}, {}
        for part in _PARTS:
            # orbax cannot save zero-size arrays: their dtype and shape go in the JSON.
            leaves = state[part].items()
            arrays[part] = {k: a for k, a in leaves if a.size}
            empty[part] = {k: [a.dtype.name, list(a.shape)] for k, a in leaves if not a.size}
        rest = {k: v for k, v in state.items() if k not in _PARTS + _TOTALS}
        sums = _checksums(state)
        meta = seal({**self.meta, "step": step, "state": rest, "empty": empty, "arrays": sums})
        args = ocp.args.Composite(arrays=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta))
        manager.save(step, args=args, force=True)
        _commit(self.path(step))
        return self.path(step)

    def check_compatible(self, step: int) -> None:
        """Refuse a checkpoint of a different run (workers, backend layout or config)."""
        try:
            saved = read_meta(self.path(step))
        except CheckpointError:
            return  # reported as corrupt by `read`
        name = self.path(step)
        if saved.get("algorithm") != self.meta["algorithm"]:
            raise CheckpointError(f"{name} is of algorithm {saved.get('algorithm')!r}")
        k_saved, k_now = saved.get("devices_per_worker", 1), self.meta["devices_per_worker"]
        if k_saved != k_now:
            raise CheckpointError(
                f"cannot resume {self.meta['algorithm']} with --devices-per-worker {k_now}: "
                f"its checkpoint {name} holds workers of {k_saved} devices each (resume with "
                f"--devices-per-worker {k_saved})"
            )
        if saved.get("workers") != self.meta["workers"]:
            raise CheckpointError(
                f"cannot resume {self.meta['algorithm']} with {self.meta['workers']} workers: "
                f"its checkpoint {name} has {saved.get('workers')} (resume with "
                f"--workers {saved.get('workers')})"
            )
        if saved.get("backend") != self.meta["backend"]:
            raise CheckpointError(
                f"cannot resume {self.meta['algorithm']} on backend {self.meta['backend']!r}: "
                f"its checkpoint {name} is from {saved.get('backend')!r}"
            )
        old, new = saved.get("config", {}), self.meta["config"]
        # Checkpoints may list fields this run's would not: compare the ones it would list.
        skip = IGNORED_FIELDS | unused_fields(self.meta["algorithm"])
        old = {k: v for k, v in old.items() if k.split(".")[0] not in skip}
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                raise CheckpointError(
                    f"cannot resume {self.meta['algorithm']}: config field {key!r} is "
                    f"{new.get(key)} now but {old.get(key)} in its checkpoint {name}"
                )

    def load(self) -> dict[str, Any] | None:
        """The newest checkpoint that is good on every process, or None if there is none
        at all. A bad one is reported on stderr and the previous one used; if checkpoints
        exist but none is good everywhere, raises `CheckpointError` naming the files."""
        steps = self.steps()
        if steps:
            self.check_compatible(steps[0])
        good, states, problems = [], {}, []
        for step in steps:
            try:
                states[step] = read(self.path(step))
                good.append(step)
            except CheckpointError as e:
                problems.append(str(e))
        everyone = self.backend.gather_all((bool(steps), good, problems))
        if not any(found for found, _, _ in everyone):
            return None
        common = set.intersection(*(set(g) for _, g, _ in everyone))
        all_problems = [p for _, _, ps in everyone for p in ps]
        if not common:
            raise CheckpointError(
                "no good checkpoint to resume from: " + "; ".join(all_problems or ["none saved"])
            )
        step = max(common)
        if self.rank == 0:
            for p in all_problems:
                print(f"shoal-run: warning: {p}", file=sys.stderr)
            if step != max(max(g, default=-1) for _, g, _ in everyone) or all_problems:
                print(
                    f"shoal-run: resuming {self.meta['algorithm']} from the previous good "
                    f"checkpoint, step {step}",
                    file=sys.stderr,
                )
        return states[step]


def pack(
    *,
    step: int,
    params: Any,
    opt_state: Any,
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
    (a leading axis over this process's workers). Records, policy changes and summary go
    as JSON text: it round-trips Python floats exactly and keeps their types."""
    p_leaves, p_def = _host_leaves(params)
    o_leaves, o_def = _host_leaves(opt_state)
    return {
        "step": step,
        "params": p_leaves,
        "opt_state": o_leaves,
        "treedefs": {"params": p_def, "opt_state": o_def},
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


def unpack(state: dict[str, Any], params: Any, opt_state: Any) -> dict[str, Any]:
    """`pack`'s fields back, ``params`` and ``opt_state`` restored into the structures of
    the given (freshly initialised, ``stacked`` layout) ones."""
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
