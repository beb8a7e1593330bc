"""Where a run's metrics are, and how to watch them: Prometheus targets, scrape config, alert rules.

Every metaps process serves Prometheus ``/metrics`` on its own port and logs the address
at start (``msg="metrics endpoint"``, :func:`common.metrics.serve_metrics`). A
fleet's ports are picked at start, so ``metaps launch`` writes them down:

* ``RUN/metrics/targets.json``: every process's endpoint in Prometheus' ``file_sd``
  format (:func:`write_targets`), labelled ``metaps_run``, ``role``, ``index`` and
  ``process``; rewritten atomically whenever the fleet changes, so a Prometheus reading
  it (``file_sd_configs``) follows the run without a reload. A worker that finished
  leaves it, and it is emptied (``[]``) when the run succeeds: Prometheus drops those
  targets, so a run that ended well raises no ``MetapsTargetDown``; a failed or
  interrupted run keeps its targets (its processes are down: worth an alert).

``metaps monitor --run RUN`` (:mod:`metaps.roles.monitor`) turns that into a local
monitoring stack, by :func:`write_stack`:

* ``RUN/metrics/prometheus.yml``: a scrape config over the targets file, every 5 s, with
  the alert rules loaded;
* ``RUN/metrics/alerts.yml``: :data:`ALERT_RULES`, the conditions the controller knows
  (a slow node, training stalled with work left, a PS or worker down, the run failed),
  the same file as ``docs/grafana/alerts.yml`` (a test keeps them equal);
* ``RUN/metrics/grafana/``: Grafana provisioning, a Prometheus data source on the local
  Prometheus and the repository's dashboard (``docs/grafana/metaps.json``).

It starts ``prometheus`` (and ``grafana-server``) when they are on ``PATH``, each in a
process group of its own that it stops (SIGTERM, then SIGKILL) when it ends (SIGINT,
SIGTERM, SIGHUP), and otherwise prints the commands that would, so the files are useful either way.

On Kubernetes none of this is needed: every pod carries ``prometheus.io/*``
annotations (``metaps deploy k8s``) and the same rules file loads into any Prometheus.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.atomic_write import PRIVATE_FILE_MODE, write_text_atomic
from common.errors import MetapsError
from metaps.deploy.yaml_out import dumps

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana" / "metaps.json"
"""The Grafana dashboard shipped with the repository."""
RULES_DOC = REPO / "docs" / "grafana" / "alerts.yml"
"""The committed copy of :data:`ALERT_RULES` (for a Prometheus outside ``metaps monitor``)."""
SCRAPE_INTERVAL_S = 5


class MonitoringError(MetapsError):
    """A run directory without a targets file, or a monitoring file that cannot be written."""


ALERT_RULES: dict[str, Any] = {"groups": [{
    "name": "metaps",
    "rules": [
        {"alert": "MetapsStraggler",
         "expr": "max by (metaps_run) (metaps_controller_slow_nodes) > 0",
         "for": "1m", "labels": {"severity": "warning"},
         "annotations": {"summary": "run {{ $labels.metaps_run }}: a node is flagged slow",
                         "description": "The controller's monitor flagged {{ $value }} node(s) slow for a minute; "
                                        "its policy moves shards (ND) or batch share (DD) away from them."}},
        {"alert": "MetapsTrainingStalled",
         "expr": "(metaps_controller_batches_done < metaps_controller_batches_total) "
                 "and on (metaps_run) (delta(metaps_controller_batches_done[10m]) <= 0) "
                 "and on (metaps_run) (metaps_controller_run_state{state=\"running\"} == 1)",
         "for": "5m", "labels": {"severity": "critical"},
         "annotations": {"summary": "run {{ $labels.metaps_run }}: coverage stuck",
                         "description": "No batch covered in 15 minutes while the run has batches left; "
                                        "`metaps status --config RUNS/{{ $labels.metaps_run }}/job.toml` shows "
                                        "its nodes and datasets."}},
        {"alert": "MetapsPsDown",
         "expr": "max by (metaps_run) (metaps_controller_nodes{role=\"ps\",state=\"dead\"}) > 0",
         "for": "1m", "labels": {"severity": "critical"},
         "annotations": {"summary": "run {{ $labels.metaps_run }}: a PS shard is down",
                         "description": "The controller holds {{ $value }} PS shard(s) dead: training on its rows "
                                        "waits for its restart and recovery."}},
        {"alert": "MetapsWorkerDown",
         "expr": "max by (metaps_run) (metaps_controller_nodes{role=\"worker\",state=\"dead\"}) > 0",
         "for": "5m", "labels": {"severity": "warning"},
         "annotations": {"summary": "run {{ $labels.metaps_run }}: a worker is down",
                         "description": "{{ $value }} worker(s) dead for 5 minutes; their shards were requeued."}},
        {"alert": "MetapsRunFailed",
         "expr": "max by (metaps_run) (metaps_controller_run_state{state=\"failed\"}) > 0",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "run {{ $labels.metaps_run }} failed",
                         "description": "Why: `metaps status --config RUNS/{{ $labels.metaps_run }}/job.toml` "
                                        "(RUNS: the job's [run] dir; the run's token is read from the 0600 "
                                        "rpc.token its job.toml names), or the controller's termination "
                                        "message on Kubernetes."}},
        {"alert": "MetapsTargetDown",
         "expr": "up{job=\"metaps\"} == 0",
         "for": "2m", "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $labels.process }} of run {{ $labels.metaps_run }} does not answer "
                                    "/metrics",
                         "description": "A process of a running (or failed, or interrupted) run: `metaps launch` "
                                        "takes a finished worker out of the targets file, and every process "
                                        "once the run succeeded, so a run that ended well raises none."}},
    ],
}]}
"""Prometheus alerting rules over the controller's metrics (``controller/metrics.py``)."""


def _write(path: Path, text: str) -> Path:
    """``text`` to ``path`` atomically, folders made; private (files 0600, folders 0700): the
    local Prometheus and Grafana run as the same user."""
    try:
        missing = [d for d in [path.parent, *path.parent.parents] if not d.exists()]
        for d in reversed(missing):  # each new folder 0700 (mkdir(parents=True) leaves the umask's mode)
            d.mkdir(mode=0o700)
            d.chmod(0o700)
        return write_text_atomic(path, text, mode=PRIVATE_FILE_MODE)
    except OSError as exc:
        raise MonitoringError(f"{path}: cannot write ({exc.strerror or exc})") from exc


def rules_yaml() -> str:
    """:data:`ALERT_RULES` as the YAML Prometheus loads."""
    return "# generated from metaps/monitoring.py (ALERT_RULES); `metaps monitor` writes the same file\n" + \
        dumps(ALERT_RULES)


def _role_index(process: str) -> tuple[str, str]:
    """``worker-3`` -> (``worker``, ``3``); ``agent-ps-1`` -> (``agent``, ``1``); ``controller`` -> (``controller``, ``0``)."""
    head, _, tail = process.rpartition("-")
    if head and tail.isdigit():
        return head.split("-", 1)[0], tail
    return process, "0"


def target_groups(endpoints: Mapping[str, str], run_name: str) -> list[dict[str, Any]]:
    """``file_sd`` target groups: one per process.

    Args:
        endpoints: process name (``controller``, ``ps-0``, ``worker-1``, ``agent-worker-1``) -> ``host:port``
            of its ``/metrics``.
        run_name: the run's name (label ``metaps_run``).
    """
    out = []
    for process, address in sorted(endpoints.items()):
        role, index = _role_index(process)
        out.append({"targets": [address],
                    "labels": {"job": "metaps", "metaps_run": run_name, "role": role, "index": index,
                               "process": process}})
    return out


def write_targets(path: Path, endpoints: Mapping[str, str], run_name: str) -> Path:
    """Write :func:`target_groups` to ``path`` atomically (0600, as every file of a run)."""
    return _write(path, json.dumps(target_groups(endpoints, run_name), indent=1) + "\n")


def prometheus_config(targets_file: Path, rules_file: Path) -> dict[str, Any]:
    """A Prometheus configuration that scrapes the targets file's endpoints and loads the rules."""
    return {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "rule_files": [str(rules_file)],
            "scrape_configs": [{"job_name": "metaps",
                                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}]}]}


@dataclass(frozen=True)
class MonitoringFiles:
    """What :func:`write_stack` wrote.

    Args:
        targets: the run's ``file_sd`` targets file (written by ``metaps launch``).
        prometheus: the Prometheus configuration.
        rules: the alert rules.
        grafana: the Grafana provisioning directory (data source + dashboard provider).
        commands: the commands that start Prometheus and Grafana on these files.
    """

    targets: Path
    prometheus: Path
    rules: Path
    grafana: Path
    commands: tuple[tuple[str, ...], ...]


def write_stack(run_dir: Path, prometheus_port: int = 9090, grafana_port: int = 3000) -> MonitoringFiles:
    """Write the Prometheus config, the rules and Grafana provisioning for ``run_dir``'s targets.

    Args:
        run_dir: a run directory of ``metaps launch`` (with ``metrics/targets.json``).
        prometheus_port: where the local Prometheus listens (and Grafana's data source points).
        grafana_port: where Grafana listens.

    Raises:
        MonitoringError: no targets file in ``run_dir``.
    """
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics"
    targets = metrics / "targets.json"
    if not targets.is_file():
        raise MonitoringError(f"{targets}: no targets file (not a run directory of `metaps launch`, or a run "
                              f"from before targets files)")
    rules = _write(metrics / "alerts.yml", rules_yaml())
    prom = _write(metrics / "prometheus.yml", dumps(prometheus_config(targets, rules)))
    graf = metrics / "grafana"
    datasource = {"apiVersion": 1, "datasources": [{
        "name": "Prometheus", "type": "prometheus", "access": "proxy", "uid": "metaps-prometheus",
        "url": f"http://127.0.0.1:{prometheus_port}", "isDefault": True}]}
    _write(graf / "datasources" / "metaps.yml", dumps(datasource))
    dashboards = graf / "dashboards"
    provider = {"apiVersion": 1, "providers": [{"name": "metaps", "type": "file", "allowUiUpdates": True,
                                                "options": {"path": str(dashboards)}}]}
    _write(graf / "dashboards" / "provider.yml", dumps(provider))
    if DASHBOARD.is_file():
        _write(dashboards / DASHBOARD.name, DASHBOARD.read_text())
    commands = (
        ("prometheus", f"--config.file={prom}", f"--storage.tsdb.path={metrics / 'prometheus-data'}",
         f"--web.listen-address=127.0.0.1:{prometheus_port}"),
        ("grafana-server", f"cfg:default.paths.provisioning={graf}", f"cfg:default.server.http_port={grafana_port}",
         "cfg:default.server.http_addr=127.0.0.1"),
    )
    return MonitoringFiles(targets=targets, prometheus=prom, rules=rules, grafana=graf, commands=commands)
