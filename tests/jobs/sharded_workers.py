"""Job for tests/test_shard_map.py: workers that span several devices.

``python sharded_workers.py OUT.npz`` on 8 host devices: a mesh ``("workers", "fsdp")``
of 2 x 4 and of 4 x 2 devices, every leaf of a worker sharded over ``"fsdp"`` (the
``_mixed`` cases add a leaf replicated over it). Each case trains 6 steps inside
``jax.shard_map`` (default checks) and stores the final params, and the noise scale
where there is one (``CASE/WxK/mesh/i``), beside its reference (``CASE/WxK/ref/i``):
the same run with one device per worker (``vmap`` over whole leaves), or, for 1-bit
Adam's compressed stage, which compresses each shard on its own, the one-device run of
each shard. A refused case stores ``CASE/WxK/error``.
"""

import sys
import traceback

import jax
import jax.numpy as jnp
import mesh_cases  # the same trainer and per-device block (this folder is on sys.path)
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shoal import optim
from shoal.comms import AxisCollective
from shoal.optim import helpers

STEPS = 6
LAYOUTS = ((2, 4), (4, 2))
SHAPES = {"v": (8, 4), "w": (16, 6)}  # sharded over "fsdp" along their first axis
sgd = optax.sgd(0.1)

CASES = {
    "ssgd": lambda c: optax.chain(optim.allreduce_gradients(collective=c), sgd),
    "bmuf": lambda c: optim.bmuf(sgd, collective=c, block_size=2, warmup_steps=1),
    "sma": lambda c: optim.sma(sgd, collective=c),
    "peer_averaging": lambda c: optim.peer_averaging(sgd, collective=c),
    "gtc": lambda c: optax.chain(optim.gtc(0.05, collective=c, capacity=1.0), sgd),
    "bfb_allreduce": lambda c: optax.chain(optim.bfb_allreduce(collective=c, buffer_bytes=64), sgd),
    "partial_exchange": lambda c: optax.chain(optim.partial_exchange(0.75, collective=c), sgd),
    "noise_scale": lambda c: optax.chain(
        optim.gradient_noise_scale(collective=c, local_batch_size=8), sgd
    ),
    # Warm-up stage only (uncompressed): the same arithmetic as one device per worker.
    "onebit_adam_warmup": lambda c: optim.onebit_adam(0.01, collective=c, freeze_step=100),
    "onebit_lamb_warmup": lambda c: optim.onebit_lamb(0.01, collective=c, freeze_step=100),
    # Compressed from step 3: each device compresses its own shard.
    "onebit_adam": lambda c: optim.onebit_adam(0.01, collective=c, freeze_step=2),
    "onebit_lamb": lambda c: optim.onebit_lamb(0.01, collective=c, freeze_step=2),
}
for _name in ("ssgd", "gtc", "bmuf"):
    # A NaN in one shard of one worker at step 2: the wrapper skips it on every worker.
    CASES[_name + "_nan"] = lambda c, make=CASES[_name]: optim.skip_nonfinite(make(c), collective=c)
CASES["ssgd_mixed"] = CASES["ssgd"]
CASES["noise_scale_mixed"] = CASES["noise_scale"]  # norms of sharded and replicated leaves
CASES["gtc_mixed"] = CASES["gtc"]  # refused: a fused buffer of sharded and replicated leaves
PER_SHARD = {"onebit_adam"}  # reference: each shard on its own
SAME_START = {"onebit_lamb"}  # every worker starts from the same params (checked: stay equal)


def data(case, workers):
    rng = np.random.default_rng(1)
    shapes = dict(SHAPES, **({"b": (6,)} if case.endswith("_mixed") else {}))
    params = {k: rng.normal(size=(workers, *s)).astype(np.float32) for k, s in shapes.items()}
    if case in SAME_START:
        params = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in params.items()}
    grads = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
        for _ in range(STEPS)
    ]
    if case.endswith("_nan"):
        grads[2]["w"][1, -1, 0] = np.nan  # the last fsdp shard of worker 1
    return params, grads


def trainer(tx):
    """`mesh_cases.trainer`, final params only (a sharded state has no single out-spec),
    and the noise scale where there is one (a whole worker's: the same on its devices)."""
    train = mesh_cases.trainer(tx)

    def run(params, grads):
        params, state = train(params, grads)
        scale = helpers.noise_scale(state)
        return params if scale is None else {**params, "noise_scale": scale}

    return run


def on_mesh(case, workers, shards, params, grads):
    mesh = Mesh(np.array(jax.devices()[: workers * shards]).reshape(workers, shards),
                ("workers", "fsdp"))  # fmt: skip
    coll = AxisCollective("workers", workers)
    spec = {k: P("workers", "fsdp") if k in SHAPES else P("workers") for k in params}
    out_spec = {**spec, "noise_scale": P("workers")} if case.startswith("noise") else spec
    # A device's block of each leaf: [1, rows / shards, ...].
    block = mesh_cases.per_worker(trainer(CASES[case](coll)))
    mapped = jax.shard_map(block, mesh=mesh, in_specs=(spec, [spec] * STEPS), out_specs=out_spec)
    return jax.jit(mapped)(params, grads)


def one_device_per_worker(case, workers, params, grads):
    coll = AxisCollective("workers", workers)
    return jax.jit(jax.vmap(trainer(CASES[case](coll)), axis_name="workers"))(params, grads)


def per_shard(case, workers, shards, params, grads):
    split = lambda t, k: {n: np.split(a, shards, axis=1)[k] for n, a in t.items()}
    runs = [
        one_device_per_worker(case, workers, split(params, k), [split(g, k) for g in grads])
        for k in range(shards)
    ]
    return {n: jnp.concatenate([r[n] for r in runs], axis=1) for n in params}


def main(out_path: str) -> None:
    assert len(jax.devices()) >= 8, "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    out = {}
    for workers, shards in LAYOUTS:
        for case in CASES:
            key = f"{case}/{workers}x{shards}"
            params, grads = data(case, workers)
            try:
                mesh = on_mesh(case, workers, shards, params, grads)
                if case in PER_SHARD:
                    ref = per_shard(case, workers, shards, params, grads)
                else:
                    ref = one_device_per_worker(case, workers, params, grads)
                for i, (a, b) in enumerate(zip(jax.tree.leaves(mesh), jax.tree.leaves(ref))):
                    out[f"{key}/mesh/{i}"] = np.asarray(a)
                    out[f"{key}/ref/{i}"] = np.asarray(b)
            except Exception:
                out[f"{key}/error"] = np.asarray(traceback.format_exc())
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
