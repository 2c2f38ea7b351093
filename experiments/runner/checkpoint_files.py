"""What a checkpoint is on disk: the orbax.checkpoint folders of one process, their commit
marker and their checksums. `read` gives a step folder's verified state.

Layout: one orbax ``CheckpointManager`` per process (`open_manager`), in ``<out>/checkpoints/
<algorithm>/rank_<rank>/`` (every MPI rank and every ``jax.distributed`` process its own,
each saving and restoring its own workers; in simulation one process holds all stacked
workers). A step is the folder ``step_<N>/``:

* ``arrays/``: an orbax PyTree (tensorstore, OCDBT) of ``params`` and ``opt_state`` (their
  leaves by index) and the host byte totals ``sent_total``, ``received_total``; plain
  ``orbax.checkpoint.PyTreeCheckpointer().restore`` reads it;
* ``meta/meta.json``: the run's identity (algorithm entry, step, workers, backend, devices
  per worker, config), the rest of the state (records, policy changes, summary, tree
  structures, elapsed time), the sha256 of every array, and the sha256 of itself (`seal`).

Orbax writes a step under a temporary name and renames it when complete; `commit` then
fsyncs every file of it and writes ``COMMITTED`` last, and only a step with that marker
counts (a job killed while saving once left a renamed step with a truncated data file).
The checksums catch what neither does (tensorstore reads a flipped byte in its data without
complaint). The latest `KEEP` steps are kept. Saving is synchronous (it returns with the
step on disk) and orbax's INFO logging is muted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

FORMAT = 2
KEEP = 2
_PARTS = ("params", "opt_state")  # dicts of leaves by index
_TOTALS = ("sent_total", "received_total")
_META_FILE = "meta.json"
COMMITTED = "COMMITTED"  # in a step folder: the step is complete (see `commit`)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, or from an incompatible run."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint this process could not write (a full disk, a read-only folder): its
    own failure, which the other processes do not share."""


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
        # Every write waited for before the first failure is raised (a full disk): orbax
        # then closes its event loop, on which writes still in flight would end and print
        # their tracebacks.
        for result in await asyncio.gather(*writes, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

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


_SAVING = [0]  # saves in progress (`writing`)


def _orbax_info(record: logging.LogRecord) -> bool:
    """Drop orbax's INFO records (several lines per save and restore), and all of its
    records during a save: a failed write is logged, with its traceback, by each of
    orbax's threads (32 tracebacks for one full disk); `writing` reports it once."""
    if "/orbax/" not in record.pathname:
        return True
    return record.levelno >= logging.WARNING and not _SAVING[0]


logging.getLogger("absl").addFilter(_orbax_info)


@contextlib.contextmanager
def writing(path: Path):
    """Around a save of ``path``: a write that fails (a full disk, a read-only folder, a
    file size limit) is raised as one `CheckpointWriteError` naming the folder and the
    cause, and orbax's own logs of it are muted."""
    _SAVING[0] += 1
    try:
        yield
    except OSError as e:
        raise CheckpointWriteError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    except (ValueError, RuntimeError) as e:
        # tensorstore's errors name the failed system call's errno in their text.
        code = re.search(r"os_error_code='(\d+)'", str(e))
        if code is None or isinstance(e, CheckpointError):
            raise
        why = os.strerror(int(code.group(1)))
        raise CheckpointWriteError(f"cannot write checkpoint {path}: {why}") from None
    finally:
        _SAVING[0] -= 1


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


def open_manager(folder: Path) -> ocp.CheckpointManager:
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


def save_args(state: dict[str, Any], meta: dict[str, Any]) -> ocp.args.Composite:
    """What a manager saves of ``state`` (`pack`'s dict), under ``meta`` (the run's identity
    and the step): the inverse of `read`."""
    arrays, empty = {p: state[p] for p in _TOTALS}, {}
    for part in _PARTS:
        # orbax cannot save zero-size arrays: their dtype and shape go in the JSON.
        leaves = state[part].items()
        arrays[part] = {k: a for k, a in leaves if a.size}
        empty[part] = {k: [a.dtype.name, list(a.shape)] for k, a in leaves if not a.size}
    rest = {k: v for k, v in state.items() if k not in _PARTS + _TOTALS}
    sums = _checksums(state)
    meta = seal({**meta, "state": rest, "empty": empty, "arrays": sums})
    return ocp.args.Composite(arrays=ocp.args.PyTreeSave(arrays), meta=ocp.args.JsonSave(meta))


def uncommit(step: Path) -> None:
    """Take the commit marker off the step folder ``step`` before it is deleted, and make
    that durable: a job killed while orbax removes the folder must not leave a committed
    step with some of its files gone (tests/test_faults.py)."""
    marker = step / COMMITTED
    if not marker.exists():
        return
    marker.unlink()
    fd = os.open(step, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(step: Path) -> None:
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
