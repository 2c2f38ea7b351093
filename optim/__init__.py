"""shoal.optim: communication-efficient algorithms as Optax gradient transformations.

Exports the factories and their state classes, the non-finite wrapper and
`update_and_apply`; the algorithms' code is in private modules (``optim/_gtc.py``, ...),
and the helpers that read a state or plan an exchange are in `shoal.optim.helpers`.
"""

from shoal.optim._allreduce import AllReduceState, allreduce_gradients
from shoal.optim._applying import ApplyingTransformation, update_and_apply
from shoal.optim._bfb import BFBState, bfb_allreduce
from shoal.optim._bmuf import BMUFState, bmuf
from shoal.optim._bmuf_gtc import bmuf_gtc
from shoal.optim._demo import DeMoState, demo
from shoal.optim._desloc import DESLOCState, desloc
from shoal.optim._diloco import DiLoCoState, diloco
from shoal.optim._gtc import GTCState, gtc
from shoal.optim._noise_scale import NoiseScaleState, gradient_noise_scale
from shoal.optim._noloco import NoLoCoState, noloco
from shoal.optim._nonfinite import (
    NONFINITE_POLICIES,
    NonFiniteGradientError,
    SkipNonFiniteState,
    SkipNonFiniteTransformation,
    skip_nonfinite,
)
from shoal.optim._onebit import OneBitAdamState, OneBitLambState, onebit_moments
from shoal.optim._onebit_adam import onebit_adam
from shoal.optim._onebit_lamb import onebit_lamb
from shoal.optim._overlapped_diloco import OverlappedDiLoCoState, overlapped_diloco
from shoal.optim._partial_exchange import PartialExchangeState, partial_exchange
from shoal.optim._peer_averaging import PeerAveragingState, peer_averaging
from shoal.optim._powersgd import PowerSGDState, powersgd
from shoal.optim._prefetch import PrefetchingTransformation
from shoal.optim._sma import SMAState, sma
from shoal.optim._sparseloco import sparseloco
from shoal.optim._sparta import SpartaState, sparta
from shoal.optim._streaming_diloco import StreamingDiLoCoState, streaming_diloco
from shoal.optim._topk import TopKState, topk

__all__ = [
    "AllReduceState",
    "ApplyingTransformation",
    "BFBState",
    "BMUFState",
    "DESLOCState",
    "DeMoState",
    "DiLoCoState",
    "GTCState",
    "NONFINITE_POLICIES",
    "NonFiniteGradientError",
    "NoLoCoState",
    "NoiseScaleState",
    "OneBitAdamState",
    "OneBitLambState",
    "OverlappedDiLoCoState",
    "PartialExchangeState",
    "PeerAveragingState",
    "PowerSGDState",
    "PrefetchingTransformation",
    "SMAState",
    "SkipNonFiniteState",
    "SkipNonFiniteTransformation",
    "SpartaState",
    "StreamingDiLoCoState",
    "TopKState",
    "allreduce_gradients",
    "bfb_allreduce",
    "bmuf",
    "bmuf_gtc",
    "demo",
    "desloc",
    "diloco",
    "gradient_noise_scale",
    "gtc",
    "noloco",
    "onebit_adam",
    "onebit_lamb",
    "onebit_moments",
    "overlapped_diloco",
    "partial_exchange",
    "peer_averaging",
    "powersgd",
    "skip_nonfinite",
    "sma",
    "sparseloco",
    "sparta",
    "streaming_diloco",
    "topk",
    "update_and_apply",
]
