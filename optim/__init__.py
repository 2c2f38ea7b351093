"""shoal.optim: communication-efficient algorithms as Optax gradient transformations."""

from shoal.optim.allreduce import AllReduceState, allreduce_gradients
from shoal.optim.bfb import BFBState, bfb_allreduce
from shoal.optim.bmuf import BMUFState, bmuf
from shoal.optim.bmuf_gtc import bmuf_gtc
from shoal.optim.gtc import GTCState, gtc
from shoal.optim.onebit import OneBitAdamState, OneBitLambState, onebit_adam, onebit_lamb

__all__ = [
    "AllReduceState",
    "BFBState",
    "BMUFState",
    "GTCState",
    "OneBitAdamState",
    "OneBitLambState",
    "allreduce_gradients",
    "bfb_allreduce",
    "bmuf",
    "bmuf_gtc",
    "gtc",
    "onebit_adam",
    "onebit_lamb",
]
