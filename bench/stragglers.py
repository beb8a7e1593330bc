"""Straggler benchmark: real-process figures (E1, E2, E5) and controller simulations.

Real processes (ratios measured side by side in the same run):

    E1  4 `metaps worker` processes + 1 `metaps ps`, worker 3 slowed 4x (fault injector):
        the controller's dynamic sharding (default monitor windows) vs a static equal split
    E2  2 `metaps ps` processes, PS 1 +20 ms per request (fault injection), 2 client threads
        pulling/pushing 256 random ids per step; recovery = fault-on / fault-off windows
        interleaved (ABBA) on the migrated layout, median of the paired ratios (like for like,
        load drift cancels), for [controller.nd] keep = 1 (default) and 0; per window, the
        requests reaching each PS and each process's CPU (/proc), and the paired ratios per
        CPU-second beside the wall ones, with a bootstrap interval and a sign test
    E5  2 all-reduce `metaps worker` processes (gloo) + 1 PS, worker 1 slowed 2x:
        DD plans from the controller vs the same DD loop with equal batches (two runs), and
        E5i: both arms in ONE run, the DD plan and the equal split alternating every 10 s
        (x global batch / 1024; ``--e5-global-batch``, on 65536-row epochs)
        (ABAB windows, median of adjacent-pair ratios; drift between runs cannot bias it)

Simulations (threads that sleep ``base_s * slowdown`` per batch against a real controller;
they test the controller's logic, not the system; reported as e1_sim_* / e5_sim_*):

    E1 sim  4 workers, one 4x slower: dynamic sharding vs a static equal split, and vs ideal
    E3  transient slowdowns only: actions taken (must be 0)
    E4  a worker killed mid-shard: coverage, duplicated shards per kill, time vs no kill
    E5 sim  all-reduce, one worker 2x slower: DD speed-proportional batches vs equal batches
    E6  no stragglers: dynamic sharding overhead vs a static split (ABBA pairs), with the
        controller in the bench's process and in its own (e6_proc, as in production), one
        RPC per shard (the report rides on the next lease) and two (e6_*two_rpc, the old
        protocol); plus the DDS engine alone per shard, one LMDB transaction vs two

Run: ``python -m bench.stragglers [--quick]``; the last line is a JSON object.
``--smoke``: the simulations only (no real processes but E6's controller), 16 batches per file, one pair: seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.procstat import stat_cpu_s
from controller.client import ControllerClient, DoneReport, Pending
from controller.config import ControllerConfig, DdConfig, DdsConfig, MonitorConfig, NdConfig, PolicyKind
from controller.dds import DatasetKind, DatasetSpec
from controller.types import ReportResult
from controller.server import ControllerServer
from common.faults import Fault, FaultConfig, FaultInjector
from common.rpc import RpcConfig

RPC = RpcConfig(token="bench")
BASE_S = 0.010      # one batch at normal speed
BPS = 16            # batches per shard
WORKERS = 4
BATCHES = 160       # batches per file of the simulations (--smoke: SMOKE_BATCHES)
SMOKE_BATCHES = 16


def say(msg: str) -> None:
    print(msg, flush=True)


def controller(tmp: str, policy: PolicyKind = PolicyKind.ND, files: int = 8, batches: int = BATCHES,
               consecutive: int = 2, dd: DdConfig | None = None, window_s: float = 0.25) -> ControllerServer:
    cfg = ControllerConfig(
        tick_s=0.05, policy=policy, heartbeat_timeout_s=30.0,
        dds=DdsConfig(batches_per_shard=BPS, lease_s=30.0, slow_shrink=4),
        monitor=MonitorConfig(window_s=window_s, consecutive=consecutive),
        nd=NdConfig(restart_after=0, move_vshards=0), dd=dd or DdConfig())
    srv = ControllerServer(cfg, tmp, [DatasetSpec("train", (batches,) * files, DatasetKind.TRAIN, 1)], RPC)
    srv.start("127.0.0.1:0")
    return srv


def run_dynamic(slow: Callable[[int, float], float], seed: int, kill: tuple[int, float] | None = None,
                consecutive: int = 2, files: int = 8, batches: int = BATCHES) -> dict[str, Any]:
    """All workers pull shards until DONE. ``slow(worker, t)`` is the slowdown factor."""
    with tempfile.TemporaryDirectory() as tmp:
        srv = controller(tmp, consecutive=consecutive, files=files, batches=batches)
        rng = random.Random(seed)
        jitter = [[1 + rng.uniform(-0.05, 0.05) for _ in range(4096)] for _ in range(WORKERS)]
        processed = [0] * WORKERS
        busy = [0.0] * WORKERS
        t0 = time.monotonic()
        ends = [0.0] * WORKERS

        def work(i: int) -> None:
            c = ControllerClient(srv.address, RPC, index=i)
            c.register()
            k = 0
            nxt = c.get_shard_async("train")
            report = None
            while True:
                got = nxt.result()
                if got.status.value == "done":
                    break
                if got.status.value == "wait":
                    time.sleep(0.005)
                    nxt = c.get_shard_async("train")
                    continue
                lease = got.lease
                nxt = None
                start = time.monotonic()
                for b in range(lease.batches):  # per-batch progress so a kill lands mid-shard
                    if kill and kill[0] == i and time.monotonic() - t0 >= kill[1]:
                        c.node_down("worker", i, "bench kill", 137)  # what the agent does at once
                        ends[i] = time.monotonic() - t0
                        return
                    if b == lease.batches - 1:  # prefetch during the last batch: RPC off the critical path
                        nxt = c.get_shard_async("train")
                    k += 1
                    time.sleep(BASE_S * slow(i, time.monotonic() - t0) * jitter[i][k % 4096])
                    processed[i] += 1
                took = time.monotonic() - start
                busy[i] += took
                if report is not None:
                    assert report.result().kind == "done"
                report = c.report_shard_async(lease, "done", samples=lease.batches, elapsed_s=took)
                c.report_metrics(batch_times_s=[took / lease.batches], samples_per_s=lease.batches / took, wait=False)
                if nxt is None:
                    nxt = c.get_shard_async("train")
            if report is not None:
                assert report.result().kind == "done"
            ends[i] = time.monotonic() - t0
            c.close()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        st = srv.status()
        srv.stop(grace=0)
    actions = [e for e in st["events"] if e["kind"] in ("shrink_shards", "restart", "move_vshards")]
    total = files * batches
    speeds = [p / b for p, b in zip(processed, busy) if b > 0]  # measured batches/s while busy
    return {"time": elapsed, "coverage": st["coverage"], "processed": sum(processed), "total": total,
            "ideal": total / sum(speeds),
            "actions": len(actions), "events": st["events"]}


def run_static(slow: Callable[[int, float], float], seed: int, files: int = 8, batches: int = BATCHES) -> float:
    """Each worker trains a fixed equal quarter (no controller): time = the slowest."""
    rng = random.Random(seed)
    jitter = [[1 + rng.uniform(-0.05, 0.05) for _ in range(4096)] for _ in range(WORKERS)]
    share = files * batches // WORKERS
    t0 = time.monotonic()

    def work(i: int) -> None:
        for k in range(1, share + 1):
            time.sleep(BASE_S * slow(i, time.monotonic() - t0) * jitter[i][k % 4096])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def e1(seed: int, batches: int = BATCHES) -> dict[str, float]:
    slow = lambda i, t: 4.0 if i == WORKERS - 1 else 1.0  # noqa: E731
    dyn = run_dynamic(slow, seed, batches=batches)
    assert dyn["coverage"]["complete"], dyn["coverage"]
    static = run_static(slow, seed, batches=batches)
    # ideal = work / sum of the speeds the workers really ran at (sleep overshoot included,
    # so the ratio charges dynamic sharding only for its own costs: RPCs, detection lag, tail)
    ideal = dyn["ideal"]
    return {"dynamic_s": dyn["time"], "static_s": static, "ideal_s": ideal,
            "vs_static": static / dyn["time"], "vs_ideal": dyn["time"] / ideal}


def e3(seed: int, batches: int = BATCHES) -> dict[str, float]:
    rng = random.Random(seed)
    faults = []
    for i in range(WORKERS):  # 0.2 s blips at 3x, well apart: never 3 slow windows in a row
        for start in (0.4 + rng.uniform(0, 0.3), 1.6 + rng.uniform(0, 0.3)):
            faults.append(Fault("worker", i, "slow", factor=3.0, start_s=start + 0.1 * i, duration_s=0.2))
    cfg = FaultConfig(faults)
    injectors = [FaultInjector(cfg, "worker", i, t0=0.0, clock=time.monotonic) for i in range(WORKERS)]
    t_start = time.monotonic()
    slow = lambda i, t: injectors[i].slowdown(t_start + t)  # noqa: E731
    dyn = run_dynamic(slow, seed, consecutive=3, files=4, batches=batches)
    return {"actions": dyn["actions"], "time": dyn["time"]}


def e4(seed: int, batches: int = BATCHES) -> dict[str, float]:
    slow = lambda i, t: 1.0  # noqa: E731
    base = run_dynamic(slow, seed, files=4, batches=batches)
    dyn = run_dynamic(slow, seed, kill=(1, 0.8 + 0.1 * seed), files=4, batches=batches)
    cov = dyn["coverage"]
    replayed_batches = dyn["processed"] - dyn["total"] + cov["duplicate_batches"]
    return {"complete": float(cov["complete"]), "dup_shards_per_kill": replayed_batches / BPS,
            "ledger_duplicates": cov["duplicate_entries"] + cov["stale_entries"],
            "time_ratio_vs_no_kill": dyn["time"] / base["time"]}


def e6(seed: int, own_process: bool = False, combined: bool = True, pairs: int = 2,
       batches: int = BATCHES) -> dict[str, Any]:
    """E6: no stragglers, dynamic sharding vs a static split, paired ABBA within the seed.

    Order per pair: dynamic, static, static, dynamic; overhead = sum(dynamic) / sum(static) - 1
    over ``pairs`` such quadruples, so a linear drift of the shared box's load cancels.
    ``own_process``: the controller runs as its own process (as in production) instead of
    in the bench's process (sharing its GIL with the simulated workers); ``combined``: each
    shard's done report rides on the next lease request (GetShard.done, one RPC per shard)
    instead of its own ReportShard. ``rpc_critical_fraction`` is the profile's share: the
    workers' time blocked on or issuing RPCs plus between shards, over the static time (it
    leaves out the sleep overshoot that load adds to every batch, the noise in ``overhead``).
    ``batches``: per file (8 files).
    """
    dyn: list[dict[str, Any]] = []
    static: list[float] = []
    for _ in range(pairs):
        dyn.append(run_e6_dynamic(seed, own_process, combined, batches))
        static += [run_static(lambda i, t: 1.0, seed, files=8, batches=batches) for _ in range(2)]
        dyn.append(run_e6_dynamic(seed, own_process, combined, batches))

    def mean(key: str) -> float:
        return statistics.fmean(d[key] for d in dyn)

    d_s, s_s = mean("time"), statistics.fmean(static)
    per_worker_shards = 8 * batches / BPS / WORKERS
    critical_ms = (mean("rpc_wait_ms_per_shard") + mean("issue_ms_per_shard") + mean("other_ms_per_shard"))
    return {"dynamic_s": d_s, "static_s": s_s, "overhead": d_s / s_s - 1.0,
            "rpc_critical_fraction": critical_ms * per_worker_shards / 1000 / s_s,
            "rpc_wait_ms_per_shard": mean("rpc_wait_ms_per_shard"), "issue_ms_per_shard": mean("issue_ms_per_shard"),
            "other_ms_per_shard": mean("other_ms_per_shard"), "tail_ms": mean("tail_ms"),
            "rpcs_per_shard": mean("rpcs_per_shard"),
            # mean time of one 10 ms batch while a shard runs, vs the static split's (no RPCs at all)
            "batch_ms": mean("batch_ms"), "static_batch_ms": 1000 * s_s / (8 * batches / WORKERS)}


def e6_dds_cpu(shards: int = 2000, reps: int = 3, fsync_shards: int = 300) -> dict[str, float]:
    """The DDS engine alone (no gRPC), report + get_shard (two LMDB transactions) vs
    report_and_get (one), one worker, shards of BPS batches, alternating ``reps`` times
    (ABAB), medians: CPU ms per shard with ``fsync = false`` (the default) and wall ms
    per shard with ``fsync = true`` (each commit waits for the disk)."""
    from controller.dds import DynamicDataSharding
    from controller.state import StateStore

    out: dict[str, list[float]] = {}
    for _ in range(reps):
        for fsync, n in ((False, shards), (True, fsync_shards)):
            for name in ("two_txn", "one_txn"):
                with tempfile.TemporaryDirectory() as tmp:
                    dds = DynamicDataSharding(StateStore(tmp, fsync=fsync),
                                              DdsConfig(batches_per_shard=BPS, lease_s=30.0),
                                              [DatasetSpec("train", (BPS * n,), DatasetKind.TRAIN, 1)])
                    lease = dds.get_shard(0, "train").lease
                    c0, w0 = time.process_time(), time.perf_counter()
                    while lease is not None:
                        if name == "two_txn":
                            dds.report(0, lease.shard_id, lease.attempt, "done", samples=BPS, elapsed_s=0.16)
                            lease = dds.get_shard(0, "train").lease
                        else:
                            lease = dds.report_and_get(0, "train", lease.shard_id, lease.attempt, "done",
                                                       samples=BPS, elapsed_s=0.16)[1].lease
                    key = f"dds_fsync_wall_ms_per_shard_{name}" if fsync else f"dds_cpu_ms_per_shard_{name}"
                    took = (time.perf_counter() - w0) if fsync else (time.process_time() - c0)
                    out.setdefault(key, []).append(1000 * took / n)
                    assert dds.coverage().complete
    return {k: statistics.median(v) for k, v in out.items()}


def _controller_process(tmp: str, batches: int = BATCHES) -> tuple[subprocess.Popen[str], str]:
    """The E6 controller as its own process (same config as :func:`controller`)."""
    p = subprocess.Popen([sys.executable, "-m", "bench.stragglers", "--serve-controller", tmp,
                          "--serve-batches", str(batches)],
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.stdout is not None
    line = p.stdout.readline().split()
    if len(line) != 2 or line[0] != "ready":
        p.kill()
        raise RuntimeError(f"E6 controller process did not start (said {line!r}, exit {p.poll()})")
    return p, line[1]


def _serve_controller(tmp: str, batches: int = BATCHES) -> int:
    srv = controller(tmp, files=8, batches=batches)
    print("ready", srv.address, flush=True)
    srv.wait()
    srv.stop(grace=0)
    return 0


def run_e6_dynamic(seed: int, own_process: bool, combined: bool, batches: int = BATCHES) -> dict[str, Any]:
    """Four simulated workers (10 ms batches, +-5 % jitter) drain 8 x ``batches`` (160) batches from a real controller.

    Both paths prefetch the next lease during a shard's last batch. ``combined=False`` is
    the old protocol: GetShard prefetch + an async ReportShard after the shard (2 RPCs).
    ``combined=True``: the prefetch carries the report of the shard finished before
    (GetShard.done, 1 RPC); a WAIT poll carries a still-pending report. Also measured:
    time blocked on RPC results (the critical path) per shard, and the tail (last worker
    end - first worker end).
    """
    with tempfile.TemporaryDirectory() as tmp:
        proc, srv = None, None
        if own_process:
            proc, address = _controller_process(tmp, batches)
        else:
            srv = controller(tmp, files=8, batches=batches)
            address = srv.address
        rng = random.Random(seed)
        jitter = [[1 + rng.uniform(-0.05, 0.05) for _ in range(4096)] for _ in range(WORKERS)]
        waited = [0.0] * WORKERS
        busy = [0.0] * WORKERS
        issued = [0.0] * WORKERS  # the worker thread's own time issuing RPCs (the critical path)
        shards = [0] * WORKERS
        rpcs = [0] * WORKERS
        ends = [0.0] * WORKERS
        errors: list[BaseException] = []
        clients = [ControllerClient(address, RPC, index=i) for i in range(WORKERS)]
        for c in clients:
            c.register()
        t0 = time.monotonic()

        def work(i: int) -> None:
            c = clients[i]
            k = 0
            pending: DoneReport | None = None  # combined: the report riding on the next lease request
            report: Pending[ReportResult] | None = None  # two RPCs: the report in flight
            nxt = c.lease_async("train")
            rpcs[i] += 1
            while True:
                w = time.monotonic()
                got = nxt.result().got
                waited[i] += time.monotonic() - w
                if got.status.value == "done":
                    break
                if got.status.value == "wait":
                    time.sleep(0.005)
                    nxt, pending = c.lease_async("train", pending), None
                    rpcs[i] += 1
                    continue
                lease = got.lease
                assert lease is not None
                start = time.monotonic()
                for b in range(lease.batches):
                    if b == lease.batches - 1:  # prefetch during the last batch: RPC off the critical path
                        w = time.monotonic()
                        nxt, pending = c.lease_async("train", pending if combined else None), None
                        issued[i] += time.monotonic() - w
                        rpcs[i] += 1
                    k += 1
                    time.sleep(BASE_S * jitter[i][k % 4096])
                took = time.monotonic() - start
                busy[i] += took
                shards[i] += 1
                if combined:
                    pending = DoneReport(lease, samples=lease.batches, elapsed_s=took)
                else:
                    if report is not None:
                        w = time.monotonic()
                        assert report.result().kind == "done"
                        waited[i] += time.monotonic() - w
                    report = c.report_shard_async(lease, "done", samples=lease.batches, elapsed_s=took)
                    rpcs[i] += 1
                c.report_metrics(batch_times_s=[took / lease.batches], samples_per_s=lease.batches / took, wait=False)
                rpcs[i] += 1
                issued[i] += time.monotonic() - start - took
            if report is not None:
                assert report.result().kind == "done"
            assert pending is None, "a done report was never sent"
            ends[i] = time.monotonic() - t0

        def guarded(i: int) -> None:
            try:
                work(i)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        try:
            if errors:
                raise errors[0]
            cov = clients[0].status()["coverage"]
            assert cov["complete"] and cov["duplicate_entries"] == 0 and cov["stale_entries"] == 0, cov
        finally:
            for c in clients:
                c.close()
            if srv is not None:
                srv.stop(grace=0)
            if proc is not None:
                proc.kill()
                proc.wait(30)
                assert proc.stdout is not None
                proc.stdout.close()
    n = sum(shards)
    return {"time": elapsed, "rpc_wait_ms_per_shard": 1000 * sum(waited) / n, "tail_ms": 1000 * (max(ends) - min(ends)),
            "rpcs_per_shard": sum(rpcs) / n, "shards": shards, "batch_ms": 1000 * sum(busy) / (n * BPS),
            "issue_ms_per_shard": 1000 * sum(issued) / n,
            "other_ms_per_shard": 1000 * (sum(ends) - sum(busy) - sum(waited)) / n}


def e5(seed: int, steps: int = 60) -> dict[str, float]:
    """Synchronous steps: step time = max_i(batch_i * per_sample_i); DD vs equal batches."""
    per_sample = [2e-4, 2e-4, 2e-4, 4e-4]  # worker 3 is 2x slower
    g = 256
    out: dict[str, float] = {}
    for mode in ("equal", "dd"):
        with tempfile.TemporaryDirectory() as tmp:
            srv = controller(tmp, policy=PolicyKind.DD if mode == "dd" else PolicyKind.NONE,
                             dd=DdConfig(global_batch=g, min_change=0.02), window_s=0.1)
            clients = [ControllerClient(srv.address, RPC, index=i) for i in range(WORKERS)]
            for c in clients:
                c.register()
            sizes = [g // WORKERS] * WORKERS
            barrier = threading.Barrier(WORKERS + 1)
            stop = threading.Event()
            rng = random.Random(seed)
            jit = [1 + rng.uniform(-0.03, 0.03) for _ in range(4096)]
            step_took = [0.0] * WORKERS

            def work(i: int) -> None:
                s = 0
                while True:  # every party meets every barrier, including the final one
                    barrier.wait()
                    if stop.is_set():
                        return
                    b = sizes[i]
                    t = time.monotonic()
                    time.sleep(b * per_sample[i] * jit[(s * 7 + i) % 4096])
                    took = time.monotonic() - t
                    step_took[i] = took
                    clients[i].report_metrics(batch_times_s=[took], samples_per_s=b / took)
                    s += 1
                    if s % 5 == 0:
                        clients[i].heartbeat(step=s)
                    barrier.wait()

            threads = [threading.Thread(target=work, args=(i,)) for i in range(WORKERS)]
            for t in threads:
                t.start()
            times, samples = [], []
            for step in range(steps * 2):
                if step % 5 == 0:
                    # rank 0 reads the whole set from one status snapshot and every worker
                    # switches at the same step (a mix of old and new sizes would not sum to g)
                    got = {n["index"]: n["batch_size"] for n in clients[0].status()["nodes"] if n["role"] == "worker"}
                    if all(got.get(i, 0) > 0 for i in range(WORKERS)):
                        sizes[:] = [got[i] for i in range(WORKERS)]
                batch = list(sizes)
                barrier.wait()
                barrier.wait()
                if step >= steps:  # steady state: second half
                    # the synchronous step lasts as long as its slowest worker's compute;
                    # metric/heartbeat RPCs are off the step's critical path (async in a real worker)
                    times.append(max(step_took))
                    samples.append(sum(batch))
            stop.set()
            barrier.wait()
            for t in threads:
                t.join()
            assert sum(sizes) == g, sizes
            out[mode] = sum(samples) / sum(times)
            out[f"{mode}_sizes"] = list(sizes)
            srv.stop(grace=0)
    out["speedup"] = out["dd"] / out["equal"]
    return out


# ---------------------------------------------------------------- E1 / E5 with real processes
REAL_WORKERS_E1 = 4
REAL_WORKERS_E5 = 2


def _real_data(tmp: Path, quick: bool, rows: int | None = None) -> dict[str, Path]:
    """Generated AntM2C-like rows built as a plain Meta-IO layout (64-row record batches).

    Args:
        rows: rows to generate (default 4000 quick, 8000 full: E1's data).
    """
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.synth import GeneratorConfig, generate
    from meta_io.layout import Layout

    if rows is None:
        rows = 4000 if quick else 8000
    gen = generate(tmp / "raw", GeneratorConfig(rows=rows, users=400, items=300, seed=5,
                                                n_files=2, row_group_rows=2000), progress=False)
    plain = build(gen.out_dir, gen.schema_path, tmp / "plain",
                  MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=64)).out_dir
    return {"plain": plain, "schema": gen.schema_path}


def _real_job(tmp: Path, data: dict[str, Path], workers: int, slow: float, **sections: dict[str, Any]) -> Path:
    from metaps.job import job_from_mapping
    from common.toml_writer import dumps

    d: dict[str, Any] = {
        "data": {"train": str(data["plain"]), "eval": ""},
        "ps": {"shards": 1, "num_vshards": 16, "device": "cpu", "table_defaults": {"dim": 8, "capacity": 65536}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [32, 16]},
        "train": {"mode": "plain", "workers": workers, "overlap": False, "log_every": 50},
        "rpc": {"token": RPC.token, "timeout_s": 60.0},
        "delivery": {"out": str(tmp / "bundles")},
        "run": {"dir": str(tmp / "run")},
        # basis "step": the slowed worker is `slow` x slower at everything it does (its pulls and
        # pushes too, not its waits for slower workers): its forward/backward is a few % of a step
        "faults": {"faults": [{"target": "worker", "index": workers - 1, "kind": "slow", "factor": slow,
                               "basis": "step"}]
                   if slow > 1 else []},
    }
    for name, values in sections.items():
        d.setdefault(name, {}).update(values)
    job = job_from_mapping(d, where="<bench job>")
    path = tmp / "job.toml"
    path.write_text(dumps(job.to_dict()))
    return path


def _real_fleet(tmp: Path, job_path: Path, workers: int, controller_addr: str,
                env_extra: dict[str, str] | None = None, timeout_s: float = 900.0) -> list[dict[str, Any]]:
    """One `metaps ps` and ``workers`` `metaps worker` processes; returns the workers' reports."""
    # the token goes by environment: a written job.toml has it redacted (metaps.job)
    env = dict(os.environ, OMP_NUM_THREADS="1", METAPS_T0=repr(time.time()), METAPS_TOKEN=RPC.token,
               **(env_extra or {}))
    env.pop("METAPS_CONTROLLER", None)
    ready = tmp / "ps-0.ready"
    ps = subprocess.Popen([sys.executable, "-m", "metaps", "ps", "--config", str(job_path), "--shard", "0",
                           "--port", "0", "--ready-file", str(ready)], env=env,
                          stdout=(tmp / "ps-0.log").open("wb"), stderr=subprocess.STDOUT)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            if ps.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"metaps ps did not start: {(tmp / 'ps-0.log').read_text()[-2000:]}")
            time.sleep(0.05)
        addr = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        for r in range(workers):
            cmd = [sys.executable, "-m", "metaps", "worker", "--config", str(job_path), "--rank", str(r),
                   "--ps", addr, "--run-dir", str(tmp / "run")]
            if controller_addr:
                cmd += ["--controller", controller_addr]
            procs.append(subprocess.Popen(cmd, env=env, stdout=(tmp / f"worker-{r}.log").open("wb"),
                                          stderr=subprocess.STDOUT))
        for r, p in enumerate(procs):
            if p.wait(timeout_s) != 0:
                raise RuntimeError(f"worker {r} failed: {(tmp / f'worker-{r}.log').read_text()[-3000:]}")
        return [json.loads((tmp / "run" / "workers" / f"worker-{r}.json").read_text()) for r in range(workers)]
    finally:
        for p in procs + [ps]:
            if p.poll() is None:
                p.terminate()
        for p in procs + [ps]:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def _span(reports: list[dict[str, Any]]) -> float:
    """Training time of a fleet: first worker's train start to the last worker's train end."""
    return max(r["train_end"] for r in reports) - min(r["train_start"] for r in reports)


def _real_controller(tmp: Path, job_path: Path, policy: PolicyKind) -> ControllerServer:
    from metaps.job import load_job

    job = load_job(str(job_path))
    import dataclasses

    cfg = dataclasses.replace(job.controller, policy=policy, tick_s=0.1)
    spec = DatasetSpec.from_meta_io("train", job.data.train, "train", epochs=job.train.epochs)
    srv = ControllerServer(cfg, tmp / "ctl", [spec], RPC)
    srv.start("127.0.0.1:0")
    return srv


def e1_real(seed: int, data: dict[str, Path], quick: bool, workers: int = REAL_WORKERS_E1,
            profile: bool = False, max_staleness: int | None = None) -> dict[str, Any]:
    """``workers`` real `metaps worker` processes + 1 real `metaps ps`; the last worker slowed 4x.

    dynamic: the controller's DDS leases shards (the product's default monitor windows,
    10 s x 3; restarts off: a restarted worker would be just as slow, the fault follows
    the rank). static: no controller, each worker trains its equal static slice.
    ``profile`` adds a static run with no fault (the same fleet's speeds when nobody sleeps).
    Per worker and run: samples, samples per second of its own busy time (steps + injected
    sleep) and per second of its train span. ``max_staleness`` overrides the product's
    bounded staleness (``[ps] max_staleness``, default 4: no worker pulls more than 4 steps
    ahead of the slowest, so a 4x slower worker holds the others back in both modes).
    ``[ps] wait_timeout_s`` is 600 s here: under load the slowed worker's first step
    (imports, first pulls) takes tens of seconds and the fault sleeps 3x that, longer
    than the product's 60 s wait. ``dynamic_actions`` counts the controller's events about the
    slow worker: ``release_clock`` (it left the staleness clock, ``[controller.nd]
    release_slow_clock``) and ``tail_split`` / ``tail_split_done`` (its lease's tail went to an
    idle worker, ``[controller.dds] tail_split_min_batches``).
    """
    epochs = 3 if quick else 6
    out: dict[str, Any] = {"workers": workers, "max_staleness": max_staleness}
    for mode in ("dynamic", "static") + (("static_nofault",) if profile else ()):
        with tempfile.TemporaryDirectory() as tmpd:
            tmp = Path(tmpd)
            job = _real_job(tmp, data, workers, 1.0 if mode == "static_nofault" else 4.0,
                            train={"epochs": epochs, "seed": seed},
                            ps={"wait_timeout_s": 600.0,
                                **({"max_staleness": max_staleness} if max_staleness is not None else {})},
                            controller={"nd": {"restart_after": 0, "move_vshards": 0},
                                        "dds": {"batches_per_shard": 4}})
            srv = _real_controller(tmp, job, PolicyKind.ND) if mode == "dynamic" else None
            load0 = os.getloadavg()[0]
            try:
                reps = _real_fleet(tmp, job, workers, srv.address if srv else "")
                if srv is not None:  # what the product did about the slow worker (release, tail split)
                    kinds = [e.kind for e in srv.events.list()]
                    out[f"{mode}_actions"] = {k: kinds.count(k) for k in
                                              ("slow_detected", "release_clock", "rejoin_clock", "tail_split",
                                               "tail_split_done") if k in kinds}
            finally:
                if srv is not None:
                    srv.stop(grace=0)
            out[f"{mode}_s"] = _span(reps)
            out[f"{mode}_samples"] = [r["samples"] for r in reps]
            out[f"{mode}_sps_busy"] = [round(r["samples"] / max(r["busy_s"], 1e-9), 1) for r in reps]
            out[f"{mode}_sps_span"] = [round(r["samples"] / max(r["train_end"] - r["train_start"], 1e-9), 1)
                                       for r in reps]
            out[f"{mode}_load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    out["vs_static"] = out["static_s"] / out["dynamic_s"]
    return out


E5_ROWS = 65536
"""E5i's data: 64 steps of 1024 units (16 of 4096) per epoch. On E1's 4000 rows an epoch was
4 steps of 1024, and each epoch's end (the DDS opens the next epoch when every shard of this
one is reported, after the step that trained it) left a worker with no lease for a step: at
1024, 37-44% of the steps trained one worker's share only, and at 4096 an epoch would be one
step. A real job's epoch is thousands of steps."""

E5_HIDDEN = [1024, 1024, 512]
"""E5i's dense tower: per-unit compute must dominate the step for a batch split to matter
(with the shared [32, 16] tower the step was ~85% fixed cost: PS push, controller RPCs)."""


def _e5_job(tmp: Path, data: dict[str, Path], seed: int, epochs: int, global_batch: int,
            hidden: list[int] | None = None) -> Path:
    """The E5 job: 2 all-reduce workers, the last slowed 2x, DD policy with 2 s monitor windows.

    Args:
        hidden: the DNN's hidden layers (default: the bench's shared small tower).
    """
    return _real_job(tmp, data, REAL_WORKERS_E5, 2.0, **({"model": {"hidden": hidden}} if hidden else {}),
                     train={"epochs": epochs, "seed": seed, "dense_sync": "allreduce", "log_every": 1000},
                     controller={"policy": "dd", "dd": {"global_batch": global_batch, "min_change": 0.05},
                                 "monitor": {"window_s": 2.0, "keep_windows": 1000},
                                 "dds": {"batches_per_shard": 2}})


def e5_real(seed: int, data: dict[str, Path], quick: bool) -> dict[str, Any]:
    """2 real all-reduce workers (gloo) + 1 real PS; worker 1 slowed 2x; DD vs equal batches.

    Both runs use the DD worker loop (workers/dd.py) with the same global batch; in the
    equal run the controller sends no plan (policy none), so the split stays 50/50. The
    monitor window is 2 s (product default 10 s) so that the plan lands within the first
    tenth of a bench-sized run. Throughput = units over the middle half of the steps,
    divided by their wall time.

    The global batch is 1024 units: this model's step has a fixed cost of ~0.27 s on the
    loaded 2-core box against ~0.5 ms per unit, and the fault doubles both, so at 128 units
    (the earlier setting) the slow worker takes ~2 x 0.27 s per step whatever its size and
    no split can gain more than ~1.1x; the theory's 1.5x needs per-unit work to matter,
    i.e. a global batch above a/b ~ 550 units.
    """
    from common.ports import reserve_port

    g = 1024
    epochs = 8 if quick else 12
    out: dict[str, Any] = {}
    for mode in ("equal", "dd"):
        with tempfile.TemporaryDirectory() as tmpd:
            tmp = Path(tmpd)
            job = _e5_job(tmp, data, seed, epochs, g)
            srv = _real_controller(tmp, job, PolicyKind.DD if mode == "dd" else PolicyKind.NONE)
            try:
                with reserve_port() as rdv:  # held for the fleet's life: no other process takes it
                    reps = _real_fleet(tmp, job, REAL_WORKERS_E5, srv.address,
                                       {"METAPS_ALLREDUCE": f"127.0.0.1:{rdv.port}"})
                snap = srv.monitor.snapshot()
                plans = [e.evidence for e in srv.events.list(kind="set_batch_sizes")]
            finally:
                srv.stop(grace=0)
            recs = reps[0]["dd_steps"]
            sizes1 = [r["size"] for r in reps[1]["dd_steps"]]
            assert all(r["size_sum"] == g for r in recs), "sizes must sum to the global batch"
            # steady state: the middle half of the steps (after the plan, before the epoch tails of the end)
            lo, hi = len(recs) // 4, 3 * len(recs) // 4
            win = recs[lo:hi]
            out[f"{mode}_samples_per_s"] = sum(r["units_sum"] for r in win) / (win[-1]["t"] - win[0]["t"])
            out[f"{mode}_sizes"] = [recs[hi]["size"], sizes1[hi]]
            # profile of the same steps: each worker's own busy time per step (what it reports to
            # the monitor: pull + compute + push + injected sleep, no collective wait) vs the wall
            # time per step; the difference is what no batch split can remove (collectives, sync).
            t0, t1 = win[0]["t"], win[-1]["t"]
            inside = [w for w in snap.windows if w.start >= t0 and w.end <= t1]
            busy = {k: statistics.mean(w.worker_batch_time[k] for w in inside if k in w.worker_batch_time)
                    for k in range(REAL_WORKERS_E5) if any(k in w.worker_batch_time for w in inside)}
            out[f"{mode}_busy_s_per_step"] = [round(busy.get(k, float("nan")), 4) for k in range(REAL_WORKERS_E5)]
            out[f"{mode}_wall_s_per_step"] = round((t1 - t0) / max(len(win) - 1, 1), 4)
            if plans:
                last = plans[-1]
                out[f"{mode}_plans"] = len(plans)
                out[f"{mode}_last_plan"] = {"mode": last.get("mode"), "sizes": last.get("sizes"),
                                            "step_cost_a_b": last.get("step_cost_a_b")}
    out["speedup"] = out["dd_samples_per_s"] / out["equal_samples_per_s"]
    return out


class _InterleavedDd:
    """A bench policy: the product's DD policy until it settles, then its plan vs equal in turns.

    Phase 1 delegates to the DD policy (controller/policy/dd.py) untouched, so the split it
    learns is the product's: its first plan is only a damped step of the samples/s fallback
    (one size observed, nothing to fit yet), so phase 1 lasts until the policy has made a
    plan and then made no new one for ``settle_s`` seconds (or ``max_learn_s`` passed since
    its first plan). From then on this wrapper stops consulting it and alternates, every
    ``window_s`` seconds, between the policy's last plan and the equal split, through the
    same ``SetBatchSizes`` action the product uses (plan stamps, min-agreement in the
    workers). Both arms then run in the same fleet, same processes, same data, interleaved
    in time: load drift on a shared box hits both alike.

    ``settle_s`` is 20 s, 10 of E5's 2 s monitor windows: the policy smooths samples/s (EMA,
    ``[controller.dd] smoothing`` 0.3), so after a few noisy windows it needs several to turn,
    and re-plans only past ``min_change``. With 8 s (4 windows) a run at load 8 froze the
    policy's first plan, made from 2 warm-up windows in which the slowed worker looked faster:
    494/530, the wrong way (2026-12-01 02:13, BENCHMARKS "E5i round 3").
    """

    name = "dd-interleaved"

    def __init__(self, inner: Any, equal: dict[int, int], window_s: float, settle_s: float = 20.0,
                 max_learn_s: float = 120.0) -> None:
        self.inner, self.equal, self.window_s = inner, equal, window_s
        self.settle_s, self.max_learn_s = settle_s, max_learn_s
        self.learned: list[dict[str, Any]] = []  # the policy's plans in phase 1 (sizes, mode)
        self.first_plan_at: float | None = None
        self.last_plan_at = 0.0
        self.plan: dict[int, int] | None = None  # frozen at the end of phase 1
        self.settled = False
        self.frozen_at: float | None = None  # wall-clock (time.time) when the alternation began
        self.switch_at = 0.0
        self.mode = "dd"
        self.switches: list[tuple[float, str]] = []

    def evaluate(self, snapshot: Any, now: float) -> list[Any]:
        from controller.policy import SetBatchSizes

        if self.plan is None:
            acts = self.inner.evaluate(snapshot, now)
            for a in acts:
                if isinstance(a, SetBatchSizes):
                    self.learned.append({"sizes": [a.sizes[k] for k in sorted(a.sizes)],
                                         "mode": a.evidence.get("mode")})
                    self.first_plan_at = now if self.first_plan_at is None else self.first_plan_at
                    self.last_plan_at = now
            if self.first_plan_at is None:
                return acts
            quiet = now - self.last_plan_at >= self.settle_s
            if not (quiet or now - self.first_plan_at >= self.max_learn_s):
                return acts
            self.settled = quiet
            last = [a for a in acts if isinstance(a, SetBatchSizes)]
            self.plan = dict(last[-1].sizes) if last else dict(self.inner.sizes)
            self.frozen_at = time.time()
            self.switch_at = now + self.window_s
            self.switches.append((now, "dd"))
            return acts
        if now < self.switch_at:
            return []
        self.mode = "equal" if self.mode == "dd" else "dd"
        self.switch_at = now + self.window_s
        self.switches.append((now, self.mode))
        return [SetBatchSizes("workers", {"bench": "interleaved", "arm": self.mode},
                              sizes=dict(self.plan if self.mode == "dd" else self.equal))]


def _arm(size0: int, dd_size0: int, equal_size0: int) -> str:
    """Which arm a step of worker 0 with ``size0`` units belongs to ("" for neither)."""
    return "dd" if size0 == dd_size0 else "equal" if size0 == equal_size0 else ""


def _paired_windows(recs: list[dict[str, Any]], dd_size0: int, equal_size0: int, skip: int = 1,
                    since: float = 0.0) -> list[float]:
    """DD/equal samples/s ratios of adjacent windows, from worker 0's per-step records.

    A window is a run of consecutive steps trained under one split (worker 0's size tells
    which; a step under any other split, e.g. a plan of the learning phase, belongs to
    neither and ends a run); only steps that end at or after ``since`` count, and each
    window's first ``skip`` steps (the switch) are dropped. Each DD window is paired with
    the equal window just before it (the ABAB order pairs every window with a neighbour,
    so slow drift cancels within a pair).
    """
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    for r in recs:
        if r["t"] < since:
            continue
        mode = _arm(r["size"], dd_size0, equal_size0)
        if runs and runs[-1][0] == mode:
            runs[-1][1].append(r)
        else:
            runs.append((mode, [r]))

    def rate(steps: list[dict[str, Any]]) -> float | None:
        # the counted steps are steps[skip:]; a step's period ends at its own end and starts
        # at the previous step's end, so the window's clock starts at the last dropped step
        # (as in _e5_profile: the same steps' periods and units in both figures)
        first = max(skip, 1)
        if len(steps) < first + 2 or steps[-1]["t"] <= steps[first - 1]["t"]:
            return None
        return sum(s["units_sum"] for s in steps[first:]) / (steps[-1]["t"] - steps[first - 1]["t"])

    ratios: list[float] = []
    for (m0, a), (m1, b) in zip(runs, runs[1:]):
        if {m0, m1} == {"dd", "equal"}:
            ra, rb = rate(a), rate(b)
            if ra and rb:
                ratios.append((ra / rb) if m0 == "dd" else (rb / ra))
    return ratios


_E5_PROFILE_FIELDS = ("size", "units", "read_s", "pull_s", "compute_s", "compute_cpu_s", "push_s", "sleep_s", "head_wait_s",
                      "grad_wait_s", "apply_s", "shard_report_s", "report_s", "wall_s")


def _e5_profile(reports: list[dict[str, Any]], dd_size0: int, equal_size0: int, skip: int = 1,
                since: float = 0.0) -> dict[str, Any]:
    """Per arm and worker, the median per step of each part of the step (``DdStepRecord``).

    A step's arm is read from worker 0's size at that step (see :func:`_arm`); steps before
    ``since`` and the first ``skip`` steps after each switch are dropped, like
    ``_paired_windows``. Per arm also (worker 0's step ends):

    * ``period_s``: wall seconds per global batch of units, i.e. the counted steps' periods
      summed over the units they trained (``units_sum``) x the global batch: the same
      quantity as the pair figure's samples/s, so equal/dd of it is comparable with the pairs.
    * ``step_median_s``: the median step period. Not a throughput: a step may train fewer
      units than the global batch (a worker that found no lease at an epoch's end trains
      0 units while its peer trains its share), and the median drops the long steps.
    * ``partial_steps`` / ``units_per_step``: steps with fewer units than the global batch
      and the mean units per step.
    """
    by_step = [{r["step"]: r for r in rep["dd_steps"]} for rep in reports]
    arm_of: dict[int, str] = {}
    prev, run = "", 0
    steps0 = sorted(by_step[0])
    for st in steps0:
        if by_step[0][st]["t"] < since:
            continue
        arm = _arm(by_step[0][st]["size"], dd_size0, equal_size0)
        run = run + 1 if arm == prev else 0
        prev = arm
        if run >= skip:
            arm_of[st] = arm
    out: dict[str, Any] = {}
    for arm in ("dd", "equal"):
        steps = [st for st in steps0 if arm_of.get(st) == arm]
        prof: dict[str, Any] = {"steps": len(steps)}
        timed = [st for st in steps if st - 1 in by_step[0]]
        periods = [by_step[0][st]["t"] - by_step[0][st - 1]["t"] for st in timed]
        units = [int(by_step[0][st]["units_sum"]) for st in timed]
        g = max((int(by_step[0][st]["size_sum"]) for st in timed), default=0)
        prof["period_s"] = round(sum(periods) / sum(units) * g, 4) if sum(units) > 0 else None
        prof["step_median_s"] = round(statistics.median(periods), 4) if periods else None
        prof["partial_steps"] = sum(1 for u in units if u < g)
        prof["units_per_step"] = round(sum(units) / len(units), 1) if units else None
        for k, recs in enumerate(by_step):
            rows = [recs[st] for st in steps if st in recs]
            prof[f"w{k}"] = {f: round(statistics.median(float(r.get(f, 0.0)) for r in rows), 4)
                             for f in _E5_PROFILE_FIELDS} if rows else {}
        out[arm] = prof
    return out


def e5_real_interleaved(seed: int, data: dict[str, Path], quick: bool, global_batch: int = 1024,
                        window_s: float | None = None, hidden: list[int] | None = None,
                        epochs: int | None = None) -> dict[str, Any]:
    """E5 with both arms in one run: DD plan and equal split alternate (see ``_InterleavedDd``).

    Args:
        data: :data:`E5_ROWS` rows (:func:`_real_data`): epochs much longer than a step.
        global_batch: units per step, all workers together (the bench's ``--e5-global-batch``).
        window_s: seconds per arm window; default 10 s x ``global_batch`` / 1024 (at least
            10 s), so that a window holds about the same number of steps at every global batch.
        epochs: the run's length (default 8 quick, 16 full, of :data:`E5_ROWS` rows: ~0.5 M
            units quick, several minutes on a quiet 2-core box at any global batch).

    Same fleet as :func:`e5_real` (2 gloo workers + 1 PS, worker 1 slowed 2x). The figure is
    the median over adjacent (equal, DD) window pairs of the samples/s ratio, counted from
    the end of the policy's learning phase. Also: the plans it made while learning, whether
    it settled, and the per-arm step profile (:func:`_e5_profile`).
    """
    from controller.config import PolicyKind as _PK
    from controller.policy import make_policy
    from common.ports import reserve_port
    from metaps.job import load_job
    import dataclasses

    hidden = E5_HIDDEN if hidden is None else hidden
    if epochs is None:
        epochs = 8 if quick else 16  # the learning phase (a few 2 s windows per plan) comes first
    if window_s is None:
        window_s = 10.0 * max(1.0, global_batch / 1024)
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        job_path = _e5_job(tmp, data, seed, epochs, global_batch, hidden)
        job = load_job(str(job_path))
        cfg = dataclasses.replace(job.controller, policy=_PK.DD, tick_s=0.1)
        half = global_batch // REAL_WORKERS_E5
        equal = {k: half + (1 if k < global_batch - half * REAL_WORKERS_E5 else 0) for k in range(REAL_WORKERS_E5)}
        pol = _InterleavedDd(make_policy(cfg), equal, window_s)
        spec = DatasetSpec.from_meta_io("train", job.data.train, "train", epochs=job.train.epochs)
        srv = ControllerServer(cfg, tmp / "ctl", [spec], RPC, policy=pol)  # type: ignore[arg-type]
        srv.start("127.0.0.1:0")
        try:
            with reserve_port() as rdv:  # held for the fleet's life: no other process takes it
                reps = _real_fleet(tmp, job_path, REAL_WORKERS_E5, srv.address,
                                   {"METAPS_ALLREDUCE": f"127.0.0.1:{rdv.port}"})
        finally:
            srv.stop(grace=0)
    recs = reps[0]["dd_steps"]
    if pol.plan is None:
        return {"speedup": float("nan"), "pairs": 0, "note": "the DD policy made no plan"}
    since = pol.frozen_at or 0.0
    if pol.plan[0] == equal[0]:
        return {"speedup": float("nan"), "pairs": 0, "note": "the DD policy's plan is the equal split",
                "learned": pol.learned}
    ratios = _paired_windows(recs, pol.plan[0], equal[0], since=since)
    prof = _e5_profile(reps, pol.plan[0], equal[0], since=since)
    p_dd, p_eq = prof["dd"]["period_s"], prof["equal"]["period_s"]
    return {"speedup": statistics.median(ratios) if ratios else float("nan"), "pairs": len(ratios),
            "period_ratio": round(p_eq / p_dd, 4) if p_dd and p_eq else None,
            "global_batch": global_batch, "window_s": window_s, "epochs": epochs,
            "settled": pol.settled, "learned": pol.learned, "hidden": hidden,
            "profile": prof,
            "pair_ratios": [round(r, 3) for r in ratios], "dd_plan": [pol.plan[k] for k in sorted(pol.plan)],
            "switches": len(pol.switches), "steps": len(recs)}


# ---------------------------------------------------------------------------- E2: slow PS
E2_LATENCY_S = 0.02   # added per request on PS 1 (fault injection)
E2_IDS = 256          # unique ids per pull/push step (one table, dim 16)
E2_CLIENTS = 2        # client threads, each: pull ids -> push grads -> next


# What reaches each PS and what CPU each process used, per E2 window (issue 11 point 3):
# read from /proc and the PS's own Prometheus counters at each window's edges.
_DATA_METHODS = ("PullMany", "Pull", "PushMany", "Push", "PullDense", "PushDense")
"""The PS RPCs the latency fault delays (``ps.servicer._rpc(data=True)``): every one of them
that arrives while a latency window is on sleeps ``latency_s`` first."""


def _box_cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot, from ``/proc/stat``."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already inside user/nice
    return total - idle, total


def _ps_requests(metrics_port: int) -> dict[str, int]:
    """Requests a PS has handled so far, per gRPC method (``metaps_ps_rpc_seconds_count``).

    Args:
        metrics_port: the PS's Prometheus port (its ready file's ``metrics_port``).
    """
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, int] = {}
    for m in re.finditer(r'^metaps_ps_rpc_seconds_count\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        method = re.search(r'method="([^"]*)"', m.group(1))
        if method:
            out[method.group(1)] = out.get(method.group(1), 0) + int(float(m.group(2)))
    return out


def _e2_snapshot(ps_pids: Sequence[int], metrics_ports: Sequence[int], client_tids: Sequence[int]) -> dict[str, Any]:
    """One reading of the counters E2's windows are accounted with.

    Args:
        ps_pids: the PS processes, by shard.
        metrics_ports: their Prometheus ports, by shard.
        client_tids: native thread ids of the bench's client threads (this process).
    """
    t = time.time()
    busy, total = _box_cpu_jiffies()
    return {"t": t, "box_busy": busy, "box_total": total,
            "cpu": {f"ps{k}": stat_cpu_s(f"/proc/{pid}/stat") for k, pid in enumerate(ps_pids)}
            | {"bench": stat_cpu_s(f"/proc/{os.getpid()}/stat"),
               "clients": sum(stat_cpu_s(f"/proc/{os.getpid()}/task/{tid}/stat") for tid in client_tids)},
            "requests": [_ps_requests(p) for p in metrics_ports]}


def _e2_window_figures(samples: Sequence[tuple[dict[str, Any], dict[str, Any]]], done: Sequence[Sequence[float]],
                       on: Sequence[bool]) -> dict[str, Any]:
    """Per-window deltas and the paired ratios of E2's interleaved windows.

    Args:
        samples: (first, last) :func:`_e2_snapshot` of each window, in order.
        done: each client's step completion times.
        on: whether the fault was on in each window (ABBA: pairs are windows 2j, 2j+1).

    Returns ``windows`` (per window: seconds, steps, steps/s, CPU seconds per process,
    the box's busy fraction, requests per PS split into data (delayed when on) and
    other), and per pair (fault-on / fault-off): ``paired_wall`` (steps/s),
    ``paired_per_client_cpu`` (steps per CPU-second of the client threads),
    ``paired_per_fleet_cpu`` (steps per CPU-second of PS 0 + PS 1 + the bench process)
    and ``ps1_cpu_on_minus_off`` (PS 1's CPU share, on - off).
    """
    times = np.sort(np.concatenate([np.asarray(d, dtype=np.float64) for d in done])) if done else np.zeros(0)
    wins: list[dict[str, Any]] = []
    for (a, b), fault in zip(samples, on):
        secs = b["t"] - a["t"]
        steps = int(np.searchsorted(times, b["t"]) - np.searchsorted(times, a["t"]))
        cpu = {k: b["cpu"][k] - a["cpu"][k] for k in a["cpu"]}
        reqs = []
        for ra, rb in zip(a["requests"], b["requests"]):
            delta = {m: rb.get(m, 0) - ra.get(m, 0) for m in rb}
            data = sum(v for m, v in delta.items() if m in _DATA_METHODS)
            reqs.append({"data": data, "other": {m: v for m, v in delta.items() if m not in _DATA_METHODS and v}})
        box_total = b["box_total"] - a["box_total"]
        wins.append({"on": fault, "s": round(secs, 3), "steps": steps, "rate": round(steps / max(secs, 1e-9), 2),
                     "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
                     "box_busy": round((b["box_busy"] - a["box_busy"]) / max(box_total, 1), 4),
                     "requests": reqs})

    def pair(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return (wins[i], wins[i + 1]) if wins[i]["on"] else (wins[i + 1], wins[i])

    def ratio(i: int, f: Callable[[dict[str, Any]], float]) -> float:
        w_on, w_off = pair(i)
        return f(w_on) / max(f(w_off), 1e-9)

    def share(w: dict[str, Any], k: str) -> float:
        return float(w["cpu_s"][k]) / max(float(w["s"]), 1e-9)

    pairs = range(0, len(wins) - 1, 2)
    fleet = ("ps0", "ps1", "bench")
    return {"windows": wins,
            "paired_wall": [ratio(i, lambda w: w["steps"] / max(w["s"], 1e-9)) for i in pairs],
            "paired_per_client_cpu": [ratio(i, lambda w: w["steps"] / max(w["cpu_s"]["clients"], 1e-9)) for i in pairs],
            "paired_per_fleet_cpu": [ratio(i, lambda w: w["steps"] / max(sum(w["cpu_s"][k] for k in fleet), 1e-9))
                                     for i in pairs],
            "ps1_cpu_share_on_minus_off": [share(pair(i)[0], "ps1") - share(pair(i)[1], "ps1") for i in pairs]}


def _e2_windows(fault_end_s: float, window_s: float, pairs: int) -> list[tuple[float, float, bool]]:
    """The interleaved windows after the migration: (start, end, fault on), seconds after launch.

    ``pairs`` pairs of equal windows starting 0.5 s after the continuous fault ends, in
    ABBA order (on/off, off/on, on/off, ...) so that a load drift that is linear over a
    pair of pairs cancels in the paired ratios.
    """
    out = []
    t = fault_end_s + 0.5
    for j in range(pairs):
        for on in ((True, False) if j % 2 == 0 else (False, True)):
            out.append((t, t + window_s, on))
            t += window_s
    return out


def _e2_job(tmp: Path, fault_start_s: float, fault_duration_s: float,
            windows: Sequence[tuple[float, float, bool]] = ()) -> Path:
    schema = tmp / "schema.json"
    schema.write_text(json.dumps({"version": 1, "task_key": "user_id", "labels": ["click"], "columns": [
        {"name": "user_id", "kind": "sparse", "table": "user"}, {"name": "click", "kind": "label"}]}))
    job = tmp / "job.toml"
    job.write_text(f"""
[data]
train = "unused"
schema = "{schema}"
[model]
default_dim = 16
[ps]
shards = 2
num_vshards = 32
device = "cpu"
[ps.table_defaults]
dim = 16
capacity = 65536
optimizer = {{ kind = "sgd", lr = 0.01 }}
[rpc]
token = "{RPC.token}"
timeout_s = 30.0
[delivery]
out = "unused"
[controller.monitor]
window_s = 0.25
[[faults.faults]]
target = "ps"
index = 1
kind = "latency"
latency_s = {E2_LATENCY_S}
start_s = {fault_start_s}
duration_s = {fault_duration_s}
""" + "".join(f"""[[faults.faults]]
target = "ps"
index = 1
kind = "latency"
latency_s = {E2_LATENCY_S}
start_s = {a}
duration_s = {b - a}
""" for a, b, on in windows if on))
    return job


def _e2_fleet(tmp: Path, job: Path, controller_addr: str) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", METAPS_T0=repr(time.time()), METAPS_TOKEN=RPC.token)
    env.pop("METAPS_CONTROLLER", None)
    procs = []
    for k in range(2):
        cmd = [sys.executable, "-m", "metaps", "ps", "--config", str(job), "--shard", str(k), "--port", "0",
               "--ready-file", str(tmp / f"ps-{k}.ready")]
        if controller_addr:
            cmd += ["--controller", controller_addr]
        procs.append(subprocess.Popen(cmd, env=env, stdout=(tmp / f"ps-{k}.log").open("wb"),
                                      stderr=subprocess.STDOUT))
    return procs


def _e2_run(keep: int, start_s: float, phase_s: float, seed: int, pairs: int = 4) -> dict[str, Any]:
    """One fleet, four phases on the same PS processes and the same client threads::

        [fault - phase, fault)          original layout, healthy            -> "baseline"
        fault: PS 1 gets +E2_LATENCY_S per request; the ND policy flags it, no PsMover yet
        [fault + 0.5, +phase)           original layout, fault, no action   -> "straggler"
        PsMover(keep) installed         the policy's next MoveVshards run; settled = no move for 3 cooldowns
        [settled, +phase)               migrated layout, fault              -> "after"
        mover removed (layout frozen); the fault ends (its duration_s)
        then ``pairs`` pairs of phase_s windows, fault on / off in ABBA order (more fault
        entries in the PS's job), migrated layout                          -> "paired"

    The paired ratios (fault-on window / its fault-off neighbour, same clients, same
    migrated layout, adjacent in time so load drift cancels) are the like-for-like
    recovery figure; "control" is the mean of the off windows and "after / control" the
    old sequential measure, kept for comparison. ``after / baseline``
    compares different layouts: with keep=0 every request goes to one PS (no 2-shard
    fan-out), which is faster than the healthy 2-shard layout even with no fault at all.
    """
    from controller.ps_mover import MigrationPsMover
    from ps.client import PsClient
    from ps.fleet_admin import GrpcPsFleet

    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.ND, heartbeat_timeout_s=60.0,
                               monitor=MonitorConfig(window_s=0.25, consecutive=2),
                               nd=NdConfig(restart_after=0, move_vshards=8, cooldown_windows=2, keep=keep))
        srv = ControllerServer(cfg, tmp / "ctl", [], RPC)
        srv.start("127.0.0.1:0")
        t_launch = time.time()
        duration_s = 2.5 * phase_s + 20.0  # covers no-action + moves + after; checked below
        windows = _e2_windows(start_s + duration_s, phase_s, pairs)
        procs = _e2_fleet(tmp, _e2_job(tmp, start_s, duration_s, windows), srv.address)
        try:
            for k, p in enumerate(procs):
                ready = tmp / f"ps-{k}.ready"
                while not ready.exists():
                    if p.poll() is not None:
                        raise RuntimeError(f"metaps ps {k} exited: {(tmp / f'ps-{k}.log').read_text()[-2000:]}")
                    time.sleep(0.05)
            started = time.time() - t_launch
            if started > start_s - phase_s - 0.5:
                raise RuntimeError(f"PS start took {started:.1f}s: no time left for the baseline before the fault "
                                   f"at {start_s}s; raise the fault start")
            addrs = [f"127.0.0.1:{json.loads((tmp / f'ps-{k}.ready').read_text())['port']}" for k in range(2)]
            stop = threading.Event()
            done: list[list[float]] = [[] for _ in range(E2_CLIENTS)]
            errors: list[BaseException] = []
            tids: list[int] = [0] * E2_CLIENTS
            ready_info = [json.loads((tmp / f"ps-{k}.ready").read_text()) for k in range(2)]

            def work(i: int) -> None:
                tids[i] = threading.get_native_id()
                rng = np.random.default_rng(seed * 100 + i)
                try:
                    with PsClient(addrs, RPC, retry_timeout_s=30.0, backoff_s=0.01, max_backoff_s=0.1) as c:
                        grads = np.full((E2_IDS, 16), 1e-3, np.float32)
                        while not stop.is_set():
                            ids = rng.choice(200_000, E2_IDS, replace=False).astype(np.int64)
                            c.pull({"user": ids})
                            c.push({"user": (ids, grads)})
                            done[i].append(time.time())
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(E2_CLIENTS)]
            for t in threads:
                t.start()

            def rate(a: float, b: float) -> float:
                return sum(1 for d in done for x in d if a <= x < b) / max(b - a, 1e-9)

            fa = t_launch + start_s
            fend = fa + duration_s
            time.sleep(max(0.0, fa + 0.5 + phase_s - time.time()))
            out: dict[str, Any] = {"baseline": rate(fa - phase_s, fa), "straggler": rate(fa + 0.5, fa + 0.5 + phase_s)}
            slow = [e for e in srv.events.list() if e.kind == "slow_detected" and e.node == "ps:1"]
            if not slow:
                raise RuntimeError(f"PS 1 not flagged: {[(e.kind, e.node, e.evidence) for e in srv.events.list()]}")
            out["detect_s"] = slow[0].time - fa
            t_enable = time.time()
            srv.ps_mover = MigrationPsMover(srv.ps_addresses, GrpcPsFleet(RPC), keep=cfg.nd.keep)
            settle_s = 3 * cfg.nd.cooldown_windows * cfg.monitor.window_s
            last_move = 0.0
            while time.time() < t_enable + 30.0:  # settled: no move for 3 cooldowns
                moves = [e for e in srv.events.list() if e.kind == "move_vshards_done"]
                if moves:
                    last_move = moves[-1].time
                    if time.time() - last_move > settle_s:
                        break
                time.sleep(0.1)
            if not last_move:
                raise RuntimeError(f"no vshard move within 30 s: {[(e.kind, e.evidence) for e in srv.events.list()]}")
            t_after = last_move + 0.25
            time.sleep(max(0.0, t_after + phase_s - time.time()))
            srv.ps_mover = None  # layout frozen: the control phase runs on exactly this layout
            out["after"] = rate(t_after, t_after + phase_s)
            if t_after + phase_s > fend:
                raise RuntimeError(f"the fault ended {t_after + phase_s - fend:.1f}s before the 'after' phase did; "
                                   "raise the fault duration")
            with PsClient(addrs, RPC) as c:
                layout = sorted(c.refresh_map().vshards_of(1))
            edge = 0.3  # skip the switch at each window's start (PS-side clock vs ours, in-flight requests)
            samples = []  # (first, last) snapshot of each window: CPU per process, requests per PS
            for a, b, _on in windows:
                time.sleep(max(0.0, t_launch + a + edge - time.time()))
                first = _e2_snapshot([int(i["pid"]) for i in ready_info], [int(i["metrics_port"]) for i in ready_info],
                                     tids)
                time.sleep(max(0.0, t_launch + b - time.time()))
                samples.append((first, _e2_snapshot([int(i["pid"]) for i in ready_info],
                                                    [int(i["metrics_port"]) for i in ready_info], tids)))
            rates = [(rate(t_launch + a + edge, t_launch + b), on) for a, b, on in windows]
            paired = [(rates[i][0] if rates[i][1] else rates[i + 1][0]) /
                      max(rates[i + 1][0] if rates[i][1] else rates[i][0], 1e-9) for i in range(0, len(rates), 2)]
            out["paired"] = paired
            acct = _e2_window_figures(samples, done, [on for _a, _b, on in windows])
            out.update(acct)
            out["control"] = statistics.mean(r for r, on in rates if not on)
            out["on_rates"] = [round(r, 1) for r, on in rates if on]
            out["off_rates"] = [round(r, 1) for r, on in rates if not on]
            with PsClient(addrs, RPC) as c:
                if sorted(c.refresh_map().vshards_of(1)) != layout:
                    raise RuntimeError("the layout changed between the 'after' and 'control' phases")
            out["move_s"] = last_move - t_enable
            out["recover_s"] = out["detect_s"] + out["move_s"]
            out["moves"] = len([e for e in srv.events.list() if e.kind == "move_vshards_done"])
            out["left"] = len(layout)
            stop.set()
            for t in threads:
                t.join(30)
            if errors:
                raise errors[0]
            return out
        finally:
            srv.stop(grace=0)  # first: no vshard move may start against stopping PS processes
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(15)


def _ratio_stats(vals: Sequence[float], resamples: int = 20_000) -> dict[str, Any]:
    """How precisely paired ratios pin their centre: the geometric mean with a bootstrap 95%
    interval (percentiles of resampled means of the logs, fixed seed) and the exact two-sided
    sign test of "as many pairs above 1 as below" (its p-value; pairs equal to 1 are dropped).

    Args:
        vals: paired ratios (> 0).
        resamples: bootstrap resamples.
    """
    import math

    logs = np.log(np.asarray(vals, dtype=np.float64))
    rng = np.random.default_rng(0)
    means = logs[rng.integers(0, len(logs), (resamples, len(logs)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    above, below = int((logs > 0).sum()), int((logs < 0).sum())
    n, k = above + below, min(above, below)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0
    return {"geo_mean": round(float(np.exp(logs.mean())), 4),
            "ci95": [round(float(np.exp(lo)), 4), round(float(np.exp(hi)), 4)], "sign_p": round(p, 4)}


def _e2_accounting(rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What reached each PS and the CPU each process used, fault-on vs fault-off windows,
    over all runs of one ``keep`` (:func:`_e2_window_figures`' per-window records).

    Args:
        rs: the runs' results (each with ``windows`` and the ``paired_*`` lists).
    """
    wins = [w for r in rs for w in r["windows"]]
    out: dict[str, Any] = {}
    for tag, sel in (("on", True), ("off", False)):
        ws = [w for w in wins if w["on"] == sel]
        secs = sum(w["s"] for w in ws)
        out[tag] = {
            "windows": len(ws), "s": round(secs, 2), "steps_per_s": round(sum(w["steps"] for w in ws) / secs, 2),
            # CPU share of one core per process (CPU-seconds / wall second) and the box's busy fraction
            "cpu_share": {k: round(sum(w["cpu_s"][k] for w in ws) / secs, 4) for k in ws[0]["cpu_s"]},
            "box_busy": round(statistics.mean(w["box_busy"] for w in ws), 4),
            "ps_data_requests": [sum(w["requests"][k]["data"] for w in ws) for k in range(2)],
            "ps_other_requests": [{m: sum(w["requests"][k]["other"].get(m, 0) for w in ws)
                                   for m in sorted({m for w in ws for m in w["requests"][k]["other"]})}
                                  for k in range(2)],
        }
    for key in ("paired_wall", "paired_per_client_cpu", "paired_per_fleet_cpu", "ps1_cpu_share_on_minus_off"):
        allv = [v for r in rs for v in r[key]]
        out[key] = {"median_of_runs": round(statistics.median(statistics.median(r[key]) for r in rs), 4),
                    "median": round(statistics.median(allv), 4), "min": round(min(allv), 4),
                    "max": round(max(allv), 4), "pairs": len(allv),
                    "above_1" if key.startswith("paired") else "above_0":
                        sum(1 for v in allv if v > (1.0 if key.startswith("paired") else 0.0))}
        if key.startswith("paired"):
            out[key].update(_ratio_stats(allv))
    return out


def e2(runs: int, quick: bool = False, pairs: int = 4, keeps: Sequence[int] | None = None) -> dict[str, Any]:
    """One of 2 real PS processes slowed by added latency; ND vshard migration, like for like.

    For the product's default ``[controller.nd] keep`` (1) and for keep=0 (the slow PS
    drained), ``runs`` fleets each: ``recovery_ratio`` = after / control (same clients, same
    migrated layout, fault vs no fault); median and [min, max] over the runs; ``accounting``:
    requests reaching each PS and each process's CPU in the fault-on vs fault-off windows,
    and the paired ratios per CPU-second beside the wall-clock ones (:func:`_e2_accounting`).

    Args:
        runs: fleets per ``keep``.
        quick: 2 s windows instead of 4 s.
        pairs: fault-on/off window pairs per run.
        keeps: the ``keep`` values to run (default: the product's default, then 0).
    """
    start, phase = 45.0, (2.0 if quick else 4.0)  # PS start takes up to ~25 s on the loaded box
    out: dict[str, Any] = {}
    for keep in (keeps if keeps is not None else (NdConfig().keep, 0)):
        rs = []
        for r in range(runs):
            got = _e2_run(keep, start, phase, r, pairs=pairs)
            say(f"e2 keep={keep} run {r}: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else
                                                               [round(x, 4) for x in v] if k.startswith(("paired", "ps1_"))
                                                               else v)
                                                           for k, v in got.items()}))
            rs.append(got)
        tag = f"keep{keep}"

        def summary(key: str, rs: list[dict[str, Any]] = rs) -> dict[str, float]:
            vals = [r[key] for r in rs]
            return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4),
                    "max": round(max(vals), 4)}

        for r in rs:
            r["paired_ratio"] = statistics.median(r["paired"])
            r["recovery_ratio"] = r["after"] / r["control"]
            r["no_action_ratio"] = r["straggler"] / r["baseline"]
            r["after_vs_original_layout"] = r["after"] / r["baseline"]
            r["control_vs_original_layout"] = r["control"] / r["baseline"]
        every_pair = [p for r in rs for p in r["paired"]]
        out[tag] = {"runs": runs, "paired_ratio": summary("paired_ratio"),
                    "paired_all": {"median": round(statistics.median(every_pair), 4),
                                   "min": round(min(every_pair), 4), "max": round(max(every_pair), 4),
                                   "pairs": len(every_pair)},
                    "recovery_ratio": summary("recovery_ratio"),
                    "no_action_ratio": summary("no_action_ratio"),
                    "after_vs_original_layout": summary("after_vs_original_layout"),
                    "control_vs_original_layout": summary("control_vs_original_layout"),
                    "recover_s": summary("recover_s"), "detect_s": summary("detect_s"),
                    "left": [r["left"] for r in rs], "moves": [r["moves"] for r in rs],
                    "accounting": _e2_accounting(rs)}
        say(f"e2 keep={keep} accounting: " + json.dumps(out[tag]["accounting"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one seed / one run of each, shorter runs")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--e5i-epochs", type=int, default=None,
                    help=f"epochs of {E5_ROWS} rows in the e5i run (default: 8 with --quick, else 16)")
    ap.add_argument("--e5-global-batch", type=int, default=1024,
                    help="e5i: units per step, both workers together (default 1024; the arm windows "
                         "last 10 s x this / 1024)")
    ap.add_argument("--only", default="", help="comma-separated subset: sim,e6,e1,e2,e5,e5i (default: all; "
                                               "sim includes e6)")
    ap.add_argument("--e2-pairs", type=int, default=4, help="E2: fault-on/off window pairs per run (default 4)")
    ap.add_argument("--e2-runs", type=int, default=0, help="E2: runs per keep (default: 1 with --quick, else 3)")
    ap.add_argument("--e2-keep", default="", help="E2: comma-separated keep values (default: the product's, then 0)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs the simulations' code paths and prints the JSON line: only the "
                         "simulations (sim, e6) unless --only says otherwise, one seed, 16 batches per file, one E6 "
                         "pair, 10+10 E5 sim steps; real-process arms named in --only run at --quick size; "
                         "seconds, figures meaningless")
    ap.add_argument("--serve-controller", default="", help=argparse.SUPPRESS)  # E6's controller process
    # E6's controller process: batches per file of its dataset (the parent's --smoke passes its own)
    ap.add_argument("--serve-batches", type=int, default=BATCHES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.e5_global_batch < REAL_WORKERS_E5:
        ap.error(f"--e5-global-batch must be >= {REAL_WORKERS_E5} (one unit per worker), got {args.e5_global_batch}")
    if args.serve_controller:
        return _serve_controller(args.serve_controller, args.serve_batches)
    logging.basicConfig(level=logging.WARNING)
    only = set(args.only.split(",")) if args.only else {"sim"} if args.smoke else {"sim", "e1", "e2", "e5", "e5i"}
    args.quick = args.quick or args.smoke  # real-process arms named in --only: their --quick size
    seeds = [0] if args.quick else list(range(args.seeds))
    batches = SMOKE_BATCHES if args.smoke else BATCHES
    figures: dict[str, Any] = {"seeds": len(seeds), "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
                               **({"smoke": True, "sim_batches_per_file": batches} if args.smoke else {})}

    def show(tag: str, r: dict[str, Any]) -> None:
        say(f"{tag}: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))

    if "sim" in only:
        res: dict[str, list[dict[str, Any]]] = {k: [] for k in ("e1", "e3", "e4", "e5")}
        for s in seeds:
            sims: tuple[tuple[str, Callable[[int], dict[str, float]]], ...] = (
                ("e1", lambda seed: e1(seed, batches)), ("e3", lambda seed: e3(seed, batches)),
                ("e4", lambda seed: e4(seed, batches)), ("e5", lambda seed: e5(seed, 10 if args.smoke else 60)))
            for name, fn in sims:
                r = fn(s)
                res[name].append(r)
                show(f"seed {s} {name}{'_sim' if name in ('e1', 'e5') else ''}", r)

        def med(name: str, key: str) -> float:
            return round(statistics.median(r[key] for r in res[name]), 4)

        figures.update({
            "simulated": "e1_sim_* and e5_sim_* are simulations: threads sleeping 10 ms per batch / "
                         "b x per-sample time, 0.25 s / 0.1 s monitor windows, no training",
            "e1_sim_vs_static": med("e1", "vs_static"), "e1_sim_vs_ideal": med("e1", "vs_ideal"),
            "e1_sim_dynamic_s": med("e1", "dynamic_s"),
            "e3_actions": int(max(r["actions"] for r in res["e3"])),
            "e4_coverage": med("e4", "complete"), "e4_dup_shards_per_kill": med("e4", "dup_shards_per_kill"),
            "e4_time_ratio_vs_no_kill": med("e4", "time_ratio_vs_no_kill"),
            "e5_sim_dd_speedup": med("e5", "speedup"),
        })
    if only & {"sim", "e6"}:
        # E6, four ways: controller in the bench's process / in its own (production), one RPC per
        # shard (report on the next lease request) / two (GetShard + ReportShard, the old protocol);
        # each seed: 2 ABBA quadruples (dynamic, static, static, dynamic) per way
        variants = {"e6": (False, True), "e6_proc": (True, True), "e6_two_rpc": (False, False),
                    "e6_proc_two_rpc": (True, False)}
        r6: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
        for s in seeds:
            for name, (own, comb) in variants.items():
                r = e6(s, own_process=own, combined=comb, pairs=1 if args.quick else 2, batches=batches)
                r6[name].append(r)
                show(f"seed {s} {name}", r)
        for name in variants:
            figures[f"{name}_overhead"] = round(statistics.median(r["overhead"] for r in r6[name]), 4)
            figures[f"{name}_overhead_all"] = [round(r["overhead"], 4) for r in r6[name]]
            for key in ("rpc_critical_fraction", "rpc_wait_ms_per_shard", "rpcs_per_shard"):
                figures[f"{name}_{key}"] = round(statistics.median(r[key] for r in r6[name]), 4)
        figures["e6_load_avg_1m"] = round(os.getloadavg()[0], 2)
        cpu = e6_dds_cpu(shards=50 if args.smoke else 2000, reps=1 if args.quick else 3,
                         fsync_shards=10 if args.smoke else 300)
        show("e6 dds engine alone", cpu)
        figures.update({k: round(v, 4) for k, v in cpu.items()})
    if only & {"e1", "e5", "e5i"}:
        with tempfile.TemporaryDirectory() as tmpd:
            data = _real_data(Path(tmpd), args.quick)
            runs = 1 if args.quick else 3
            if "e1" in only:
                rs = [e1_real(s, data, args.quick, profile=(s == 0)) for s in range(runs)]
                for i, r in enumerate(rs):
                    show(f"run {i} e1 (real processes)", r)
                v = [r["vs_static"] for r in rs]
                figures.update(e1_vs_static=round(statistics.median(v), 4), e1_vs_static_min=round(min(v), 4),
                               e1_vs_static_max=round(max(v), 4), e1_runs=runs,
                               e1_dynamic_s=round(statistics.median(r["dynamic_s"] for r in rs), 2),
                               e1_profile={k: rs[0][k] for k in rs[0] if "sps" in k or "samples" in k})
                # additional figure, not a replacement: 1 fast + 1 slow worker fit the 2 cores better
                r2 = e1_real(0, data, args.quick, workers=2)
                show("e1 2 workers (real processes)", r2)
                figures.update(e1_2w_vs_static=round(r2["vs_static"], 4),
                               e1_2w_profile={k: r2[k] for k in r2 if "sps" in k or "samples" in k})
                # additional figure: the same 4 workers with staleness effectively unbounded
                r3 = e1_real(0, data, args.quick, max_staleness=1_000_000)
                show("e1 unbounded staleness (real processes)", r3)
                figures.update(e1_unbounded_staleness_vs_static=round(r3["vs_static"], 4),
                               e1_unbounded_staleness_profile={k: r3[k] for k in r3 if "sps" in k or "samples" in k})
            if "e5" in only:
                rs = [e5_real(s, data, args.quick) for s in range(runs)]
                for i, r in enumerate(rs):
                    show(f"run {i} e5 (real processes)", r)
                v = [r["speedup"] for r in rs]
                figures.update(e5_dd_speedup=round(statistics.median(v), 4), e5_dd_speedup_min=round(min(v), 4),
                               e5_dd_speedup_max=round(max(v), 4), e5_runs=runs,
                               e5_dd_sizes=rs[0]["dd_sizes"])
            if "e5i" in only:
                data5 = _real_data(Path(tmpd) / "e5", args.quick, rows=E5_ROWS)
                rs = [e5_real_interleaved(s, data5, args.quick, global_batch=args.e5_global_batch,
                                          epochs=args.e5i_epochs) for s in range(runs)]
                for i, r in enumerate(rs):
                    show(f"run {i} e5 interleaved (real processes)", r)
                allr = [x for r in rs for x in r["pair_ratios"]] if all("pair_ratios" in r for r in rs) else []
                figures.update(e5_interleaved_speedup=round(statistics.median(allr), 4) if allr else None,
                               e5_interleaved_pairs=len(allr),
                               e5_interleaved_pair_min=round(min(allr), 4) if allr else None,
                               e5_interleaved_pair_max=round(max(allr), 4) if allr else None,
                               e5_interleaved_runs=runs, e5_interleaved_plan=rs[0].get("dd_plan"),
                               e5_interleaved_global_batch=args.e5_global_batch,
                               e5_interleaved_rows=E5_ROWS,
                               e5_interleaved_window_s=rs[0].get("window_s"),
                               e5_interleaved_period_ratio=rs[0].get("period_ratio"),
                               e5_interleaved_profile=rs[0].get("profile"),
                               e5_interleaved_learned=rs[0].get("learned"),
                               e5_interleaved_settled=rs[0].get("settled"),
                               e5_interleaved_hidden=rs[0].get("hidden"))
    if "e2" in only:
        # E2 starts real PS processes (~10-20 s each under load)
        e2r = e2(args.e2_runs or (1 if args.quick else 3), quick=args.quick, pairs=args.e2_pairs,
                 keeps=[int(k) for k in args.e2_keep.split(",")] if args.e2_keep else None)
        for tag, r in e2r.items():
            figures[f"e2_{tag}_paired_ratio"] = r["paired_ratio"]
            figures[f"e2_{tag}_paired_all"] = r["paired_all"]
            figures[f"e2_{tag}_recovery_ratio"] = r["recovery_ratio"]
            figures[f"e2_{tag}_no_action_ratio"] = r["no_action_ratio"]
            figures[f"e2_{tag}_after_vs_original_layout"] = r["after_vs_original_layout"]
            figures[f"e2_{tag}_control_vs_original_layout"] = r["control_vs_original_layout"]
            figures[f"e2_{tag}_recover_s"] = r["recover_s"]
            figures[f"e2_{tag}_accounting"] = r["accounting"]
    figures["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
