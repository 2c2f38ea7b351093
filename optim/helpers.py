"""Helpers that read or plan what a transformation does, beside the factories of
`shoal.optim`: the gradient noise scale of a monitor's state, the peers of a step of peer
averaging, NoLoCo's pairings, the bins of partial exchange, Streaming DiLoCo's fragments, the error
``nonfinite="raise"`` raised inside a compiled step, the check that every worker
starts from the same model, the axes that let simulated workers hold rank-uniform
state once and take their local steps in turn, and which leaves are error feedback.

Example:
  >>> from shoal.optim.helpers import peer_permutation
  >>> peer_permutation("round_robin", 4, 0)
  (1, 2, 3, 0)
"""

from shoal.optim._declared import error_feedback_mask, rank_uniform_mask
from shoal.optim._noise_scale import noise_scale
from shoal.optim._noloco import pairing
from shoal.optim._nonfinite import take_raised
from shoal.optim._partial_exchange import partial_exchange_bins
from shoal.optim._peer_averaging import peer_permutation
from shoal.optim._same_model import SameModelCheck, check_same_model, same_model_check
from shoal.optim._streaming_diloco import split_fragments
from shoal.optim._turns import take_turns
from shoal.optim._uniform import hold_uniform, uniform_axes

__all__ = [
    "SameModelCheck",
    "check_same_model",
    "error_feedback_mask",
    "rank_uniform_mask",
    "hold_uniform",
    "noise_scale",
    "pairing",
    "peer_permutation",
    "partial_exchange_bins",
    "same_model_check",
    "split_fragments",
    "take_raised",
    "take_turns",
    "uniform_axes",
]
