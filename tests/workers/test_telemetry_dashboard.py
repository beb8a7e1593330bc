"""docs/grafana/metaps.json queries only metrics the code exports.

The exported names come from the real collectors: a worker's Telemetry (module
registry), an in-process PS shard's registry, a running controller's and an
agent's collectors -- each family expanded to its exposition sample names
(``_total`` for counters, ``_bucket``/``_sum``/``_count`` for histograms).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.registry import Collector

from controller.agent import Agent
from controller.config import AgentConfig
from controller.metrics import ControllerCollector, AgentCollector
from controller.server import ControllerServer
from tests.controller.conftest import EVAL, RPC, TRAIN, small_cfg
from tests.workers.conftest import make_job
from workers.telemetry import METRIC_NAMES, Telemetry

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docs" / "grafana" / "metaps.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", ""),
             "gauge": ("",), "unknown": ("",), "info": ("_info",)}


def _names(collectors: list[Any]) -> set[str]:
    out: set[str] = set()
    for c in collectors:
        for fam in c.collect():
            out.update(fam.name + s for s in _SUFFIXES.get(fam.type, ("",)))
            out.update(s.name for s in fam.samples)
    return out


def _queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash.get("templating", {}).get("list", []) if "metaps_" in str(v.get("query"))]
    return exprs


def test_every_dashboard_metric_is_exported(worker_data: dict[str, Path], tmp_path: Path) -> None:
    from ps.factory import build_server

    Telemetry(tmp_path / "run", rank=0, every=0)  # registers its series' labels
    job = make_job(worker_data["meta"], tmp_path)
    ps = build_server(job.ps, job.rpc, job.table_configs(), 0, wait_timeout_s=10.0)
    ctl = ControllerServer(small_cfg(), tmp_path / "ctl", (TRAIN, EVAL), RPC)
    ctl.start("127.0.0.1:0")
    try:
        agent = Agent(AgentConfig(heartbeat_s=0.2, restart_limit=0, backoff_s=0.0, backoff_max_s=0.0),
                      "worker", 0, ctl.address, RPC, [sys.executable, "-c", "pass"])
        collectors: list[Collector] = [REGISTRY, ps.metrics.registry, ControllerCollector(ctl), AgentCollector(agent)]
        exported = _names(collectors)
    finally:
        ctl.stop(grace=0)
    queried = {m for e in _queries() for m in re.findall(r"\bmetaps_[a-z0-9_]+", e)}
    assert len(queried) >= 20, sorted(queried)
    missing = sorted(queried - exported)
    assert not missing, f"docs/grafana/metaps.json queries metrics nobody exports: {missing}"
    # the worker series the module documents are exported under those names, and the dashboard shows them all
    assert set(METRIC_NAMES) <= exported
    assert set(METRIC_NAMES) - {"metaps_worker_step_seconds_sum", "metaps_worker_step_seconds_count"} <= queried
    # controller: shard states and events by kind
    assert {"metaps_controller_shards", "metaps_controller_events_by_kind"} <= queried


def test_dashboard_is_valid_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"]), p["title"]
