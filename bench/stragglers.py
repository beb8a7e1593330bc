"""Straggler benchmark: simulated workers against a real controller over gRPC.

Workers are threads that "process" a batch by sleeping ``base_s * slowdown``;
every shard goes through the real controller (GetShard / ReportShard /
ReportMetrics on 127.0.0.1). Figures are ratios measured side by side in the
same run, medians over seeds.

    E1  4 workers, one 4x slower: dynamic sharding vs a static equal split, and vs ideal
    E2  2 real `metaps ps` processes, PS 1 slowed by +20 ms per request (fault injection), 2
        client threads pulling/pushing 256 random ids per step: steps/s before the fault, with
        the fault and no action, and after the ND policy's vshard moves (the controller's
        MigrationPsMover); e2_recovery_ratio = after / before (keep=0: the slow PS drained)
    E3  transient slowdowns only: actions taken (must be 0)
    E4  a worker killed mid-shard: coverage, duplicated shards per kill, time vs no kill
    E5  all-reduce, one worker 2x slower: DD speed-proportional batches vs equal batches
    E6  no stragglers: dynamic sharding overhead vs a static split

Run: ``python -m bench.stragglers [--quick]``; the last line is a JSON object.
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
from typing import Any, Callable

import numpy as np

from controller.client import ControllerClient
from controller.config import ControllerConfig, DdConfig, DdsConfig, MonitorConfig, NdConfig, PolicyKind
from controller.dds import DatasetKind, DatasetSpec
from controller.server import ControllerServer
from metaps.faults import Fault, FaultConfig, FaultInjector
from metaps.rpc import RpcConfig

RPC = RpcConfig(token="bench")
BASE_S = 0.010      # one batch at normal speed
BPS = 16            # batches per shard
WORKERS = 4


def say(msg: str) -> None:
    print(msg, flush=True)


def controller(tmp: str, policy: PolicyKind = PolicyKind.ND, files: int = 8, batches: int = 160,
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
                consecutive: int = 2, files: int = 8) -> dict[str, Any]:
    """All workers pull shards until DONE. ``slow(worker, t)`` is the slowdown factor."""
    with tempfile.TemporaryDirectory() as tmp:
        srv = controller(tmp, consecutive=consecutive, files=files)
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
    total = files * 160
    speeds = [p / b for p, b in zip(processed, busy) if b > 0]  # measured batches/s while busy
    return {"time": elapsed, "coverage": st["coverage"], "processed": sum(processed), "total": total,
            "ideal": total / sum(speeds),
            "actions": len(actions), "events": st["events"]}


def run_static(slow: Callable[[int, float], float], seed: int, files: int = 8) -> float:
    """Each worker trains a fixed equal quarter (no controller): time = the slowest."""
    rng = random.Random(seed)
    jitter = [[1 + rng.uniform(-0.05, 0.05) for _ in range(4096)] for _ in range(WORKERS)]
    share = files * 160 // WORKERS
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


def e1(seed: int) -> dict[str, float]:
    slow = lambda i, t: 4.0 if i == WORKERS - 1 else 1.0  # noqa: E731
    dyn = run_dynamic(slow, seed)
    assert dyn["coverage"]["complete"], dyn["coverage"]
    static = run_static(slow, seed)
    # ideal = work / sum of the speeds the workers really ran at (sleep overshoot included,
    # so the ratio charges dynamic sharding only for its own costs: RPCs, detection lag, tail)
    ideal = dyn["ideal"]
    return {"dynamic_s": dyn["time"], "static_s": static, "ideal_s": ideal,
            "vs_static": static / dyn["time"], "vs_ideal": dyn["time"] / ideal}


def e3(seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    faults = []
    for i in range(WORKERS):  # 0.2 s blips at 3x, well apart: never 3 slow windows in a row
        for start in (0.4 + rng.uniform(0, 0.3), 1.6 + rng.uniform(0, 0.3)):
            faults.append(Fault("worker", i, "slow", factor=3.0, start_s=start + 0.1 * i, duration_s=0.2))
    cfg = FaultConfig(faults)
    injectors = [FaultInjector(cfg, "worker", i, t0=0.0, clock=time.monotonic) for i in range(WORKERS)]
    t_start = time.monotonic()
    slow = lambda i, t: injectors[i].slowdown(t_start + t)  # noqa: E731
    dyn = run_dynamic(slow, seed, consecutive=3, files=4)
    return {"actions": dyn["actions"], "time": dyn["time"]}


def e4(seed: int) -> dict[str, float]:
    slow = lambda i, t: 1.0  # noqa: E731
    base = run_dynamic(slow, seed, files=4)
    dyn = run_dynamic(slow, seed, kill=(1, 0.8 + 0.1 * seed), files=4)
    cov = dyn["coverage"]
    replayed_batches = dyn["processed"] - dyn["total"] + cov["duplicate_batches"]
    return {"complete": float(cov["complete"]), "dup_shards_per_kill": replayed_batches / BPS,
            "ledger_duplicates": cov["duplicate_entries"] + cov["stale_entries"],
            "time_ratio_vs_no_kill": dyn["time"] / base["time"]}


def e6(seed: int) -> dict[str, float]:
    slow = lambda i, t: 1.0  # noqa: E731
    dyn = run_dynamic(slow, seed, files=8)
    static = run_static(slow, seed, files=8)
    return {"dynamic_s": dyn["time"], "static_s": static, "overhead": dyn["time"] / static - 1.0}


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


# ---------------------------------------------------------------------------- E2: slow PS
E2_LATENCY_S = 0.02   # added per request on PS 1 (fault injection)
E2_IDS = 256          # unique ids per pull/push step (one table, dim 16)
E2_CLIENTS = 2        # client threads, each: pull ids -> push grads -> next


def _e2_job(tmp: Path, fault_start_s: float) -> Path:
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
""")
    return job


def _e2_fleet(tmp: Path, job: Path, controller_addr: str) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", METAPS_T0=repr(time.time()))
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


def _e2_run(keep: int, start_s: float, phase_s: float, seed: int) -> dict[str, Any]:
    """One fleet, three phases on the same processes and clients::

        [fault - phase, fault)           baseline: both PS healthy
        fault: PS 1 gets +E2_LATENCY_S per request; the ND policy flags it, but no PsMover
        [fault + 0.5, +phase)            no action (the policy's moves are recorded as skipped)
        PsMover(keep) installed          the next MoveVshards runs; moves until nothing is left / healthy
        [settled, +phase)                after migration
    """
    from controller.ps_mover import MigrationPsMover
    from ps.client import PsClient

    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.ND, heartbeat_timeout_s=60.0,
                               monitor=MonitorConfig(window_s=0.25, consecutive=2),
                               nd=NdConfig(restart_after=0, move_vshards=8, cooldown_windows=2))
        srv = ControllerServer(cfg, tmp / "ctl", [], RPC)
        srv.start("127.0.0.1:0")
        t_launch = time.time()
        procs = _e2_fleet(tmp, _e2_job(tmp, start_s), srv.address)
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

            def work(i: int) -> None:
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
            time.sleep(max(0.0, fa + 0.5 + phase_s - time.time()))
            out: dict[str, Any] = {"baseline": rate(fa - phase_s, fa), "straggler": rate(fa + 0.5, fa + 0.5 + phase_s)}
            slow = [e for e in srv.events.list() if e.kind == "slow_detected" and e.node == "ps:1"]
            if not slow:
                raise RuntimeError(f"PS 1 not flagged: {[(e.kind, e.node, e.evidence) for e in srv.events.list()]}")
            out["detect_s"] = slow[0].time - fa
            t_enable = time.time()
            srv.ps_mover = MigrationPsMover(srv.ps_addresses, RPC, keep=keep)
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
            out["after"] = rate(t_after, t_after + phase_s)
            out["move_s"] = last_move - t_enable
            out["recover_s"] = out["detect_s"] + out["move_s"]
            out["moves"] = len([e for e in srv.events.list() if e.kind == "move_vshards_done"])
            with PsClient(addrs, RPC) as c:
                out["left"] = len(c.refresh_map().vshards_of(1))
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


def e2(seed: int, quick: bool = False) -> dict[str, Any]:
    """One of 2 real PS processes slowed by added latency: no action vs ND vshard migration.

    ``keep`` = vshards the mover leaves on the slow PS: 0 drains it (the headline
    figure), 1 is the mover's default (one probe vshard; measured in full runs).
    """
    start, phase = 25.0, (2.0 if quick else 4.0)
    drain = _e2_run(0, start, phase, seed)
    out = {
        "no_action_ratio": drain["straggler"] / drain["baseline"],
        "recovery_ratio": drain["after"] / drain["baseline"],
        "detect_s": drain["detect_s"], "recover_s": drain["recover_s"], "moves": drain["moves"], "left": drain["left"],
        "baseline_steps_per_s": drain["baseline"],
    }
    if not quick:
        keep1 = _e2_run(1, start, phase, seed)
        out.update(keep1_no_action_ratio=keep1["straggler"] / keep1["baseline"],
                   keep1_recovery_ratio=keep1["after"] / keep1["baseline"], keep1_left=keep1["left"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one seed of each (within ~2 minutes)")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    seeds = [0] if args.quick else list(range(args.seeds))
    res: dict[str, list[dict[str, Any]]] = {k: [] for k in ("e1", "e3", "e4", "e5", "e6")}
    for s in seeds:
        for name, fn in (("e1", e1), ("e3", e3), ("e4", e4), ("e5", e5), ("e6", e6)):
            r = fn(s)
            res[name].append(r)
            say(f"seed {s} {name}: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    # E2 starts real PS processes (~10-20 s each under load): once, not per seed
    e2r = e2(0, quick=args.quick)
    say("e2: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in e2r.items()}))

    def med(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in res[name]), 4)

    figures = {
        "seeds": len(seeds),
        "e1_vs_static": med("e1", "vs_static"), "e1_vs_ideal": med("e1", "vs_ideal"),
        "e1_dynamic_s": med("e1", "dynamic_s"),
        "e2_recovery_ratio": round(e2r["recovery_ratio"], 4), "e2_no_action_ratio": round(e2r["no_action_ratio"], 4),
        "e2_recover_s": round(e2r["recover_s"], 3), "e2_detect_s": round(e2r["detect_s"], 3),
        **({"e2_keep1_recovery_ratio": round(e2r["keep1_recovery_ratio"], 4)} if "keep1_recovery_ratio" in e2r else {}),
        "e3_actions": int(max(r["actions"] for r in res["e3"])),
        "e4_coverage": med("e4", "complete"), "e4_dup_shards_per_kill": med("e4", "dup_shards_per_kill"),
        "e4_time_ratio_vs_no_kill": med("e4", "time_ratio_vs_no_kill"),
        "e5_dd_speedup": med("e5", "speedup"),
        "e6_overhead": med("e6", "overhead"),
    }
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
