"""A PS shard's link to the controller: register, heartbeat, report load windows.

``metaps ps --controller ADDR`` (or ``$METAPS_CONTROLLER``, which agents set)
starts one :class:`ControllerLink` once the shard serves::

    register(role=ps, index=shard, address=host:port, metrics_port, pid, incarnation id)
    every report_s:    ReportMetrics(request_latency_s = mean data-RPC time since last report,
                                     queue_depth = mean requests in flight seen on arrival)
    every heartbeat_s: Heartbeat: a ``stop`` command (the run ended or failed, or a newer
                       incarnation of this shard fenced this one off) calls ``on_stop(reason)``;
                       other commands are logged and ignored (checkpoints are written by
                       the coordinator through the PS RPCs)

The request latency is the server's own measurement (``PsServer.load``), fault
delays included, so the Monitor sees a slow PS the way its clients do. A window
with no request reports nothing (the Monitor leaves the shard's streak alone).
The controller uses the registered address to move vshards off a slow shard and
to restore the fleet after a shard restarts (``controller/ps_recovery.py``).

Example::

    link = ControllerLink(server, "127.0.0.1:7070", job.rpc, address="127.0.0.1:5001",
                          report_s=job.controller.monitor.window_s / 2)
    link.start()
    ...
    link.stop()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from common.log import kv
from common.rpc import RpcConfig

if TYPE_CHECKING:
    from controller.client import Registration

log = logging.getLogger(__name__)


class ControllerLink(threading.Thread):
    """Background thread of one PS process. See the module docstring.

    Args:
        server: the running :class:`ps.servicer.PsServer`.
        controller: controller ``host:port``.
        rpc_cfg: the job's RPC settings (token).
        address: this shard's ``host:port`` as clients reach it.
        metrics_port: its Prometheus port (0 = none).
        report_s: period of the load reports (about half a Monitor window).
        retry_s: how long registration retries while the controller is unreachable.
    """

    def __init__(self, server: Any, controller: str, rpc_cfg: RpcConfig, address: str, metrics_port: int = 0,
                 report_s: float = 1.0, retry_s: float = 60.0) -> None:
        super().__init__(name="ps-controller-link", daemon=True)
        if report_s <= 0:
            raise ValueError(f"report_s must be > 0, got {report_s}")
        from controller.client import ControllerClient

        self.server = server
        self.address = address
        self.metrics_port = metrics_port
        self.report_s = report_s
        self.client = ControllerClient(controller, rpc_cfg, role="ps", index=server.shard_id, retry_s=retry_s)
        self.heartbeat_s = 2.0
        self.incarnation = 0
        self.on_stop: Callable[[str], None] | None = None
        """Called with the reason of a ``stop`` command (the process then exits)."""
        self.stop_reason = ""
        self._stopping = threading.Event()  # not `_stop`: that would shadow threading.Thread._stop
        self._last = server.load.read()
        self.reports = 0

    def register(self) -> Registration:
        """Register this process; ``restarted``: the controller knew an earlier process of this shard."""
        reg = self.client.register(address=self.address, metrics_port=self.metrics_port, pid=os.getpid())
        self.heartbeat_s = max(0.05, reg.heartbeat_s)
        self.incarnation = reg.incarnation
        log.info("ps registered with the controller",
                 extra=kv(shard=self.server.shard_id, controller=self.client.address, address=self.address,
                          incarnation=reg.incarnation, restarted=reg.restarted))
        return reg

    def report_once(self) -> bool:
        """Send the load since the previous report; False when no request finished in between."""
        now = self.server.load.read()
        count, lat, depth = (now[0] - self._last[0], now[1] - self._last[1], now[2] - self._last[2])
        self._last = now
        if count <= 0:
            return False
        self.client.report_metrics(request_latency_s=lat / count, queue_depth=depth / count, wait=False)
        self.reports += 1
        return True

    def run(self) -> None:
        next_hb = time.monotonic() + self.heartbeat_s
        while not self._stopping.wait(self.report_s):
            try:
                self.report_once()
                if time.monotonic() >= next_hb:
                    next_hb = time.monotonic() + self.heartbeat_s
                    reply = self.client.heartbeat()
                    for cmd in reply.commands:
                        if cmd.kind == "stop":
                            log.warning("controller says stop", extra=kv(shard=self.server.shard_id,
                                                                        reason=cmd.reason))
                            self.stop_reason = cmd.reason
                            if self.on_stop is not None:
                                self.on_stop(cmd.reason)
                            continue
                        log.debug("controller command ignored by the PS process",
                                  extra=kv(shard=self.server.shard_id, command=cmd.kind, cut_id=cmd.cut_id))
            except Exception as exc:  # the controller may be restarting: keep serving, try again
                log.warning("controller link: call failed", extra=kv(shard=self.server.shard_id, error=str(exc)[:200]))

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=5.0)
        self.client.close()
