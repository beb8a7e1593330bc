"""``metaps deploy k8s`` knobs (issue 39, item 2): each renders where it should, validates strictly,
and a bad value is refused in one line with nothing written; ``[log] format = "json"`` everywhere.

Cheap on purpose: one generation of a variant with every knob set (module fixture), the
defaults rendered in-process, refusals checked at the config level (one through the CLI).
Kubernetes objects validate with ``kubernetes-validate`` (strict: unknown fields fail) on 1.29
(the first with ``backoffLimitPerIndex`` on by default) and 1.32; the PodMonitor against
:data:`PODMONITOR_SCHEMA`, transcribed from the prometheus-operator CRD.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from common.errors import ConfigError
from common.log import JsonFormatter, LogConfig
from metaps.deploy.k8s import Options, render
from metaps.job import job_from_mapping

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("1.29.0", "1.32.0")
IMAGE = "registry.example/metaps:0.1.0"

KNOBS: dict[str, Any] = {
    "ttl_after_finished_s": 3600, "active_deadline_s": 86400, "ps_backoff_limit_per_index": 3,
    "image_pull_secrets": ["regcred", "mirror-cred"], "pod_monitor": True,
    "roles": {
        "ps": {"node_selector": {"pool": "ps", "cloud.example/disk": "ssd"},
               "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ps", "effect": "NoSchedule"},
                               {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                                "effect": "NoExecute", "tolerationSeconds": 600}],
               "affinity": {"podAntiAffinity": {
                   "requiredDuringSchedulingIgnoredDuringExecution": [
                       {"labelSelector": {"matchLabels": {"app.kubernetes.io/component": "ps"}},
                        "topologyKey": "topology.kubernetes.io/zone"}],
                   "preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 50, "podAffinityTerm": {"labelSelector": {"matchLabels": {"team": "ranking"}},
                                                          "topologyKey": "kubernetes.io/hostname"}}]}},
               "service_account": "metaps-ps"},
        "worker": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                       "nodeSelectorTerms": [{"matchExpressions": [
                           {"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}},
                   "service_account": "metaps-train"},
        "controller": {"node_selector": {"pool": "system"}},
        "data": {"service_account": "metaps-loader"},
        "deliver": {"node_selector": {"pool": "batch"}, "service_account": "metaps-publish"},
    },
}

# The PodMonitor fields metaps writes, as prometheus-operator's CRD types them
# (example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml, operator 0.91.0):
# spec.selector is required; podMetricsEndpoints[].port a string (the pod's port name),
# path a string, scheme one of http/https/HTTP/HTTPS; podTargetLabels strings. Every level
# refuses a field it does not list (a strict subset of the CRD: a misspelt field fails).
_LABEL_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["key", "operator"],
        "properties": {"key": {"type": "string"}, "operator": {"type": "string"},
                       "values": {"type": "array", "items": {"type": "string"}}}}}}}
PODMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
            "name": {"type": "string"}, "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector"], "properties": {
            "selector": _LABEL_SELECTOR,
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "jobLabel": {"type": "string"},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "podMetricsEndpoints": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"},
                    "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "path": {"type": "string"},
                    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                    "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                                 r"(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                    "honorLabels": {"type": "boolean"}}}}}}}}


def _raw(**deploy: Any) -> dict[str, Any]:
    raw = tomllib.loads((REPO / "configs" / "main_job.toml").read_text())
    if deploy:
        raw["deploy"] = deploy
    return raw


def _docs(files: dict[str, str]) -> list[dict[str, Any]]:
    return [d for name, text in files.items() if name != "kustomization.yaml"
            for d in yaml.safe_load_all(text) if d]


def _jobs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Job"}


def _templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {n: j["spec"]["template"] for n, j in _jobs(docs).items()}
    for d in docs:
        if d["kind"] == "CronJob":
            out[d["metadata"]["name"]] = d["spec"]["jobTemplate"]["spec"]["template"]
    return out


@pytest.fixture(scope="module")
def knobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    """Every knob set, ``[log] format = "json"``, generated by the CLI once: (objects, its stderr)."""
    from common.toml_writer import write

    tmp = tmp_path_factory.mktemp("knobs")
    raw = _raw(data_input="raw/train", data_schema="raw/schema.json", **KNOBS)
    raw["log"] = {"format": "json"}
    write(tmp / "job.toml", raw)
    env = {k: v for k, v in os.environ.items() if k != "METAPS_LOG_FORMAT"}
    r = subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(tmp / "job.toml"),
                        "--image", IMAGE, "--out", str(tmp / "out")], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    files = {p.name: p.read_text() for p in (tmp / "out").glob("*.yaml")}
    return _docs(files), r.stderr


@pytest.fixture(scope="module")
def defaults() -> list[dict[str, Any]]:
    raw = _raw()
    return _docs(render(job_from_mapping(raw, where="main_job.toml"), raw, Options(image=IMAGE)))


def test_every_object_validates_strictly(knobs: Any) -> None:
    docs, _ = knobs
    kinds = {d["kind"] for d in docs}
    assert {"Job", "CronJob", "PodMonitor"} <= kinds
    for d in docs:
        if d["kind"] == "PodMonitor":
            jsonschema.validate(d, PODMONITOR_SCHEMA)
            continue
        for version in VERSIONS:
            kubernetes_validate.validate(d, version, strict=True)


def test_job_lifetimes_ttl_on_every_job_deadline_on_training_jobs(knobs: Any, defaults: Any) -> None:
    docs, _ = knobs
    jobs = _jobs(docs)
    assert set(jobs) == {"metaps-controller", "metaps-ps", "metaps-worker", "metaps-data"}
    for name, job in jobs.items():
        assert job["spec"]["ttlSecondsAfterFinished"] == 3600, name
        assert job["spec"].get("activeDeadlineSeconds") == (None if name == "metaps-data" else 86400), name
    cron = [d for d in docs if d["kind"] == "CronJob"][0]["spec"]["jobTemplate"]["spec"]
    assert "ttlSecondsAfterFinished" not in cron and cron["activeDeadlineSeconds"] == 3600  # deliver_deadline_s
    for name, job in _jobs(defaults).items():  # unset: neither field
        assert not {"ttlSecondsAfterFinished", "activeDeadlineSeconds"} & set(job["spec"]), name


def test_ps_backoff_is_per_shard_and_keeps_the_failure_policy(knobs: Any, defaults: Any) -> None:
    docs, _ = knobs
    ps = _jobs(docs)["metaps-ps"]["spec"]
    assert ps["completionMode"] == "Indexed" and ps["template"]["spec"]["restartPolicy"] == "Never"
    assert ps["backoffLimitPerIndex"] == 3 and ps["maxFailedIndexes"] == 0
    assert "backoffLimit" not in ps  # a Job-wide count would pool every shard's failures again
    rules = ps["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules if r["action"] == "FailJob"] == ["FailJob"]  # exit 4 still fails the run
    assert not [r for r in rules if r["action"] == "FailIndex"]
    worker = _jobs(docs)["metaps-worker"]["spec"]
    assert "backoffLimitPerIndex" not in worker and worker["backoffLimit"] >= 6  # PS only
    plain = _jobs(defaults)["metaps-ps"]["spec"]
    assert plain["backoffLimit"] >= 6 and "backoffLimitPerIndex" not in plain and "maxFailedIndexes" not in plain


def test_placement_per_role_and_pull_secrets_on_every_pod(knobs: Any, defaults: Any) -> None:
    docs, _ = knobs
    t = {name.removeprefix("metaps-"): tpl["spec"] for name, tpl in _templates(docs).items()}
    assert set(t) == {"controller", "ps", "worker", "data", "deliver"}
    for role, spec in t.items():
        assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror-cred"}], role
        assert spec["automountServiceAccountToken"] is False, role  # an account, not its API token
        want = KNOBS["roles"][role]
        assert spec.get("serviceAccountName") == want.get("service_account"), role
        assert spec.get("nodeSelector") == want.get("node_selector"), role
    assert t["ps"]["tolerations"] == KNOBS["roles"]["ps"]["tolerations"]
    assert t["worker"]["tolerations"] == KNOBS["roles"]["worker"]["tolerations"]
    assert not any("tolerations" in t[r] for r in ("controller", "data", "deliver"))
    # the PS keeps its own spread across nodes, gains the zone rule and its preferred term after its own
    anti, mine = t["ps"]["affinity"]["podAntiAffinity"], KNOBS["roles"]["ps"]["affinity"]["podAntiAffinity"]
    own, *added = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert own["weight"] == 100 and own["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert own["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "metaps"
    assert added == mine["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"] == mine["requiredDuringSchedulingIgnoredDuringExecution"]
    assert t["worker"]["affinity"] == KNOBS["roles"]["worker"]["affinity"]
    for name, tpl in _templates(defaults).items():  # unset: none of them (the PS keeps its spread only)
        spec = tpl["spec"]
        assert not {"imagePullSecrets", "serviceAccountName", "nodeSelector", "tolerations"} & set(spec), name
        assert set(spec.get("affinity", {})) <= {"podAntiAffinity"}, name


def test_pod_monitor_scrapes_the_metrics_port_of_exactly_the_serving_pods(knobs: Any, defaults: Any) -> None:
    docs, _ = knobs
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    sel = pm["spec"]["selector"]

    def selects(labels: dict[str, str]) -> bool:
        if not sel["matchLabels"].items() <= labels.items():
            return False
        return all(labels.get(e["key"]) in e["values"] for e in sel["matchExpressions"] if e["operator"] == "In")
    chosen = {n for n, tpl in _templates(docs).items() if selects(tpl["metadata"]["labels"])}
    assert chosen == {"metaps-controller", "metaps-ps", "metaps-worker"}
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    for name in chosen:
        spec = _templates(docs)[name]["spec"]
        ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        assert ep["port"] in ports and ep["path"] == _templates(docs)[name]["metadata"]["annotations"][
            "prometheus.io/path"], name
    # strict: a misspelt field is refused
    bad = {**pm, "spec": {**pm["spec"], "podMetricEndpoints": pm["spec"]["podMetricsEndpoints"]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, PODMONITOR_SCHEMA)
    assert not [d for d in defaults if d["kind"] == "PodMonitor"]


def test_json_log_format_reaches_every_container_and_the_generator_itself(knobs: Any, defaults: Any) -> None:
    docs, stderr = knobs
    for name, tpl in _templates(docs).items():
        for c in tpl["spec"].get("initContainers", []) + tpl["spec"]["containers"]:
            assert {"name": "METAPS_LOG_FORMAT", "value": "json"} in c["env"], (name, c["name"])
    for tpl in _templates(defaults).values():
        for c in tpl["spec"].get("initContainers", []) + tpl["spec"]["containers"]:
            assert all(e["name"] != "METAPS_LOG_FORMAT" for e in c["env"])
    # `deploy k8s` read [log] from its --config: its warning about [faults] is a JSON line with its fields
    lines = [json.loads(line) for line in stderr.splitlines()]
    (warn,) = [rec for rec in lines if rec["message"].startswith("[faults] left out")]
    assert warn["level"] == "WARNING" and warn["logger"] == "metaps.deploy.k8s" and warn["role"] == "deploy"
    assert warn["job"].endswith("job.toml") and warn["time"].endswith("Z")


BAD: list[tuple[dict[str, Any], str]] = [
    ({"ttl_after_finished_s": 10}, "[deploy]: ttl_after_finished_s: expected 0 (none) or seconds >= 60, got 10"),
    ({"active_deadline_s": -5}, "[deploy]: active_deadline_s: expected 0 (none) or seconds >= 60, got -5"),
    ({"ps_backoff_limit_per_index": -1}, "[deploy]: ps_backoff_limit_per_index: expected a count >= 0"),
    ({"image_pull_secrets": ["Reg_Cred"]}, "[deploy]: image_pull_secrets: 'Reg_Cred' is not a Secret name"),
    ({"image_pull_secrets": "regcred"}, "key 'deploy.image_pull_secrets': expected a list, got str"),
    ({"pod_monitor": "yes"}, "key 'deploy.pod_monitor': expected bool, got str"),
    ({"roles": {"gpu": {}}}, "unknown key 'deploy.roles.gpu'"),
    ({"roles": {"ps": {"node_selector": {"pool name": "ps"}}}},
     "[deploy.roles.ps]: node_selector: key 'pool name' is not a label key"),
    ({"roles": {"ps": {"node_selector": {"pool": "a b"}}}}, "[deploy.roles.ps]: node_selector.pool: 'a b' is not"),
    ({"roles": {"worker": {"tolerations": [{"key": "gpu", "operator": "Exist"}]}}},
     "[deploy.roles.worker.tolerations[0]]: operator: expected 'Equal' or 'Exists', got 'Exist'"),
    ({"roles": {"worker": {"tolerations": [{"key": "gpu", "effect": "NoExec"}]}}},
     "[deploy.roles.worker.tolerations[0]]: effect: expected one of NoSchedule, PreferNoSchedule, NoExecute"),
    ({"roles": {"worker": {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "1"}]}}},
     "value: expected '' with operator 'Exists', got '1'"),
    ({"roles": {"worker": {"tolerations": [{"key": "gpu", "tolerationSeconds": 60}]}}},
     "tolerationSeconds: expected a count >= 0 with effect 'NoExecute', got 60 with effect ''"),
    ({"roles": {"worker": {"tolerations": [{"key": "gpu", "toleration_seconds": 60}]}}},
     "unknown key 'deploy.roles.worker.tolerations[0].toleration_seconds'"),
    ({"roles": {"ps": {"affinity": {"nodeAfinity": {}}}}},
     "[deploy.roles.ps]: affinity: expected keys among nodeAffinity, podAffinity, podAntiAffinity, got 'nodeAfinity'"),
    ({"roles": {"ps": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{}]}}}}},
     "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution: expected a table {nodeSelectorTerms"),
    ({"roles": {"ps": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": []}}}}}},
     "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution: expected a non-empty list of terms"),
    ({"roles": {"ps": {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": ["x"]}}}}},
     "affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution: expected each term to be a non-empty"),
    ({"roles": {"ps": {"affinity": {"podAffinity": {"preferred": []}}}}},
     "affinity.podAffinity: expected keys among requiredDuringSchedulingIgnoredDuringExecution"),
    ({"roles": {"ps": {"service_account": "Metaps PS"}}},
     "[deploy.roles.ps]: service_account 'Metaps PS' is not a Kubernetes object name"),
]


@pytest.mark.parametrize("deploy,words", BAD, ids=[w.split(":")[1 if w.startswith("[") else 0][:40] for _, w in BAD])
def test_a_bad_knob_is_refused_in_one_line_naming_the_key(deploy: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        job_from_mapping(_raw(**deploy), where="job.toml")
    msg = str(exc.value)
    assert words in msg and "\n" not in msg and msg.startswith("job.toml: "), msg


def test_a_bad_log_format_is_refused_in_one_line() -> None:
    raw = _raw()
    raw["log"] = {"format": "xml"}
    with pytest.raises(ConfigError, match=r"^job.toml: \[log\]: format: expected one of 'text', 'json', got 'xml'$"):
        job_from_mapping(raw, where="job.toml")
    assert job_from_mapping({**raw, "log": {"format": "json"}}, where="job.toml").log == LogConfig("json")


def test_the_cli_refuses_a_bad_knob_and_writes_nothing(tmp_path: Path) -> None:
    from common.toml_writer import write

    write(tmp_path / "job.toml", _raw(roles={"ps": {"tolerations": [{"key": "x", "operator": "Exist"}]}}))
    r = subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(tmp_path / "job.toml"),
                        "--image", IMAGE, "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "[deploy.roles.ps.tolerations[0]]: operator: expected 'Equal' or 'Exists', got 'Exist'" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_cli_process_writes_json_lines_with_its_fields(tmp_path: Path) -> None:
    """``METAPS_LOG_FORMAT=json`` (a process with no job file): every stderr line is one JSON
    object with time, level, logger, message and the line's structured fields."""
    env = {**os.environ, "METAPS_LOG_FORMAT": "json"}
    r = subprocess.run([sys.executable, "-m", "metaps", "gen-data", "--out", str(tmp_path / "logs"), "--rows", "300",
                        "--users", "30", "--items", "20", "--files", "1"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= rec.keys() for rec in lines)
    (gen,) = [rec for rec in lines if rec["message"] == "generating"]
    assert gen["logger"] == "meta_io.synth.generator" and gen["role"] == "gen-data"
    assert gen["rows"] == "300/300" and gen["file"] == "part-00.parquet"
    bad = subprocess.run([sys.executable, "-m", "metaps", "gen-data", "--out", str(tmp_path / "bad"), "--rows", "300"],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "METAPS_LOG_FORMAT": "xml"})
    assert bad.returncode == 1 and bad.stderr.strip() == \
        "metaps gen-data: error: METAPS_LOG_FORMAT: expected one of 'text', 'json', got 'xml'"
    assert not (tmp_path / "bad").exists()


def test_json_formatter_keeps_one_line_and_its_own_keys() -> None:
    rec = logging.LogRecord("ps.servicer", logging.ERROR, __file__, 1, "failed %s", ("twice",), None)
    rec.kv = {"shard": 1, "loss": float("nan"), "message": "a field named message", "path": Path("/x y"),
              "ok": True, "none": None}
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec.exc_info = sys.exc_info()
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == "failed twice" and out["kv_message"] == "a field named message"
    assert out["shard"] == 1 and out["loss"] == "nan" and out["path"] == "/x y" and out["ok"] is True
    assert out["none"] is None and out["level"] == "ERROR" and "ValueError: boom" in out["exc"]


def test_json_lines_read_back_like_key_value_lines(tmp_path: Path) -> None:
    """The launcher's log tail (step records for the live table and the run report) reads a
    worker's JSON lines as it reads its key=value lines."""
    from common.log import KeyValueFormatter
    from metaps.progress import StepLogTail, parse_kv_line

    rec = logging.LogRecord("workers.worker", logging.INFO, __file__, 1, "step", None, None)
    rec.kv = {"rank": 1, "step": 12, "loss": 0.6931, "samples_per_s": 250.5, "reason": "the PS died"}
    text, js = KeyValueFormatter().format(rec), JsonFormatter().format(rec)
    a, b = parse_kv_line(text), parse_kv_line(js)
    assert a is not None and b is not None
    assert {k: v for k, v in a.items() if k != "time"} == {k: v for k, v in b.items() if k not in ("time",)}
    assert abs(a["time"] - b["time"]) < 1.0 and parse_kv_line('{"not": "a log line"}') is None
    log_file = tmp_path / "worker-1.log"
    log_file.write_text(js + "\n")
    tail = StepLogTail({1: log_file})
    tail.poll()
    assert tail.latest()[1]["step"] == 12 and tail.latest()[1]["loss"] == 0.6931


def test_the_docs_knobs_example_and_overlay_render_as_written(tmp_path: Path) -> None:
    """docs/kubernetes.md's knobs section: its TOML renders, and its kustomize overlay over the
    generated directory applies every patch, each object still valid."""
    import re
    import shutil

    from metaps.deploy.k8s import write

    doc = (REPO / "docs" / "kubernetes.md").read_text()
    section = doc[doc.index("## Knobs:"):doc.index("## 4. Watch")]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    (example,) = [tomllib.loads(b) for lang, b in blocks if lang == "toml"]
    (overlay,) = [b for lang, b in blocks if lang == "yaml"]
    raw = {**_raw(**example["deploy"]), "log": example["log"]}
    write(render(job_from_mapping(raw, where="job.toml"), raw, Options(image=IMAGE)), tmp_path / "k8s" / "main")
    (tmp_path / "overlays" / "prod").mkdir(parents=True)
    (tmp_path / "overlays" / "prod" / "kustomization.yaml").write_text(overlay)
    assert shutil.which("kubectl"), "kubectl (with kustomize) is required on test machines"
    r = subprocess.run(["kubectl", "kustomize", str(tmp_path / "overlays" / "prod")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    for d in docs:
        assert d["metadata"]["labels"]["team"] == "ranking", d["kind"]
        if d["kind"] == "PodMonitor":
            jsonschema.validate(d, PODMONITOR_SCHEMA)
            assert d["metadata"]["labels"]["release"] == "prometheus"
        else:
            kubernetes_validate.validate(d, VERSIONS[-1], strict=True)
    t = _templates(docs)
    worker = t["ctr-worker"]
    assert worker["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["HTTPS_PROXY"] == "http://proxy.internal:3128" and env["METAPS_LOG_FORMAT"] == "json"
    assert t["ctr-ps"]["spec"]["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "DoNotSchedule"
    assert _jobs(docs)["ctr-ps"]["spec"]["backoffLimitPerIndex"] == 3


def test_a_commands_log_format_comes_from_its_job_file_and_its_sets(tmp_path: Path) -> None:
    """What ``metaps COMMAND --config JOB [--set log.format=...]`` logs in, before the command runs."""
    from metaps.cli import job_log_format

    job = tmp_path / "job.toml"
    job.write_text('[log]\nformat = "json"\n')
    assert job_log_format(str(job)) == "json" and job_log_format(str(job), ["log.format=text"]) == "text"
    assert job_log_format("", ["ps.shards=2", "log.format=json"]) == "json"
    assert job_log_format(None) == job_log_format(str(tmp_path / "missing.toml")) == ""  # the command reports it
    assert job_log_format(str(job), ["ps.shards=2"]) == "json"
    with pytest.raises(ConfigError, match=r"\[log\]: format: expected one of 'text', 'json', got 'xml'$"):
        job_log_format("", ["log.format=xml"])
    job.write_text('[log]\nformat = "yaml"\n')
    with pytest.raises(ConfigError, match=r"job.toml: \[log\]: format: expected one of 'text', 'json', got 'yaml'$"):
        job_log_format(str(job))
