"""Benchmark: Herring's balanced-fusion-buffer all-reduce (`bfb_allreduce`), colocated
(mode 1) and with dedicated parameter servers (mode 2), against
`MPICollective.all_reduce`, side by side on one transformer-like gradient pytree.

Usage: ``.venv/bin/mpiexec -n 6 .venv/bin/python benchmarks/bfb_allreduce.py
[--servers 2] [--mb 64] [--reps 10] [--buffer-mb 2] [--fused]``

The last ``--servers`` ranks are parameter servers (they sit in `ParameterServers.serve`
for the whole run); the other ``W`` ranks are workers. All-reduce and mode 1 run over the
workers' communicator (`ParameterServers.workers`), mode 2 through the servers. Every
variant is jitted once and warmed up, then the variants are timed in turn (A B C A B C
...) so machine noise hits them alike. Each rep starts after a barrier of the workers; a
rep's time is the slowest worker's. Bytes per worker come from each transformation's
`WireCount` (all-reduce: the ring count ``2 (W-1)/W n`` of every leaf); bytes per server
from the `ServerStats` every server returns, gathered to rank 0 at the end and checked
against the plan. The results of all variants are checked once against each other and
against the exact mean. ``--fused`` adds a fourth reference: `MPICollective.all_reduce`
of the same fusion buffers (fuse, one all-reduce per buffer, unfuse). Without mpiexec, or
with too few ranks, the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

D_MODEL = 256
SEQ = 512


def transformer_shapes(total_elements: int) -> dict:
    """A GPT-like parameter pytree of about ``total_elements`` float32 values: layers of
    width ``D_MODEL`` (12 leaves each: fused QKV, output projection, MLP, two layer norms;
    narrower for small totals) plus positional and token embeddings, the token embedding
    sized to make up the rest."""
    d = D_MODEL
    while d > 16 and 13 * d * d > 0.75 * total_elements:
        d //= 2
    layer = {
        "ln1": {"scale": (d,), "bias": (d,)},
        "attn": {"qkv": (d, 3 * d), "qkv_bias": (3 * d,), "out": (d, d), "out_bias": (d,)},
        "ln2": {"scale": (d,), "bias": (d,)},
        "mlp": {"up": (d, 4 * d), "up_bias": (4 * d,), "down": (4 * d, d), "down_bias": (d,)},
    }
    per_layer = sum(math.prod(s) for s in jax.tree.leaves(layer, is_leaf=_is_shape))
    # About three quarters in the layers, the rest in the embeddings (as in a small GPT).
    layers = max(1, int(0.75 * total_elements // per_layer))
    rest = total_elements - layers * per_layer - 2 * d - SEQ * d
    vocab = max(1, rest // d)
    return {
        "embed": {"tokens": (vocab, d), "positions": (SEQ, d)},
        "layers": [layer] * layers,
        "ln_f": {"scale": (d,), "bias": (d,)},
    }


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def make_grads(shapes: dict, rank: int) -> dict:
    """Worker ``rank``'s gradient: ``(rank + 1) * x`` with ``x`` the same standard-normal
    draw on every worker, so the mean over ``W`` workers is exactly ``(W + 1) / 2 * x``."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    rng = np.random.default_rng(0)
    out = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * (rank + 1)) for s in leaves]
    return jax.tree.unflatten(treedef, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2, help="parameter-server ranks (S)")
    parser.add_argument("--mb", type=float, default=64.0, help="gradient size in MiB")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per variant")
    parser.add_argument(
        "--buffer-mb",
        type=float,
        default=2.0,
        help="an explicit buffer size (MiB) timed besides the automatic one (for 64 MiB "
        "the automatic size is 8 MiB); 0, or the automatic size: skip it",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="also time MPICollective.all_reduce of mode 1's automatic fusion buffers (fuse, "
        "one all-reduce per buffer, unfuse): separates the gain of fusing from the "
        "reduce-scatter + all-gather",
    )
    args = parser.parse_args()
    name = "bfb_allreduce benchmark"
    command = ".venv/bin/mpiexec -n 6 .venv/bin/python benchmarks/bfb_allreduce.py"

    try:
        from mpi4py import MPI
    except ImportError:
        print(f"{name}: mpi4py is not installed, skipped")
        return
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    if size < args.servers + 2:
        if rank == 0:
            print(
                f"{name}: skipped, {size} rank(s) cannot hold {args.servers} server(s) and at "
                f"least 2 workers; run it with `{command}`"
            )
        return

    from shoal.comms import ParameterServers, plan_fusion
    from shoal.comms.wire import all_reduce_bytes
    from shoal.optim import bfb_allreduce
    from shoal.optim._bfb import server_bytes_per_step

    load_start = os.getloadavg()[0]
    ps = ParameterServers(args.servers)
    shapes = transformer_shapes(int(args.mb * 2**20) // 4)
    if ps.is_server:
        stats = ps.serve(timeout=600)
        world.gather(tuple(stats), root=0)
        return

    coll = ps.workers
    comm = coll.comm
    w = coll.size
    grads = make_grads(shapes, coll._rank)
    leaves = jax.tree.leaves(grads)
    n_bytes = sum(x.nbytes for x in leaves)

    buffer_sizes = [None]
    explicit = int(args.buffer_mb * 2**20)
    auto = {plan_fusion(grads, num_shards=k).buffer_bytes[0] for k in (w, ps.num_servers)}
    if explicit > 0 and explicit not in auto:
        buffer_sizes.append(explicit)

    # name -> (jitted step returning (mean tree, wire bytes sent, received), buffer, servers?)
    variants: dict[str, tuple] = {}
    all_reduce = jax.jit(lambda g: coll.all_reduce(g, "mean"))
    ar_bytes = sum(all_reduce_bytes(x.nbytes, w)[0] for x in leaves)
    variants["all_reduce"] = (lambda g: (all_reduce(g), ar_bytes, ar_bytes), None, False)
    if args.fused:
        fplan = plan_fusion(grads, num_shards=w)
        fused = jax.jit(lambda g: fplan.unfuse([coll.all_reduce(b, "mean") for b in fplan.fuse(g)]))
        f_bytes = sum(all_reduce_bytes(b, w)[0] for b in fplan.buffer_bytes)
        variants["all_reduce (fused)"] = (lambda g: (fused(g), f_bytes, f_bytes), None, False)
    for buf in buffer_sizes:
        for mode, servers in (("mode 1", None), ("mode 2", ps)):
            tx = bfb_allreduce(collective=coll, buffer_bytes=buf, servers=servers)
            step = jax.jit(lambda g, tx=tx: tx.update(g, tx.init(g)))

            def run(g, step=step):
                u, state = step(g)
                return u, state.wire.step.sent, state.wire.step.received

            label = f"{mode} ({'auto' if buf is None else f'{buf / 2**20:g} MiB'})"
            variants[label] = (run, buf, servers is not None)

    # Compile, warm up, and check every variant once against the exact mean.
    calls = dict.fromkeys(variants, 0)
    want = [np.asarray(x) * ((w + 1) / 2 / (coll._rank + 1)) for x in leaves]
    wire = {}
    compile_s = {}
    for label, (run, _, _) in variants.items():
        start = time.perf_counter()
        u, sent, received = jax.block_until_ready(run(grads))
        compile_s[label] = time.perf_counter() - start
        calls[label] += 1
        wire[label] = (int(sent), int(received))
        for got, exp in zip(jax.tree.leaves(u), want):
            np.testing.assert_allclose(np.asarray(got), exp, rtol=1e-5, atol=1e-5)
        if label != "all_reduce":
            ref = jax.tree.leaves(variants["all_reduce"][0](grads)[0])
            calls["all_reduce"] += 1
            for got, exp in zip(jax.tree.leaves(u), ref):
                np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-5, atol=1e-6)
        del u
    for label, (run, _, _) in variants.items():  # a second warm-up, past first-touch costs
        jax.block_until_ready(run(grads))
        calls[label] += 1

    def timed(run) -> float:
        comm.Barrier()
        start = time.perf_counter()
        jax.block_until_ready(run(grads)[0])
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    times = {label: [] for label in variants}
    t0 = time.perf_counter()
    for _ in range(args.reps):
        for label, (run, _, _) in variants.items():
            times[label].append(timed(run))
            calls[label] += 1
    timing_s = time.perf_counter() - t0

    ps.shutdown()
    stats = world.gather(None, root=0)
    if coll._rank != 0:
        return

    # What each server should have moved: one shard of every buffer from every worker,
    # per call of a mode-2 variant.
    servers_stats = [s for s in stats if s is not None]
    per_server = {}
    expect = want_steps = want_buffers = 0
    for label, (_, buf, dedicated) in variants.items():
        if dedicated:
            plan = plan_fusion(grads, buffer_bytes=buf, num_shards=ps.num_servers)
            per_server[label] = server_bytes_per_step(plan, w)
            expect += calls[label] * per_server[label]
            want_steps += calls[label]
            want_buffers += calls[label] * plan.num_buffers
    for s in servers_stats:
        steps, buffers, received, sent = s
        assert (steps, buffers) == (want_steps, want_buffers), (s, want_steps, want_buffers)
        assert received == sent == expect, (s, expect)

    ar = np.asarray(times["all_reduce"])
    load = f"{load_start:.1f} - {os.getloadavg()[0]:.1f}"
    print(f"## {name}: W = {w} workers + S = {ps.num_servers} servers")
    print()
    print(
        f"Gradient: {len(leaves)} float32 leaves, {n_bytes:,} bytes ({n_bytes / 2**20:.1f} MiB), "
        f"largest leaf {max(x.nbytes for x in leaves) / 2**20:.1f} MiB, smallest "
        f"{min(x.nbytes for x in leaves)} B. Machine: {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), jax {jax.__version__}, "
        f"{size} MPI ranks, load {load} (1-min average, start - end). Median of {args.reps} reps, "
        f"interleaved; ratio = variant / all_reduce (lower is faster). "
        f"Timing loop {timing_s:.0f} s."
    )
    print()
    print(
        "| variant | buffers | median ms | min - max ms | ratio of medians | "
        "median paired ratio | sent / worker | received / worker | per server (each way) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, (_, buf, dedicated) in variants.items():
        t = np.asarray(times[label])
        if label == "all_reduce":
            nbuf = f"{len(leaves)} leaves"
        elif label == "all_reduce (fused)":
            nbuf = f"{fplan.num_buffers} x {fplan.buffer_bytes[0] / 2**20:.1f} MiB"
        else:
            shards = ps.num_servers if dedicated else w
            plan = plan_fusion(grads, buffer_bytes=buf, num_shards=shards)
            nbuf = f"{plan.num_buffers} x {plan.buffer_bytes[0] / 2**20:.1f} MiB"
        sent, received = wire[label]
        srv = f"{per_server[label]:,}" if dedicated else "-"
        print(
            f"| {label} | {nbuf} | {np.median(t) * 1e3:.1f} | "
            f"{t.min() * 1e3:.1f} - {t.max() * 1e3:.1f} | {np.median(t) / np.median(ar):.2f} | "
            f"{np.median(t / ar):.2f} | {sent:,} | {received:,} | {srv} |"
        )
    print()
    total_steps = sum(s[0] for s in servers_stats)
    print(
        f"Servers: {len(servers_stats)} x ServerStats, {total_steps} steps in all, each "
        f"received = sent = {servers_stats[0][2]:,} bytes (= the plan's bytes per step x calls, "
        "checked). All variants agree with the exact mean (allclose, checked on every worker)."
    )
    print(
        "First call (compile + run), s: " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items())
    )


if __name__ == "__main__":
    try:
        main()
    except Exception:
        # One failed rank must not leave the others (or the servers) waiting.
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
