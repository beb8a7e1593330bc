"""``[deploy]``: what ``metaps deploy k8s`` needs beyond the rest of the job file.

Counts, tables and data paths come from the job's own sections (``[ps] shards``,
``[train] workers``, ``[data]``, ``[run]``, ``[delivery] out``); this section adds
ports, storage, the data-build inputs, the delivery schedule and per-role resources.

Example::

    [deploy]
    name = "ctr"
    data_input = "raw/train"            # on the shared volume; '' = no data Job
    data_schema = "raw/schema.json"
    deliver_schedule = "0 * * * *"
    [deploy.resources.worker]
    cpu = "4"
    memory = "8Gi"
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")
_QTY = re.compile(r"^([0-9]+(\.[0-9]+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
STORAGE = ("shared", "per-role")
APIS = ("jobs", "jobset")  # [deploy] api: the workload objects (metaps.deploy.k8s, metaps.deploy.jobset)
_OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a DNS subdomain: PriorityClass, StorageClass
_CRON = re.compile(r"^(@(hourly|daily|weekly|monthly|yearly|annually)|(\S+\s+){4}\S+)$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# a label key: an optional DNS-subdomain prefix and '/', then a name of at most 63 characters
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
AFFINITY_TERMS = {  # the pod affinity kinds and the rules each may hold (Kubernetes' field names)
    "nodeAffinity": ("requiredDuringSchedulingIgnoredDuringExecution",
                     "preferredDuringSchedulingIgnoredDuringExecution"),
    "podAffinity": ("requiredDuringSchedulingIgnoredDuringExecution",
                    "preferredDuringSchedulingIgnoredDuringExecution"),
    "podAntiAffinity": ("requiredDuringSchedulingIgnoredDuringExecution",
                        "preferredDuringSchedulingIgnoredDuringExecution"),
}
ROLES = ("controller", "ps", "worker", "data", "deliver")


@dataclass(frozen=True)
class Resources:
    """Requests (= limits) of one role's container.

    Args:
        cpu: CPU quantity, e.g. ``"2"`` or ``"500m"``.
        memory: memory quantity, e.g. ``"4Gi"``.
        gpu: ``nvidia.com/gpu`` count with ``--gpu`` (0: none for this role).
    """

    cpu: str = "1"
    memory: str = "2Gi"
    gpu: int = 0

    def validate(self) -> None:
        for key in ("cpu", "memory"):
            if not _QTY.match(getattr(self, key)):
                raise ValueError(f"{key} {getattr(self, key)!r} is not a Kubernetes quantity (e.g. '2', '500m', '4Gi')")
        if self.gpu < 0:
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")


@dataclass(frozen=True)
class RoleResources:
    """Resources per role. Defaults (the table below lists a bare ``Resources``'s): controller
    1 CPU 1Gi; ps and worker 2 CPU 4Gi and 1 GPU with ``--gpu``; data 1 CPU 4Gi; deliver 1 CPU 2Gi.

    Args:
        controller: the controller Job.
        ps: each PS pod (an Indexed Job).
        worker: each worker Job pod (``gpu`` used with ``--gpu``).
        data: the Meta-IO build Job.
        deliver: the delivery CronJob.
    """

    controller: Resources = field(default_factory=lambda: Resources("1", "1Gi"))
    ps: Resources = field(default_factory=lambda: Resources("2", "4Gi", 1))
    worker: Resources = field(default_factory=lambda: Resources("2", "4Gi", 1))
    data: Resources = field(default_factory=lambda: Resources("1", "4Gi"))
    deliver: Resources = field(default_factory=lambda: Resources("1", "2Gi"))


@dataclass(frozen=True)
class Toleration:
    """One toleration of a role's pods, in Kubernetes' own field names.

    E.g. ``tolerations = [{key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule"}]``.

    Args:
        key: the taint's key ('' with ``operator = "Exists"``: every taint).
        operator: ``"Equal"`` (the taint's value is ``value``) or ``"Exists"`` (any value).
        value: the taint's value with ``"Equal"`` ('' with ``"Exists"``).
        effect: ``"NoSchedule"``, ``"PreferNoSchedule"``, ``"NoExecute"`` ('' = every effect).
        toleration_seconds: with ``effect = "NoExecute"``: how long the pod stays on a node after
            the taint appears (-1 = for ever); the TOML key is Kubernetes' ``tolerationSeconds``.
    """

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""
    toleration_seconds: int = field(default=-1, metadata={"toml": "tolerationSeconds"})

    def validate(self) -> None:
        if self.operator not in ("Equal", "Exists"):
            raise ValueError(f"operator: expected 'Equal' or 'Exists', got {self.operator!r}")
        if self.key and not _LABEL_KEY.match(self.key):
            raise ValueError(f"key {self.key!r} is not a label key (e.g. 'nvidia.com/gpu')")
        if not self.key and self.operator != "Exists":
            raise ValueError("key: expected a taint key with operator 'Equal' ('' only with 'Exists'), got ''")
        if self.operator == "Exists" and self.value:
            raise ValueError(f"value: expected '' with operator 'Exists', got {self.value!r}")
        if not _LABEL_VALUE.match(self.value):
            raise ValueError(f"value {self.value!r} is not a label value (63 letters, digits, '-', '_', '.')")
        if self.effect and self.effect not in TAINT_EFFECTS:
            raise ValueError(f"effect: expected one of {', '.join(TAINT_EFFECTS)} or '', got {self.effect!r}")
        if self.toleration_seconds != -1 and (self.toleration_seconds < 0 or self.effect != "NoExecute"):
            raise ValueError(f"tolerationSeconds: expected a count >= 0 with effect 'NoExecute', got "
                             f"{self.toleration_seconds} with effect {self.effect!r}")

    def manifest(self) -> dict[str, Any]:
        """The toleration as a pod spec holds it (unset fields left out)."""
        out: dict[str, Any] = {"key": self.key, "operator": self.operator, "value": self.value,
                               "effect": self.effect}
        out = {k: v for k, v in out.items() if v}
        if self.toleration_seconds != -1:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


def _check_affinity(affinity: dict[str, Any]) -> None:
    """The affinity's two upper levels: its kinds and their rules (the API server checks the terms)."""
    for kind, rules in affinity.items():
        if kind not in AFFINITY_TERMS:
            raise ValueError(f"affinity: expected keys among {', '.join(AFFINITY_TERMS)}, got {kind!r}")
        if not isinstance(rules, dict):
            raise ValueError(f"affinity.{kind}: expected a table, got {type(rules).__name__}")
        for rule, terms in rules.items():
            if rule not in AFFINITY_TERMS[kind]:
                raise ValueError(f"affinity.{kind}: expected keys among {', '.join(AFFINITY_TERMS[kind])}, "
                                 f"got {rule!r}")
            items: Any = terms
            if kind == "nodeAffinity" and rule.startswith("required"):  # a NodeSelector, not a list
                if not isinstance(terms, dict) or set(terms) != {"nodeSelectorTerms"}:
                    raise ValueError(f"affinity.{kind}.{rule}: expected a table {{nodeSelectorTerms = [...]}}, "
                                     f"got {terms!r}")
                items = terms["nodeSelectorTerms"]
            if not isinstance(items, list) or not items:
                raise ValueError(f"affinity.{kind}.{rule}: expected a non-empty list of terms, got {items!r}")
            if not all(isinstance(t, dict) and t for t in items):
                raise ValueError(f"affinity.{kind}.{rule}: expected each term to be a non-empty table, got {items!r}")


@dataclass(frozen=True)
class RolePlacement:
    """Where one role's pods run and as whom (``[deploy.roles.ROLE]``; every key optional).

    Args:
        node_selector: the pods' ``nodeSelector`` (label -> value), e.g. ``{"pool" = "ps"}``.
        tolerations: the pods' ``tolerations`` (a list of tables, Kubernetes' field names).
        affinity: the pods' ``affinity`` in Kubernetes' own form (keys ``nodeAffinity``,
            ``podAffinity``, ``podAntiAffinity``; checked down to their rules, the terms by the
            API server). On the PS its terms are added to the PS's own preferred spread across nodes.
        service_account: the pods' ``serviceAccountName`` ('' = the namespace's ``default``), e.g.
            the account a cloud's workload identity maps to object-store credentials. The
            account's API token stays unmounted (``automountServiceAccountToken: false``).
    """

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[Toleration] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    service_account: str = ""

    def validate(self) -> None:
        for k, v in self.node_selector.items():
            if not _LABEL_KEY.match(k):
                raise ValueError(f"node_selector: key {k!r} is not a label key (e.g. 'cloud.example/pool')")
            if not _LABEL_VALUE.match(v):
                raise ValueError(f"node_selector.{k}: {v!r} is not a label value (63 letters, digits, '-', '_', '.')")
        _check_affinity(self.affinity)
        if self.service_account and not _OBJECT_NAME.match(self.service_account):
            raise ValueError(f"service_account {self.service_account!r} is not a Kubernetes object name")


@dataclass(frozen=True)
class RolePlacements:
    """Node selector, tolerations, affinity and service account per role.

    Args:
        controller: the controller Job's pod.
        ps: the PS pods.
        worker: the worker pods.
        data: the Meta-IO build Job's pod.
        deliver: the delivery CronJob's pods.
    """

    controller: RolePlacement = field(default_factory=RolePlacement)
    ps: RolePlacement = field(default_factory=RolePlacement)
    worker: RolePlacement = field(default_factory=RolePlacement)
    data: RolePlacement = field(default_factory=RolePlacement)
    deliver: RolePlacement = field(default_factory=RolePlacement)


@dataclass(frozen=True)
class DeployConfig:
    """Kubernetes deployment of the job (``metaps deploy k8s``).

    Args:
        name: prefix of every object name (``NAME-controller``, ``NAME-ps``, ...); a DNS label.
        controller_port: the controller's gRPC port (its Service's port).
        ps_port: each PS pod's gRPC port.
        metrics_port: every pod's Prometheus ``/metrics`` port (not 9100: node_exporter's).
        storage: ``"shared"``: one ReadWriteMany volume holds everything (data, run directory,
            checkpoints, bundles); ``"per-role"``: the built datasets live at ``data_source`` and
            each pod that reads them copies them into a volume of its own (a worker the whole
            datasets, the controller their manifests and indexes, the PS the train set's for its
            schema, the delivery gate the eval set) in an init container (``metaps meta-io
            stage``); the shared volume keeps only the run directory, checkpoints and bundles.
        storage_class: storage class of the shared ReadWriteMany volume ('' = the cluster default).
        storage_size: size of the shared volume (run directory, checkpoints, bundles; the data too
            with ``storage = "shared"``).
        data_source: ``storage = "per-role"``: the URI (``s3://``, ``gs://``, ``hdfs://``,
            ``file://``) or absolute path under which ``[data] train`` and ``[data] eval`` (relative
            paths) are the built datasets; the data Job uploads its builds there.
        stage_size: size of each pod's own staging volume (``storage = "per-role"``: a generic
            ephemeral volume, created with the pod and deleted with it).
        stage_storage_class: storage class of the staging volumes ('' = the cluster default;
            a node-local class fits: the copy lives as long as the pod).
        state_size: size of the controller's ReadWriteOnce LMDB state volume.
        data_input: raw logs (Parquet/CSV, path on the shared volume) the data Job builds
            ``[data] train`` from; '' = no data Job (the datasets are already there).
        data_eval_input: raw held-out logs the data Job builds ``[data] eval`` from ('' = none).
        data_schema: schema file for the builds (path on the shared volume).
        deliver_schedule: cron schedule of the delivery CronJob ('' = no CronJob).
        deliver_args: extra ``metaps deliver`` arguments, e.g. ``["--incremental", "--keep", "5"]``.
        restore_from: warm start: a checkpoints directory (shared volume) the PS restore their
            newest committed checkpoint from ('' = cold start).
        ps_max_unavailable: the PS PodDisruptionBudget's ``maxUnavailable``: 0 blocks voluntary
            evictions of PS pods (a node drain waits for the run); 1 lets a drain take one PS
            at a time (the controller restores the fleet to its last cut each time).
        priority_class: ``priorityClassName`` of the controller and PS pods ('' = none; the
            class must exist in the cluster): they are the last to be preempted.
        startup_timeout_s: how long a PS may take to serve (a warm start's restore) before the
            startup probe gives up; liveness probing starts after it.
        deliver_deadline_s: ``activeDeadlineSeconds`` of a delivery run (a hung one cannot block
            the later ones).
        network_policy: write ``network.yaml``: NetworkPolicies that admit only the job's own
            pods to the controller's and the PS's gRPC ports (and to the workers), plus the
            metrics port from ``metrics_from_namespace``.
        metrics_from_namespace: the namespace whose pods may scrape ``metrics_port`` ('' = any
            pod in any namespace: Prometheus runs in different namespaces in different clusters,
            and ``/metrics`` is read-only and carries no secret).
        api: ``"jobs"``: controller, PS, workers (and the data step) are Jobs of their own;
            ``"jobset"``: one JobSet (``jobset.x-k8s.io/v1alpha2``) runs the same pods as
            replicated jobs, started in order, failed or restarted as a group
            (:mod:`metaps.deploy.jobset`).
        queue: ``api = "jobset"``: the Kueue ``LocalQueue`` the JobSet is submitted to (created
            suspended, labelled ``kueue.x-k8s.io/queue-name``: Kueue admits the whole run at
            once). '' = no queue (the JobSet starts when applied).
        max_restarts: ``api = "jobset"``: how many times a child Job that failed (other than
            by a failed run, exit 4, or a deadline) restarts the whole group
            (``failurePolicy.maxRestarts``; 0 = a failed child Job fails the JobSet).
        resources: per-role requests and limits.
        ttl_after_finished_s: ``ttlSecondsAfterFinished`` of the controller, PS, worker and data
            Jobs: the cluster deletes a finished Job (and its pods) this long after it ended
            (0 = never: the Jobs stay until deleted; else >= 60, so the outcome outlives a
            ``kubectl wait``).
        active_deadline_s: ``activeDeadlineSeconds`` of the controller, PS and worker Jobs: a run
            still going this long after its Job started is stopped and the Job fails
            (``DeadlineExceeded``) (0 = no deadline; else >= 60).
        ps_backoff_limit_per_index: ``backoffLimitPerIndex`` of the Indexed PS Job: the failures
            each PS shard may have before the Job fails (``maxFailedIndexes: 0``: a shard that
            runs out fails the Job, since the run cannot go on without it), so one flapping shard
            cannot spend the others' retries; the Job-wide ``backoffLimit`` is then left out
            (Kubernetes counts per index only). 0 = off: one Job-wide ``backoffLimit``
            (``max(6, shards * [controller.agent] restart_limit)``). Needs Kubernetes >= 1.29.
        image_pull_secrets: names of Secrets (``kubernetes.io/dockerconfigjson``) every pod pulls
            its image with (``imagePullSecrets``); the Secrets must exist in the namespace.
        pod_monitor: also write ``monitoring.yaml``: a prometheus-operator ``PodMonitor``
            (``monitoring.coreos.com/v1``) scraping ``/metrics`` on the ``metrics`` port of the
            controller, PS and worker pods (the CRD must be installed).
        roles: per-role node selector, tolerations, affinity and service account
            (``[deploy.roles.ps]`` ...).
        tls_secret: TLS between the pods: the name of a Secret in cert-manager's layout
            (``tls.crt``, ``tls.key``, ``ca.crt``) mounted read-only into the controller, PS
            and worker pods; their job file's ``[rpc] tls_cert`` / ``tls_key`` / ``tls_ca``
            name its files, so every role serves and dials TLS only ('' = plaintext, the
            token still checked). The certificate must name the Service DNS names the pods
            dial (``metaps.deploy.k8s.tls_dns_names``): ``NAME-controller`` and each PS pod's
            ``NAME-ps-K.NAME-ps``.
    """

    name: str = "metaps"
    controller_port: int = 7070
    ps_port: int = 5000
    metrics_port: int = 9400
    storage: str = "shared"
    storage_class: str = ""
    storage_size: str = "100Gi"
    data_source: str = ""
    stage_size: str = "50Gi"
    stage_storage_class: str = ""
    state_size: str = "1Gi"
    data_input: str = ""
    data_eval_input: str = ""
    data_schema: str = ""
    deliver_schedule: str = "0 * * * *"
    deliver_args: list[str] = field(default_factory=list)
    restore_from: str = ""
    ps_max_unavailable: int = 1
    priority_class: str = ""
    startup_timeout_s: int = 1800
    deliver_deadline_s: int = 3600
    network_policy: bool = True
    metrics_from_namespace: str = ""
    api: str = "jobs"
    queue: str = ""
    max_restarts: int = 0
    resources: RoleResources = field(default_factory=RoleResources)
    ttl_after_finished_s: int = 0
    active_deadline_s: int = 0
    ps_backoff_limit_per_index: int = 0
    image_pull_secrets: list[str] = field(default_factory=list)
    pod_monitor: bool = False
    roles: RolePlacements = field(default_factory=RolePlacements)
    tls_secret: str = ""

    def _validate_api(self) -> None:
        """``api``, ``queue``, ``max_restarts``."""
        if self.api not in APIS:
            raise ValueError(f"api: expected one of {', '.join(APIS)}, got {self.api!r}")
        if self.queue and self.api != "jobset":
            raise ValueError(f"queue {self.queue!r} needs api = 'jobset' (three Jobs would be three Kueue "
                             "workloads, admitted one by one)")
        if self.queue and (len(self.queue) > 63 or not _OBJECT_NAME.match(self.queue)):
            raise ValueError(f"queue {self.queue!r} is not a LocalQueue name (lowercase letters, digits, '-', '.'; "
                             "at most 63)")
        if not 0 <= self.max_restarts <= 100:
            raise ValueError(f"max_restarts: expected 0..100, got {self.max_restarts}")
        if self.max_restarts and self.api != "jobset":
            raise ValueError(f"max_restarts {self.max_restarts} is only read with api = 'jobset' (group restarts "
                             "of one JobSet; each Job retries its own pods)")

    def validate(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r} must be a DNS label: lowercase letters, digits, '-', at most 32")
        ports = {"controller_port": self.controller_port, "ps_port": self.ps_port, "metrics_port": self.metrics_port}
        for key, port in ports.items():
            if not 1 <= port <= 65535:
                raise ValueError(f"{key} must be in 1..65535, got {port}")
        if self.metrics_port == 9100:
            raise ValueError("metrics_port 9100 is node_exporter's; pick another (default 9400)")
        if len(set(ports.values())) != len(ports):
            raise ValueError(f"controller_port, ps_port and metrics_port must differ, got {ports}")
        if self.storage not in STORAGE:
            raise ValueError(f"storage must be one of {', '.join(STORAGE)}, got {self.storage!r}")
        if self.storage == "per-role" and not self.data_source:
            raise ValueError("storage = 'per-role' needs data_source (the URI or absolute path under which "
                             "[data] train and [data] eval are the built datasets)")
        if self.data_source and self.storage != "per-role":
            raise ValueError("data_source is only read with storage = 'per-role' (the shared volume holds "
                             "the data otherwise)")
        if self.data_source and not re.match(r"^([a-z][a-z0-9+.-]*://\S+|/\S*)$", self.data_source):
            raise ValueError(f"data_source {self.data_source!r}: expected a URI (s3://bucket/prefix, "
                             "file:///abs/path) or an absolute path")
        if self.stage_storage_class and not _OBJECT_NAME.match(self.stage_storage_class):
            raise ValueError(f"stage_storage_class {self.stage_storage_class!r} is not a Kubernetes object name")
        for key in ("storage_size", "state_size", "stage_size"):
            if not _QTY.match(getattr(self, key)):
                raise ValueError(f"{key} {getattr(self, key)!r} is not a Kubernetes quantity (e.g. '100Gi')")
        if self.data_input and not self.data_schema:
            raise ValueError("data_schema is required with data_input (the schema of the raw logs)")
        if self.data_eval_input and not self.data_input:
            raise ValueError("data_eval_input needs data_input")
        if self.ps_max_unavailable not in (0, 1):
            raise ValueError(f"ps_max_unavailable must be 0 or 1, got {self.ps_max_unavailable}")
        if self.priority_class and not _OBJECT_NAME.match(self.priority_class):
            raise ValueError(f"priority_class {self.priority_class!r} is not a Kubernetes object name")
        for key in ("startup_timeout_s", "deliver_deadline_s"):
            if getattr(self, key) < 60:
                raise ValueError(f"{key} must be >= 60 seconds, got {getattr(self, key)}")
        if self.metrics_from_namespace and not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
                                                        self.metrics_from_namespace):
            raise ValueError(f"metrics_from_namespace {self.metrics_from_namespace!r} is not a namespace name "
                             "(a DNS label: lowercase letters, digits, '-')")
        self._validate_api()
        if self.deliver_schedule and not _CRON.match(self.deliver_schedule.strip()):
            raise ValueError(f"deliver_schedule {self.deliver_schedule!r} is not a cron schedule "
                             "(five fields, e.g. '0 * * * *', or @hourly/@daily)")
        for key in ("ttl_after_finished_s", "active_deadline_s"):
            value = getattr(self, key)
            if value != 0 and not 60 <= value <= 2**31 - 1:
                raise ValueError(f"{key}: expected 0 (none) or seconds >= 60, got {value}")
        if not 0 <= self.ps_backoff_limit_per_index <= 2**31 - 1:
            raise ValueError(f"ps_backoff_limit_per_index: expected a count >= 0 (0 = off), "
                             f"got {self.ps_backoff_limit_per_index}")
        for secret in self.image_pull_secrets:
            if not _OBJECT_NAME.match(secret):
                raise ValueError(f"image_pull_secrets: {secret!r} is not a Secret name")
        if len(set(self.image_pull_secrets)) != len(self.image_pull_secrets):
            raise ValueError(f"image_pull_secrets: expected distinct names, got {self.image_pull_secrets}")
        if self.tls_secret and not _OBJECT_NAME.match(self.tls_secret):
            raise ValueError(f"tls_secret {self.tls_secret!r} is not a Secret name (lowercase letters, digits, "
                             "'-', '.'; e.g. the secretName of a cert-manager Certificate)")
