"""Job for tests/test_presence.py: reductions over the present workers inside
``jax.shard_map`` (JAX's default checks) on 4 host devices, saved for the test to hold
against its NumPy oracle."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shoal.comms import AxisCollective
from shoal.comms.presence import present
from shoal.comms.wire import all_reduce_bytes

N = 4
WEIGHTS = np.array([2.0, 0.0, 1.0, 3.0], np.float32)


def main(out: str) -> None:
    coll = AxisCollective("workers", N)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("workers",))
    x = np.random.default_rng(0).normal(size=(N, 6)).astype(np.float32)
    k = np.arange(N * 3, dtype=np.int32).reshape(N, 3)

    def block(x, k):
        with present(coll, jnp.asarray(WEIGHTS)):
            sent, _ = all_reduce_bytes(1000, N)
            outs = [coll.all_reduce(x[0], op) for op in ("mean", "sum", "max", "min")]
            outs += [coll.all_reduce(k[0], "sum"), coll.all_reduce(k[0], "max")]
            return tuple(o[None] for o in outs) + (sent.lo[None],)

    spec = P("workers")
    f = jax.jit(jax.shard_map(block, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    names = ("mean", "sum", "max", "min", "int_sum", "int_max", "bytes")
    np.savez(out, x=x, k=k, **{n: np.asarray(v) for n, v in zip(names, f(x, k))})


if __name__ == "__main__":
    main(sys.argv[1])
