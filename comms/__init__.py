"""shoal.comms: who talks to whom, and how many bytes cross the wire."""

from shoal.comms.axis import AxisCollective
from shoal.comms.collective import REDUCE_OPS, Collective
from shoal.comms.compressed import (
    compressed_allreduce,
    compressed_allreduce_bytes,
    compressed_allreduce_init,
    compressed_allreduce_padded_size,
)
from shoal.comms.groups import two_tier
from shoal.comms.mpi import MPICollective
from shoal.comms.wire import WireCount, tree_nbytes, wire_bytes

__all__ = [
    "REDUCE_OPS",
    "AxisCollective",
    "Collective",
    "MPICollective",
    "WireCount",
    "compressed_allreduce",
    "compressed_allreduce_bytes",
    "compressed_allreduce_init",
    "compressed_allreduce_padded_size",
    "tree_nbytes",
    "two_tier",
    "wire_bytes",
]
