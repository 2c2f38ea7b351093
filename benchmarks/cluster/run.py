"""Measured, not projected: end-to-end step times on a shaped network of namespaces.

Usage (as root): ``.venv/bin/python benchmarks/cluster/run.py [--hosts 4] [--rate-mbit 1000]
[--steps 30] [--tiny] [--no-write]`` (``make bench-cluster``).

Inside one `netns.ShapedNetwork` (H hosts, each link shaped by tbf both ways):

a. `probe.py`: the rate of a timed MPI transfer and each rank's namespace; an MPI
   ping-pong of 1 byte gives the link's latency (the natural veth one: no netem here);
b. ``benchmarks/mpi_allreduce.py`` (float32 against shoal's compressed all-reduce);
c. ``shoal-run --backend mpi`` of the quickstart's algorithms, one rank per host, on a
   wider MLP (``--hidden``, 4.3M parameters by default), plus ``local``: BMUF with one
   block over the whole run, whose timed steps exchange nothing (the compute time);
d. the same for ``--backend jax`` (gloo over TCP) for a few algorithms;
e. the cost model (`shoal.costmodel.Cluster` of the shaped network) on the same runs'
   recorded collectives (`shoal.comms.record_events`), against the measurement; a
   reference run of every algorithm on an unthrottled network of namespaces (the same
   jobs with tbf at 100 Gbit/s) separates an algorithm's own compute from its network time;
f. a markdown table, written to BENCHMARKS.md between ``<!-- bench:cluster:start -->``
   and ``<!-- bench:cluster:end -->`` (unless ``--no-write``).

Measured ms/step: the mean of the per-step wall times in ``timing.jsonl`` over the timed
steps, ``--first-timed`` to ``steps - 1`` (whole BMUF/DiLoCo periods: a median would
miss their sync steps; the first steps compile, the last one evaluates). ``--tiny``: 2
hosts, a small MLP, 4 steps, ssgd and gtc only, no jax, no reference (for the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from netns import MPICH_ENV, ShapedNetwork, Unavailable, check_available  # noqa: E402

BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
SHOAL_RUN = BIN / "shoal-run"
CONFIG = ROOT / "experiments" / "configs" / "quickstart.py"
MARK = "cluster"
SECTION = "## cluster (measured on a shaped network of namespaces)"
REF_RATE_MBIT = 100_000  # the reference network: tbf far above what veth carries here

DEFAULT_ALGORITHMS = ("ssgd", "gtc", "bmuf", "lamb", "onebit_lamb", "diloco",
                      "streaming_diloco", "topk", "powersgd", "demo")  # fmt: skip
JAX_ALGORITHMS = ("ssgd", "gtc", "onebit_lamb")
TARGETS = ("gtc", "bmuf", "onebit_lamb")  # the issue's: >= half the projected speed-up

PING = r"""
import json, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
r = comm.Get_rank()
buf = np.zeros(1, np.uint8)
out = []
for rep in range(3):
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(500):
        if r == 0:
            comm.Send(buf, dest=1); comm.Recv(buf, source=1)
        elif r == 1:
            comm.Recv(buf, source=0); comm.Send(buf, dest=0)
    out.append((time.perf_counter() - t) / 1000)
if r == 0:
    print(json.dumps({"one_way_s": min(out[1:])}))
"""


class JobFailed(RuntimeError):
    pass


_CURRENT: list[subprocess.Popen] = []


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_in_hosts(net: ShapedNetwork) -> None:
    """Processes still running inside the network's namespaces (ranks this script started,
    found by their namespace): end them by id."""
    for name in net.names:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def job(cmd: list[str], timeout: float, env: dict | None = None, log: Path | None = None) -> str:
    """Run ``cmd`` in a session of its own; its stdout, or `JobFailed` with its tail."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, start_new_session=True,
    )  # fmt: skip
    _CURRENT.append(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out = proc.communicate()[0] if proc.stdout else ""
        raise JobFailed(f"timed out after {timeout:.0f} s: {_show(cmd)}\n{_tail(out)}") from None
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        _CURRENT.remove(proc)
    if log is not None:
        log.write_text(out)
    if proc.returncode != 0:
        raise JobFailed(f"exit code {proc.returncode}: {_show(cmd)}\n{_tail(out)}")
    return out


def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _show(cmd: list[str]) -> str:
    prefix = f"{ROOT}{os.sep}"
    return shlex.join(w[len(prefix) :] if w.startswith(prefix) else w for w in cmd)


def mpi(net: ShapedNetwork, ranks: int, *cmd: str) -> list[str]:
    return [str(MPIEXEC), *net.mpiexec_args(), "-n", str(ranks), *cmd]


@dataclasses.dataclass
class Setup:
    hosts: int
    rate_mbit: float
    steps: int
    first_timed: int
    hidden: str
    algorithms: tuple[str, ...]
    jax_algorithms: tuple[str, ...]
    allreduce_n: int
    reference: bool
    timeout: float
    out: Path

    @property
    def local(self) -> str:
        """BMUF with one block over the whole run: its timed steps exchange nothing."""
        return f"bmuf[block_size={self.steps}]"

    def overrides(self, algorithms: tuple[str, ...]) -> list[str]:
        return [
            f"algorithms={','.join(algorithms)}",
            f"steps={self.steps}",
            f"eval_every={self.steps}",
            f"hidden={self.hidden}",
            "project_workers=0",
            # GTC at 1% density (gtc and bmuf_gtc): capacity 1% of the parameters, and a
            # threshold low enough to fill it (0.1 leaves ~0.15% here; the bytes sent are
            # the capacity's anyway).
            *each(("gtc", "bmuf_gtc"), "capacity", 0.01),
            *each(("gtc", "bmuf_gtc"), "threshold", 0.01),
            *each(("bmuf", "bmuf_gtc"), "block_size", 10),
            *each(("diloco", "streaming_diloco"), "sync_every", 10),
            # 1-bit LAMB's warm-up ends before the timed steps: they are compressed. So
            # early a freeze diverges at LAMB's 0.02 on this model (NaN, skipped steps that
            # send nothing): LAMB and 1-bit LAMB (and 1-bit Adam) run at 0.005.
            *each(("onebit_lamb", "onebit_adam"), "freeze_step", max(1, self.first_timed - 5)),
            *each(("lamb", "onebit_lamb", "onebit_adam"), "learning_rate", 0.005),
        ]


def each(names: tuple[str, ...], field: str, value) -> list[str]:
    """``--set`` items giving each algorithm of ``names`` its own ``field`` = ``value``."""
    return [f"{name}.{field}={value}" for name in names]


def shoal_run(net, setup: Setup, backend: str, algorithms, out: Path) -> list[str]:
    cmd = [str(SHOAL_RUN), str(CONFIG.relative_to(ROOT)), "--backend", backend,
           "--no-progress", "--overwrite", "--out", str(out),
           "--set", *setup.overrides(algorithms)]  # fmt: skip
    return mpi(net, setup.hosts, *cmd)


def read_run(out: Path, first: int, last: int) -> dict[str, dict]:
    """Per algorithm: mean ms per timed step, and mean bytes sent per worker per step."""
    times: dict[str, dict[int, float]] = {}
    for line in (out / "timing.jsonl").read_text().splitlines():
        r = json.loads(line)
        times.setdefault(r["algorithm"], {})[r["step"]] = r["time_s"]
    sent: dict[str, list[float]] = {}
    density: dict[str, list[float]] = {}
    skipped: dict[str, int] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if first <= r["step"] <= last:
            b = r["bytes_sent"]
            sent.setdefault(r["algorithm"], []).append(
                sum(b) / len(b) if isinstance(b, list) else b
            )
            if "density" in r:
                density.setdefault(r["algorithm"], []).append(r["density"])
            if r.get("skipped") or r["loss"] != r["loss"]:  # a skipped step, or NaN loss
                skipped[r["algorithm"]] = skipped.get(r["algorithm"], 0) + 1
    res = {}
    for name, t in times.items():
        steps = [t[s] - t[s - 1] for s in range(first, last + 1)]
        res[name] = {
            "ms": 1e3 * sum(steps) / len(steps),
            "ms_steps": [1e3 * x for x in steps],
            "bytes": sum(sent[name]) / len(sent[name]),
            "density": sum(density[name]) / len(density[name]) if name in density else None,
            "invalid": skipped.get(name, 0),
        }
    return res


def project(setup: Setup, algorithms_: tuple[str, ...], cluster) -> tuple[dict, float]:
    """Projected communication seconds per timed step of each algorithm (the same config,
    its collectives recorded by `record_events` and timed on ``cluster``), and the
    forward+backward seconds of one local batch in this process alone."""
    from shoal.comms import record_events
    from shoal.costmodel import step_comm_time
    from shoal.experiments import algorithms
    from shoal.experiments.overrides import apply_overrides, load_config
    from shoal.experiments.runner.projection import compute_seconds
    from shoal.experiments.tasks import make_task

    cfg = apply_overrides(load_config(CONFIG), setup.overrides(algorithms_))
    cfg = dataclasses.replace(cfg, workers=setup.hosts)
    task = make_task(cfg)
    params = task.init_params()
    last = setup.steps - 1
    comm = {}
    for name in algorithms_:
        entry = algorithms.resolve(name, cfg)
        gs = entry.group_size
        steps = record_events(
            lambda c, entry=entry: entry.build(c, task=task),
            params, workers=setup.hosts, steps=last, group_size=gs,
        )  # fmt: skip
        window = steps[setup.first_timed - 1 : last]
        comm[name] = sum(step_comm_time(e, cluster, group_size=gs) for e in window) / len(window)
    return comm, compute_seconds(task)


def reduce_rate() -> float:
    """Bytes per second this machine adds float32 arrays (the model's gamma)."""
    import numpy as np

    a, b = np.ones(1 << 24, np.float32), np.ones(1 << 24, np.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def label(name: str, setup: Setup) -> str:
    return "local (no exchange)" if name == setup.local else name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=1000.0)
    p.add_argument("--steps", type=int, default=30, help="steps per run (a multiple of 10)")
    p.add_argument("--first-timed", type=int, default=10, help="first timed step")
    p.add_argument("--hidden", default="2048,2048", help="MLP hidden widths (4.3M params)")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS))
    p.add_argument("--jax-algorithms", default=",".join(JAX_ALGORITHMS), help="'' for none")
    p.add_argument("--no-reference", action="store_true", help="skip the unthrottled runs")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "cluster")
    p.add_argument("--no-write", action="store_true", help="do not rewrite BENCHMARKS.md")
    p.add_argument("--tiny", action="store_true", help="2 hosts, tiny model, 4 steps (tests)")
    args = p.parse_args(argv)
    try:
        check_available()
    except Unavailable as e:
        print(f"cluster benchmark: cannot build the shaped network: {e}", file=sys.stderr)
        return 2
    algos = tuple(a for a in args.algorithms.split(",") if a)
    jax_algos = tuple(a for a in args.jax_algorithms.split(",") if a)
    if args.tiny:
        setup = Setup(2, args.rate_mbit, 4, 2, "64,64", ("ssgd", "gtc"), (), 1 << 16,
                      False, min(args.timeout, 120), args.out)  # fmt: skip
    else:
        if args.steps % 10 or args.steps < 20 or not 2 <= args.first_timed < args.steps:
            p.error("--steps must be a multiple of 10, >= 20, and 2 <= --first-timed < steps")
        setup = Setup(args.hosts, args.rate_mbit, args.steps, args.first_timed, args.hidden,
                      algos, jax_algos, 1 << 24, not args.no_reference, args.timeout,
                      args.out)  # fmt: skip
    if "ssgd" not in setup.algorithms:
        p.error("--algorithms must include ssgd (the baseline)")
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    command = shlex.join(["python", "benchmarks/cluster/run.py", *(sys.argv[1:] if argv is None
                                                                    else argv)])  # fmt: skip
    try:
        report = measure(setup)
    except JobFailed as e:
        print(f"cluster benchmark FAILED: {e}", file=sys.stderr)
        return 1
    text = render(setup, report, command, time.perf_counter() - start)
    print(text)
    if not args.no_write and not args.tiny:
        write_doc(text, load_start)
        print(f"\nBENCHMARKS.md: block bench:{MARK} rewritten")
    return 0


def measure(setup: Setup) -> dict:
    env = {**os.environ, **MPICH_ENV, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    report: dict = {"runs": {}, "ref": {}}
    setup.out.mkdir(parents=True, exist_ok=True)
    last = setup.steps - 1
    to = setup.timeout
    say = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    run_algos = (*setup.algorithms, setup.local)
    with ShapedNetwork(hosts=setup.hosts, rate_mbit=setup.rate_mbit) as net:
        try:
            report["gateway"], report["addresses"] = net.gateway, list(net.addresses)
            say(f"network: {setup.hosts} hosts {net.addresses}, {setup.rate_mbit:g} Mbit/s")
            out = job(mpi(net, setup.hosts, sys.executable, str(HERE / "probe.py"),
                          "--mbytes", "20"), 120, env)  # fmt: skip
            report["probe"] = json.loads(out.strip().splitlines()[-1])
            out = job(mpi(net, 2, sys.executable, "-c", PING), 120, env)
            report["latency_s"] = json.loads(out.strip().splitlines()[-1])["one_way_s"]
            say(f"probe: {report['probe']['rate_mbit']:.1f} Mbit/s, "
                f"latency {report['latency_s'] * 1e6:.0f} us")  # fmt: skip
            ar = [sys.executable, str(ROOT / "benchmarks" / "mpi_allreduce.py"),
                  "--n", str(setup.allreduce_n)]  # fmt: skip
            report["allreduce_cmd"] = _show(mpi(net, setup.hosts, *ar))
            report["allreduce"] = job(mpi(net, setup.hosts, *ar), to, env)
            say("mpi_allreduce done")
            for backend, algos in (("mpi", run_algos), ("jax", setup.jax_algorithms)):
                if not algos:
                    continue
                if backend == "jax":
                    algos = (*algos, setup.local)
                out_dir = setup.out / backend
                cmd = shoal_run(net, setup, backend, algos, out_dir)
                report.setdefault("cmds", {})[backend] = _show(cmd)
                job(cmd, to * 2, env, log=setup.out / f"{backend}.log")
                report["runs"][backend] = read_run(out_dir, setup.first_timed, last)
                say(f"shoal-run --backend {backend} done")
        finally:
            for proc in list(_CURRENT):
                _kill_group(proc)
            _kill_in_hosts(net)
    if setup.reference:
        with ShapedNetwork(hosts=setup.hosts, rate_mbit=REF_RATE_MBIT) as ref:
            try:
                out = job(mpi(ref, 2, sys.executable, str(HERE / "probe.py"), "--mbytes",
                              "20"), 120, env)  # fmt: skip
                report["ref_rate_mbit"] = json.loads(out.strip().splitlines()[-1])["rate_mbit"]
                cmd = shoal_run(ref, setup, "mpi", run_algos, setup.out / "reference")
                job(cmd, to * 2, env, log=setup.out / "reference.log")
                report["ref"] = read_run(setup.out / "reference", setup.first_timed, last)
                say("reference (unthrottled) run done")
            finally:
                for proc in list(_CURRENT):
                    _kill_group(proc)
                _kill_in_hosts(ref)
    # The cost model, after the measurements (it computes on this machine).
    from shoal.costmodel import Cluster

    bw = setup.rate_mbit * 1e6 / 8
    gamma = 1 / reduce_rate()
    cluster = Cluster(nodes=setup.hosts, workers_per_node=1, intra_bandwidth=bw,
                      intra_latency=report["latency_s"], inter_bandwidth=bw,
                      inter_latency=report["latency_s"], gamma=gamma, name="shaped")  # fmt: skip
    report["cluster"] = cluster
    report["comm"], report["compute_alone_s"] = project(setup, run_algos, cluster)
    say("projection done")
    return report


def _allreduce_rows(text: str) -> dict[str, tuple[float, int]]:
    """mpi_allreduce's table: case -> (ms, bytes sent per worker)."""
    rows = re.findall(r"^\| (\w+) \| ([\d.]+) \|.*\| (\d+) \|$", text, re.M)
    return {case: (float(ms), int(sent)) for case, ms, sent in rows}


def render(setup: Setup, rep: dict, command: str, seconds: float) -> str:
    c = rep["cluster"]
    probe = rep["probe"]
    inodes = [r["netns"] for r in probe["ranks"]]
    distinct = len(set(inodes)) == len(inodes)
    lines = [
        f"Network: {setup.hosts} hosts (network namespaces on a bridge, one rank each), "
        f"links shaped to {setup.rate_mbit:g} Mbit/s each way (tbf), no added delay (no "
        f"netem on this kernel); addresses {', '.join(rep['addresses'])}. "
        f"Probe: {probe['rate_mbit']:.1f} Mbit/s measured 0->1 (MPI, 20 MB), ranks in "
        f"{'distinct' if distinct else 'NOT distinct'} namespaces "
        f"({', '.join(r['hostname'] for r in probe['ranks'])}); MPI ping-pong latency "
        f"{rep['latency_s'] * 1e6:.0f} us one way. MPICH over TCP (ofi/tcp, no shared memory).",
        "",
        f"The {setup.hosts} ranks share this machine's {os.cpu_count()} CPU cores: compute is "
        f"contended, as no real cluster's would be.",
        "",
    ]
    cases = _allreduce_rows(rep["allreduce"])
    ar = (cases["all_reduce"][0], cases["compressed"][0]) if len(cases) >= 4 else None
    lines.append(f"**compressed all-reduce** ({setup.allreduce_n} float32 values, "
                 f"`{rep['allreduce_cmd']}`):")  # fmt: skip
    lines.append("")
    lines += [x for x in rep["allreduce"].strip().splitlines() if x.startswith("|")]
    lines.append("")
    if ar:
        lines.append(f"float32 all_reduce {ar[0]:.1f} ms, compressed {ar[1]:.1f} ms: "
                     f"**{ar[0] / ar[1]:.2f}x** faster (target >= 8x: "
                     f"{'met' if ar[0] / ar[1] >= 8 else 'NOT met'})")  # fmt: skip
        lines.append("")
        rate = probe["rate_mbit"] * 1e6 / 8  # bytes/s, measured
        wire = {k: cases[k][1] / rate * 1e3 for k in ("all_reduce", "compressed")}
        lines.append(
            f"At the probe's {probe['rate_mbit']:.0f} Mbit/s the bytes each worker sends take "
            f"{wire['all_reduce']:.1f} ms (float32) and {wire['compressed']:.1f} ms "
            f"(compressed): a wire-bound ratio of {wire['all_reduce'] / wire['compressed']:.0f}x. "
            f"The compressed call's local memory passes alone (`floor`: no network) take "
            f"{cases['floor'][0]:.1f} ms with {setup.hosts} ranks on {os.cpu_count()} cores"
            + (
                ": the compressed all-reduce is bound by local work (CPU, memory), not the link."
                if cases["compressed"][0] > 2 * wire["compressed"]
                else "."
            )
        )
        lines.append("")

    comm = rep["comm"]
    local = setup.local
    rows = []
    table = [
        "| algorithm | backend | ms/step measured | speed-up over ssgd measured | "
        "projected ms/step | projected speed-up | projected / measured | bytes sent per "
        "worker per step | unthrottled ms/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for backend, runs in rep["runs"].items():
        if "ssgd" not in runs or local not in runs:
            continue
        compute = runs[local]["ms"] / 1e3 - comm[local]  # measured step minus its tiny comm
        proj = {n: compute + comm[n] for n in runs}
        for name, r in runs.items():
            sp = runs["ssgd"]["ms"] / r["ms"]
            psp = proj["ssgd"] / proj[name]
            ref = rep["ref"].get(name) if backend == "mpi" else None
            dens = f" (density {r['density']:.2%})" if r["density"] is not None else ""
            if r["invalid"]:
                dens += f" INVALID: {r['invalid']} timed steps skipped or NaN"
            rows.append((backend, name, r, sp, psp, proj[name], ref))
            unthrottled = f"{ref['ms']:.1f}" if ref else "-"
            table.append(
                f"| {label(name, setup)}{dens} | {backend} | {r['ms']:.1f} | {sp:.2f} | "
                f"{proj[name] * 1e3:.1f} | {psp:.2f} | {psp / sp:.2f} | {r['bytes']:,.0f} | "
                f"{unthrottled} |"
            )
    lines += table
    lines.append("")
    if rep.get("ref_rate_mbit"):
        lines.append(
            f"Unthrottled: the same `--backend mpi` runs on {setup.hosts} namespaces whose "
            f"tbf is at {REF_RATE_MBIT / 1000:g} Gbit/s (probe: "
            f"{rep['ref_rate_mbit']:.0f} Mbit/s 0->1, what TCP over veth reaches here)."
        )
        lines.append("")
    whole = (setup.steps - setup.first_timed) % 10 == 0
    periods = " (whole 10-step periods of BMUF and DiLoCo)" if whole else ""
    lines.append(
        f"Model: `Cluster(nodes={c.nodes}, workers_per_node=1, inter_bandwidth="
        f"{c.inter_bandwidth:.4g} B/s, inter_latency={c.inter_latency * 1e6:.0f} us (measured), "
        f"gamma=1/{1 / c.gamma / 1e9:.2f} GB/s (numpy add, measured))`; projected ms/step = "
        f"compute (the measured `local` step, less its modelled flag all-reduce) + "
        f"`step_comm_time` of the run's recorded collectives, mean over steps "
        f"{setup.first_timed}-{setup.steps - 1}. Measured ms/step: mean wall time of the same "
        f"steps{periods} from timing.jsonl. One worker's forward+backward "
        f"alone in one process: {rep['compute_alone_s'] * 1e3:.1f} ms."
    )
    lines.append("")
    # Targets.
    mpi_rows = {n: (sp, psp) for b, n, _, sp, psp, _, _ in rows if b == "mpi"}
    for name in TARGETS:
        if name in mpi_rows:
            sp, psp = mpi_rows[name]
            ok = sp >= 0.5 * psp
            lines.append(f"- target {name}: measured speed-up {sp:.2f} vs projected {psp:.2f} "
                         f"({sp / psp:.0%} of it; target >= 50%: "
                         f"{'met' if ok else 'NOT met'})")  # fmt: skip
    lines.append("")
    lines += disagreements(setup, rep, rows)
    lines.append("")
    lines.append(f"Command: `{command}` ({seconds:.0f} s in all); runs: "
                 + "; ".join(f"`{v}`" for v in rep.get("cmds", {}).values()))  # fmt: skip
    return "\n".join(lines)


def disagreements(setup: Setup, rep: dict, rows) -> list[str]:
    """Where projected and measured speed-ups differ by more than 1.5x, the parts of the
    gap that the measurements support."""
    out = []
    comm = rep["comm"]
    local = setup.local
    ref_local = rep["ref"].get(local)
    for backend, name, r, sp, psp, proj, ref in rows:
        ratio = psp / sp
        if 1 / 1.5 <= ratio <= 1.5 or name == local:
            continue
        gap = r["ms"] - proj * 1e3
        why = [
            f"{name} ({backend}): projected/measured {ratio:.2f}; measured {r['ms']:.1f} "
            f"ms/step vs {proj * 1e3:.1f} projected (gap {gap:+.1f} ms)"
        ]
        if ref is not None and ref_local is not None:
            own = ref["ms"] - ref_local["ms"]  # the algorithm's compute beyond plain local SGD
            net = r["ms"] - ref["ms"]  # what the 1 Gbit/s links add
            why.append(
                f"unthrottled it takes {ref['ms']:.1f} ms/step, {own:+.1f} ms more than the "
                f"local step there (its own compute: compression, optimizer, small "
                f"messages; not in the cost model); the shaped links add {net:.1f} ms "
                f"where the model has {comm[name] * 1e3:.1f} ms of communication"
            )
            if net > 0 and comm[name] > 0:
                eff = r["bytes"] * 8 / (net / 1e3) / 1e6 if net > 0 else float("nan")
                why.append(f"(effective {eff:.0f} Mbit/s per worker for its "
                           f"{r['bytes']:,.0f} bytes per step)")  # fmt: skip
            main = "its own compute" if abs(own) > abs(net - comm[name] * 1e3) else "the network"
            why.append(f"=> the larger part of the gap: {main}")
        out.append("- " + " ".join(why))
    if name_ssgd := next((x for x in rows if x[0] == "mpi" and x[1] == "ssgd"), None):
        r, proj, ref = name_ssgd[2], name_ssgd[5], name_ssgd[6]
        line = (f"- ssgd (the denominator of every speed-up): measured {r['ms']:.1f} ms/step, "
                f"projected {proj * 1e3:.1f}")  # fmt: skip
        if ref is not None:
            net = r["ms"] - ref["ms"]
            eff = r["bytes"] * 8 / (net / 1e3) / 1e6 if net > 0 else float("nan")
            line += (
                f"; unthrottled {ref['ms']:.1f}, so the shaped links add {net:.1f} ms where the "
                f"model has {comm['ssgd'] * 1e3:.1f} ms (its {r['bytes']:,.0f} bytes per step "
                f"at an effective {eff:.0f} Mbit/s per worker)"
            )
        out.append(line)
    local_row = next((x for x in rows if x[0] == "mpi" and x[1] == local), None)
    if local_row is not None:
        out.append(
            f"- CPU contention: the local step (no exchange) takes {local_row[2]['ms']:.1f} ms "
            f"with {setup.hosts} ranks on {os.cpu_count()} cores, one worker's forward+backward "
            f"alone {rep['compute_alone_s'] * 1e3:.1f} ms; the projection uses the former"
        )
    if not any(x.startswith("- ") and "projected/measured" in x for x in out):
        out.insert(0, "- no algorithm's projected and measured speed-ups differ by more than 1.5x")
    out.insert(0, "Where projection and measurement disagree by more than 1.5x, and why:")
    out.insert(1, "")
    return out


def write_doc(text: str, load_start: float) -> None:
    import run_all  # benchmarks/run_all.py: its block format and writer

    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    block = "\n".join([
        f"<!-- bench:{MARK}:start -->", "",
        f"Latest run: {date}, machine: {run_all.machine()}, load {load_start:.2f} - "
        f"{load:.2f} (1-min average, start - end).", "",
        run_all.to_markdown(text), "", f"<!-- bench:{MARK}:end -->",
    ])  # fmt: skip
    doc = run_all.DOC.read_text() if run_all.DOC.exists() else "# Benchmarks\n"
    if run_all._markers(MARK).search(doc) or re.search(rf"^##\s+{MARK}\b", doc, re.M):
        doc = run_all.rewrite(doc, MARK, block)
    else:
        doc = doc.rstrip("\n") + (
            f"\n\n{SECTION}\n\n"
            "Command: `make bench-cluster` (root: `.venv/bin/python benchmarks/cluster/run.py`; "
            "see `benchmarks/cluster/README.md`). Not part of `make bench`, which needs no "
            f"root.\n\n{block}\n"
        )
    run_all.write(run_all.DOC, doc)


if __name__ == "__main__":
    sys.exit(main())
