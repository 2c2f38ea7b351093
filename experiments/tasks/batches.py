"""The batch schedule shared by the tasks: which training examples each worker gets."""

from __future__ import annotations

import numpy as np


class EpochBatches:
    """Seeded epochs over a training set of ``size`` examples.

    ``indices(step, workers)`` are the example indices of 0-based ``step``, one row of
    ``batch_size`` per worker: the step's global batch of ``workers * batch_size``
    examples, worker ``r`` taking block ``r``. Every epoch walks a fresh permutation
    seeded by ``(seed, epoch)``; the tail that does not fill a global batch is dropped.
    The schedule depends on nothing else, so every backend and rank sees the same batches.
    """

    def __init__(self, size: int, batch_size: int, seed: int):
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self._epoch = None
        self._perm = None

    def indices(self, step: int, workers: int) -> np.ndarray:
        n = workers * self.batch_size
        per_epoch = self.size // n
        if per_epoch == 0:
            raise ValueError(f"{workers} workers x {self.batch_size} exceed {self.size} examples")
        epoch, i = divmod(step, per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, 1, epoch])
            self._perm, self._epoch = rng.permutation(self.size), epoch
        return self._perm[i * n : (i + 1) * n].reshape(workers, self.batch_size)
