"""The controller's and agents' Prometheus collectors read live state at scrape time."""

from __future__ import annotations

import sys
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import start_http_server

from controller.agent import Agent
from controller.config import AgentConfig
from controller.metrics import AgentCollector, ControllerCollector
from tests.ports import pick_port

from tests.controller.conftest import RPC, client


def _scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_controller_collector_tracks_shards_and_nodes(controller) -> None:
    srv = controller()
    reg = CollectorRegistry()
    reg.register(ControllerCollector(srv))
    text = _scrape(reg)
    assert 'metaps_controller_shards{dataset="train",state="todo"}' in text
    c = client(srv, index=0)
    lease = c.get_shard("train").lease
    c.report_shard(lease, "done", samples=4)
    text = _scrape(reg)
    assert 'metaps_controller_shards{dataset="train",state="done"} 1.0' in text
    assert 'metaps_controller_nodes{role="worker",state=' in text
    # served over HTTP like every other process
    port = pick_port()
    start_http_server(port, addr="127.0.0.1", registry=reg)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "metaps_controller_events" in body
    c.close()


def test_agent_collector_reports_child_and_restarts(controller) -> None:
    srv = controller()
    agent = Agent(AgentConfig(heartbeat_s=0.2, restart_limit=0, backoff_s=0.0, backoff_max_s=0.0),
                  "worker", 3, srv.address, RPC, [sys.executable, "-c", "pass"])
    reg = CollectorRegistry()
    reg.register(AgentCollector(agent))
    text = _scrape(reg)
    assert 'metaps_agent_child_alive{index="3",role="worker"} 0.0' in text
    assert 'metaps_agent_child_restarts{index="3",role="worker"} 0.0' in text


def test_alert_rules_read_only_metrics_the_controller_exports(controller) -> None:
    """Every metric an alert rule of metaps.monitoring reads is one a real controller's /metrics
    serves (a renamed gauge would leave its alert silently never firing)."""
    import re

    from metaps.monitoring import ALERT_RULES

    srv = controller()
    reg = CollectorRegistry()
    reg.register(ControllerCollector(srv))
    text = _scrape(reg)
    assert "metaps_controller_batches_total " in text and 'metaps_controller_run_state{state="running"} 1.0' in text
    exported = set(re.findall(r"^# TYPE (metaps_\w+)", text, re.M))  # families, with or without samples yet
    for rule in ALERT_RULES["groups"][0]["rules"]:
        used = set(re.findall(r"\b(metaps_\w+)\b", rule["expr"])) - {"metaps_run"}  # metaps_run: a label
        assert used <= exported, (rule["alert"], used - exported)
