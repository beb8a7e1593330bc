"""Ports for test subprocesses that cannot collide across xdist workers.

``common.metrics.free_port`` asks the kernel for an ephemeral port and lets it go: the
caller binds it later, and in between another process (the other xdist worker picking
its own port, or any outgoing connection, which also draws from the ephemeral range)
may take it. Tests that hand a port to a subprocess use :func:`pick_port` instead: each
xdist worker (``PYTEST_XDIST_WORKER`` = ``gw0``, ``gw1``, ...) owns its own block of
ports below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``
starts at 32768 by default), so neither the other worker nor the kernel hands it out.
Within a worker, ports are walked round-robin and each is checked free before use.
"""

from __future__ import annotations

import itertools
import os
import socket

BASE = 20000
BLOCK = 1500  # ports per worker: gw0 20000-21499, gw1 21500-22999, ... (8 workers < 32768)


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = name.removeprefix("gw")
    return int(digits) if digits.isdigit() else 0


_counter = itertools.count(os.getpid() % BLOCK)  # reruns of a worker start elsewhere in its block


def pick_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host``, from this xdist worker's own block.

    Args:
        host: the address the port will be bound on.

    Raises:
        RuntimeError: every port of the block is in use.
    """
    start = BASE + _worker_index() * BLOCK
    for _ in range(BLOCK):
        port = start + next(_counter) % BLOCK
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{start + BLOCK - 1} on {host}")

