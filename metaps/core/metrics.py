"""Prometheus metrics: every metaps process serves ``/metrics`` on its own port, and logs it.

Metric objects are module-level in the code that updates them (e.g.
``ps.server_metrics``); this module only starts the endpoint and picks a free port.
"""

from __future__ import annotations

import logging
import socket

from prometheus_client import start_http_server

from metaps.core.log import kv

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (racy; fine for tests/launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_metrics(port: int = 0, host: str = "127.0.0.1") -> int:
    """Start the ``/metrics`` HTTP endpoint; ``port=0`` picks one. Returns the port.

    Example::

        port = serve_metrics()   # then GET http://127.0.0.1:{port}/metrics
    """
    if port < 0:
        raise ValueError(f"metrics port must be >= 0, got {port}")
    port = port or free_port(host)
    start_http_server(port, addr=host)
    # ports are picked at start: a person (or a scrape config) finds this one in the log
    log.info("metrics endpoint", extra=kv(address=f"http://{host}:{port}/metrics"))
    return port
