"""`Held`: how optimizer state that is the same on every worker is held.

Some state comes from the exchanges alone (1-bit Adam/LAMB's moments ``m``, ``v`` and
``v_fresh``), so every worker has the same value. Under MPI and shard_map each worker
holds it whole. Simulated workers (vmap) would write N identical copies of it every step;
instead each holds one chunk, the N workers one copy between them, and a step reads it
back whole through `AxisCollective.all_gather`, a free view under vmap (1-bit LAMB's
compression stage at 1.05M params x 16 simulated workers: 1.80x local SGD's step ->
1.44x, side by side in one process).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shoal.comms.collective import Collective, is_simulated
from shoal.optim._validation import check_tree_like

__all__ = ["Held"]


class Held(NamedTuple):
    """The layout of state the same on every worker: whole (``cut == 1``: MPI ranks,
    devices), or on simulated workers cut into one chunk per worker, worker ``r`` holding
    elements ``[r c, (r + 1) c)`` of each leaf's ravel padded to ``P c`` (``c =
    ceil(numel / P)``).

    Attributes:
      collective: the workers (`shoal.comms.Collective`).
      cut: chunks per leaf, ``P`` on simulated workers, else 1.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shoal.comms import AxisCollective
      >>> from shoal.optim._held import Held
      >>> coll = AxisCollective("workers", 2)
      >>> def worker(x):  # x: the same on both workers
      ...     layout = Held.of(coll)
      ...     (mine,) = layout.store([x])
      ...     return mine, layout.load([mine], [x])[0]
      >>> mine, whole = jax.vmap(worker, axis_name="workers")(jnp.tile(jnp.arange(3.0), (2, 1)))
      >>> print(mine)  # worker 0 holds [0, 1], worker 1 holds [2] and the padding
      [[0. 1.]
       [2. 0.]]
      >>> print(whole)
      [[0. 1. 2.]
       [0. 1. 2.]]
    """

    collective: Collective
    cut: int

    @classmethod
    def of(cls, collective: Collective) -> Held:
        """The layout for ``collective``, at trace time (inside its vmap or shard_map)."""
        return cls(collective, collective.size if is_simulated(collective) else 1)

    def chunk(self, n: int) -> int:
        """Elements each worker holds of a leaf of ``n``."""
        return -(-n // self.cut)

    def zeros(self, params: Any) -> Any:
        """Float32 zeros for each leaf of ``params``, as this layout holds them."""
        shape = lambda p: (self.chunk(math.prod(jnp.shape(p))),) if self.cut > 1 else jnp.shape(p)
        return jax.tree.map(lambda p: jnp.zeros(shape(p), jnp.float32), params)

    def load(self, held: list, like: list) -> list:
        """The whole leaves (shaped as ``like``'s) from what this worker holds."""
        if self.cut == 1:
            return held
        out = []
        for h, x in zip(held, like):
            rows = self.collective.all_gather(h)  # [P, c]: under vmap a free view
            out.append(rows.reshape(-1)[: math.prod(x.shape)].reshape(x.shape))
        return out

    def store(self, values: list) -> list:
        """What this worker holds of ``values`` (whole leaves, the same on every worker)."""
        if self.cut == 1:
            return values
        rank, out = self.collective.rank(), []
        for v in values:
            c = self.chunk(v.size)
            rows = jnp.pad(jnp.ravel(v), (0, c * self.cut - v.size)).reshape(self.cut, c)
            out.append(rows[rank])  # under vmap: one copy, each worker its row
        return out

    def check(self, name: str, held: Any, grads: Any) -> None:
        """A ValueError naming the first leaf of ``grads`` that ``held`` was not made for
        (init was given other params)."""
        if self.cut == 1 or jax.tree.structure(grads) != jax.tree.structure(held):
            check_tree_like(name, "the gradient (updates)", grads, held, "the params given to init")
            return
        paths = jax.tree_util.tree_flatten_with_path(grads)[0]
        for (path, g), h in zip(paths, jax.tree.leaves(held)):
            c = self.chunk(math.prod(jnp.shape(g)))
            if jnp.shape(h) != (c,):
                leaf = jax.tree_util.keystr(path) or "(root)"
                raise ValueError(
                    f"{name}: the gradient (updates) leaf {leaf} has "
                    f"shape {tuple(jnp.shape(g))}, whose chunk on {self.cut} simulated "
                    f"workers is {c} values; the state holds {tuple(jnp.shape(h))} (init was "
                    "given other params)"
                )
