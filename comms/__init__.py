"""shoal.comms: who talks to whom, and how many bytes cross the wire."""

from shoal.comms.agreement import check_same_structure
from shoal.comms.axis import AxisCollective
from shoal.comms.collective import REDUCE_OPS, Collective, ppermute_switch, reduce_scatter
from shoal.comms.compressed import (
    OneBit,
    compressed_allreduce,
    compressed_allreduce_bytes,
    compressed_allreduce_init,
    compressed_allreduce_padded_size,
)
from shoal.comms.compressor import Compressor, Float32
from shoal.comms.fusion import AtomicPlacement, FusionPlan, atomic_placement, plan_fusion
from shoal.comms.groups import two_tier
from shoal.comms.mpi import MPICollective
from shoal.comms.order import broadcast_order, gradient_order
from shoal.comms.quantized import (
    Quantized,
    quantized_allreduce,
    quantized_allreduce_bytes,
    quantized_allreduce_init,
    quantized_allreduce_padded_size,
)
from shoal.comms.recording import RecordingCollective, record_events
from shoal.comms.servers import ParameterServers, ServerStats
from shoal.comms.topk import TopK
from shoal.comms.wire import ByteCount, WireCount, WireMeter, tree_nbytes, wire_bytes

__all__ = [
    "REDUCE_OPS",
    "AtomicPlacement",
    "AxisCollective",
    "ByteCount",
    "Collective",
    "Compressor",
    "Float32",
    "FusionPlan",
    "MPICollective",
    "OneBit",
    "ParameterServers",
    "Quantized",
    "RecordingCollective",
    "ServerStats",
    "TopK",
    "WireCount",
    "WireMeter",
    "atomic_placement",
    "broadcast_order",
    "check_same_structure",
    "compressed_allreduce",
    "compressed_allreduce_bytes",
    "compressed_allreduce_init",
    "compressed_allreduce_padded_size",
    "gradient_order",
    "plan_fusion",
    "ppermute_switch",
    "reduce_scatter",
    "quantized_allreduce",
    "quantized_allreduce_bytes",
    "quantized_allreduce_init",
    "quantized_allreduce_padded_size",
    "record_events",
    "tree_nbytes",
    "two_tier",
    "wire_bytes",
]
