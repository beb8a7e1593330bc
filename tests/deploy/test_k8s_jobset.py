"""``metaps deploy k8s --api jobset``: one JobSet runs the Jobs' pods, validated strictly.

The JobSet's own fields are checked by :func:`metaps.deploy.jobset.validate_jobset` (the API
types of kubernetes-sigs/jobset, unknown field = error); each replicated job's Job template
(and every other object) by ``kubernetes-validate`` (strict) against the Kubernetes 1.32
schemas, as test_k8s_manifests.py does for the Jobs. The pods are the Jobs variant's,
name for name, but for the DNS names of Indexed pods (a JobSet's child Job is
``NAME-ROLE-0``). Its semantics in pods (order, failure policy, restarts, success) are
checked by the podsim test at the end and by test_k8s_pods_allreduce.py (a run to the end).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from common.errors import ConfigError
from metaps.deploy.jobset import validate_jobset
from metaps.job import job_from_mapping
from tests.deploy.test_k8s_manifests import IMAGE, K8S_VERSION, REPO, generate, kustomize

JOB: dict[str, Any] = {
    "data": {"train": "metaio/train", "eval": "metaio/eval"},
    "ps": {"shards": 2, "num_vshards": 8, "device": "cpu", "table_defaults": {"dim": 8, "capacity": 4096}},
    "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
    "train": {"workers": 3},
    "run": {"dir": "runs", "name": "day1"},
    "deploy": {"name": "ctr", "data_input": "raw/train", "data_schema": "raw/schema.json",
               "deliver_schedule": "0 * * * *", "queue": "team-a", "max_restarts": 2},
}


def _write(path: Path, edit: Any = None) -> Path:
    from common.toml_writer import write

    raw = copy.deepcopy(JOB)
    if edit is not None:
        edit(raw)
    return write(path, raw)


def _allreduce(raw: dict[str, Any]) -> None:
    raw["train"].update(dense_sync="allreduce", workers=2)
    raw["deploy"].update(api="jobset", queue="", max_restarts=0)  # the key, not the flag


def _render_here(cfg: Path, out: Path) -> None:
    """What ``metaps deploy k8s --config CFG --out OUT`` does, in this process (no interpreter start)."""
    from metaps.deploy import jobset
    from metaps.deploy.k8s import Options, render, write

    raw = tomllib.loads(cfg.read_text())
    job = job_from_mapping(copy.deepcopy(raw), where=str(cfg))
    write((jobset.render if job.deploy.api == "jobset" else render)(job, raw, Options(IMAGE)), out)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Objects of ``kubectl kustomize`` per variant: ``jobs`` and ``jobset`` of one job file (the
    JobSet by the command's ``--api jobset``), ``allreduce`` (``[deploy] api = "jobset"``)."""
    tmp = tmp_path_factory.mktemp("jobset")
    jobs_cfg = _write(tmp / "job.toml", lambda raw: raw["deploy"].update(queue="", max_restarts=0))
    r = generate(tmp / "jobset", _write(tmp / "js.toml"), "--api", "jobset")
    assert r.returncode == 0, r.stderr
    _render_here(jobs_cfg, tmp / "jobs")
    _render_here(_write(tmp / "ar.toml", _allreduce), tmp / "allreduce")
    return {name: kustomize(tmp / name) for name in ("jobs", "jobset", "allreduce")}


def _jobset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    sets = [d for d in docs if d["kind"] == "JobSet"]
    assert len(sets) == 1, [d["kind"] for d in docs]
    return sets[0]


def _rjobs(js: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in js["spec"]["replicatedJobs"]}


def _as_job(js: dict[str, Any], rj: dict[str, Any]) -> dict[str, Any]:
    """The child Job the JobSet controller creates from a replicated job (index 0)."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{js['metadata']['name']}-{rj['name']}-0", **rj["template"].get("metadata", {})},
            "spec": rj["template"]["spec"]}


def test_the_jobset_and_every_template_validate_strictly(rendered: Any) -> None:
    for variant in ("jobset", "allreduce"):
        docs = rendered[variant]
        js = _jobset(docs)
        validate_jobset(js)
        assert [r["name"] for r in js["spec"]["replicatedJobs"]] == ["data", "controller", "ps", "worker"]
        for rj in js["spec"]["replicatedJobs"]:
            assert rj["replicas"] == 1
            kubernetes_validate.validate(_as_job(js, rj), K8S_VERSION, strict=True)
        for d in docs:
            if d["kind"] != "JobSet":
                kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        assert not [d for d in docs if d["kind"] == "Job"]  # no Job outside the JobSet
    # a misspelt field in an embedded pod template is caught
    js = copy.deepcopy(_jobset(rendered["jobset"]))
    rj = _rjobs(js)["ps"]
    rj["template"]["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_as_job(js, rj), K8S_VERSION, strict=True)


@pytest.mark.parametrize("path,value,words", [
    ("spec.failurePolicy.maxRestart", 3, "spec.failurePolicy.maxRestart: unknown field of FailurePolicy"),
    ("spec.replicatedJobs.0.replica", 1, "spec.replicatedJobs[0].replica: unknown field of ReplicatedJob"),
    ("spec.startupPolicy.startupPolicyOrder", "Ordered", "expected one of AnyOrder, InOrder, got 'Ordered'"),
    ("spec.failurePolicy.rules.0.action", "FailJob", "rules[0].action: expected one of FailJobSet"),
    ("spec.suspend", "yes", "spec.suspend: expected bool, got str"),
    ("spec.failurePolicy.maxRestarts", True, "spec.failurePolicy.maxRestarts: expected an int32, got True"),
    ("spec.successPolicy.targetReplicatedJobs", ["workers"], "'workers' is not a replicated job"),
    ("spec.failurePolicy.rules.0.name", "run failed", "rules[0].name: expected"),
    ("spec.replicatedJobs.3.template.spec.completionMode", None,
     "an Indexed Job (the JobSet's default completionMode) needs completions"),
    ("status", {}, "unknown top-level field 'status'"),
])
def test_the_validator_refuses_what_the_jobset_api_refuses(rendered: Any, path: str, value: Any, words: str) -> None:
    js = copy.deepcopy(_jobset(rendered["jobset"]))
    node: Any = js
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is None:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    with pytest.raises(ConfigError) as err:
        validate_jobset(js)
    assert words in str(err.value), str(err.value)
    validate_jobset(_jobset(rendered["jobset"]))  # the original passes


def _unname(obj: Any, name: str, secret: str) -> Any:
    """``obj`` with the JobSet's Indexed pod hostnames (NAME-ROLE-0-K) written as the Jobs' (NAME-ROLE-K)
    and its token Secret's name as the Jobs' (``secret``: kustomize's hashed name)."""
    text = json.dumps(obj).replace(f'"secretName": "{name}-token"', f'"secretName": "{secret}"')
    for role in ("ps", "worker"):
        text = text.replace(f"{name}-{role}-0-", f"{name}-{role}-")
    return json.loads(text)


def test_the_replicated_jobs_run_the_jobs_pods(rendered: Any) -> None:
    """Job spec for Job spec, pod for pod: the JobSet's templates are the Jobs', but for the
    completion mode the JobSet needs spelt out and the Indexed pods' DNS names."""
    jobs = {d["metadata"]["name"]: d for d in rendered["jobs"] if d["kind"] == "Job"}
    js = _jobset(rendered["jobset"])
    rjobs = _rjobs(js)
    assert sorted(jobs) == sorted(f"ctr-{r}" for r in rjobs)
    secret = [d["metadata"]["name"] for d in rendered["jobs"] if d["kind"] == "Secret"][0]
    for role, rj in rjobs.items():
        job = jobs[f"ctr-{role}"]
        spec = dict(rj["template"]["spec"])
        if job["spec"].get("completionMode") != "Indexed":
            assert spec.pop("completionMode") == "NonIndexed", role  # else the JobSet's webhook makes it Indexed
        assert _unname(spec, "ctr", secret) == job["spec"], role
        assert rj["template"]["metadata"]["labels"] == job["metadata"]["labels"]
    # the objects around the Jobs are the same (the Secret's name without kustomize's hash)
    others = sorted((d["kind"], "ctr-token" if d["kind"] == "Secret" else d["metadata"]["name"])
                    for d in rendered["jobs"] if d["kind"] != "Job")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered["jobset"]
                  if d["kind"] != "JobSet") == others


def test_indexed_pods_are_reached_at_their_jobset_hostnames(rendered: Any) -> None:
    """A child Job NAME-ROLE-0's pod K has hostname NAME-ROLE-0-K in the template's subdomain
    (DNS hostnames of the JobSet off: each role's own headless Service)."""
    for variant in ("jobset", "allreduce"):
        docs = rendered[variant]
        js = _jobset(docs)
        assert js["spec"]["network"] == {"enableDNSHostnames": False}
        rjobs = _rjobs(js)
        headless = {d["metadata"]["name"] for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"}
        ps = rjobs["ps"]["template"]["spec"]["template"]["spec"]
        assert ps["subdomain"] == "ctr-ps" and "ctr-ps" in headless
        args = ps["containers"][0]["args"]
        assert args[args.index("--advertise") + 1] == "ctr-ps-0-$(METAPS_INDEX).ctr-ps"
        w = rjobs["worker"]["template"]["spec"]["template"]["spec"]["containers"][0]
        assert w["args"][w["args"].index("--ps") + 1] == "ctr-ps-0-{k}.ctr-ps:5000"
    w = _rjobs(_jobset(rendered["allreduce"]))["worker"]["template"]["spec"]
    assert w["completionMode"] == "Indexed" and w["template"]["spec"]["subdomain"] == "ctr-worker"
    env = {e["name"]: e.get("value") for e in w["template"]["spec"]["containers"][0]["env"]}
    assert env["METAPS_ALLREDUCE"] == "ctr-worker-0-0.ctr-worker:29500"  # rank 0 of child Job ctr-worker-0


def test_order_outcome_restarts_and_the_kueue_gang(rendered: Any) -> None:
    js = _jobset(rendered["jobset"])
    spec = js["spec"]
    assert spec["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["worker"]}
    rules = spec["failurePolicy"]["rules"]
    assert spec["failurePolicy"]["maxRestarts"] == 2
    # a child Job failed by its podFailurePolicy (exit 4: the run failed) fails the JobSet; any other
    # failure restarts the group
    assert rules[0]["action"] == "FailJobSet" and "PodFailurePolicy" in rules[0]["onJobFailureReasons"]
    assert rules[-1] == {"name": "restartGroup", "action": "RestartJobSet"}
    assert spec["suspend"] is True and js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    for role, rj in _rjobs(js).items():  # the Jobs' exit-code semantics ride along
        policy = rj["template"]["spec"].get("podFailurePolicy")
        if role == "data":
            assert policy is None
            continue
        fail = [r for r in policy["rules"] if r["action"] == "FailJob"]
        assert fail and fail[0]["onExitCodes"]["values"] == [4], role
        ignored = {c for r in policy["rules"] if r["action"] == "Ignore" for c in r.get("onExitCodes", {}).get("values", [])}
        assert 143 in ignored, role
    ar = _jobset(rendered["allreduce"])
    assert "suspend" not in ar["spec"] and "kueue.x-k8s.io/queue-name" not in ar["metadata"]["labels"]
    assert ar["spec"]["failurePolicy"]["maxRestarts"] == 0


def test_the_token_secret_keeps_the_name_the_jobset_mounts(rendered: Any) -> None:
    """kustomize rewrites a generated Secret's hashed name into pod templates it knows, not into a
    JobSet's: the JobSet variant's Secret carries no hash."""
    docs = rendered["jobset"]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    mounted = {v["secret"]["secretName"] for rj in _jobset(docs)["spec"]["replicatedJobs"]
               for v in rj["template"]["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert mounted == {"ctr-token"} and mounted <= secrets, (mounted, secrets)


def _deploy_error(edit: Any) -> str:
    raw = copy.deepcopy(JOB)
    raw["deploy"].update(queue="", max_restarts=0)
    raw["deploy"].update(edit)
    with pytest.raises(ConfigError) as err:
        job_from_mapping(raw, where="job.toml")
    return str(err.value)


def test_bad_api_queue_and_restart_keys_are_refused_naming_the_key() -> None:
    assert "api: expected one of jobs, jobset, got 'jobsets'" in _deploy_error({"api": "jobsets"})
    assert "queue 'team-a' needs api = 'jobset'" in _deploy_error({"queue": "team-a"})
    assert "queue 'Team A' is not a LocalQueue name" in _deploy_error({"api": "jobset", "queue": "Team A"})
    assert "max_restarts: expected 0..100, got -1" in _deploy_error({"api": "jobset", "max_restarts": -1})
    assert "max_restarts 3 is only read with api = 'jobset'" in _deploy_error({"max_restarts": 3})


def test_ttl_moves_from_the_child_jobs_to_the_jobset(tmp_path: Path) -> None:
    """A child Job deleted by its TTL while the JobSet runs would be created again (a data step
    rebuilt): the JobSet carries the TTL, its child Jobs none."""
    from metaps.deploy import jobset
    from metaps.deploy.k8s import Options

    raw = copy.deepcopy(JOB)
    raw["deploy"].update(api="jobset", ttl_after_finished_s=3600)
    files = jobset.render(job_from_mapping(copy.deepcopy(raw), where="job.toml"), raw, Options(IMAGE))
    text = files["jobset.yaml"]
    assert text.count("ttlSecondsAfterFinished") == 1 and "\n  ttlSecondsAfterFinished: 3600\n" in text, text[:400]


# ---------------------------------------------------------------- the JobSet's semantics in pods
def _shell_jobset(js: dict[str, Any], name: str, ctl: Path, roles: tuple[str, ...]) -> dict[str, Any]:
    """The rendered JobSet as ``name`` with one pod per replicated job (``roles``) whose container is a
    shell loop: it waits for ``CTL/NAME/ROLE.exit`` and exits with the code written there (143 on
    SIGTERM); the data pod's init container waits for ``CTL/NAME/data.init`` first. Policies, order,
    restart policies and labels stay the rendered ones; no volume, probe or hook (no fleet runs)."""
    js = copy.deepcopy(js)
    js["metadata"]["name"] = name
    js["spec"]["replicatedJobs"] = [r for r in js["spec"]["replicatedJobs"] if r["name"] in roles]
    for rj in js["spec"]["replicatedJobs"]:
        spec = rj["template"]["spec"]
        spec.update(parallelism=1, backoffLimit=0)
        if spec.get("completions") is not None:
            spec["completions"] = 1
        pod = spec["template"]["spec"]
        c = pod["containers"][0]

        def wait(what: str, role: str = rj["name"]) -> str:
            return f"while [ ! -e {ctl}/{name}/{role}.{what} ]; do sleep 0.1; done"
        script = f"trap 'exit 143' TERM; {wait('exit')}; exit $(cat {ctl}/{name}/{rj['name']}.exit)"
        for key in ("args", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "ports"):
            c.pop(key, None)
        c.update(command=["sh", "-c", script], volumeMounts=[])
        pod.update(volumes=[], terminationGracePeriodSeconds=2)
        pod.pop("initContainers", None)
        if rj["name"] == "data":
            pod["initContainers"] = [{**c, "name": "gate", "command": ["sh", "-c", wait("init")]}]
    return js


@pytest.mark.timeout(300)
def test_podsim_runs_the_jobsets_order_failure_policy_restarts_and_success(rendered: Any, tmp_path: Path) -> None:
    """The rendered JobSet's policies in the pods harness, with shell pods (seconds, no fleet):
    suspended until admitted, then in order (the controller's Job only once the data pod runs);
    an evicted pod is replaced uncounted; the worker Job complete completes the JobSet and the
    controller and PS are deleted; a pod exiting 4 fails the JobSet at once, no restart; a crash
    (exit 1, backoffLimit 0) restarts the group, at most maxRestarts (1) times, then fails it."""
    from tests.deploy.podsim import PodSim, netns_available
    from tests.deploy.pods import closing_shown, pod_env
    from tests.metaps.fleet_data import wait_for

    assert netns_available(), "this test runs pods in network + mount namespaces: it needs root, iproute2, unshare"
    ctl = tmp_path / "ctl"
    js = _jobset(rendered["jobset"])
    everyone = ("data", "controller", "ps", "worker")
    sets = {"ok": _shell_jobset(js, "ok", ctl, everyone), "fail": _shell_jobset(js, "fail", ctl, everyone),
            "again": _shell_jobset(js, "again", ctl, ("controller", "worker"))}
    sets["again"]["spec"]["failurePolicy"]["maxRestarts"] = 1
    for name in sets:
        (ctl / name).mkdir(parents=True)
    ctl.chmod(0o777)
    docs = [d for d in rendered["jobset"] if d["kind"] != "JobSet"] + list(sets.values())
    sim = PodSim(docs, tmp_path / "sim", env=pod_env(), subnet="10.239.0", external=[ctl])

    def touch(name: str, role: str, what: str, text: str = "") -> None:
        (ctl / name / f"{role}.{what}").write_text(text)

    with closing_shown(sim):
        t0 = time.monotonic()
        for name in sets:
            sim.start_jobset(name)
        time.sleep(1.0)  # two rounds of the JobSet controller
        assert not sim.pods, "a suspended JobSet created pods before Kueue admitted it"
        for name in sets:
            if name != "ok":  # "ok": its data pod's gate stays closed, its workers run on
                touch(name, "worker", "exit", {"fail": "4", "again": "1"}[name])
                touch(name, "data", "init")
            touch(name, "data", "exit", "0")
            sim.resume_jobset(name)
        # the failed run fails the JobSet at once (FailJobSet: no restart), deleting the rest
        wait_for(lambda: sim.jobset_status("fail") != "Running", 60, "the failing JobSet to end")
        st = sim.jobsets["fail"]
        assert (st.status, st.restarts) == ("Failed", 0) and st.reason.startswith("FailJobSetAction"), st.reason
        assert "PodFailurePolicy" in st.reason and sim.job_status("fail-worker-0") == "Failed"
        # a crash restarts the group once (maxRestarts 1), then fails it
        wait_for(lambda: sim.jobset_status("again") != "Running", 60, "the crashing JobSet to end")
        st = sim.jobsets["again"]
        assert (st.status, st.restarts) == ("Failed", 1) and st.reason.startswith("ReachedMaxRestarts"), st.reason
        assert len([p for p in sim.pods.values() if p.owner.startswith("again-controller-0")]) == 2  # one per attempt
        # in order: while the data pod's init container waits (all the above), no controller Job
        assert sim.job_pods("ok-data-0") and sim.job_pods("ok-data-0")[0].phase == "Pending"
        assert "ok-controller-0" not in sim.jobs, "InOrder: the controller started before the data pod ran"
        touch("ok", "data", "init")
        wait_for(lambda: "ok-worker-0" in sim.jobs and sim.job_pods("ok-worker-0"), 60, "the worker Job")
        created = {role: min(p.created for p in sim.job_pods(f"ok-{role}-0")) for role in everyone}
        assert sorted(created, key=created.__getitem__) == list(everyone), created
        ps = sim.job_pods("ok-ps-0")[0]
        wait_for(lambda: ps.phase == "Running", 30, "the PS pod")
        sim.delete_pod(ps.name, condition="DisruptionTarget")  # an eviction: replaced, counted nowhere
        wait_for(lambda: len(sim.job_pods("ok-ps-0")) == 2, 30, "the replacement PS pod")
        assert ps.exit_codes == [143] and sim.jobsets["ok"].restarts == 0
        touch("ok", "worker", "exit", "0")
        wait_for(lambda: sim.jobset_status("ok") != "Running", 60, "the JobSet to complete")
        assert sim.jobset_status("ok") == "Completed", sim.jobsets["ok"].reason
        try:
            wait_for(lambda: all(p.ended for p in sim.pods.values()), 30, "every pod to end")
        except AssertionError:
            raise AssertionError(f"pods still up: {[(p.name, p.phase, p.deleting) for p in sim.pods.values() if not p.ended]}")
        assert sim.job_status("ok-worker-0") == "Complete"
        assert sim.job_status("ok-controller-0") == sim.job_status("ok-ps-0") == "Deleted"  # cleaned up
        sys.stderr.write(f"[jobset podsim] {len(sim.pods)} pods in {time.monotonic() - t0:.1f}s\n")
