"""``metaps deploy k8s``: manifests validate offline, render with kustomize, and are wired right.

Validation: ``kubernetes-validate`` (strict: unknown fields fail) against the Kubernetes
1.28 and 1.32 OpenAPI schemas (1.28 is the oldest that kubernetes-validate 1.37.0 ships; the
versions between cost seconds the suite does not have); rendering: ``kubectl kustomize`` (no
cluster needed). ``METAPS_K8S_VERSIONS`` (comma-separated) replaces the versions for a one-off
check with another kubernetes-validate, e.g. the floor docs/kubernetes.md states, 1.27::

    pip install --no-deps --target /tmp/kv130 kubernetes-validate==1.30.0   # ships 1.22-1.30
    PYTHONPATH=/tmp/kv130 METAPS_K8S_VERSIONS=1.27.0 python -m pytest tests/deploy/test_k8s_manifests.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from metaps.job import job_from_mapping

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.32.0"
K8S_VERSIONS = tuple(os.environ.get("METAPS_K8S_VERSIONS", f"1.28.0,{K8S_VERSION}").split(","))
"""Every object of every variant validates strictly on each: the oldest, then the newest."""
IMAGE = "registry.example/metaps:0.1.0"
SOURCE = "s3://bucket/ctr/2026-12-01"


def generate(out: Path, config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(config), "--image", IMAGE,
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=120, cwd=REPO)


def kustomize(out: Path) -> list[dict[str, Any]]:
    assert shutil.which("kubectl"), "kubectl (with kustomize) is required on test machines"
    r = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for d in docs:
        if d["kind"] == "Job":
            out[d["metadata"]["name"]] = d["spec"]["template"]
        elif d["kind"] == "CronJob":
            out[d["metadata"]["name"]] = d["spec"]["jobTemplate"]["spec"]["template"]
    return out


def _variant(tmp_path: Path, name: str, edit: Any) -> Path:
    raw = tomllib.loads((REPO / "configs" / "main_job.toml").read_text())
    edit(raw)
    from common.toml_writer import write

    p = tmp_path / f"{name}.toml"
    write(p, raw)
    return p


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("k8s")

    def data_job(raw: dict[str, Any]) -> None:
        raw["deploy"] = {"data_input": "raw/train", "data_eval_input": "raw/holdout", "data_schema": "raw/schema.json",
                         "deliver_args": ["--incremental", "--keep", "5"]}

    def allreduce(raw: dict[str, Any]) -> None:
        raw["train"]["dense_sync"] = "allreduce"
        raw["train"]["workers"] = 3

    def per_role(raw: dict[str, Any]) -> None:
        data_job(raw)
        raw["deploy"].update(storage="per-role", data_source=SOURCE, stage_size="20Gi",
                             stage_storage_class="local-nvme")

    out = {}
    for name, cfg, extra in [
        ("cpu", REPO / "configs" / "main_job.toml", ["--namespace", "ctr"]),
        ("gpu", _variant(tmp, "gpu", data_job), ["--gpu"]),
        ("allreduce", _variant(tmp, "ar", allreduce), []),
        ("per-role", _variant(tmp, "per_role", per_role), []),
    ]:
        d = tmp / name
        r = generate(d, cfg, *extra)
        assert r.returncode == 0, r.stderr
        out[name] = (d, kustomize(d))
    return out


@pytest.mark.parametrize("variant", ["cpu", "gpu", "allreduce", "per-role"])
def test_every_object_validates_against_the_kubernetes_schemas(rendered: Any, variant: str) -> None:
    _, docs = rendered[variant]
    kinds = sorted(d["kind"] for d in docs)
    for version in K8S_VERSIONS:
        for d in docs:
            kubernetes_validate.validate(d, version, strict=True)
    assert {"ConfigMap", "Secret", "Service", "PersistentVolumeClaim", "Job", "CronJob",
            "PodDisruptionBudget", "NetworkPolicy"} <= set(kinds)
    # every long-running role is a Job: it completes when the run ends (no Deployment or
    # StatefulSet restarts a finished controller or PS, or rolls the PS on an apply)
    assert not {"Deployment", "StatefulSet"} & set(kinds)


def _job(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return [j for j in by_kind(docs, "Job") if j["metadata"]["name"] == name][0]


def test_every_failure_policy_rule_names_its_pod_conditions_for_the_older_schemas(rendered: Any) -> None:
    """The 1.25-1.28 OpenAPI schemas require ``onPodConditions`` on every podFailurePolicy rule
    (kubernetes/api#48): an exit-code rule carries an explicit ``[]``, so the three Jobs validate
    on 1.28; the same rule without it is refused there (and accepted on 1.29)."""
    jobs = [j for variant in rendered.values() for j in by_kind(variant[1], "Job") if "podFailurePolicy" in j["spec"]]
    assert {j["metadata"]["name"] for j in jobs} >= {"metaps-controller", "metaps-ps", "metaps-worker"}
    for job in jobs:
        for rule in job["spec"]["podFailurePolicy"]["rules"]:
            assert "onPodConditions" in rule, (job["metadata"]["name"], rule)
            if "onExitCodes" in rule:  # one of the two matches: an exit-code rule's conditions are empty
                assert rule["onPodConditions"] == [], (job["metadata"]["name"], rule)
    job = jobs[0]
    bare = {**job, "spec": {**job["spec"], "podFailurePolicy": {"rules": [
        {k: v for k, v in r.items() if not (k == "onPodConditions" and not v)}
        for r in job["spec"]["podFailurePolicy"]["rules"]]}}}
    with pytest.raises(kubernetes_validate.ValidationError, match="onPodConditions"):
        kubernetes_validate.validate(bare, K8S_VERSIONS[0], strict=True)
    kubernetes_validate.validate(bare, "1.29.0", strict=True)


def test_strict_validation_catches_a_misspelt_field(rendered: Any) -> None:
    _, docs = rendered["cpu"]
    ps = dict(_job(docs, "metaps-ps"))
    ps["spec"] = {**ps["spec"], "completionMod": "Indexed"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ps, K8S_VERSION, strict=True)


def test_counts_ports_and_selectors_match_the_job_file(rendered: Any) -> None:
    _, docs = rendered["cpu"]
    raw = tomllib.loads((REPO / "configs" / "main_job.toml").read_text())
    assert all(d["metadata"].get("namespace") == "ctr" for d in docs)
    ps = _job(docs, "metaps-ps")
    assert ps["spec"]["completions"] == ps["spec"]["parallelism"] == raw["ps"]["shards"]
    assert ps["spec"]["completionMode"] == "Indexed" and ps["spec"]["template"]["spec"]["subdomain"] == "metaps-ps"
    job = _job(docs, "metaps-worker")
    assert job["spec"]["parallelism"] == raw["train"]["workers"]
    assert "completions" not in job["spec"] and "completionMode" not in job["spec"]  # the work-queue pattern
    ctl = _job(docs, "metaps-controller")
    assert ctl["spec"]["completions"] == ctl["spec"]["parallelism"] == 1
    templates = pod_templates(docs)
    for svc in by_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        matched = [n for n, t in templates.items() if sel.items() <= t["metadata"]["labels"].items()]
        assert matched == [svc["metadata"]["name"]], (svc["metadata"]["name"], matched)
        ports = {p["name"]: p["containerPort"] for c in templates[matched[0]]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert ports[p.get("targetPort", p["name"])] == p["port"]
    assert [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "metaps-ps"][0]["spec"]["clusterIP"] == "None"
    for name, t in templates.items():
        for c in t["spec"]["containers"]:
            container_ports = {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    assert c[probe]["grpc"]["port"] in container_ports, (name, probe)
            if name in ("metaps-controller", "metaps-ps"):
                assert c["readinessProbe"]["grpc"]["port"] == {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
        ann = t["metadata"]["annotations"]
        if name in ("metaps-controller", "metaps-ps", "metaps-worker"):
            port = ann["prometheus.io/port"]
            assert ann["prometheus.io/scrape"] == "true" and port != "9100"
            assert any(str(p["containerPort"]) == port for c in t["spec"]["containers"] for p in c["ports"])
        else:
            assert ann["prometheus.io/scrape"] == "false"


def test_no_token_in_any_configmap_or_env_value_and_the_secret_is_a_0400_file(rendered: Any) -> None:
    out, docs = rendered["cpu"]
    token = (out / "token").read_text().strip()
    assert len(token) >= 32 and (out / "token").stat().st_mode & 0o777 == 0o600
    for cm in by_kind(docs, "ConfigMap"):
        for text in cm["data"].values():
            assert token not in text
            job = tomllib.loads(text)
            assert "token" not in job["rpc"] and job["rpc"]["token_file"] == "/run/metaps/token"
    secret = by_kind(docs, "Secret")[0]
    for name, t in pod_templates(docs).items():
        spec = t["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            for e in c.get("env", []):
                assert token not in str(e.get("value", "")) and "TOKEN" not in e["name"], (name, e)
            assert token not in " ".join(c.get("args", []) + c.get("command", []))
        for v in spec["volumes"]:
            if "secret" in v:
                assert v["secret"]["secretName"] == secret["metadata"]["name"] and v["secret"]["defaultMode"] == 0o400


def test_the_configmap_job_is_the_job_file(rendered: Any) -> None:
    _, docs = rendered["cpu"]
    raw = tomllib.loads((REPO / "configs" / "main_job.toml").read_text())
    pod = tomllib.loads(by_kind(docs, "ConfigMap")[0]["data"]["job.toml"])
    job_from_mapping(pod, where="configmap")  # a valid job
    assert raw["faults"] and "faults" not in pod  # the demo's fault injection never ships into a cluster
    for section in raw:
        if section not in ("rpc", "ps", "faults"):
            assert pod[section] == raw[section], section
    assert {k: v for k, v in pod["ps"].items() if k != "host"} == raw["ps"] and pod["ps"]["host"] == "0.0.0.0"


def test_gpu_variant_cuda_image_gpu_limits_data_and_delivery(rendered: Any) -> None:
    _, docs = rendered["gpu"]
    templates = pod_templates(docs)
    for name, t in templates.items():
        for c in t["spec"]["containers"]:
            assert c["image"] == IMAGE + "-cuda"
            has_gpu = "nvidia.com/gpu" in c["resources"]["limits"]
            assert has_gpu == (name in ("metaps-ps", "metaps-worker")), name
    data = templates["metaps-data"]["spec"]
    assert [c["args"][:2] for c in data["initContainers"] + data["containers"]] == [["meta-io", "build"]] * 2
    assert data["containers"][0]["args"][data["containers"][0]["args"].index("--out") + 1] == "runs/main/metaio"
    cron = by_kind(docs, "CronJob")[0]
    assert cron["spec"]["schedule"] == "0 * * * *" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    args = templates["metaps-deliver"]["spec"]["containers"][0]["args"]
    # gated on the job's eval data (held-out users): deliver refuses to publish ungated unless told
    assert args == ["deliver", "--run", "runs/main/runs/main", "--out", "runs/main/bundles",
                    "--holdout", "runs/main/metaio-holdout", "--incremental", "--keep", "5", "--if-checkpoint"]


def test_allreduce_is_an_indexed_job_with_fixed_ranks(rendered: Any) -> None:
    _, docs = rendered["allreduce"]
    job = [j for j in by_kind(docs, "Job") if j["metadata"]["name"] == "metaps-worker"][0]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    spec = job["spec"]["template"]["spec"]
    assert spec["subdomain"] == "metaps-worker"
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["METAPS_ALLREDUCE"].startswith("metaps-worker-0.metaps-worker:")


def test_a_token_in_the_job_file_is_refused_and_nothing_written(tmp_path: Path) -> None:
    cfg = _variant(tmp_path, "tok", lambda raw: raw["rpc"].update(token="s3cret-s3cret"))
    r = generate(tmp_path / "out", cfg)
    assert r.returncode == 1
    assert "[rpc] token is set" in r.stderr and "s3cret" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_bad_deploy_key_names_the_key(tmp_path: Path) -> None:
    cfg = _variant(tmp_path, "bad", lambda raw: raw.update(deploy={"metrics_port": 9100}))
    r = generate(tmp_path / "out", cfg)
    assert r.returncode == 1 and "[deploy]: metrics_port 9100 is node_exporter's" in r.stderr
    cfg = _variant(tmp_path, "bad2", lambda raw: raw.update(deploy={"resources": {"ps": {"memory": "4 GB"}}}))
    r = generate(tmp_path / "out", cfg)
    assert r.returncode == 1 and "memory '4 GB' is not a Kubernetes quantity" in r.stderr, r.stderr


def test_a_delivery_cronjob_without_a_gate_is_refused_naming_the_fix(tmp_path: Path) -> None:
    def no_eval(raw: dict[str, Any]) -> None:
        raw["data"]["eval"] = ""
        raw.setdefault("delivery", {}).pop("holdout", None)

    r = generate(tmp_path / "out", _variant(tmp_path, "nogate", no_eval))
    assert r.returncode == 1 and "--no-gate" in r.stderr and "[delivery] holdout" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()

    def explicit(raw: dict[str, Any]) -> None:
        no_eval(raw)
        raw.setdefault("deploy", {})["deliver_args"] = ["--no-gate"]

    r = generate(tmp_path / "out2", _variant(tmp_path, "nogate2", explicit))
    assert r.returncode == 0, r.stderr
    cron = [d for d in kustomize(tmp_path / "out2") if d["kind"] == "CronJob"][0]
    args = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--no-gate" in args and "--holdout" not in args


def test_the_run_outcome_is_the_jobs_outcome(rendered: Any) -> None:
    """podFailurePolicy: exit 4 (the run failed) fails the Job; disruptions, SIGTERM exits and
    fenced-off processes do not count toward backoffLimit; the controller ends the fleet."""
    _, docs = rendered["cpu"]
    for name, container in (("metaps-controller", "controller"), ("metaps-ps", "ps"), ("metaps-worker", "worker")):
        job = _job(docs, name)
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never", name  # podFailurePolicy needs it
        rules = job["spec"]["podFailurePolicy"]["rules"]
        fail = [r for r in rules if r["action"] == "FailJob"]
        assert fail == [{"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In",
                                                              "values": [4]}, "onPodConditions": []}], name
        ignored = {c for r in rules if r["action"] == "Ignore" for c in r.get("onExitCodes", {}).get("values", [])}
        assert 143 in ignored and 4 not in ignored and 1 not in ignored, name
        assert any(r["action"] == "Ignore" and r.get("onPodConditions") == [{"type": "DisruptionTarget",
                                                                             "status": "True"}] for r in rules)
        c = job["spec"]["template"]["spec"]["containers"][0]
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
        assert env["METAPS_POD_UID"] == "metadata.uid", name  # a replaced pod's new identity
    args = _job(docs, "metaps-controller")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--exit-when-done" in args and args[args.index("--termination-log") + 1] == "/dev/termination-log"
    assert 5 in {c for r in _job(docs, "metaps-worker")["spec"]["podFailurePolicy"]["rules"]
                 for c in r.get("onExitCodes", {}).get("values", []) if r["action"] == "Ignore"}


def test_the_ps_is_protected(rendered: Any) -> None:
    _, docs = rendered["cpu"]
    pdb = [p for p in by_kind(docs, "PodDisruptionBudget") if p["metadata"]["name"] == "metaps-ps"][0]
    ps = _job(docs, "metaps-ps")
    spec = ps["spec"]["template"]["spec"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= ps["spec"]["template"]["metadata"]["labels"].items()
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    c = spec["containers"][0]
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 1800  # a warm start's restore fits
    assert "initialDelaySeconds" not in c["livenessProbe"]
    assert "shareProcessNamespace" not in spec  # identity no longer rides on pids
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["metaps", "cut"] and int(hook[hook.index("--wait") + 1]) < spec["terminationGracePeriodSeconds"]
    assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    args = c["args"]
    assert args[args.index("--shard") + 1] == "auto" and args[args.index("--advertise") + 1] == \
        "metaps-ps-$(METAPS_INDEX).metaps-ps"
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["METAPS_INDEX"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    cron = by_kind(docs, "CronJob")[0]["spec"]
    assert cron["concurrencyPolicy"] == "Forbid" and cron["startingDeadlineSeconds"] > 0
    assert cron["jobTemplate"]["spec"]["activeDeadlineSeconds"] == 3600
    assert "--if-checkpoint" in cron["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_priority_class_and_a_strict_disruption_budget_are_configurable(tmp_path: Path) -> None:
    cfg = _variant(tmp_path, "prio", lambda raw: raw.setdefault("deploy", {}).update(
        priority_class="metaps-critical", ps_max_unavailable=0))
    r = generate(tmp_path / "out", cfg)
    assert r.returncode == 0, r.stderr
    docs = kustomize(tmp_path / "out")
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    assert by_kind(docs, "PodDisruptionBudget")[0]["spec"]["maxUnavailable"] == 0
    for name in ("metaps-ps", "metaps-controller"):
        assert _job(docs, name)["spec"]["template"]["spec"]["priorityClassName"] == "metaps-critical"
    assert "priorityClassName" not in _job(docs, "metaps-worker")["spec"]["template"]["spec"]
    bad = _variant(tmp_path, "bad", lambda raw: raw.setdefault("deploy", {}).update(ps_max_unavailable=3))
    r = generate(tmp_path / "bad-out", bad)
    assert r.returncode == 1 and "ps_max_unavailable" in r.stderr and not (tmp_path / "bad-out").exists()


def test_day_two_is_a_new_run_with_its_own_state_gate_and_warm_start(tmp_path: Path) -> None:
    """``--run-name`` starts a new run (its own controller state, run dir and data gate);
    ``--warm-start-from`` restores yesterday's model once, before the run has its own."""
    cfg = _variant(tmp_path, "day2", lambda raw: raw.update(deploy={"data_input": "raw/day2", "data_schema": "raw/s.json"}))
    out = tmp_path / "out"
    r = generate(out, cfg, "--run-name", "day2", "--warm-start-from", "runs/main/runs/main/checkpoints")
    assert r.returncode == 0, r.stderr
    docs = kustomize(out)
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    job = tomllib.loads(by_kind(docs, "ConfigMap")[0]["data"]["job.toml"])
    assert job["run"]["name"] == "day2"
    run_dir = f"{job['run']['dir'].rstrip('/')}/day2"
    ctl = _job(docs, "metaps-controller")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ctl[ctl.index("--state-dir") + 1] == "/var/lib/metaps/runs/day2"  # not yesterday's DDS state
    ps = _job(docs, "metaps-ps")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ps[ps.index("--restore-latest") + 1] == "runs/main/runs/main/checkpoints"
    assert ps[ps.index("--checkpoint-root") + 1] == f"/data/{run_dir}/checkpoints"
    build = _job(docs, "metaps-data")["spec"]["template"]["spec"]["containers"][0]["args"]
    gate = f"{run_dir}/data-ready.json"
    assert build[build.index("--done-file") + 1] == gate
    for name in ("metaps-controller", "metaps-ps", "metaps-worker"):
        init = _job(docs, name)["spec"]["template"]["spec"]["initContainers"]
        wait = [c for c in init if c["name"] == "wait-data"][0]["args"]
        assert wait[wait.index("--path") + 1] == gate, name  # this run's build, never a manifest that exists


# ---------------------------------------------------------------- NetworkPolicy
def admits(docs: list[dict[str, Any]], dst: dict[str, str], port: int, src: dict[str, str], src_ns: str) -> bool:
    """Whether the manifests' NetworkPolicies let a pod labelled ``src`` in namespace ``src_ns``
    open ``port`` on a pod labelled ``dst`` (in the policies' namespace): the Kubernetes rules
    for ingress (a pod no policy selects admits everything; otherwise any rule of any selecting
    policy must match both the port and the peer)."""
    selecting = [p for p in by_kind(docs, "NetworkPolicy")
                 if p["spec"]["podSelector"]["matchLabels"].items() <= dst.items()]
    if not selecting:
        return True
    for pol in selecting:
        assert "Ingress" in pol["spec"]["policyTypes"]
        ns = pol["metadata"].get("namespace", "default")
        for rule in pol["spec"].get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                assert set(peer) <= {"podSelector", "namespaceSelector"}, peer  # no ipBlock
                pods = peer.get("podSelector", {}).get("matchLabels", {})
                nss = peer.get("namespaceSelector")
                ns_ok = (src_ns == ns) if nss is None else \
                    nss.get("matchLabels", {}).items() <= {"kubernetes.io/metadata.name": src_ns}.items()
                if ns_ok and pods.items() <= src.items():
                    return True
    return False


def _labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name: t["metadata"]["labels"] for name, t in pod_templates(docs).items()}


def _ports(docs: list[dict[str, Any]], job: str) -> dict[str, int]:
    t = pod_templates(docs)[job]
    return {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}


@pytest.mark.parametrize("variant", ["cpu", "allreduce"])
def test_network_policies_admit_only_the_jobs_own_pods_to_grpc(rendered: Any, variant: str) -> None:
    _, docs = rendered[variant]
    ns = "ctr" if variant == "cpu" else "default"
    labels = _labels(docs)
    ctl, ps, worker = labels["metaps-controller"], labels["metaps-ps"], labels["metaps-worker"]
    ctl_grpc, ps_grpc = _ports(docs, "metaps-controller")["grpc"], _ports(docs, "metaps-ps")["grpc"]
    metrics = _ports(docs, "metaps-ps")["metrics"]
    # the job's own pods: workers reach controller and PS, the PS (and its preStop cut) the controller
    assert admits(docs, ctl, ctl_grpc, worker, ns) and admits(docs, ps, ps_grpc, worker, ns)
    assert admits(docs, ctl, ctl_grpc, ps, ns) and admits(docs, ps, ps_grpc, ctl, ns)
    # anyone else: another pod of the namespace, another metaps job, any pod of another namespace
    outsiders = [({"app": "web"}, ns), ({**worker, "app.kubernetes.io/instance": "other-job"}, ns), (worker, "evil")]
    for src, src_ns in outsiders:
        for dst, port in ((ctl, ctl_grpc), (ps, ps_grpc), (worker, 29500), (worker, 12345)):
            assert not admits(docs, dst, port, src, src_ns), (src, src_ns, dst, port)
        # the metrics port is open to scrapers anywhere (the default: metrics_from_namespace = '')
        for dst in (ctl, ps, worker):
            assert admits(docs, dst, metrics, src, src_ns)
    # every long-running pod is covered by a policy, and workers admit each other on any port (gloo)
    assert admits(docs, worker, 29500, worker, ns) and admits(docs, worker, 40000, worker, ns)
    assert {p["metadata"]["name"] for p in by_kind(docs, "NetworkPolicy")} == \
        {"metaps-controller", "metaps-ps", "metaps-worker"}


def test_metrics_can_be_limited_to_a_monitoring_namespace_and_policies_turned_off(tmp_path: Path) -> None:
    cfg = _variant(tmp_path, "mon", lambda raw: raw.setdefault("deploy", {}).update(metrics_from_namespace="monitoring"))
    r = generate(tmp_path / "out", cfg)
    assert r.returncode == 0, r.stderr
    docs = kustomize(tmp_path / "out")
    for d in by_kind(docs, "NetworkPolicy"):
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    labels = _labels(docs)
    ps, metrics = labels["metaps-ps"], _ports(docs, "metaps-ps")["metrics"]
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert admits(docs, ps, metrics, prometheus, "monitoring")
    assert not admits(docs, ps, metrics, prometheus, "default")
    assert not admits(docs, ps, _ports(docs, "metaps-ps")["grpc"], prometheus, "monitoring")
    off = _variant(tmp_path, "off", lambda raw: raw.setdefault("deploy", {}).update(network_policy=False))
    r = generate(tmp_path / "out-off", off)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "out-off" / "network.yaml").exists()
    assert not by_kind(kustomize(tmp_path / "out-off"), "NetworkPolicy")
    bad = _variant(tmp_path, "bad", lambda raw: raw.setdefault("deploy", {}).update(metrics_from_namespace="Mon itor"))
    r = generate(tmp_path / "out-bad", bad)
    assert r.returncode == 1 and "metrics_from_namespace 'Mon itor' is not a namespace name" in r.stderr, r.stderr


def _init(template: dict[str, Any]) -> dict[str, list[str]]:
    return {c["name"]: c["args"] for c in template["spec"].get("initContainers", [])}


def _stage_volume(template: dict[str, Any]) -> dict[str, Any] | None:
    vols = [v for v in template["spec"]["volumes"] if v["name"] == "stage"]
    return vols[0] if vols else None


def test_per_role_storage_stages_each_roles_data_into_its_own_volume(rendered: Any) -> None:
    _, docs = rendered["per-role"]
    job = tomllib.loads(by_kind(docs, "ConfigMap")[0]["data"]["job.toml"])
    train, held = "runs/main/metaio", "runs/main/metaio-holdout"
    assert (job["data"]["train"], job["data"]["eval"]) == (f"/stage/{train}", f"/stage/{held}")
    t = pod_templates(docs)

    def stage_args(path: str, *extra: str) -> list[str]:
        return ["meta-io", "stage", "--from", f"{SOURCE}/{path}", "--to", f"/stage/{path}", "--wait", "86400", *extra]
    # a worker copies both datasets whole; the controller their manifests and indexes
    w, ctl, ps = t["metaps-worker"], t["metaps-controller"], t["metaps-ps"]
    assert list(_init(w)) == ["token", "wait-data", "stage-train", "stage-eval"]
    assert _init(w)["stage-train"] == stage_args(train) and _init(w)["stage-eval"] == stage_args(held)
    assert _init(ctl)["stage-train"] == stage_args(train, "--metadata-only")
    assert _init(ctl)["stage-eval"] == stage_args(held, "--metadata-only")
    for tpl in (w, ctl, ps):
        claim = _stage_volume(tpl)["ephemeral"]["volumeClaimTemplate"]["spec"]  # type: ignore[index]
        assert claim == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}},
                         "storageClassName": "local-nvme"}
        mounts = {m["mountPath"]: m["name"] for m in tpl["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["/stage"] == "stage" and mounts["/data"] == "data"  # run dir + checkpoints stay shared
    # the PS reads the schema in the train manifest: that manifest and index only
    assert {n: a for n, a in _init(ps).items() if n.startswith("stage")} == {
        "stage-train": stage_args(train, "--metadata-only")}
    # the data Job builds into its own volume, uploads eval, then train with the run's done file last
    data = t["metaps-data"]["spec"]
    steps = [(c["name"], c["args"]) for c in data.get("initContainers", []) + data["containers"]]
    assert [n for n, _ in steps] == ["build-eval", "build-train", "upload-eval", "upload-train"]
    assert dict(steps)["build-train"][dict(steps)["build-train"].index("--out") + 1] == f"/stage/{train}"
    gate = _init(w)["wait-data"][3]  # the training pods' gate: the done file of this run
    assert gate.endswith("/data-ready.json")
    assert dict(steps)["upload-train"] == ["meta-io", "stage", "--from", f"/stage/{train}", "--to",
                                           f"{SOURCE}/{train}", "--overwrite", "--done-file", gate]
    # the delivery gate reads its own copy of [data] eval
    dl = t["metaps-deliver"]
    assert _init(dl) == {"stage-eval": stage_args(held)}
    args = dl["spec"]["containers"][0]["args"]
    assert args[args.index("--holdout") + 1] == f"/stage/{held}"
    # the shared volume is still there (checkpoints, run dir, bundles)
    assert "metaps-data" in [c["metadata"]["name"] for c in by_kind(docs, "PersistentVolumeClaim")]


def test_per_role_storage_is_refused_without_a_source_or_with_absolute_data_paths(tmp_path: Path) -> None:
    def no_source(raw: dict[str, Any]) -> None:
        raw["deploy"] = {"storage": "per-role"}

    def absolute(raw: dict[str, Any]) -> None:
        raw["deploy"] = {"storage": "per-role", "data_source": SOURCE}
        raw["data"]["train"] = "/mnt/metaio"

    def source_alone(raw: dict[str, Any]) -> None:
        raw["deploy"] = {"data_source": SOURCE}

    for edit, words in ((no_source, "needs data_source"), (absolute, "[data] train = '/mnt/metaio'"),
                        (source_alone, "only read with storage = 'per-role'")):
        out = tmp_path / edit.__name__
        r = generate(out, _variant(tmp_path, edit.__name__, edit))
        assert r.returncode != 0 and words in r.stderr, r.stderr
        assert not list(out.glob("*.yaml")) if out.exists() else True
