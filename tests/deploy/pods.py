"""Helpers of the pods-in-namespaces tests: render a job's manifests, show the pods of a failed test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from metaps.deploy.podsim import PodSim, tail

REPO = Path(__file__).resolve().parents[2]


def render(job_toml: Path, out: Path) -> list[dict[str, Any]]:
    """``metaps deploy k8s`` of ``job_toml`` into ``out``, then ``kubectl kustomize``: the objects a cluster gets."""
    r = subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(job_toml),
                        "--image", "local/metaps:test", "--out", str(out)], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    k = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=120)
    assert k.returncode == 0, k.stderr
    return [d for d in yaml.safe_load_all(k.stdout) if d]


def show_pods(sim: PodSim, lines: int = 25) -> None:
    """Every pod's phase, exit codes and log tail on stderr (a failed test's evidence)."""
    for p in sim.pods.values():
        sys.stderr.write(f"--- {p.name} ({p.phase}, exits {p.exit_codes})\n{tail(p.log_path, lines)}\n")
