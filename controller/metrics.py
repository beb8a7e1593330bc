"""Prometheus metrics of the controller and of agents, read at scrape time.

The controller's numbers already live in its DDS, registry and event log; a
custom collector reads them when ``/metrics`` is scraped instead of mirroring
every transition into gauges.

Example::

    REGISTRY.register(ControllerCollector(server))
    port = serve_metrics(0)
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class ControllerCollector(Collector):
    """Shards by dataset and state, nodes by role and state, slow nodes, events (total and by kind),
    the job's batches done of its total (the ledger's coverage) and the run's state."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[GaugeMetricFamily]:
        shards = GaugeMetricFamily("metaps_controller_shards", "Shards of the current epoch by state",
                                   labels=["dataset", "state"])
        epoch = GaugeMetricFamily("metaps_controller_epoch", "Current epoch per dataset", labels=["dataset"])
        for p in self.server.dds.progress():
            for state in ("todo", "doing", "done"):
                shards.add_metric([p["dataset"], state], p[f"shards_{state}"])
            epoch.add_metric([p["dataset"]], p["epoch"])
        nodes = GaugeMetricFamily("metaps_controller_nodes", "Registered nodes by role and state",
                                  labels=["role", "state"])
        slow = GaugeMetricFamily("metaps_controller_slow_nodes", "Nodes flagged slow", labels=["role"])
        counts: dict[tuple[str, str], int] = {}
        slow_counts: dict[str, int] = {}
        for n in self.server.registry.nodes():
            counts[(n.role, n.state.value)] = counts.get((n.role, n.state.value), 0) + 1
            slow_counts[n.role] = slow_counts.get(n.role, 0) + int(bool(n.slow))
        for (role, state), c in sorted(counts.items()):
            nodes.add_metric([role, state], c)
        for role, c in sorted(slow_counts.items()):
            slow.add_metric([role], c)
        recorded = self.server.events.list(since=0)
        events = GaugeMetricFamily("metaps_controller_events", "Controller events recorded so far")
        events.add_metric([], len(recorded))
        by_kind = GaugeMetricFamily("metaps_controller_events_by_kind",
                                    "Controller events recorded so far by kind (slow, shrink_shards, restart, "
                                    "shards_requeued, move_vshards, checkpoint, ...)", labels=["kind"])
        kinds: dict[str, int] = {}
        for e in recorded:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        for kind, c in sorted(kinds.items()):
            by_kind.add_metric([kind], c)
        cov = self.server.dds.coverage()
        done = GaugeMetricFamily("metaps_controller_batches_done",
                                 "Batches of every requested epoch covered by the ledger (the job's progress)")
        done.add_metric([], cov.done_batches)
        total = GaugeMetricFamily("metaps_controller_batches_total", "Batches the whole job needs (every epoch)")
        total.add_metric([], cov.total_batches)
        state, _ = self.server.outcome.state()
        run = GaugeMetricFamily("metaps_controller_run_state", "1 for the run's current state (running, complete, "
                                "failed)", labels=["state"])
        for name in ("running", "complete", "failed"):
            run.add_metric([name], int(state.value == name))
        yield from (shards, epoch, nodes, slow, events, by_kind, done, total, run)


class AgentCollector(Collector):
    """An agent's child: alive, restarts."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = [self.agent.role, str(self.agent.index)]
        alive = GaugeMetricFamily("metaps_agent_child_alive", "1 while the supervised child runs",
                                  labels=["role", "index"])
        child = self.agent.child
        alive.add_metric(labels, int(child is not None and child.poll() is None))
        restarts = GaugeMetricFamily("metaps_agent_child_restarts", "Restarts of the supervised child",
                                     labels=["role", "index"])
        restarts.add_metric(labels, self.agent.restarts)
        yield from (alive, restarts)
