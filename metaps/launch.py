"""``metaps launch``: run a whole fleet on this machine and leave a run directory.

::

    metaps launch --config configs/local.toml [--workers N] [--ps N] [--run-dir DIR]
                  [--resume-from DIR] [--timeout S] [--no-progress] [--token-file FILE]
                  [--set SECTION.KEY=VALUE ...] [--json]

Everything that can be checked is checked before a process starts or the run
directory is made (:mod:`metaps.roles.launch_checks`, :mod:`metaps.preflight`): the
``--set`` keys, the job file, the datasets (a missing one says which command builds
it), the schema, tables and model, the resume checkpoint, that the run and
checkpoint directories can be written, that the fixed ports are free, the token file.

What it does::

    run dir  <- job.toml (the effective config: counts, run dir, state dir; every process reads it)
    controller                          metaps controller --address HOST:PORT --state-dir RUN/controller
    agent ps:K   -> metaps ps --shard K --port P_K (picked up front: a restart comes back on it)
                     [--restore CKPT with --resume-from]     ... wait for RUN/ps/ps-K.ready
    agent worker:R -> metaps worker --rank R --ps ADDRS --controller ADDR --run-dir RUN
    watch: controller status + worker step logs -> live view; exits / signals / timeout
    end:   PS stats, controller status, (failed or interrupted: workers stopped, then a
           coordinated checkpoint of the PS), stop PS, stop controller, ledger
           -> report.json, tb/, plots/, summary table

Auth is always on: the run's token is ``[rpc] token``, a token file or
``$METAPS_TOKEN``, else a fresh random one (:func:`metaps.core.security.launch_token`);
children get it through ``$METAPS_TOKEN`` or the 0600 token file, never argv;
``RUN/job.toml``, ``report.json`` and manifests say ``token = "<redacted>"``. The
run dir is 0700, its files 0600; the PS and controller accept checkpoint paths
under ``RUN/checkpoints`` only (``--checkpoint-root``).

Every process gets ``METAPS_T0`` (one job start time, for fault-injection clocks)
and its own process group (see :mod:`metaps.fleet`): SIGINT/SIGTERM stop the
whole fleet with no process left behind; a second signal kills at once.

Exit code: 0 when every worker finished; 1 when training failed (a worker's agent
gave up after its restart limit, an agent died more often than that limit, a PS
or the controller died, the controller failed the run -- a PS recovery with no
restorable checkpoint --, the timeout passed, a process did not start); 130/143
when interrupted by SIGINT/SIGTERM. An agent that died (SIGKILL, a crash) is
restarted with its orphaned child stopped and its node reported down
(docs/design/launch.md). report.json and the summary say why, and what fraction
of the requested shards was covered (``coverage: 62% (stopped: launcher
SIGTERM)``; "complete" only when every shard of every requested epoch is done).

Two helpers for fleets started by hand or across hosts (``scripts/``)::

    metaps config-write --config job.toml --set ps.host=10.0.0.2 --out host-job.toml
    metaps run-report --run-dir DIR [--controller ADDR] [--ps ADDRS]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metaps.core.errors import ConfigError
from metaps.fleet import Fleet, FleetError, last_error, tail
from metaps.core.log import kv
from metaps.roles.overrides import apply_overrides, describe, parse_sets

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143
_WILDCARD = ("", "0.0.0.0", "::", "[::]")


def register(subparsers: Any) -> None:
    """Add ``launch``, ``config-write`` and ``run-report`` to the ``metaps`` command line.

    Args:
        subparsers: the ``metaps`` parser's subparsers (see :mod:`metaps.cli`).
    """
    p = subparsers.add_parser("launch", help="run a controller, PS shards and workers on this machine")
    p.add_argument("--config", required=True, help="job TOML")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default [train] workers)")
    p.add_argument("--ps", type=int, default=None, help="PS shards (default [ps] shards)")
    p.add_argument("--run-dir", default="", help="run directory, new or empty (default [run] dir/<name>-<time>)")
    p.add_argument("--resume-from", default="", help="warm start: a run dir, checkpoints dir or checkpoint")
    p.add_argument("--timeout", type=float, default=0.0, help="fail the run after this many seconds (0: none)")
    p.add_argument("--no-progress", action="store_true", help="no live view; a progress log line every 10 s")
    p.add_argument("--token-file", default="",
                   help="auth token file (0600): read it, or create it with the run's token (default [rpc] token_file)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="sets",
                   help="override a job-file key (VALUE is TOML; bare words are text); repeatable")
    p.set_defaults(func=_cmd_launch)

    c = subparsers.add_parser("config-write", help="write a job TOML with overrides (per-host configs)")
    c.add_argument("--config", required=True, help="job TOML to start from")
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override (VALUE is a TOML value; bare words are strings); repeatable")
    c.add_argument("--out", required=True,
                   help="file to write: the source file with the overrides, comments and layout kept")
    c.set_defaults(func=_cmd_config_write)

    r = subparsers.add_parser("run-report", help="assemble report.json, TensorBoard logs and plots of a run dir")
    r.add_argument("--run-dir", required=True, help="the run directory (holds job.toml, workers/, controller/)")
    r.add_argument("--config", default="", help="job TOML (default RUN_DIR/job.toml)")
    r.add_argument("--controller", default="", help="controller host:port to read status from (optional)")
    r.add_argument("--ps", default="", help="PS addresses host:port,... to read stats from (optional)")
    r.set_defaults(func=_cmd_run_report)


# ============================================================== configuration
@dataclass(frozen=True)
class LaunchConfig:
    """What ``metaps launch`` was asked to do.

    Args:
        config: the job TOML.
        workers: worker count (None: ``[train] workers``).
        ps: PS shard count (None: ``[ps] shards``).
        run_dir: run directory ('' = ``[run] dir/<name>-<YYYYmmdd-HHMMSS>``); must be new or empty.
        resume_from: warm start from this run dir / checkpoints dir / checkpoint ('' = cold).
        progress: live rich view on a terminal.
        timeout_s: the run fails after this long (0 = no limit).
        ready_timeout_s: how long the controller and each PS get to come up.
        stop_grace_s: SIGTERM -> SIGKILL grace per role when stopping.
        status_every_s: controller status poll period.
        token_file: read the run's token from this 0600 file, or write it there ('' = ``[rpc] token_file``).
        sets: ``--set SECTION.KEY=VALUE`` overrides of the job file (:mod:`metaps.roles.overrides`).

    Example::

        LaunchConfig(config="configs/local.toml", workers=2, run_dir="runs/t").validate()
    """

    config: str
    workers: int | None = None
    ps: int | None = None
    run_dir: str = ""
    resume_from: str = ""
    progress: bool = True
    timeout_s: float = 0.0
    ready_timeout_s: float = 180.0
    stop_grace_s: float = 20.0
    status_every_s: float = 1.0
    token_file: str = ""
    sets: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.config:
            raise ValueError("--config is required")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.ps is not None and self.ps < 1:
            raise ValueError(f"--ps must be >= 1, got {self.ps}")
        if self.timeout_s < 0:
            raise ValueError(f"--timeout must be >= 0, got {self.timeout_s}")
        for name in ("ready_timeout_s", "stop_grace_s", "status_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``ps.host=10.0.0.2`` -> (["ps", "host"], "10.0.0.2"); VALUE is read as TOML, else a string.

    Example::

        parse_override("train.workers=4")   # (["train", "workers"], 4)
    """
    return parse_sets([text])[0]


def write_job(path: Path, data: dict[str, Any]) -> Any:
    """Validate a job mapping, write it as TOML, load it back. Returns the JobConfig.

    Nothing is written when the mapping is invalid (the ConfigError names ``path``).
    """
    from metaps.job import job_from_mapping, load_job
    from metaps.core.toml_writer import write

    job_from_mapping(data, where=str(path))
    write(path, data)
    return load_job(path)


def _absolute_data_paths(data: dict[str, Any]) -> None:
    """Make [data] paths absolute (processes may run from another directory or host)."""
    sec = data.get("data", {})
    for k in ("train", "eval", "schema"):
        if isinstance(sec.get(k), str) and sec[k]:
            sec[k] = str(Path(sec[k]).resolve())


def find_resume_checkpoint(path: str | Path) -> Path:
    """The checkpoint to warm-start from: a checkpoint dir itself, else the latest under
    ``<path>/checkpoints`` or ``<path>``.

    Raises:
        ConfigError: nothing committed there.
    """
    from ps.checkpoint import latest_checkpoint

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--resume-from {p}: no such file or directory")
    if (p / "manifest.json").exists():
        return p
    for root in (p / "checkpoints", p):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ConfigError(f"--resume-from {p}: no committed checkpoint (ckpt-<step>/manifest.json) in {p} "
                      f"or {p / 'checkpoints'}")


def _new_run_dir(lc: LaunchConfig, job: Any) -> tuple[Path, bool]:
    """(run dir, auto-named). An explicit dir must be new or empty."""
    if lc.run_dir:
        d = Path(lc.run_dir).resolve()
        if d.exists() and any(d.iterdir()):
            raise ConfigError(f"--run-dir {d} is not empty (it holds another run); pick a new directory")
        return d, False
    root = Path(job.run.dir)
    base = f"{job.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    d, n = root / base, 1
    while d.exists():
        n += 1
        d = root / f"{base}-{n}"
    return d.resolve(), True


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in _WILDCARD else host


def _metaps(*args: str) -> list[str]:
    return [sys.executable, "-m", "metaps", "--log-level", logging.getLevelName(logging.getLogger().level), *args]


# ============================================================== the launcher
@dataclass
class Outcome:
    """How a launch ended.

    Attributes:
        status: succeeded | failed | interrupted.
        reason: why it failed or stopped ('' on success); report.json and the summary carry it.
        code: the exit code.
        final_checkpoint: take a coordinated checkpoint while stopping (False when the PS
            fleet is in no consistent state, e.g. a failed PS recovery: such a checkpoint
            would become the newest one a resume picks).
    """

    status: str
    reason: str = ""
    code: int = EXIT_OK
    final_checkpoint: bool = True


def controller_failed(status: dict[str, Any] | None) -> Outcome | None:
    """A failed Outcome when the controller failed the run (``run_failed`` event), else None."""
    from metaps.run_report import run_failure

    why = run_failure(status)
    return Outcome("failed", why, EXIT_FAILED, final_checkpoint=False) if why else None


class Launcher:
    """One ``metaps launch``: see the module docstring.

    Args:
        lc: the launch request.
        console: rich console for the live view and the summary (default: stdout).

    Example::

        code = Launcher(LaunchConfig(config="configs/local.toml", workers=2, progress=False)).run()
    """

    def __init__(self, lc: LaunchConfig, console: Any = None) -> None:
        from rich.console import Console

        from metaps.core.config import read_toml
        from metaps.job import job_from_mapping
        from metaps.core.security import launch_token, make_private_dir

        lc.validate()
        self.lc = lc
        self.console = console or Console()
        raw = apply_overrides(read_toml(lc.config), parse_sets(list(lc.sets)))
        base = job_from_mapping(copy.deepcopy(raw), where=describe(lc.config, list(lc.sets)))  # before anything starts
        self.run_dir, self.auto_named = _new_run_dir(lc, base)
        self.resume = str(find_resume_checkpoint(lc.resume_from)) if lc.resume_from else ""
        dataclasses.replace(base.rpc, token_file="").check_files()  # TLS files: one line, before preflight's torch import
        from metaps.roles.launch_checks import check_launch

        check_launch(base, self.run_dir, self.resume)  # every deterministic error: one line, before anything starts
        token, token_env = launch_token(raw, base.rpc, lc.token_file)  # raw's [rpc] token -> "<redacted>"
        n_ps = lc.ps if lc.ps is not None else base.ps.shards
        n_workers = lc.workers if lc.workers is not None else base.train.workers
        for sub in ("", "logs", "ps", "workers", "checkpoints"):
            make_private_dir(self.run_dir / sub)  # 0700
        _absolute_data_paths(raw)
        overrides = [(["ps", "shards"], n_ps), (["train", "workers"], n_workers),
                     (["run", "dir"], str(self.run_dir)),
                     (["controller", "state_dir"], str(self.run_dir / "controller"))]
        if base.train.dense_sync.value == "allreduce" and not base.train.allreduce_port:
            from metaps.core.metrics import free_port

            overrides.append((["train", "allreduce_port"], free_port()))
        self.job_path = self.run_dir / "job.toml"
        self.job = write_job(self.job_path, apply_overrides(raw, overrides))
        self.job = self.job.with_overrides(rpc=dataclasses.replace(self.job.rpc, token=token))  # in memory only
        self.fleet = Fleet(self.run_dir / "logs", env={
            "METAPS_T0": repr(time.time()), "PYTHONUNBUFFERED": "1", "METAPS_RUN_DIR": str(self.run_dir),
            **token_env})
        self.t0 = float(self.fleet.env["METAPS_T0"])
        self.stop_event = threading.Event()
        self.signal_name = ""
        self.ctl_addr = ""
        self.ps_addrs: list[str] = []
        self.metrics_ports: dict[str, int | None] = {}
        self.status: dict[str, Any] | None = None
        self.ckpt = ""
        self.agent_notes: list[str] = []  # agents that died and were restarted (true reasons, for the report)
        from metaps.progress import StepLogTail

        self.tail = StepLogTail({r: self.run_dir / "logs" / f"worker-{r}.log" for r in range(n_workers)})
        self.previous_latest = mark_latest(self.run_dir) if self.auto_named else None
        log.info("run directory ready", extra=kv(run_dir=str(self.run_dir), ps=n_ps, workers=n_workers,
                                                  resume=self.resume or "-"))

    # ---------------------------------------------------------------- signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_event.is_set():
            log.warning("second signal: killing the fleet now")
            self.fleet.kill_all()
            return
        self.signal_name = signal.Signals(signum).name
        self.stop_event.set()

    # ---------------------------------------------------------------- start
    def _start_controller(self) -> None:
        from metaps.core.metrics import free_port

        host = self.job.controller.address.rsplit(":", 1)[0]
        port = free_port(_connect_host(host))
        addr_file = self.run_dir / "controller" / "address"
        addr_file.unlink(missing_ok=True)
        mport = free_port(_connect_host(host))
        m = self.fleet.start("controller", _metaps(
            "controller", "--config", str(self.job_path), "--address", f"{host}:{port}",
            "--state-dir", str(self.run_dir / "controller"), "--metrics-port", str(mport),
            "--checkpoint-root", str(self.run_dir / "checkpoints")), role="controller")
        self.fleet.wait_file(addr_file, m, self.lc.ready_timeout_s, self.stop_event.is_set)
        self.ctl_addr = f"{_connect_host(host)}:{port}"
        self.metrics_ports["controller"] = mport
        log.info("controller up", extra=kv(address=self.ctl_addr))

    def _start_ps(self) -> None:
        from metaps.core.metrics import free_port

        host = self.job.ps.host
        for k in range(self.job.ps.shards):
            port, mport = free_port(_connect_host(host)), free_port(_connect_host(host))
            child = ["ps", "--config", str(self.job_path), "--shard", str(k), "--port", str(port),
                     "--metrics-port", str(mport), "--ready-file", str(self.run_dir / "ps" / f"ps-{k}.ready"),
                     "--checkpoint-root", str(self.run_dir / "checkpoints")]
            if self.resume:
                child += ["--restore", self.resume]
            aport = free_port(_connect_host(host))
            self.fleet.start(f"ps-{k}", _metaps("agent", "--config", str(self.job_path), "--role", "ps",
                                                "--index", str(k), "--controller", self.ctl_addr,
                                                "--metrics-port", str(aport), "--",
                                                *_metaps(*child)), role="ps", index=k)
            self.metrics_ports[f"agent-ps-{k}"] = aport
            self.ps_addrs.append(f"{_connect_host(host)}:{port}")
            self.metrics_ports[f"ps-{k}"] = mport

    def _wait_ps(self) -> None:
        for k in range(self.job.ps.shards):
            ready = self.run_dir / "ps" / f"ps-{k}.ready"
            self.fleet.wait_file(ready, self.fleet.members[f"ps-{k}"], self.lc.ready_timeout_s, self.stop_event.is_set)
            info = json.loads(ready.read_text())
            self.metrics_ports[f"ps-{k}"] = int(info["metrics_port"])
        log.info("PS fleet ready", extra=kv(addresses=",".join(self.ps_addrs)))

    def _start_workers(self) -> None:
        from metaps.core.metrics import free_port

        for r in range(self.job.train.workers):
            mport = free_port()
            child = ["worker", "--config", str(self.job_path), "--rank", str(r), "--ps", ",".join(self.ps_addrs),
                     "--controller", self.ctl_addr, "--run-dir", str(self.run_dir), "--metrics-port", str(mport)]
            aport = free_port()
            self.fleet.start(f"worker-{r}", _metaps("agent", "--config", str(self.job_path), "--role", "worker",
                                                    "--index", str(r), "--controller", self.ctl_addr,
                                                    "--metrics-port", str(aport), "--",
                                                    *_metaps(*child)), role="worker", index=r)
            self.metrics_ports[f"agent-worker-{r}"] = aport
            self.metrics_ports[f"worker-{r}"] = mport

    # ---------------------------------------------------------------- watch
    def _poll_status(self, client: Any) -> None:
        from controller.client import ControllerError

        try:
            self.status = client.status()
        except ControllerError as exc:
            log.debug("status unavailable", extra=kv(error=str(exc)[:200]))

    def _interrupted(self) -> Outcome:
        code = EXIT_SIGTERM if self.signal_name == "SIGTERM" else EXIT_SIGINT
        return Outcome("interrupted", f"stopped by {self.signal_name or 'signal'}", code)

    def _watch(self) -> Outcome:
        from controller.client import ControllerClient
        from metaps.progress import ProgressDisplay

        client = ControllerClient(self.ctl_addr, dataclasses.replace(self.job.rpc, timeout_s=5.0), retry_s=1.0)
        display = ProgressDisplay(self.console, live=self.lc.progress)
        next_status = 0.0
        workers = [f"worker-{r}" for r in range(self.job.train.workers)]
        try:
            while True:
                if self.stop_event.is_set():
                    return self._interrupted()
                exited = self.fleet.exited()
                if "controller" in exited:
                    return Outcome("failed", f"the controller exited with code {exited['controller']}", EXIT_FAILED)
                agents = self._supervise_agents(exited)
                if isinstance(agents, Outcome):
                    return agents
                if agents:  # restarted: look again
                    continue
                elapsed = time.time() - self.t0
                now = time.monotonic()
                if now >= next_status or all(w in exited for w in workers):
                    next_status = now + self.lc.status_every_s
                    self._poll_status(client)
                    self.tail.poll()
                    display.update(self.status, self.tail.latest(), elapsed)
                    failed = controller_failed(self.status)
                    if failed is not None:
                        return failed
                if all(w in exited for w in workers):
                    return Outcome("succeeded")
                if self.lc.timeout_s and elapsed > self.lc.timeout_s:
                    return Outcome("failed", f"timeout: not finished after {self.lc.timeout_s:.0f}s", EXIT_FAILED)
                self.stop_event.wait(0.2)
        finally:
            display.close()
            client.close()

    def _supervise_agents(self, exited: dict[str, int]) -> Outcome | list[str]:
        """Agents that exited: restart the ones that died, fail the run with the true reason otherwise.

        An agent that gave up (its child failed beyond ``[controller.agent] restart_limit``)
        or a PS agent that exited by itself fails the run. An agent that died (a signal,
        or an exit code other than "gave up") is restarted: the rest of its process group
        (its orphaned child) is killed first, the controller is told the node is down
        (its shards are requeued, the reason is in the event log), then a fresh agent
        starts a fresh child. At most ``restart_limit`` restarts per agent
        (docs/design/launch.md, "Agent supervision").

        Returns:
            an Outcome that ends the run, or the names of the agents restarted (maybe none).
        """
        from controller.client import ControllerClient, ControllerError

        limit = self.job.controller.agent.restart_limit
        restarted: list[str] = []
        for name, rc in sorted(exited.items()):
            m = self.fleet.members[name]
            if m.role not in ("ps", "worker") or (m.role == "worker" and rc == 0):
                continue
            if rc == 1 and "restart limit reached" in tail(m.log_path, 200):
                cause = last_error(m.log_path)
                return Outcome("failed", f"{name}'s agent exited with code 1 (its {m.role} failed beyond its "
                                         f"restart limit {limit}{'; last error: ' + cause if cause else ''}); "
                                         f"see logs/{name}.log", EXIT_FAILED)
            if m.role == "ps" and rc == 0:
                return Outcome("failed", f"{name}'s agent exited with code 0 while the run was going (its PS "
                                         f"stopped); see logs/{name}.log", EXIT_FAILED)
            how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            if m.restarts >= limit:
                return Outcome("failed", f"agent for {name} died ({how}) after {m.restarts} restart(s) "
                                         f"(restart_limit {limit}); see logs/{name}.log", EXIT_FAILED)
            self.fleet.stop([name], self.lc.stop_grace_s)  # its orphaned child, if any: the group goes
            note = f"agent for {name} died ({how}); restarted"
            try:  # before the new agent starts: its worker must not inherit the dead one's leases
                with ControllerClient(self.ctl_addr, dataclasses.replace(self.job.rpc, timeout_s=20.0),
                                      retry_s=30.0) as ctl:
                    ctl.node_down(m.role, m.index, f"{note} (its {m.role} process was stopped with it)", rc)
            except ControllerError as exc:
                log.error("could not report the dead agent's node down; its shards wait for their lease",
                          extra=kv(member=name, error=exc))
            self.fleet.restart(name)
            log.warning("agent died; restarted", extra=kv(member=name, how=how, restarts=m.restarts))
            self.agent_notes.append(note)
            restarted.append(name)
        return restarted

    # ---------------------------------------------------------------- end
    def _final_checkpoint(self, reason: str) -> str:
        """Coordinated checkpoint of the PS fleet (workers already stopped); '' if impossible."""
        from ps.checkpoint import latest_checkpoint
        from ps.coordinator import checkpoint_all
        from workers.worker import checkpoint_info

        if not self.ps_addrs or any(self.fleet.members[f"ps-{k}"].poll() is not None
                                    for k in range(len(self.ps_addrs)) if f"ps-{k}" in self.fleet.members):
            return ""
        node_steps = [int(n.get("step", 0)) for n in (self.status or {}).get("nodes", []) if n.get("role") == "worker"]
        step = max([self.tail.max_step(), *node_steps])
        root = self.run_dir / "checkpoints"
        last = latest_checkpoint(root)
        if last is not None and int(last.name.split("-")[1]) >= step:
            step = int(last.name.split("-")[1]) + 1
        try:
            path = checkpoint_all(self.ps_addrs, root, step, rpc_cfg=self.job.rpc,
                                  full_every=self.job.ps.checkpoint_full_every,
                                  extra_info=checkpoint_info(self.job, step, {"stopped": reason}))
        except Exception as exc:  # noqa: BLE001 -- report it, but still stop the fleet and write the report
            log.error("final checkpoint failed", extra=kv(error=str(exc)[:300]))
            return ""
        log.info("final checkpoint written", extra=kv(dir=str(path), step=step))
        return str(path)

    def _ps_stats(self) -> list[dict[str, Any]] | None:
        from ps.client import PsClient

        if not self.ps_addrs:
            return None
        try:
            with PsClient(self.ps_addrs, self.job.rpc, retry_timeout_s=5.0) as client:
                return client.stats()
        except Exception as exc:  # noqa: BLE001 -- the report notes missing stats; teardown goes on
            log.warning("PS stats unavailable", extra=kv(error=str(exc)[:200]))
            return None

    def _final_status(self) -> None:
        if not self.ctl_addr or self.fleet.members["controller"].poll() is not None:
            return
        from controller.client import ControllerClient

        with ControllerClient(self.ctl_addr, dataclasses.replace(self.job.rpc, timeout_s=5.0), retry_s=2.0) as c:
            self._poll_status(c)

    def _teardown(self, outcome: Outcome) -> tuple[list[dict[str, Any]] | None, list[str]]:
        notes: list[str] = list(self.agent_notes)
        grace = self.lc.stop_grace_s
        workers = [n for n, m in self.fleet.members.items() if m.role == "worker"]
        if outcome.status != "succeeded":
            self.fleet.stop(workers, grace)
            if outcome.final_checkpoint:
                self.ckpt = self._final_checkpoint(outcome.reason)
                if not self.ckpt:
                    notes.append("no final checkpoint: the PS fleet was not all up, or the checkpoint failed")
            else:
                notes.append("no final checkpoint: the PS fleet is in no consistent state")
        self._final_status()
        stats = self._ps_stats()
        self.fleet.stop([n for n, m in self.fleet.members.items() if m.role == "ps"], grace)
        self.fleet.stop(["controller"], grace)
        self.fleet.kill_all()
        left = self.fleet.alive_pids()
        if left:
            notes.append(f"processes still alive after the stop: {left}")
            log.error("fleet processes left behind", extra=kv(pids=left))
        return stats, notes

    def _report(self, outcome: Outcome, ps_stats: list[dict[str, Any]] | None, notes: list[str]) -> dict[str, Any]:
        from metaps.plots import make_plots
        from metaps.run_report import (
            build_report,
            print_summary,
            read_ledger,
            write_report,
        )
        from metaps.tb import write_tensorboard

        self.tail.poll()
        ledger = []
        try:
            ledger = read_ledger(self.run_dir / "controller")
        except Exception as exc:  # noqa: BLE001 -- the report goes out without the ledger
            notes.append(f"ledger unreadable: {exc}")
        processes = {n: {"pid": m.pid, "exit_code": m.poll(), "log": str(m.log_path), "role": m.role,
                         "index": m.index} for n, m in self.fleet.members.items()}
        rep = build_report(
            self.run_dir, self.job, status=outcome.status, reason=outcome.reason, exit_code=outcome.code,
            started=self.t0, ps_stats=ps_stats, controller_status=self.status, ledger=ledger,
            metrics_ports=self.metrics_ports, processes=processes, log_histories=self.tail.history,
            checkpoint=self.ckpt, resumed_from=self.resume, notes=notes)
        write_report(self.run_dir, rep)
        for what, fn in (("tensorboard", lambda: write_tensorboard(rep, self.run_dir / "tb")),
                         ("plots", lambda: make_plots(rep, self.run_dir / "plots"))):
            try:
                fn()
            except Exception:
                log.exception("could not write run artefact", extra=kv(what=what))
        if self.auto_named:
            settle_latest(self.run_dir, outcome.status == "succeeded", self.previous_latest)
        print_summary(self.console, rep)
        return rep

    def run(self) -> int:
        """Start, watch, stop, report. Returns the exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        outcome = Outcome("failed", "launcher error", EXIT_FAILED)
        try:
            try:
                self._start_controller()
                self._start_ps()
                self._wait_ps()
                self._start_workers()
                outcome = self._watch()
            except FleetError as exc:
                outcome = self._interrupted() if self.stop_event.is_set() else Outcome("failed", str(exc), EXIT_FAILED)
            log.info("run ending", extra=kv(status=outcome.status, reason=outcome.reason or "-"))
            stats, notes = self._teardown(outcome)
            if outcome.status == "succeeded":  # a recovery may have failed after the last poll
                outcome = controller_failed(self.status) or outcome
        except BaseException:
            self.fleet.kill_all()
            if self.auto_named:
                settle_latest(self.run_dir, False, self.previous_latest)
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        self._report(outcome, stats, notes)
        self.console.print(f"run directory: {self.run_dir}")
        return outcome.code


# ============================================================== runs/latest
LATEST, LAST_FAILED = "latest", "last-failed"


def _point(link: Path, target: str) -> None:
    """Make ``link`` a symlink to ``target`` (relative) in one rename: readers never see it missing."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)


def mark_latest(run_dir: Path) -> str | None:
    """Point ``<runs>/latest`` at ``run_dir`` as the run starts; returns the previous target ('' if none;
    None when ``latest`` is not a symlink and was left alone).

    Its logs can be tailed (``runs/latest/logs``) while it runs. A ``latest`` that is not a
    symlink (a user's directory) is left alone.

    Args:
        run_dir: the new run directory (its parent holds ``latest``).
    """
    link = run_dir.parent / LATEST
    previous = os.readlink(link) if link.is_symlink() else ""
    if link.exists() and not link.is_symlink():
        log.warning("runs/latest is not a symlink; not touching it", extra=kv(path=str(link)))
        return None
    _point(link, run_dir.name)
    log.info("latest points at the running run", extra=kv(link=str(link), run=run_dir.name))
    return previous


def settle_latest(run_dir: Path, succeeded: bool, previous: str | None) -> None:
    """At the end of a run: ``latest`` stays on it when it succeeded; otherwise ``latest`` goes
    back to the run it named before (or goes away) and ``last-failed`` names this one.

    Args:
        run_dir: the run that ended.
        succeeded: whether it succeeded (failed and interrupted runs never stay ``latest``).
        previous: :func:`mark_latest`'s return value (None: latest was not marked).
    """
    if previous is None:
        return
    link = run_dir.parent / LATEST
    try:
        if succeeded:
            _point(link, run_dir.name)
            return
        _point(run_dir.parent / LAST_FAILED, run_dir.name)
        if link.is_symlink() and os.readlink(link) == run_dir.name:
            if previous:
                _point(link, previous)
            else:
                link.unlink()
        log.info("run did not succeed: latest restored", extra=kv(latest=previous or "-", last_failed=run_dir.name))
    except OSError as exc:
        log.error("could not update runs/latest", extra=kv(dir=str(run_dir.parent), error=str(exc)[:200]))


# ============================================================== commands
def _cmd_launch(args: argparse.Namespace) -> int:
    from metaps.core.security import set_private_umask

    set_private_umask()  # every file of the run (logs, checkpoints, tb, plots) 0600, dirs 0700
    from metaps.roles.output import emit, wants_json

    set_private_umask()  # every file of the run (logs, checkpoints, tb, plots) 0600, dirs 0700
    lc = LaunchConfig(config=args.config, workers=args.workers, ps=args.ps, run_dir=args.run_dir,
                      resume_from=args.resume_from, progress=not args.no_progress, timeout_s=args.timeout,
                      token_file=args.token_file, sets=tuple(args.sets))
    try:
        lc.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not wants_json(args):
        return Launcher(lc).run()
    from rich.console import Console

    launcher = Launcher(lc, console=Console(stderr=True))  # the live view and tables on stderr
    code = launcher.run()
    rep = json.loads((launcher.run_dir / "report.json").read_text())
    emit(args, {k: rep.get(k) for k in ("status", "reason", "exit_code", "run_dir", "wall_s", "counts", "totals",
                                        "coverage_summary", "final_auc", "checkpoint", "resumed_from")}, "")
    return code


def _cmd_config_write(args: argparse.Namespace) -> int:
    """The source file with the overrides set: comments, blank lines and key order kept."""
    from metaps.core.atomic_write import write_text_atomic
    from metaps.core.config import read_toml
    from metaps.core.toml_writer import set_keys
    from metaps.job import job_from_mapping, load_job
    from metaps.roles.output import emit

    sets = parse_sets(args.set)
    where = describe(args.config, args.set)
    job_from_mapping(apply_overrides(read_toml(args.config), sets), where=where)  # errors name the source
    try:
        text = Path(args.config).read_text()
    except OSError as exc:
        raise ConfigError(f"{args.config}: cannot read: {exc.strerror}") from None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, set_keys(text, sets, where=args.config))
    load_job(out)  # what was written reads back
    emit(args, {"out": str(out), "config": args.config, "overrides": list(args.set)},
         f"wrote {out} ({args.config} with {len(args.set)} override(s))")
    return 0


def _cmd_run_report(args: argparse.Namespace) -> int:
    """Report of a fleet started by the scripts (or of a launch whose report was lost)."""
    from rich.console import Console

    from metaps.job import load_job
    from metaps.plots import make_plots
    from metaps.run_report import (
        build_report,
        print_summary,
        read_ledger,
        read_worker_reports,
        run_failure,
        write_report,
    )
    from metaps.tb import write_tensorboard

    run_dir = Path(args.run_dir).resolve()
    cfg = Path(args.config) if args.config else run_dir / "job.toml"
    job = load_job(cfg)
    status = None
    if args.controller:
        from controller.client import ControllerClient, ControllerError

        try:
            with ControllerClient(args.controller, dataclasses.replace(job.rpc, timeout_s=5.0), retry_s=2.0) as c:
                status = c.status()
        except ControllerError as exc:
            log.warning("controller status unavailable", extra=kv(error=str(exc)[:200]))
    stats = None
    if args.ps:
        from ps.client import PsClient

        try:
            with PsClient([a for a in args.ps.split(",") if a], job.rpc, retry_timeout_s=5.0) as client:
                stats = client.stats()
        except Exception as exc:  # noqa: BLE001 -- PS already gone: report without its stats
            log.warning("PS stats unavailable", extra=kv(error=str(exc)[:200]))
    ports: dict[str, int | None] = {}
    for ready in sorted((run_dir / "ps").glob("ps-*.ready")):
        ports[ready.stem] = int(json.loads(ready.read_text())["metrics_port"])
    reports = read_worker_reports(run_dir)
    missing = sorted(set(range(job.train.workers)) - set(reports))
    failure = run_failure(status) or (f"no report from worker(s) {missing}" if missing else "")
    ok = not failure
    rep = build_report(run_dir, job, status="succeeded" if ok else "failed",
                       reason=failure, exit_code=0 if ok else 1,
                       ps_stats=stats, controller_status=status,
                       ledger=read_ledger(Path(job.controller.state_dir or run_dir / "controller")),
                       metrics_ports=ports, notes=["assembled by metaps run-report"])
    write_report(run_dir, rep)
    write_tensorboard(rep, run_dir / "tb")
    make_plots(rep, run_dir / "plots")
    from metaps.roles.output import emit, wants_json

    print_summary(Console(stderr=wants_json(args)), rep)
    if wants_json(args):
        emit(args, {k: rep.get(k) for k in ("status", "reason", "exit_code", "run_dir", "counts", "totals",
                                            "coverage_summary", "final_auc", "checkpoint")}, "")
    return 0 if ok else 1


__all__ = [
    "LaunchConfig",
    "Launcher",
    "apply_overrides",
    "find_resume_checkpoint",
    "parse_override",
    "register",
    "write_job",
]

