"""Metrics of one PS shard: Prometheus counters/histograms, store gauges, load totals.

:class:`PsMetrics` lives in its own registry (several shards per test process);
:class:`StoreCollector` reads table fill, admissions, evictions and memory from the
store at scrape time; :class:`LoadTotals` keeps cheap running totals that the
controller link reports as the shard's load.

Per-table data-plane metrics (issue 14): ``metaps_ps_table_requests`` (requests
that touched a table, by method) and ``metaps_ps_table_rpc_seconds`` (their
handling time, by table and method), beside the per-method ``metaps_ps_rpc_seconds``.

Staleness (issue 14), read from the shard's :class:`ps.staleness.StepClock` at scrape time
(:class:`ClockCollector`): ``metaps_ps_worker_clock{shard,worker}`` (each registered worker's
clock: steps completed, half-steps in sync mode), ``metaps_ps_worker_clock_lag{shard,worker}``
(how far it is behind the fastest clock) and ``metaps_ps_max_staleness{shard}`` (the bound;
-1 unbounded). A worker whose lag reaches the bound holds the faster ones back.

Example::

    metrics = PsMetrics(lambda: store, shard_id=0, registry=None)
    idx = metrics.tables.index(("user", "item"))
    metrics.tables.rows("pulled", idx, np.array([16384, 512]))
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ps.types import RowStore


class StoreCollector:
    """Table fill, admissions, evictions and memory read from the store at scrape time.

    Args:
        store: returns the shard's current store (a restore swaps it).
        shard_id: the shard label.
    """

    def __init__(self, store: Callable[[], RowStore], shard_id: int) -> None:
        self._store = store
        self._shard = str(shard_id)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        shard = self._shard
        store = self._store()
        stats = store.stats()
        fams: dict[str, GaugeMetricFamily] = {}
        for table, st in (stats.get("tables", stats) or {}).items():
            if not isinstance(st, dict):
                continue
            for key, value in st.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    name = f"metaps_ps_table_{key}"
                    if name not in fams:
                        fams[name] = GaugeMetricFamily(name, f"PS table {key} (from ShardStore.stats)", labels=["shard", "table"])
                    fams[name].add_metric([shard, table], float(value))
        mem = GaugeMetricFamily("metaps_ps_memory_bytes", "bytes held by the shard store", labels=["shard"])
        mem.add_metric([shard], float(store.memory_bytes()))
        yield from fams.values()
        yield mem


class ClockCollector:
    """Worker clocks and their lag behind the fastest clock, read from the shard's clock at scrape time.

    Args:
        clock: returns the shard's :class:`ps.staleness.StepClock` (anything with ``lags()`` and
            ``max_staleness``).
        shard_id: the shard label.
    """

    def __init__(self, clock: Callable[[], Any], shard_id: int) -> None:
        self._clock = clock
        self._shard = str(shard_id)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        clock = self._clock()
        fam = GaugeMetricFamily("metaps_ps_worker_clock", "each registered worker's step clock on this shard "
                                "(steps completed; half-steps in sync mode)", labels=["shard", "worker"])
        lag = GaugeMetricFamily("metaps_ps_worker_clock_lag", "how far a worker's clock is behind the fastest "
                                "registered worker's on this shard", labels=["shard", "worker"])
        bound = GaugeMetricFamily("metaps_ps_max_staleness", "the staleness bound of this shard's clock "
                                  "(steps a worker may run ahead of the slowest; -1 unbounded)", labels=["shard"])
        for worker, (c, behind) in sorted(clock.lags().items()):
            fam.add_metric([self._shard, worker], float(c))
            lag.add_metric([self._shard, worker], float(behind))
        bound.add_metric([self._shard], float(clock.max_staleness))
        yield fam
        yield lag
        yield bound


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
"""Upper bounds (seconds) of the RPC latency histograms (``+Inf`` implied)."""


class TableCounters:
    """The per-table data-plane metrics, counted in arrays and exported at scrape time.

    A data request touches every table of a step (dozens): one Prometheus child ``inc`` /
    ``observe`` per table and metric cost ~0.3 ms per request. Here a request adds into
    numpy arrays indexed by table (one lock, a few vectorized adds) and :meth:`collect`
    turns them into the same series a ``Counter`` / ``Histogram`` would export:
    ``metaps_ps_rows_pulled_total`` / ``metaps_ps_rows_pushed_total`` {shard, table},
    ``metaps_ps_table_requests_total`` {shard, table, method} and the histogram
    ``metaps_ps_table_rpc_seconds`` {shard, table, method}.

    Args:
        shard_id: the shard label.
    """

    def __init__(self, shard_id: int) -> None:
        self._shard = str(shard_id)
        self._lock = threading.Lock()
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._by_tuple: dict[tuple[str, ...], np.ndarray] = {}
        """Row numbers per table tuple already seen (read-only arrays; rows never move)."""
        self._rows: dict[str, np.ndarray] = {"pulled": np.zeros(0, np.int64), "pushed": np.zeros(0, np.int64)}
        self._hist: dict[str, np.ndarray] = {}  # method -> int64 [tables, buckets + 1] (non-cumulative)
        self._sums: dict[str, np.ndarray] = {}  # method -> float64 [tables]
        self._bounds = np.asarray(LATENCY_BUCKETS, dtype=np.float64)

    def index(self, tables: tuple[str, ...]) -> np.ndarray:
        """Row numbers of ``tables`` (new names get rows): what :meth:`rows` and :meth:`observe` take."""
        got = self._by_tuple.get(tables)  # a request's table tuple repeats every step: one dict hit
        if got is not None:
            return got
        idx = self._index
        if all(t in idx for t in tables):
            got = np.fromiter((idx[t] for t in tables), dtype=np.int64, count=len(tables))
            got.setflags(write=False)
            if len(self._by_tuple) < 4096:  # bounded: clients choose the tuples
                self._by_tuple[tables] = got
            return got
        with self._lock:
            for t in tables:
                if t not in idx:
                    idx[t] = len(self._names)
                    self._names.append(t)
            n = len(self._names)
            for k, a in self._rows.items():
                self._rows[k] = np.concatenate([a, np.zeros(n - a.size, np.int64)])
            for m, h in self._hist.items():
                self._hist[m] = np.concatenate([h, np.zeros((n - h.shape[0], h.shape[1]), np.int64)])
                self._sums[m] = np.concatenate([self._sums[m], np.zeros(n - self._sums[m].size)])
        return np.fromiter((idx[t] for t in tables), dtype=np.int64, count=len(tables))

    def rows(self, kind: str, tables: np.ndarray, counts: np.ndarray) -> None:
        """Add ``counts`` rows ``kind`` ("pulled" / "pushed") to ``tables`` (rows of :meth:`index`)."""
        with self._lock:
            np.add.at(self._rows[kind], tables, counts)  # (a table named twice counts twice)

    def observe(self, method: str, tables: np.ndarray, seconds: float) -> None:
        """One request of ``method`` that touched ``tables`` (rows of :meth:`index`) took ``seconds``."""
        if not tables.size:
            return
        b = int(np.searchsorted(self._bounds, seconds, side="left"))  # le semantics: first bound >= seconds
        with self._lock:
            h = self._hist.get(method)
            if h is None:  # a method's first request (index() grows the arrays of known methods)
                h = self._hist[method] = np.zeros((len(self._names), self._bounds.size + 1), np.int64)
                self._sums[method] = np.zeros(len(self._names))
            np.add.at(h[:, b], tables, 1)
            np.add.at(self._sums[method], tables, seconds)

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        with self._lock:
            names = list(self._names)
            rows = {k: v.copy() for k, v in self._rows.items()}
            hist = {m: h.copy() for m, h in self._hist.items()}
            sums = {m: v.copy() for m, v in self._sums.items()}
        for kind in ("pulled", "pushed"):
            fam = CounterMetricFamily(f"metaps_ps_rows_{kind}", f"rows {kind}", labels=["shard", "table"])
            for i, t in enumerate(names):
                if rows[kind][i]:
                    fam.add_metric([self._shard, t], float(rows[kind][i]))
            yield fam
        req = CounterMetricFamily("metaps_ps_table_requests", "data requests that touched a table",
                                  labels=["shard", "table", "method"])
        lat = HistogramMetricFamily("metaps_ps_table_rpc_seconds", "handling time of data requests that touched a table",
                                    labels=["shard", "table", "method"])
        edges = [str(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]
        for m, h in hist.items():
            for i, t in enumerate(names[: h.shape[0]]):
                n = int(h[i].sum())
                if not n:
                    continue
                req.add_metric([self._shard, t, m], float(n))
                cum = np.cumsum(h[i])
                lat.add_metric([self._shard, t, m], [(e, float(c)) for e, c in zip(edges, cum)], float(sums[m][i]))
        yield req
        yield lat


class PsMetrics:
    """Prometheus metrics of one shard, in its own registry (several shards per test process).

    Args:
        store: returns the shard's current store (read at scrape time).
        shard_id: the shard label.
        registry: where to register (None: a private registry).
    """

    def __init__(self, store: Callable[[], RowStore], shard_id: int, registry: CollectorRegistry | None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.tables = TableCounters(shard_id)
        """Per-table rows, requests and latency (vectorized; exported by its own collector)."""
        r.register(self.tables)
        self.nonfinite = Counter(
            "metaps_ps_nonfinite_grads", "pushed rows with NaN/Inf gradients", ["shard", "table", "action"], registry=r
        )
        self.errors = Counter("metaps_ps_rpc_errors", "refused or failed RPCs", ["shard", "method", "code"], registry=r)
        self.wait_answers = Counter(
            "metaps_ps_wait_answers", "'ask again' answers (stale_wait, paused): the client waits", ["shard", "method", "reason"],
            registry=r,
        )
        self.latency = Histogram(
            "metaps_ps_rpc_seconds",
            "RPC handling time",
            ["shard", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.map_version = Gauge("metaps_ps_map_version", "partition map version", ["shard"], registry=r)
        self.clocks_expired = Gauge(
            "metaps_ps_clocks_expired", "worker step clocks whose lease ran out (clock_lease_s)", ["shard"], registry=r
        )
        r.register(StoreCollector(store, shard_id))
        self._shard_id = shard_id
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the same child prometheus hands back (no label
        series is ever removed here), without its per-call validation and lock (the data
        plane asks for 3-4 per request).

        Args:
            metric: one of this object's labelled metrics.
            labels: its label values, in order.
        """
        key = (id(metric), labels)
        got = self._children.get(key)
        if got is None:
            got = self._children.setdefault(key, metric.labels(*labels))
        return got

    def watch_clock(self, clock: Callable[[], Any]) -> None:
        """Export the worker clocks of ``clock()`` (the shard's StepClock): :class:`ClockCollector`."""
        self.registry.register(ClockCollector(clock, self._shard_id))


class LoadTotals:
    """Running totals of data-RPC handling time and in-flight depth (cheap: one lock, no histogram).

    The controller link (``metaps.roles.ps_link``) reads them periodically and reports the
    deltas as the shard's mean request latency and mean queue depth (requests in flight
    seen by each arriving request, itself included). Time a request spent waiting for a
    pause, a migration freeze drain or slower workers (staleness) is left out: that is
    not this shard being slow. Fault delays are in.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.latency_s = 0.0
        self.depth = 0
        self.inflight = 0

    def enter(self) -> None:
        with self._lock:
            self.inflight += 1
            self.depth += self.inflight

    def leave(self, seconds: float, count: bool = True) -> None:
        """A request finished; ``count=False`` for "ask again" answers (not load)."""
        with self._lock:
            self.inflight -= 1
            if count:
                self.count += 1
                self.latency_s += seconds

    def read(self) -> tuple[int, float, int]:
        """(requests finished, their summed seconds, summed depth at arrival) since start."""
        with self._lock:
            return self.count, self.latency_s, self.depth
