"""Run under ``mpiexec -n 2``: start the ``jax`` backend and print, on process 0, the local
addresses that listen on the jax.distributed coordinator's port (Linux /proc/net/tcp*)."""

import socket
import sys
from pathlib import Path

from shoal.experiments.runner.backends import make_backend


def listening(port: int) -> list[str]:
    """Local addresses in state LISTEN on ``port``, as text ("0.0.0.0", "::", ...)."""
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(host)
            # /proc writes each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return found


backend = make_backend("jax", bind_address=sys.argv[1] if len(sys.argv) > 1 else None)
address, bind = backend.coordinator
if backend.is_root:
    port = int(bind.rsplit(":", 1)[1])
    print(f"coordinator {address} bind {bind} listening {','.join(listening(port))}", flush=True)
backend.comm.Barrier()
