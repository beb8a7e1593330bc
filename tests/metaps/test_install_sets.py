"""No install set holds both fbgemm builds (fbgemm-gpu-cpu and fbgemm-gpu both ship ``fbgemm_gpu``).

Install sets: setup.cfg's install_requires plus each extra (what ``pip install -e '.[x]'``
adds), and every requirements/*.txt together with install_requires. The Makefile
installs the CPU set.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FBGEMM = {"fbgemm-gpu", "fbgemm-gpu-cpu"}


def _names(lines: list[str]) -> set[str]:
    """Normalized distribution names of requirement lines (comments, options and markers dropped)."""
    out = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        assert m, f"unparsable requirement line {line!r}"
        out.add(re.sub(r"[-_.]+", "-", m.group(0)).lower())
    return out


def _setup_cfg() -> tuple[set[str], dict[str, set[str]]]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    base = _names(cfg["options"]["install_requires"].splitlines())
    extras = {k: _names(v.splitlines()) for k, v in cfg["options.extras_require"].items()}
    return base, extras


def install_sets() -> dict[str, set[str]]:
    base, extras = _setup_cfg()
    sets = {f"setup.cfg [{k}]": base | v for k, v in extras.items()}
    for req in sorted((REPO / "requirements").glob("*.txt")):
        if req.name.startswith("lock"):
            continue  # generated from these inputs (tests/metaps/test_lock.py checks them)
        sets[f"requirements/{req.name}"] = base | _names(req.read_text().splitlines())
    return sets


def test_no_install_set_holds_both_fbgemm_builds() -> None:
    sets = install_sets()
    assert {"setup.cfg [cpu]", "setup.cfg [gpu]", "requirements/cpu.txt", "requirements/gpu.txt"} <= set(sets)
    for name, reqs in sets.items():
        assert len(reqs & FBGEMM) <= 1, f"{name} installs both {sorted(reqs & FBGEMM)}"
    base, _ = _setup_cfg()
    assert not base & FBGEMM, "install_requires must leave the fbgemm build to the cpu/gpu sets"
    assert sets["requirements/cpu.txt"] & FBGEMM == {"fbgemm-gpu-cpu"} == sets["setup.cfg [cpu]"] & FBGEMM
    assert sets["requirements/gpu.txt"] & FBGEMM == {"fbgemm-gpu"} == sets["setup.cfg [gpu]"] & FBGEMM


def test_make_install_uses_the_cpu_set() -> None:
    """`make` installs through scripts/install.sh (shared with the images): the CPU set, nothing of the GPU's."""
    import subprocess

    install = (REPO / "Makefile").read_text().split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "scripts/install.sh" in install and "--variant cpu" in install
    assert "gpu" not in install.replace("fbgemm-gpu-cpu", "")
    recipe = next(line for line in install.splitlines() if line.strip().startswith("bash scripts/install.sh"))
    args = recipe.split("scripts/install.sh", 1)[1].replace("$(BIN)/python", "python3").split()
    plan = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), *args, "--dry-run"], check=True,
                          capture_output=True, text=True).stdout
    assert "requirements/lock-cpu.txt" in plan and "[cpu," in plan, plan
    assert "gpu" not in plan.replace("fbgemm-gpu-cpu", ""), plan
