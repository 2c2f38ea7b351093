"""Check a shaped network from inside an MPI job: where each rank runs, and the link's rate.

Usage (under mpiexec with `ShapedNetwork.mpiexec_args`, 2 ranks or more):
``python benchmarks/cluster/probe.py [--mbytes 4] [--reps 3]``

Rank 0 prints one JSON line: ``ranks`` (per rank its network namespace's inode, hostname
and IPv4 addresses) and ``rate_mbit``, the rate of a timed MPI transfer of ``--mbytes``
MB from rank 0 to rank 1 (until rank 1 acknowledges the last byte), the fastest of
``--reps`` after a warm-up: tbf caps every transfer at its rate, so a slower one only says
a rank was kept off the CPU. It crosses both shaped links between them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time

import numpy as np
from mpi4py import MPI


def where() -> dict:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    addrs = [
        line.split()[3].split("/")[0]
        for line in out.stdout.splitlines()
        if " lo " not in line and "inet" in line
    ]
    return {
        "netns": os.stat("/proc/self/ns/net").st_ino,
        "hostname": socket.gethostname(),
        "addresses": addrs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3, help="timed transfers (>= 1)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    ranks = comm.gather(where(), root=0)
    data = np.ones(int(args.mbytes * 1e6), np.uint8)
    ack = np.zeros(1, np.uint8)
    rates = []
    for _rep in range(1 + max(args.reps, 1)):  # the first opens the connection, grows TCP's window
        comm.Barrier()
        if rank == 0:
            start = time.perf_counter()
            comm.Send(data, dest=1)
            comm.Recv(ack, source=1)
            rates.append(data.nbytes * 8 / (time.perf_counter() - start) / 1e6)
        elif rank == 1:
            comm.Recv(data, source=0)
            comm.Send(ack, dest=0)
    if rank == 0:
        print(json.dumps({"ranks": ranks, "rate_mbit": max(rates[1:])}), flush=True)


if __name__ == "__main__":
    main()
