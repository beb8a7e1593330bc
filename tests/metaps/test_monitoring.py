"""metaps.monitoring and ``metaps monitor``: the committed alert rules are the code's, the
local stack's files point at the run's targets, and a directory without targets is refused.

(That ``metaps launch`` writes a targets file whose every endpoint answers during a run is
checked in tests/metaps/test_coverage_honest.py, on a fleet that test starts anyway; that the
rules read only exported metrics, in tests/controller/test_metrics.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from metaps.monitoring import ALERT_RULES, RULES_DOC, rules_yaml, write_stack, write_targets

REPO = Path(__file__).resolve().parents[2]


def test_committed_rules_file_is_the_codes() -> None:
    assert RULES_DOC.read_text() == rules_yaml(), "run: python -c 'from metaps.monitoring import *; " \
                                                  "RULES_DOC.write_text(rules_yaml())'"
    assert yaml.safe_load(RULES_DOC.read_text()) == ALERT_RULES  # the YAML a Prometheus parses is the data


def test_stack_files_point_at_the_targets(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_targets(run / "metrics" / "targets.json", {"worker-1": "127.0.0.1:9101", "ps-0": "127.0.0.1:9200",
                                                     "agent-worker-1": "127.0.0.1:9102"}, "run")
    groups = json.loads((run / "metrics" / "targets.json").read_text())
    by = {g["labels"]["process"]: g for g in groups}
    assert by["worker-1"]["targets"] == ["127.0.0.1:9101"]
    assert (by["worker-1"]["labels"]["role"], by["worker-1"]["labels"]["index"]) == ("worker", "1")
    assert by["agent-worker-1"]["labels"]["role"] == "agent" and by["ps-0"]["labels"]["metaps_run"] == "run"
    files = write_stack(run, prometheus_port=9999)
    prom = yaml.safe_load(files.prometheus.read_text())
    assert prom["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(files.targets)]
    assert prom["rule_files"] == [str(files.rules)] and yaml.safe_load(files.rules.read_text()) == ALERT_RULES
    ds = yaml.safe_load((files.grafana / "datasources" / "metaps.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://127.0.0.1:9999"
    assert (files.grafana / "dashboards" / "metaps.json").is_file()
    assert os.stat(files.targets).st_mode & 0o777 == 0o600 and os.stat(files.grafana).st_mode & 0o777 == 0o700


def _metaps(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))  # no prometheus on PATH here
    return subprocess.run([sys.executable, "-m", "metaps", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_monitor_command_prints_the_commands_or_refuses_in_one_line(tmp_path: Path) -> None:
    r = _metaps("monitor", "--run", str(tmp_path))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no targets file" in r.stderr and str(tmp_path / "metrics" / "targets.json") in r.stderr
    write_targets(tmp_path / "metrics" / "targets.json", {"controller": "127.0.0.1:9300"}, "x")
    r = _metaps("monitor", "--run", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "prometheus is not on PATH" in r.stdout and "prometheus --config.file=" in r.stdout
    r = _metaps("--json", "monitor", "--run", str(tmp_path))
    out = json.loads(r.stdout)  # exactly one JSON object
    assert out["started"] == [] and out["targets"] == str(tmp_path / "metrics" / "targets.json")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_monitor_stops_what_it_started_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM to `metaps monitor` stops the Prometheus it started and what that one started
    (a stand-in `prometheus` on PATH: a shell that starts a `sleep` and waits)."""
    import shutil
    import signal
    import time

    write_targets(tmp_path / "run" / "metrics" / "targets.json", {"controller": "127.0.0.1:9300"}, "x")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "prometheus"
    pids = tmp_path / "pids"
    fake.write_text(f'#!/bin/sh\nsleep 300 &\necho "$$ $!" > {pids}.tmp && mv {pids}.tmp {pids}\nwait\n')
    fake.chmod(0o700)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin:/bin")
    log = tmp_path / "monitor.log"  # printed by tests/conftest.py when the test fails
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "metaps", "monitor", "--run", str(tmp_path / "run"),
                                 "--prometheus-port", "1"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not pids.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids.exists(), log.read_text()
        started = [int(x) for x in pids.read_text().split()]
        assert all(_alive(pid) for pid in started)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text()
        deadline = time.monotonic() + 10  # the orphaned sleep is reaped by init
        while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if _alive(pid)], log.read_text()
        if shutil.which("setpriv"):  # a SIGKILLed monitor: its Prometheus gets the death signal
            pids.unlink()
            with log.open("ab") as out:
                proc = subprocess.Popen([sys.executable, "-m", "metaps", "monitor", "--run", str(tmp_path / "run"),
                                         "--prometheus-port", "1"], cwd=REPO, env=env, stdout=out,
                                        stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while not pids.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert pids.exists(), log.read_text()
            started = [int(x) for x in pids.read_text().split()]
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 10
            while _alive(started[0]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(started[0]), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
