"""shoal.optim: communication-efficient algorithms as Optax gradient transformations."""

from shoal.optim.allreduce import AllReduceState, allreduce_gradients

__all__ = ["AllReduceState", "allreduce_gradients"]
