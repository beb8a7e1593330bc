"""The PS's per-step handler (StepFrame) against a raw gRPC echo of the same bytes, and the store alone.

Run::

    python -m bench.ps_step [--quick] [--smoke] [--steps N] [--rounds N]

One fleet step of ``bench.peers``' job with one shard: 29 tables of dim 16 in one storage
group (rowwise Adagrad), ~1.7K unique ids a step (60 per table, drawn Zipf-like from 20K ids
per table, so rows are both new and reused), and 4 dense parameters (35K floats, Adam). Each
step is one ``StepFrame`` message (``ps/step_frame.py``): the push of step t, the dense
gradients (new values back) and the pull of the next batch.

Three measurements of the same messages, in rounds (each round: the PS, then the echo with the
PS's reply sizes; the store replay after the rounds):

* ``ps``: a PS shard process (``ps.factory.build_server``, 8 handler threads, token auth),
  the messages sent as a worker sends them; CPU per call of the shard process (its threads'
  ``schedstat``, nanoseconds): transport, handler and store together.
* ``echo``: a process built like it (``common.rpc.make_server``, 8 threads, the token
  interceptor) with one raw bytes handler that answers each request with a reply of the PS's
  reply size: the wire's cost of the same bytes.
* ``store``: the same calls the shard makes on a ``ShardStore`` in this process (thread CPU):
  ``push_group`` (untrusted: repeated ids checked, as for a remote caller), the dense update
  and values, ``pull_group``: what the shard must compute whatever the transport.

``ps_nonstore_cpu_per_rpc_vs_echo`` = (ps - store) / echo: what the shard spends per call
beyond the store, against a raw echo of the same bytes (issue 36's goal: <= 1.5). The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.procstat import sched_cpu_s

TOKEN = "bench-token"
TABLES = 29
DIM = 16
IDS_PER_TABLE = 60
POPULATION = 20_000
DENSE_SHAPES = {"mlp.0.weight": (128, 240), "mlp.0.bias": (128,), "mlp.2.weight": (64, 128), "mlp.2.bias": (64,)}
NAMES = tuple(f"t{i:02d}" for i in range(TABLES))


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _tables() -> list[Any]:
    from ps.config import OptimizerConfig, OptimizerKind, TableConfig

    opt = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.05)
    return [TableConfig(name=n, dim=DIM, capacity=TABLES * POPULATION, optimizer=opt) for n in NAMES]


def _ps_cfg() -> Any:
    from ps.config import PsConfig

    return PsConfig(shards=1, num_vshards=64, device="cpu", seed=3)


def _serve_ps(port_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    from common.rpc import RpcConfig
    from ps.factory import build_server

    server = build_server(_ps_cfg(), RpcConfig(token=TOKEN), _tables(), 0, max_workers=8)
    port = server.start("127.0.0.1:0")
    Path(port_file).write_text(str(port))
    server.wait()


def _serve_echo(port_file: str) -> None:
    import grpc

    from common.rpc import RpcConfig, make_server

    replies: dict[int, bytes] = {}

    def step(req: bytes, ctx: Any) -> bytes:
        n = int.from_bytes(req[-8:], "little")  # the reply size the PS gave this request
        got = replies.get(n)
        if got is None:
            got = replies[n] = os.urandom(n)
        return got

    server = make_server(RpcConfig(token=TOKEN), max_workers=8)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Echo", {"Step": grpc.unary_unary_rpc_method_handler(step)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def _start(target: Any) -> tuple[Any, int]:
    from bench.ps_throughput import _start_many

    return _start_many([(target, ())])[0]


def _steps(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per step: counts [TABLES], unique ids per table concatenated, grads [N, DIM]."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = [np.unique(np.minimum(rng.zipf(1.3, IDS_PER_TABLE * 2), POPULATION))[:IDS_PER_TABLE].astype(np.int64)
               for _ in NAMES]
        counts = np.array([i.size for i in ids], dtype=np.int64)
        flat = np.concatenate(ids)
        out.append((counts, flat, rng.standard_normal((flat.size, DIM)).astype(np.float32) * 0.01))
    return out


def _messages(steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]], map_version: int) -> list[bytes]:
    """One StepFrame per step: push of step t, dense gradients, pull of step t+1's ids."""
    from ps import group_frame, step_frame
    from ps.wire import DType

    sizes = [int(np.prod(s)) for s in DENSE_SHAPES.values()]
    rng = np.random.default_rng(11)
    out = []
    for t, (counts, flat, grads) in enumerate(steps):
        nxt_counts, nxt_flat, _ = steps[(t + 1) % len(steps)]
        push = group_frame.encode_push([(NAMES, counts, flat, grads, None)], grad_dtype=DType.FP32,
                                       map_version=map_version, worker_id="w0", step=t)
        pull = group_frame.encode_pull([(NAMES, nxt_counts, nxt_flat, None)], fp16=False, map_version=map_version,
                                       worker_id="w0", step=t + 1)
        dense = step_frame.encode_dense(list(DENSE_SHAPES), rng.standard_normal(sum(sizes)).astype(np.float32) * 1e-3, sizes)
        out.append(step_frame.encode_step(step_frame.REQUEST, push=push, dense=dense, pull=pull,
                                          flags=step_frame.FLAG_WANT_VALUES))
    return out


def _store_replay(steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]], dense0: dict[str, np.ndarray],
                  count: int) -> list[float]:
    """Thread CPU ms of the store doing each of the first ``count`` steps (push, dense, pull)."""
    import torch

    from ps import step_frame
    from ps.shard_store import ShardStore

    store = ShardStore(_tables(), shard_id=0, num_vshards=64, seed=_ps_cfg().seed)
    for n, v in dense0.items():
        store.dense.register(n, v)
    sizes = [int(np.prod(s)) for s in DENSE_SHAPES.values()]
    rng = np.random.default_rng(11)
    dense = [step_frame.encode_dense(list(DENSE_SHAPES), rng.standard_normal(sum(sizes)).astype(np.float32) * 1e-3, sizes)
             for _ in steps]
    out = []
    gi = store.group_of(NAMES)
    for t in range(count):
        counts, flat, grads = steps[t]
        nxt_counts, nxt_flat, _ = steps[(t + 1) % len(steps)]
        ids, g, nxt = torch.from_numpy(flat), torch.from_numpy(grads), torch.from_numpy(nxt_flat)
        sec = step_frame.decode_dense(dense[t])
        c0 = time.thread_time()
        store.push_group(gi, counts, ids, g, trusted=False)
        store.dense.push(sec.split())
        store.dense.pull(sec.names)
        store.pull_group(gi, nxt_counts, nxt)
        out.append(1e3 * (time.thread_time() - c0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds of 40 steps")
    ap.add_argument("--smoke", action="store_true", help="2 rounds of 4 steps (figures meaningless)")
    ap.add_argument("--steps", type=int, default=0, help="steps per round (default 100; quick 40; smoke 4)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 9; quick 5; smoke 2)")
    args = ap.parse_args(argv)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    per = args.steps or {"smoke": 4, "quick": 40, "full": 100}[size]
    rounds = args.rounds or {"smoke": 2, "quick": 5, "full": 9}[size]
    import torch

    torch.set_num_threads(1)
    from common.rpc import RpcConfig, make_channel
    from ps import step_frame
    from ps.client import PsClient

    _progress(f"ps_step: {rounds} rounds of {per} steps; {TABLES} tables x dim {DIM}, {IDS_PER_TABLE} ids a table, "
              f"{sum(int(np.prod(s)) for s in DENSE_SHAPES.values()):,} dense floats")
    (ps_proc, ps_port), (echo_proc, echo_port) = _start(_serve_ps), _start(_serve_echo)
    try:
        rpc = RpcConfig(token=TOKEN)
        client = PsClient([f"127.0.0.1:{ps_port}"], rpc, worker_id="w0", register=True)
        rng = np.random.default_rng(5)
        dense0 = {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in DENSE_SHAPES.items()}
        client.register_dense(dense0)
        steps = _steps(rounds * per + 1, seed=1)
        msgs = _messages(steps, client.pmap.version)
        ps_call = client._step_frame[0]
        ch = make_channel(f"127.0.0.1:{echo_port}", rpc)
        echo_call = ch.unary_unary("/bench.Echo/Step")
        reply_len: list[int] = []
        ps_ms, echo_ms = [], []
        req_bytes = statistics.fmean(len(m) for m in msgs)
        for r in range(rounds):  # the PS first: the echo answers each request with the PS's reply size
            chunk = range(r * per, (r + 1) * per)
            c0 = sched_cpu_s(ps_proc.pid)
            for t in chunk:
                reply = step_frame.decode_step(ps_call(msgs[t], timeout=60), step_frame.REPLY)
                if reply.pull_deferred:
                    raise RuntimeError(f"step {t}: pull deferred: {reply.deferred_reason}")
                reply_len.append(sum(p.nbytes for p in (reply.push, reply.dense, reply.pull) if p is not None) + 32)
            ps_ms.append(1e3 * (sched_cpu_s(ps_proc.pid) - c0) / per)
            c0 = sched_cpu_s(echo_proc.pid)
            for t in chunk:
                echo_call(msgs[t] + reply_len[t].to_bytes(8, "little"), timeout=60)
            echo_ms.append(1e3 * (sched_cpu_s(echo_proc.pid) - c0) / per)
            _progress(f"  round {r + 1}/{rounds}: ps {ps_ms[-1]:.3f} ms CPU/call, echo {echo_ms[-1]:.3f}")
        store_ms = _store_replay(steps, dense0, rounds * per)
        store_round = [statistics.fmean(store_ms[r * per:(r + 1) * per]) for r in range(rounds)]
        ch.close()
        client.close()
    finally:
        for proc in (ps_proc, echo_proc):
            proc.kill()
            proc.join()
    ps_med, echo_med, store_med = statistics.median(ps_ms), statistics.median(echo_ms), statistics.median(store_round)
    per_round = [(p - s) / max(e, 1e-9) for p, s, e in zip(ps_ms, store_round, echo_ms)]
    out: dict[str, Any] = {
        "bench": "ps_step", "rounds": rounds, "steps_per_round": per, "request_bytes": round(req_bytes),
        "reply_bytes": round(statistics.fmean(reply_len)),
        "ps_cpu_ms_per_call": round(ps_med, 3), "echo_cpu_ms_per_call": round(echo_med, 3),
        "store_cpu_ms_per_step": round(store_med, 3), "ps_nonstore_cpu_ms_per_call": round(ps_med - store_med, 3),
        "ps_nonstore_cpu_per_rpc_vs_echo": round(statistics.median(per_round), 3),
        "paired": {"min": round(min(per_round), 3), "max": round(max(per_round), 3)},
        "loadavg": os.getloadavg()[0],
    }
    _progress(f"ps {ps_med:.3f} ms = store {store_med:.3f} + other {ps_med - store_med:.3f}; echo {echo_med:.3f}: "
              f"non-store / echo {out['ps_nonstore_cpu_per_rpc_vs_echo']:.2f}")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    raise SystemExit(main())
