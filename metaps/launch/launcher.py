"""The :class:`Launcher`: starts the controller, agents, PS shards and workers of one run,
watches them, stops them, and writes the run's report (see :mod:`metaps.launch`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from common import exit_codes
from common.errors import ConfigError
from metaps.fleet import Fleet, FleetError, last_error, tail
from common.log import kv
from common.ports import PortReservation, reserve_port
from metaps.roles.overrides import apply_overrides, describe, parse_sets
from metaps.launch.config import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, LaunchConfig, _connect_host, _metaps, _new_run_dir, find_resume_checkpoint, write_job, _absolute_data_paths
from metaps.launch.latest import follows_latest, mark_latest, settle_latest
from metaps.launch.resume import ContinuePoint, find_continue_point, set_aside_previous_attempt


log = logging.getLogger(__name__)


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
    no_checkpoint_note: str = "no final checkpoint: the PS fleet is in no consistent state"
    """The report's note when ``final_checkpoint`` is False."""


def controller_failed(status: dict[str, Any] | None) -> Outcome | None:
    """A failed Outcome when the controller failed the run (``run_failed`` event), else None."""
    from metaps.run_report import final_checkpoint_failure, run_failure

    why = run_failure(status)
    if why and final_checkpoint_failure(status):  # a write failure: the launcher's own try would fail the same way
        return Outcome("failed", why, EXIT_FAILED, final_checkpoint=False,
                       no_checkpoint_note="no final checkpoint: it could not be written (see the reason); not retried")
    return Outcome("failed", why, EXIT_FAILED, final_checkpoint=False) if why else None


def coverage_short(status: dict[str, Any] | None) -> Outcome | None:
    """A failed Outcome when every worker exited but the controller's coverage is neither
    ``complete`` nor ``partial_by_request`` (a run never ends "succeeded" below full coverage:
    e.g. a rollback that reopened finished training after the workers had gone), else None."""
    cov = (status or {}).get("coverage") or {}
    if not cov or cov.get("state") in ("complete", "partial_by_request"):
        return None
    problems = list(cov.get("problems") or [])
    return Outcome("failed", f"every worker exited with the coverage {cov.get('state')} at "
                             f"{100.0 * float(cov.get('fraction') or 0.0):.0f}%"
                             + (f": {problems[:3]}" if problems else ""), EXIT_FAILED)


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

        from common.config import read_toml
        from metaps.job import absolute_class_dir, job_from_mapping
        from common.security import launch_token, make_run_dir

        lc.validate()
        self.continued: ContinuePoint | None = None
        if lc.resume:
            self.continued = find_continue_point(lc.resume)  # before anything is touched: one line if refused
            if not lc.config:
                lc = dataclasses.replace(lc, config=str(self.continued.run_dir / "job.toml"))
        self.lc = lc
        self.console = console or Console()
        raw = apply_overrides(read_toml(lc.config), parse_sets(list(lc.sets)))
        raw = absolute_class_dir(raw, lc.config)  # a custom model's folder, for RUN/job.toml's readers
        base = job_from_mapping(copy.deepcopy(raw), where=describe(lc.config, list(lc.sets)))  # before anything starts
        if self.continued is not None:
            # a continued run is `latest`'s again when it was an auto-named run of RUNS/ (latest.py)
            self.run_dir, self.auto_named = self.continued.run_dir, follows_latest(self.continued.run_dir,
                                                                                  base.run.name)
            self.resume = str(self.continued.checkpoint)
        else:
            self.run_dir, self.auto_named = _new_run_dir(lc, base)
            self.resume = str(find_resume_checkpoint(lc.resume_from)) if lc.resume_from else ""
        dataclasses.replace(base.rpc, token_file="").check_files()  # TLS files: one line, before preflight's torch import
        from metaps.roles.launch_checks import check_launch

        n_ps = lc.ps if lc.ps is not None else base.ps.shards
        n_workers = lc.workers if lc.workers is not None else base.train.workers
        check_launch(base, self.run_dir, self.resume, ps_shards=n_ps)  # every deterministic error: one line
        # the token in a 0600 file (RUN/rpc.token unless one is given) that RUN/job.toml names; raw's
        # [rpc] token -> "<redacted>"
        token, token_env = launch_token(raw, base.rpc, lc.token_file, run_dir=self.run_dir)
        if self.continued is not None:
            set_aside_previous_attempt(self.continued)
        for sub in ("", "logs", "ps", "workers", "checkpoints", "metrics", "metrics/ports"):
            make_run_dir(self.run_dir / sub)  # 0750: the group reads, the token file stays 0600
        for old in (self.run_dir / "metrics" / "ports").glob("*.json"):
            old.unlink()  # a previous attempt's (--resume): a port is read only from its process's own file
        _absolute_data_paths(raw)
        overrides = [(["ps", "shards"], n_ps), (["train", "workers"], n_workers),
                     (["run", "dir"], str(self.run_dir)),
                     (["controller", "state_dir"], str(self.run_dir / "controller"))]
        self.reservations: list[PortReservation] = []
        if base.train.dense_sync.value == "allreduce" and not base.train.allreduce_port:
            # rank 0's gloo TCPStore binds it inside torch.distributed: the launcher holds the port for the
            # run (bound, not listening; common.ports) so no other process can take it, before rank 0
            # binds it or between two of its incarnations
            self.reservations.append(reserve_port("127.0.0.1"))
            overrides.append((["train", "allreduce_port"], self.reservations[-1].port))
        self.job_path = self.run_dir / "job.toml"
        self.job = write_job(self.job_path, apply_overrides(raw, overrides))
        self.job = self.job.with_overrides(rpc=dataclasses.replace(self.job.rpc, token=token))  # in memory only
        self.fleet = Fleet(self.run_dir / "logs", env={
            "METAPS_T0": repr(time.time()), "PYTHONUNBUFFERED": "1", "METAPS_RUN_DIR": str(self.run_dir),
            **token_env})
        self.t0 = float(self.fleet.env["METAPS_T0"])
        self.stop_event = threading.Event()
        self.signal_name = ""
        # called at every status poll with (status, workers' latest); a reason it returns stops the
        # run as a signal does (metaps.api's callbacks and progress); None: no one watches
        self.on_poll: Callable[[Mapping[str, Any] | None, Mapping[int, Mapping[str, Any]]], str] | None = None
        self.stop_reason = ""
        self.ctl_addr = ""
        self.ps_addrs: list[str] = []
        self.ps_ready = False  # every shard's ready file seen (a final checkpoint can be asked of them)
        self.metrics_ports: dict[str, int | None] = {}
        self.metrics_hosts: dict[str, str] = {}  # process -> the host its /metrics binds (default 127.0.0.1)
        self.targets_finished: set[str] = set()  # finished workers, out of RUN/metrics/targets.json
        self.status: dict[str, Any] | None = None
        self.ckpt = ""
        self.agent_notes: list[str] = []  # agents that died and were restarted (true reasons, for the report)
        from metaps.progress import LiveWorkers, StepLogTail

        self.tail = StepLogTail({r: self.run_dir / "logs" / f"worker-{r}.log" for r in range(n_workers)})
        self.live = LiveWorkers(self.run_dir)  # the live view: snapshots + /metrics; the log tail is its fallback
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
    def _cmd(self, *args: str) -> list[str]:
        """A fleet process's command line: it logs at ``--file-log-level`` (INFO), whatever the console's level."""
        return _metaps(*args, level=self.lc.file_log_level)

    # Ports: every server of the fleet binds its own port -- the one the job file configures, else 0 (the
    # kernel picks) -- and publishes what it got: the controller in RUN/controller/address, a PS shard in
    # its ready file, every /metrics endpoint in RUN/metrics/ports/NAME.json (--metrics-file). The launcher
    # reads them; it picks no port for a role and lets it go first (docs/design/launch.md, "Ports").

    def _metrics_file(self, name: str) -> Path:
        return self.run_dir / "metrics" / "ports" / f"{name}.json"

    def _metrics_args(self, name: str) -> list[str]:
        """``--metrics-port 0 --metrics-file RUN/metrics/ports/NAME.json`` (a stale file removed first)."""
        f = self._metrics_file(name)
        f.unlink(missing_ok=True)
        return ["--metrics-port", "0", "--metrics-file", str(f)]

    def _read_published_ports(self) -> bool:
        """Take every ``/metrics`` port the fleet published (a restarted process publishes its new one);
        True when one changed."""
        found: dict[str, tuple[str, int]] = {}
        for f in (self.run_dir / "metrics" / "ports").glob("*.json"):
            try:
                info = json.loads(f.read_text())
                found[f.stem] = (_connect_host(str(info["host"])), int(info["port"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced (written atomically, but read between a restart's unlink and write)
        for k in range(len(self.ps_addrs)):
            try:
                info = json.loads((self.run_dir / "ps" / f"ps-{k}.ready").read_text())
                found[f"ps-{k}"] = (self.metrics_hosts.get(f"ps-{k}", "127.0.0.1"), int(info["metrics_port"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        changed = False
        for name, (host, port) in found.items():
            if self.metrics_ports.get(name) != port or self.metrics_hosts.get(name) != host:
                self.metrics_ports[name], self.metrics_hosts[name] = port, host
                changed = True
        return changed

    def _start_controller(self) -> None:
        host, _, port = self.job.controller.address.rpartition(":")
        addr_file = self.run_dir / "controller" / "address"
        addr_file.unlink(missing_ok=True)
        m = self.fleet.start("controller", self._cmd(
            "controller", "--config", str(self.job_path), "--address", f"{host}:{port}",
            "--state-dir", str(self.run_dir / "controller"), *self._metrics_args("controller"),
            "--checkpoint-root", str(self.run_dir / "checkpoints"),
            *(["--continue-from-cut"] if self.continued is not None else []),
            # a warm start is the run's first cut: a PS lost before the run's own first cut is recovered to it
            *(["--warm-start", self.resume] if self.resume and self.continued is None else [])), role="controller")
        self.fleet.wait_file(addr_file, m, self.lc.ready_timeout_s, self.stop_event.is_set)
        bound = addr_file.read_text().strip().rpartition(":")[2]  # written atomically once gRPC serves
        self.ctl_addr = f"{_connect_host(host)}:{bound}"
        self._read_published_ports()  # its /metrics file is written before the address file
        self._write_targets()
        log.info("controller up", extra=kv(address=self.ctl_addr))

    def _start_ps(self) -> None:
        for k in range(self.job.ps.shards):
            ready = self.run_dir / "ps" / f"ps-{k}.ready"
            ready.unlink(missing_ok=True)  # a ready file there is its earlier process's: a restart binds its port
            # no --port: the shard binds [ps] base_port + k from job.toml, or (base_port 0) a port of its own
            child = ["ps", "--config", str(self.job_path), "--shard", str(k), "--metrics-port", "0",
                     "--ready-file", str(ready), "--checkpoint-root", str(self.run_dir / "checkpoints")]
            if self.resume:
                child += ["--restore", self.resume]
            self.fleet.start(f"ps-{k}", self._cmd("agent", "--config", str(self.job_path), "--role", "ps",
                                                  "--index", str(k), "--controller", self.ctl_addr,
                                                  *self._metrics_args(f"agent-ps-{k}"), "--",
                                                  *self._cmd(*child)), role="ps", index=k)
            self.metrics_hosts[f"ps-{k}"] = _connect_host(self.job.ps.host)

    def _wait_ps(self) -> None:
        host = _connect_host(self.job.ps.host)
        for k in range(self.job.ps.shards):
            ready = self.run_dir / "ps" / f"ps-{k}.ready"
            self.fleet.wait_file(ready, self.fleet.members[f"ps-{k}"], self.lc.ready_timeout_s, self.stop_event.is_set)
            info = json.loads(ready.read_text())
            self.ps_addrs.append(f"{host}:{int(info['port'])}")  # the port the shard bound
            self.metrics_ports[f"ps-{k}"] = int(info["metrics_port"])
        self._read_published_ports()
        self._write_targets()
        self.ps_ready = True
        log.info("PS fleet ready", extra=kv(addresses=",".join(self.ps_addrs)))

    def _start_workers(self) -> None:
        for r in range(self.job.train.workers):
            child = ["worker", "--config", str(self.job_path), "--rank", str(r), "--ps", ",".join(self.ps_addrs),
                     "--controller", self.ctl_addr, "--run-dir", str(self.run_dir), *self._metrics_args(f"worker-{r}")]
            if self.continued is not None:
                child += ["--start-step", str(self.continued.step)]
            self.fleet.start(f"worker-{r}", self._cmd("agent", "--config", str(self.job_path), "--role", "worker",
                                                      "--index", str(r), "--controller", self.ctl_addr,
                                                      *self._metrics_args(f"agent-worker-{r}"), "--",
                                                      *self._cmd(*child)), role="worker", index=r)
        self._read_published_ports()
        self._write_targets()

    def _finished_members(self) -> set[str]:
        """Workers whose agent exited 0 (their part of the run done): their endpoints leave the targets."""
        return {n for n, rc in self.fleet.exited().items() if rc == 0 and self.fleet.members[n].role == "worker"}

    def _write_targets(self, *, ended: bool = False) -> None:
        """``RUN/metrics/targets.json``: every live process's ``/metrics`` (Prometheus ``file_sd``;
        metaps.monitoring). A worker that finished (its agent exited 0) leaves it, and a run that
        succeeded empties it (``ended``): a Prometheus reading it drops those targets instead of
        alerting ``MetapsTargetDown`` on processes that ended as they should."""
        from metaps.monitoring import write_targets

        self.targets_finished = self._finished_members()
        gone = {name for m in self.targets_finished for name in (m, f"agent-{m}")}
        endpoints = {} if ended else {name: f"{self.metrics_hosts.get(name, '127.0.0.1')}:{port}"
                                      for name, port in self.metrics_ports.items() if port and name not in gone}
        path = write_targets(self.run_dir / "metrics" / "targets.json", endpoints, self.run_dir.name)
        log.info("metrics targets written", extra=kv(path=str(path), endpoints=len(endpoints)))

    # ---------------------------------------------------------------- watch
    def _poll_status(self, client: Any) -> None:
        from controller.client import ControllerError

        try:
            self.status = client.status()
        except ControllerError as exc:
            log.debug("status unavailable", extra=kv(error=str(exc)[:200]))

    def _interrupted(self) -> Outcome:
        if self.stop_reason:  # on_poll asked to stop
            return Outcome("interrupted", self.stop_reason, EXIT_SIGINT)
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
                    if self._read_published_ports() or self._finished_members() != self.targets_finished:
                        self._write_targets()  # a process that started (or restarted) or finished since
                    self.live.ports = {r: self.metrics_ports.get(f"worker-{r}") for r in range(self.job.train.workers)}
                    self.live.poll()
                    latest = self.live.latest(fallback=self.tail.latest())
                    display.update(self.status, latest, elapsed)
                    why = self.on_poll(self.status, latest) if self.on_poll is not None else ""
                    if why and not self.stop_event.is_set():
                        self.stop_reason = why
                        self.stop_event.set()
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
            if rc == exit_codes.RUN_FAILED:  # the run failed (e.g. a final checkpoint not written): no restart
                self._final_status()
                return controller_failed(self.status) or Outcome(
                    "failed", f"{name} exited with code {rc} (the run failed); see logs/{name}.log", EXIT_FAILED)
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
        from ps.checkpoint import checkpoint_step, latest_checkpoint
        from ps.coordinator import checkpoint_all
        from workers.worker import checkpoint_info

        if not self.ps_ready or any(self.fleet.members[f"ps-{k}"].poll() is not None
                                    for k in range(len(self.ps_addrs)) if f"ps-{k}" in self.fleet.members):
            # stopped during start-up (Ctrl-C before every shard served): nothing to save, not an error
            log.info("no final checkpoint: the PS fleet was not up", extra=kv(reason=reason))
            return ""
        node_steps = [int(n.get("step", 0)) for n in (self.status or {}).get("nodes", []) if n.get("role") == "worker"]
        step = max([self.tail.max_step(), *node_steps])
        root = self.run_dir / "checkpoints"
        last = latest_checkpoint(root)
        if last is not None and checkpoint_step(last) >= step:
            step = checkpoint_step(last) + 1
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
                notes.append(outcome.no_checkpoint_note)
        self._final_status()
        stats = self._ps_stats()
        self._read_published_ports()  # for the report: every endpoint the fleet had
        self.fleet.stop([n for n, m in self.fleet.members.items() if m.role == "ps"], grace)
        self.fleet.stop(["controller"], grace)
        self.fleet.kill_all()
        left = self.fleet.alive_pids()
        if left:
            notes.append(f"processes still alive after the stop: {left}")
            log.error("fleet processes left behind", extra=kv(pids=left))
        return stats, notes

    def _report(self, outcome: Outcome, ps_stats: list[dict[str, Any]] | None, notes: list[str]) -> dict[str, Any]:
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
                         ("plots", lambda: _draw_plots(rep, self.run_dir / "plots"))):
            if what == "plots" and not self.job.run.plots:
                log.info("plots not drawn ([run] plots = false)", extra=kv(draw=f"metaps run-report --run-dir {self.run_dir}"))
                continue
            try:
                fn()
            except Exception:
                log.exception("could not write run artefact", extra=kv(what=what))
        if self.auto_named:
            settle_latest(self.run_dir, outcome.status == "succeeded", self.previous_latest)
        print_summary(self.console, rep)
        hint = self._continue_hint(outcome)
        if hint:
            self.console.print(hint, soft_wrap=True)  # one line: a command to copy
            log.info("the run can be continued", extra=kv(command=f"metaps launch --resume {self.run_dir}"))
        return rep

    def _continue_hint(self, outcome: Outcome) -> str:
        """How to continue a run that did not finish ('' when it cannot be continued)."""
        if outcome.status == "succeeded":
            return ""
        from metaps.launch.resume import find_continue_point

        try:
            point = find_continue_point(self.run_dir)
        except ConfigError as exc:
            log.info("this run cannot be continued", extra=kv(why=str(exc)[:300]))
            return ""
        return (f"continue it from its last committed cut (step {point.step}): "
                f"metaps launch --resume {self.run_dir}")

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
                outcome = controller_failed(self.status) or coverage_short(self.status) or outcome
            if outcome.status == "succeeded":
                self._write_targets(ended=True)  # no target-down alerts for a run that ended well
        except BaseException:
            self.fleet.kill_all()
            if self.auto_named:
                settle_latest(self.run_dir, False, self.previous_latest)
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for r in self.reservations:
                r.close()  # the fleet is gone: the all-reduce port goes back
        self._report(outcome, stats, notes)
        from metaps.run_report import shown_path

        self.console.print(f"run directory: {shown_path(str(self.run_dir))}")
        return outcome.code


def _draw_plots(rep: dict[str, Any], out: Path) -> None:
    """``RUN/plots/*.png``; matplotlib is imported only here (about 1 CPU-s), so a run with
    ``[run] plots = false`` never loads it."""
    from metaps.plots import make_plots

    make_plots(rep, out)
