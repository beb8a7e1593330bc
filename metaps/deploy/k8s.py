"""Kubernetes manifests generated from the job file (``metaps deploy k8s``).

The job file is the one source of truth for counts, ports and tables; the
generator writes plain YAML and a ``kustomization.yaml`` (``kubectl apply -k DIR``)::

    job.yaml          ConfigMap NAME-job: the job file pods read (/etc/metaps/job/job.toml);
                      [rpc] token_file -> /run/metaps/token, [ps] host -> 0.0.0.0, no token
    storage.yaml      PVC NAME-data (ReadWriteMany: data, run dir, checkpoints, bundles at /data)
                      PVC NAME-controller-state (ReadWriteOnce: the controller's LMDB)
                      [deploy] storage = "per-role": the data is not on NAME-data; it lives at
                      [deploy] data_source and each pod copies what it reads into a generic
                      ephemeral volume of its own (/stage) in init containers (meta-io stage):
                      worker train + eval whole, controller their manifests + indexes, PS the
                      train manifest + index (schema), delivery the eval set its gate reads;
                      the data Job builds into its own and uploads. The pods' job file names
                      the copies ([data] X -> /stage/X)
    controller.yaml   Job NAME-controller (1 pod, ``--exit-when-done``) + Service NAME-controller
    ps.yaml           Indexed Job NAME-ps (one pod per [ps] shard, hostname NAME-ps-K, shard K) +
                      headless Service (NAME-ps-K.NAME-ps:PORT) + PodDisruptionBudget
    worker.yaml       PS mode: Job, parallelism = [train] workers, no completions (work queue:
                      patch parallelism to scale; --rank auto gets an index from the controller)
                      all-reduce: Indexed Job (completions = parallelism = workers) + headless Service
    data.yaml         Job: metaps meta-io build of [data] eval / train ([deploy] data_input); it ends
                      by writing RUN_DIR/data-ready.json, which training pods wait for (a gate of
                      this run: a rebuild at yesterday's path never passes on yesterday's manifest)
    deliver.yaml      CronJob ([deploy] deliver_schedule): metaps deliver of the run's checkpoints
    network.yaml      NetworkPolicies ([deploy] network_policy): only the job's own pods reach the
                      controller's and the PS's gRPC ports and the workers; the metrics port is
                      open to [deploy] metrics_from_namespace ('' = any namespace)
    monitoring.yaml   PodMonitor NAME ([deploy] pod_monitor; monitoring.coreos.com/v1): /metrics on the
                      metrics port of the controller, PS and worker pods
    kustomization.yaml  the above + a Secret NAME-token generated from DIR/token (0600, created
                      here with a fresh token unless it exists; never in the ConfigMap or an env value)

**The run's outcome is the Jobs' outcome.** Controller, PS and workers are Jobs with
``restartPolicy: Never`` and a ``podFailurePolicy``: exit code 4 (the controller failed
the run, :mod:`common.exit_codes`) fails the Job at once; disruptions (a drain, a
preemption: ``DisruptionTarget``), SIGTERM exits (143: a deleted or scaled-down pod)
and fenced-off processes (5) do not count toward ``backoffLimit``; other failures (a
crash) get a new pod. When the run ends the controller stops the PS and exits
(``--exit-when-done``), so every Job completes and nothing holds a node or a GPU. A
replaced pod is a new incarnation (a random id per process start, and its pod UID), so
the controller recovers a replaced PS as it does a crashed one. A Job's pod template
is immutable: ``kubectl apply`` never rolls a running PS fleet.

**Knobs** (``[deploy]``): ``ttl_after_finished_s`` (``ttlSecondsAfterFinished``: controller, PS,
worker, data Jobs), ``active_deadline_s`` (``activeDeadlineSeconds``: controller, PS, worker Jobs),
``ps_backoff_limit_per_index`` (``backoffLimitPerIndex`` + ``maxFailedIndexes: 0`` on the PS Job in
place of its ``backoffLimit``), ``image_pull_secrets`` (every pod), ``[deploy.roles.ROLE]``
``node_selector`` / ``tolerations`` / ``affinity`` / ``service_account`` (the role's pods; an
affinity's terms add to the PS's own spread), ``pod_monitor``; ``[log] format = "json"`` puts
``METAPS_LOG_FORMAT=json`` into every container.

**TLS** (``[deploy] tls_secret = "NAME"``): the Secret (cert-manager's ``tls.crt``, ``tls.key``,
``ca.crt``) is mounted read-only (0400 + the pod's fsGroup) at ``/etc/metaps/tls`` in the controller,
PS and worker pods, and the pods' job file names its files in ``[rpc] tls_cert`` / ``tls_key`` /
``tls_ca``: every role serves TLS only and dials TLS. Its certificate must hold the names the pods
dial (:func:`tls_dns_names`). The probes become TCP probes (a kubelet's gRPC probe is plaintext).
``[rpc] tls_*`` in the job file (local paths) is refused.

**Day 2.** The controller's state lives in ``STATE/runs/<[run] name>``: a new run name
(``metaps deploy k8s --run-name``) starts its own data accounting, and ``--warm-start-from``
(``[deploy] restore_from``) has each PS restore the newest committed checkpoint there
before serving -- only while the new run has no checkpoint of its own, so a PS replaced
mid-run is recovered to this run's latest cut, not restarted from yesterday's model.

**The PS is protected:** a PodDisruptionBudget (``[deploy] ps_max_unavailable``), an
optional priority class (``[deploy] priority_class``, also on the controller), spread
across nodes (preferred anti-affinity and a topology spread constraint), a startup probe
that covers a warm start's restore (``[deploy] startup_timeout_s``) before liveness
probing starts, and a preStop hook (``metaps cut --wait``) that has the controller take a
checkpoint cut while a terminating PS still serves.

Every pod: non-root (uid 10001, ``fsGroup`` with ``fsGroupChangePolicy: OnRootMismatch``:
the volumes' roots must be group-writable for gid 10001), read-only root filesystem (/tmp is
an emptyDir), capabilities dropped, ``terminationMessagePolicy: FallbackToLogsOnError`` (the
controller writes its outcome line to the termination message), Prometheus scrape
annotations (long-running roles) or ``prometheus.io/scrape: "false"`` (batch pods that serve
no metrics). Training pods wait for ``[data] train``'s manifest in an init container, and
copy the mounted Secret (mode 0400 + the pod's fsGroup) to a 0600 file of their own in
memory (``/run/metaps/token``) the token check accepts.

No ``metaps agent`` runs in a pod: restarts are Kubernetes'. The controller's ``drain``
and checkpoint commands reach the worker process itself; a worker pod that is deleted
reports itself down (its shards are requeued at once).

Example::

    files = render(load_job("configs/main_job.toml"), raw, image="reg.example/metaps:0.1.0")
    write(files, Path("k8s/main"))
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from common import exit_codes
from common.errors import ConfigError
from metaps.deploy.yaml_out import dumps_all
from common.security import REDACTED, generate_token
from common.log import ENV_FORMAT, kv
from common.toml_writer import dumps as toml_dumps

log = logging.getLogger(__name__)

JOB_DIR = "/etc/metaps/job"
JOB_PATH = f"{JOB_DIR}/job.toml"
SECRET_DIR = "/etc/metaps/secret"
TOKEN_DIR = "/run/metaps"
TOKEN_PATH = f"{TOKEN_DIR}/token"
TLS_DIR = "/etc/metaps/tls"  # [deploy] tls_secret: cert-manager's layout (tls.crt, tls.key, ca.crt)
TLS_FILES = {"tls_cert": f"{TLS_DIR}/tls.crt", "tls_key": f"{TLS_DIR}/tls.key", "tls_ca": f"{TLS_DIR}/ca.crt"}
DATA_DIR = "/data"
STATE_DIR = "/var/lib/metaps"
STAGE_DIR = "/stage"  # storage = "per-role": a pod's own copy of the datasets ([data] X -> /stage/X)
UID = 10001
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
PS_GRACE_S = 30  # a PS pod's termination grace: its preStop cut gets all but 10 s of it
FILES = ("job.yaml", "storage.yaml", "controller.yaml", "ps.yaml", "worker.yaml", "data.yaml", "deliver.yaml",
         "network.yaml", "monitoring.yaml", "jobset.yaml")
METRICS_ROLES = ("controller", "ps", "worker")  # the pods that serve /metrics (the PodMonitor's targets)


@dataclass(frozen=True)
class Options:
    """Command-line choices of ``metaps deploy k8s``.

    Args:
        image: the CPU image (``docker/Dockerfile``), e.g. ``reg.example/metaps:0.1.0``.
        namespace: Kubernetes namespace ('' = the one kubectl uses).
        gpu: CUDA image and ``nvidia.com/gpu`` limits for the roles with ``gpu`` > 0 in their resources.
        gpu_image: the CUDA image (default: ``image`` + ``-cuda``).
    """

    image: str
    namespace: str = ""
    gpu: bool = False
    gpu_image: str = ""

    @property
    def pod_image(self) -> str:
        return (self.gpu_image or f"{self.image}-cuda") if self.gpu else self.image


def tls_dns_names(job: Any) -> list[str]:
    """The names the pods dial, which ``[deploy] tls_secret``'s certificate must hold as DNS SANs:
    the controller's Service (``NAME-controller``: the PS, the workers, a PS's preStop ``metaps cut``)
    and each PS pod's ``POD.SERVICE`` name (``NAME-ps-K.NAME-ps``, ``NAME-ps-0-K.NAME-ps`` with
    ``api = "jobset"``: the workers and the controller). gRPC verifies the name as dialed (no
    namespace suffix) and takes no ``*.NAME-ps`` wildcard (one label after it is too few)."""
    n, suffix = job.deploy.name, "-0" if job.deploy.api == "jobset" else ""
    return [f"{n}-controller"] + [f"{n}-ps{suffix}-{k}.{n}-ps" for k in range(job.ps.shards)]


def pod_job_mapping(raw: dict[str, Any], where: str, stage_dir: str = "", tls: bool = False) -> dict[str, Any]:
    """The job mapping pods read: token out, token file and bind host in, ``[faults]`` out.

    Args:
        raw: the job file as parsed TOML.
        where: its path, for messages.
        stage_dir: ``storage = "per-role"``: ``[data] train`` and ``eval`` become
            ``STAGE_DIR/<path>``, the pod's own copy (the ones in ``raw`` name paths under
            ``[deploy] data_source``).
        tls: ``[deploy] tls_secret`` is set: ``[rpc] tls_cert``, ``tls_key``, ``tls_ca`` name
            its files as mounted (``TLS_DIR``).

    Raises:
        ConfigError: the job file holds a token (it would land in a ConfigMap), or ``[rpc]
            tls_*`` paths (local files no pod has).
    """
    data = copy.deepcopy(raw)
    rpc = data.setdefault("rpc", {})
    if rpc.get("token") not in (None, "", REDACTED):
        raise ConfigError(f"{where}: [rpc] token is set; `metaps deploy k8s` never puts a token into a ConfigMap: "
                          "remove it (the pods read the Secret generated from DIR/token)")
    rpc.pop("token", None)
    given = [k for k in TLS_FILES if rpc.get(k)]
    if given:
        raise ConfigError(f"{where}: [rpc] {', '.join(given)} name local files no pod has; unset them and set "
                          "[deploy] tls_secret = \"NAME\" (a Secret holding tls.crt, tls.key, ca.crt)")
    if tls:
        rpc.update(TLS_FILES)
    rpc["token_file"] = TOKEN_PATH
    data.setdefault("ps", {})["host"] = "0.0.0.0"
    if stage_dir:
        section = data.setdefault("data", {})
        for key in ("train", "eval"):
            if section.get(key):
                section[key] = f"{stage_dir}/{section[key]}"
    if data.pop("faults", None):  # a demo's injected slowdowns and kills never ship into a cluster
        log.warning("[faults] left out of the pods' job file (fault injection is for local runs)",
                    extra=kv(job=where))
    return data


class _Gen:
    def __init__(self, job: Any, job_text: str, opts: Options) -> None:
        self.job, self.job_text, self.o = job, job_text, opts
        self.d = job.deploy
        self.n = self.d.name
        self.run_dir = f"{job.run.dir.rstrip('/')}/{job.run.name}"
        self.ckpt_root = f"{DATA_DIR}/{self.run_dir}/checkpoints"
        # the data Job's completion marker: in this run's directory, so a gate never passes on
        # the dataset (or manifest) of an earlier run at the same path
        self.data_ready = f"{self.run_dir}/data-ready.json"
        self.allreduce = str(getattr(job.train.dense_sync, "value", job.train.dense_sync)) == "allreduce"
        self.per_role = self.d.storage == "per-role"
        # [deploy] api = "jobset": a JobSet names its child Jobs NAME-ROLE-0 (metaps.deploy.jobset),
        # so an Indexed pod's hostname is NAME-ROLE-0-K
        self.job_suffix = "-0" if self.d.api == "jobset" else ""

    # ------------------------------------------------------------------ pieces
    def meta(self, name: str, component: str = "", **extra: Any) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name, "labels": self.labels(component) if component else self.labels("")}
        if self.o.namespace:
            m["namespace"] = self.o.namespace
        m.update(extra)
        return m

    def labels(self, component: str) -> dict[str, str]:
        out = {"app.kubernetes.io/name": "metaps", "app.kubernetes.io/instance": self.n}
        if component:
            out["app.kubernetes.io/component"] = component
        return out

    def annotations(self, scrape: bool) -> dict[str, str]:
        if not scrape:
            return {"prometheus.io/scrape": "false"}
        return {"prometheus.io/scrape": "true", "prometheus.io/port": str(self.d.metrics_port),
                "prometheus.io/path": "/metrics"}

    def resources(self, role: str) -> dict[str, Any]:
        r = getattr(self.d.resources, role)
        req = {"cpu": r.cpu, "memory": r.memory}
        lim: dict[str, Any] = dict(req)
        if self.o.gpu and r.gpu:
            lim["nvidia.com/gpu"] = str(r.gpu)
        return {"requests": req, "limits": lim}

    def container(self, name: str, args: list[str], role: str, ports: dict[str, int] | None = None,
                  mounts: list[dict[str, Any]] | None = None, env: list[dict[str, Any]] | None = None,
                  probe_port: int = 0, command: list[str] | None = None) -> dict[str, Any]:
        c: dict[str, Any] = {"name": name, "image": self.o.pod_image, "imagePullPolicy": "IfNotPresent"}
        if command:
            c["command"] = command
        c["args"] = args
        c["workingDir"] = DATA_DIR
        c["env"] = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "HOME", "value": "/tmp"},
                    {"name": "MPLCONFIGDIR", "value": "/tmp/matplotlib"}] + self.log_env() + (env or [])
        if ports:
            c["ports"] = [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in ports.items()]
        c["resources"] = self.resources(role)
        c["volumeMounts"] = (mounts or []) + [{"name": "tmp", "mountPath": "/tmp"}]
        if probe_port:
            # startup covers a warm start's restore; liveness only begins once it passed. With TLS the
            # probes open a TCP connection: a kubelet's gRPC probe speaks plaintext only
            how: dict[str, Any] = {"tcpSocket" if self.d.tls_secret else "grpc": {"port": probe_port}}
            c["startupProbe"] = {**how, "periodSeconds": 10, "timeoutSeconds": 5,
                                 "failureThreshold": max(6, self.d.startup_timeout_s // 10)}
            c["readinessProbe"] = {**copy.deepcopy(how), "periodSeconds": 5, "timeoutSeconds": 5,
                                   "failureThreshold": 3}
            c["livenessProbe"] = {**copy.deepcopy(how), "periodSeconds": 10,
                                  "timeoutSeconds": 10, "failureThreshold": 6}
        c["terminationMessagePolicy"] = "FallbackToLogsOnError"
        c["securityContext"] = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
        return c

    def log_env(self) -> list[dict[str, Any]]:
        """``[log] format = "json"``: ``METAPS_LOG_FORMAT`` in every container, so a command run
        without the job file (the ``deploy wait`` and ``meta-io stage`` init containers, the data
        Job's builds, ``deliver``) writes JSON lines too."""
        fmt = getattr(getattr(self.job, "log", None), "format", "")
        return [{"name": ENV_FORMAT, "value": "json"}] if fmt == "json" else []

    def pod_env(self) -> list[dict[str, Any]]:
        """The pod's name and UID (a replaced pod has a new UID: the controller's incarnation evidence)."""
        return [{"name": "METAPS_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "METAPS_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]

    def train_mounts(self) -> list[dict[str, Any]]:
        tls = [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if self.d.tls_secret else []
        return [{"name": "job", "mountPath": JOB_DIR, "readOnly": True},
                {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}, *tls,
                {"name": "data", "mountPath": DATA_DIR}]

    def init_containers(self, role: str) -> list[dict[str, Any]]:
        """The token copy, then the data gate: the data Job's done file of this run (or ``[data]
        train``'s manifest); per-role, the gate is the data Job's done file (or none) and the
        copy of the datasets into the pod's own volume follows (:meth:`stage_containers`)."""
        copy_token = self.container(
            "token", [f"{SECRET_DIR}/token", TOKEN_PATH], role, command=["install", "-m", "0600"],
            mounts=[{"name": "token-secret", "mountPath": SECRET_DIR, "readOnly": True},
                    {"name": "token", "mountPath": TOKEN_DIR}])
        out = [copy_token]
        if self.d.data_input or not self.per_role:  # per-role without a data Job: `stage --wait` is the gate
            gate = self.data_ready if self.d.data_input else f"{self.job.data.train}/manifest.json"
            out.append(self.container("wait-data", ["deploy", "wait", "--path", gate, "--timeout", "86400"], role,
                                      mounts=[{"name": "data", "mountPath": DATA_DIR}]))
        if self.per_role:
            # a worker reads every batch; the controller batch counts (manifest + index); the PS the
            # schema in the train manifest (when [data] schema is empty)
            datasets = self.datasets()[:1] if role == "ps" else self.datasets()
            out += self.stage_containers(role, datasets, metadata_only=role != "worker")
        return out

    # ---------------------------------------------------------- per-role storage
    def datasets(self) -> list[tuple[str, str]]:
        """(key, path under ``data_source``) of the datasets training reads."""
        return [(k, p) for k, p in (("train", self.job.data.train), ("eval", self.job.data.eval)) if p]

    def staged(self, path: str) -> str:
        """A dataset's path in a pod's own staging volume."""
        return f"{STAGE_DIR}/{path}"

    def source(self, path: str) -> str:
        """A dataset's URI under ``[deploy] data_source``."""
        return f"{self.d.data_source.rstrip('/')}/{path}"

    def stage_containers(self, role: str, datasets: list[tuple[str, str]],
                         metadata_only: bool = False) -> list[dict[str, Any]]:
        """Init containers copying ``datasets`` from ``data_source`` into the pod's staging volume
        (``metaps meta-io stage``: waits for the source's manifest, copies it last, verifies)."""
        out = []
        for key, path in datasets:
            args = ["meta-io", "stage", "--from", self.source(path), "--to", self.staged(path), "--wait", "86400"]
            out.append(self.container(f"stage-{key}", args + (["--metadata-only"] if metadata_only else []), role,
                                      mounts=self.stage_mounts()))
        return out

    def stage_volume(self) -> dict[str, Any]:
        """A generic ephemeral volume: a PVC made with the pod (``POD-stage``) and deleted with it."""
        spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                                "resources": {"requests": {"storage": self.d.stage_size}}}
        if self.d.stage_storage_class:
            spec["storageClassName"] = self.d.stage_storage_class
        return {"name": "stage", "ephemeral": {"volumeClaimTemplate": {
            "metadata": {"labels": self.labels("stage")}, "spec": spec}}}

    def stage_mounts(self) -> list[dict[str, Any]]:
        return [{"name": "stage", "mountPath": STAGE_DIR}] if self.per_role else []

    def stage_volumes(self) -> list[dict[str, Any]]:
        return [self.stage_volume()] if self.per_role else []

    def volumes(self, *extra: dict[str, Any], training: bool = True) -> list[dict[str, Any]]:
        vols: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}},
                                      {"name": "data", "persistentVolumeClaim": {"claimName": f"{self.n}-data"}}]
        if training:
            vols += [{"name": "job", "configMap": {"name": f"{self.n}-job"}},
                     {"name": "token-secret", "secret": {"secretName": f"{self.n}-token", "defaultMode": 0o400}},
                     {"name": "token", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]
            if self.d.tls_secret:  # [deploy] tls_secret: 0400 + the pod's fsGroup (0440), read in place
                vols.append({"name": "tls", "secret": {"secretName": self.d.tls_secret, "defaultMode": 0o400}})
        return vols + list(extra)

    def pod_spec(self, containers: list[dict[str, Any]], restart: str, volumes: list[dict[str, Any]],
                 init: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {"restartPolicy": restart, "automountServiceAccountToken": False,
                                "enableServiceLinks": False}
        spec.update(extra)
        spec["securityContext"] = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                                   "fsGroupChangePolicy": "OnRootMismatch",
                                   "seccompProfile": {"type": "RuntimeDefault"}}
        if init:
            spec["initContainers"] = init
        spec["containers"] = containers
        spec["volumes"] = volumes
        return spec

    def template(self, component: str, spec: dict[str, Any], scrape: bool) -> dict[str, Any]:
        return {"metadata": {"labels": self.labels(component), "annotations": self.annotations(scrape)},
                "spec": self.placed(component, spec)}

    def placed(self, role: str, spec: dict[str, Any]) -> dict[str, Any]:
        """``spec`` with ``[deploy.roles.ROLE]`` (node selector, tolerations, affinity, service account)
        and ``[deploy] image_pull_secrets``; an affinity's terms are added to the pod's own (the PS's
        spread), each rule's list extended."""
        place = getattr(self.d.roles, role)
        extra: dict[str, Any] = {}
        if place.service_account:
            extra["serviceAccountName"] = place.service_account
        if self.d.image_pull_secrets:
            extra["imagePullSecrets"] = [{"name": n} for n in self.d.image_pull_secrets]
        if place.node_selector:
            extra["nodeSelector"] = dict(place.node_selector)
        if place.tolerations:
            extra["tolerations"] = [t.manifest() for t in place.tolerations]
        if place.affinity:
            affinity = copy.deepcopy(spec.get("affinity", {}))
            for kind, rules in place.affinity.items():
                mine = affinity.setdefault(kind, {})
                for rule, terms in rules.items():
                    if isinstance(terms, list) and isinstance(mine.get(rule), list):
                        mine[rule] = mine[rule] + copy.deepcopy(terms)
                    else:
                        mine[rule] = copy.deepcopy(terms)
            extra["affinity"] = affinity
        if not extra:
            return spec
        # placement keys before the containers, as a person would write them
        head = {k: v for k, v in spec.items() if k not in ("initContainers", "containers", "volumes")}
        return {**head, **extra, **{k: v for k, v in spec.items() if k in ("initContainers", "containers", "volumes")}}

    def job_limits(self, training: bool) -> dict[str, Any]:
        """``ttlSecondsAfterFinished`` (every Job) and ``activeDeadlineSeconds`` (training Jobs)."""
        out: dict[str, Any] = {}
        if training and self.d.active_deadline_s:
            out["activeDeadlineSeconds"] = self.d.active_deadline_s
        if self.d.ttl_after_finished_s:
            out["ttlSecondsAfterFinished"] = self.d.ttl_after_finished_s
        return out

    # ------------------------------------------------------------------ objects
    def job_objects(self) -> list[dict[str, Any]]:
        return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": self.meta(f"{self.n}-job", "config"),
                 "data": {"job.toml": self.job_text}}]

    def storage(self) -> list[dict[str, Any]]:
        def pvc(name: str, mode: str, size: str, component: str) -> dict[str, Any]:
            spec: dict[str, Any] = {"accessModes": [mode], "resources": {"requests": {"storage": size}}}
            if self.d.storage_class:
                spec["storageClassName"] = self.d.storage_class
            return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": self.meta(name, component),
                    "spec": spec}
        return [pvc(f"{self.n}-data", "ReadWriteMany", self.d.storage_size, "storage"),
                pvc(f"{self.n}-controller-state", "ReadWriteOnce", self.d.state_size, "controller")]

    def failure_policy(self, container: str, ignore_codes: tuple[int, ...] = ()) -> dict[str, Any]:
        """A Job's ``podFailurePolicy``: the run failed (exit 4) fails the Job; disruptions and
        ``ignore_codes`` do not count toward ``backoffLimit``; anything else is retried.

        A rule on exit codes carries an explicit ``onPodConditions: []``: the OpenAPI schemas of
        Kubernetes 1.25 to 1.28 mark it required (kubernetes/api#48), so client-side validation
        there refuses a rule without it; an empty list matches as an absent one."""
        rules: list[dict[str, Any]] = [
            {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In",
                                                   "values": [exit_codes.RUN_FAILED]}, "onPodConditions": []},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
        if ignore_codes:
            rules.append({"action": "Ignore", "onExitCodes": {"containerName": container, "operator": "In",
                                                               "values": sorted(ignore_codes)}, "onPodConditions": []})
        return {"rules": rules}

    def controller(self) -> list[dict[str, Any]]:
        port, mport = self.d.controller_port, self.d.metrics_port
        # one state dir per run name: a new run (day 2) starts its own data accounting
        args = ["controller", "--config", JOB_PATH, "--address", f"0.0.0.0:{port}", "--state-dir",
                f"{STATE_DIR}/runs/{self.job.run.name}", "--metrics-port", str(mport), "--metrics-host", "0.0.0.0",
                "--checkpoint-root", self.ckpt_root, "--exit-when-done",
                "--termination-log", "/dev/termination-log", "--signal-exit-code", str(exit_codes.SIGTERM)]
        if self.d.restore_from:  # the warm start is the run's first cut (what the PS pods restore)
            args += ["--warm-start-latest", self.d.restore_from]
        c = self.container("controller", args, "controller", {"grpc": port, "metrics": mport},
                           self.train_mounts() + [{"name": "state", "mountPath": STATE_DIR}] + self.stage_mounts(),
                           self.pod_env(), probe_port=port)
        spec = self.pod_spec([c], "Never", self.volumes(
            {"name": "state", "persistentVolumeClaim": {"claimName": f"{self.n}-controller-state"}},
            *self.stage_volumes()),
            self.init_containers("controller"), **self.priority())
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": self.meta(f"{self.n}-controller", "controller"),
               "spec": {"completions": 1, "parallelism": 1, "backoffLimit": 6, **self.job_limits(True),
                        "podFailurePolicy": self.failure_policy("controller", (exit_codes.SIGTERM,)),
                        "template": self.template("controller", spec, True)}}
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(f"{self.n}-controller", "controller"),
               "spec": {"selector": self.labels("controller"),
                        "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}]}}
        return [svc, job]

    def priority(self) -> dict[str, Any]:
        return {"priorityClassName": self.d.priority_class} if self.d.priority_class else {}

    @property
    def controller_addr(self) -> str:
        return f"{self.n}-controller:{self.d.controller_port}"

    def ps(self) -> list[dict[str, Any]]:
        port, mport, svc_name = self.d.ps_port, self.d.metrics_port, f"{self.n}-ps"
        # an Indexed Job pod's hostname is NAME-ps-K (shard K: --shard auto), its DNS name
        # NAME-ps-K.NAME-ps through the headless Service (spec.subdomain)
        args = ["ps", "--config", JOB_PATH, "--shard", "auto", "--port", str(port), "--metrics-port", str(mport),
                "--controller", self.controller_addr,
                "--advertise", f"{svc_name}{self.job_suffix}-$(METAPS_INDEX).{svc_name}",
                "--checkpoint-root", self.ckpt_root, "--signal-exit-code", str(exit_codes.SIGTERM)]
        if self.d.restore_from:
            args += ["--restore-latest", self.d.restore_from]
        env = self.pod_env() + [{"name": "METAPS_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}]
        c = self.container("ps", args, "ps", {"grpc": port, "metrics": mport},
                           self.train_mounts() + self.stage_mounts(), env, probe_port=port)
        # a drain or eviction: ask the controller for a checkpoint cut while this shard still serves,
        # so its replacement is recovered to a cut taken just now (within the grace period)
        c["lifecycle"] = {"preStop": {"exec": {"command": [
            "metaps", "cut", "--config", JOB_PATH, "--controller", self.controller_addr,
            "--wait", str(PS_GRACE_S - 10), "--reason", "preStop: the PS pod is terminating"]}}}
        sel = {"matchLabels": self.labels("ps")}
        spread = {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                      {"weight": 100, "podAffinityTerm": {"labelSelector": sel,
                                                          "topologyKey": "kubernetes.io/hostname"}}]}},
                  "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                                 "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": sel}]}
        spec = self.pod_spec([c], "Never", self.volumes(*self.stage_volumes()), self.init_containers("ps"),
                             subdomain=svc_name, terminationGracePeriodSeconds=PS_GRACE_S, **self.priority(), **spread)
        shards = self.job.ps.shards
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": self.meta(svc_name, "ps"),
               "spec": {"completions": shards, "parallelism": shards, "completionMode": "Indexed",
                        **self.ps_backoff(shards), **self.job_limits(True),
                        "podFailurePolicy": self.failure_policy("ps", (exit_codes.SUPERSEDED, exit_codes.SIGTERM)),
                        "template": self.template("ps", spec, True)}}
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(svc_name, "ps"),
               "spec": {"clusterIP": "None", "selector": self.labels("ps"), "publishNotReadyAddresses": True,
                        "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}]}}
        pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": self.meta(svc_name, "ps"),
               "spec": {"maxUnavailable": self.d.ps_max_unavailable, "selector": sel}}
        return [svc, job, pdb]

    def ps_backoff(self, shards: int) -> dict[str, Any]:
        """The PS Job's retry budget: per shard (``backoffLimitPerIndex``, ``maxFailedIndexes: 0``:
        a shard out of retries fails the Job; no Job-wide ``backoffLimit``, which would count every
        shard's failures together) or Job-wide (``backoffLimit``). The ``podFailurePolicy`` holds
        either way: exit 4 fails the Job, ignored exits and disruptions count toward neither."""
        if self.d.ps_backoff_limit_per_index:
            return {"backoffLimitPerIndex": self.d.ps_backoff_limit_per_index, "maxFailedIndexes": 0}
        return {"backoffLimit": max(6, shards * self.job.controller.agent.restart_limit)}

    def worker(self) -> list[dict[str, Any]]:
        mport, name = self.d.metrics_port, f"{self.n}-worker"
        ps_pattern = f"{self.n}-ps{self.job_suffix}-{{k}}.{self.n}-ps:{self.d.ps_port}"
        args = ["worker", "--config", JOB_PATH, "--rank", "auto", "--ps", ps_pattern, "--controller",
                self.controller_addr, "--run-dir", self.run_dir, "--metrics-port", str(mport),
                "--metrics-host", "0.0.0.0"]
        env = self.pod_env()
        ports = {"metrics": mport}
        workers = self.job.train.workers
        job_spec: dict[str, Any] = {"parallelism": workers,
                                    "backoffLimit": max(6, workers * self.job.controller.agent.restart_limit),
                                    **self.job_limits(True)}
        extra: dict[str, Any] = {}
        objs: list[dict[str, Any]] = []
        if self.allreduce:
            ar_port = self.job.train.allreduce_port or 29500
            env = env + [{"name": "METAPS_ALLREDUCE", "value": f"{name}{self.job_suffix}-0.{name}:{ar_port}"}]
            ports["allreduce"] = ar_port
            job_spec.update(completions=workers, completionMode="Indexed")
            extra["subdomain"] = name
            objs.append({"apiVersion": "v1", "kind": "Service", "metadata": self.meta(name, "worker"),
                         "spec": {"clusterIP": "None", "selector": self.labels("worker"),
                                  "ports": [{"name": "allreduce", "port": ar_port, "protocol": "TCP"}]}})
        c = self.container("worker", args, "worker", ports, self.train_mounts() + self.stage_mounts(), env)
        spec = self.pod_spec([c], "Never", self.volumes(*self.stage_volumes()), self.init_containers("worker"),
                             terminationGracePeriodSeconds=30, **extra)
        # scale-down deletions (143), drains and fenced-off processes never count as failures
        job_spec["podFailurePolicy"] = self.failure_policy("worker", (exit_codes.SUPERSEDED, exit_codes.SIGTERM))
        job_spec["template"] = self.template("worker", spec, True)
        objs.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": self.meta(name, "worker"), "spec": job_spec})
        return objs

    def data(self) -> list[dict[str, Any]]:
        if not self.d.data_input:
            return []
        mounts = [{"name": "data", "mountPath": DATA_DIR}] + self.stage_mounts()
        if self.d.data_eval_input and not self.job.data.eval:
            raise ConfigError(f"{self.job.source}: [deploy] data_eval_input is set but [data] eval is empty")
        # shared: build onto the shared volume; per-role: build into the pod's own volume, then upload
        # each dataset to data_source (`meta-io stage`, the manifest last); the done file ends the last step
        out = self.staged if self.per_role else (lambda path: path)
        done = ["--done-file", self.data_ready]

        def build(name: str, src: str, path: str, *extra: str) -> dict[str, Any]:
            return self.container(name, ["meta-io", "build", "--input", src, "--schema", self.d.data_schema,
                                         "--out", out(path), "--overwrite", *extra], "data", mounts=mounts)

        def upload(key: str, path: str, *extra: str) -> dict[str, Any]:
            return self.container(f"upload-{key}", ["meta-io", "stage", "--from", self.staged(path), "--to",
                                                    self.source(path), "--overwrite", *extra], "data", mounts=mounts)
        steps = [build("build-eval", self.d.data_eval_input, self.job.data.eval)] if self.d.data_eval_input else []
        if self.per_role:
            steps.append(build("build-train", self.d.data_input, self.job.data.train))
            if self.d.data_eval_input:
                steps.append(upload("eval", self.job.data.eval))
            steps.append(upload("train", self.job.data.train, *done))
        else:
            steps.append(build("build-train", self.d.data_input, self.job.data.train, *done))
        spec = self.pod_spec([steps[-1]], "OnFailure",
                             self.volumes(*self.stage_volumes(), training=False), steps[:-1] or None)
        return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": self.meta(f"{self.n}-data", "data"),
                 "spec": {"backoffLimit": 3, **self.job_limits(False),
                          "template": self.template("data", spec, False)}}]

    def deliver(self) -> list[dict[str, Any]]:
        if not self.d.deliver_schedule:
            return []
        out = str(self.job.delivery.out)
        gate = self.deliver_gate()
        init: list[dict[str, Any]] = []
        mounts = [{"name": "data", "mountPath": DATA_DIR}]
        if self.per_role and gate and not self.job.delivery.holdout:  # the gate reads [data] eval: a copy
            init = self.stage_containers("deliver", [("eval", self.job.data.eval)])
            gate[1] = self.staged(self.job.data.eval)
            mounts += self.stage_mounts()
        args = ["deliver", "--run", self.run_dir, "--out", out, *gate, *self.d.deliver_args]
        args.append("--if-checkpoint")  # before the run's first checkpoint: exit 0 saying so, not a failure
        c = self.container("deliver", args, "deliver", mounts=mounts)
        spec = self.pod_spec([c], "OnFailure", self.volumes(*(self.stage_volumes() if init else []), training=False),
                             init or None)
        return [{"apiVersion": "batch/v1", "kind": "CronJob", "metadata": self.meta(f"{self.n}-deliver", "deliver"),
                 "spec": {"schedule": self.d.deliver_schedule, "concurrencyPolicy": "Forbid",
                          "startingDeadlineSeconds": 300,
                          "successfulJobsHistoryLimit": 3, "failedJobsHistoryLimit": 3,
                          "jobTemplate": {"spec": {"backoffLimit": 2,
                                                   "activeDeadlineSeconds": self.d.deliver_deadline_s,
                                                   "template": self.template("deliver", spec, False)}}}}]

    def deliver_gate(self) -> list[str]:
        """The delivery CronJob's gate: ``metaps deliver`` refuses to publish ungated unless told.

        ``[deploy] deliver_args`` naming ``--holdout`` or ``--no-gate`` decides; otherwise the
        gate reads ``[delivery] holdout``, else the job's eval data (``[data] eval``). With
        neither, the manifests are not written: a CronJob that refuses every run is no job.
        """
        if "--holdout" in self.d.deliver_args or "--no-gate" in self.d.deliver_args:
            return []
        holdout = str(self.job.delivery.holdout or self.job.data.eval or "")
        if holdout:
            gate = ["--holdout", holdout]
            if self.job.delivery.holdout_rows:
                gate += ["--holdout-rows", str(self.job.delivery.holdout_rows)]
            return gate
        raise ConfigError(f"{self.job.source}: the delivery CronJob needs a gate: set [delivery] holdout or "
                          f"[data] eval, or put \"--no-gate\" in [deploy] deliver_args to publish ungated")

    def network(self) -> list[dict[str, Any]]:
        """Ingress NetworkPolicies: the token is not the only gate to the fleet's gRPC ports.

        Controller and PS pods admit their gRPC port from this job's own pods only (same
        namespace, labels ``app.kubernetes.io/name=metaps`` + ``instance=NAME``: workers,
        the other PS, the controller, a PS pod's preStop ``metaps cut``); worker pods admit
        this job's pods on any port (all-reduce's rendezvous and gloo's peer ports). Every
        policy admits ``metrics_port`` from ``metrics_from_namespace`` ('' = anywhere).
        Kubelet probes come from the node, which a NetworkPolicy never blocks. Egress is
        left open (DNS, storage and registries differ from cluster to cluster).
        """
        if not self.d.network_policy:
            return []
        own = [{"podSelector": {"matchLabels": self.labels("")}}]
        if self.d.metrics_from_namespace:
            scrapers: list[dict[str, Any]] = [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": self.d.metrics_from_namespace}}}]
            metrics_rule: dict[str, Any] = {"from": scrapers}
        else:
            metrics_rule = {}  # no "from": every source
        metrics_rule["ports"] = [{"protocol": "TCP", "port": self.d.metrics_port}]

        def policy(component: str, grpc_port: int | None) -> dict[str, Any]:
            own_rule: dict[str, Any] = {"from": own}
            if grpc_port is not None:
                own_rule["ports"] = [{"protocol": "TCP", "port": grpc_port}]
            return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": self.meta(f"{self.n}-{component}", component),
                    "spec": {"podSelector": {"matchLabels": self.labels(component)}, "policyTypes": ["Ingress"],
                             "ingress": [own_rule, copy.deepcopy(metrics_rule)]}}
        return [policy("controller", self.d.controller_port), policy("ps", self.d.ps_port), policy("worker", None)]

    def monitoring(self) -> list[dict[str, Any]]:
        """``[deploy] pod_monitor``: a prometheus-operator PodMonitor scraping ``/metrics`` on the
        ``metrics`` port of the controller, PS and worker pods of this job."""
        if not self.d.pod_monitor:
            return []
        sel = {"matchLabels": self.labels(""), "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": list(METRICS_ROLES)}]}
        return [{"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                 "metadata": self.meta(self.n, "metrics"),
                 "spec": {"selector": sel, "podTargetLabels": ["app.kubernetes.io/component"],
                          "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "scheme": "http"}]}}]

    def kustomization(self, files: list[str]) -> dict[str, Any]:
        k: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
        if self.o.namespace:
            k["namespace"] = self.o.namespace
        k["resources"] = files
        k["secretGenerator"] = [{"name": f"{self.n}-token", "files": ["token"], "type": "Opaque",
                                 "options": {"labels": self.labels("config")}}]
        if self.job_suffix:  # a JobSet: kustomize knows no JobSet pod template, a hashed name would not reach it
            k["secretGenerator"][0]["options"]["disableNameSuffixHash"] = True
        return k


def render(job: Any, raw: dict[str, Any], opts: Options,
           finish: Callable[[_Gen, dict[str, list[dict[str, Any]]]], None] | None = None) -> dict[str, str]:
    """Every manifest file's text, by file name (``kustomization.yaml`` included).

    Args:
        job: the loaded job (its ``[deploy]`` section included).
        raw: the job file as parsed TOML (what the ConfigMap carries, after :func:`pod_job_mapping`).
        opts: image, namespace, GPU.

    Raises:
        ConfigError: a token in the job file, or sections that do not fit together.
    """
    if not opts.image or any(ch.isspace() for ch in opts.image):
        raise ConfigError(f"--image {opts.image!r}: expected an image reference, e.g. registry.example/metaps:0.1.0")
    device = getattr(job.ps.device, "value", job.ps.device)
    if device == "cuda" and not opts.gpu:
        raise ConfigError(f"{job.source}: [ps] device = 'cuda' needs --gpu (the CUDA image and GPU limits)")
    per_role = job.deploy.storage == "per-role"
    if per_role:
        for key in ("train", "eval"):
            path = getattr(job.data, key)
            if path and (path.startswith("/") or ".." in Path(path).parts or "://" in path):
                raise ConfigError(f"{job.source}: [data] {key} = {path!r}: with [deploy] storage = 'per-role' it is "
                                  "a relative path under [deploy] data_source (no '/' at the start, no '..')")
    where = job.source or "<job>"
    gen = _Gen(job, toml_dumps(pod_job_mapping(raw, where, STAGE_DIR if per_role else "",
                                               tls=bool(job.deploy.tls_secret))), opts)
    parts = {"job.yaml": gen.job_objects(), "storage.yaml": gen.storage(), "controller.yaml": gen.controller(),
             "ps.yaml": gen.ps(), "worker.yaml": gen.worker(), "data.yaml": gen.data(), "deliver.yaml": gen.deliver(),
             "network.yaml": gen.network(), "monitoring.yaml": gen.monitoring()}
    if finish is not None:  # metaps.deploy.jobset.render: the Jobs become one JobSet (``parts`` edited in place)
        finish(gen, parts)
    out = {name: dumps_all(docs) for name, docs in parts.items() if docs}
    out["kustomization.yaml"] = dumps_all([gen.kustomization([n for n in FILES if n in out])])
    return out


def write(files: dict[str, str], out_dir: Path) -> list[Path]:
    """Write the manifests into ``out_dir``; create ``out_dir/token`` (0600, a fresh token) if missing.

    Returns:
        the paths written (the token file only when it was created).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        p = out_dir / name
        p.write_text(text)
        written.append(p)
    token = out_dir / "token"
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(generate_token())
        written.append(token)
    return written
