"""The JobSet variant of the manifests (``metaps deploy k8s --api jobset``, ``[deploy] api = "jobset"``).

One JobSet (``jobset.x-k8s.io/v1alpha2``, kubernetes-sigs/jobset) runs the pods that
:mod:`metaps.deploy.k8s` writes as separate Jobs, as replicated jobs of one replica each,
in this order: ``data`` (when ``[deploy] data_input`` is set), ``controller``, ``ps``
(Indexed, one pod per shard), ``worker``. Their Job specs and pod templates are the Jobs'
own (containers, volumes, probes, ``podFailurePolicy``, backoff limits); the Services, the
PodDisruptionBudget, the NetworkPolicies, the volumes and the delivery CronJob stay as they
are. What the JobSet adds:

* ``startupPolicy: InOrder``: a replicated job's Job is created once every pod of the one
  before is ready (the controller serving before a PS starts, the PS before the workers);
* ``failurePolicy``: a child Job that failed by its ``podFailurePolicy`` (a pod exited 4:
  the controller failed the run) or by a deadline fails the JobSet (``FailJobSet``); any
  other failure of a child Job (its ``backoffLimit`` spent) restarts the whole group (every
  child Job recreated) up to ``[deploy] max_restarts`` times, then fails it. Evictions and
  SIGTERM exits (143) never fail a child Job: its ``podFailurePolicy`` ignores them;
* ``successPolicy``: the JobSet completes when the worker Job completes (the JobSet then
  deletes the Jobs still active; the controller has normally ended the fleet already);
* ``[deploy] queue``: ``suspend: true`` and the label ``kueue.x-k8s.io/queue-name``: Kueue
  admits the whole run as one workload when the queue has quota for every pod;
* ``network.enableDNSHostnames: false``: each role keeps its own headless Service and
  subdomain. A JobSet names its child Jobs ``NAME-ROLE-0``, so an Indexed pod's hostname
  is ``NAME-ROLE-0-K`` and the PS answer at ``NAME-ps-0-K.NAME-ps`` (all-reduce rank 0 at
  ``NAME-worker-0-0.NAME-worker``); the generator writes those names into the pods' args
  and env;
* the token Secret's generated name carries no hash suffix: kustomize rewrites a Secret's
  name only in the pod templates of the kinds it knows, not in a JobSet's;
* ``ttlSecondsAfterFinished`` moves from the child Jobs to the JobSet (a child Job deleted
  while the JobSet runs would be created again).

:func:`validate_jobset` checks the JobSet's own fields strictly against the API types of
kubernetes-sigs/jobset (``api/jobset/v1alpha2/jobset_types.go``, commit 816ba51e) and the
checks of its admission webhook and CEL rules: an unknown field, a wrong type or a value
outside an enum is an error. The embedded Job templates are Kubernetes' ``batch/v1`` types
(tests/deploy/test_k8s_jobset.py validates them with ``kubernetes-validate``).

Example::

    files = render(load_job("job.toml"), raw, Options("reg.example/metaps:0.1.0"))  # [deploy] api = "jobset"
"""

from __future__ import annotations

import re
from typing import Any

from common.errors import ConfigError
from metaps.deploy import k8s

API_VERSION = "jobset.x-k8s.io/v1alpha2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
ORDER = ("data", "controller", "ps", "worker")
"""The replicated jobs, in startup order (each one's child Job is ``NAME-ROLE-0``)."""
SOURCES = {"data": "data.yaml", "controller": "controller.yaml", "ps": "ps.yaml", "worker": "worker.yaml"}
FAIL_REASONS = ("PodFailurePolicy", "DeadlineExceeded")
"""Child Job failure reasons that fail the JobSet at once (a failed run; a deadline) instead of restarting it."""


def render(job: Any, raw: dict[str, Any], opts: k8s.Options) -> dict[str, str]:
    """Every manifest file's text, by file name: :func:`metaps.deploy.k8s.render` with the
    controller, PS, worker and data Jobs turned into one JobSet (``jobset.yaml``).

    Raises:
        ConfigError: what :func:`metaps.deploy.k8s.render` refuses; ``[deploy] api`` is not "jobset".
    """
    if job.deploy.api != "jobset":
        raise ConfigError(f"{job.source}: [deploy] api: expected 'jobset' for the JobSet variant, got "
                          f"{job.deploy.api!r}")
    return k8s.render(job, raw, opts, finish=to_jobset)


def to_jobset(gen: Any, parts: dict[str, list[dict[str, Any]]]) -> None:
    """Move the Jobs of ``parts`` (file name -> objects) into one JobSet, ``parts["jobset.yaml"]``.

    Args:
        gen: the generator (:class:`metaps.deploy.k8s._Gen`): names, labels, ``[deploy]``.
        parts: the objects by file; the Jobs leave their files (a file left empty is not written).
    """
    d = gen.d
    replicated: list[dict[str, Any]] = []
    ttl = 0
    for role in ORDER:
        objs = parts.get(SOURCES[role], [])
        jobs = [o for o in objs if o["kind"] == "Job"]
        if not jobs:
            continue
        if len(jobs) != 1 or jobs[0]["metadata"]["name"] != f"{gen.n}-{role}":
            raise ConfigError(f"JobSet {gen.n}: expected one Job {gen.n}-{role} in {SOURCES[role]}, got "
                              f"{[j['metadata']['name'] for j in jobs]}")
        parts[SOURCES[role]] = [o for o in objs if o["kind"] != "Job"]
        job_spec = dict(jobs[0]["spec"])
        # the JobSet's webhook makes a Job without a completion mode Indexed: a work-queue worker
        # Job, the controller and the data step stay NonIndexed
        job_spec.setdefault("completionMode", "NonIndexed")
        ttl = max(ttl, int(job_spec.pop("ttlSecondsAfterFinished", 0)))
        replicated.append({"name": role, "replicas": 1, "template": {
            "metadata": {"labels": dict(jobs[0]["metadata"]["labels"])}, "spec": job_spec}})
    meta = gen.meta(gen.n)
    if d.queue:
        meta["labels"][QUEUE_LABEL] = d.queue
    spec: dict[str, Any] = {}
    if d.queue:
        spec["suspend"] = True  # Kueue resumes it once the whole run fits the queue's quota
    spec["network"] = {"enableDNSHostnames": False}  # each role's own headless Service and subdomain
    spec["startupPolicy"] = {"startupPolicyOrder": "InOrder"}
    spec["successPolicy"] = {"operator": "All", "targetReplicatedJobs": ["worker"]}
    spec["failurePolicy"] = {"maxRestarts": d.max_restarts, "rules": [
        {"name": "runFailed", "action": "FailJobSet", "onJobFailureReasons": list(FAIL_REASONS)},
        {"name": "restartGroup", "action": "RestartJobSet"}]}
    if ttl:
        spec["ttlSecondsAfterFinished"] = ttl
    spec["replicatedJobs"] = replicated
    jobset = {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": meta, "spec": spec}
    validate_jobset(jobset)
    parts["jobset.yaml"] = [jobset]


# ------------------------------------------------------------------ the JobSet API types
# Field -> type: bool / int / str, a type name of TYPES ("Network"), or a one-element list
# ([T]: a list of T). From api/jobset/v1alpha2/jobset_types.go (kubernetes-sigs/jobset 816ba51e).
TYPES: dict[str, dict[str, Any]] = {
    "JobSetSpec": {"replicatedJobs": ["ReplicatedJob"], "network": "Network", "successPolicy": "SuccessPolicy",
                   "failurePolicy": "FailurePolicy", "startupPolicy": "StartupPolicy", "suspend": bool,
                   "coordinator": "Coordinator", "managedBy": str, "ttlSecondsAfterFinished": int},
    "ReplicatedJob": {"name": str, "groupName": str, "template": "JobTemplateSpec", "replicas": int,
                      "dependsOn": ["DependsOn"]},
    "JobTemplateSpec": {"metadata": "ObjectMeta", "spec": dict},  # batch/v1: checked by kubernetes-validate
    "ObjectMeta": {"name": str, "namespace": str, "labels": dict, "annotations": dict},
    "DependsOn": {"name": str, "status": str},
    "Network": {"enableDNSHostnames": bool, "subdomain": str, "publishNotReadyAddresses": bool},
    "SuccessPolicy": {"operator": str, "targetReplicatedJobs": [str]},
    "FailurePolicy": {"maxRestarts": int, "restartStrategy": str, "rules": ["FailurePolicyRule"]},
    "FailurePolicyRule": {"name": str, "action": str, "onJobFailureReasons": [str],
                          "onJobFailureMessagePatterns": [str], "targetReplicatedJobs": [str]},
    "StartupPolicy": {"startupPolicyOrder": str},
    "Coordinator": {"replicatedJob": str, "jobIndex": int, "podIndex": int},
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "ReplicatedJob": ("name", "template"), "DependsOn": ("name", "status"), "SuccessPolicy": ("operator",),
    "FailurePolicyRule": ("name", "action"), "StartupPolicy": ("startupPolicyOrder",),
    "Coordinator": ("replicatedJob",),
}
ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("DependsOn", "status"): ("Ready", "Complete"),
    ("SuccessPolicy", "operator"): ("All", "Any"),
    ("FailurePolicy", "restartStrategy"): ("Recreate", "BlockingRecreate"),
    ("FailurePolicyRule", "action"): ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"),
    ("StartupPolicy", "startupPolicyOrder"): ("AnyOrder", "InOrder"),
}
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_INT32 = 2**31 - 1


def _check(value: Any, kind: Any, path: str) -> None:
    """``value`` against ``kind`` (see :data:`TYPES`), recursively; ConfigError names ``path``."""
    if isinstance(kind, list):
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            _check(item, kind[0], f"{path}[{i}]")
        return
    if kind is bool or kind is str or kind is dict:
        if not isinstance(value, kind):
            raise ConfigError(f"{path}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
        return
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or not -_INT32 - 1 <= value <= _INT32:
            raise ConfigError(f"{path}: expected an int32, got {value!r}")
        return
    fields = TYPES[kind]
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a {kind} mapping, got {type(value).__name__}")
    for key in value:
        if key not in fields:
            raise ConfigError(f"{path}.{key}: unknown field of {kind} (expected one of {', '.join(fields)})")
    for key in REQUIRED.get(kind, ()):
        if key not in value:
            raise ConfigError(f"{path}.{key}: required field of {kind} missing")
    for key, v in value.items():
        _check(v, fields[key], f"{path}.{key}")
        allowed = ENUMS.get((kind, key))
        if allowed is not None and v not in allowed:
            raise ConfigError(f"{path}.{key}: expected one of {', '.join(allowed)}, got {v!r}")


def validate_jobset(obj: dict[str, Any]) -> None:
    """A JobSet manifest, strictly: its own fields against the API types, then what the
    JobSet webhook and CEL rules refuse (names, references between fields).

    Raises:
        ConfigError: one line naming the field, expected vs got.
    """
    top = {"apiVersion", "kind", "metadata", "spec"}
    unknown = sorted(set(obj) - top)
    if unknown:
        raise ConfigError(f"JobSet: unknown top-level field {unknown[0]!r} (expected {', '.join(sorted(top))})")
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != "JobSet":
        raise ConfigError(f"JobSet: expected apiVersion {API_VERSION} kind JobSet, got "
                          f"{obj.get('apiVersion')!r} {obj.get('kind')!r}")
    _check(obj.get("metadata"), "ObjectMeta", "metadata")
    name = obj["metadata"].get("name", "")
    if not _DNS1035.match(name):
        raise ConfigError(f"metadata.name: expected a DNS-1035 label (lowercase letters, digits, '-'), got {name!r}")
    spec = obj.get("spec")
    _check(spec, "JobSetSpec", "spec")
    assert isinstance(spec, dict)
    rjobs = spec.get("replicatedJobs", [])
    names = [r["name"] for r in rjobs]
    if len(set(names)) != len(names):
        raise ConfigError(f"spec.replicatedJobs: expected distinct names, got {names}")
    for i, r in enumerate(rjobs):
        replicas = r.get("replicas", 1)
        if replicas < 0:
            raise ConfigError(f"spec.replicatedJobs[{i}].replicas: expected >= 0, got {replicas}")
        job_name = f"{name}-{r['name']}-{max(0, replicas - 1)}"
        if len(job_name) > 63 or not _DNS1035.match(job_name):
            raise ConfigError(f"spec.replicatedJobs[{i}].name: child Job name {job_name!r} is not a DNS-1035 label "
                              "of at most 63 characters")
        jspec = r["template"].get("spec", {})
        if jspec.get("completionMode", "Indexed") == "Indexed":
            if jspec.get("completions") is None:
                raise ConfigError(f"spec.replicatedJobs[{i}].template.spec.completions: an Indexed Job (the JobSet's "
                                  "default completionMode) needs completions; set completionMode NonIndexed")
            pod = f"{job_name}-{int(jspec['completions']) - 1}-abcde"
            if len(pod) > 63:
                raise ConfigError(f"spec.replicatedJobs[{i}]: pod name {pod!r} longer than 63 characters")
        if "dependsOn" in r and spec.get("startupPolicy", {}).get("startupPolicyOrder") == "InOrder":
            raise ConfigError(f"spec.replicatedJobs[{i}].dependsOn: StartupPolicy InOrder and DependsOn are "
                              "mutually exclusive")
    for path, targets in [("spec.successPolicy.targetReplicatedJobs",
                           spec.get("successPolicy", {}).get("targetReplicatedJobs", []))] + [
            (f"spec.failurePolicy.rules[{i}].targetReplicatedJobs", rule.get("targetReplicatedJobs", []))
            for i, rule in enumerate(spec.get("failurePolicy", {}).get("rules", []))]:
        for t in targets:
            if t not in names:
                raise ConfigError(f"{path}: {t!r} is not a replicated job (expected one of {', '.join(names)})")
    fp = spec.get("failurePolicy", {})
    if fp.get("maxRestarts", 0) < 0:
        raise ConfigError(f"spec.failurePolicy.maxRestarts: expected >= 0, got {fp['maxRestarts']}")
    for i, rule in enumerate(fp.get("rules", [])):
        if not _RULE_NAME.match(rule["name"]):
            raise ConfigError(f"spec.failurePolicy.rules[{i}].name: expected {_RULE_NAME.pattern}, got {rule['name']!r}")
        reasons = rule.get("onJobFailureReasons", [])
        if len(set(reasons)) != len(reasons):
            raise ConfigError(f"spec.failurePolicy.rules[{i}].onJobFailureReasons: expected distinct, got {reasons}")
    if spec.get("ttlSecondsAfterFinished", 0) < 0:
        raise ConfigError(f"spec.ttlSecondsAfterFinished: expected >= 0, got {spec['ttlSecondsAfterFinished']}")
    sub = spec.get("network", {}).get("subdomain", "")
    if sub and (len(sub) > 63 or not _DNS1035.match(sub)):
        raise ConfigError(f"spec.network.subdomain: expected a DNS-1035 label of at most 63 characters, got {sub!r}")
    coord = spec.get("coordinator")
    if coord is not None and coord["replicatedJob"] not in names:
        raise ConfigError(f"spec.coordinator.replicatedJob: {coord['replicatedJob']!r} is not a replicated job")
