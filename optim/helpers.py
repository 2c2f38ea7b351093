"""Helpers that read or plan what a transformation does, beside the factories of
`shoal.optim`: the gradient noise scale of a monitor's state, the peers of a step of peer
averaging, the bins of partial exchange, and the error ``nonfinite="raise"`` raised inside
a compiled step.

Example:
  >>> from shoal.optim.helpers import peer_permutation
  >>> peer_permutation("round_robin", 4, 0)
  (1, 2, 3, 0)
"""

from shoal.optim._noise_scale import noise_scale
from shoal.optim._nonfinite import take_raised
from shoal.optim._partial_exchange import pgx_partition
from shoal.optim._peer_averaging import peer_permutation

__all__ = ["noise_scale", "peer_permutation", "pgx_partition", "take_raised"]
