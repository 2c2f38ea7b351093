"""MPI job for tests/test_agreement.py: workers whose parameters differ are refused at
init, on every rank, with the first differing leaf named (not a hang)."""

import sys

import jax
import jax.numpy as jnp
from mpi4py import MPI

from shoal.comms import MPICollective
from shoal.optim import allreduce_gradients, gtc

rank = MPI.COMM_WORLD.Get_rank()
coll = MPICollective()
width = 3 if rank == 0 else 4  # worker 1 built a different model
params = {"a": jnp.zeros((2,)), "b": jnp.zeros((width,)), "c": jnp.zeros((5,))}
dtype_params = {"a": jnp.zeros((2,)), "b": jnp.zeros((3,), jnp.float16 if rank else jnp.float32)}

for make, p, want in [
    (lambda: allreduce_gradients(collective=coll), params, "shape (4,)"),
    (lambda: gtc(0.1, collective=coll), params, "shape (4,)"),  # jitted init below
    (lambda: allreduce_gradients(collective=coll), dtype_params, "float16"),
]:
    tx = make()
    try:
        jax.jit(tx.init)(p)
    except ValueError as e:
        msg = str(e)
        assert "['b']" in msg and "worker 1" in msg and want in msg, msg
    else:
        print(f"rank {rank}: no error", file=sys.stderr)
        MPI.COMM_WORLD.Abort(1)
# One file per rank: mpiexec may interleave the ranks' stdout.
with open(f"{sys.argv[1]}/refused.{rank}", "w") as f:
    f.write(msg)
