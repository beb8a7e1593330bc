"""Prometheus metrics: every metaps process serves ``/metrics`` on its own port, and logs it.

Metric objects are module-level in the code that updates them (e.g.
``ps.server_metrics``); this module only starts the endpoint. The endpoint binds the port
it is given, or with 0 a port the kernel picks, itself: nothing picks a port for it and
releases it first, so no other process can take it in between. The port it got is logged
and, with ``publish``, written to a file (``{"host", "port", "pid"}``) that a launcher reads.

Example::

    port = serve_metrics(0, what="metaps worker", publish="run/metrics/ports/worker-0.json")
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

from prometheus_client import start_http_server

from common.atomic_write import write_json_atomic
from common.errors import BindError
from common.log import kv

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``. Racy: the port is released before the
    caller binds it, and another process may take it in between. Servers bind port 0
    themselves instead; this is for tests and tools that must name a port up front."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_metrics(port: int = 0, host: str = "127.0.0.1", *, what: str = "this process",
                  publish: str | Path | None = None) -> int:
    """Start the ``/metrics`` HTTP endpoint on ``host:port`` (0: a port the kernel picks). Returns the port.

    Args:
        port: the port to bind, 0 for any free one.
        host: the address to bind.
        what: the role, for the error message (``"metaps controller"``).
        publish: write ``{"host", "port", "pid"}`` here (atomically) once serving.

    Raises:
        ValueError: a negative port.
        BindError: the port is in use or the host is not this machine's (one line naming both and ``what``).
    """
    if port < 0:
        raise ValueError(f"metrics port must be >= 0, got {port}")
    try:
        httpd, _ = start_http_server(port, addr=host)
    except OSError as exc:
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise BindError(f"{what}: cannot serve /metrics on {host}:{port}: {why}") from None
    port = int(httpd.server_port)
    log.info("metrics endpoint", extra=kv(address=f"http://{host}:{port}/metrics"))
    if publish:
        write_json_atomic(publish, {"host": host, "port": port, "pid": os.getpid()})
    return port
