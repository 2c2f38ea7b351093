"""Job for tests/test_same_model.py: `same_model_check` inside ``jax.shard_map`` (default
checks) on 8 host devices.

``python same_model.py OUT.npz`` stores, for three layouts, the check's ``worker`` and
``leaf`` on every device (``LAYOUT/same/...``: every worker holds the same model;
``LAYOUT/odd/...``: worker 2's kernel differs by one ulp in one element of its last
shard): ``flat``, 4 workers of one device; ``fsdp``, 4 workers of two devices each
(mesh ``("workers", "fsdp")``, both leaves sharded over ``"fsdp"``); ``tiers``, a 2 x 2
mesh ``("group", "member")`` checked over ``(intra, inter)``.
"""

import sys

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shoal.comms import AxisCollective
from shoal.optim.helpers import same_model_check

N = 4


def models():
    rng = np.random.default_rng(0)
    one = {"bias": rng.normal(size=(4,)), "kernel": rng.normal(size=(4, 3))}
    same = {k: np.broadcast_to(v, (N, *v.shape)).astype(np.float32) for k, v in one.items()}
    odd = {k: v.copy() for k, v in same.items()}
    odd["kernel"][2, -1, 0] = np.nextafter(odd["kernel"][2, -1, 0], np.float32(np.inf))
    return {"same": same, "odd": odd}


def per_device(check):
    # A device's block has a leading worker axis of size 1; its results gain one.
    def run(params):
        out = check(jax.tree.map(lambda a: a[0], params))
        return out.worker[None], out.leaf[None]

    return run


def layouts():
    devices = np.array(jax.devices())
    coll = AxisCollective("workers", N)
    intra, inter = AxisCollective("member", 2), AxisCollective("group", 2)
    yield "flat", Mesh(devices[:N], ("workers",)), P("workers"), P("workers"), coll
    mesh = Mesh(devices[: 2 * N].reshape(N, 2), ("workers", "fsdp"))
    yield "fsdp", mesh, P("workers", "fsdp"), P(("workers", "fsdp")), coll
    mesh = Mesh(devices[:N].reshape(2, 2), ("group", "member"))
    spec = P(("group", "member"))
    yield "tiers", mesh, spec, spec, (intra, inter)


def main(out_path: str) -> None:
    assert len(jax.devices()) >= 8, "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    out = {}
    for name, mesh, spec, out_spec, coll in layouts():
        block = per_device(lambda p, coll=coll: same_model_check(p, coll))
        mapped = jax.jit(jax.shard_map(block, mesh=mesh, in_specs=(spec,), out_specs=out_spec))
        for case, params in models().items():
            worker, leaf = mapped(params)
            out[f"{name}/{case}/worker"] = np.asarray(worker)
            out[f"{name}/{case}/leaf"] = np.asarray(leaf)
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1])
