"""Job for tests/test_shard_map.py: every transformation of `shoal.optim` inside
``jax.shard_map`` with JAX's default checks (``check_vma=True``), against the same run
under ``vmap``.

``python mesh_cases.py OUT.npz`` needs 8 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before jax starts). For every
case it trains 7 steps on 4 workers (flat: a mesh axis ``"workers"``; two-tier: a 2 x 2
mesh ``("group", "member")``) and stores the final params and state of both engines
(``CASE/vmap/i``, ``CASE/mesh/i``; 1-bit Adam/LAMB's moments whole), or ``CASE/error``
with the exception's text.
"""

import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shoal import optim, vma
from shoal.comms import AxisCollective, Quantized, TopK

N = 4
STEPS = 7
BAD = (3, 1)  # (step, worker) of the NaN in the "_nan" cases

coll = AxisCollective("workers", N)
intra, inter = coll.split(2)
sgd = optax.sgd(0.1)

FLAT = {
    "ssgd": lambda: optax.chain(optim.allreduce_gradients(collective=coll), sgd),
    "ssgd_raise": lambda: optim.skip_nonfinite(
        optax.chain(optim.allreduce_gradients(collective=coll), sgd),
        collective=coll,
        nonfinite="raise",
    ),
    "gtc": lambda: optax.chain(optim.gtc(0.05, collective=coll), sgd),
    "bmuf": lambda: optim.bmuf(sgd, collective=coll, block_size=3, warmup_steps=2),
    "bfb_allreduce": lambda: optax.chain(
        optim.bfb_allreduce(collective=coll, buffer_bytes=64), sgd
    ),
    "partial_exchange": lambda: optax.chain(optim.partial_exchange(0.9, collective=coll), sgd),
    "peer_averaging": lambda: optim.peer_averaging(sgd, collective=coll),
    "sma": lambda: optim.sma(sgd, collective=coll),
    "onebit_lamb": lambda: optim.onebit_lamb(0.01, collective=coll, freeze_step=3),
    "onebit_adam": lambda: optim.onebit_adam(0.01, collective=coll, freeze_step=3),
    "noise_scale": lambda: optax.chain(
        optim.gradient_noise_scale(collective=coll, local_batch_size=8), sgd
    ),
    "skip_nonfinite": lambda: optim.skip_nonfinite(
        optax.chain(optim.allreduce_gradients(collective=coll), sgd), collective=coll
    ),
    "desloc": lambda: optim.desloc(0.01, collective=coll, sync_every=2, moment_every=3),
    "diloco": lambda: optim.diloco(sgd, collective=coll, sync_every=3, outer=optax.sgd(0.7)),
    "diloco_fp4": lambda: optim.diloco(
        sgd, collective=coll, sync_every=3, outer=optax.sgd(0.7), exchange=Quantized("fp4", 8)
    ),
    "streaming_diloco": lambda: optim.streaming_diloco(
        sgd,
        collective=coll,
        sync_every=4,
        outer=optax.sgd(0.7),
        num_fragments=2,
        overlap=1,
        exchange=TopK(fraction=0.5, chunk_size=4),
    ),
    "noloco": lambda: optim.noloco(sgd, collective=coll, sync_every=2, gamma=0.3),
    "overlapped_diloco": lambda: optim.overlapped_diloco(
        sgd, collective=coll, sync_every=3, outer=optax.sgd(0.7, momentum=0.9)
    ),
    "overlapped_delayed": lambda: optim.overlapped_diloco(
        sgd, collective=coll, sync_every=2, outer=optax.sgd(0.7), variant="delayed"
    ),
    "sparseloco": lambda: optim.sparseloco(
        sgd, collective=coll, sync_every=3, beta=0.9, density=0.25, chunk_size=8
    ),
    "sparta": lambda: optim.sparta(sgd, collective=coll, fraction=0.2),
    "sparta_diloco": lambda: optim.sparta(
        optim.diloco(sgd, collective=coll, sync_every=3, outer=optax.sgd(0.7)),
        collective=coll,
        fraction=0.1,
    ),
    "topk": lambda: optax.chain(optim.topk(0.25, collective=coll, chunk_size=4), sgd),
    "powersgd": lambda: optax.chain(optim.powersgd(2, collective=coll, min_compression=1.0), sgd),
    "demo": lambda: optax.chain(optim.demo(collective=coll, chunk_size=4, topk=3), sgd),
}
# A NaN in one worker's gradient, in skip_nonfinite: every way it skips (a select, an
# in-place branch for BMUF and DiLoCo) runs under shard_map's checks.
for _name in ("ssgd", "gtc", "bmuf", "onebit_lamb", "diloco", "powersgd"):
    FLAT[_name + "_nan"] = lambda make=FLAT[_name]: optim.skip_nonfinite(make(), collective=coll)
TIERS = {
    "bmuf_gtc": lambda: optim.bmuf_gtc(sgd, intra=intra, inter=inter, block_size=3, threshold=0.05),
    "bfb_two_tier": lambda: optax.chain(
        optim.bfb_allreduce(collective=inter, intra=intra, buffer_bytes=64), sgd
    ),
    "gtc_skip_two_tier": lambda: optim.skip_nonfinite(
        optax.chain(optim.gtc(0.05, collective=inter), sgd), collective=(intra, inter)
    ),
}
TIERS["bmuf_gtc_nan"] = lambda: optim.skip_nonfinite(TIERS["bmuf_gtc"](), collective=(intra, inter))


def data(nan: bool):
    rng = np.random.default_rng(0)
    params = {
        "w": rng.normal(size=(N, 6, 5)).astype(np.float32),
        "b": rng.normal(size=(N, 5)).astype(np.float32),
    }
    grads = [
        jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
        for _ in range(STEPS)
    ]
    if nan:
        step, worker = BAD
        grads[step]["w"][worker, 2, 3] = np.nan
    return params, grads


def trainer(tx):
    """Train on a list of gradients, one step each, in a ``lax.scan``: a step is compiled
    once, not once per step."""

    def step(carry, g):
        params, state = carry
        updates, state = tx.update(g, state, params)
        new = (optax.apply_updates(params, updates), state)
        return jax.tree.map(lambda n, o: jnp.asarray(n, o.dtype), new, carry)

    def train(params, grads):
        carry = (params, tx.init(params))
        stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
        # Under shard_map the carry must vary over the same mesh axes in every step: widen
        # it to what a step makes of it (a no-op under vmap).
        first = jax.tree.map(lambda a: a[0], stacked)
        axes = vma.joint(carry, jax.eval_shape(step, carry, first))
        while vma.joint(widened := vma.vary_as(carry, axes)) != vma.joint(carry):
            carry = widened
            axes = vma.joint(carry, jax.eval_shape(step, carry, first))
        carry, _ = lax.scan(lambda c, g: (vma.vary_as(step(c, g), axes), None), carry, stacked)
        return carry

    return train


ONEBIT = (optim.OneBitAdamState, optim.OneBitLambState)


def whole_moments(train):
    """``train`` returning 1-bit Adam/LAMB's moments whole (over `coll`): simulated workers
    hold one chunk of them each, devices the whole (`shoal.optim._held.Held`)."""

    def whole(s, params):
        if not isinstance(s, ONEBIT):
            return s
        return s._replace(**optim.onebit_moments(s, params, collective=coll))

    def run(params, grads):
        params, state = train(params, grads)
        onebit = lambda s: isinstance(s, ONEBIT)
        return params, jax.tree.map(lambda s: whole(s, params), state, is_leaf=onebit)

    return run


def per_worker(fn):
    # A shard of P("workers") is one worker's block: a leading axis of size 1.
    def run(*args):
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

    return run


def engines(two_tier: bool):
    devices = np.array(jax.devices()[:N])
    if not two_tier:
        mesh = Mesh(devices, ("workers",))
        spec = P("workers")
        vmapped = lambda f: jax.vmap(f, axis_name="workers")
    else:
        mesh = Mesh(devices.reshape(2, 2), ("group", "member"))
        spec = P(("group", "member"))

        def vmapped(f):
            nested = jax.vmap(jax.vmap(f, axis_name="member"), axis_name="group")

            def run(*args):
                out = nested(*jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), args))
                return jax.tree.map(lambda a: a.reshape(N, *a.shape[2:]), out)

            return run

    # shard_map as a user writes it: JAX's default checks, nothing turned off.
    mapped = lambda f: jax.shard_map(per_worker(f), mesh=mesh, in_specs=spec, out_specs=spec)
    return {"vmap": vmapped, "mesh": mapped}


def main(out_path: str) -> None:
    assert len(jax.devices()) >= 8, "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    out = {}
    for two_tier, cases in ((False, FLAT), (True, TIERS)):
        for name, make in cases.items():
            params, grads = data(name.endswith("_nan"))
            try:
                for engine, wrap in engines(two_tier).items():
                    result = jax.jit(wrap(whole_moments(trainer(make()))))(params, grads)
                    for i, leaf in enumerate(jax.tree.leaves(result)):
                        out[f"{name}/{engine}/{i}"] = np.asarray(leaf)
            except Exception:  # reported by the test that owns the case
                out[f"{name}/error"] = np.asarray(traceback.format_exc())
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
