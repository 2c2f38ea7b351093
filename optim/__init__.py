"""shoal.optim: communication-efficient algorithms as Optax gradient transformations."""

from shoal.optim.allreduce import AllReduceState, allreduce_gradients
from shoal.optim.applying import ApplyingTransformation, update_and_apply
from shoal.optim.bfb import BFBState, bfb_allreduce
from shoal.optim.bmuf import BMUFState, bmuf
from shoal.optim.bmuf_gtc import bmuf_gtc
from shoal.optim.demo import DeMoState, demo
from shoal.optim.diloco import DiLoCoState, diloco
from shoal.optim.gtc import GTCState, gtc
from shoal.optim.noise_scale import NoiseScaleState, gradient_noise_scale, noise_scale
from shoal.optim.nonfinite import (
    NONFINITE_POLICIES,
    NonFiniteGradientError,
    SkipNonFiniteState,
    SkipNonFiniteTransformation,
    skip_nonfinite,
)
from shoal.optim.onebit import OneBitAdamState, OneBitLambState, onebit_moments
from shoal.optim.onebit_adam import onebit_adam
from shoal.optim.onebit_lamb import onebit_lamb
from shoal.optim.partial_exchange import PartialExchangeState, partial_exchange, pgx_partition
from shoal.optim.peer_averaging import PeerAveragingState, peer_averaging, peer_permutation
from shoal.optim.powersgd import PowerSGDState, powersgd
from shoal.optim.prefetch import PrefetchingTransformation
from shoal.optim.sma import SMAState, sma
from shoal.optim.streaming_diloco import StreamingDiLoCoState, streaming_diloco
from shoal.optim.topk import TopKState, topk

__all__ = [
    "AllReduceState",
    "ApplyingTransformation",
    "BFBState",
    "BMUFState",
    "DeMoState",
    "DiLoCoState",
    "GTCState",
    "NONFINITE_POLICIES",
    "NonFiniteGradientError",
    "NoiseScaleState",
    "OneBitAdamState",
    "OneBitLambState",
    "PartialExchangeState",
    "PeerAveragingState",
    "PowerSGDState",
    "PrefetchingTransformation",
    "SMAState",
    "SkipNonFiniteState",
    "SkipNonFiniteTransformation",
    "StreamingDiLoCoState",
    "TopKState",
    "allreduce_gradients",
    "bfb_allreduce",
    "bmuf",
    "bmuf_gtc",
    "demo",
    "diloco",
    "gradient_noise_scale",
    "gtc",
    "noise_scale",
    "onebit_adam",
    "onebit_lamb",
    "onebit_moments",
    "partial_exchange",
    "peer_averaging",
    "peer_permutation",
    "pgx_partition",
    "powersgd",
    "skip_nonfinite",
    "sma",
    "streaming_diloco",
    "topk",
    "update_and_apply",
]
