"""PS pull/push throughput against a raw gRPC bytes echo, plus memory per row.

Run::

    python -m bench.ps_throughput [--quick] [--device cpu|cuda] [--pull-push]
    python -m bench.ps_throughput --smoke   # 32K rows, 0.2 s per rate, 1 and 2 shards (no 4); figures meaningless

``--pull-push``: only the echo baseline, one shard (fp32 and fp16) and the store alone
on the bench population (no 2/4 shards, no 1M-row memory figure): the
``pull_vs_echo`` / ``push_vs_echo`` figures in a minute or two, for repeated runs.

``--ab ROUNDS``: the data plane's old path against the new one side by side in ONE run:
one echo process and one shard process stay up while this process alternates the echo,
a protobuf client (``PsClient(framed=False)``: PullMany/PushMany) and a framed client
(the default: PullFrame/PushFrame, ``ps/frame.py``) for ROUNDS rounds (order rotated each
round); each round's ratios use that round's echo. ``--ab-threads N`` (default 2; 0 = off)
adds a second shard process with ``[ps] intra_op_threads = N`` and a framed client against
it (``newtN_*`` figures); the other shard runs with the default, 1. Besides rows/s it records the CPU time
per 16K-row call (this process + the server process, ``*_cpu_ms``) and its ratio to the
echo's (``*_cpu_vs_echo``), which other jobs' load barely moves. Last line: per-round
figures, medians and the load average.

Every server (the PS shards and the echo baseline) runs in its own process,
started fresh with ``spawn``, like production. The client is this process.

* echo baseline: the same thread-pool gRPC server type (``common.rpc.make_server``)
  with raw ``bytes`` handlers: for pull it receives the ids and returns a
  payload the size of the rows; for push it receives ids + grads and returns 2 bytes.
* PS: ``PsClient.pull/push`` (dedup, routing, PullMany/PushMany, reassembly)
  against PS shard processes; dim 64, 16K unique ids per request, rowwise Adagrad.
* shards 1, 2, 4: the same client against N shard processes (2 cores here: more
  processes share the same cores, so expect no linear scaling).
* memory: a ShardStore filled with 1M rows (dim 64) vs the raw bytes of the rows
  and their optimizer state.

The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.procstat import stat_cpu_s

DIM = 64
ROWS_PER_REQ = 16 * 1024
TOKEN = "bench-token"


def _progress(msg: str) -> None:
    print(msg, flush=True)


# -- server processes -----------------------------------------------------------------
def _serve_echo(port_file: str, dim: int) -> None:
    import grpc

    from common.rpc import RpcConfig, make_server

    cfg = RpcConfig(token=TOKEN)
    replies: dict[tuple[int, int], bytes] = {}

    def pull(req: bytes, ctx: Any) -> bytes:
        n = len(req) // 8
        key = (n, 4)
        if key not in replies:
            replies[key] = os.urandom(n * dim * 4)
        return replies[key]

    def pull16(req: bytes, ctx: Any) -> bytes:
        n = len(req) // 8
        key = (n, 2)
        if key not in replies:
            replies[key] = os.urandom(n * dim * 2)
        return replies[key]

    def push(req: bytes, ctx: Any) -> bytes:
        return b"ok"

    server = make_server(cfg, max_workers=8)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Echo",
                {
                    "Pull": grpc.unary_unary_rpc_method_handler(pull),
                    "Pull16": grpc.unary_unary_rpc_method_handler(pull16),
                    "Push": grpc.unary_unary_rpc_method_handler(push),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def _serve_ps(port_file: str, shard: int, shards: int, capacity: int, device: str, intra_op_threads: int = 1) -> None:
    import torch

    torch.set_num_threads(1)
    if intra_op_threads > 1:  # [ps] intra_op_threads, as metaps/roles/ps.py sets it
        from ps import intra_op

        intra_op.set_threads(intra_op_threads)
    from common.rpc import RpcConfig
    from ps.config import OptimizerConfig, OptimizerKind, PsConfig, TableConfig
    from ps.factory import build_server

    ps_cfg = PsConfig(shards=shards, num_vshards=256, device=device, max_request_rows=1 << 20)
    table = TableConfig(name="t", dim=DIM, capacity=capacity, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.01))
    server = build_server(ps_cfg, RpcConfig(token=TOKEN), [table], shard)
    port = server.start("127.0.0.1:0")
    Path(port_file).write_text(str(port))
    server.wait()


def _start_many(specs: list[tuple[Any, tuple]]) -> list[tuple[mp.Process, int]]:
    """Start every server process at once (imports overlap), then wait until each serves."""
    ctx = mp.get_context("spawn")
    started = []
    for target, args in specs:
        fd, port_file = tempfile.mkstemp(prefix="psbench-")
        os.close(fd)
        os.unlink(port_file)
        proc = ctx.Process(target=target, args=(port_file, *args), daemon=True)
        proc.start()
        started.append((proc, port_file, target))
    out = []
    deadline = time.monotonic() + 180
    for proc, port_file, target in started:
        while not os.path.exists(port_file) or not Path(port_file).read_text():
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server process {target.__name__} did not start (exit {proc.exitcode})")
            time.sleep(0.05)
        time.sleep(0.05)
        out.append((proc, int(Path(port_file).read_text())))
        os.unlink(port_file)
    return out


def _start(target: Any, *args: Any) -> tuple[mp.Process, int]:
    return _start_many([(target, args)])[0]


# -- measurements --------------------------------------------------------------------------
def _rate(fn: Any, rows_per_call: int, seconds: float, min_calls: int = 3) -> float:
    fn()  # warm up (connections, allocations)
    n, t0 = 0, time.perf_counter()
    while n < min_calls or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return rows_per_call * n / (time.perf_counter() - t0)


def _id_batches(population: np.ndarray, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.choice(population, ROWS_PER_REQ, replace=False) for _ in range(count)]


def bench_echo(seconds: float) -> dict[str, float]:
    from common.rpc import RpcConfig, make_channel

    proc, port = _start(_serve_echo, DIM)
    try:
        ch = make_channel(f"127.0.0.1:{port}", RpcConfig(token=TOKEN))
        pull = ch.unary_unary("/bench.Echo/Pull")
        pull16 = ch.unary_unary("/bench.Echo/Pull16")
        push = ch.unary_unary("/bench.Echo/Push")
        ids = np.arange(ROWS_PER_REQ, dtype=np.int64)
        grads = np.random.default_rng(0).standard_normal((ROWS_PER_REQ, DIM)).astype(np.float32)

        def do_pull() -> None:
            out = pull(ids.tobytes(), timeout=30)
            np.frombuffer(out, dtype=np.float32)

        def do_pull16() -> None:
            out = pull16(ids.tobytes(), timeout=30)
            np.frombuffer(out, dtype=np.float16)

        def do_push() -> None:
            push(ids.tobytes() + grads.tobytes(), timeout=30)

        res = {
            "echo_pull_rows_s": _rate(do_pull, ROWS_PER_REQ, seconds),
            "echo_pull_fp16_rows_s": _rate(do_pull16, ROWS_PER_REQ, seconds),
            "echo_push_rows_s": _rate(do_push, ROWS_PER_REQ, seconds),
        }
        ch.close()
        return res
    finally:
        proc.kill()
        proc.join()


def bench_ps(shards: int, seconds: float, population: int, device: str, fp16: bool = True) -> dict[str, float]:
    from common.rpc import RpcConfig
    from ps.client import PsClient

    procs = _start_many([(_serve_ps, (s, shards, population // shards * 2 + 1024, device)) for s in range(shards)])
    try:
        addrs = [f"127.0.0.1:{port}" for _, port in procs]
        pop = np.random.default_rng(1).choice(1 << 40, population, replace=False).astype(np.int64)
        grads = np.random.default_rng(2).standard_normal((ROWS_PER_REQ, DIM)).astype(np.float32) * 0.01
        res: dict[str, float] = {}
        with PsClient(addrs, RpcConfig(token=TOKEN)) as client:
            for start in range(0, population, ROWS_PER_REQ * 4):  # admit every row first
                chunk = pop[start : start + ROWS_PER_REQ * 4]
                client.push({"t": (chunk, np.zeros((chunk.size, DIM), np.float32))})
            batches = _id_batches(pop, 8, 3)
            it = iter(range(1 << 30))

            def do_pull() -> None:
                client.pull({"t": batches[next(it) % len(batches)]})

            def do_push() -> None:
                client.push({"t": (batches[next(it) % len(batches)], grads)})

            res["pull_rows_s"] = _rate(do_pull, ROWS_PER_REQ, seconds)
            res["push_rows_s"] = _rate(do_push, ROWS_PER_REQ, seconds)
        if fp16:
            with PsClient(addrs, RpcConfig(token=TOKEN), value_dtype="fp16", grad_dtype="fp16") as client:
                res["pull_fp16_rows_s"] = _rate(do_pull_fp16 := (lambda: client.pull({"t": batches[next(it) % len(batches)]})), ROWS_PER_REQ, seconds)
                res["push_fp16_rows_s"] = _rate(lambda: client.push({"t": (batches[next(it) % len(batches)], grads)}), ROWS_PER_REQ, seconds)
                del do_pull_fp16
        return res
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.join()


def _echo_calls(port: int) -> tuple[Any, Any, Any]:
    """(pull, push, close) against the echo server on ``port`` (16K rows of dim 64 per call)."""
    from common.rpc import RpcConfig, make_channel

    ch = make_channel(f"127.0.0.1:{port}", RpcConfig(token=TOKEN))
    pull = ch.unary_unary("/bench.Echo/Pull")
    push = ch.unary_unary("/bench.Echo/Push")
    ids = np.arange(ROWS_PER_REQ, dtype=np.int64)
    grads = np.random.default_rng(0).standard_normal((ROWS_PER_REQ, DIM)).astype(np.float32)
    return (lambda: np.frombuffer(pull(ids.tobytes(), timeout=30), dtype=np.float32),
            lambda: push(ids.tobytes() + grads.tobytes(), timeout=30), ch.close)


def _rate_cpu(fn: Any, seconds: float, pid: int) -> tuple[float, float, float]:
    """(rows/s, client CPU ms per call, server CPU ms per call): CPU time barely moves with
    the load of other jobs, wall time does (a 2-core box at load 10-20)."""
    fn()
    n, t0, c0, s0 = 0, time.perf_counter(), time.process_time(), stat_cpu_s(f"/proc/{pid}/stat")
    while n < 3 or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    wall, client, server = time.perf_counter() - t0, time.process_time() - c0, stat_cpu_s(f"/proc/{pid}/stat") - s0
    return ROWS_PER_REQ * n / wall, client / n * 1e3, server / n * 1e3


def bench_ab(rounds: int, seconds: float, population: int, device: str, threads: int = 0) -> dict[str, Any]:
    """Echo, protobuf client and framed client against the same processes, alternated (see the module doc).

    Args:
        threads: > 1 adds a shard with ``[ps] intra_op_threads = threads`` and a framed client on it.
    """
    from common.rpc import RpcConfig
    from ps.client import PsClient

    specs: list[tuple[Any, tuple]] = [(_serve_echo, (DIM,)), (_serve_ps, (0, 1, population * 2 + 1024, device, 1))]
    if threads > 1:
        specs.append((_serve_ps, (0, 1, population * 2 + 1024, device, threads)))
    procs = _start_many(specs)
    load0 = os.getloadavg()[0]
    try:
        echo_pull, echo_push, echo_close = _echo_calls(procs[0][1])
        addrs = [f"127.0.0.1:{procs[1][1]}"]
        pop = np.random.default_rng(1).choice(1 << 40, population, replace=False).astype(np.int64)
        grads = np.random.default_rng(2).standard_normal((ROWS_PER_REQ, DIM)).astype(np.float32) * 0.01
        clients = {"base": PsClient(addrs, RpcConfig(token=TOKEN), framed=False), "new": PsClient(addrs, RpcConfig(token=TOKEN))}
        pids = {"echo": procs[0][0].pid, "base": procs[1][0].pid, "new": procs[1][0].pid}
        if threads > 1:
            clients[f"newt{threads}"] = PsClient([f"127.0.0.1:{procs[2][1]}"], RpcConfig(token=TOKEN))
            pids[f"newt{threads}"] = procs[2][0].pid
        for name in [n for n in clients if n != "base"]:  # admit every row first (each shard its own)
            for start in range(0, population, ROWS_PER_REQ * 4):
                chunk = pop[start : start + ROWS_PER_REQ * 4]
                clients[name].push({"t": (chunk, np.zeros((chunk.size, DIM), np.float32))})
        batches = _id_batches(pop, 8, 3)
        it = iter(range(1 << 30))
        calls: dict[str, tuple[Any, Any]] = {"echo": (echo_pull, echo_push)}
        for name, c in clients.items():
            calls[name] = ((lambda c=c: c.pull({"t": batches[next(it) % len(batches)]})),
                           (lambda c=c: c.push({"t": (batches[next(it) % len(batches)], grads)})))
        order = ["echo", *clients]
        sides = list(clients)
        per_round = []
        for r in range(rounds):
            got: dict[str, float] = {}
            for name in order[r % len(order):] + order[: r % len(order)]:
                pid = pids[name]
                for k, op in enumerate(("pull", "push")):
                    rate, client_ms, server_ms = _rate_cpu(calls[name][k], seconds, pid)
                    got[f"{name}_{op}_rows_s"] = rate
                    got[f"{name}_{op}_cpu_ms"] = client_ms + server_ms  # client + server CPU per 16K-row call
                    got[f"{name}_{op}_server_cpu_ms"] = server_ms
            for side in sides:
                for op in ("pull", "push"):
                    got[f"{side}_{op}_vs_echo"] = got[f"{side}_{op}_rows_s"] / got[f"echo_{op}_rows_s"]
                    # the CPU form of the ratio: echo CPU / our CPU per call (what the wall ratio
                    # tends to when the client and the shard have their cores to themselves)
                    got[f"{side}_{op}_cpu_vs_echo"] = got[f"echo_{op}_cpu_ms"] / got[f"{side}_{op}_cpu_ms"]
            got["load_avg_1m"] = os.getloadavg()[0]
            per_round.append(got)
            _progress("      round {}: ".format(r + 1) + ", ".join(f"{k} {v:.2f}" for k, v in got.items() if "_vs_" in k or "cpu_ms" in k)
                      + f" (load {got['load_avg_1m']:.1f})")
        for c in clients.values():
            c.close()
        echo_close()
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.join()
    out: dict[str, Any] = {"ab_rounds": rounds, "load_avg_1m_start": load0, "intra_op_threads": {s: 1 for s in sides}}
    if threads > 1:
        out["intra_op_threads"][f"newt{threads}"] = threads
    for k in per_round[0]:
        out[f"median_{k}"] = float(np.median([g[k] for g in per_round]))
    for side in sides:
        for k in ("pull_vs_echo", "push_vs_echo", "pull_cpu_vs_echo", "push_cpu_vs_echo"):
            out[f"runs_{side}_{k}"] = [round(g[f"{side}_{k}"], 3) for g in per_round]
    for side in sides[1:]:
        for op in ("pull", "push"):
            out[f"{side}_vs_base_{op}"] = float(np.median([g[f"{side}_{op}_rows_s"] / g[f"base_{op}_rows_s"] for g in per_round]))
    return out


def bench_memory(rows: int, device: str, seconds: float = 1.0) -> dict[str, float]:
    """Bytes per row of a filled ShardStore vs raw rows + rowwise-Adagrad state; the store's own
    push / pull rows/s, each measured for ``seconds``."""
    import torch

    from ps.config import OptimizerConfig, OptimizerKind, TableConfig
    from ps.shard_store import ShardStore

    table = TableConfig(name="t", dim=DIM, capacity=rows, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD))
    store = ShardStore([table], shard_id=0, num_vshards=1, seed=0, device=device)
    ids = np.random.default_rng(5).choice(1 << 40, rows, replace=False).astype(np.int64)
    zeros = np.zeros((min(rows, 1 << 17), DIM), np.float32)
    for start in range(0, rows, zeros.shape[0]):
        chunk = ids[start : start + zeros.shape[0]]
        store.push("t", chunk, zeros[: chunk.size])
    raw = rows * (DIM * 4 + 4)  # fp32 row + one fp32 rowwise-Adagrad accumulator
    held = store.memory_bytes()
    stats = store.stats()
    # The store alone, in this process: the ceiling the service's push/pull can reach.
    batch = ids[np.random.default_rng(6).choice(rows, ROWS_PER_REQ, replace=False)]
    grads = np.random.default_rng(7).standard_normal((ROWS_PER_REQ, DIM)).astype(np.float32) * 0.01
    store_push = _rate(lambda: store.push("t", batch, grads), ROWS_PER_REQ, seconds)
    store_pull = _rate(lambda: store.pull("t", batch), ROWS_PER_REQ, seconds)
    del store
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"memory_rows": rows, "memory_bytes_per_row": held / rows, "raw_bytes_per_row": raw / rows,
            "bytes_per_row_ratio": held / raw, "memory_store_stats": stats,
            "store_push_rows_s": store_push, "store_pull_rows_s": store_pull}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="about a minute")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--pull-push", action="store_true", help="only echo, one shard and the store alone (see the docstring)")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                    help="protobuf vs framed data plane, alternated in one run for ROUNDS rounds (see the docstring)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every code path and prints the JSON line (32K rows, 0.2 s per "
                         "rate, 2 shards but not 4; seconds, figures meaningless); combines with --pull-push and --ab")
    ap.add_argument("--ab-threads", type=int, default=2, metavar="N",
                    help="with --ab: also a shard with [ps] intra_op_threads = N (0 or 1 = no such shard)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    seconds = 0.2 if args.smoke else 2.0 if args.quick else 6.0
    population = 2 * ROWS_PER_REQ if args.smoke else 200_000 if args.quick else 1_000_000
    if args.ab:
        extra = f", framed on a shard with intra_op_threads={args.ab_threads} (newt{args.ab_threads})" if args.ab_threads > 1 else ""
        _progress(f"A/B: echo vs protobuf (base) vs framed (new) data plane{extra}, {args.ab} rounds, shards with intra_op_threads=1")
        ab = bench_ab(args.ab, seconds, population, args.device, args.ab_threads)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in ab.items()}), flush=True)
        return 0
    out: dict[str, Any] = {"device": args.device, "dim": DIM, "rows_per_request": ROWS_PER_REQ, "cores": os.cpu_count()}

    _progress(f"[1/4] echo baseline (raw gRPC bytes, {ROWS_PER_REQ} rows x dim {DIM})")
    out.update(bench_echo(seconds))
    _progress(f"      echo pull {out['echo_pull_rows_s']:,.0f} rows/s, push {out['echo_push_rows_s']:,.0f} rows/s")

    _progress("[2/4] one PS shard (separate process), fp32 and fp16")
    one = bench_ps(1, seconds, population, args.device)
    out.update({f"ps1_{k}": v for k, v in one.items()})
    out["pull_vs_echo"] = one["pull_rows_s"] / out["echo_pull_rows_s"]
    out["push_vs_echo"] = one["push_rows_s"] / out["echo_push_rows_s"]
    out["pull_fp16_vs_echo_fp16"] = one["pull_fp16_rows_s"] / out["echo_pull_fp16_rows_s"]
    _progress(
        f"      pull {one['pull_rows_s']:,.0f} rows/s ({out['pull_vs_echo']:.2f}x echo), "
        f"push {one['push_rows_s']:,.0f} rows/s ({out['push_vs_echo']:.2f}x echo), "
        f"fp16 pull {one['pull_fp16_rows_s']:,.0f}, fp16 push {one['push_fp16_rows_s']:,.0f}"
    )

    _progress("[3/4] 2 and 4 shards (one process each; 2 cores shared)" + (": --smoke, 2 only" if args.smoke else ""))
    for n in () if args.pull_push else (2,) if args.smoke else (2, 4):
        r = bench_ps(n, seconds / 2 if args.quick or args.smoke else seconds, population, args.device, fp16=False)
        out[f"ps{n}_pull_rows_s"] = r["pull_rows_s"]
        out[f"ps{n}_push_rows_s"] = r["push_rows_s"]
        _progress(f"      {n} shards: pull {r['pull_rows_s']:,.0f} rows/s, push {r['push_rows_s']:,.0f} rows/s")

    mem_rows = population if args.pull_push or args.smoke else 1_000_000
    _progress(f"[4/4] memory per row with {mem_rows:,} rows; the store alone")
    mem = bench_memory(mem_rows, args.device, seconds=seconds if args.smoke else 1.0)
    out.update({k: v for k, v in mem.items() if k != "memory_store_stats"})
    _progress(
        f"      {mem['memory_bytes_per_row']:.1f} B/row held vs {mem['raw_bytes_per_row']:.1f} raw "
        f"({mem['bytes_per_row_ratio']:.2f}x); store alone: push {mem['store_push_rows_s']:,.0f} rows/s, "
        f"pull {mem['store_pull_rows_s']:,.0f} rows/s"
    )
    out["store_push_vs_echo"] = mem["store_push_rows_s"] / out["echo_push_rows_s"]
    out["store_pull_vs_echo"] = mem["store_pull_rows_s"] / out["echo_pull_rows_s"]
    out["load_avg_1m"] = os.getloadavg()[0]
    out["targets_met"] = {  # issue 15 point 1
        "pull_vs_echo>=0.6": out["pull_vs_echo"] >= 0.6,
        "push_vs_echo>=0.4": out["push_vs_echo"] >= 0.4,
        "bytes_per_row_ratio<=1.5": out["bytes_per_row_ratio"] <= 1.5,
    }
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
