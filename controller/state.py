"""The controller's LMDB state directory and its event log.

One LMDB environment holds everything the controller must not forget: DDS
shard records and dataset cursors (``controller.dds``), the completion ledger
(``controller.ledger``), decisions and incidents (:class:`EventLog`),
registered nodes and checkpoint cuts. A restart opens the same directory and
carries on.

Example::

    store = StateStore("/tmp/ctl")
    events = EventLog(store)
    events.record(Event.now("worker:3", "slow", {"ratio": 3.1}, "shrink_shards"))
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import lmdb

from common.errors import MetapsError
from common.log import kv

log = logging.getLogger(__name__)

DB_NAMES = (b"meta", b"shards", b"ledger", b"events", b"nodes", b"cuts")


def seq_key(seq: int) -> bytes:
    """Big-endian 8-byte key so LMDB's byte order is numeric order."""
    return struct.pack(">Q", seq)


def key_seq(key: bytes | memoryview) -> int:
    return struct.unpack(">Q", key)[0]


_PROBE = r"""
import json, os, shutil, sys
import lmdb
names = sys.argv[2].split(",")
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=len(names) + 2)
try:
    with env.begin() as txn:
        for name in names:
            db = env.open_db(name.encode(), txn=txn, create=False)
            for k, v in txn.cursor(db):
                json.loads(bytes(v))
    env.close()
    # writes read what reads never do (the free-page list): write to a copy of the file
    shutil.copyfile(os.path.join(sys.argv[1], "data.mdb"), os.path.join(sys.argv[3], "data.mdb"))
    env = lmdb.open(sys.argv[3], lock=False, max_dbs=len(names) + 2, sync=False, metasync=False,
                    map_size=max(1 << 32, 2 * os.path.getsize(os.path.join(sys.argv[3], "data.mdb"))))
    for _ in range(3):
        with env.begin(write=True) as txn:
            for name in names:
                db = env.open_db(name.encode(), txn=txn, create=False)
                txn.put(b"\xff-state-probe", b"{}" * 2048, db=db)
        with env.begin(write=True) as txn:
            for name in names:
                txn.delete(b"\xff-state-probe", db=env.open_db(name.encode(), txn=txn, create=False))
except Exception as exc:
    print(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
    sys.exit(3)
"""


def probe_state(path: Path, timeout_s: float = 120.0) -> None:
    """Read an existing state directory back in a child process (a damaged LMDB page can end
    the reading process with SIGBUS/SIGSEGV, which no ``except`` catches).

    Raises:
        StateCorrupt: the child could not read every record (names the file and why).
    """
    import signal
    import subprocess
    import sys
    import tempfile

    data = path / "data.mdb"
    names = ",".join(n.decode() for n in DB_NAMES)
    try:
        with tempfile.TemporaryDirectory(prefix="state-probe-") as tmp:
            r = subprocess.run([sys.executable, "-c", _PROBE, str(path), names, tmp], capture_output=True,
                               text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise StateCorrupt(f"controller state {data}: reading it back took over {timeout_s:.0f}s; restore the "
                           f"state directory from a backup or start the run on a new one") from None
    if r.returncode == 0:
        return
    if r.returncode < 0:
        why = f"reading it back killed the checking process with {signal.Signals(-r.returncode).name}"
    else:
        why = r.stdout.strip() or (r.stderr.strip().splitlines() or ["unreadable"])[-1]
    raise StateCorrupt(f"controller state {data}: unreadable ({why}); restore the state directory from a "
                       f"backup or start the run on a new one")


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def loads(raw: bytes | memoryview) -> Any:
    return json.loads(bytes(raw))


class StateCorrupt(MetapsError):
    """The controller's LMDB state file cannot be read back; the controller refuses to start.

    The message names the file and the first unreadable record (one line).
    """

    code = "data_loss"


class StateLocked(MetapsError):
    """Another controller holds this state directory: one controller per state directory.

    The message names the directory and the holder (pid, host, since when), in one line.
    """

    code = "failed_precondition"


class StateDirLock:
    """The exclusive lock a serving controller holds on its state directory.

    An ``flock`` on ``DIR/controller.lock`` (released by the kernel when the holder's process
    ends, whatever the way), with the holder's pid, host and start time written into the file
    for the refusal message. A second controller on the same directory (by mistake, or a
    replacement started before the old one is gone) is refused before it opens the LMDB state,
    so it cannot open checkpoint cuts or requeue shards in a live run's state. Readers (the run
    report, ``--resume`` planning) open the state without it.

    Args:
        path: the state directory (created if missing).

    Raises:
        StateLocked: another process (or another open lock in this one) holds it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path) / "controller.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
            except (ValueError, UnicodeDecodeError):
                holder = {}
            os.close(fd)
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(holder["since"])) if "since" in holder else "?"
            raise StateLocked(
                f"controller state {self.path.parent} is in use by another controller (pid {holder.get('pid', '?')} "
                f"on {holder.get('host', '?')} since {since}): one controller per state directory; stop that one "
                f"first, or give this one another state directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Let another controller have the directory (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


class StateStore:
    """An LMDB environment with the controller's named databases.

    Opening it reads every record of every database back once (LMDB keeps no
    checksums: a damaged page or value shows only when read): a state file that
    cannot be read is refused here with :class:`StateCorrupt` naming the file,
    instead of a controller that serves and fails every call (``UNKNOWN``).

    Args:
        path: directory (created if missing).
        fsync: fsync every commit (see ``ControllerConfig.fsync``).
        map_size: LMDB map size (sparse; only used pages take disk).

    Raises:
        StateCorrupt: the state file is not a readable controller state.
    """

    def __init__(self, path: str | Path, fsync: bool = False, map_size: int = 1 << 32) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        data = self.path / "data.mdb"
        if data.exists() and data.stat().st_size > 0:
            probe_state(self.path)  # a damaged page can kill the reader (SIGBUS): read it in a child first
        try:
            self.env = lmdb.open(
                str(self.path), map_size=map_size, max_dbs=len(DB_NAMES) + 2,
                sync=fsync, metasync=fsync, lock=True,
            )
        except lmdb.Error as exc:
            raise StateCorrupt(f"controller state {data}: cannot be opened as LMDB ({_one_line(exc)}); "
                               f"restore the state directory from a backup or start the run on a new one") from None
        try:
            self.dbs = {name.decode(): self.env.open_db(name) for name in DB_NAMES}
            self.verify()
        except StateCorrupt:
            self.env.close()
            raise
        except (lmdb.Error, ValueError, UnicodeDecodeError) as exc:
            self.env.close()
            raise StateCorrupt(f"controller state {data}: unreadable ({_one_line(exc)}); restore the state "
                               f"directory from a backup or start the run on a new one") from None

    def verify(self) -> int:
        """Read every record of every database back (keys in order, values as JSON); returns how many.

        Raises:
            StateCorrupt: a record is unreadable or out of order (names the file, database and key).
        """
        data = self.path / "data.mdb"
        n = 0
        with self.begin() as txn:
            for name, db in self.dbs.items():
                prev = b""
                for k, v in txn.cursor(db):
                    key = bytes(k)
                    if key < prev:
                        raise StateCorrupt(f"controller state {data}: database {name!r} keys out of order at "
                                           f"{key[:40]!r}; restore the state directory from a backup or start "
                                           f"the run on a new one")
                    prev = key
                    try:
                        loads(v)
                    except (ValueError, UnicodeDecodeError) as exc:
                        raise StateCorrupt(f"controller state {data}: database {name!r} key {key[:40]!r} holds "
                                           f"no JSON record ({_one_line(exc)}); restore the state directory from "
                                           f"a backup or start the run on a new one") from None
                    n += 1
        return n

    def db(self, name: str) -> Any:
        return self.dbs[name]

    def begin(self, write: bool = False) -> lmdb.Transaction:
        return self.env.begin(write=write)

    def next_seq(self, txn: lmdb.Transaction, db: str) -> int:
        """One past the largest sequence key of ``db`` (0 when empty)."""
        cur = txn.cursor(self.dbs[db])
        return key_seq(cur.key()) + 1 if cur.last() else 0

    def get_json(self, db: str, key: str, default: Any = None) -> Any:
        with self.begin() as txn:
            raw = txn.get(key.encode(), db=self.dbs[db])
        return default if raw is None else loads(raw)

    def put_json(self, db: str, key: str, value: Any) -> None:
        with self.begin(write=True) as txn:
            txn.put(key.encode(), dumps(value), db=self.dbs[db])

    def items(self, db: str, prefix: bytes = b"") -> Iterator[tuple[bytes, Any]]:
        """Decoded ``(key, value)`` pairs of ``db`` whose key starts with ``prefix``."""
        with self.begin() as txn:
            cur = txn.cursor(self.dbs[db])
            if not cur.set_range(prefix):
                return
            for k, v in cur:
                key = bytes(k)
                if not key.startswith(prefix):
                    break
                yield key, loads(v)

    def close(self) -> None:
        self.env.close()


@dataclass(frozen=True)
class Event:
    """One decision or incident, for the run report.

    Args:
        time: unix seconds.
        node: ``role:index`` (``worker:3``, ``ps:1``) or ``dataset:<name>`` or ``controller``.
        kind: what happened (``slow``, ``restart``, ``move_vshards``, ``shard_failing``...).
        evidence: the figures behind the decision.
        action: what the controller did about it ('' for observations).
    """

    time: float
    node: str
    kind: str
    evidence: dict[str, Any] = field(default_factory=dict)
    action: str = ""
    seq: int = -1

    @staticmethod
    def now(node: str, kind: str, evidence: dict[str, Any] | None = None, action: str = "") -> "Event":
        return Event(time.time(), node, kind, dict(evidence or {}), action)


class EventLog:
    """Append-only, LMDB-backed list of :class:`Event`.

    Example::

        log = EventLog(store); log.record(Event.now("ps:1", "slow", {"latency": 0.4}))
        [e.kind for e in log.list()]
    """

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._lock = threading.Lock()

    def record(self, event: Event, txn: lmdb.Transaction | None = None) -> Event:
        """Store ``event`` (inside ``txn`` when given, so it commits with a transition)."""
        with self._lock:
            if txn is None:
                with self._store.begin(write=True) as own:
                    return self._put(own, event)
            return self._put(txn, event)

    def _put(self, txn: lmdb.Transaction, event: Event) -> Event:
        seq = self._store.next_seq(txn, "events")
        stored = Event(event.time, event.node, event.kind, event.evidence, event.action, seq)
        body = asdict(stored)
        txn.put(seq_key(seq), dumps(body), db=self._store.db("events"))
        level = logging.ERROR if event.kind in ("shard_failing", "gave_up") else logging.INFO
        log.log(level, "event", extra=kv(node=event.node, kind=event.kind, action=event.action or "-",
                                          evidence=json.dumps(event.evidence, sort_keys=True)))
        return stored

    def list(self, since: int = 0, kind: str | None = None) -> list[Event]:
        """Events with ``seq >= since``, oldest first, optionally of one kind."""
        out = []
        for _, body in self._store.items("events", b""):
            if body["seq"] >= since and (kind is None or body["kind"] == kind):
                out.append(Event(**body))
        return out
