"""A shaped multi-host network on one machine: network namespaces on a bridge.

Each test host is a network namespace with one veth link to a bridge in the root namespace.
Both directions of every link pass a token-bucket filter (``tc tbf``) at the chosen rate, so
a host sends and receives at most ``rate`` however many peers it talks to, as through one
NIC. Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544) and nothing else:
host ``i`` is ``198.18.S.(i + 1)``, the bridge ``198.18.S.254``, with ``S`` the first /24
not already in use on this machine.

MPI jobs run through hydra's ssh launcher with `hostexec` as the "ssh": it enters the
host's namespace (and a UTS namespace with the host's name, which ``/etc/netns/<host>/hosts``
resolves to its address, so ``jax.distributed`` finds its coordinator). `MPICH_ENV` makes
MPICH talk TCP between hosts: shared memory and libfabric's shm provider would otherwise
cross the namespaces through ``/dev/shm``, since they share one kernel.

Needs root, ``ip``, ``tc`` and ``unshare``; `check_available` says which is missing.

Example (as root)::

    with ShapedNetwork(hosts=2, rate_mbit=1000) as net:
        subprocess.run(["mpiexec", *net.mpiexec_args(), "-n", "2", "hostname"],
                       env={**os.environ, **MPICH_ENV}, check=True)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
import signal
import subprocess
from pathlib import Path

HOSTEXEC = Path(__file__).resolve().parent / "hostexec"
RANGE = ipaddress.ip_network("198.18.0.0/15")
NETNS_ETC = Path("/etc/netns")

# MPICH (ch4) between namespaces: every rank is "remote" (no shared-memory transport), the
# libfabric netmod with its TCP provider (its shm provider, like UCX's, would use /dev/shm)
# on the host's own link.
MPICH_ENV = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "eth0",
}


class Unavailable(RuntimeError):
    """Namespaces cannot be built here; the message says why."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_available() -> None:
    """Raise `Unavailable` naming the reason when namespaces and tbf cannot be used here."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        raise Unavailable("network namespaces need Linux (/proc/self/ns/net is missing)")
    if os.geteuid() != 0:
        raise Unavailable("creating network namespaces needs root (run as root)")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise Unavailable(f"the `{tool}` command is not installed")
    probe = f"shoalprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        raise Unavailable(f"`ip netns add` failed: {made.stderr.strip()}")
    try:
        tbf = _run(
            "ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
            "tbf", "rate", "1gbit", "burst", "128kb", "latency", "10ms", check=False,
        )  # fmt: skip
        if tbf.returncode != 0:
            raise Unavailable(f"the kernel has no tbf qdisc: {tbf.stderr.strip()}")
    finally:
        _run("ip", "netns", "del", probe, check=False)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    out = _run("ip", "-o", "-4", "addr", "show").stdout
    used = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.add(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return used


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_subnets()
    for sub in RANGE.subnets(new_prefix=24):
        if not any(sub.overlaps(u) for u in used):
            return sub
    raise Unavailable("every /24 of 198.18.0.0/15 is already in use on this machine")


@dataclasses.dataclass
class ShapedNetwork:
    """``hosts`` namespaces on a bridge, each link shaped to ``rate_mbit`` both ways.

    Args:
      hosts: number of test hosts, 2 to 253.
      rate_mbit: the rate of each host's link in Mbit/s, each way (tbf).
      delay_ms: added one-way delay per link; needs the netem qdisc, refused without it.
      tag: distinguishes concurrent networks' names (default: this process's id).

    Attributes (once entered):
      names: the hosts' names, which are also their namespaces' names and hostnames.
      addresses: their IPv4 addresses, in order.
      gateway: the bridge's address (where hydra's proxies reach mpiexec).
    """

    hosts: int
    rate_mbit: float
    delay_ms: float = 0.0
    tag: str = ""
    names: list[str] = dataclasses.field(default_factory=list, init=False)
    addresses: list[str] = dataclasses.field(default_factory=list, init=False)
    gateway: str = dataclasses.field(default="", init=False)

    def __post_init__(self):
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int):
            raise TypeError(f"hosts must be an int, got {self.hosts!r}")
        if not 2 <= self.hosts <= 253:
            raise ValueError(f"hosts must be in [2, 253], got {self.hosts}")
        if not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        self.tag = self.tag or str(os.getpid() % 100000)
        self._made: list[tuple[str, str]] = []  # ("netns"|"link"|"etc", name), to undo

    # Interface names are limited to 15 characters.
    @property
    def bridge(self) -> str:
        return f"shb{self.tag}"

    def _veth(self, i: int) -> str:
        return f"shv{self.tag}x{i}"

    def __enter__(self) -> ShapedNetwork:
        check_available()
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
        self._signals = previous
        for sig in previous:  # a killed run still tears down (via __exit__)
            signal.signal(sig, _raise_exit)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        sub = _free_subnet()
        hosts = list(sub.hosts())
        self.gateway = str(hosts[253])  # .254
        self.names = [f"shoal{self.tag}h{i}" for i in range(self.hosts)]
        self.addresses = [str(hosts[i]) for i in range(self.hosts)]
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(self.addresses, self.names)
        )
        for i, (name, addr) in enumerate(zip(self.names, self.addresses)):
            _run("ip", "netns", "add", name)
            self._made.append(("netns", name))
            etc = NETNS_ETC / name
            etc.mkdir(parents=True, exist_ok=True)
            self._made.append(("etc", str(etc)))
            (etc / "hosts").write_text(hosts_file)
            veth = self._veth(i)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            self._made.append(("link", veth))
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "route", "add", "default", "via", self.gateway)
            self._shape(veth)  # into the host
            self._shape("eth0", netns=name)  # out of the host

    def _shape(self, dev: str, netns: str | None = None) -> None:
        prefix = ("ip", "netns", "exec", netns) if netns else ()
        rate = f"{self.rate_mbit}mbit"
        # The bucket holds at least 1 ms of traffic (tbf needs more than rate / HZ) and
        # one 64 KB segmentation-offload packet; the queue holds 20 ms.
        burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 1000))
        if self.delay_ms > 0:
            proc = _run(
                *prefix, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                "delay", f"{self.delay_ms}ms", "rate", rate, check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                raise Unavailable(
                    f"delay_ms needs the netem qdisc, which this kernel lacks "
                    f"({proc.stderr.strip()}); use delay_ms=0"
                )
            return
        _run(
            *prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", rate, "burst", str(burst), "latency", "20ms",
        )  # fmt: skip

    def close(self) -> None:
        """Remove everything this network made (namespaces, links, /etc/netns files)."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _run("ip", "netns", "del", name, check=False)
            elif kind == "link":
                _run("ip", "link", "del", name, check=False)
            else:
                shutil.rmtree(name, ignore_errors=True)
        self._made.clear()
        for sig, handler in getattr(self, "_signals", {}).items():
            signal.signal(sig, handler)
        self._signals = {}

    def mpiexec_args(self, ranks_per_host: int = 1) -> list[str]:
        """mpiexec options that place ``ranks_per_host`` ranks in each host, in order."""
        hosts = ",".join(f"{n}:{ranks_per_host}" for n in self.names)
        return [
            "-launcher", "ssh", "-launcher-exec", str(HOSTEXEC),
            "-localhost", self.gateway, "-hosts", hosts,
        ]  # fmt: skip

    def exec_args(self, host: int) -> list[str]:
        """A command prefix that runs in host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.names[host]]


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def leftovers() -> list[str]:
    """Namespaces of earlier networks (``shoal<tag>h<i>``) that still exist."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("shoal")]
