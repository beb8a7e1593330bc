"""PS recovery driven in this process, where mutation testing can see it (issue 37 item 9).

``tests/controller/test_recovery_durable.py`` kills a controller *process* at each step
of a recovery; mutmut cannot trace a subprocess, so every mutant of
``controller/ps_recovery.py`` that only those tests would kill survived. The same
scenarios run here in-process: a real :class:`~controller.server.ControllerServer`
(gRPC, LMDB state), two real PS shards on 127.0.0.1 (``tests/ps/conftest.start_fleet``)
and the real ``ps.fleet_admin.GrpcPsFleet`` port; no part of the project is mocked.

A controller "dies" at a step: its recovery thread's step hook raises :class:`_Died`
(not an ``Exception``: nothing in the recovery catches it), and the hook keeps raising
once dead, so the fleet's ``finally`` cannot resume the shards either -- what a
SIGKILL leaves behind: the durable record and a pause that ends with its lease. The
server is then stopped and a new one started on the same state directory
(``resume_pending`` on start). Judged by state: the rows every shard serves, the pause,
the DDS (one rollback, the shards trained after the cut TODO again, their ledger
entries replayed), the events and the durable record.

Also here: a PS restarting *during* a recovery (the record's ``gen`` counter: the run
ends by starting over, so the shard restarted mid-run is restored too), and the
failures that fail the run (no fleet wired in, no committed cut, a shard unreachable).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from controller.client import ControllerClient
from controller.ps_recovery import RECORD_KEY, RUN_FAILED, NoCommittedCut, PsRecovery, RecoveryError
from controller.server import ControllerServer
from controller.state import dumps, loads
from ps.checkpoint import shard_path
from ps.coordinator import checkpoint_all
from ps.factory import build_server
from ps.fleet_admin import GrpcPsFleet
from tests.metaps.fleet_data import wait_for
from tests.ps.conftest import Fleet, start_fleet

from .conftest import RPC, TOKEN, TRAIN, client, small_cfg, served_rows

torch.set_num_threads(1)

N_SHARDS = 14  # TRAIN (10, 7, 8 batches, 2 epochs) at 4 batches per shard: 3 + 2 + 2 shards an epoch


class _Died(BaseException):
    """The controller process died here (a SIGKILL): nothing in the recovery catches it."""


@pytest.fixture
def dying_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread ended by :class:`_Died` is a dead controller's, not an error of the test."""
    prev = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is not _Died:
            prev(args)

    monkeypatch.setattr(threading, "excepthook", hook)


class _Steps:
    """A recovery's step hook: records every step; ``crash_at`` (``step`` or ``step:shard``) kills the
    controller there, and every later step of that controller dies too (its threads are gone)."""

    def __init__(self, crash_at: str = "", on: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.what, _, self.shard = crash_at.partition(":")
        self.on = on
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.dead = threading.Event()

    def __call__(self, step: str, detail: dict[str, Any]) -> None:
        if self.dead.is_set():
            raise _Died(step)
        self.seen.append((step, dict(detail)))
        if step == self.what and (not self.shard or str(detail.get("shard")) == self.shard):
            self.dead.set()
            raise _Died(step)
        if self.on is not None:
            self.on(step, detail)

    def steps(self) -> list[str]:
        return [s if "shard" not in d or s in ("pause", "resume") else f"{s}:{d['shard']}" for s, d in self.seen]




def _n_rows(server: Any) -> int:
    return sum(server.store.tables[t].size for t in server.store.tables)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="controller.ps_recovery")
    return caplog


def _logged(caplog: pytest.LogCaptureFixture, level: str, message: str) -> dict[str, Any]:
    """The fields (``extra=kv(...)``) of the one line ``message`` the recovery logged at ``level``."""
    got = [r for r in caplog.records if r.name == "controller.ps_recovery" and r.getMessage() == message]
    assert len(got) == 1, (message, [(r.levelname, r.getMessage()) for r in caplog.records])
    assert got[0].levelname == level, (message, got[0].levelname)
    fields: dict[str, Any] = getattr(got[0], "kv", {})
    return fields


@dataclass
class Run:
    """A controller with two PS shards registered, one committed cut and 3 shards trained after it."""

    srv: ControllerServer
    fleet: Fleet
    state: Path
    w: ControllerClient = field(init=False)
    ckpt: str = ""
    cut_id: int = 0
    rows_cut: list[dict[str, bytes]] = field(default_factory=list)
    rows_at_cut: int = 0
    done_cut: int = 0
    leases: Iterator[Any] | None = None
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def connect(self, srv: ControllerServer) -> None:
        self.srv = srv
        self.w = client(srv, 0, register=False)
        self.w.register(incarnation="worker0")  # the same worker process, before and after a controller restart
        self.leases = self.w.shards("train", poll_s=0.01)

    def train(self, n: int | None) -> int:
        assert self.leases is not None
        ps = self.fleet.client()
        k = 0
        for lease in itertools.islice(self.leases, n):
            ids = self.rng.integers(0, 1 << 30, 40)
            ps.push({"user": (ids, self.rng.standard_normal((40, 8)).astype(np.float32))})
            assert self.w.report_shard(lease, "done", samples=lease.stop - lease.start).kind == "done"
            k += 1
        ps.close()
        return k

    def done(self) -> int:
        return int(self.srv.dds.progress()[0]["shards_done"])

    def restart_ps(self, k: int, incarnation: str) -> None:
        """PS ``k`` crashed; its agent started it again, empty and awaiting the recovery, on the same port;
        it registers its new incarnation (which starts the recovery)."""
        port = int(self.fleet.addresses[k].rsplit(":", 1)[1])
        self.fleet.servers[k].stop(0)
        s = build_server(self.fleet.ps_cfg, self.fleet.rpc, self.fleet.tables, k, wait_timeout_s=10.0)
        s.mark_awaiting_recovery("test: a restarted process")
        s.start(f"127.0.0.1:{port}")
        self.fleet.servers[k] = s
        self.srv.register_node("ps", k, self.fleet.addresses[k], pid=3000 + k, incarnation_id=incarnation)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.srv.events.list()]

    def event(self, kind: str) -> dict[str, Any]:
        evs = self.srv.events.list(kind=kind)
        assert len(evs) == 1, (kind, self.kinds())
        return evs[0].evidence

    def wait_recovered(self, n: int = 1) -> None:
        wait_for(lambda: self.kinds().count("ps_recovery") >= n or "ps_recovery_failed" in self.kinds(), 30,
                 "the fleet recovery", 0.05)
        self.srv.recovery.join(30)
        assert not self.srv.recovery.busy()

    def assert_recovered(self) -> None:
        """Every shard at the cut's rows and serving, none paused, the DDS back at the cut once."""
        kinds = self.kinds()
        assert "ps_recovery_failed" not in kinds and RUN_FAILED not in kinds, self.srv.events.list()
        assert [served_rows(s) for s in self.fleet.servers] == self.rows_cut
        assert not any(s.awaiting_recovery for s in self.fleet.servers)
        assert not any(s._gate.paused for s in self.fleet.servers)
        assert kinds.count("rollback") == 1, kinds
        assert self.done() == self.done_cut
        assert self.w.status()["coverage"]["replayed_entries"] == 3
        assert self.srv.recovery.record() is None and not self.srv.recovery.pending()
        assert self.srv.recovery.failed == ""

    def finish(self) -> None:
        """The replayed shards are handed out again and the run completes."""
        assert self.train(None) == N_SHARDS - self.done_cut
        st = self.w.status()
        assert st["finished"] and st["coverage"]["state"] == "complete", st["coverage"]


def _fresh(state: Path, steps: _Steps | None = None, **kw: Any) -> ControllerServer:
    """A controller process started on ``state`` (a restart: it resumes a pending recovery at start)."""
    kw.setdefault("ps_fleet", GrpcPsFleet(RPC))
    srv = ControllerServer(small_cfg(), state, (TRAIN,), RPC, **kw)
    if steps is not None:
        srv.recovery.fault_hook = steps
    srv.start("127.0.0.1:0")
    return srv


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    """Factory: a controller (its recovery's step hook given), two PS shards registered, 3 shards
    trained, a committed cut, 3 shards trained after it (their updates are what a restore erases)."""
    made: list[Run] = []

    def make(steps: _Steps | None = None, cut: bool = True, **kw: Any) -> Run:
        state = tmp_path / "state"
        fleet = start_fleet(2, token=TOKEN)
        r = Run(_fresh(state, steps, **kw), fleet, state)
        made.append(r)
        for k, a in enumerate(fleet.addresses):
            r.srv.register_node("ps", k, a, pid=1000 + k, incarnation_id=f"ps{k}-first")
        r.connect(r.srv)
        assert r.train(3) == 3
        if cut:
            r.cut_id = r.srv.checkpoints.open_cut()
            r.ckpt = str(checkpoint_all(fleet.addresses, tmp_path / "ckpt", 1, rpc_cfg=fleet.rpc))
            r.srv.checkpoints.commit(r.cut_id, 1, r.ckpt)
        r.rows_cut = [served_rows(s) for s in fleet.servers]
        r.rows_at_cut = sum(_n_rows(s) for s in fleet.servers)
        r.done_cut = r.done()
        assert r.train(3) == 3
        assert r.done() == r.done_cut + 3 and [served_rows(s) for s in fleet.servers] != r.rows_cut
        return r

    yield make
    for r in made:
        if r.srv._server is not None:
            r.srv.stop(grace=0)
        r.fleet.stop()


# -- one recovery, start to end ----------------------------------------------------------------------
def test_a_restarted_ps_is_recovered_to_the_cut_and_the_run_completes(run: Callable[..., Run],
                                                                     logs: pytest.LogCaptureFixture) -> None:
    steps = _Steps()
    r = run(steps)
    t0 = time.time()
    r.restart_ps(1, "ps1-second")
    assert r.srv.recovery.pending()  # durable before anything acted on it
    r.wait_recovered()
    r.assert_recovered()
    assert steps.steps() == ["pause", "restore:0", "restored:0", "restore:1", "restored:1", "rolled_back", "resume"]
    assert dict(steps.seen)["rolled_back"] == {"dir": r.ckpt, "cut_id": r.cut_id, "requeued": 3}
    restored = {d["shard"]: d for s, d in steps.seen if s == "restored"}
    assert sum(d["rows"] for d in restored.values()) == r.rows_at_cut > 0
    ev = r.event("ps_recovery")
    assert ev["incarnations"] == {"ps:1": 2}
    assert (ev["cut_id"], ev["dir"], ev["step"]) == (r.cut_id, r.ckpt, 1)
    assert ev["rows"] == r.rows_at_cut
    assert ev["requeued"] == 3 and ev["aborted_cuts"] == [] and ev["fallback"] is False and ev["healed"] == []
    assert ev["map_version"] == r.fleet.servers[0].pmap.version
    assert 0 < ev["seconds"] < time.time() - t0 + 1
    if "digests" in ev:  # what each restored shard served once restored (ps.digest)
        assert sorted(ev["digests"]) == ["0", "1"]
    [e] = r.srv.events.list(kind="ps_recovery")
    assert (e.node, e.action) == ("ps:1", "restore_fleet+rollback")
    assert "ps_recovery_fallback" not in r.kinds() and "ps_recovery_resumed" not in r.kinds()
    assert r.srv.recovery.runs == 1
    assert _logged(logs, "WARNING", "ps process restarted; fleet recovery requested") == {"node": "ps:1",
                                                                                          "incarnation": 2}
    done = _logged(logs, "INFO", "ps fleet restored to a committed cut")
    assert done.pop("seconds") == ev["seconds"]
    assert done == {"nodes": "ps:1", "cut_id": r.cut_id, "dir": r.ckpt, "rows": r.rows_at_cut, "requeued": 3}
    r.finish()


def test_the_durable_record_of_a_request(run: Callable[..., Run], logs: pytest.LogCaptureFixture) -> None:
    """What ``note`` writes before anything acts: which node restarted, as which incarnation, and a
    request counter (``gen``) that every further request moves on."""
    r = run(ps_fleet=None)
    rec = r.srv.recovery
    assert rec.record() is None and not rec.pending() and not rec.busy()
    t0 = time.time()
    rec.note("ps:1", 2)
    got = rec.record()
    assert got is not None
    opened = got.pop("opened")
    assert t0 - 1 <= opened <= time.time() + 1
    assert got == {"nodes": {"ps:1": 2}, "gen": 1, "phase": "requested", "dir": "", "restored": {}, "aborted": [],
                   "requeued": 0, "paused_until": 0.0}
    rec.note("ps:0", 3)
    got = rec.record()
    assert got is not None and got["nodes"] == {"ps:1": 2, "ps:0": 3} and got["gen"] == 2
    assert rec.discard("a continued run restores its cut") is True and rec.record() is None
    assert _logged(logs, "WARNING", "pending PS recovery discarded") == {"why": "a continued run restores its cut"}
    assert rec.discard("again") is False
    assert len([x for x in logs.records if x.getMessage() == "pending PS recovery discarded"]) == 1


def test_a_failed_recovery_names_every_recorded_node(run: Callable[..., Run]) -> None:
    """``fail`` reports the nodes of the durable record, not only those of the run that failed, and
    the error on one line."""
    r = run(ps_fleet=None)
    rec = r.srv.recovery
    rec.note("ps:0", 3)
    rec.note("ps:1", 2)
    rec.fail({"ps:1": 2}, RecoveryError("shard 1 refused:\n  two  lines"))
    assert rec.failed == "PS recovery after the restart of ps:0,ps:1 failed: shard 1 refused: two lines"
    [e] = r.srv.events.list(kind="ps_recovery_failed")
    assert (e.node, e.action) == ("ps:0,ps:1", "fail the run")
    assert e.evidence == {"incarnations": {"ps:0": 3, "ps:1": 2}, "error": "shard 1 refused: two lines", "fatal": True}
    [e] = r.srv.events.list(kind=RUN_FAILED)
    assert (e.node, e.action) == ("controller", "stop")
    assert e.evidence == {"reason": rec.failed, "source": "ps_recovery"}
    assert rec.record() is None
    rec.fail({"ps:1": 4}, RuntimeError("again"))  # no record left: the nodes given
    assert rec.failed == "PS recovery after the restart of ps:1 failed: again"


# -- the controller dies at each step and a new one resumes the recovery ------------------------------
@pytest.mark.parametrize("crash_at, redone", [
    ("pause", ["restore:0", "restore:1"]),       # recorded, no shard paused yet: everything again
    ("restore:1", ["restore:1"]),                # shard 0 restored (still paused): only shard 1 again
    ("restored:0", ["restore:1"]),               # the same, recorded after shard 0's restore
    ("restored:1", []),                          # every shard restored, the DDS not rolled back yet
    ("rolled_back", None),                       # rolled back, the shards still paused: only resumed
    ("resume", None),                            # the same, dead while resuming them
])
def test_a_controller_dead_mid_recovery_is_resumed_by_the_next_one(
        run: Callable[..., Run], dying_threads: None, logs: pytest.LogCaptureFixture, crash_at: str,
        redone: list[str] | None) -> None:
    first = _Steps(crash_at)
    r = run(first)
    r.restart_ps(1, "ps1-second")
    wait_for(first.dead.is_set, 30, f"the controller to reach {crash_at}", 0.02)
    r.srv.recovery.join(30)
    rec = r.srv.recovery.record()
    assert rec is not None and rec["nodes"] == {"ps:1": 2}
    if crash_at == "pause":
        assert rec["phase"] == "paused" and rec["dir"] == "" and rec["restored"] == {}
        assert time.time() < rec["paused_until"] <= time.time() + r.srv.cfg.heartbeat_timeout_s
        assert not any(s._gate.paused for s in r.fleet.servers)  # died before pausing any shard
    elif crash_at in ("restore:1", "restored:0", "restored:1"):
        assert rec["phase"] == "paused" and rec["dir"] == r.ckpt
        assert sorted(rec["restored"]) == (["0", "1"] if crash_at == "restored:1" else ["0"])
        assert sum(rec["restored"].values()) == sum(_n_rows(s) for s in r.fleet.servers[: len(rec["restored"])])
        assert all(s._gate.paused for s in r.fleet.servers)  # a dead controller's pause stays, with its lease
        left = [s._gate._paused_until - time.monotonic() for s in r.fleet.servers]
        assert 0 < min(left) and max(left) <= r.srv.cfg.heartbeat_timeout_s + 0.5, left  # the lease: its node timeout
        assert "rollback" not in r.kinds() and r.done() == r.done_cut + 3
    else:
        assert rec["phase"] == "rolled_back" and rec["dir"] == r.ckpt and rec["cut_id"] == r.cut_id
        assert rec["requeued"] == 3 and sorted(rec["restored"]) == ["0", "1"]
        assert all(s._gate.paused for s in r.fleet.servers)
        assert r.kinds().count("rollback") == 1 and r.done() == r.done_cut
    assert "ps_recovery" not in r.kinds() and "ps_recovery_failed" not in r.kinds()
    r.srv.stop(grace=0)

    second = _Steps()
    r.connect(_fresh(r.state, second))
    r.wait_recovered()
    r.assert_recovered()
    resumed = r.event("ps_recovery_resumed")
    assert resumed == {"phase": rec["phase"], "dir": rec["dir"], "restored": sorted(rec["restored"]),
                       "incarnations": {"ps:1": 2}}
    [e] = r.srv.events.list(kind="ps_recovery_resumed")
    assert (e.node, e.action) == ("ps:1", "resume the recovery")
    assert _logged(logs, "WARNING", "a PS recovery was pending when the controller stopped; resuming it") == {
        "nodes": "ps:1", "phase": rec["phase"], "dir": rec["dir"] or "-",
        "restored": ",".join(sorted(rec["restored"])) or "-"}
    if redone is None:  # after the rollback: nothing restored again, only the pause ended
        assert second.seen == [("resume", {"shards": 2})]
        assert _logged(logs, "INFO", "recovery resumed after its rollback; resuming the shards") == {"nodes": "ps:1"}
    else:
        assert [s for s in second.steps() if s.startswith("restore:")] == redone
        assert second.steps()[0] == "pause" and second.steps()[-2:] == ["rolled_back", "resume"]
    ev = r.event("ps_recovery")
    assert ev["incarnations"] == {"ps:1": 2} and (ev["cut_id"], ev["dir"], ev["step"]) == (r.cut_id, r.ckpt, 1)
    assert ev["rows"] == r.rows_at_cut and ev["requeued"] == 3 and ev["fallback"] is False
    assert ev["healed"] == [] and ev["aborted_cuts"] == []
    assert ev["map_version"] == r.fleet.servers[0].pmap.version
    assert r.srv.recovery.runs == 1
    r.finish()


def test_a_lapsed_pause_restores_every_shard_again(run: Callable[..., Run], dying_threads: None,
                                                   logs: pytest.LogCaptureFixture) -> None:
    """Dead after shard 0's restore, and the recorded pause has lapsed since (writes may have reached
    shard 0): the next controller restores shard 0 again, not only the rest."""
    first = _Steps("restored:0")
    r = run(first)
    r.restart_ps(1, "ps1-second")
    wait_for(first.dead.is_set, 30, "the controller to reach restored:0", 0.02)
    r.srv.recovery.join(30)
    r.srv.stop(grace=0)
    # a write that reached shard 0 once its pause lapsed (straight into its store)
    r.fleet.servers[0].store.push("user", np.array([123456789], dtype=np.int64), np.ones((1, 8), np.float32))
    second = _Steps()
    srv = ControllerServer(small_cfg(), r.state, (TRAIN,), RPC, ps_fleet=GrpcPsFleet(RPC))
    with srv.store.begin(write=True) as txn:  # the pause it recorded ended while no controller ran
        rec = loads(txn.get(RECORD_KEY.encode(), db=srv.store.db("meta")))
        rec["paused_until"] = time.time() - 1.0
        txn.put(RECORD_KEY.encode(), dumps(rec), db=srv.store.db("meta"))
    srv.recovery.fault_hook = second
    srv.start("127.0.0.1:0")
    r.connect(srv)
    r.wait_recovered()
    assert [s for s in second.steps() if s.startswith("restore:")] == ["restore:0", "restore:1"]
    r.assert_recovered()  # shard 0 without the late write
    assert _logged(logs, "WARNING", "the recorded pause may have lapsed; restoring every shard again") == {
        "dir": r.ckpt, "restored": "0"}


def test_a_corrupt_newest_cut_falls_back_to_the_one_before(run: Callable[..., Run], tmp_path: Path,
                                                           logs: pytest.LogCaptureFixture) -> None:
    """The newest committed cut is refused (a flipped byte): the fleet is restored from the one before,
    and the fallback is reported with both cuts and the refusal."""
    r = run()
    newer = r.srv.checkpoints.open_cut()
    newer_dir = str(checkpoint_all(r.fleet.addresses, tmp_path / "ckpt", 2, rpc_cfg=r.fleet.rpc))
    r.srv.checkpoints.commit(newer, 2, newer_dir)
    p = shard_path(Path(newer_dir), 0)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    r.restart_ps(1, "ps1-second")
    r.wait_recovered()
    r.assert_recovered()
    fb = r.event("ps_recovery_fallback")
    rejected = fb.pop("rejected")
    assert fb == {"newest_dir": newer_dir, "newest_cut_id": newer, "dir": r.ckpt, "cut_id": r.cut_id}
    assert [(x["dir"], x["shard"]) for x in rejected] == [(newer_dir, "0")] and "sha256" in rejected[0]["error"]
    [e] = r.srv.events.list(kind="ps_recovery_fallback")
    assert (e.node, e.action) == ("ps:1", "restored an older committed cut: the newer one(s) were refused as corrupt")
    ev = r.event("ps_recovery")
    assert (ev["dir"], ev["cut_id"], ev["fallback"], ev["rows"]) == (r.ckpt, r.cut_id, True, r.rows_at_cut)
    assert _logged(logs, "ERROR", "newest checkpoint refused; the fleet was restored from an older one") == {
        "newest": newer_dir, "dir": r.ckpt, "rejected": 1}


# -- a PS restarting during a recovery ---------------------------------------------------------------
def test_a_ps_restarting_during_a_recovery_makes_it_run_again(run: Callable[..., Run]) -> None:
    """PS 0 restarts (empty) while the recovery for PS 1 runs, after PS 0 was restored: the run in
    progress cannot stand (PS 0 lost what it restored), so the recovery runs once more and restores
    PS 0 too. The request counter in the record is what tells the first run to start over."""
    holder: list[Run] = []

    def ps0_restarts(step: str, detail: dict[str, Any]) -> None:
        if step == "restored" and detail["shard"] == 1 and len(holder) == 1:
            holder.append(holder[0])
            holder[0].restart_ps(0, "ps0-second")  # registers: the record's request counter moves on

    steps = _Steps(on=ps0_restarts)
    r = run(steps)
    holder.append(r)
    r.restart_ps(1, "ps1-second")
    r.wait_recovered(2)
    assert r.kinds().count("ps_recovery") == 2, r.kinds()
    first, second = (e.evidence for e in r.srv.events.list(kind="ps_recovery"))
    assert first["incarnations"] == {"ps:1": 2}
    assert second["incarnations"] == {"ps:0": 2, "ps:1": 2}
    assert second["rows"] == r.rows_at_cut and second["cut_id"] == r.cut_id
    assert [s for s in steps.steps() if s.startswith("restore:")] == ["restore:0", "restore:1"] * 2
    assert r.srv.recovery.runs == 2
    # the rows and the DDS are back at the cut; the second rollback had nothing left to requeue
    assert [served_rows(s) for s in r.fleet.servers] == r.rows_cut
    assert not any(s.awaiting_recovery or s._gate.paused for s in r.fleet.servers)
    assert r.done() == r.done_cut and r.w.status()["coverage"]["replayed_entries"] == 3
    assert r.srv.recovery.record() is None and r.srv.recovery.failed == ""
    r.finish()


def test_a_request_after_the_rollback_restores_again(run: Callable[..., Run], dying_threads: None) -> None:
    """A PS that restarts after a recovery's rollback committed (before its end): the recorded
    rollback does not stand for it; the next controller restores every shard again."""
    first = _Steps("rolled_back")
    r = run(first)
    r.restart_ps(1, "ps1-second")
    wait_for(first.dead.is_set, 30, "the controller to reach rolled_back", 0.02)
    r.srv.recovery.join(30)
    before = r.srv.recovery.record()
    assert before is not None and before["phase"] == "rolled_back"
    r.srv.recovery.note("ps:0", 2)  # PS 0 restarted, recorded before the controller died
    rec = r.srv.recovery.record()
    assert rec is not None and rec["phase"] == "requested" and rec["restored"] == {} and rec["dir"] == ""
    assert rec["gen"] == before["gen"] + 1 and rec["nodes"] == {"ps:1": 2, "ps:0": 2}
    r.srv.stop(grace=0)
    second = _Steps()
    r.connect(_fresh(r.state, second))
    r.wait_recovered()
    assert [s for s in second.steps() if s.startswith("restore:")] == ["restore:0", "restore:1"]
    assert r.event("ps_recovery")["incarnations"] == {"ps:0": 2, "ps:1": 2}
    assert [e.node for e in r.srv.events.list() if e.kind in ("ps_recovery_resumed", "ps_recovery")] == [
        "ps:0,ps:1", "ps:0,ps:1"]
    assert [served_rows(s) for s in r.fleet.servers] == r.rows_cut
    assert r.kinds().count("rollback") == 2, r.srv.events.list()  # the second rollback: nothing trained since the first
    assert r.done() == r.done_cut and r.srv.recovery.record() is None


# -- recoveries that fail the run -------------------------------------------------------------------
def _failed(r: Run, rec: PsRecovery | None = None) -> str:
    rec = rec or r.srv.recovery
    kinds = r.kinds()
    assert "ps_recovery" not in kinds, kinds
    failed = r.event("ps_recovery_failed")
    assert failed["fatal"] is True and failed["incarnations"] == {"ps:1": 2}
    [e] = r.srv.events.list(kind="ps_recovery_failed")
    assert (e.node, e.action) == ("ps:1", "fail the run")
    run_failed = r.event(RUN_FAILED)
    [e] = r.srv.events.list(kind=RUN_FAILED)
    assert (e.node, e.action) == ("controller", "stop")
    reason = run_failed["reason"]
    assert run_failed["source"] == "ps_recovery" and reason == rec.failed
    assert reason.startswith("PS recovery after the restart of ps:1 failed: ") and "\n" not in reason, reason
    assert failed["error"] == reason.split(" failed: ", 1)[1]
    assert rec.record() is None  # removed with the events, in one transaction
    return reason


def test_no_fleet_wired_in_fails_the_run(run: Callable[..., Run]) -> None:
    r = run(ps_fleet=None)
    r.restart_ps(1, "ps1-second")
    r.wait_recovered()
    assert _failed(r).endswith(": no PS fleet is wired into the controller (ControllerServer(ps_fleet=...)): "
                               "the restarted shard cannot be restored")
    assert r.fleet.servers[1].awaiting_recovery


def test_no_committed_cut_fails_the_run_and_aborts_the_pending_one(run: Callable[..., Run],
                                                                   logs: pytest.LogCaptureFixture) -> None:
    r = run(cut=False)
    pending = r.srv.checkpoints.open_cut()
    r.restart_ps(1, "ps1-second")
    r.wait_recovered()
    reason = _failed(r)
    # the count in the reason is the record's after the abort (it said 0 while it read the record before)
    assert "no committed checkpoint cut to restore (1 pending cut(s) aborted)" in reason, reason
    assert "checkpoint_interval_s" in reason
    cuts = {c["cut_id"]: c for c in r.srv.checkpoints.cuts()}
    assert cuts[pending]["state"] == "aborted"
    assert r.done() == r.done_cut + 3  # nothing rolled back
    assert r.fleet.servers[1].awaiting_recovery and not r.fleet.servers[0]._gate.paused
    assert _logged(logs, "ERROR", "ps restarted with no committed checkpoint; the run fails") == {"nodes": "ps:1"}
    assert _logged(logs, "ERROR", "ps recovery failed; the run fails") == {"nodes": "ps:1"}


def test_a_pending_cut_is_aborted_by_a_recovery(run: Callable[..., Run]) -> None:
    """A cut opened before the restart and not committed: aborted (a late CheckpointDone for it is
    ignored), named in the event; the restore uses the committed one."""
    r = run()
    pending = r.srv.checkpoints.open_cut()
    r.restart_ps(1, "ps1-second")
    r.wait_recovered()
    r.assert_recovered()
    assert r.event("ps_recovery")["aborted_cuts"] == [pending]
    cut = {c["cut_id"]: c for c in r.srv.checkpoints.cuts()}[pending]
    assert (cut["state"], cut["reason"]) == ("aborted", "ps restart: fleet restored to an earlier cut")


def test_a_shard_that_stays_unreachable_fails_the_recovery(run: Callable[..., Run]) -> None:
    r = run(ps_fleet=None)
    rec = PsRecovery(r.srv, GrpcPsFleet(RPC), settle_s=0.0, reach_timeout_s=0.5, pause_lease_s=5.0)
    r.fleet.servers[1].stop(0)  # gone, not restarted
    t0 = time.monotonic()
    with pytest.raises(RecoveryError) as err:
        rec.recover({"ps:1": 2})
    assert 0.5 <= time.monotonic() - t0 < 30
    assert str(err.value) == f"PS shard {r.fleet.addresses[1]}: UNAVAILABLE unreachable for 0s; fleet not restored"
    assert rec.record() is not None  # recorded; the loop's fail() removes it
    rec.fail({"ps:1": 2}, err.value)
    assert _failed(r, rec).endswith(" ".join(str(err.value).split()))
    assert not r.fleet.servers[0]._gate.paused and r.done() == r.done_cut + 3


def test_recover_called_directly_records_the_request_first(run: Callable[..., Run]) -> None:
    r = run(ps_fleet=None)
    rec = PsRecovery(r.srv, GrpcPsFleet(RPC), settle_s=0.0, pause_lease_s=30.0)
    out = rec.recover({"ps:1": 2})
    assert out.dir == r.ckpt and out.rows == r.rows_at_cut
    assert [served_rows(s) for s in r.fleet.servers] == r.rows_cut
    assert rec.record() is None and rec.runs == 1
    assert r.event("ps_recovery")["incarnations"] == {"ps:1": 2}


def test_no_committed_cut_is_its_own_error(run: Callable[..., Run]) -> None:
    r = run(cut=False, ps_fleet=None)
    rec = PsRecovery(r.srv, GrpcPsFleet(RPC), settle_s=0.0)
    with pytest.raises(NoCommittedCut, match=r"^no committed checkpoint cut to restore \(0 pending cut\(s\) aborted\)"):
        rec.recover({"ps:1": 2})
    assert not any(s._gate.paused for s in r.fleet.servers)
