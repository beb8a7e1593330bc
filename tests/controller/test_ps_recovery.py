"""PS failure recovery on a real fleet (issue 5): every part its own process, real gRPC.

    metaps controller (checkpoint cuts every second)
    metaps agent --role ps --index k -- metaps ps --shard k --port P_k   (k = 0, 1)
    metaps worker --rank r --ps P_0,P_1 --controller ADDR                (r = 0, 1)

After the first committed checkpoint PS 1's process is SIGKILLed. Its agent
restarts it on the same port; it registers again with a new pid; the controller
pauses the fleet, restores both shards from the last committed cut, rolls the
DDS back to that cut and resumes. The workers keep going and the job completes
with every shard of every epoch done once (coverage 100%), replays counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from controller.client import ControllerClient
from meta_io.build import MetaIOBuildConfig, build
from meta_io.synth import GeneratorConfig, generate
from tests.ports import pick_port
from common.rpc import RpcConfig
from common.toml_writer import write
from tests.metaps.fleet_data import TOKEN, job_mapping, wait_for

REPO = Path(__file__).resolve().parents[2]


def _train_data(root: Path) -> dict[str, Path]:
    gen = generate(root / "raw", GeneratorConfig(rows=800, users=80, items=100, seed=3, n_files=1,
                                                  row_group_rows=800), progress=False)
    return {"train": build(gen.out_dir, gen.schema_path, root / "train",
                           MetaIOBuildConfig(support=4, query=4, rows_per_batch=64)).out_dir}


class _Procs:
    """Subprocesses in their own process groups; all killed at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", METAPS_T0=repr(time.time()))
        self.env.pop("METAPS_CONTROLLER", None)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        out = (self.logs / f"{name}.log").open("wb")
        p = subprocess.Popen([sys.executable, "-m", "metaps", *args], cwd=REPO, env=self.env, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def kill_all(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            p.wait(10)


def _status(ctl: ControllerClient) -> dict[str, Any]:
    return ctl.status()


def test_killed_ps_is_restarted_restored_and_the_job_completes(tmp_path: Path) -> None:
    data = _train_data(tmp_path / "data")
    agent = {"heartbeat_s": 0.3, "restart_limit": 2, "backoff_s": 0.2, "stop_grace_s": 5.0}
    # ps.max_staleness effectively unbounded: with a small bound, a worker idle in DDS WAIT holds back a worker that is
    # ahead and holds the last shard (a deadlock that is not about PS recovery; reported separately)
    mapping = job_mapping(data, tmp_path, workers=2, ps=2,
                         train={"mode": "meta", "workers": 2, "overlap": False, "log_every": 2, "epochs": 6},
                         controller={"heartbeat_timeout_s": 30.0, "tick_s": 0.1, "checkpoint_interval_s": 1.0,
                                     "dds": {"batches_per_shard": 2}, "monitor": {"window_s": 1.0},
                                     "agent": agent})
    mapping["ps"]["max_staleness"] = 1_000_000
    job = write(tmp_path / "job.toml", mapping)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    procs = _Procs(run / "logs")
    rpc = RpcConfig(token=TOKEN, timeout_s=20.0)
    try:
        ctl_port = pick_port("127.0.0.1")
        procs.start("controller", "controller", "--config", str(job), "--address", f"127.0.0.1:{ctl_port}",
                    "--state-dir", str(run / "controller"))
        wait_for(lambda: (run / "controller" / "address").exists() or procs.procs["controller"].poll() is not None,
                 60, "the controller's address file", 0.1)
        assert procs.procs["controller"].poll() is None, procs.log("controller")
        ctl_addr = f"127.0.0.1:{ctl_port}"
        ports = [pick_port("127.0.0.1") for _ in range(2)]
        for k in range(2):
            procs.start(f"ps-{k}", "agent", "--config", str(job), "--role", "ps", "--index", str(k),
                        "--controller", ctl_addr, "--", sys.executable, "-m", "metaps", "ps", "--config", str(job),
                        "--shard", str(k), "--port", str(ports[k]), "--ready-file", str(run / f"ps-{k}.ready"),
                        "--restore-latest", str(run / "checkpoints"),  # a restart serves checkpointed rows + dense
                        "--checkpoint-root", str(run / "checkpoints"))
        for k in range(2):
            wait_for(lambda: (run / f"ps-{k}.ready").exists(), 90, f"PS {k} ready\n{procs.log(f'ps-{k}')}", 0.1)
        ps_addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
        for r in range(2):
            procs.start(f"worker-{r}", "worker", "--config", str(job), "--rank", str(r), "--ps", ps_addrs,
                        "--controller", ctl_addr, "--run-dir", str(run))
        ctl = ControllerClient(ctl_addr, rpc, retry_s=5.0)

        def committed() -> list[dict[str, Any]]:
            return [c for c in _status(ctl)["checkpoints"] if c["state"] == "committed"]

        wait_for(lambda: committed(), 120, f"a committed checkpoint\n{procs.log('worker-0')}", 0.1)
        st = _status(ctl)
        assert not st["finished"], "the job finished before the PS could be killed: make it longer"
        # kill PS 1's process (not its agent): a crash in the middle of training
        ready = run / "ps-1.ready"
        pid = json.loads(ready.read_text())["pid"]
        ready.unlink()
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        wait_for(lambda: any(e["kind"] in ("ps_recovery", "ps_recovery_failed") for e in _status(ctl)["events"]),
                 120, f"the controller's fleet recovery\n{procs.log('ps-1')}\n{procs.log('controller')}", 0.2)
        recovered_s = time.monotonic() - t_kill
        for r in range(2):
            rc = procs.procs[f"worker-{r}"].wait(240)
            assert rc == 0, procs.log(f"worker-{r}")
        st = _status(ctl)
        events = {e["kind"]: e for e in st["events"]}
        assert "ps_recovery_failed" not in events, events["ps_recovery_failed"]
        restarted, rec = events["ps_restarted"], events["ps_recovery"]
        assert restarted["node"] == "ps:1" and restarted["evidence"]["previous_pid"] == pid
        assert json.loads(ready.read_text())["pid"] != pid  # the agent restarted it on the same port
        cuts = {c["cut_id"]: c for c in st["checkpoints"]}
        assert cuts[rec["evidence"]["cut_id"]]["state"] == "committed"
        assert rec["evidence"]["dir"] == cuts[rec["evidence"]["cut_id"]]["dir"]
        assert rec["evidence"]["rows"] > 0 and rec["evidence"]["requeued"] >= 1
        assert st["finished"]
        cov = st["coverage"]
        assert cov["complete"], cov["problems"]  # every shard of every epoch done exactly once (live)
        assert cov["replayed_entries"] + cov["stale_entries"] >= 1, cov  # the rolled-back work, counted
        assert cov["duplicate_samples"] > 0, cov
        print(f"recovered {recovered_s:.1f}s after the kill; coverage {cov}")
    finally:
        procs.kill_all()
