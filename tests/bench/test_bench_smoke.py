"""Every bench runs: each ``bench/NAME.py`` started as ``python -m bench.NAME --smoke``, a real process.

``--smoke`` is each bench's smallest size that still runs its code paths and prints its
JSON line (seconds; the figures mean nothing). Per bench this checks the exit code, that
the last stdout line is one JSON object, and that the figures the bench documents as its
result are there and finite. A failing run shows the tail of the process's stdout and
stderr. :func:`test_every_bench_module_has_a_smoke_run` fails when a bench module (a
``main()`` and an ``if __name__ == "__main__":`` block) is added without an entry in
:data:`SMOKES`; ``bench/gpu_check.sh`` (CUDA only) is checked for syntax alone.

The fleet benches cannot be tiny: ``train_throughput`` starts 4 configurations of real
processes (about a minute on a loaded 2-core box); ``chaos``, ``k8s_local`` and
``stragglers`` run a documented subset under ``--smoke`` (see their docstrings).
"""

from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TAIL = 4000  # characters of stdout / stderr shown when a run fails


@dataclass(frozen=True)
class Smoke:
    """One bench's smoke run.

    Args:
        args: command-line arguments after ``-m bench.NAME``.
        figures: result keys that must hold a finite number (or a mapping of finite numbers);
            ``a/b/c`` reaches into nested objects.
        timeout_s: wall-clock limit of the process.
        verdicts: result keys that must be ``true`` (the run's own pass/fail findings, e.g. a
            fault recovered); a smoke run that says it failed fails.
    """

    args: tuple[str, ...]
    figures: tuple[str, ...]
    timeout_s: float = 240.0
    verdicts: tuple[str, ...] = ()


SMOKES: dict[str, Smoke] = {
    # --smoke: the bad-input batteries and the many-workers run, no fleet fault (each is a minute)
    "chaos": Smoke(("--smoke",), ("faults_tried", "faults_survived", "bad_inputs_tried", "bad_inputs_clear_error")),
    "delivery": Smoke(("--smoke",), ("export_rows_per_s", "write_speedup", "lookup_speedup",
                                     "delta_cost_vs_fraction", "delta_cost_vs_fraction_job", "adapt/ms_per_task")),
    # --smoke: 4k rows, 1 seed, 1 epoch, train-local + a launched 1 PS x 1 worker fleet (~36 CPU-s)
    "fleet_quality": Smoke(("--smoke",), ("worst_margin", "max_abs_diff", "all_click_diff_mean",
                                          "all_conversion_diff_mean", "first_k_adapted_conversion_diff_mean")),
    # --smoke: the lifecycle's failing run (root, ip netns, kubectl): a PS crash before any cut must fail
    # the Jobs; no launch run to compare with, no day 1 or 2 (--quick runs those; test_k8s_pods runs a day 1)
    "k8s_local": Smoke(("--smoke",), ("run_failure_s",), 420.0, ("run_failure_fails_job",)),
    "meta_io": Smoke(("--smoke",), ("read_speedup_vs_naive", "reader_overhead", "raw_reader_unpacked_vs_packed")),
    "meta_step": Smoke(("--smoke",), ("vmap_speedup", "vmap_speedup_min")),
    # --no-fleet: its fleet part (metaps train-local and launched fleets of 1-4 PS, every process's CPU)
    # starts five configurations of processes, minutes of CPU in a CPU-bound suite
    "peers": Smoke(("--smoke", "--no-fleet"), ("local_vs_torch", "local_vs_torch_per_cpu", "local_vs_floor_per_cpu",
                                               "meta_vs_torchfunc", "meta_vs_torchfunc_per_cpu"), 420.0),
    "ps_scale": Smoke(("--smoke",), ("pull_50m_vs_1m", "push_50m_vs_1m", "bytes_per_row_ratio", "restore_rows_per_s")),
    "ps_storage": Smoke(("--smoke",), ("pull_vs_floor", "push_vs_floor_rowwise_adagrad", "insert_vs_hashmap",
                                       "stream_vs_known", "steady_new10_vs_known")),
    "ps_step": Smoke(("--smoke",), ("ps_nonstore_cpu_per_rpc_vs_echo", "ps_cpu_ms_per_call", "echo_cpu_ms_per_call",
                                    "store_cpu_ms_per_step")),
    "ps_throughput": Smoke(("--smoke",), ("pull_vs_echo", "push_vs_echo", "bytes_per_row_ratio")),
    "quality": Smoke(("--smoke",), ("dnn_click_norm_auc", "esmm_conversion_norm_auc", "logreg_click_norm_auc",
                                    "cold_click_adapted_minus_base_auc")),
    # --smoke: 4k and 6k rows, seed 3, the taste world (its Bayes ceiling at 200 draws a user), every arm
    "quality_curve": Smoke(("--smoke",), ("adapted_minus_best_other_min", "elapsed_s")),
    "quality_ceiling": Smoke(("--smoke",), ("by_k/4/click/ceiling_gain/median",
                                            "by_k/4/conversion/ceiling_gain/median",
                                            "by_k/4/click/non_offset_gain/median")),
    # --smoke: the simulations (E1/E3/E4/E5 sims, E6), not the real-process arms
    "stragglers": Smoke(("--smoke",), ("e1_sim_vs_static", "e5_sim_dd_speedup", "e6_overhead", "e6_proc_overhead")),
    "train_throughput": Smoke(("--smoke",), ("dist_1x1_vs_local", "dist_2x2_vs_local", "overlap_gain"), 420.0),
    "update_screening": Smoke(("--smoke",), ("rowwise_adagrad_added_frac", "rowwise_adagrad_exact_vs_push",
                                             "adam_added_frac")),
}
"""Every bench module and how its smoke run is judged."""

FLEETS = frozenset({"train_throughput", "chaos", "k8s_local", "fleet_quality"})
"""The smoke runs that start fleets of processes (a minute or less each): they run from
tests/bench/test_bench_smoke_fleets.py, a module of their own, so the suite's xdist
workers (``--dist loadscope``: a module to a worker) can run them beside the others."""


def bench_modules() -> list[str]:
    """Names of the modules under ``bench/`` that are benches: a top-level ``main`` and a ``__main__`` block."""
    out = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        runs = any(isinstance(n, ast.If) and "__name__" in ast.unparse(n.test) and "__main__" in ast.unparse(n.test)
                   for n in tree.body)
        if has_main and runs:
            out.append(path.stem)
    return out


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-TAIL:]


def _figure(result: dict[str, Any], key: str) -> Any:
    value: Any = result
    for part in key.split("/"):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _finite(value: Any) -> bool:
    if isinstance(value, dict):
        return bool(value) and all(_finite(v) for v in value.values())
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def run_bench(name: str, smoke: Smoke, tmp: Path) -> tuple[int | None, str, str]:
    """``python -m bench.NAME ARGS`` from the repository root: (exit code or None on timeout, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", f"bench.{name}", *smoke.args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=smoke.timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and what it started in its session
        out, err = proc.communicate()
        return None, out, err


def smoke_params(names: set[str] | frozenset[str]) -> list[Any]:
    """pytest params of these benches' smoke runs, each with its timeout."""
    return [pytest.param(n, marks=pytest.mark.timeout(SMOKES[n].timeout_s + 60)) for n in sorted(names)]


@pytest.mark.parametrize("name", smoke_params(set(SMOKES) - FLEETS))
def test_bench_smoke_run_prints_its_figures(name: str, tmp_path: Path) -> None:
    check_smoke(name, tmp_path)


def check_smoke(name: str, tmp_path: Path) -> None:
    """Run bench ``name``'s smoke invocation and judge its JSON line (see the module docstring)."""
    judge_smoke(name, *run_bench(name, SMOKES[name], tmp_path))


def judge_smoke(name: str, rc: int | None, out: str, err: str) -> None:
    """Judge a smoke run of bench ``name`` from its exit code (None: timed out) and output."""
    smoke = SMOKES[name]
    shown = (f"python -m bench.{name} {' '.join(smoke.args)}\n--- stdout (tail) ---\n{_tail(out)}"
             f"\n--- stderr (tail) ---\n{_tail(err)}")
    assert rc is not None, f"timed out after {smoke.timeout_s:.0f} s: {shown}"
    assert rc == 0, f"exit code {rc}: {shown}"
    lines = out.strip().splitlines()
    assert lines, f"no output: {shown}"
    try:
        result = json.loads(lines[-1])
    except ValueError as exc:
        raise AssertionError(f"last stdout line is not JSON ({exc}): {shown}") from None
    assert isinstance(result, dict), f"last stdout line is JSON but not an object: {shown}"
    missing = [k for k in smoke.figures if not _has(result, k)]
    assert not missing, f"figures missing from the JSON: {missing}; keys: {sorted(result)}\n{shown}"
    bad = {k: _figure(result, k) for k in smoke.figures if not _finite(_figure(result, k))}
    assert not bad, f"figures that are not finite numbers: {bad}\n{shown}"
    failed = {k: result.get(k) for k in smoke.verdicts if result.get(k) is not True}
    assert not failed, f"the run's own findings say it failed: {failed}\n{shown}"


def _has(result: dict[str, Any], key: str) -> bool:
    try:
        _figure(result, key)
    except KeyError:
        return False
    return True


def test_every_bench_module_has_a_smoke_run() -> None:
    benches = bench_modules()
    assert {"train_throughput", "ps_storage", "stragglers"} <= set(benches), benches  # the scan finds benches
    uncovered = sorted(set(benches) - set(SMOKES))
    assert not uncovered, (f"bench modules without a smoke run: {uncovered}; add each to SMOKES in {__file__} "
                           "(and give the bench a --smoke size)")
    helpers = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__" and p.stem not in benches)
    assert not set(helpers) & set(SMOKES), f"SMOKES names helper modules that are not benches: {helpers}"
    assert FLEETS <= set(SMOKES), sorted(FLEETS - set(SMOKES))


@pytest.mark.parametrize("name", sorted(SMOKES))
def test_bench_documents_smoke_in_its_docstring(name: str) -> None:
    path = BENCH / f"{name}.py"
    if not path.exists():
        pytest.fail(f"{path} does not exist (SMOKES names it)")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "--smoke" in doc, f"bench/{name}.py: its module docstring does not say what --smoke runs"


def test_gpu_check_script_is_valid_bash() -> None:
    script = BENCH / "gpu_check.sh"
    assert script.is_file(), script
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"bash -n {script}: {proc.stderr[-TAIL:]}"
