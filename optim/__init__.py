"""shoal.optim: communication-efficient algorithms as Optax gradient transformations."""

from shoal.optim.allreduce import AllReduceState, allreduce_gradients
from shoal.optim.bfb import BFBState, bfb_allreduce
from shoal.optim.bmuf import BMUFState, bmuf
from shoal.optim.bmuf_gtc import bmuf_gtc
from shoal.optim.diloco import DiLoCoState, diloco
from shoal.optim.gtc import GTCState, gtc
from shoal.optim.noise_scale import NoiseScaleState, gradient_noise_scale, noise_scale
from shoal.optim.nonfinite import (
    NONFINITE_POLICIES,
    NonFiniteGradientError,
    SkipNonFiniteState,
    skip_nonfinite,
)
from shoal.optim.onebit import OneBitAdamState, OneBitLambState, onebit_adam, onebit_lamb
from shoal.optim.partial_exchange import PartialExchangeState, partial_exchange, pgx_partition
from shoal.optim.peer_averaging import PeerAveragingState, peer_averaging, peer_permutation
from shoal.optim.sma import SMAState, sma

__all__ = [
    "AllReduceState",
    "BFBState",
    "BMUFState",
    "DiLoCoState",
    "GTCState",
    "NONFINITE_POLICIES",
    "NonFiniteGradientError",
    "NoiseScaleState",
    "OneBitAdamState",
    "OneBitLambState",
    "PartialExchangeState",
    "PeerAveragingState",
    "SMAState",
    "SkipNonFiniteState",
    "allreduce_gradients",
    "bfb_allreduce",
    "bmuf",
    "bmuf_gtc",
    "diloco",
    "gradient_noise_scale",
    "gtc",
    "noise_scale",
    "onebit_adam",
    "onebit_lamb",
    "partial_exchange",
    "peer_averaging",
    "peer_permutation",
    "pgx_partition",
    "skip_nonfinite",
    "sma",
]
