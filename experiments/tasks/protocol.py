"""What ``shoal-run`` needs of a task (`Task`), and the check that a task provides it
(`check_task`), run before anything trains.

A task is the model, its loss and the data of one experiment. The bundled tasks
(``mixture``, ``hmm``, ``lm``, ``images``) implement `Task`; so can yours, in any module:
give ``shoal-run`` a factory that takes the run's `shoal.experiments.config.Config` and
returns the task, with ``--task module.path:factory``, ``--task path/to/file.py:factory``,
or ``get_task(config)`` in the config file itself (see ``examples/own_model.py``).
Every runner feature then works with it: the sim, mpi and jax backends, checkpoints and
``--resume``, exact bytes, reports and plots, the cost-model projection and studies.

Every process builds its own task from the config, so the data and the initial
parameters must be a pure function of the config: every worker, rank and backend must see
the same batches. Seed the initial parameters and the batch order with ``config.seed`` and
the data itself with ``config.seed_of_data``, so that ``--seeds 0,1,2`` repeats the run
from other initial models and batch orders on the same data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np


@runtime_checkable
class Task(Protocol):
    """The model, loss and data of one experiment, as ``shoal-run`` uses them.

    Methods:
      init_params(): the initial parameters of one worker, a pytree of floating arrays,
        the same at every call (every worker starts from them).
      loss(params, x, y): the scalar training loss of one worker's batch; pure and
        jit-able (it is differentiated under ``jax.vmap`` or ``shard_map``).
      batch(step, workers): ``(x, y)`` of the 0-based ``step``, NumPy arrays (or pytrees
        of them) whose leading axis is over the ``workers``: worker ``r`` trains on row
        ``r``. A pure function of the config and ``step``, so a resumed run sees the
        same batches.
      evaluate(params): the test metrics of one set of parameters (the workers'
        average): a mapping with at least ``"loss"`` and ``"accuracy"`` (recorded as
        ``test_loss``, ``test_accuracy``; more names are recorded as ``test_<name>``),
        or the tuple ``(loss, accuracy)``.

    Optional attributes: ``error_name`` (what ``1 - accuracy`` is called in a study's
    tables, default "test error") and ``corpus_info()`` (a dict of lines for the report's data
    section).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> class Line:
      ...     def init_params(self): return {"w": jnp.zeros(())}
      ...     def loss(self, p, x, y): return jnp.mean((p["w"] * x - y) ** 2)
      ...     def batch(self, step, workers):
      ...         x = np.ones((workers, 4), np.float32)
      ...         return x, 2 * x
      ...     def evaluate(self, p): return {"loss": float((p["w"] - 2) ** 2), "accuracy": 0.0}
      >>> isinstance(Line(), Task)
      True
    """

    def init_params(self) -> Any: ...

    def loss(self, params: Any, x: Any, y: Any) -> jax.Array: ...

    def batch(self, step: int, workers: int) -> tuple[Any, Any]: ...

    def evaluate(self, params: Any) -> Mapping[str, float] | tuple[float, float]: ...


def check_task(task: Any, spec: str, workers: int = 2) -> None:
    """Raise `TypeError` naming ``spec`` (the task's name or ``module:factory``) and what
    is wrong, unless ``task`` provides `Task`: its methods, floating parameters, a batch
    with a leading axis over the workers and a scalar loss (traced, not run)."""
    methods = ("init_params", "loss", "batch", "evaluate")
    missing = [m for m in methods if not callable(getattr(task, m, None))]
    if missing:
        raise TypeError(
            f"task {spec}: {type(task).__name__} has no {', '.join(missing)} (a task "
            "provides init_params(), loss(params, x, y), batch(step, workers) and "
            "evaluate(params): shoal.experiments.tasks.Task)"
        )
    params = task.init_params()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"task {spec}: init_params() leaf {jax.tree_util.keystr(path)} has dtype "
                f"{jnp.result_type(leaf)}; parameters must be floating point"
            )
    if not jax.tree.leaves(params):
        raise TypeError(f"task {spec}: init_params() returned no arrays")
    got = task.batch(0, workers)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise TypeError(f"task {spec}: batch(step, workers) must return a pair (x, y)")
    for name, part in zip("xy", got, strict=True):
        for leaf in jax.tree.leaves(part):
            if np.ndim(leaf) < 1 or np.shape(leaf)[0] != workers:
                raise TypeError(
                    f"task {spec}: batch(0, {workers})'s {name} has shape "
                    f"{np.shape(leaf)}; its leading axis must be over the {workers} workers"
                )
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], np.asarray(a).dtype), got)
    out = jax.eval_shape(task.loss, params, *one)
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()):
        raise TypeError(f"task {spec}: loss(params, x, y) of one worker's batch must be a "
                        f"scalar, got {out}")  # fmt: skip


def metrics_of(result: Any, spec: str) -> dict[str, float]:
    """``evaluate``'s result as ``{name: float}`` with ``loss`` and ``accuracy`` first;
    `TypeError` naming ``spec`` when it is neither form of `Task.evaluate`."""
    if isinstance(result, Mapping):
        metrics = dict(result)
    elif isinstance(result, tuple) and len(result) == 2:
        metrics = {"loss": result[0], "accuracy": result[1]}
    else:
        raise TypeError(
            f"task {spec}: evaluate(params) must return a mapping with 'loss' and "
            f"'accuracy', or (loss, accuracy); got {type(result).__name__}"
        )
    missing = [k for k in ("loss", "accuracy") if k not in metrics]
    if missing:
        raise TypeError(f"task {spec}: evaluate(params) gave no {' or '.join(missing)}")
    return {k: float(metrics[k]) for k in ("loss", "accuracy", *metrics)}
