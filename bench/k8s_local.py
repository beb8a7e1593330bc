"""The Kubernetes wiring on one machine vs ``metaps launch`` of the same job.

Both fleets train the same job (2 PS shards, 3 workers, PS mode) on the same Meta-IO data:

    launch   ``metaps launch --config job.toml`` (controller, agents, PS, workers on 127.0.0.1)
    k8s      ``metaps deploy k8s`` -> ``kubectl kustomize`` -> every pod run by
             :class:`tests.deploy.podsim.PodSim` in its own network + mount namespace
             (the data is already built: no data Job)

Three k8s-side runs per round: a steady one (3 workers throughout: the like-for-like
twin of the launch run) and a scaling one (the worker Job scaled 3 -> 4 at a third of
the batches and 4 -> 2 at two thirds). Runs go in the order launch, k8s steady, k8s
scaling, and in the full mode a second launch run closes the round (A B B A), so load
drift on a shared box biases neither side: ``throughput_ratio`` is the k8s steady rate
over the mean of the launch rates around it.

Measured from the controller's status, polled every 0.25 s, the same way for all:
time to first step (fleet start -> the first batch done), batches/s and samples/s
(batches x rows per batch of the manifest) between the first batch and the end.
``scale_events_lost_shards``: shards (2 batches each) of the requested epochs the
controller's coverage misses at the end of the scaling run (must be 0).

Run: ``python -m bench.k8s_local [--quick]`` (root, ``ip netns``, ``unshare``, kubectl);
the last line is a JSON object with ``first_step_s_ratio`` (k8s / launch),
``throughput_ratio`` (k8s / launch, goal >= 0.9) and ``scale_events_lost_shards``.
Lifecycle (:func:`run_lifecycle`, pods only): day 1 with a PS pod drained mid-run (preStop
cut, eviction, a replacement pod recovered by the controller) and a scale-down by a random
pod; day 2, a new run warm-started from day 1's checkpoints on the same data; a run that
fails (a PS crashes before any cut committed) and must fail its Jobs. JSON keys
``replaced_ps_recovered`` (recovered and the run completed with full coverage),
``replaced_ps_recover_s``, ``rows_lost`` (training rows of the requested epochs the final
coverage misses: must be 0), ``warm_start_ok`` (every PS restored, the run completed),
``run_failure_fails_job`` (the worker and controller Jobs failed through their
podFailurePolicy), ``run_failure_s`` (eviction to failed Jobs).

The JobSet variant (``metaps deploy k8s --api jobset``: one JobSet, replicated jobs started
in order, :mod:`metaps.deploy.jobset`) runs the same steady fleet and the same day 1 and
failing run (no day 2): ``jobset_first_step_s`` (the in-order start included),
``jobset_samples_per_s``, ``jobset_throughput_ratio`` and ``jobset_first_step_s_ratio``
(over the launch runs), ``jobset_replaced_ps_recovered``, ``jobset_replaced_ps_recover_s``,
``jobset_rows_lost`` (day 1: complete means the JobSet completed by its success policy),
``jobset_run_failure_fails_jobset`` (a child Job failed by its podFailurePolicy failed the
JobSet through its failure policy, no group restart) and ``jobset_run_failure_s``.

``--smoke`` runs the failing run of the lifecycle only (1000 rows, 20 epochs; under a minute
here): ``run_failure_fails_job`` and ``run_failure_s``, no ratios; day 1 and day 2 are
``null`` (``--quick`` runs them; tests/deploy/test_k8s_pods.py runs day 1's drain and
scale-down in the suite).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

REPO = Path(__file__).resolve().parents[1]


def _job(root: Path, epochs: int, name: str, **controller: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "data": {"train": "metaio/train"},
        "ps": {"shards": 2, "num_vshards": 16, "device": "cpu", "table_defaults": {"dim": 8, "capacity": 16384}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": "meta", "workers": 3, "epochs": epochs, "overlap": False, "log_every": 20},
        "controller": {"heartbeat_timeout_s": 60.0, "tick_s": 0.5, "dds": {"batches_per_shard": 2}},
        "rpc": {"timeout_s": 30.0},
        "delivery": {"out": "bundles"},
        "run": {"dir": "runs", "name": name},
        "deploy": {"name": "bk", "deliver_schedule": ""},
    }
    job["controller"].update(controller)
    return job


def _data(root: Path, rows: int) -> tuple[int, int]:
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.synth.generator import GeneratorConfig, generate

    gen = generate(root / "raw", GeneratorConfig(rows=rows, users=max(50, rows // 20), items=500, seed=11, n_files=1,
                                                 row_group_rows=rows), progress=False)
    out = build(gen.out_dir, gen.schema_path, root / "metaio" / "train", MetaIOBuildConfig(rows_per_batch=256)).out_dir
    totals = json.loads((Path(out) / "manifest.json").read_text())["totals"]
    return int(totals["input_rows"]), int(totals["batches"])


class Progress:
    """Polls a status function; records (time, batches_done) and the end."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status
        self.samples: list[tuple[float, int]] = []
        self.last: dict[str, Any] = {}

    def poll(self) -> dict[str, Any]:
        try:
            st = self.status()
        except Exception:  # not up yet
            return {}
        if "datasets" not in st:
            return {}
        done = int(st.get("coverage", {}).get("done_batches", 0))  # the ledger's, over every epoch
        self.samples.append((time.monotonic(), done))
        self.last = st
        return st

    def first_step_t(self) -> float:
        return next(t for t, b in self.samples if b > 0)

    def batches_per_s(self) -> float:
        t1, b1 = self.samples[-1]
        t0, b0 = next((t, b) for t, b in self.samples if b > 0)
        return (b1 - b0) / max(t1 - t0, 1e-9)


def _name(api: str, role: str) -> str:
    """The Job that runs ``role``: ``bk-ROLE``, or the JobSet's child Job ``bk-ROLE-0``."""
    return f"bk-{role}-0" if api == "jobset" else f"bk-{role}"


def _start(sim: Any, api: str) -> Any:
    """``kubectl apply``: the controller, PS and worker Jobs, or the JobSet; returns the controller's pod."""
    if api == "jobset":
        sim.start_jobset("bk")
        deadline = time.monotonic() + 300
        while not sim.job_pods("bk-controller-0"):  # the JobSet controller creates it
            if time.monotonic() > deadline or sim.jobset_status("bk") != "Running":
                raise AssertionError(f"the JobSet created no controller pod ({sim.jobset_status('bk')})")
            time.sleep(0.1)
    else:
        for w in ("bk-controller", "bk-ps", "bk-worker"):
            sim.start_workload(w)
    return sim.job_pods(_name(api, "controller"))[0]


def _fleet_done(sim: Any, api: str) -> bool:
    """Every Job complete, or the JobSet completed (by its success policy) with every pod ended."""
    if api == "jobset":
        return sim.jobset_status("bk") == "Completed" and all(p.ended for p in sim.pods.values())
    return all(sim.job_complete(f"bk-{r}") for r in ("worker", "ps", "controller"))


def run_launch(root: Path, epochs: int, tag: str = "launch") -> dict[str, Any]:
    from controller.client import ControllerClient
    from common.rpc import RpcConfig
    from common.toml_writer import write

    work = root / tag
    work.mkdir()
    os.symlink(root / "data" / "metaio", work / "metaio")
    cfg = write(work / "job.toml", _job(work, epochs, "launch"))
    tok = work / "token"
    run_dir = work / "runs" / "launch"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "metaps", "launch", "--config", str(cfg), "--run-dir", str(run_dir),
                             "--no-progress", "--token-file", str(tok), "--timeout", "1800"], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=(work / "launch.log").open("wb"),
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    client: list[Any] = []

    def status() -> dict[str, Any]:
        if not client:
            addr_file = run_dir / "controller" / "address"
            if not (addr_file.exists() and tok.exists()):
                return {}
            client.append(ControllerClient(addr_file.read_text().strip(), RpcConfig(token=tok.read_text().strip()),
                                           retry_s=2.0))
        return client[0].status()

    prog = Progress(status)
    while proc.poll() is None:
        st = prog.poll()
        if st.get("finished"):
            break
        time.sleep(0.25)
    proc.wait(600)
    if client:
        client[0].close()
    return {"first_step_s": prog.first_step_t() - t0, "batches_per_s": prog.batches_per_s(), "rc": proc.returncode}


def run_k8s(root: Path, epochs: int, total_batches: int, scale: bool = True, tag: str = "k8s",
            api: str = "jobs") -> dict[str, Any]:
    """One pods-in-namespaces fleet; ``scale``: scale the worker Job 3 -> 4 -> 2 mid-run; ``api``:
    ``metaps deploy k8s --api`` (jobs or jobset)."""
    from tests.deploy.podsim import PodSim
    from common.toml_writer import write

    work = root / tag
    work.mkdir()
    cfg = write(work / "job.toml", _job(work, epochs, "k8s"))
    out = work / "manifests"
    subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(cfg), "--image", "local/metaps:bench",
                    "--out", str(out), "--api", api], check=True, cwd=REPO, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    docs = [d for d in yaml.safe_load_all(subprocess.run(["kubectl", "kustomize", str(out)], check=True,
                                                          capture_output=True, text=True).stdout) if d]
    token = (out / "token").read_text().strip()
    sim = PodSim(docs, work / "sim", env={"PYTHONPATH": str(REPO)}, subnet="10.232.0")
    try:
        pvc = sim.root / "pvc" / "bk-data"
        pvc.mkdir(parents=True)
        subprocess.run(["cp", "-a", str(root / "data" / "metaio"), str(pvc / "metaio")], check=True)
        t0 = time.monotonic()
        ctl = _start(sim, api)
        prog = Progress(lambda: sim.controller_status(f"{ctl.ip}:7070", token) if ctl.phase == "Running" else {})
        target = epochs * total_batches
        scaled: list[tuple[str, int]] = []
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            st = prog.poll()
            done = prog.samples[-1][1] if prog.samples else 0
            if scale and not scaled and done >= target / 3:
                sim.scale_job(_name(api, "worker"), 4)
                scaled.append(("3->4", done))
            elif len(scaled) == 1 and done >= 2 * target / 3:
                sim.scale_job(_name(api, "worker"), 2)
                scaled.append(("4->2", done))
            if st.get("finished"):
                break
            time.sleep(0.25)
        st = prog.last
        cov = st.get("coverage", {})
        # batches of the requested epochs not covered, in shards (0 when coverage is complete)
        lost = 0 if cov.get("complete") else math.ceil((1.0 - float(cov.get("fraction", 0.0))) * target / 2)
        return {"first_step_s": prog.first_step_t() - t0, "batches_per_s": prog.batches_per_s(),
                "scale_events": scaled, "lost_shards": lost, "coverage": cov}
    finally:
        sim.close()


def _render(work: Path, cfg: Path, *extra: str) -> tuple[list[dict[str, Any]], str]:
    out = work / "manifests"
    subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(cfg), "--image", "local/metaps:bench",
                    "--out", str(out), *extra], check=True, cwd=REPO, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    docs = [d for d in yaml.safe_load_all(subprocess.run(["kubectl", "kustomize", str(out)], check=True,
                                                          capture_output=True, text=True).stdout) if d]
    return docs, (out / "token").read_text().strip()


def _lost(cov: dict[str, Any], rows_per_batch: float) -> tuple[int, int]:
    """(batches, rows) of the requested epochs the final coverage misses (0, 0 when complete)."""
    if cov.get("complete"):
        return 0, 0
    missing = int(cov.get("total_batches", 0)) - int(cov.get("done_batches", 0))
    return missing, round(missing * rows_per_batch)


def _day_two(root: Path, epochs: int, fleet: Callable[..., Any], wait: Callable[..., bool]) -> dict[str, Any]:
    """Day 2: a new run (its own name and state) warm-started from day 1's checkpoints."""
    from common.toml_writer import write

    (root / "day2").mkdir()
    cfg = write(root / "day2" / "job.toml", _job(root, epochs, "day1", checkpoint_interval_s=2.0))
    t0 = time.monotonic()
    sim, _, prog = fleet("day2", cfg, "--run-name", "day2", "--warm-start-from", "runs/day1/checkpoints")
    try:
        done = wait(lambda: bool(prog.poll() or True) and sim.job_complete("bk-worker")
                    and sim.job_complete("bk-controller"), 900)
        logs = [p.log_path.read_text() for p in sim.job_pods("bk-ps")]
        restored = len(logs) == 2 and all(re.search(r'msg="?restored"? ', t) for t in logs)
        cov = prog.last.get("coverage", {})
        return {"warm_start_ok": bool(done and restored and cov.get("complete")),
                "warm_start_s": round(time.monotonic() - t0, 2)}
    finally:
        sim.close()


def _day_one(root: Path, epochs: int, rows_per_batch: float, fleet: Callable[..., Any],
             wait: Callable[[Callable[[], bool], float], bool], api: str = "jobs", tag: str = "day1") -> dict[str, Any]:
    """Day 1 of :func:`run_lifecycle`: PS 1 drained after the first committed cut, then a scale-down."""
    from common.toml_writer import write

    out: dict[str, Any] = {}
    (root / tag).mkdir()
    cfg = write(root / tag / "job.toml", _job(root, epochs, tag, checkpoint_interval_s=2.0))
    sim, _, prog = fleet(tag, cfg)
    try:
        def committed() -> bool:
            if sim.job_status(_name(api, "controller")) != "Running":
                raise AssertionError("day 1 ended before its first committed cut: give it more epochs")
            return any(c.get("state") == "committed" for c in prog.poll().get("checkpoints", []))
        assert wait(committed, 600), "day 1: no committed cut"
        old = sim.index_pod(_name(api, "ps"), 1)
        assert old is not None
        t_evict = time.monotonic()
        evicted = sim.evict_pod(old.name)
        recovered = wait(lambda: any(e["kind"] == "ps_recovery" and e["node"] == "ps:1"
                                     for e in prog.poll().get("events", [])), 300)
        out["replaced_ps_recover_s"] = round(time.monotonic() - t_evict, 2)
        sim.scale_job(_name(api, "worker"), 2)
        done = wait(lambda: bool(prog.poll() or True) and _fleet_done(sim, api), 900)
        cov = prog.last.get("coverage", {})
        batches, rows = _lost(cov, rows_per_batch)
        out.update(replaced_ps_recovered=bool(evicted and recovered and done and cov.get("complete")),
                   day1_jobs_complete=done, day1_lost_batches=batches, rows_lost=rows)
    finally:
        sim.close()
    return out


def run_lifecycle(root: Path, epochs: int, rows_per_batch: float, day1: bool = True, warm_start: bool = True,
                  failure: bool = True, api: str = "jobs") -> dict[str, Any]:
    """Three fleets of pods: (1) day 1 with a PS pod replaced mid-run (a drain: preStop cut,
    eviction, a new pod for its index) and a worker deleted by a scale-down (``day1``); (2)
    day 2, a warm start of a new run from day 1's checkpoints (``warm_start``, needs day 1);
    (3) a run that fails (a PS crashes before any cut committed: nothing consistent to
    restore) and must fail its Jobs (``failure``). ``epochs`` are day 1's and the failing
    run's (long enough to act on mid-run). The figures of a part not run are ``None``. ``api``:
    ``jobset`` runs each fleet as one JobSet (no day 2: ``warm_start`` must be False); the
    failing run must then fail the JobSet (``run_failure_fails_jobset``)."""
    if api == "jobset" and warm_start:
        raise ValueError("run_lifecycle: the JobSet variant runs no day 2 (warm_start=False)")
    pre = "" if api == "jobs" else f"{api}-"
    from tests.deploy.podsim import PodSim
    from common.toml_writer import write

    out: dict[str, Any] = {}
    shared = root / f"{pre}lifecycle-data"
    shared.mkdir()
    subprocess.run(["cp", "-a", str(root / "data" / "metaio"), str(shared / "metaio")], check=True)

    def fleet(tag: str, cfg: Path, *extra: str) -> tuple[PodSim, str, Progress]:
        docs, token = _render(root / tag, cfg, "--api", api, *extra)
        sim = PodSim(docs, root / tag / "sim", env={"PYTHONPATH": str(REPO)}, subnet="10.233.0")
        pvc = sim.root / "pvc"
        pvc.mkdir(parents=True)
        os.symlink(shared, pvc / "bk-data")  # one shared volume across the days
        ctl = _start(sim, api)
        return sim, token, Progress(lambda: sim.controller_status(f"{ctl.ip}:7070", token)
                                    if ctl.phase == "Running" else {})

    def wait(pred: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.25)
        return False

    # (1) day 1: a drained PS, a scaled-down worker
    if not day1:
        out.update(replaced_ps_recovered=None, replaced_ps_recover_s=None, day1_jobs_complete=None,
                   day1_lost_batches=None, rows_lost=None)
        warm_start = False  # day 2 starts from day 1's checkpoints
    else:
        out.update(_day_one(root, epochs, rows_per_batch, fleet, wait, api, f"{pre}day1"))

    # (2) day 2: a new run warm-started from day 1's checkpoints
    if not warm_start:
        out.update(warm_start_ok=None, warm_start_s=None)
    else:
        out.update(_day_two(root, epochs, fleet, wait))

    # (3) a failed run reaches its Jobs: no cut ever commits, then a PS crashes (no preStop: a crash)
    if not failure:
        out.update(run_failure_fails_job=None, run_failure_s=None, run_failure_reason="not run")
        return out
    (root / f"{pre}fail").mkdir()
    cfg3 = write(root / f"{pre}fail" / "job.toml", _job(root, epochs, "fail", checkpoint_interval_s=0.0))
    sim, _, prog = fleet(f"{pre}fail", cfg3)
    try:
        started = wait(lambda: int(prog.poll().get("coverage", {}).get("done_batches", 0)) > 0, 600)
        old = sim.index_pod(_name(api, "ps"), 0)
        assert started and old is not None, "the failing run never started"
        t_kill = time.monotonic()
        sim.kill_container(old.name)
        if api == "jobset":  # a child Job failed by its podFailurePolicy fails the JobSet, no group restart
            failed = wait(lambda: sim.jobset_status("bk") != "Running", 300)
            js = sim.jobsets["bk"]
            out.update(run_failure_fails_jobset=bool(failed and js.status == "Failed" and js.restarts == 0
                                                     and js.reason.startswith("FailJobSetAction")
                                                     and "PodFailurePolicy" in js.reason),
                       run_failure_s=round(time.monotonic() - t_kill, 2), run_failure_reason=js.reason)
            return out
        failed = wait(lambda: sim.job_status("bk-worker") == "Failed" and sim.job_status("bk-controller") == "Failed",
                      300)
        reason = sim.jobs["bk-worker"].reason
        out.update(run_failure_fails_job=bool(failed and reason.startswith("PodFailurePolicy")),
                   run_failure_s=round(time.monotonic() - t_kill, 2), run_failure_reason=reason)
    finally:
        sim.close()
    return out



@contextlib.contextmanager
def _scratch(grace_s: float = 30.0) -> Iterator[str]:
    """A scratch folder removed at the end. A pod's output can still land in it just after its
    simulation closed (a pod thread that outlived close()'s join on a loaded box): removal is
    retried for ``grace_s``, then fails naming what is left, so a process that keeps writing
    is still reported."""
    tmp = tempfile.mkdtemp(prefix="bench-k8s-")
    try:
        yield tmp
    finally:
        deadline = time.monotonic() + grace_s
        while True:
            try:
                shutil.rmtree(tmp)
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    left = sorted(str(q.relative_to(tmp)) for q in Path(tmp).rglob("*"))[:20]
                    raise OSError(f"{tmp}: still written to {grace_s:.0f} s after the simulations closed "
                                  f"({exc}); left: {left}") from None
                time.sleep(0.5)

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller data, fewer epochs")
    ap.add_argument("--smoke", action="store_true",
                    help="the lifecycle's failing run only, on 1000 rows (no launch run, so no ratios in the JSON); "
                         "figures meaningless")
    args = ap.parse_args(argv)
    rows, epochs = (1000, 1) if args.smoke else (4000, 4) if args.quick else (20000, 4)
    load0 = os.getloadavg()[0]
    with _scratch() as tmp:
        root = Path(tmp)
        n_rows, n_batches = _data(root / "data", rows)
        per_batch = n_rows / n_batches
        print(f"data: {n_rows} rows, {n_batches} batches ({per_batch:.0f} rows/batch), {epochs} epochs", flush=True)

        def show_launch(r: dict[str, Any], tag: str) -> None:
            print(f"{tag}: first step {r['first_step_s']:.1f}s, {r['batches_per_s']:.2f} batches/s "
                  f"({r['batches_per_s'] * per_batch:.0f} samples/s), rc {r['rc']}", flush=True)

        # the lifecycle: day 1 long enough to be drained after its first cut (smoke: the failing run only)
        life = run_lifecycle(root, epochs * 20 if args.smoke else epochs * 4, per_batch, day1=not args.smoke,
                             warm_start=not args.smoke)
        print(f"lifecycle: replaced PS recovered {life['replaced_ps_recovered']} in {life['replaced_ps_recover_s']}s, "
              f"rows lost {life['rows_lost']}, warm start ok {life['warm_start_ok']}, run failure fails the Jobs "
              f"{life['run_failure_fails_job']} ({life['run_failure_reason']})", flush=True)
        lifecycle = {k: life[k] for k in ("replaced_ps_recovered", "replaced_ps_recover_s", "rows_lost", "warm_start_ok",
                                          "run_failure_fails_job", "run_failure_s")}
        if args.smoke:  # one configuration: the failing run, no launch run, no ratios
            print(json.dumps({
                "smoke": True, "load_avg_1m_at_start": round(load0, 2),
                "load_avg_1m_at_end": round(os.getloadavg()[0], 2), **lifecycle,
            }))
            return 0
        launches = [run_launch(root, epochs, "launch-a")]
        show_launch(launches[0], "launch (A)")
        steady = run_k8s(root, epochs, n_batches, scale=False, tag="k8s-steady")
        print(f"k8s pods, steady 3 workers: first step {steady['first_step_s']:.1f}s, "
              f"{steady['batches_per_s']:.2f} batches/s ({steady['batches_per_s'] * per_batch:.0f} samples/s), "
              f"lost shards {steady['lost_shards']}", flush=True)
        k8s = run_k8s(root, epochs, n_batches, scale=True, tag="k8s-scaling")
        print(f"k8s pods, scaling: first step {k8s['first_step_s']:.1f}s, {k8s['batches_per_s']:.2f} batches/s "
              f"({k8s['batches_per_s'] * per_batch:.0f} samples/s) with scale events {k8s['scale_events']}, "
              f"lost shards {k8s['lost_shards']}", flush=True)
        # the JobSet variant: the same steady fleet, started in order, and the same day 1 and failing run
        js_steady = run_k8s(root, epochs, n_batches, scale=False, tag="jobset-steady", api="jobset")
        print(f"k8s pods, one JobSet, steady 3 workers: first step {js_steady['first_step_s']:.1f}s, "
              f"{js_steady['batches_per_s']:.2f} batches/s ({js_steady['batches_per_s'] * per_batch:.0f} samples/s), "
              f"lost shards {js_steady['lost_shards']}", flush=True)
        js_life = run_lifecycle(root, epochs * 4, per_batch, warm_start=False, api="jobset")
        print(f"JobSet lifecycle: replaced PS recovered {js_life['replaced_ps_recovered']} in "
              f"{js_life['replaced_ps_recover_s']}s, rows lost {js_life['rows_lost']}, run failure fails the JobSet "
              f"{js_life['run_failure_fails_jobset']} ({js_life['run_failure_reason']})", flush=True)
        if not args.quick:
            launches.append(run_launch(root, epochs, "launch-b"))
            show_launch(launches[1], "launch (A')")
    launch_bps = sum(r["batches_per_s"] for r in launches) / len(launches)
    launch_first = sum(r["first_step_s"] for r in launches) / len(launches)
    print(json.dumps({
        "quick": args.quick, "load_avg_1m_at_start": round(load0, 2), "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "launch_first_step_s": round(launch_first, 2), "k8s_first_step_s": round(steady["first_step_s"], 2),
        "launch_samples_per_s": round(launch_bps * per_batch, 1),
        "launch_samples_per_s_each": [round(r["batches_per_s"] * per_batch, 1) for r in launches],
        "k8s_samples_per_s": round(steady["batches_per_s"] * per_batch, 1),
        "k8s_scaling_samples_per_s": round(k8s["batches_per_s"] * per_batch, 1),
        "first_step_s_ratio": round(steady["first_step_s"] / launch_first, 3),
        "throughput_ratio": round(steady["batches_per_s"] / launch_bps, 3),
        "throughput_ratio_while_scaling": round(k8s["batches_per_s"] / launch_bps, 3),
        "scale_events": [e[0] for e in k8s["scale_events"]],
        "scale_events_lost_shards": k8s["lost_shards"],
        "steady_lost_shards": steady["lost_shards"], **lifecycle,
        "jobset_first_step_s": round(js_steady["first_step_s"], 2),
        "jobset_samples_per_s": round(js_steady["batches_per_s"] * per_batch, 1),
        "jobset_first_step_s_ratio": round(js_steady["first_step_s"] / launch_first, 3),
        "jobset_throughput_ratio": round(js_steady["batches_per_s"] / launch_bps, 3),
        "jobset_steady_lost_shards": js_steady["lost_shards"],
        **{f"jobset_{k}": js_life[k] for k in ("replaced_ps_recovered", "replaced_ps_recover_s", "rows_lost",
                                               "run_failure_fails_jobset", "run_failure_s")},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
