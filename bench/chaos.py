"""Chaos bench (issue 10, "no silent loss, safe by default"): faults injected into real small fleets.

Every fleet is a real ``metaps launch`` (controller, PS and worker agents as OS
processes, gRPC on 127.0.0.1) on tiny Meta-IO data (800 rows, 17 meta-batches,
2 epochs, 2 PS, 2 workers, Adam on every table), bounded by ``--timeout`` and
killed from outside past a hard limit. Faults:

    kill_<role>       SIGKILL of the controller, PS 0, worker 1, worker 1's agent, PS 0's agent
    stop_<role>       SIGSTOP of the same for STOP_S (> the heartbeat timeout), then SIGCONT
    corrupt_ckpt_kill_ps  the newest committed checkpoint's bytes overwritten, then PS 0 SIGKILLed
    kill_worker_mid_shard  SIGKILL of the only worker with >= 2 steps of a lease trained and not reported
                      (16-batch leases, every PS request +30 ms: a lease outlasts its heartbeats)
    freeze_ps         SIGSTOP of PS 0 at that state until a worker crashed (its RPC to the frozen PS
                      expired: ``[rpc] timeout_s`` 5), then SIGCONT
    kill_allreduce_rank   ``dense_sync = "allreduce"``, 2 ranks: SIGKILL of rank 1 after the bench's cut
    disk_full         the checkpoint root is a tiny tmpfs (``unshare --mount``; room for ~1 checkpoint)
    slow_ps           PS 1 answers every request +50 ms late (``[faults]`` latency)
    many_workers      32 simulated workers (threads here) against one ``metaps ps`` with bounded
                      staleness, one of them slow: its pushes that fail / starve are counted
    bad inputs        hostile RPCs to a live PS and controller (bench/chaos_inputs.py) and bad
                      configs / data to ``metaps launch``

**Faults strike at states, not times** (a busy box cannot make them vacuous). A signal
fault's fleet takes no interval cuts; the bench watches the controller (``GetStatus``)
and: waits for a train shard done -> requests cut A (``RequestCut``) and waits for its
commit -> (corrupt: requests cut B, waits for its commit, corrupts it) -> waits for training
leased after A's commit to be done (more train batches done than the shards in flight at
the commit can hold: a shard in flight may have pushed into A's rows before it was reported
done, and then a broken rollback loses nothing) -> strikes. A PS recovery must then restore
A and roll the DDS back to it, with training the cut lacks to lose. ``kill_worker_mid_shard`` and
``freeze_ps`` run one worker with 16-batch leases (PS requests +30 ms) and strike when its last heartbeat's step count is at
least 2 above the train batches the ledger has done (``unreported_steps``: its second step's pull
waited for its first step's push, so a push of a lease it never reports is in the model), read again
once it died; it is exercised only when the final model shows those pushes: updates beyond the
ledger's done / replayed / stale / duplicate entries (``model.updates_abandoned``: the ones only the
``abandoned`` entry of the dead lease accounts for, plus ``unreported_updates``). A fault that did not
reach its state is **not exercised** (never survived).

**The judge reads the model, not row counts.** Every table runs Adam, whose per-row
state counts the row's updates (checkpointed with the row); one training step pushes
each unique id of its batch once, so a row's count is the number of trained batches
holding its id, whatever the interleaving. From the run's own outputs (exit code,
report.json: the ledger, the cuts, the recovery events; the checkpoints):

    model         final checkpoint, row by row: count >= the batches of the ledger's live done
                  entries holding the id (else: updates the ledger claims and the model lacks)
                  and <= those plus the replayed / stale / duplicate / abandoned entries' batches
                  (``abandoned``: a lease taken from a holder that may have pushed some of it).
                  ``unreported_updates``: the sum over rows of what exceeds that bound (updates
                  in the model that no ledger entry reports)
    restored      each cut a PS recovery restored: its checkpoint holds the updates of every
                  shard done at the cut, and what every shard *served* once restored is the cut
                  on disk, by content: the digest of its live store after the restore (ids,
                  weights, optimizer state in id order, ``ps/digest.py``; in its Restore reply,
                  recorded in the ``ps_recovery`` event) against the same digest of its part of
                  the cut read from the checkpoint files (``ps.digest.checkpoint_digests``), per
                  shard and table. The replies' row counts are only compared with what the shards
                  served. Missing evidence (no digests, a shard or table without one, no row
                  count) fails. Only this check sees a restore that dropped rows (the final model
                  can mask it: the shard in flight at the strike repeats the cut's batches and its
                  pushes land after the restore) or never replaced a live shard's rows (its updates
                  after the cut are within the replayed entries' bound). Its limit: it trusts that
                  a shard computes the digest from the store it serves from
    exercised     the armed cut is the one restored, with shards done before it and after it
    survived      exercised, exit 0, "succeeded", the ledger covering every batch of every
                  epoch exactly once, and the model checks clean. A failed run never survives
                  (``failed_clearly``: it failed naming the fault's cause, lost nothing)
    false_claim   "succeeded" / coverage complete while the ledger has batches not done,
                  "succeeded" after a failed PS recovery, updates not reported, a restore whose
                  shards serve other content than the cut, or its evidence missing

The judge reads sparse rows only: a dense parameter reset (an all-reduce group re-formed from
fresh weights) is not seen by it.

The judge is mutation-tested (tests/bench/test_chaos_judge.py): fleets of builds broken
on purpose (``common.faults.TEST_BREAKS``: no DDS rollback; a restore that keeps
zero rows; a restore that never swaps the cut in; one that keeps 7 rows of 8, each replying
the rows loaded) must fail it, and a correct one pass; the correct run with its recovery
evidence taken away must fail it too.

The last line's figures: ``faults_survived`` of ``faults_tried``, ``faults_not_exercised``,
``runs_losing_updates``, ``false_coverage_claims``, ``unreported_updates`` (summed over the
fleet faults; per fault in ``faults``), ``runs_unjudged`` (fleet runs without a final model to
read).

Run: ``python -m bench.chaos [--quick] [--keep DIR]``; the last line is one JSON object.
``--smoke``: bad inputs and many_workers (4 threads, 2 s) only, no fleet fault unless ``--only`` names some: seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TOKEN = "chaos-token"
STOP_S = 14.0            # SIGSTOP length: longer than HEARTBEAT_TIMEOUT_S
FREEZE_MAX_S = 40.0      # freeze_ps: the PS stays stopped until a worker crashed, at most this long
FREEZE_RPC_TIMEOUT_S = 5.0  # freeze_ps: the fleet's [rpc] timeout_s (a worker's call to the frozen PS expires)
HEARTBEAT_TIMEOUT_S = 10.0
RUN_TIMEOUT_S = 240.0    # metaps launch --timeout
HARD_LIMIT_S = 330.0     # killed from outside past this
ARMED_INTERVAL_S = 3600.0  # checkpoint interval of a fleet whose fault is armed: the bench takes the cuts
ADAM = {"kind": "adam", "lr": 0.01}  # every table: the per-row update count the judge reads
TMPFS_BYTES = 600 * 1024  # one ~450 KiB checkpoint fits, the next does not

log = logging.getLogger("bench.chaos")


def say(msg: str) -> None:
    print(msg, flush=True)


def _env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=f"{REPO}:{pp}" if pp else str(REPO), OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1")


def _metaps(*args: str) -> list[str]:
    return [sys.executable, "-m", "metaps", *args]


# ============================================================== processes of a fleet
def _argv(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state == "Z" or not raw:
        return None
    return raw.decode(errors="replace").split("\0")


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else ""


def fleet_procs(marker: str) -> dict[str, int]:
    """Live processes whose command line holds ``marker`` (a run dir), by fleet name.

    Names: ``controller``, ``ps-K``, ``worker-R``, ``agent-ps-K``, ``agent-worker-R``.
    """
    out: dict[str, int] = {}
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        argv = _argv(int(d.name))
        if not argv or marker not in " ".join(argv) or "metaps" not in argv:
            continue
        rest = argv[argv.index("metaps") + 1:]
        while rest and rest[0].startswith("--"):  # --log-level X
            rest = rest[2:]
        if not rest:
            continue
        cmd, head = rest[0], rest[: rest.index("--")] if "--" in rest else rest
        if cmd == "controller":
            out["controller"] = int(d.name)
        elif cmd == "ps":
            out[f"ps-{_opt(head, '--shard')}"] = int(d.name)
        elif cmd == "worker":
            out[f"worker-{_opt(head, '--rank')}"] = int(d.name)
        elif cmd == "launch":
            out["launcher"] = int(d.name)
        elif cmd == "agent":
            out[f"agent-{_opt(head, '--role')}-{_opt(head, '--index')}"] = int(d.name)
    return out


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_marker(marker: str) -> list[int]:
    """SIGCONT + SIGKILL every fleet process of one run (ours, found by its run dir)."""
    pids = list(fleet_procs(marker).values())
    for pid in pids:
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGKILL)
    return pids


# ============================================================== data and jobs
def make_data(root: Path) -> dict[str, Path]:
    """The launch tests' tiny data: 800-row train + held-out eval, meta layout, 17 batches each."""
    from tests.metaps.fleet_data import make_data as _make

    return _make(root)


def job_mapping(data: dict[str, Path], root: Path, *, workers: int = 2, ps: int = 2,
                **sections: dict[str, Any]) -> dict[str, Any]:
    from tests.metaps.fleet_data import job_mapping as _job

    job = _job(data, root, workers=workers, ps=ps)
    job["rpc"]["token"] = TOKEN
    job["train"]["epochs"] = 2
    job["controller"]["checkpoint_interval_s"] = 3.0
    job["controller"]["heartbeat_timeout_s"] = HEARTBEAT_TIMEOUT_S
    job["controller"]["agent"]["restart_limit"] = 2
    job["ps"]["table_defaults"]["optimizer"] = dict(ADAM)
    _merge(job, sections)
    return job


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """``src`` into ``dst``, nested tables merged key by key (``{"controller": {"dds": {...}}}`` keeps the rest)."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def write_job(path: Path, job: dict[str, Any]) -> Path:
    from common.toml_writer import write

    path.parent.mkdir(parents=True, exist_ok=True)
    return write(path, job)


def dataset_specs(data: dict[str, Path]) -> dict[str, list[int]]:
    from meta_io.reader import MetaIODataset

    out = {}
    for name in ("train", "eval"):
        ds = MetaIODataset(data[name])
        out[name] = [ds.num_batches(f) for f in range(ds.num_files)]
    return out


# ============================================================== one fleet run
@dataclass
class FleetFault:
    """One fault against one ``metaps launch``.

    Args:
        name: the fault's name in the JSON.
        target: fleet process name (see :func:`fleet_procs`) or '' (none / special).
        sig: "kill" | "stop" | "" (none).
        because: words one of which a failing run's reason must hold to be a true reason.
        sections: job TOML overrides.
        special: "corrupt" | "disk" | "".
        epochs: the fleet's epochs (0: :func:`run_fleet`'s). ``corrupt_ckpt_kill_ps`` takes two cuts
            before it strikes; at 2 epochs the run often ended first ("not exercised" in 2 of 5 quick
            runs), at 3 there is training left after both.
        strike: the state it strikes at: "cut" (the bench's cut committed, training after it done),
            "mid_shard" (worker 0 has trained >= 2 steps of a lease it has not reported: its pushes
            are in the PS) or "freeze" (that state, then ``target`` SIGSTOPped until a worker
            crashed, then SIGCONT).
        workers, ps: the fleet's size (0: :func:`run_fleet`'s).
    """

    name: str
    target: str = ""
    sig: str = ""
    because: tuple[str, ...] = ()
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    special: str = ""
    epochs: int = 0
    strike: str = "cut"
    workers: int = 0
    ps: int = 0

    @property
    def armed(self) -> bool:
        """Struck at a state (the bench's own cut committed, training on both sides of it), not at a time."""
        return bool(self.sig)

    @property
    def recovers_ps(self) -> bool:
        """The fault restarts a PS: the fleet must restore a committed cut and roll the DDS back to it."""
        return self.target.startswith("ps-") and self.sig == "kill"


def _committed(root: Path) -> list[Path]:
    out = [p for p in root.glob("ckpt-*") if (p / "manifest.json").is_file() and not p.name.endswith(".tmp")]
    return sorted(out, key=lambda p: int(p.name.split("-")[1]) if p.name.split("-")[1].isdigit() else -1)


class _Watch:
    """The fleet's controller, as the bench sees it (``GetStatus``, ``RequestCut``): faults strike at states."""

    def __init__(self, run: Path, proc: subprocess.Popen[Any], deadline: float) -> None:
        self.run, self.proc, self.deadline = run, proc, deadline
        self._client: Any = None

    def _ctl(self) -> Any:
        if self._client is None:
            from controller.client import ControllerClient
            from common.rpc import RpcConfig

            addr = (self.run / "controller" / "address").read_text().strip()
            self._client = ControllerClient(addr, RpcConfig(token=TOKEN, timeout_s=10.0), role="worker", index=0,
                                            retry_s=2.0)
        return self._client

    def status(self) -> dict[str, Any] | None:
        try:
            return dict(self._ctl().status())
        except Exception as exc:  # noqa: BLE001 -- not up yet / restarting: the next poll asks again
            log.debug("status: %s", exc)
            self.close()
            return None

    def request_cut(self) -> int | None:
        try:
            return int(self._ctl().request_cut("chaos"))
        except Exception as exc:  # noqa: BLE001
            log.warning("request_cut: %s", exc)
            self.close()
            return None

    def until(self, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """Poll the status until ``pred`` holds; None when the run ended or the deadline passed first."""
        while self.proc.poll() is None and time.monotonic() < self.deadline:
            st = self.status()
            if st is not None and pred(st):
                return st
            time.sleep(0.2)
        return None

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001
                pass
            self._client = None


def train_done(st: dict[str, Any]) -> int:
    """Batches of the ``train`` dataset done so far (every epoch), from a status's coverage."""
    return int((st.get("coverage", {}).get("by_dataset", {}).get("train") or [0, 0])[0])


def ledger_head(st: dict[str, Any]) -> int:
    """The seq of the ledger's newest entry (-1: none), from a status's coverage counts."""
    cov = st.get("coverage", {})
    return (int(cov.get("done_entries", 0)) + int(cov.get("duplicate_entries", 0)) + int(cov.get("stale_entries", 0))
            + int(cov.get("abandoned_entries", 0)) - 1)


def _node(st: dict[str, Any], role: str, index: int) -> dict[str, Any] | None:
    return next((n for n in st.get("nodes", []) if n.get("role") == role and int(n.get("index", -1)) == index), None)


def unreported_steps(st: dict[str, Any]) -> int | None:
    """Train steps worker 0 has taken (its last heartbeat) beyond the train batches the ledger has done.

    The fleet's only worker, in its first incarnation (its step count starts at 0 and counts
    train steps: one per batch), so this many steps of its current lease were trained and not
    reported. A heartbeat lags, so it is a lower bound. None: no such worker in ``st``.
    """
    node = _node(st, "worker", 0)
    if node is None or int(node.get("restarts", 0)) != 0:
        return None
    return int(node.get("step", 0)) - train_done(st)


def _cut(st: dict[str, Any], cut_id: int) -> dict[str, Any] | None:
    return next((c for c in st.get("checkpoints", []) if int(c.get("cut_id", -1)) == cut_id), None)


def _arm_cut(w: _Watch, notes: dict[str, Any], key: str) -> dict[str, Any] | None:
    """Request a cut, wait until it committed; its record (None, ``notes['not_exercised']`` said why)."""
    cut_id = w.request_cut()
    if cut_id is None:
        notes["not_exercised"] = "the controller refused the bench's cut"
        return None
    st = w.until(lambda s: (_cut(s, cut_id) or {}).get("state") in ("committed", "aborted"))
    cut = _cut(st, cut_id) if st else None
    if cut is None or cut.get("state") != "committed":
        notes["not_exercised"] = f"cut {cut_id} never committed ({(cut or {}).get('state', 'run ended')})"
        return None
    notes[key] = {"cut_id": cut_id, "ledger_seq": int(cut["dds"]["ledger_seq"]), "dir": cut.get("dir", "")}
    return cut


def _inject(f: FleetFault, run: Path, proc: subprocess.Popen[Any], notes: dict[str, Any],
            job: dict[str, Any]) -> None:
    """Drive the fleet to the fault's state, then strike. Everything it did goes into ``notes``.

    Armed faults (signals): shard(s) done -> the bench's cut A committed (-> for ``corrupt``: cut
    B committed and corrupted) -> training leased after A's commit done (more train batches than the
    shards in flight at the commit can hold) -> strike. Interval cuts are off
    (``checkpoint_interval_s`` huge), so no cut commits between A and the strike: a correct PS
    recovery restores A (B is unreadable) and must roll the DDS back to it.
    """
    w = _Watch(run, proc, time.monotonic() + HARD_LIMIT_S - 30)
    try:
        if f.special == "disk":
            notes["injected"] = "tmpfs checkpoint root"
            return
        if not f.armed:
            notes["injected"] = "from the start (job [faults])" if f.sections else "none (fault-free run)"
            return
        if w.until(lambda s: ledger_head(s) >= 0) is None:
            notes["not_exercised"] = "the run ended before any shard was done"
            return
        if f.strike in ("mid_shard", "freeze"):
            _strike_mid_shard(f, w, run, notes)
            return
        cut = _arm_cut(w, notes, "cut")
        if cut is None:
            return
        if f.special == "corrupt":  # right away: a run of 1 epoch may end before a later cut commits
            spoiled = _arm_cut(w, notes, "corrupted_cut")
            if spoiled is None:
                return
            shard = Path(spoiled["dir"]) / "shard-0.lmdb"
            size = shard.stat().st_size
            with shard.open("r+b") as fh:  # the middle of the file: sha256 no longer matches the manifest
                fh.seek(size // 2)
                fh.write(os.urandom(min(4096, size // 4)))
            notes["corrupted"] = spoiled["dir"]
        # Training the cut cannot hold: a shard in flight while the cut's rows were written may have
        # pushed into them before it was reported done (a correct recovery then replays it, a broken
        # one loses nothing: the judge could not tell them apart). Shards in flight when the commit
        # was seen hold at most workers x batches_per_shard batches, so more train batches done after
        # that include one from a shard leased after the commit, whose updates the cut lacks.
        seq = int(cut["dds"]["ledger_seq"])
        seen = w.status()
        base = train_done(seen) if seen else 0
        inflight = int(job["train"]["workers"]) * int(job["controller"]["dds"]["batches_per_shard"])
        if w.until(lambda s: ledger_head(s) > seq and train_done(s) > base + inflight) is None:
            notes["not_exercised"] = (f"no training leased after cut {cut['cut_id']} was done "
                                      f"(train batches done at its commit {base}; the run ended)")
            return
        notes["train_done_at_commit"] = base
        st = w.status()
        pid = fleet_procs(str(run)).get(f.target)
        if pid is None:
            notes["not_exercised"] = f"{f.target} not found"
            return
        notes["ledger_head_at_strike"] = ledger_head(st) if st else None
        notes["strike_time"] = time.time()
        if f.sig == "kill":
            _signal(pid, signal.SIGKILL)
        else:
            _signal(pid, signal.SIGSTOP)
            time.sleep(STOP_S)
            _signal(pid, signal.SIGCONT)
        notes["injected"] = f"{f.sig} {f.target} pid {pid} after cut {cut['cut_id']}"
    finally:
        w.close()


def _strike_mid_shard(f: FleetFault, w: _Watch, run: Path, notes: dict[str, Any]) -> None:
    """Strike while worker 0 holds pushed, unreported steps of a lease (``unreported_steps`` >= 2).

    ``mid_shard``: SIGKILL ``f.target`` (worker 0). ``freeze``: SIGSTOP ``f.target`` (a PS) until a
    worker process of the fleet is gone (its RPCs to the frozen PS ran past their deadline and
    it crashed; the agent may already have started its next incarnation), at most FREEZE_MAX_S,
    then SIGCONT. Worker 0 trains at least 2 steps of the lease before the strike (the second
    step's pull waited for the first step's push to be applied), and the ledger read after the
    worker died has no report of them: its pushes are in the model, the lease was not reported.
    """
    st = w.until(lambda s: (unreported_steps(s) or 0) >= 2)
    procs = fleet_procs(str(run))
    pid = procs.get(f.target)
    if st is None or pid is None:
        notes["not_exercised"] = ("worker 0 was never seen 2 steps into a lease it had not reported (the run ended)"
                                  if st is None else f"{f.target} not found")
        return
    seen = int((_node(st, "worker", 0) or {}).get("step", 0))
    workers = {n: p for n, p in procs.items() if n.startswith("worker-")}
    notes["strike_time"] = time.time()
    if f.sig == "kill":
        _signal(pid, signal.SIGKILL)
        notes["injected"] = f"kill {f.target} pid {pid} at its step {seen}, train batches done {train_done(st)}"
    else:
        _signal(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        crashed: list[str] = []
        while time.monotonic() - t0 < FREEZE_MAX_S and not crashed:
            now = fleet_procs(str(run))
            crashed = sorted(n for n, p in workers.items() if now.get(n) != p)
            time.sleep(0.1)
        frozen_s = time.monotonic() - t0
        _signal(pid, signal.SIGCONT)
        notes["crashed"] = crashed
        notes["injected"] = (f"stop {f.target} pid {pid} for {frozen_s:.1f}s (until {crashed or 'no worker'} "
                             f"crashed) at worker 0's step {seen}")
    after = None
    for _ in range(50):  # the controller answers while the worker is dead: nothing it trained is reported now
        after = w.status()
        if after is not None:
            break
        time.sleep(0.2)
    notes["unreported_steps_at_strike"] = None if after is None else seen - train_done(after)


def _launch_cmd(f: FleetFault, cfg: Path, run: Path) -> tuple[list[str], str]:
    base = _metaps("--log-level", "INFO", "launch", "--config", str(cfg), "--run-dir", str(run), "--no-progress",
                   "--timeout", str(RUN_TIMEOUT_S))
    if f.special != "disk":
        return base, ""
    ck, seen = run / "checkpoints", run / "ckpt-manifests"
    script = (f"{shlex.join(base)} & L=$!; "
              f"while [ ! -d {shlex.quote(str(ck))} ] && kill -0 $L 2>/dev/null; do sleep 0.05; done; "
              f"mount -t tmpfs -o size={TMPFS_BYTES} chaos-ckpt {shlex.quote(str(ck))} || echo CHAOS_MOUNT_FAILED; "
              f"wait $L; rc=$?; "
              f"for d in {shlex.quote(str(ck))}/ckpt-*; do [ -f \"$d/manifest.json\" ] && "
              f"mkdir -p {shlex.quote(str(seen))}/$(basename \"$d\") && cp \"$d/manifest.json\" "
              f"{shlex.quote(str(seen))}/$(basename \"$d\")/; done; exit $rc")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script], f"tmpfs {TMPFS_BYTES} bytes"


def run_fleet(f: FleetFault, data: dict[str, Path], root: Path, *, breaks: str = "",
              workers: int = 2, ps: int = 2, epochs: int = 2) -> dict[str, Any]:
    """One ``metaps launch`` with fault ``f``; returns the raw outputs for :func:`judge`.

    Args:
        breaks: TEST ONLY: ``$METAPS_TEST_BREAK`` for the fleet (``common.faults.TEST_BREAKS``):
            the run is of a deliberately broken build, for the judge's mutation tests.
        workers, ps, epochs: the fleet's size (the tests run smaller ones).
    """
    job = job_mapping(data, root / f.name, workers=f.workers or workers, ps=f.ps or ps, **f.sections)
    job["train"]["epochs"] = f.epochs or epochs
    if f.armed:  # the bench takes the cuts (_inject): none commits behind its back
        job["controller"]["checkpoint_interval_s"] = ARMED_INTERVAL_S
    cfg = write_job(root / f.name / "job.toml", job)
    run = root / f.name / "run"
    cmd, method = _launch_cmd(f, cfg, run)
    notes: dict[str, Any] = {"method": method} if method else {}
    notes["recovers_ps"] = f.recovers_ps
    notes["strike"] = f.strike
    env = _env()
    if breaks:
        from common.faults import TEST_BREAK_ENV, write_break_sitecustomize

        env["PYTHONPATH"] = write_break_sitecustomize(root / f.name / "break-site") + ":" + env["PYTHONPATH"]
        env[TEST_BREAK_ENV] = breaks
        notes["test_break"] = breaks
    t0 = time.monotonic()
    out_path = root / f.name / "launch.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        inj = threading.Thread(target=_inject, args=(f, run, proc, notes, job), daemon=True)
        inj.start()
        try:
            rc: int | None = proc.wait(HARD_LIMIT_S)
        except subprocess.TimeoutExpired:
            rc = None
            notes["hard_killed"] = True
            _signal(proc.pid, signal.SIGKILL)  # the launcher (or its unshare wrapper) we started
            proc.wait(30)
        inj.join(STOP_S + 5)
    left = kill_marker(str(run))
    text = out_path.read_text(errors="replace")
    if breaks:  # the break's own log line, from the process it broke: the mutation ran
        notes["breaks_fired"] = sorted({b for b in breaks.split(",") for lf in (run / "logs").glob("*.log")
                                        if f"TEST BREAK {b}" in lf.read_text(errors="replace")})
    if "CHAOS_MOUNT_FAILED" in text:
        notes["method"] = "tmpfs mount failed: no disk-full fault"
    rep = None
    try:
        rep = json.loads((run / "report.json").read_text())
    except (OSError, ValueError):
        pass
    return {"rc": rc, "report": rep, "run": run, "wall_s": time.monotonic() - t0, "notes": notes,
            "left_processes": len(left), "tail": text[-1500:]}


def ledger_coverage(shards: list[dict[str, Any]], specs: dict[str, list[int]], epochs: dict[str, int]) -> list[str]:
    """Independent check of the report's ledger: every batch of every epoch done exactly once.

    Returns the problems ([] = complete).
    """
    got: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for e in shards:
        if e.get("kind") == "done" and not e.get("replayed"):
            got.setdefault((e["dataset"], int(e["epoch"]), int(e["file"])), []).append((int(e["start"]), int(e["stop"])))
    problems = []
    for name, files in specs.items():
        for ep in range(epochs.get(name, 1)):
            for fi, total in enumerate(files):
                pos = 0
                for a, b in sorted(got.get((name, ep, fi), [])):
                    if a != pos:
                        problems.append(f"{name} epoch {ep} file {fi}: {'gap' if a > pos else 'overlap'} at {min(a, pos)}")
                    pos = max(pos, b)
                if pos != total:
                    problems.append(f"{name} epoch {ep} file {fi}: covered to {pos} of {total}")
    return problems


# ============================================================== the model's own update counts
# Every table of a chaos fleet runs Adam, whose per-row state holds the row's update count
# (``ps.optimizers.AdamOptimizer.step``; checkpointed with the row). A training step pushes
# every unique id of its batch once, so a row's count is exactly the number of trained
# batches holding its id (checked on a fault-free run: every row equal). The count is
# additive and order-free (two async workers, any interleaving): the judge compares it,
# row by row, with what the ledger says was trained.
BatchIds = dict[tuple[int, int], dict[str, "np.ndarray"]]


def batch_ids(train: Path) -> BatchIds:
    """(file, batch) -> table -> the batch's unique ids: what one training step on it pushes."""
    from meta_io.reader import MetaIODataset

    ds = MetaIODataset(train)
    out: BatchIds = {}
    for f in range(ds.num_files):
        for i, b in enumerate(ds.read_range(f, 0, ds.num_batches(f))):
            out[(f, i)] = {t: u.numpy().astype(np.int64) for t, u in b.unique_ids.items()}
    return out


def expected_counts(entries: list[dict[str, Any]], ids: BatchIds) -> dict[str, dict[int, int]]:
    """table -> id -> updates the ledger ``entries`` (train; each batch of a range once) account for."""
    parts: dict[str, list[np.ndarray]] = {}
    for e in entries:
        for b in range(int(e["start"]), int(e["stop"])):
            for t, u in ids.get((int(e["file"]), b), {}).items():
                parts.setdefault(t, []).append(u)
    out: dict[str, dict[int, int]] = {}
    for t, arrs in parts.items():
        u, c = np.unique(np.concatenate(arrs), return_counts=True)
        out[t] = dict(zip(u.tolist(), c.tolist()))
    return out


def model_counts(ckpt: Path) -> dict[str, dict[int, int]]:
    """table -> id -> the row's update count (Adam ``step``) in a committed checkpoint."""
    from ps.checkpoint import read_manifest, read_rows

    out: dict[str, dict[int, int]] = {}
    for t in read_manifest(ckpt).get("tables", {}):
        d: dict[int, int] = {}
        for rows in read_rows(ckpt, t):
            d.update(zip(rows.ids.tolist(), np.asarray(rows.state["step"]).reshape(-1).tolist()))
        out[t] = d
    return out


def compare_counts(have: dict[str, dict[int, int]], low: dict[str, dict[int, int]],
                   high: dict[str, dict[int, int]] | None = None) -> dict[str, int]:
    """Rows whose count is below ``low`` (updates the ledger claims and the model lacks) / above ``high``.

    Returns rows_short, updates_missing, rows_over, updates_unaccounted, rows_checked.
    """
    short = missing = over = extra = checked = 0
    for t, want in low.items():
        got = have.get(t, {})
        for i, n in want.items():
            checked += 1
            g = got.get(i, 0)
            if g < n:
                short += 1
                missing += n - g
    if high is not None:
        for t, got in have.items():
            cap = high.get(t, {})
            for i, g in got.items():
                if g > cap.get(i, 0):
                    over += 1
                    extra += g - cap.get(i, 0)
    return {"rows_short": short, "updates_missing": missing, "rows_over": over, "updates_unaccounted": extra,
            "rows_checked": checked}


def model_check(res: dict[str, Any], ids: BatchIds) -> dict[str, Any]:
    """The final model and every restored cut against the ledger (see the module docstring).

    Keys: ``final`` (compare_counts of the final checkpoint: low = live done entries, high = those
    plus every other train entry: replayed done, duplicate, stale, abandoned), ``restored`` (one per
    PS recovery: the cut's checkpoint against the done entries at the cut, and what every shard
    served once restored against the cut on disk: :func:`restored_check`), ``exercised`` (None, or
    why the fault did not reach its state), ``lost`` (updates the model lacks), ``claims`` (what the
    run says and its model or evidence contradicts, or evidence missing), ``problems`` (both).
    """
    rep = res["report"] or {}
    train = [e for e in rep.get("shards", []) if e.get("dataset") == "train"]
    live = [e for e in train if e.get("kind") == "done" and not e.get("replayed")]
    replays = [e for e in train if e not in live]
    out: dict[str, Any] = {"lost": [], "claims": [], "restored": []}
    lost, claims = out["lost"], out["claims"]
    final = rep.get("checkpoint") or ""
    if final and (Path(final) / "manifest.json").is_file():
        held = model_counts(Path(final))
        fc = compare_counts(held, expected_counts(live, ids), expected_counts(live + replays, ids))
        # updates only the ``abandoned`` entries account for: a dead holder's pushes of a lease trained again
        reported = [e for e in replays if e.get("kind") != "abandoned"]
        fc["updates_abandoned"] = (compare_counts(held, {}, expected_counts(live + reported, ids))["updates_unaccounted"]
                                   - fc["updates_unaccounted"])
        out["final"] = fc
        if fc["updates_missing"]:
            lost.append(f"the final model lacks {fc['updates_missing']} row updates of {fc['rows_short']} "
                        f"rows that the ledger says were trained")
        if fc["updates_unaccounted"]:
            claims.append(f"the final model holds {fc['updates_unaccounted']} row updates ({fc['rows_over']} rows) "
                          f"more than the ledger's done + replayed + stale + duplicate + abandoned entries: "
                          f"updates not reported")
    elif rep.get("status") == "succeeded":
        claims.append("succeeded without a final checkpoint to check")
    cuts = {int(c["cut_id"]): c for c in rep.get("controller", {}).get("checkpoints", [])}
    recoveries = [e for e in rep.get("controller", {}).get("events", []) if e.get("kind") == "ps_recovery"]
    num_ps = int((rep.get("counts") or {}).get("ps") or (rep.get("config", {}).get("ps", {}) or {}).get("shards") or 0)
    for ev in recoveries:
        evd = ev.get("evidence") or {}
        cut = cuts.get(int(evd["cut_id"])) if isinstance(evd.get("cut_id"), int) else None
        if cut is None:
            claims.append(f"a PS recovery restored a cut the report does not list: {evd}")
            continue
        seq = int(cut["dds"]["ledger_seq"])
        row: dict[str, Any] = {"cut_id": int(cut["cut_id"]), "ledger_seq": seq}
        if Path(cut.get("dir", ""), "manifest.json").is_file():
            at_cut = [e for e in train if e.get("kind") == "done" and int(e["seq"]) <= seq]
            row.update(compare_counts(model_counts(Path(cut["dir"])), expected_counts(at_cut, ids)))
            if row["updates_missing"]:
                lost.append(f"cut {cut['cut_id']}'s checkpoint lacks {row['updates_missing']} row updates "
                            f"of the shards done at the cut")
            rc = restored_check(evd, Path(cut["dir"]), num_ps)
            row.update(rc["row"])
            lost.extend(rc["lost"])
            claims.extend(rc["claims"])
        else:
            row["checked"] = "its checkpoint was pruned"
        out["restored"].append(row)
    out["problems"] = lost + claims
    out["exercised"] = _exercised(res, train, cuts, recoveries, out.get("final"))
    return out


def restored_check(evd: dict[str, Any], ckpt: Path, num_ps: int) -> dict[str, Any]:
    """What each shard served once a PS recovery restored it, against the cut on disk, by content.

    ``evd``: the ``ps_recovery`` event's evidence; ``digests`` (shard -> table -> ``{"rows",
    "sha256"}``, each shard's Restore reply: what its live store served after the restore,
    ``ps.digest``) is compared with :func:`ps.digest.checkpoint_digests` of ``ckpt`` read from disk,
    shard by shard and table by table; the Restore replies' ``rows`` only with what the shards
    serve. Missing evidence (no digests, a shard or table without one, no rows) fails: nothing
    defaults to a value that passes. A dropped row can be masked in the final model (the shard in
    flight at the strike repeats the cut's batches and its pushes land after the restore), and rows
    a restore failed to replace are covered there by the replayed entries' bound: only this check
    sees either.

    Returns ``row`` (rows_in_cut, rows_restored: rows the shards served, rows_reply: what their
    replies said, rows_missing, digest_mismatches: per shard whose content differs, its tables and
    their rows served / in the cut / short), ``lost`` and ``claims`` (problem lines).
    """
    from ps.digest import checkpoint_digests

    cut = f"the PS recovery from {ckpt.name}"
    lost: list[str] = []
    claims: list[str] = []
    want = checkpoint_digests(ckpt, num_ps) if num_ps > 0 else {}
    in_cut = sum(int(d["rows"]) for tables in want.values() for d in tables.values())
    row: dict[str, Any] = {"rows_in_cut": in_cut, "rows_restored": None, "rows_reply": None, "rows_missing": None,
                           "digest_mismatches": []}
    if not want:
        claims.append(f"{cut}: the report names no PS shard count: nothing restored can be checked")
    got = evd.get("digests")
    if not isinstance(got, dict) or not got:
        claims.append(f"{cut}: its event has no digests of what the shards served (missing evidence): "
                      f"the restore cannot be checked")
        got = {}
    reply = evd.get("rows")
    if not isinstance(reply, int):
        claims.append(f"{cut}: its event has no restored row count (missing evidence)")
    else:
        row["rows_reply"] = reply
    served = 0
    missing = 0
    complete = True
    for k, tables in sorted(want.items()):
        have = got.get(str(k))
        if not isinstance(have, dict):
            complete = False
            if got:
                claims.append(f"{cut}: no digest of what shard {k} served (missing evidence)")
            continue
        bad: dict[str, Any] = {"shard": k, "tables": [], "served_rows": 0, "cut_rows": 0, "rows_short": 0}
        for t, d in sorted(tables.items()):
            h = have.get(t)
            if not isinstance(h, dict) or not isinstance(h.get("rows"), int) or not h.get("sha256"):
                complete = False
                claims.append(f"{cut}: no digest of table {t} on shard {k} (missing evidence)")
                continue
            served += h["rows"]
            if h["rows"] == d["rows"] and h["sha256"] == d["sha256"]:
                continue
            bad["tables"].append(t)
            bad["served_rows"] += h["rows"]
            bad["cut_rows"] += d["rows"]
            bad["rows_short"] += max(0, d["rows"] - h["rows"])
        if not bad["tables"]:
            continue
        row["digest_mismatches"].append(bad)
        n = len(bad["tables"])
        if bad["rows_short"]:
            missing += bad["rows_short"]
            lost.append(f"{cut} left shard {k} serving {bad['served_rows']} rows of {n} table(s) where the cut on "
                        f"disk holds {bad['cut_rows']}: the restored model lacks {bad['rows_short']} rows")
        else:
            claims.append(f"after {cut} shard {k} served content other than the cut's in {n} table(s) "
                          f"({bad['served_rows']} rows served, {bad['cut_rows']} on disk): the fleet does not hold "
                          f"the cut it restored")
    if complete and want:
        row.update(rows_restored=served, rows_missing=missing)
        if isinstance(reply, int) and reply != served:
            claims.append(f"{cut}: the shards' Restore replies say {reply} rows, the shards served {served}")
    return {"row": row, "lost": lost, "claims": claims}


def _exercised(res: dict[str, Any], train: list[dict[str, Any]], cuts: dict[int, dict[str, Any]],
               recoveries: list[dict[str, Any]], final: dict[str, int] | None = None) -> str | None:
    """None when the fault reached the state it was meant for; else why not (from the run's own record).

    A worker struck mid-lease (``mid_shard``, ``freeze``) must also have left its pushes in the model:
    the final model holds updates beyond the ledger's done / replayed / stale / duplicate entries
    (reported by ``abandoned`` entries, or by none: ``unreported_updates``).
    """
    notes = res["notes"]
    if notes.get("not_exercised"):
        return str(notes["not_exercised"])
    f_armed = "strike_time" in notes
    if not f_armed:
        return None if notes.get("injected") else "never injected"
    if notes.get("strike") in ("mid_shard", "freeze"):
        n = notes.get("unreported_steps_at_strike")
        if n is None or n < 2:
            return f"worker 0 had {n} trained steps of its lease unreported when struck (2 needed: one pushed)"
        if notes.get("strike") == "freeze" and not notes.get("crashed"):
            return f"no worker crashed while the PS was frozen ({FREEZE_MAX_S:.0f}s at most)"
        if final is None:
            return "no final model to read the struck worker's pushes in"
        if final["updates_abandoned"] + final["updates_unaccounted"] == 0:
            return "the final model holds no update of the struck worker's lease beyond what was reported"
        return None
    if notes.get("recovers_ps"):
        if not recoveries:
            return "no PS recovery ran"
        cut_id = int((recoveries[0].get("evidence") or {}).get("cut_id", -1))
        if cut_id != int(notes["cut"]["cut_id"]):
            return f"the recovery restored cut {cut_id}, not the armed cut {notes['cut']['cut_id']}"
        seq = int(cuts[cut_id]["dds"]["ledger_seq"]) if cut_id in cuts else -1
        before = [e for e in train if e.get("kind") == "done" and int(e["seq"]) <= seq]
        after = [e for e in train if e.get("kind") == "done" and int(e["seq"]) > seq
                 and float(e.get("time", 0)) <= float(notes["strike_time"])]
        if not before or not after:
            return f"the restored cut had {len(before)} shards done before it and {len(after)} after it at the strike"
    return None


def judge(f: FleetFault, res: dict[str, Any], specs: dict[str, list[int]], ids: BatchIds) -> dict[str, Any]:
    """survived / not exercised / lost updates / false claim of one fleet run (see the module docstring)."""
    rep = res["report"]
    row: dict[str, Any] = {"fault": f.name, "exit_code": res["rc"], "wall_s": round(res["wall_s"], 1),
                           **{k: v for k, v in res["notes"].items() if k != "recovers_ps"},
                           "left_processes": res["left_processes"]}
    if rep is None:
        row.update(survived=False, exercised=False, lost_updates=False, false_claim=False, status="no report.json",
                   why="no report.json (launcher hung or crashed); tail: " + res["tail"][-300:])
        return row
    status, reason = rep.get("status", ""), rep.get("reason", "")
    epochs = {"train": int(rep.get("config", {}).get("train", {}).get("epochs", 1)), "eval": 1}
    problems = ledger_coverage(rep.get("shards", []), specs, epochs)
    mc = model_check(res, ids)
    events = rep.get("controller", {}).get("events", [])
    failed_recovery = [e for e in events if e.get("kind") == "ps_recovery_failed"
                       or (e.get("kind") == "ps_recovery" and "error" in (e.get("evidence") or {}))]
    lost = list(mc["lost"])
    claims = list(mc["claims"])
    cov_claim = bool(rep.get("controller", {}).get("coverage", {}).get("complete"))
    if (status == "succeeded" or cov_claim) and problems:
        claims.append(f"says {'succeeded' if status == 'succeeded' else 'coverage complete'} but the ledger: {problems[:3]}")
    if status == "succeeded" and failed_recovery:
        claims.append(f"says succeeded after a failed PS recovery: {failed_recovery[0].get('evidence')}")
    not_ex = mc["exercised"]
    succeeded = res["rc"] == 0 and status == "succeeded" and not problems
    survived = succeeded and not lost and not claims and not_ex is None
    true_reason = bool(reason) and any(w.lower() in reason.lower() for w in f.because)
    row.update(status=status, reason=reason[:300], survived=survived, exercised=not_ex is None,
               lost_updates=bool(lost), false_claim=bool(claims), coverage_problems=len(problems),
               failed_clearly=not succeeded and status == "failed" and true_reason and not lost and not claims,
               model=mc.get("final"), restored=mc["restored"],
               unreported_updates=(mc.get("final") or {}).get("updates_unaccounted"),
               ps_recoveries=len([e for e in events if e.get("kind") == "ps_recovery"]),
               failed_recoveries=len(failed_recovery))
    why = ([f"not exercised: {not_ex}"] if not_ex else []) + lost + claims
    if not succeeded:
        why.append(f"the run failed (status {status}, exit {res['rc']}): {reason[:200]}" if status == "failed" else
                   f"status {status}, exit {res['rc']}" + (f", ledger: {problems[:2]}" if problems else ""))
    if why:
        row["why"] = "; ".join(why)[:600]
    return row


def fleet_faults(quick: bool) -> list[FleetFault]:
    """The fleet faults, quick subset first."""
    ctl, ps, wk, ag = ("controller",), ("ps", "parameter server", "shard"), ("worker",), ("agent",)
    # One worker whose leases outlast its heartbeats (its step count against the ledger's done batches
    # shows a lease in progress): 16-batch leases, every PS request +30 ms, heartbeats every 0.2 s.
    # Without the latency an idle box trained the 34 batches in about a second and no heartbeat
    # showed a lease in progress ("not exercised").
    mid = {"controller": {"dds": {"batches_per_shard": 16}, "agent": {"heartbeat_s": 0.2}},
           "faults": {"faults": [{"target": "ps", "index": k, "kind": "latency", "latency_s": 0.03} for k in (0, 1)]}}
    quick_set = [
        # 6 epochs: on an idle box 2 epochs were trained before the bench's cut committed ("not exercised")
        FleetFault("kill_ps", "ps-0", "kill", ps, epochs=6),
        FleetFault("corrupt_ckpt_kill_ps", "ps-0", "kill", ("checkpoint", "checksum", "sha256", "corrupt", "recovery"),
                   special="corrupt", epochs=8),
        FleetFault("kill_worker_mid_shard", "worker-0", "kill", wk, strike="mid_shard", workers=1, epochs=3,
                   sections=mid),
        # the worker's RPC to the frozen PS expires (DEADLINE_EXCEEDED) and it crashes mid-lease
        FleetFault("freeze_ps", "ps-0", "stop", wk + ps + ("deadline",), strike="freeze", workers=1, epochs=3,
                   sections={**mid, "rpc": {"timeout_s": FREEZE_RPC_TIMEOUT_S}}),
        # all-reduce ranks: one dies after the bench's cut with training on both sides of it
        FleetFault("kill_allreduce_rank", "worker-1", "kill", wk + ("all-reduce", "allreduce", "gloo", "rank"),
                   sections={"train": {"dense_sync": "allreduce"}}, epochs=6),
    ]
    if quick:
        return quick_set
    return quick_set + [
        FleetFault("kill_controller", "controller", "kill", ctl),
        FleetFault("kill_worker", "worker-1", "kill", wk),
        FleetFault("kill_worker_agent", "agent-worker-1", "kill", ag + wk),
        FleetFault("kill_ps_agent", "agent-ps-0", "kill", ag + ps),
        FleetFault("stop_controller", "controller", "stop", ctl),
        FleetFault("stop_ps", "ps-0", "stop", ps),
        FleetFault("stop_worker", "worker-1", "stop", wk),
        FleetFault("stop_worker_agent", "agent-worker-1", "stop", ag + wk),
        FleetFault("disk_full", "", "", ("space", "disk", "ENOSPC", "checkpoint"), special="disk"),
        FleetFault("slow_ps", "", "", ps, sections={"faults": {"faults": [
            {"target": "ps", "index": 1, "kind": "latency", "latency_s": 0.05}]}}),
    ]


# ============================================================== many workers, one slow
def many_workers(data: dict[str, Path], root: Path, n: int = 32, seconds: float = 20.0,
                 max_staleness: int = 2, slow_step_s: float = 1.5, deadline_s: float = 10.0) -> dict[str, Any]:
    """``n`` client threads (one slow) pushing/pulling against one ``metaps ps`` with bounded staleness.

    Every thread is a registered worker using the product's ``PsClient``: pull(step) ->
    push(step) -> step + 1. Fast ones run ahead and their pulls wait (client-side, on the
    PS's "stale_wait" answers) for the slow one; the slow one's pushes must still get
    through (before issue 10 a waiting pull held one of the PS's 8 handler threads).
    """
    import numpy as np

    from common.rpc import RpcConfig
    from ps.client import PsClient, PsClientError

    job = job_mapping(data, root / "many", ps=1)
    job["ps"]["max_staleness"] = max_staleness
    cfg = write_job(root / "many" / "job.toml", job)
    proc, addr = _start_ps(cfg, root / "many")
    stop = threading.Event()
    counts = {"slow_steps_tried": 0, "slow_pushes": 0, "slow_push_failed": 0, "slow_failed": 0, "slow_codes": {},
              "fast_steps": 0, "fast_errors": 0, "fast_codes": {}}
    lock = threading.Lock()
    try:
        def work(i: int) -> None:
            # The product's client: it waits out "stale_wait" answers with bounded backoff on its
            # own thread (the PS never holds a handler thread for it), as a real worker does.
            wid = f"chaos-{i}"
            slow = i == n - 1
            rng = np.random.default_rng(i)
            client = PsClient([addr], RpcConfig(token=TOKEN, timeout_s=deadline_s), worker_id=wid,
                              wait_timeout_s=deadline_s, retry_timeout_s=deadline_s, register=True)
            step = 0
            try:
                while not stop.is_set():
                    ids = np.unique(rng.integers(1, 5000, 64)).astype(np.int64)
                    if slow:
                        with lock:
                            counts["slow_steps_tried"] += 1
                    grads = np.full((ids.size, 8), 1e-3, np.float32)
                    try:
                        client.pull({"user": ids}, step=step)
                    except PsClientError as exc:  # a pull that waited out its deadline
                        with lock:
                            key = "slow_codes" if slow else "fast_codes"
                            c = f"pull:{getattr(getattr(exc, 'code', None), 'name', type(exc).__name__)}"
                            counts[key][c] = counts[key].get(c, 0) + 1
                            counts["slow_failed" if slow else "fast_errors"] += 1
                        continue
                    if slow:
                        time.sleep(slow_step_s)
                    try:
                        client.push({"user": (ids, grads)}, step=step)
                        ok, code = True, ""
                    except PsClientError as exc:
                        ok, code = False, getattr(getattr(exc, "code", None), "name", type(exc).__name__)
                    with lock:
                        if slow:
                            counts["slow_pushes"] += 1
                            if not ok:
                                counts["slow_push_failed"] += 1
                                counts["slow_failed"] += 1
                                counts["slow_codes"][f"push:{code}"] = counts["slow_codes"].get(f"push:{code}", 0) + 1
                        elif ok:
                            counts["fast_steps"] += 1
                        else:
                            counts["fast_errors"] += 1
                            counts["fast_codes"][code] = counts["fast_codes"].get(code, 0) + 1
                    step += 1
            finally:
                try:
                    client.leave_clock()
                except PsClientError:
                    pass
                client.close()

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(deadline_s * 3)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    counts.update(workers=n, max_staleness=max_staleness, seconds=seconds, call_deadline_s=deadline_s,
                  survived=counts["slow_steps_tried"] > 0 and counts["slow_failed"] == 0)
    return counts


def _start_ps(cfg: Path, where: Path, timeout_s: float = 180.0) -> tuple[subprocess.Popen[bytes], str]:
    ready = where / "ps-0.ready"
    logf = (where / "ps-0.log").open("wb")
    proc = subprocess.Popen(_metaps("ps", "--config", str(cfg), "--shard", "0", "--port", "0", "--ready-file",
                                    str(ready), "--grace", "2"), cwd=REPO, env=_env(), stdout=logf,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"metaps ps did not start: {(where / 'ps-0.log').read_text()[-1500:]}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{json.loads(ready.read_text())['port']}"


# ============================================================== bad inputs
def rpc_bad_inputs(data: dict[str, Path], root: Path) -> list[dict[str, Any]]:
    """The hostile-RPC battery against a live ``metaps ps`` and ``metaps controller``."""
    from bench.chaos_inputs import controller_battery, ps_battery

    where = root / "rpc"
    cfg = write_job(where / "job.toml", job_mapping(data, where, ps=1))
    state = where / "controller"
    # port 0: the controller binds a port of its own and writes it to its address file
    ctl = subprocess.Popen(_metaps("controller", "--config", str(cfg), "--address", "127.0.0.1:0",
                                   "--state-dir", str(state)), cwd=REPO, env=_env(),
                           stdout=(where / "controller.log").open("wb"), stderr=subprocess.STDOUT)
    ps = None
    try:
        ps, addr = _start_ps(cfg, where)
        deadline = time.monotonic() + 180
        while not (state / "address").exists():
            if ctl.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"metaps controller did not start: {(where / 'controller.log').read_text()[-1500:]}")
            time.sleep(0.1)
        outside = root / "outside-the-checkpoint-root"
        outside.mkdir(exist_ok=True)
        rows = ps_battery(addr, TOKEN, str(outside))
        rows += controller_battery((state / "address").read_text().strip(), TOKEN)
        return rows
    finally:
        for p in (ps, ctl):
            if p is not None:
                p.terminate()
        for p in (ps, ctl):
            if p is not None:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def launch_bad_inputs(data: dict[str, Path], root: Path, resume_source: Path | None) -> list[dict[str, Any]]:
    """Bad configs / data given to ``metaps launch``: each must be a one-line error, exit 1, nothing started."""
    where = root / "launch-bad"
    where.mkdir(parents=True, exist_ok=True)
    cases: list[tuple[str, dict[str, Any], list[str]]] = []
    base = job_mapping(data, where)

    unknown = json.loads(json.dumps(base))
    unknown["ps"]["tables"] = [{"name": "chaos_no_such_table", "dim": 8}]
    cases.append(("unknown table", unknown, []))

    trunc_dir = where / "truncated-train"
    if not trunc_dir.exists():
        shutil.copytree(data["train"], trunc_dir)
        part = min(trunc_dir.glob("part-*.arrow"))
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 3])
        for ids in trunc_dir.glob("part-*.ids.arrow"):
            ids.unlink()
    trunc = json.loads(json.dumps(base))
    trunc["data"]["train"] = str(trunc_dir)
    cases.append(("truncated dataset", trunc, []))

    missing = json.loads(json.dumps(base))
    del missing["data"]["train"]
    cases.append(("missing data.train", missing, []))

    nowhere = json.loads(json.dumps(base))
    nowhere["data"]["train"] = str(where / "no-such-dataset")
    cases.append(("data.train does not exist", nowhere, []))

    if resume_source is not None:
        bad_ckpt = where / "corrupt-resume" / resume_source.name
        if not bad_ckpt.exists():
            shutil.copytree(resume_source, bad_ckpt)
            shard = bad_ckpt / "shard-0.lmdb"
            size = shard.stat().st_size
            with shard.open("r+b") as fh:
                fh.seek(size // 2)
                fh.write(os.urandom(min(4096, size // 4)))
        cases.append(("corrupt resume checkpoint", base, ["--resume-from", str(bad_ckpt)]))

    out = []
    for i, (name, job, extra) in enumerate(cases):
        cfg = write_raw(where / f"case-{i}.toml", job)
        run = where / f"run-{i}"
        try:
            proc = subprocess.run(_metaps("launch", "--config", str(cfg), "--run-dir", str(run), "--no-progress",
                                          "--timeout", "90", *extra),
                                  cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
            rc, text, err = proc.returncode, proc.stdout + proc.stderr, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, text, err = None, str(exc.stdout or "") + str(exc.stderr or ""), ""
        kill_marker(str(run))
        started = (run / "logs" / "controller.log").exists()
        err_lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
        clear = rc == 1 and "Traceback" not in text and not started and len(err_lines) >= 1
        last = err_lines[-1] if err_lines else (text.strip().splitlines() or [""])[-1]
        out.append({"name": name, "target": "launch", "code": f"exit {rc}", "message": last[:300],
                    "fleet_started": started, "clear": clear})
    return out


def write_raw(path: Path, job: dict[str, Any]) -> Path:
    """Write a job mapping as TOML without validating it (bad configs are the point)."""
    from common.toml_writer import write

    return write(path, job)


# ============================================================== main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a subset: bad inputs, many workers, 5 fleet faults")
    ap.add_argument("--keep", default="", help="keep run dirs under this directory (default: a temp dir, removed)")
    ap.add_argument("--only", default="", help="comma-separated fleet fault names to run (default: all of the mode)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds, figures meaningless: the bad-input batteries and many_workers (4 threads, 2 s); "
                         "no fleet fault (each is a fleet of about a minute) unless --only names some")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    root = Path(args.keep or tempfile.mkdtemp(prefix="chaos-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        data = make_data(root / "data")
        specs = dataset_specs(data)
        bad = rpc_bad_inputs(data, root)
        for r in bad:
            say(f"bad input {r['target']}: {r['name']}: {'clear' if r['clear'] else 'NOT CLEAR'} "
                f"({r['code']}: {r['message'][:120]})")
        mw = (many_workers(data, root, n=4, seconds=2.0) if args.smoke
              else many_workers(data, root, seconds=12.0 if args.quick else 25.0))
        say("many_workers: " + json.dumps(mw))
        faults = fleet_faults(args.quick and not args.smoke)
        if args.only:
            keep = set(args.only.split(","))
            faults = [f for f in faults if f.name in keep]
        elif args.smoke:
            faults = []
        ids = batch_ids(data["train"])
        rows: list[dict[str, Any]] = []
        resume_source = None
        if not (args.quick or args.smoke):  # the fault-free run: the judge must pass it too
            b = run_fleet(FleetFault("baseline"), data, root)
            rb = judge(FleetFault("baseline"), b, specs, ids)
            say("baseline: " + json.dumps(rb))
            rows.append(rb)
            ck = _committed(b["run"] / "checkpoints")
            resume_source = ck[-1] if ck else None
        for f in faults:
            res = run_fleet(f, data, root)
            row = judge(f, res, specs, ids)
            rows.append(row)
            say(f"{f.name}: " + json.dumps(row))
            if resume_source is None:
                ck = _committed(res["run"] / "checkpoints")
                resume_source = ck[0] if ck else None
        bad += launch_bad_inputs(data, root, resume_source)
        for r in bad[-5:]:
            say(f"bad input {r['target']}: {r['name']}: {'clear' if r['clear'] else 'NOT CLEAR'} "
                f"({r['code']}: {r['message'][:120]})")
        mw_row = {"fault": "many_workers_one_slow", "survived": mw["survived"],
                  "exercised": mw["slow_steps_tried"] > 0, "lost_updates": False, "false_claim": False,
                  **{k: mw[k] for k in ("slow_steps_tried", "slow_failed", "slow_pushes", "slow_push_failed",
                                        "slow_codes", "fast_steps", "fast_errors")}}
        rows.append(mw_row)
        figures = {
            "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
            "faults_tried": len(rows),
            "faults_survived": sum(1 for r in rows if r["survived"]),
            "faults_not_exercised": sum(1 for r in rows if not r.get("exercised", True)),
            "faults_failed_clearly": sum(1 for r in rows if r.get("failed_clearly")),
            "runs_losing_updates": sum(1 for r in rows if r["lost_updates"]),
            "unreported_updates": sum(int(r.get("unreported_updates") or 0) for r in rows),
            "runs_unjudged": sum(1 for r in rows if r["fault"] != "many_workers_one_slow"
                                 and r.get("unreported_updates") is None),
            "false_coverage_claims": sum(1 for r in rows if r["false_claim"]),
            "bad_inputs_tried": len(bad),
            "bad_inputs_clear_error": sum(1 for r in bad if r["clear"]),
            "disk_full_method": next((r.get("method", "") for r in rows if r["fault"] == "disk_full"), "not run"),
            "slow_worker_steps_tried": mw["slow_steps_tried"],
            "slow_worker_steps_failed": mw["slow_failed"],
            "slow_worker_pushes_failed": mw["slow_push_failed"],
            "wall_s": round(time.monotonic() - t0, 1),
            "faults": [{k: r[k] for k in ("fault", "survived", "exercised", "lost_updates", "false_claim",
                                          "unreported_updates") if k in r}
                       | {k: r[k] for k in ("status", "exit_code", "reason", "why", "model") if r.get(k)}
                       for r in rows],
            "bad_inputs": [{k: r[k] for k in ("target", "name", "clear", "code")} for r in bad],
        }
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
