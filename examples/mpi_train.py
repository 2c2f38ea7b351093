"""GTC on linear regression, one worker per MPI process:
mpiexec -n 2 python examples/mpi_train.py"""

import jax
import jax.numpy as jnp
import optax

from shoal.comms import MPICollective, wire_bytes
from shoal.optim import gtc

coll = MPICollective()  # a clone of MPI.COMM_WORLD: this process is one worker
N, me = coll.size, coll.process_rank  # Python ints, for host code
tx = optax.chain(gtc(0.01, collective=coll, capacity=0.25), optax.sgd(0.1))
loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)


def step(w, state, x, y):  # what one worker runs: the code of the vmap example
    updates, state = tx.update(jax.grad(loss)(w, x, y), state, w)
    return optax.apply_updates(w, updates), state


x, y = jax.random.normal(jax.random.key(0), (2, N, 32, 8))  # every rank makes all shards
x, y = x[me], y[me]  # and keeps its own: [32, 8] each
w = jnp.zeros((8, 8))  # one model per process: no leading workers axis
w = coll.broadcast(w, root=0)  # every worker starts from rank 0's model
state = tx.init(w)  # no vmap either
train = jax.jit(step)
for _ in range(3):  # three steps
    w, state = train(w, state, x, y)
print(f"rank {me}: loss {float(loss(w, x, y)):.6f}, {wire_bytes(state, 'total')}")
