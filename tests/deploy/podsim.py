"""Run rendered Kubernetes manifests on one machine, pod by pod, the way a kubelet would.

No API server, kind or k3s can run here, yet a pod's wiring (command, args, env,
mounts, DNS names, probes) can be exercised: :class:`PodSim` reads the objects
``kubectl kustomize DIR`` renders and runs each pod

* in its own network namespace (``ip netns``), joined by a veth to a bridge in a hub
  namespace, with its own address (a Service name resolves to the pod behind it: no
  kube-proxy; a headless Service's ``POD.SERVICE`` names resolve to each pod);
* in a private mount, UTS and PID namespace (``unshare --mount --uts --pid``), a fresh one
  per container start as a container runtime gives (the main process is pid 1, so pids say
  nothing about identity); hostname = the pod's hostname (an Indexed Job pod: ``JOB-K``);
  ConfigMap, Secret (``defaultMode``), PVC (one host folder per claim, shared by the pods),
  generic ephemeral (a host folder per pod and volume, ``ROOT/ephemeral/POD-VOLUME``) and
  emptyDir volumes bind-mounted at their ``mountPath``; ``/etc/hosts`` bind-mounted
  from one file holding every Service name and every live pod's name and hostname (a
  kubelet's /etc/hosts holds the pod's own; gloo resolves it to pick its address), rewritten
  in place as pods come and go, like DNS;
  what stands for the image (the checkout on ``PYTHONPATH``, the venv) stays visible when a
  volume covers its path (an emptyDir at ``/tmp`` over a checkout under ``/tmp``): parked
  in ``/run/metaps-podsim-*`` and bound back after the volumes, so any checkout path works;
* as the pod's user: ``securityContext`` ``runAsUser``/``runAsGroup`` (the container's over
  the pod's), ``fsGroup`` and ``supplementalGroups`` as supplementary groups, no capabilities
  (``setpriv`` execs the command once the mounts, which need root, are done; the preStop hook
  runs the same way); without a runAsUser, root (``runAsNonRoot`` then refuses, as a kubelet
  would for a root image). A volume gets the ``fsGroup`` as the kubelet gives it, once per pod
  before the first container: group ``fsGroup``, group read/write (read only for ConfigMap and
  Secret files), setgid directories, recursively -- with ``fsGroupChangePolicy: OnRootMismatch``
  only when the volume's root lacks that group or mode. An emptyDir starts 0777, the
  termination message file 0666. A directory above the image's paths that the user cannot
  enter (a pyenv interpreter under ``/root``, 0700) gets an empty tmpfs in the pod with the
  image's paths bound back below it, as an image would hold them; the image's files must be
  world-readable;
* with the container's ``command`` (or the image's entrypoint ``metaps``, which is this
  machine's venv: ``python -m metaps``; the image itself is not used), its ``args`` with
  ``$(VAR)`` expanded, its env (literal values and the downward-API ``metadata.name``,
  ``metadata.namespace``, ``metadata.uid`` -- a new one per pod -- and the Job completion
  index annotation), ``workingDir``, init containers first, in order;
* probes through the gRPC health service (or a TCP connection: ``tcpSocket``) on the probe's port
  (from the hub namespace, one helper process answering every pod's probes concurrently):
  readiness (:meth:`PodSim.ready`); the startup probe, then the liveness probe once it passed (:meth:`PodSim._watch_probes`):
  ``failureThreshold`` consecutive failures kill the container (SIGTERM to pid 1, SIGKILL
  after the grace period: 137) and the restartPolicy decides. ``probe_time_scale`` divides
  their periods, initial delays, timeouts (at least 1 s) and the kill's grace period (a test's
  "hung for a minute" takes seconds); readiness is not gated on the startup probe here;
* a deleted pod's ``preStop`` exec hook run in its namespaces (``nsenter``) before SIGTERM;
* restarts as the pod's ``restartPolicy`` says (Always / OnFailure) in the same pod:
  same name, same address, same emptyDirs -- what a container restart is.

Jobs (the Job controller, :meth:`PodSim._supervise`): a work-queue Job keeps ``parallelism``
pods running until one succeeds; a Job with ``completions`` runs until that many succeed;
an Indexed Job keeps one pod per index (``JOB_COMPLETION_INDEX``, hostname ``JOB-K``, a
new pod name per attempt) until each index succeeded. With ``restartPolicy: Never`` a
failed pod is replaced by a new pod (new name, uid, address) after the
``podFailurePolicy`` rules decide (``FailJob`` on an exit code: the Job fails and its
pods are deleted; ``Ignore`` on an exit code or the ``DisruptionTarget`` condition: not
counted) and counted failures beyond ``backoffLimit`` fail the Job.
:meth:`PodSim.scale_job` changes parallelism; the excess pods are deleted (SIGTERM, the pod's
grace period) in the Job controller's order (``activePodsForRemoval``: :func:`removal_order`,
pending before running, not ready before ready, the most recently started, the most restarted,
the newest first; so nothing may depend on a particular index staying), and each one's end goes
through the ``podFailurePolicy`` like any other failed pod's (a pod that exits 143 on SIGTERM
is ignored, one that exits 4 fails the Job, another code counts toward ``backoffLimit``);
:meth:`PodSim.evict_pod` is an eviction (a node drain) that a PodDisruptionBudget may
refuse; :meth:`PodSim.delete_pod` is ``kubectl delete pod`` (a Job replaces the pod).
A CronJob's template runs once with :meth:`PodSim.trigger_cronjob`.

JobSets (``jobset.x-k8s.io/v1alpha2``, the JobSet controller, :meth:`PodSim._sync_jobset`):
:meth:`PodSim.start_jobset` applies the webhook's defaults (``completionMode: Indexed``,
``restartPolicy: OnFailure``, ``replicas: 1``, DNS hostnames on: every pod's ``subdomain`` set
to ``network.subdomain`` or the JobSet's name, with a headless Service of that name) and
creates child Jobs ``JOBSET-RJOB-K`` (their pods labelled ``jobset.sigs.k8s.io/jobset-name``
...); ``startupPolicyOrder: InOrder`` creates a replicated job's Jobs once every Job of the
one before has finished or has min(parallelism, completions) pods ready or succeeded; a
suspended JobSet creates nothing until :meth:`PodSim.resume_jobset` (Kueue's admission).
A failed child Job meets the ``failurePolicy``: the first rule (in order) whose
``onJobFailureReasons`` holds the Job's failure reason (``PodFailurePolicy``,
``BackoffLimitExceeded``) and whose ``targetReplicatedJobs`` holds its replicated job acts:
``FailJobSet``; ``RestartJobSet`` (none matching: the same) deletes every child Job and
creates them again once their pods are gone, up to ``maxRestarts`` times, then fails the
JobSet; ``RestartJobSetAndIgnoreMaxRestarts`` restarts uncounted; no failurePolicy: the
JobSet fails. The ``successPolicy`` (``All``/``Any`` of the ``targetReplicatedJobs``' Jobs
complete) completes it. A finished JobSet deletes its child Jobs still active (their
pods are deleted, SIGTERM, uncounted). Not simulated: suspending a running JobSet,
``dependsOn``, ``coordinator``, TTLs.

The termination message (``terminationMessagePath``, default ``/dev/termination-log``) is
the pod's own file bound over that path; the mount point is an empty host file, created
once if missing and left in place. A container killed by signal N exits 128 + N, as a
runtime reports it. Not simulated: the image (the venv replaces it), readOnlyRootFilesystem,
seccomp, resource limits, exec/HTTP probes, Service ClusterIPs and load balancing, node
scheduling, PVC provisioning. Needs root, iproute2 (``ip netns``), util-linux ``unshare`` and
``setpriv``.

Example::

    sim = PodSim(docs, Path("/tmp/sim"), python=sys.executable)
    try:
        sim.start_workload("metaps-controller"); sim.wait_ready("metaps-controller-0")
        ...
    finally:
        sim.close()
"""

from __future__ import annotations

import base64
import fcntl
import itertools
import json
import logging
import os
import re
import secrets
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from common.errors import ConfigError
from common.log import kv

log = logging.getLogger(__name__)

_SIMS = itertools.count()


def _new_tag() -> str:
    """A name part no live namespace on this machine has: this process's pid, a per-process count (two
    simulations in one test) and a random byte; a name left by a killed simulation is skipped. Short:
    ``v<tag><ip>a`` must fit a 15-character interface name."""
    while True:
        tag = f"{os.getpid() % 10000}{next(_SIMS) % 16:x}{secrets.token_hex(1)}"
        if not Path(f"/run/netns/k8h{tag}").exists():
            return tag


HOST_LOCK = "/run/metaps-podsim.lock"
"""Held shared by every live :class:`PodSim` on this machine (see ``PodSim.__init__``)."""
HOST_DIRS = "/run/metaps-podsim.dirs"
"""Host directories a simulation created as mount points, one per line: the last one to close removes them."""

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_available(need_unshare: bool = True) -> bool:
    """root + iproute2 (+ unshare) + a namespace can actually be created here.

    Args:
        need_unshare: also require ``unshare`` (pods get a private mount namespace).
    """
    import shutil

    if os.geteuid() != 0 or not shutil.which("ip") or (need_unshare and not shutil.which("unshare")):
        return False
    probe = f"psprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError):
        return False
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True, timeout=30)
    return True


@dataclass
class Pod:
    """One simulated pod: its namespace, address, spec and current container process."""

    name: str
    owner: str
    spec: dict[str, Any]
    ip: str
    netns: str
    dir: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    phase: str = "Pending"          # Pending | Running | Succeeded | Failed | Deleted
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    deleting: bool = False
    created: float = field(default_factory=time.monotonic)
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    hostname: str = ""               # '' = the pod name
    index: int | None = None         # an Indexed Job pod's completion index
    conditions: set[str] = field(default_factory=set)  # e.g. DisruptionTarget (evicted)
    scaled_down: bool = False        # deleted by the Job controller for a lower parallelism
    started_at: float = 0.0          # when the current container started (monotonic; 0: none yet)
    accounted: bool = False          # its end was counted by the Job controller
    pre_stop_exits: list[int] = field(default_factory=list)  # the preStop hook's exit codes
    started: bool = False            # the current container's startup probe passed (or it has none)
    probe_kills: list[str] = field(default_factory=list)  # 'startup' / 'liveness': containers a probe killed
    volumes_set_up: set[str] = field(default_factory=set)  # volumes made and owned at the pod's start

    @property
    def host(self) -> str:
        return self.hostname or self.name

    @property
    def log_path(self) -> Path:
        return self.dir / "container.log"

    @property
    def ended(self) -> bool:
        return self.phase in ("Succeeded", "Failed", "Deleted")


@dataclass
class JobState:
    """What the simulated Job controller keeps of one Job."""

    name: str
    parallelism: int
    completions: int | None          # None: a work-queue Job
    indexed: bool
    backoff_limit: int
    failure_policy: list[dict[str, Any]]
    failures: int = 0
    status: str = "Running"          # Running | Complete | Failed | Deleted (by its JobSet)
    reason: str = ""


JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


@dataclass
class JobSetState:
    """What the simulated JobSet controller keeps of one JobSet (its spec with the webhook's defaults)."""

    name: str
    namespace: str
    spec: dict[str, Any]
    suspended: bool
    restarts: int = 0                # status.restarts: group restarts so far
    restarts_counted: int = 0        # status.restartsCountTowardsMax
    status: str = "Running"          # Running | Completed | Failed
    reason: str = ""
    children: list[str] = field(default_factory=list)   # child Job names, in creation order
    rjob: dict[str, str] = field(default_factory=dict)  # child Job -> its replicated job
    created: set[str] = field(default_factory=set)      # replicated jobs whose Jobs exist in this attempt
    draining: list[str] = field(default_factory=list)   # pods of the previous attempt not yet gone


def removal_order(pods: Sequence[Pod], ready: Callable[[Pod], bool]) -> list[Pod]:
    """``pods`` in the order the Job controller deletes active pods on a scale-down
    (``activePodsForRemoval``, which sorts by ``controller.ActivePods``): pending (no container
    started: unscheduled here too) before running; not ready before ready; of two ready pods,
    the one ready for less time (here: its container started later); more restarts first;
    the newer pod first.

    Args:
        pods: the Job's active pods.
        ready: the pod's readiness (:meth:`PodSim.ready`).
    """
    def key(p: Pod) -> tuple[int, int, float, int, float]:
        is_ready = p.phase == "Running" and ready(p)
        return (0 if p.phase == "Pending" else 1, int(is_ready), -p.started_at if is_ready else 0.0,
                -p.restarts, -p.created)

    return sorted(pods, key=key)


def _last_exit_code(pod: Pod) -> int | None:
    """The exit code of the pod's last container run (None: its main container never ran).

    Read from the process itself: a deleted pod's end is seen (``phase`` ``Deleted``) as soon
    as its process exited, maybe before the pod's runner recorded the code in ``exit_codes``."""
    p = pod.proc
    if p is not None and p.returncode is not None:
        return 128 - p.returncode if p.returncode < 0 else p.returncode
    return pod.exit_codes[-1] if pod.exit_codes else None


class PodSim:
    """A one-machine kubelet + Job controller for rendered manifests (see the module docstring).

    Args:
        docs: the objects of ``kubectl kustomize DIR``.
        root: working folder (PVC folders, volumes, logs); created.
        python: interpreter that stands in for the image's ``metaps`` entrypoint.
        env: extra environment for every container (e.g. ``PYTHONPATH`` of a checkout).
        subnet: first three octets of the pods' /24.
        probe_time_scale: startup and liveness probes run this many times faster than the
            manifests say: ``periodSeconds``, ``initialDelaySeconds``, ``timeoutSeconds`` (at
            least 1 s) and the grace period of a probe's kill are divided by it (a test's
            minutes of "hung" become seconds); ``failureThreshold`` is kept. 1.0 = as written.
        external: host folders every pod sees at the same path, read-write, like the image's
            paths (bound back over any volume or blocked directory that would hide them): what
            stands for storage outside the cluster that every pod reaches (an object store
            behind a ``file://`` URI, a file share).
    """

    def __init__(self, docs: list[dict[str, Any]], root: Path, python: str = sys.executable,
                 env: dict[str, str] | None = None, subnet: str = "10.231.0",
                 probe_time_scale: float = 1.0, external: Sequence[Path] = ()) -> None:
        if not probe_time_scale > 0:
            raise ConfigError(f"PodSim probe_time_scale: expected > 0, got {probe_time_scale}")
        self.probe_time_scale = float(probe_time_scale)
        self.docs, self.root, self.python = docs, Path(root), python
        self.external = [str(Path(e).resolve()) for e in external]
        self.root.mkdir(parents=True, exist_ok=True)
        self.base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
        self.base_env.update(env or {})
        self.subnet = subnet
        self.tag = _new_tag()
        self.hub = f"k8h{self.tag}"
        self.pods: dict[str, Pod] = {}
        self.namespaces: list[str] = []
        self.created_dirs: list[Path] = []  # host mount points this simulation made (maybe shared)
        self.private_dirs: list[Path] = []  # its own stash directories (/run/metaps-podsim-<tag>/...)
        # Mount points are host directories (/etc/metaps/job, /data, ...) that another simulation on
        # this machine may be using right now: removing one detaches the bind mounts on it in every
        # mount namespace (Linux >= 3.18), so a concurrent simulation's pods would lose their config.
        # Each simulation holds a shared lock on one host-wide file for its life; close() removes the
        # mount points it created only when it can take the lock exclusively (no other one alive).
        self._host_lock = open(HOST_LOCK, "a+")
        fcntl.flock(self._host_lock, fcntl.LOCK_SH)
        self._closed = False
        self.jobs: dict[str, JobState] = {}
        self.jobsets: dict[str, JobSetState] = {}
        self.hosts_file = self.root / "hosts"
        self._lock = threading.RLock()
        self._next_ip = 2
        self._stop = threading.Event()
        self._pod_threads: list[threading.Thread] = []  # every pod's runner (joined by close())
        self._prober = _Prober(self.hub, self.python, self.base_env)
        self._write_hosts()
        _ip("netns", "add", self.hub)
        self.namespaces.append(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{subnet}.1/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        self._thread = threading.Thread(target=self._supervise, name="podsim", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- objects
    def obj(self, kind: str, name: str) -> dict[str, Any]:
        for d in self.docs:
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
        raise KeyError(f"no {kind} {name!r} in the manifests")

    def _template(self, workload: str) -> tuple[dict[str, Any], dict[str, Any]]:
        for d in self.docs:
            if d["metadata"]["name"] != workload:
                continue
            if d["kind"] in ("Deployment", "StatefulSet", "Job"):
                return d, d["spec"]["template"]
            if d["kind"] == "CronJob":
                return d, d["spec"]["jobTemplate"]["spec"]["template"]
        raise KeyError(f"no workload {workload!r} in the manifests")

    # ----------------------------------------------------------------- names
    def _write_hosts(self) -> None:
        """Every Service name -> the address of the pod(s) it selects; rewritten in place."""
        lines = ["127.0.0.1\tlocalhost"]
        with self._lock:
            pods = [p for p in self.pods.values() if not p.ended]  # a finished pod leaves the endpoints
            for p in pods:  # a pod's own hostname resolves to its address, as in a kubelet's /etc/hosts
                lines.append(f"{p.ip}\t{p.name}" + (f" {p.host}" if p.host != p.name else ""))
            for svc in (d for d in self.docs if d["kind"] == "Service"):
                name = svc["metadata"]["name"]
                ns = svc["metadata"].get("namespace", "default")
                sel = svc["spec"].get("selector", {})
                chosen = [p for p in pods if sel.items() <= p.spec["metadata"]["labels"].items()]
                if svc["spec"].get("clusterIP") == "None":
                    for p in chosen:  # POD.SERVICE, or HOSTNAME.SUBDOMAIN for a pod whose subdomain it is
                        host = p.host if p.spec["spec"].get("subdomain") == name else p.name
                        lines.append(f"{p.ip}\t{host}.{name} {host}.{name}.{ns}.svc "
                                     f"{host}.{name}.{ns}.svc.cluster.local")
                if chosen:  # a ClusterIP Service: the (one) pod behind it, no kube-proxy here
                    lines.append(f"{chosen[0].ip}\t{name} {name}.{ns}.svc {name}.{ns}.svc.cluster.local")
        text = "\n".join(lines) + "\n"
        with open(self.hosts_file, "a+") as f:  # same inode: the pods' bind mounts see the change
            f.seek(0)
            f.truncate()
            f.write(text)

    # ----------------------------------------------------------------- volumes
    def _volume_source(self, pod: Pod, vol: dict[str, Any]) -> Path:
        """The host folder that stands for a pod volume, owned as the pod's ``fsGroup`` says: once per
        pod, as the kubelet sets a volume up before the first container (what a container wrote into
        it later keeps its mode: a 0600 token copied by an init container stays 0600)."""
        first = vol["name"] not in pod.volumes_set_up
        pod.volumes_set_up.add(vol["name"])
        p = self._volume_folder(pod, vol, first)
        sc = pod.spec["spec"].get("securityContext", {})
        fresh = first or "configMap" in vol or "secret" in vol  # these two are written anew here
        if sc.get("fsGroup") is not None and fresh:
            _apply_fs_group(p, int(sc["fsGroup"]), readonly="configMap" in vol or "secret" in vol,
                            always=sc.get("fsGroupChangePolicy", "Always") != "OnRootMismatch")
        return p

    def _volume_folder(self, pod: Pod, vol: dict[str, Any], first: bool) -> Path:
        name = vol["name"]
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            self.obj("PersistentVolumeClaim", claim)
            p = self.root / "pvc" / claim
            p.mkdir(parents=True, exist_ok=True)
            return p
        if "ephemeral" in vol:
            # a generic ephemeral volume: the PVC ``POD-VOLUME`` provisioned for this pod alone (a fresh
            # filesystem's root: root-owned 0755 until the fsGroup applies); kept after the pod ends so
            # a test can read what the pod wrote (a cluster deletes it with the pod)
            p = self.root / "ephemeral" / f"{pod.name}-{name}"
            p.mkdir(parents=True, exist_ok=True)
            if first:
                os.chmod(p, 0o755)
            return p
        if "emptyDir" in vol:
            p = pod.dir / "empty" / name
            p.mkdir(parents=True, exist_ok=True)
            if first:
                os.chmod(p, 0o777)  # as the kubelet makes an emptyDir (before fsGroup)
            return p
        if "configMap" in vol or "secret" in vol:  # projected files, each at the source's defaultMode
            src = vol.get("configMap") or vol["secret"]
            if "configMap" in vol:
                files = {k: v.encode() for k, v in self.obj("ConfigMap", src["name"]).get("data", {}).items()}
            else:
                files = {k: base64.b64decode(v) for k, v in self.obj("Secret", src["secretName"]).get("data", {}).items()}
            p = pod.dir / ("cm" if "configMap" in vol else "secret") / name
            p.mkdir(parents=True, exist_ok=True)
            for k, b in files.items():
                (p / k).write_bytes(b)
                os.chmod(p / k, src.get("defaultMode", 0o644))
            return p
        raise ValueError(f"pod {pod.name}: volume {name!r}: unsupported source {sorted(vol)}")

    def _image_paths(self) -> list[str]:
        """What stands for the image (PYTHONPATH entries, the interpreter's installation, the venv) and the
        ``external`` folders: host paths every pod sees where the host has them."""
        image = [p for p in self.base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        image.append(str(Path(self.python).resolve().parent.parent))  # <venv>/bin/python -> <base>
        image.append(str(Path(self.python).parent.parent))  # <venv>/bin/python -> <venv>
        image.append(sys.prefix)
        return sorted({str(Path(q).resolve()) for q in image} | set(self.external))

    def _covered_host_paths(self, mount_paths: list[str], blocked: Sequence[str] = ()) -> list[str]:
        """The image's paths that one of ``mount_paths`` would hide, or that lie under a ``blocked``
        directory (covered by a tmpfs in the pod); the outermost of each nest only."""
        covers = [m.rstrip("/") for m in mount_paths] + list(blocked)
        out: list[str] = []
        for p in self._image_paths():
            if any(p == m or p.startswith(m + "/") for m in covers):
                if not any(p.startswith(o + "/") or p == o for o in out):
                    out.append(p)
        return out

    def _blocked_dirs(self, ident: tuple[int, int, list[int]] | None) -> list[str]:
        """Directories above the image's paths that the container's user cannot enter (``/root`` 0700
        above a pyenv interpreter): each gets an empty tmpfs in the pod, the image's paths bound back
        below it -- what a real image has at those paths, nothing else of the host."""
        if ident is None:
            return []
        uid, gid, groups = ident
        out: list[str] = []
        for p in self._image_paths():
            for a in reversed(Path(p).parents):  # outermost first
                st = a.stat()
                bits = 0o100 if st.st_uid == uid else 0o010 if st.st_gid in (gid, *groups) else 0o001
                if not st.st_mode & bits:
                    if str(a) not in out:
                        out.append(str(a))
                    break
        return out

    @staticmethod
    def _identity(pod: Pod, c: dict[str, Any]) -> tuple[int, int, list[int]] | None:
        """(uid, gid, supplementary groups) the container runs as: its ``securityContext`` over the
        pod's; None = as the image says (root here)."""
        pod_sc, c_sc = pod.spec["spec"].get("securityContext", {}), c.get("securityContext", {})
        uid = c_sc.get("runAsUser", pod_sc.get("runAsUser"))
        if uid is None:
            if c_sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
                raise ConfigError(f"pod {pod.name}: container {c['name']}: runAsNonRoot without runAsUser "
                                  "(the image's user is root here): expected a runAsUser")
            return None
        gid = c_sc.get("runAsGroup", pod_sc.get("runAsGroup", 0))
        groups = [int(g) for g in ([pod_sc["fsGroup"]] if pod_sc.get("fsGroup") is not None else [])
                  + list(pod_sc.get("supplementalGroups", []))]
        return int(uid), int(gid), groups

    def _setpriv(self, ident: tuple[int, int, list[int]] | None, c: dict[str, Any]) -> list[str]:
        """The command prefix that drops root for the container's process (nothing for root)."""
        if ident is None or ident[0] == 0:
            return []
        uid, gid, groups = ident
        out = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
               f"--groups={','.join(str(g) for g in groups)}" if groups else "--clear-groups"]
        if c.get("securityContext", {}).get("allowPrivilegeEscalation") is False:
            out.append("--no-new-privs")
        return out + ["--"]

    def _stash_dir(self, i: int) -> Path:
        """An empty host directory outside /tmp where a pod's mount namespace parks a covered path."""
        d = Path(f"/run/metaps-podsim-{self.tag}/{i}")
        with self._lock:
            if not d.exists():
                d.mkdir(parents=True)
                self.private_dirs.extend([d.parent, d] if d.parent not in self.private_dirs else [d])
        return d

    def _mountpoint(self, path: str) -> None:
        p = Path(path)
        missing = []
        q = p
        while not q.exists():
            missing.append(q)
            q = q.parent
        for m in reversed(missing):
            m.mkdir()
            self.created_dirs.append(m)
            with open(HOST_DIRS, "a") as f:  # one short O_APPEND write: concurrent simulations' lines stay whole
                f.write(f"{m}\n")

    # ----------------------------------------------------------------- pods
    def _new_pod(self, owner: str, name: str, template: dict[str, Any], env: dict[str, str] | None = None,
                 index: int | None = None) -> Pod:
        with self._lock:
            if name in self.pods and self.pods[name].phase != "Deleted":
                raise ValueError(f"pod {name} exists")
            old = self.pods.get(name)
            if old is not None:  # a StatefulSet pod comes back with its name (and, here, its address)
                ip, ns = old.ip, old.netns
            else:
                ip, ns = f"{self.subnet}.{self._next_ip}", f"k8p{self.tag}{self._next_ip}"
                self._next_ip += 1
                self._make_netns(ns, ip)
            pod = Pod(name, owner, template, ip, ns, self.root / "pods" / name, dict(env or {}), index=index)
            if index is not None:
                pod.hostname = f"{owner}-{index}"  # an Indexed Job pod's hostname
                pod.env_extra["JOB_COMPLETION_INDEX"] = str(index)
            if pod.dir.exists():  # the same name again (a StatefulSet-style pod): fresh emptyDirs
                pod.dir = self.root / "pods" / f"{name}.{secrets.token_hex(3)}"
            pod.dir.mkdir(parents=True, exist_ok=True)
            self.pods[name] = pod
        self._write_hosts()
        thread = threading.Thread(target=self._run_pod, args=(pod,), name=f"pod-{name}", daemon=True)
        with self._lock:
            self._pod_threads.append(thread)
        thread.start()
        return pod

    def _make_netns(self, ns: str, ip: str) -> None:
        i = ip.rsplit(".", 1)[1]
        a, b = f"v{self.tag}{i}a", f"v{self.tag}{i}b"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", a, "netns", self.hub)
        _ip("link", "set", b, "netns", ns)
        _ip("-n", self.hub, "link", "set", a, "master", "br0")
        _ip("-n", self.hub, "link", "set", a, "up")
        _ip("-n", ns, "link", "set", b, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def _argv(self, pod: Pod, c: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        env = dict(self.base_env)
        env["HOSTNAME"] = pod.host
        env.update(pod.env_extra)
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
            elif "valueFrom" in e:
                path = e["valueFrom"].get("fieldRef", {}).get("fieldPath", "")
                values = {"metadata.name": pod.name, "status.podIP": pod.ip, "metadata.uid": pod.uid,
                          "metadata.namespace": pod.spec["metadata"].get("namespace", "default")}
                if pod.index is not None:
                    values["metadata.annotations['batch.kubernetes.io/job-completion-index']"] = str(pod.index)
                if path not in values:
                    raise ValueError(f"pod {pod.name}: env {e['name']}: unsupported valueFrom {e['valueFrom']}")
                env[e["name"]] = values[path]
        command = c.get("command") or [self.python, "-m", "metaps"]  # the image's ENTRYPOINT ["metaps"]
        args = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in c.get("args", [])]
        return command + args, env

    def _container_cmd(self, pod: Pod, c: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        argv, env = self._argv(pod, c)
        vols = {v["name"]: v for v in pod.spec["spec"].get("volumes", [])}
        mounts = list(c.get("volumeMounts", []))
        # a mount over /tmp hides the volume sources under /tmp: mount such paths last
        mounts.sort(key=lambda m: str(self.root).startswith(m["mountPath"].rstrip("/") + "/"))
        script = ["set -e", f"hostname {shlex.quote(pod.host)}",
                  f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts"]
        # the termination message file (terminationMessagePath): the pod's own file, read by
        # termination_message(); its mount point is an empty host file, created once and kept
        # (another simulation may be using it as its mount point right now)
        term_path = c.get("terminationMessagePath", "/dev/termination-log")
        term = pod.dir / f"termination-{c['name']}"
        term.touch()
        os.chmod(term, 0o666)  # as the kubelet makes it: writable by the container's user
        Path(term_path).touch(exist_ok=True)
        script.append(f"mount --bind {shlex.quote(str(term))} {shlex.quote(term_path)}")  # before /tmp is covered
        # What stands for the image (the checkout on PYTHONPATH, the interpreter's environment) must stay
        # visible when a volume covers its path (an emptyDir at /tmp over a checkout under /tmp), and
        # reachable for the container's user (an interpreter under /root, 0700): bound to a stash first,
        # bound back into place after the volumes and the tmpfs over each blocked directory.
        ident = self._identity(pod, c)
        blocked = [b for b in self._blocked_dirs(ident)
                   if not any(m["mountPath"].rstrip("/") == b or m["mountPath"].startswith(b + "/")
                              for m in mounts)]  # never hide a volume's mount point
        covered = self._covered_host_paths([m["mountPath"] for m in mounts], blocked)
        stashes = []
        for i, path in enumerate(covered):
            stash = self._stash_dir(i)
            script.append(f"mount --bind {shlex.quote(path)} {shlex.quote(str(stash))}")
            stashes.append((stash, path))
        for m in mounts:
            src = self._volume_source(pod, vols[m["name"]])
            with self._lock:
                self._mountpoint(m["mountPath"])
            script.append(f"mount --bind {shlex.quote(str(src))} {shlex.quote(m['mountPath'])}")
            if m.get("readOnly"):
                script.append(f"mount -o remount,bind,ro {shlex.quote(m['mountPath'])}")
        for b in blocked:  # (mkdir: a blocked directory under a volume's path, e.g. /tmp's, is not there yet)
            script.append(f"mkdir -p {shlex.quote(b)} && mount -t tmpfs -o mode=0755,size=1m podsim-image "
                          f"{shlex.quote(b)}")
        for stash, path in stashes:
            script.append(f"mkdir -p {shlex.quote(path)} && mount --bind {shlex.quote(str(stash))} {shlex.quote(path)}")
        if c.get("workingDir"):  # the runtime creates a missing working directory
            with self._lock:
                self._mountpoint(c["workingDir"])
            script.append(f"cd {shlex.quote(c['workingDir'])}")
        # mounts need root, the container's process must not have it: runAsUser/runAsGroup, the
        # fsGroup as a supplementary group, no capabilities left
        script.append('exec "$@"')
        # a fresh PID namespace per container start, as a container runtime gives: the command is pid 1
        cmd = ["ip", "netns", "exec", pod.netns, "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
               "--kill-child", "--propagation", "private", "sh", "-c", "\n".join(script), "sh",
               *self._setpriv(ident, c), *argv]
        return cmd, env

    def _exec(self, pod: Pod, c: dict[str, Any]) -> subprocess.Popen[bytes]:
        cmd, env = self._container_cmd(pod, c)
        with pod.log_path.open("ab") as out:
            out.write(f"==> {c['name']}: {json.dumps(cmd[-len(c.get('args', [])) - 3:])}\n".encode())
            out.flush()
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)

    def _run_pod(self, pod: Pod) -> None:
        spec = pod.spec["spec"]
        policy = spec.get("restartPolicy", "Always")
        try:
            for c in spec.get("initContainers", []):
                while True:
                    if pod.deleting or self._stop.is_set():
                        return
                    p = self._exec(pod, c)
                    with self._lock:
                        pod.proc = p
                    rc = p.wait()
                    if rc == 0:
                        break
                    if policy == "Never" or pod.deleting:
                        pod.phase = "Failed"
                        return
                    pod.restarts += 1
                    time.sleep(1.0)
            main = spec["containers"][0]
            while not pod.deleting and not self._stop.is_set():
                pod.started = False  # this container start's startup probe has not passed yet
                p = self._exec(pod, main)
                with self._lock:
                    pod.proc, pod.phase, pod.started_at = p, "Running", time.monotonic()
                    orphan = pod.deleting  # deleted while this container started: no deletion will stop it
                if orphan:
                    _signal_group(p, signal.SIGKILL)
                prober = threading.Thread(target=self._watch_probes, args=(pod, main, p), name=f"probe-{pod.name}",
                                          daemon=True)
                prober.start()
                rc = p.wait()
                rc = 128 - rc if rc < 0 else rc  # killed by signal N: the runtime reports 128 + N
                pod.exit_codes.append(rc)
                if pod.deleting or self._stop.is_set():
                    break
                if rc == 0 and policy != "Always":
                    pod.phase = "Succeeded"
                    return
                if policy == "Never":
                    pod.phase = "Failed"
                    return
                pod.restarts += 1
                log.info("container restarted", extra=kv(pod=pod.name, exit_code=rc, restarts=pod.restarts))
                time.sleep(1.0)  # the kubelet's back-off, short here
        finally:
            if pod.deleting:
                pod.phase = "Deleted"
            if not self._stop.is_set():
                self._write_hosts()  # an ended pod leaves the Services' endpoints

    # ----------------------------------------------------------------- workloads
    def start_workload(self, name: str) -> list[Pod]:
        """Create the pods of a Deployment, StatefulSet or Job (its controller keeps them)."""
        obj, tpl = self._template(name)
        kind = obj["kind"]
        if kind == "Deployment":
            return [self._new_pod(name, f"{name}-{secrets.token_hex(4)}-{secrets.token_hex(2)}"[:63], tpl)]
        if kind == "StatefulSet":
            return [self._new_pod(name, f"{name}-{k}", tpl) for k in range(obj["spec"].get("replicas", 1))]
        if kind == "Job":
            spec = obj["spec"]
            indexed = spec.get("completionMode") == "Indexed"
            st = JobState(name, int(spec.get("parallelism", 1)), spec.get("completions"), indexed,
                          int(spec.get("backoffLimit", 6)), list(spec.get("podFailurePolicy", {}).get("rules", [])))
            with self._lock:  # the Job controller thread must not see the Job before its pods
                self.jobs[name] = st
                if indexed:
                    return [self._new_job_pod(st, tpl, k) for k in range(min(st.parallelism, st.completions or 0))]
                n = st.parallelism if st.completions is None else min(st.parallelism, st.completions)
                return [self._new_job_pod(st, tpl) for _ in range(n)]
        raise ValueError(f"{name}: cannot start a {kind}")

    def _new_job_pod(self, st: JobState, tpl: dict[str, Any], index: int | None = None) -> Pod:
        prefix = st.name if index is None else f"{st.name}-{index}"
        return self._new_pod(st.name, f"{prefix}-{secrets.token_hex(3)[:5]}", tpl, index=index)

    def trigger_cronjob(self, name: str) -> Pod:
        """Run a CronJob's job template once (``kubectl create job --from=cronjob/NAME``)."""
        obj, tpl = self._template(name)
        if obj["kind"] != "CronJob":
            raise ValueError(f"{name} is a {obj['kind']}, not a CronJob")
        return self._new_pod(name, f"{name}-manual-{secrets.token_hex(3)}", tpl)

    def job_pods(self, job: str) -> list[Pod]:
        with self._lock:
            return [p for p in self.pods.values() if p.owner == job]

    def index_pod(self, job: str, index: int) -> Pod | None:
        """The newest pod of an Indexed Job's ``index`` (None before the first one)."""
        pods = [p for p in self.job_pods(job) if p.index == index]
        return max(pods, key=lambda p: p.created) if pods else None

    def job_status(self, job: str) -> str:
        """Running | Complete | Failed (the Job's conditions)."""
        with self._lock:
            return self.jobs[job].status

    def job_complete(self, job: str) -> bool:
        """The Job completed and none of its pods still runs."""
        return self.job_status(job) == "Complete" and all(p.ended for p in self.job_pods(job))

    def scale_job(self, job: str, parallelism: int) -> None:
        """``kubectl patch job JOB -p '{"spec":{"parallelism":N}}'``: start pods, or delete excess ones.

        Which pods go is the Job controller's choice (:func:`removal_order`: not ready and
        recently started ones first), so nothing may depend on a particular index staying
        (worker 0 included). Their ends are accounted by the ``podFailurePolicy``.
        """
        with self._lock:
            self.jobs[job].parallelism = parallelism
            active = [p for p in self.job_pods(job) if not p.ended and not p.deleting]
        ready = {p.name: self.ready(p.name) for p in active}  # gRPC probes: not under the lock
        with self._lock:
            active = [p for p in active if not p.ended and not p.deleting]
            for p in removal_order(active, lambda q: ready[q.name])[:max(0, len(active) - parallelism)]:
                p.scaled_down = True
                self.delete_pod(p.name)

    def delete_pod(self, name: str, grace_s: float | None = None, condition: str = "") -> None:
        """``kubectl delete pod``: SIGTERM, then SIGKILL after the grace period (in the background).

        Args:
            condition: a pod condition set first (``DisruptionTarget``: an eviction).
        """
        pod = self.pods[name]
        if condition:
            pod.conditions.add(condition)
        pod.deleting = True
        grace = float(pod.spec["spec"].get("terminationGracePeriodSeconds", 30)) if grace_s is None else grace_s

        def stop() -> None:
            p = pod.proc
            if p is not None and p.poll() is None:
                t0 = time.monotonic()
                self._pre_stop(pod, grace)  # the kubelet runs the hook first, within the grace period
                grace_left = max(1.0, grace - (time.monotonic() - t0))
                _signal_main(p, signal.SIGTERM)  # the kubelet signals the container's pid 1 only
                try:
                    p.wait(grace_left)
                except subprocess.TimeoutExpired:
                    _signal_group(p, signal.SIGKILL)
                    p.wait()
            pod.phase = "Deleted"
            self._write_hosts()
        threading.Thread(target=stop, daemon=True).start()

    def _pre_stop(self, pod: Pod, grace: float) -> None:
        """Run the main container's ``lifecycle.preStop.exec`` hook in its namespaces (``nsenter``),
        as the kubelet does before SIGTERM; its output goes to the pod's log."""
        c = pod.spec["spec"]["containers"][0]
        command = list(c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", []))
        if not command or pod.proc is None:
            return
        if command[0] == "metaps":  # the image's metaps: this machine's venv
            command = [self.python, "-m", "metaps", *command[1:]]
        _, env = self._argv(pod, c)
        command = self._setpriv(self._identity(pod, c), c) + command
        pid = _main_pid(pod.proc)
        with pod.log_path.open("ab") as out:
            out.write(f"==> preStop: {json.dumps(command[-8:])}\n".encode())
            out.flush()
            try:
                rc = subprocess.run(["nsenter", "-t", str(pid), "-n", "-m", "-u", "--wd=/", *command], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, timeout=grace, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = -1
        pod.pre_stop_exits.append(rc)

    def evict_pod(self, name: str) -> bool:
        """The Eviction API (``kubectl drain``): refused (False, HTTP 429) when a PodDisruptionBudget
        selecting the pod allows no more unavailable pods; else the pod gets the
        ``DisruptionTarget`` condition and is deleted (True)."""
        with self._lock:
            pod = self.pods[name]
            labels = pod.spec["metadata"]["labels"]
            for pdb in (d for d in self.docs if d["kind"] == "PodDisruptionBudget"):
                sel = pdb["spec"].get("selector", {}).get("matchLabels", {})
                if not sel.items() <= labels.items():
                    continue
                owned = [p for p in self.pods.values() if sel.items() <= p.spec["metadata"]["labels"].items()]
                unavailable = sum(1 for p in owned if not p.ended and (p.deleting or p.phase != "Running"))
                unavailable += sum(1 for k in self._missing_indexes(pod.owner))
                if unavailable + 1 > int(pdb["spec"].get("maxUnavailable", 1)):
                    log.info("eviction refused by a PodDisruptionBudget",
                             extra=kv(pod=name, pdb=pdb["metadata"]["name"], unavailable=unavailable))
                    return False
            self.delete_pod(name, condition="DisruptionTarget")
            return True

    def _missing_indexes(self, job: str) -> list[int]:
        """Indexes of an Indexed Job with no pod at all right now (a replacement not yet created)."""
        st = self.jobs.get(job)
        if st is None or not st.indexed:
            return []
        live = {p.index for p in self.job_pods(job) if not p.ended}
        done = {p.index for p in self.job_pods(job) if p.phase == "Succeeded"}
        return [k for k in range(st.completions or 0) if k not in live and k not in done]

    def termination_message(self, name: str) -> str:
        """What the pod's main container wrote to its termination message file ('' if nothing)."""
        pod = self.pods[name]
        f = pod.dir / f"termination-{pod.spec['spec']['containers'][0]['name']}"
        return f.read_text() if f.exists() else ""

    def kill_container(self, name: str) -> int:
        """SIGKILL a pod's running container (its restartPolicy brings it back). Returns the killed pid."""
        pod = self.pods[name]
        p = pod.proc
        assert p is not None and p.poll() is None, f"pod {name} has no running container"
        pid = self.container_pid(name)
        _signal_group(p, signal.SIGKILL)
        return pid

    def signal_container(self, name: str, sig: int) -> None:
        """Send ``sig`` to a pod's running container (e.g. SIGSTOP / SIGCONT to hold it in a test)."""
        p = self.pods[name].proc
        assert p is not None and p.poll() is None, f"pod {name} has no running container"
        _signal_group(p, sig)

    def container_pid(self, name: str) -> int:
        """Host pid of the container's main process (pid 1 in its PID namespace)."""
        p = self.pods[name].proc
        assert p is not None
        return _main_pid(p)

    def _supervise(self) -> None:
        """The Job controller (see the module docstring), every half second."""
        while not self._stop.wait(0.5):
            with self._lock:
                for st in self.jobs.values():
                    if st.status == "Running":
                        self._sync_job(st)
            self._sync_jobsets()

    def _sync_job(self, st: JobState) -> None:
        pods = self.job_pods(st.name)
        for p in pods:
            if p.ended and not p.accounted and p.phase != "Succeeded":
                p.accounted = True
                self._account_failure(st, p)
                if st.status == "Failed":
                    return
        succeeded = [p for p in pods if p.phase == "Succeeded"]
        active = [p for p in pods if not p.ended and not p.deleting]
        if st.indexed:
            done = {p.index for p in succeeded}
            if len(done) >= (st.completions or 0):
                st.status = "Complete"
                return
            busy = {p.index for p in pods if not p.ended}
            _, tpl = self._template(st.name)
            for k in range(st.completions or 0):
                if k not in done and k not in busy and len(active) < st.parallelism:
                    active.append(self._new_job_pod(st, tpl, k))
            return
        if st.completions is None:  # work queue: done once a pod succeeded and the rest finished
            if succeeded:
                if not active:
                    st.status = "Complete"
                return
            want = st.parallelism
        else:
            if len(succeeded) >= st.completions:
                st.status = "Complete"
                return
            want = min(st.parallelism, st.completions - len(succeeded))
        if len(active) < want:
            _, tpl = self._template(st.name)
            for _ in range(want - len(active)):
                self._new_job_pod(st, tpl)

    def _account_failure(self, st: JobState, pod: Pod) -> None:
        """A pod of ``st`` ended without success: the podFailurePolicy decides, else it counts.
        A pod the Job deleted for a lower parallelism is judged the same way, as the Job
        controller does (its SIGTERM exit, 143, is what the manifests' rules ignore)."""
        code = _last_exit_code(pod)
        name = pod.spec["spec"]["containers"][0]["name"]
        action = "Count"
        for rule in st.failure_policy:
            on_codes = rule.get("onExitCodes")
            if on_codes is not None:
                if on_codes.get("containerName", name) != name or code is None:
                    continue
                values = set(on_codes.get("values", []))
                hit = (code in values) if on_codes.get("operator", "In") == "In" else (code not in values)
            else:
                hit = any(c.get("type") in pod.conditions and c.get("status", "True") == "True"
                          for c in rule.get("onPodConditions", []))
            if hit:
                action = rule["action"]
                break
        log.info("job pod ended", extra=kv(job=st.name, pod=pod.name, phase=pod.phase, exit_code=code,
                                           conditions=",".join(sorted(pod.conditions)) or "-", action=action))
        if action == "FailJob":
            self._fail_job(st, f"PodFailurePolicy: pod {pod.name} exited with {code}")
        elif action == "Count":
            st.failures += 1
            if st.failures > st.backoff_limit:
                self._fail_job(st, f"BackoffLimitExceeded: {st.failures} failed pods > backoffLimit {st.backoff_limit}")

    def _fail_job(self, st: JobState, reason: str) -> None:
        st.status, st.reason = "Failed", reason
        log.warning("job failed", extra=kv(job=st.name, reason=reason))
        for p in self.job_pods(st.name):
            if not p.ended and not p.deleting:
                p.accounted = True  # the failed Job's own deletion: no further accounting
                self.delete_pod(p.name)

    # ----------------------------------------------------------------- probes
    def ready(self, name: str) -> bool:
        """The pod's readiness probe (gRPC health, from the hub namespace) passes."""
        pod = self.pods[name]
        c = pod.spec["spec"]["containers"][0]
        probe = c.get("readinessProbe", {})
        if pod.phase != "Running":
            return False
        if "tcpSocket" in probe:
            return bool(self._prober.ask(f"tcp {pod.ip}:{probe['tcpSocket']['port']} 3")["serving"])
        if "grpc" not in probe:
            return True
        return bool(self._prober.ask(f"health {pod.ip}:{probe['grpc']['port']} 3")["serving"])

    def _probe_passes(self, pod: Pod, probe: dict[str, Any]) -> bool:
        """One kubelet probe: gRPC health, or a TCP connection (``tcpSocket``: the TLS manifests')."""
        kind = "grpc" if "grpc" in probe else "tcpSocket" if "tcpSocket" in probe else ""
        if not kind:
            raise ConfigError(f"pod {pod.name}: probe {sorted(probe)}: podsim runs gRPC and TCP probes only")
        timeout = max(1.0, float(probe.get("timeoutSeconds", 1)) / self.probe_time_scale)
        ask = "health" if kind == "grpc" else "tcp"
        return bool(self._prober.ask(f"{ask} {pod.ip}:{probe[kind]['port']} {timeout}",
                                     timeout + 30.0).get("serving"))

    def _watch_probes(self, pod: Pod, c: dict[str, Any], p: subprocess.Popen[bytes]) -> None:
        """The kubelet's startup and liveness probing of one container start ``p``.

        The startup probe runs first (none: started at once); liveness only once it passed.
        ``failureThreshold`` consecutive failures of the probe in force kill the container
        (SIGTERM to its pid 1, SIGKILL after the pod's grace period): the pod's restartPolicy
        then decides, as for any container exit (Never: the pod fails with 137 and its Job
        decides). Times are divided by ``probe_time_scale``.
        """
        startup, liveness = c.get("startupProbe"), c.get("livenessProbe")
        pod.started = startup is None
        if startup is None and liveness is None:
            return
        scale = self.probe_time_scale
        t_start = time.monotonic()

        def alive() -> bool:
            return p.poll() is None and not pod.deleting and not self._stop.is_set()

        for kind, probe in (("startup", startup), ("liveness", liveness)):
            if probe is None or (kind == "startup") == pod.started:
                continue
            delay = float(probe.get("initialDelaySeconds", 0)) / scale - (time.monotonic() - t_start)
            if delay > 0 and self._stop.wait(delay):
                return
            period = max(0.05, float(probe.get("periodSeconds", 10)) / scale)
            threshold = int(probe.get("failureThreshold", 3))
            failures = 0
            while alive():
                t0 = time.monotonic()
                ok = self._probe_passes(pod, probe)
                if not alive():
                    return
                if ok and kind == "startup":
                    pod.started = True
                    log.info("startup probe passed", extra=kv(pod=pod.name, after_s=round(t0 - t_start, 1)))
                    break
                failures = 0 if ok else failures + 1
                if failures >= threshold:
                    log.warning("probe failed: killing the container",
                                extra=kv(pod=pod.name, probe=kind, failures=failures, period_s=period))
                    pod.probe_kills.append(kind)
                    grace = float(pod.spec["spec"].get("terminationGracePeriodSeconds", 30)) / scale
                    _signal_main(p, signal.SIGTERM)
                    try:
                        p.wait(max(1.0, grace))
                    except subprocess.TimeoutExpired:
                        _signal_group(p, signal.SIGKILL)
                    return
                self._stop.wait(max(0.0, period - (time.monotonic() - t0)))

    def wait_ready(self, name: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready(name):
            pod = self.pods[name]
            if pod.phase in ("Failed", "Succeeded", "Deleted") or time.monotonic() > deadline:
                raise TimeoutError(f"pod {name} not ready ({pod.phase}, exits {pod.exit_codes}); "
                                   f"log tail:\n{tail(pod.log_path)}")
            time.sleep(1.0)

    def dial(self, kind: str, address: str, timeout_s: float = 1.0) -> dict[str, Any]:
        """What a kubelet's probe of ``kind`` (``tcp``: a TCP connect; ``health``: a plaintext gRPC health
        call) to ``address`` (a pod's ``ip:port``) sees, dialed from the hub namespace: ``{"serving": bool, ...}``."""
        if kind not in ("tcp", "health"):
            raise ValueError(f"dial: kind must be 'tcp' or 'health', got {kind!r}")
        return self._prober.ask(f"{kind} {address} {timeout_s:g}")

    def controller_status(self, address: str, token: str) -> dict[str, Any]:
        """GetStatus of the controller at ``address`` (a pod address), called from the hub namespace."""
        return self._prober.ask(f"status {address} {token}")

    # ----------------------------------------------------------------- JobSets
    def start_jobset(self, name: str) -> JobSetState:
        """Create a JobSet (``kubectl apply``): the JobSet controller (:meth:`_sync_jobset`, every
        half second) creates its child Jobs. A suspended JobSet (``spec.suspend``) creates none
        until :meth:`resume_jobset` (Kueue's admission)."""
        obj = self.obj("JobSet", name)
        spec = json.loads(json.dumps(obj["spec"]))
        for rj in spec.get("replicatedJobs", []):  # the JobSet webhook's defaults
            rj.setdefault("replicas", 1)
            jspec = rj["template"]["spec"]
            jspec.setdefault("completionMode", "Indexed")
            jspec["template"]["spec"].setdefault("restartPolicy", "OnFailure")
            if jspec["completionMode"] == "Indexed" and jspec.get("completions") is None:
                raise ConfigError(f"JobSet {name}: replicated job {rj['name']}: an Indexed Job (the webhook's "
                                  "default completionMode) needs completions; expected completionMode NonIndexed")
        spec.setdefault("network", {}).setdefault("enableDNSHostnames", True)
        spec.setdefault("successPolicy", {"operator": "All"})
        spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
        st = JobSetState(name, obj["metadata"].get("namespace", "default"), spec, bool(spec.get("suspend")))
        if spec["network"]["enableDNSHostnames"]:  # a headless Service named after the subdomain, every pod in it
            sub = spec["network"].get("subdomain") or name
            if not any(d["kind"] == "Service" and d["metadata"]["name"] == sub for d in self.docs):
                self.docs.append({"apiVersion": "v1", "kind": "Service",
                                  "metadata": {"name": sub, "namespace": st.namespace},
                                  "spec": {"clusterIP": "None", "selector": {JOBSET_NAME_LABEL: name}}})
        with self._lock:
            self.jobsets[name] = st
        return st

    def resume_jobset(self, name: str) -> None:
        """``spec.suspend: false`` (what Kueue does when it admits the JobSet's workload)."""
        with self._lock:
            self.jobsets[name].suspended = False

    def jobset_status(self, name: str) -> str:
        """Running | Completed | Failed (the JobSet's terminal state)."""
        with self._lock:
            return self.jobsets[name].status

    @staticmethod
    def child_job(jobset: str, replicated_job: str, index: int = 0) -> str:
        """A JobSet's child Job name: ``JOBSET-REPLICATEDJOB-INDEX``."""
        return f"{jobset}-{replicated_job}-{index}"

    def _sync_jobsets(self) -> None:
        with self._lock:
            sets = [st for st in self.jobsets.values() if st.status == "Running"]
        for st in sets:
            self._sync_jobset(st)

    def _sync_jobset(self, st: JobSetState) -> None:
        """The JobSet controller, once: failure policy, success policy, then startup."""
        spec = st.spec
        with self._lock:
            if st.draining:  # a restart: the same Job names come back once the old pods are gone
                if not all(self.pods[p].ended for p in st.draining):
                    return
                st.draining.clear()
            kids = [self.jobs[c] for c in st.children]
            failed = [k for k in kids if k.status == "Failed"]
            if failed:
                self._jobset_failure(st, failed)
                return
            targets = spec["successPolicy"].get("targetReplicatedJobs") or [r["name"] for r in spec["replicatedJobs"]]
            want = 1 if spec["successPolicy"]["operator"] == "Any" else \
                sum(r["replicas"] for r in spec["replicatedJobs"] if r["name"] in targets)
            done = [k for k in kids if k.status == "Complete" and st.rjob[k.name] in targets]
            if kids and len(done) >= want:
                self._finish_jobset(st, "Completed", f"AllJobsCompleted: {', '.join(k.name for k in done)}")
                return
            if st.suspended:
                return
        in_order = spec["startupPolicy"]["startupPolicyOrder"] == "InOrder"
        for rj in spec["replicatedJobs"]:
            names = [self.child_job(st.name, rj["name"], i) for i in range(rj["replicas"])]
            if rj["name"] not in st.created:
                with self._lock:
                    for i, child in enumerate(names):
                        self._create_child(st, rj, child, i)
                    st.created.add(rj["name"])
                if in_order:
                    return
            elif in_order and not all(self._child_started(c) for c in names):
                return  # InOrder: the next replicated job waits for every pod of this one to be ready

    def _child_started(self, job: str) -> bool:
        """A child Job counts as started when it finished, or its ready and succeeded pods reach
        min(parallelism, completions) (the JobSet controller's "ready")."""
        st = self.jobs[job]
        if st.status != "Running":
            return True
        pods = self.job_pods(job)
        want = st.parallelism if st.completions is None else min(st.parallelism, st.completions)
        up = sum(1 for p in pods if p.phase == "Succeeded")
        up += sum(1 for p in pods if not p.ended and not p.deleting and self.ready(p.name))
        return up >= want

    def _create_child(self, st: JobSetState, rj: dict[str, Any], child: str, index: int) -> None:
        """One child Job from a replicated job's template, labelled as the JobSet controller labels it."""
        labels = {JOBSET_NAME_LABEL: st.name, "jobset.sigs.k8s.io/replicatedjob-name": rj["name"],
                  "jobset.sigs.k8s.io/job-index": str(index), "jobset.sigs.k8s.io/restart-attempt": str(st.restarts)}
        tpl = json.loads(json.dumps(rj["template"]))
        meta = tpl.get("metadata", {})
        pod = tpl["spec"]["template"]
        pod.setdefault("metadata", {})["labels"] = {**pod["metadata"].get("labels", {}), **labels}
        if st.spec["network"]["enableDNSHostnames"]:
            pod["spec"]["subdomain"] = st.spec["network"].get("subdomain") or st.name
        doc = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": child, "namespace": st.namespace,
                            "labels": {**meta.get("labels", {}), **labels}}, "spec": tpl["spec"]}
        self.docs[:] = [d for d in self.docs if not (d["kind"] == "Job" and d["metadata"]["name"] == child)]
        self.docs.append(doc)
        st.rjob[child] = rj["name"]
        if child not in st.children:
            st.children.append(child)
        self.start_workload(child)
        log.info("jobset created a child job", extra=kv(jobset=st.name, job=child, restarts=st.restarts))

    def _jobset_failure(self, st: JobSetState, failed: list[JobState]) -> None:
        """The failure policy: the first rule (in order) matching a failed child Job (its failure
        reason, its replicated job) acts; none matching: RestartJobSet; no policy: the JobSet fails."""
        policy = st.spec.get("failurePolicy")
        if policy is None:
            self._finish_jobset(st, "Failed", f"FailedJobs: {failed[0].name} ({failed[0].reason})")
            return
        action, job = "RestartJobSet", failed[0]
        for rule in policy.get("rules", []):
            hit = [k for k in failed
                   if (not rule.get("onJobFailureReasons") or k.reason.split(":")[0] in rule["onJobFailureReasons"])
                   and (not rule.get("targetReplicatedJobs") or st.rjob[k.name] in rule["targetReplicatedJobs"])]
            if hit:
                action, job = rule["action"], hit[0]
                break
        why = f"job {job.name}: {job.reason}"
        if action == "FailJobSet":
            self._finish_jobset(st, "Failed", f"FailJobSetAction: {why}")
        elif action == "RestartJobSet" and st.restarts_counted >= int(policy.get("maxRestarts", 0)):
            self._finish_jobset(st, "Failed", f"ReachedMaxRestarts: {why}")
        else:
            counted = action == "RestartJobSet"
            st.restarts += 1
            st.restarts_counted += int(counted)
            log.warning("jobset restart", extra=kv(jobset=st.name, restarts=st.restarts, action=action, why=why))
            for child in st.children:  # every child Job deleted; its pods leave it (a new Job takes the name)
                self.jobs[child].status = "Deleted"
                for p in self.job_pods(child):
                    p.accounted = True
                    p.owner = f"{child}@attempt{st.restarts - 1}"
                    if not p.ended:
                        st.draining.append(p.name)
                        if not p.deleting:
                            self.delete_pod(p.name)
            st.created.clear()

    def _finish_jobset(self, st: JobSetState, status: str, reason: str) -> None:
        """Completed or Failed: the child Jobs still active are deleted (their pods with them)."""
        st.status, st.reason = status, reason
        log.warning("jobset finished", extra=kv(jobset=st.name, status=status, reason=reason))
        for child in st.children:
            if self.jobs[child].status == "Running":
                self.jobs[child].status = "Deleted"
                for p in self.job_pods(child):
                    p.accounted = True
                    if not p.ended and not p.deleting:
                        self.delete_pod(p.name)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Stop every pod (SIGKILL), remove the namespaces, veths and, when no other simulation on this
        machine is alive, the mount points simulations created (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            pod.deleting = True
            if pod.proc is not None and pod.proc.poll() is None:
                _signal_group(pod.proc, signal.SIGKILL)
        for pod in pods:
            if pod.proc is not None:
                try:
                    pod.proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
        self._prober.close()
        with self._lock:
            threads = list(self._pod_threads)
        for t in threads + [self._thread]:  # no pod thread still rewrites <root>/hosts once close() returns
            if t is not threading.current_thread() and t.ident is not None:
                t.join(timeout=30)
        for ns in reversed(self.namespaces):  # deleting a namespace deletes its veth ends (and their peers)
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)
        for d in reversed(self.private_dirs):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            fcntl.flock(self._host_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        if alone:  # the last one out: every mount point any simulation left, deepest first
            try:
                listed = [Path(x) for x in Path(HOST_DIRS).read_text().split("\n") if x]
            except OSError:
                listed = []
            for d in sorted(set(listed) | set(self.created_dirs), key=lambda q: len(q.parts), reverse=True):
                try:
                    d.rmdir()
                except OSError:
                    pass
            Path(HOST_DIRS).unlink(missing_ok=True)
        elif self.created_dirs:
            log.info("host mount points kept: another simulation is using them",
                     extra=kv(dirs=[str(d) for d in self.created_dirs]))
        self._host_lock.close()  # releases the lock


def _apply_fs_group(root: Path, gid: int, readonly: bool, always: bool) -> None:
    """A volume's ``fsGroup``, as the kubelet applies it: group ``gid`` and group-readable (+ writable
    unless ``readonly``: ConfigMap, Secret) files, setgid directories (new files inherit the group),
    recursively -- with ``always`` False (``fsGroupChangePolicy: OnRootMismatch``) only when the root
    does not already have that group and mode."""
    file_bits = 0o440 if readonly else 0o660
    dir_bits = file_bits | 0o110 | stat.S_ISGID
    st = root.stat()
    if not always and st.st_gid == gid and st.st_mode & dir_bits == dir_bits:
        return
    for d, _dirs, files in os.walk(root):
        for name in [None, *files]:
            path = d if name is None else os.path.join(d, name)
            try:
                st = os.stat(path) if name is None and d == str(root) else os.lstat(path)  # a linked root: its target
                if stat.S_ISLNK(st.st_mode):
                    continue
                os.chown(path, -1, gid)
                os.chmod(path, stat.S_IMODE(st.st_mode) | (dir_bits if name is None else file_bits))
            except FileNotFoundError:  # a pod of the same volume removed it meanwhile
                continue


def _main_pid(p: subprocess.Popen[bytes]) -> int:
    """The container's main process: the child ``unshare --fork`` started (``p`` itself until then)."""
    try:
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
    except OSError:
        return p.pid
    return int(kids[0]) if kids else p.pid


def _signal_main(p: subprocess.Popen[bytes], sig: int) -> None:
    """``sig`` to the container's main process only (``unshare`` would die of a SIGTERM and,
    with ``--kill-child``, SIGKILL the process before it could shut down)."""
    pid = _main_pid(p)
    try:
        if pid == p.pid:
            os.killpg(p.pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} missing)"


class _Prober:
    """The probe helper process in the hub namespace (:func:`prober_main`), shared by every pod's
    probes and the test's status calls: requests carry an id and are answered concurrently, so a
    hung container's probe (waiting out its timeout) delays no other pod's."""

    def __init__(self, hub: str, python: str, env: dict[str, str]) -> None:
        self.hub, self.python, self.env = hub, python, env
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._closed = False

    def _ensure(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hub, self.python, "-c",
                 "from tests.deploy.podsim import prober_main; prober_main()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(self.env),
                start_new_session=True)
            threading.Thread(target=self._read, args=(proc,), name="podsim-prober", daemon=True).start()
            self._proc = proc
        return self._proc

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            rid, _, body = line.partition(" ")
            with self._lock:
                slot = self._waiting.pop(int(rid), None)
            if slot is not None:
                slot[1].append(json.loads(body))
                slot[0].set()
        with self._lock:  # the helper ended: every open request fails
            for ev, out in self._waiting.values():
                out.append({"serving": False, "error": "prober exited"})
                ev.set()
            self._waiting.clear()

    def ask(self, request: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """One request line (see :func:`prober_main`) -> its answer."""
        ev = threading.Event()
        out: list[dict[str, Any]] = []
        with self._lock:
            if self._closed:
                return {"serving": False, "error": "simulation closed"}
            proc = self._ensure()
            rid = next(self._ids)
            self._waiting[rid] = (ev, out)
            assert proc.stdin is not None
            try:
                proc.stdin.write(f"{rid} {request}\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._waiting.pop(rid, None)
                return {"serving": False, "error": f"prober: {exc}"}
        if not ev.wait(timeout_s):
            with self._lock:
                self._waiting.pop(rid, None)
            return {"serving": False, "error": f"no answer in {timeout_s} s"}
        return out[0]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def prober_main() -> None:
    """The probe helper in the hub namespace: ``ID REQUEST`` per line, answered ``ID JSON`` (each
    request in its own thread, so answers may come out of order).

    ``health HOST:PORT [TIMEOUT_S]`` -> ``{"serving": bool}`` (grpc.health.v1, plaintext, like a
    kubelet's gRPC probe; 3 s by default); ``tcp HOST:PORT [TIMEOUT_S]`` -> ``{"serving": bool}``
    (a TCP connection, like a ``tcpSocket`` probe); ``status HOST:PORT TOKEN`` -> the controller's GetStatus as
    plain data (or ``{"error": ...}``).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    write_lock = threading.Lock()

    def answer(rid: str, parts: list[str]) -> None:
        out: dict[str, Any]
        try:
            if parts[0] == "health":
                timeout = float(parts[2]) if len(parts) > 2 else 3.0
                with grpc.insecure_channel(parts[1]) as ch:
                    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
                out = {"serving": r.status == health_pb2.HealthCheckResponse.SERVING}
            elif parts[0] == "tcp":  # a kubelet's tcpSocket probe: the connection opens, then closes
                import socket

                host, _, port = parts[1].rpartition(":")
                with socket.create_connection((host, int(port)), timeout=float(parts[2]) if len(parts) > 2 else 3.0):
                    out = {"serving": True}
            elif parts[0] == "status":
                from controller.client import ControllerClient
                from common.rpc import RpcConfig

                with ControllerClient(parts[1], RpcConfig(token=parts[2], timeout_s=10.0), retry_s=5.0) as c:
                    out = c.status()
            else:
                out = {"error": f"unknown request {parts[0]!r}"}
        except grpc.RpcError as exc:
            out = {"serving": False, "error": str(exc.code())}
        except Exception as exc:  # the answer names it; the caller decides
            out = {"serving": False, "error": str(exc)[:300]}
        with write_lock:
            sys.stdout.write(f"{rid} {json.dumps(out, default=str)}\n")
            sys.stdout.flush()

    for line in sys.stdin:
        rid, *parts = line.split()
        if parts:
            threading.Thread(target=answer, args=(rid, parts), daemon=True).start()
