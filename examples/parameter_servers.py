"""Herring's balanced fusion buffers through dedicated parameter servers: the last 2 ranks
serve, the others are the workers.
mpiexec -n 4 python examples/parameter_servers.py"""

import jax
import jax.numpy as jnp
import optax

from shoal.comms import ParameterServers, wire_bytes
from shoal.optim import bfb_allreduce, skip_nonfinite

ps = ParameterServers(2)  # collective: every rank constructs it
if ps.is_server:
    stats = ps.serve()  # sums the workers' shards until worker 0 shuts the servers down
    print(f"server: {stats.steps} steps, {stats.received} bytes received")
else:
    coll = ps.workers  # the workers alone: an MPICollective of W = size - 2 ranks
    tx = optax.chain(bfb_allreduce(collective=coll, servers=ps), optax.sgd(0.1))
    tx = skip_nonfinite(tx, collective=coll)  # the non-finite flag: among the workers only
    loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)

    def step(w, state, x, y):
        updates, state = tx.update(jax.grad(loss)(w, x, y), state, w)
        return optax.apply_updates(w, updates), state

    x, y = jax.random.normal(jax.random.key(0), (2, coll.size, 32, 8))
    x, y = x[coll.process_rank], y[coll.process_rank]  # this worker's shard
    w = coll.broadcast(jnp.zeros((8, 8)), root=0)
    state = tx.init(w)
    train = jax.jit(step)
    for _ in range(3):
        w, state = train(w, state, x, y)
    print(f"worker {coll.process_rank}: loss {float(loss(w, x, y)):.6f}, "
          f"{wire_bytes(state, 'total')}")  # fmt: skip
    ps.shutdown()  # every worker calls it; worker 0 tells the servers to stop
