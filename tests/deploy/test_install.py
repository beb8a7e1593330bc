"""scripts/install.sh is the one install procedure of `make install` and both images.

No image can be built here (no Docker engine, no registry): the script runs in
--dry-run mode, the Makefile and Dockerfiles are checked to call it, and the
image's entrypoint (``metaps``) runs from this machine's venv.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install.sh"
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cuda"]


def _dry(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--python", "/opt/x/bin/python", *args],
                          capture_output=True, text=True, timeout=60)


def test_cpu_variant_installs_the_cpu_set_editable_with_extras() -> None:
    r = _dry("--variant", "cpu", "--extras", "test", "--editable")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("+ ")]
    assert len(lines) == 3, r.stdout
    locks = " ".join(f"-r {REPO}/requirements/{n}" for n in ("lock.txt", "lock-cpu.txt", "lock-test.txt"))
    assert lines[0] == f"+ /opt/x/bin/python -m pip install -q --require-hashes --no-deps {locks}", lines[0]
    assert lines[1].endswith(f"--no-deps --no-build-isolation -e {REPO}[cpu,test]")
    assert lines[2] == "+ /opt/x/bin/python -m pip check"
    assert "gpu" not in r.stdout.replace("fbgemm-gpu", "")


def test_gpu_variant_never_pulls_the_cpu_fbgemm() -> None:
    r = _dry("--variant", "gpu")
    assert r.returncode == 0, r.stderr
    assert f"--require-hashes --no-deps -r {REPO}/requirements/lock.txt\n" in r.stdout
    assert f"-r {REPO}/requirements/gpu.txt" in r.stdout and f"{REPO}[gpu]" in r.stdout
    assert "cpu" not in r.stdout and " -e " not in r.stdout


def test_an_extra_without_a_lock_is_refused_in_one_line() -> None:
    r = _dry("--extras", "docs")
    assert r.returncode == 2
    assert r.stderr.strip() == "install.sh: error: extra 'docs' has no lock file requirements/lock-docs.txt (run scripts/lock.py)"


def test_bad_variant_is_refused_in_one_line() -> None:
    r = _dry("--variant", "tpu")
    assert r.returncode == 2
    assert r.stderr.strip() == "install.sh: error: --variant must be cpu or gpu, got 'tpu'"
    assert "+ " not in r.stdout


def test_makefile_and_both_images_install_with_the_script() -> None:
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^\tbash scripts/install\.sh .*--variant cpu .*--extras test .*--editable", make, re.M)
    assert "pip install" not in make.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    packages = [p.rstrip("*") for p in cfg["options.packages.find"]["include"].split()]
    ignored = {l.strip() for l in (REPO / ".dockerignore").read_text().splitlines() if l.strip() and not l.startswith("#")}
    for df, variant in zip(DOCKERFILES, ("cpu", "gpu")):
        text = df.read_text()
        assert "COPY scripts/install.sh" in text, df
        assert re.search(rf"bash scripts/install\.sh .*--variant {variant}\b", text), df
        assert "pip install" not in text, f"{df}: installs around scripts/install.sh"
        for pkg in packages:  # every package the wheel needs is in the build context and copied
            assert f"COPY {pkg} ./{pkg}" in text, f"{df}: package {pkg} not copied"
            assert pkg not in ignored, f".dockerignore drops package {pkg}"
        assert re.search(r"^USER 10001", text, re.M), f"{df}: must run as non-root"
        entry = re.search(r"^ENTRYPOINT (.*)$", text, re.M)
        assert entry is not None, f"{df}: no ENTRYPOINT"
        assert json.loads(entry.group(1)) == ["metaps"]


def test_image_entrypoint_runs_outside_a_container() -> None:
    """ENTRYPOINT + CMD of the image, run with this venv on PATH (what the image's venv holds)."""
    text = DOCKERFILES[0].read_text()
    entry, cmd = re.search(r"^ENTRYPOINT (.*)$", text, re.M), re.search(r"^CMD (.*)$", text, re.M)
    assert entry is not None and cmd is not None, f"{DOCKERFILES[0]}: ENTRYPOINT and CMD expected"
    argv = json.loads(entry.group(1)) + json.loads(cmd.group(1))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    assert shutil.which(argv[0], path=env["PATH"]), "the metaps console script is not installed in this venv"
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    for sub in ("ps", "worker", "controller", "deliver", "meta-io"):
        assert sub in r.stdout
