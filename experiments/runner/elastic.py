"""Elastic restart: a checkpoint of N workers continued by M (`--resume` with another
``--workers``, or another ``mpiexec -n``).

The rule, for every algorithm whose per-worker state has the same shapes at N and M
workers (the worker count is otherwise refused, naming the leaf, e.g. 1-bit Adam's
server error, which is cut into one chunk per worker):

* **Shared state is kept.** Leaves every worker holds alike (held once by simulated
  workers: DiLoCo's global model and outer state, counters) are the checkpoint's.
* **Workers 0 .. min(N, M) - 1 keep their own state**: model, optimizer state, error
  feedback, byte totals.
* **Shrinking (M < N):** worker ``i >= M`` leaves. Its error feedback (every leaf under a
  field its state class lists in ``ERROR_FEEDBACK``: `shoal.optim.helpers.
  error_feedback_mask`) is added to worker ``i mod M``'s, so the workers' total is
  unchanged: no gradient mass is dropped. Its byte totals go the same way. The rest of
  its state (its local model, its inner optimizer's moments) goes with it.
* **Growing (M > N):** worker ``i >= N`` joins with the global model (the mean over the N
  workers of the model each delivers, `shoal.optim.readouts.evaluation_params`: DiLoCo's
  global model itself, S-SGD's common model), zero error feedback (it owes nothing), zero
  byte totals, and a copy of worker ``i mod N``'s other state: its optimizer's moments,
  counters and schedule position, so that it steps like the others from the first step
  (a freshly initialised Adam would take its first steps at full size).

Growing then shrinking back (N -> M -> N, M > N, no step between) is therefore the
identity. Shrinking then growing keeps the shared state, the kept workers and the total
error feedback, but not the departed workers' own models: those who join again start from
the global model.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shoal.experiments.runner.checkpoint_files import CheckpointError
from shoal.optim.helpers import error_feedback_mask
from shoal.optim.readouts import evaluation_params

__all__ = ["global_model", "resize", "resized", "totals"]


def global_model(params: list[np.ndarray], opt_state: list[np.ndarray], p_def: Any,
                 o_def: Any, held: set[int]) -> list[np.ndarray]:  # fmt: skip
    """The mean over the saved workers of `evaluation_params`, leaf by leaf (summed in
    float64, so N equal models give that model exactly), in the params' dtypes.

    Args:
      params, opt_state: the checkpoint's leaves, a leading axis over its N workers (but
        the ``held`` indices of ``opt_state``, held once).
      p_def, o_def: the treedefs of one worker's params and optimizer state.
      held: indices of ``opt_state``'s leaves held once.
    """
    n = params[0].shape[0] if params else 0
    total: list[np.ndarray] | None = None
    for i in range(n):
        state = jax.tree.unflatten(
            o_def, [x if k in held else x[i] for k, x in enumerate(opt_state)]
        )
        mine = evaluation_params(jax.tree.unflatten(p_def, [x[i] for x in params]), state)
        leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(mine)]
        total = leaves if total is None else [t + x for t, x in zip(total, leaves)]
    assert total is not None
    return [(t / n).astype(p.dtype) for t, p in zip(total, params)]


def _rows(x: np.ndarray, n_to: int, *, ef: bool, join: np.ndarray | None) -> np.ndarray:
    """One per-worker leaf from ``len(x)`` workers to ``n_to`` (the module's rule)."""
    n_from = x.shape[0]
    keep = min(n_from, n_to)
    out = np.empty((n_to, *x.shape[1:]), x.dtype)
    out[:keep] = x[:keep]
    if n_to < n_from:
        if ef:  # the leavers' error feedback, onto the workers that stay
            for i in range(n_to, n_from):
                out[i % n_to] = out[i % n_to] + x[i]
        return out
    for i in range(n_from, n_to):
        out[i] = 0 if ef else (join if join is not None else x[i % n_from])
    return out


def resize(
    params: list[np.ndarray],
    opt_state: list[np.ndarray],
    n_to: int,
    *,
    held: set[int],
    error_feedback: list[bool],
    joined: list[np.ndarray] | None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The checkpoint's leaves for ``n_to`` workers (the module's rule).

    Args:
      params, opt_state: leaves with a leading axis over the N saved workers (but the
        ``held`` indices of ``opt_state``).
      n_to: the workers now.
      held: indices of ``opt_state``'s leaves held once: kept as they are.
      error_feedback: per leaf of ``opt_state``, whether it is error feedback.
      joined: the model of a worker that joins (`global_model`); None when ``n_to <= N``.

    Returns:
      ``(params, opt_state)`` with ``n_to`` rows per per-worker leaf.

    Example:
      >>> import numpy as np
      >>> p, ef = [np.arange(3.0)[:, None]], [np.array([[1.0], [2.0], [4.0]])]
      >>> p2, ef2 = resize(p, ef, 2, held=set(), error_feedback=[True], joined=None)
      >>> p2[0].ravel().tolist(), ef2[0].ravel().tolist()  # worker 2's error onto worker 0
      ([0.0, 1.0], [5.0, 2.0])
    """
    if len(error_feedback) != len(opt_state):
        raise ValueError("error_feedback needs one flag per optimizer-state leaf")
    joins = joined if joined is not None else [None] * len(params)
    new_params = [_rows(x, n_to, ef=False, join=j) for x, j in zip(params, joins)]
    new_state = [
        x if k in held else _rows(x, n_to, ef=error_feedback[k], join=None)
        for k, x in enumerate(opt_state)
    ]
    return new_params, new_state


def totals(x: np.ndarray, n_to: int) -> np.ndarray:
    """Per-worker byte totals to ``n_to`` workers: a leaver's onto worker ``i mod n_to``,
    a joiner's from 0; the job's total is unchanged."""
    return _rows(np.asarray(x, np.int64), n_to, ef=True, join=None)


def resized(saved: dict[str, Any], label: str, backend: Any, params: Any, opt_state: Any,
            n_to: int) -> dict[str, Any]:  # fmt: skip
    """A loaded checkpoint of ``saved["elastic_from"]`` workers (every saved worker's leaves
    stacked) as this process's workers of ``n_to`` (the module's rule), ready for
    `shoal.experiments.runner.checkpoint.unpack` into ``params`` and ``opt_state`` (this
    run's fresh ones: their structure, held leaves and error-feedback fields).

    Raises:
      CheckpointError: another structure, or a per-worker leaf whose shape follows the
        worker count (named).
    """
    n_from = saved["elastic_from"]
    held = set(backend.held(opt_state))
    params, opt_state = backend.stacked(params), backend.stacked(opt_state)
    n_params = len(jax.tree.leaves(params))
    o_paths = jax.tree_util.tree_leaves_with_path(opt_state)
    if len(saved["params"]) != n_params or len(saved["opt_state"]) != len(o_paths):
        raise CheckpointError("the saved state has a different structure than this run's")
    p_saved = [saved["params"][str(i)] for i in range(n_params)]
    o_saved = [saved["opt_state"][str(i)] for i in range(len(o_paths))]
    for k, ((path, now), old) in enumerate(zip(o_paths, o_saved)):
        per_worker = k not in held
        if np.shape(now)[per_worker:] != old.shape[per_worker:]:
            raise CheckpointError(
                f"cannot resume {label} with {n_to} workers from a checkpoint of {n_from}: "
                f"its optimizer state leaf {jax.tree_util.keystr(path)} is "
                f"{list(old.shape[per_worker:])} per worker there and "
                f"{list(np.shape(now)[per_worker:])} here (its shape follows the worker "
                f"count); resume with {n_from} workers"
            )
    ef = [bool(x) for x in jax.tree.leaves(error_feedback_mask(opt_state))]
    # One worker's tree has the stacked one's structure (only the leaves' shapes differ).
    p_def, o_def = jax.tree.structure(params), jax.tree.structure(opt_state)
    joined = global_model(p_saved, o_saved, p_def, o_def, held) if n_to > n_from else None
    p_new, o_new = resize(p_saved, o_saved, n_to, held=held, error_feedback=ef, joined=joined)
    rows = slice(None) if backend.name == "sim" else slice(backend.rank, backend.rank + 1)
    out = dict(saved)
    out["params"] = {str(i): x[rows] for i, x in enumerate(p_new)}
    out["opt_state"] = {str(i): x if i in held else x[rows] for i, x in enumerate(o_new)}
    out["sent_total"] = totals(saved["sent_total"], n_to)
    out["received_total"] = totals(saved["received_total"], n_to)
    return out
