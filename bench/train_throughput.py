"""Training throughput of a PS fleet against ``metaps train-local`` on the same job and data.

Run::

    python -m bench.train_throughput [--quick] [--mode plain|meta]
    python -m bench.train_throughput --smoke   # 2K rows (meta: 8K), every configuration once; figures meaningless

Every configuration runs as real processes (``metaps ps``, ``metaps worker``,
``metaps train-local``) talking gRPC on loopback, in the same run, on the same
generated data and job file:

* ``local``: ``metaps train-local``: the same model, optimizers and step engine
  with the rows in an in-process ShardStore (no RPC). The baseline.
* ``1x1``: 1 PS shard + 1 worker, with and without ``[train] overlap`` (the pull
  of batch t+1 in flight while batch t computes).
* ``2x2``: 2 PS shards + 2 workers (static data split, overlap on); 6 processes
  share the 2 cores here, so expect no scaling, only the cost of the fleet.

samples/s is steady-state: from each worker's report history (a record every
``log_every`` steps with a timestamp and the cumulative samples), the samples
trained between its first and last record over the time between them. That
leaves out process start-up, data generation, evaluation and the first step,
which pays one-time lazy imports (``torch.func`` pulls in ``torch._dynamo``:
about 3 s here, as long as the whole quick run's training); every
configuration is measured the same way. For 2x2 the two workers' rates add up. The PS processes run
async mode (``[ps] sync = "async"``, bounded staleness 4), the fleet default.

The last line printed is a JSON object: ``dist_1x1_vs_local`` (target >= 0.6 on
2 cores), ``dist_2x2_vs_local``, ``overlap_gain`` (1x1 overlap on / off), and
the samples/s behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"
LOG_EVERY = 2


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def make_data(root: Path, rows: int, mode: str) -> Path:
    """Generated AntM2C-like rows built as a plain (256 rows a batch) or meta (S8/Q4) Meta-IO set."""
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.synth import GeneratorConfig, generate
    from meta_io.layout import Layout

    gen = generate(root / "raw", GeneratorConfig(rows=rows, users=max(100, rows // 40), items=max(100, rows // 80),
                                                 seed=11, n_files=2, row_group_rows=min(rows, 65_536)), progress=False)
    if mode == "plain":
        cfg = MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=256)
    else:
        cfg = MetaIOBuildConfig(support=8, query=4, rows_per_batch=768)
    return build(gen.out_dir, gen.schema_path, root / "data", cfg).out_dir


def write_job(path: Path, data: Path, run_dir: Path, *, mode: str, shards: int, workers: int, overlap: bool | str,
              epochs: int) -> Path:
    from common.toml_writer import dumps

    job = {
        "data": {"train": str(data)},
        "ps": {"shards": shards, "num_vshards": 64, "device": "cpu", "sync": "async",
               "table_defaults": {"dim": 16, "capacity": 200_000}},
        "model": {"kind": "dnn", "default_dim": 16, "hidden": [128, 64]},
        "train": {"mode": mode, "workers": workers, "epochs": epochs, "overlap": overlap, "log_every": LOG_EVERY,
                  "threads": 1},
        "rpc": {"token": TOKEN, "timeout_s": 60.0},
        "delivery": {"out": str(run_dir / "bundles")},
        "run": {"dir": str(run_dir), "plots": False},  # a throughput bench: no PNGs (~4 CPU-s a run)
    }
    path.write_text(dumps(job))
    return path


def _start_ps(config: Path, shard: int, tmp: Path) -> tuple[subprocess.Popen, str]:
    ready = tmp / f"ps-{shard}.ready"
    log = (tmp / f"ps-{shard}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "metaps", "ps", "--config", str(config), "--shard", str(shard),
                             "--port", "0", "--ready-file", str(ready), "--grace", "2"],
                            cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    return proc, str(ready)


def _await_ready(proc: subprocess.Popen, ready: str, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"metaps ps did not start (rc {proc.returncode}); see {Path(ready).with_suffix('.log')}")
        time.sleep(0.05)
    return f"127.0.0.1:{json.loads(Path(ready).read_text())['port']}"


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(tmp: Path, data: Path, mode: str, epochs: int) -> dict[str, Any]:
    """``metaps train-local`` as one process; its loop-time samples/s."""
    run_dir = tmp / "local"
    config = write_job(tmp / "local.toml", data, run_dir, mode=mode, shards=1, workers=1, overlap=False,
                       epochs=epochs)
    done = subprocess.run([sys.executable, "-m", "metaps", "train-local", "--config", str(config), "--json"],
                          cwd=REPO, env=_env(), check=True, stdout=subprocess.PIPE, text=True,
                          stderr=(tmp / "local.log").open("w"))
    run = Path(json.loads(done.stdout)["run_dir"])  # train-local makes [run] dir/<name>-<time>/
    rep = json.loads((run / "workers" / "worker-0.json").read_text())
    return {"samples": rep["samples"], "wall_s": rep["wall_s"], "samples_per_s": steady_rate(rep),
            "step_ms": _step_ms([rep])}


def steady_rate(report: dict[str, Any]) -> float:
    """Samples/s between a worker's first and last history records (after step 1's one-time costs)."""
    hist = report["history"]
    if len(hist) < 2:
        raise RuntimeError(f"too few history records ({len(hist)}) for a steady-state rate: use more data")
    first, last = hist[0], hist[-1]
    return (last["samples"] - first["samples"]) / max(last["time"] - first["time"], 1e-9)


def run_fleet(tmp: Path, data: Path, name: str, *, mode: str, shards: int, workers: int, overlap: bool | str,
              epochs: int) -> dict[str, Any]:
    """A fresh fleet: ``shards`` PS processes and ``workers`` worker processes (static split), one job file.

    The PS and the workers read the same job, so they share one run dir (the PS writes the
    workers' coordinated checkpoints under it and refuses any other root). Each configuration
    gets its own fleet: a warm PS (its tables already holding their ids) favours a second run
    on it a lot here (1x1 serial 0.4x -> 0.9x of local).
    """
    d = tmp / name
    d.mkdir()
    run_dir = d / "run"
    config = write_job(d / "job.toml", data, run_dir, mode=mode, shards=shards, workers=workers, overlap=overlap,
                       epochs=epochs)
    procs: list[subprocess.Popen] = []
    try:
        started = [_start_ps(config, k, d) for k in range(shards)]
        procs += [p for p, _ in started]
        addrs = [_await_ready(p, r) for p, r in started]
        wprocs = [subprocess.Popen([sys.executable, "-m", "metaps", "worker", "--config", str(config), "--rank",
                                    str(r), "--ps", ",".join(addrs), "--run-dir", str(run_dir)],
                                   cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                                   stderr=(d / f"worker-{r}.log").open("w"))
                  for r in range(workers)]
        procs += wprocs
        for r, p in enumerate(wprocs):
            if p.wait(timeout=1800) != 0:
                log = d / f"worker-{r}.log"
                raise RuntimeError(f"worker {r} of {name} failed (rc {p.returncode}); its log ends:\n"
                                   + log.read_text(errors="replace")[-3000:])
        reps = [json.loads((run_dir / "workers" / f"worker-{r}.json").read_text()) for r in range(workers)]
    finally:
        _stop(procs)
    return {
        "samples": sum(r["samples"] for r in reps), "wall_s": max(r["wall_s"] for r in reps),
        "samples_per_s": sum(steady_rate(r) for r in reps),
        "pull_s_share": _share(reps, "pull_s"), "push_s_share": _share(reps, "push_s"),
        "step_ms": _step_ms(reps),
        "overlap": [r.get("overlap") for r in reps],
    }


def _fmt(r: dict[str, Any], local: dict[str, Any] | None) -> str:
    rel = f" = {r['samples_per_s'] / local['samples_per_s']:.2f}x local" if local else ""
    ms = r.get("step_ms", {})
    parts = ", ".join(f"{k} {v:.0f}" for k, v in ms.items())
    return f"{r['samples_per_s']:,.0f} samples/s{rel}" + (f"  (mean step ms: {parts})" if parts else "")


def _step_ms(reps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean pull wait / compute / push+dense-sync milliseconds of the recorded steps after step 1."""
    hist = [h for r in reps for h in r["history"] if h["step"] > 1]
    if not hist:
        return {}
    return {k.removesuffix("_s"): 1000 * sum(h[k] for h in hist) / len(hist) for k in ("pull_s", "compute_s", "push_s")}


def _share(reps: list[dict[str, Any]], key: str) -> float:
    """Mean share of a step's time spent in ``key`` over the logged steps of every worker."""
    vals = [h[key] / max(h["pull_s"] + h["compute_s"] + h["push_s"], 1e-9) for r in reps for h in r["history"]]
    return sum(vals) / len(vals) if vals else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small data, within a minute")
    ap.add_argument("--mode", default="plain", choices=["plain", "meta"], help="plain CTR steps or G-Meta steps")
    ap.add_argument("--rows", type=int, default=0,
                    help="generated rows (default 8k quick, 100k full; smoke 2k plain, 8k meta)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every configuration and prints the JSON line (2k rows, 8k with "
                         "--mode meta, 1 epoch, one baseline run; figures meaningless)")
    args = ap.parse_args(argv)
    smoke_rows = 2_048 if args.mode == "plain" else 8_000  # >= 2 history records per worker in 2x2
    rows = args.rows or (smoke_rows if args.smoke else 8_000 if args.quick else 100_000)
    epochs = 1 if args.quick or args.smoke else 2
    out: dict[str, Any] = {"mode": args.mode, "rows": rows, "epochs": epochs, "cores": os.cpu_count()}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as td:
        tmp = Path(td)
        _progress(f"[0/5] generating {rows:,} rows, building a {args.mode} Meta-IO set")
        data = make_data(tmp, rows, args.mode)
        kw = dict(mode=args.mode, epochs=epochs)
        _progress("[1/5] train-local (baseline)")
        local = run_local(tmp, data, **kw)
        _progress(f"      {_fmt(local, None)}")
        _progress("[2/5] 1 PS + 1 worker, overlap on")
        on = run_fleet(tmp, data, "1x1-overlap", shards=1, workers=1, overlap=True, **kw)
        _progress(f"      {_fmt(on, local)}")
        _progress("[3/5] 1 PS + 1 worker, overlap off (a fresh PS: a warm one would favour this run)")
        off = run_fleet(tmp, data, "1x1-serial", shards=1, workers=1, overlap=False, **kw)
        _progress(f"      {_fmt(off, local)}")
        _progress("[4/5] 2 PS + 2 workers, overlap on")
        two = run_fleet(tmp, data, "2x2", shards=2, workers=2, overlap=True, **kw)
        _progress(f"      {_fmt(two, local)}")
        local_runs = [local["samples_per_s"]]
        if not (args.quick or args.smoke):  # --quick keeps to about a minute: one baseline run
            _progress("[5/5] train-local again (the baseline before and after: a noise check)")
            local2 = run_local(tmp, data, **kw)
            _progress(f"      {_fmt(local2, None)}")
            local_runs.append(local2["samples_per_s"])
    base = sum(local_runs) / len(local_runs)
    out.update({
        "local_samples_per_s": base,
        "local_runs_samples_per_s": local_runs,
        "dist_1x1_samples_per_s": on["samples_per_s"],
        "dist_1x1_serial_samples_per_s": off["samples_per_s"],
        "dist_2x2_samples_per_s": two["samples_per_s"],
        "dist_1x1_vs_local": on["samples_per_s"] / base,
        "dist_1x1_serial_vs_local": off["samples_per_s"] / base,
        "dist_2x2_vs_local": two["samples_per_s"] / base,
        "overlap_gain": on["samples_per_s"] / off["samples_per_s"],
        "step_ms": {"local": local["step_ms"], "dist_1x1": on["step_ms"], "dist_1x1_serial": off["step_ms"],
                    "dist_2x2": two["step_ms"]},
        "elapsed_s": time.perf_counter() - t_all,
    })
    out["targets_met"] = {"dist_1x1_vs_local>=0.6": out["dist_1x1_vs_local"] >= 0.6}
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
