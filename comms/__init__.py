"""shoal.comms: who talks to whom, and how many bytes cross the wire."""

from shoal.comms.agreement import check_same_structure
from shoal.comms.axis import AxisCollective
from shoal.comms.codecs import Compressor, Float32, OneBit, Quantized, TopK
from shoal.comms.collective import REDUCE_OPS, Collective, ppermute_switch, reduce_scatter
from shoal.comms.fusion import AtomicPlacement, FusionPlan, atomic_placement, plan_fusion
from shoal.comms.groups import two_tier
from shoal.comms.mpi import MPICollective
from shoal.comms.order import broadcast_order, gradient_order
from shoal.comms.recording import RecordingCollective, record_events
from shoal.comms.servers import ParameterServers, ServerStats
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
    "gradient_order",
    "plan_fusion",
    "ppermute_switch",
    "reduce_scatter",
    "record_events",
    "tree_nbytes",
    "two_tier",
    "wire_bytes",
]
