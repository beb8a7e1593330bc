"""The locked install set (requirements/lock*.txt, written by scripts/lock.py) is whole and in use.

* every requirement the inputs declare (setup.cfg install_requires and the test extra,
  requirements/cpu.txt) is locked at a version its range admits;
* every locked line is an exact pin with a sha256 (pip's --require-hashes needs both);
* the environment running this suite is the locked one: each locked package at its locked version.
"""

from __future__ import annotations

import configparser
import importlib.metadata as md
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
REQ = REPO / "requirements"
LOCKS = ("lock.txt", "lock-cpu.txt", "lock-test.txt")
"""What `make install` installs (the test environment); `lock-mutation.txt` goes on top only for `make mutation`."""
_PIN = re.compile(r"^([a-z0-9][a-z0-9-]*)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", re.M)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(names: tuple[str, ...] = LOCKS) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in names:
        text = (REQ / name).read_text()
        body = "\n".join(l for l in text.splitlines() if not l.startswith("#"))
        pins = _PIN.findall(body + "\n")
        assert len(pins) == body.count("=="), f"requirements/{name}: a line is not `name==version --hash=sha256:...`"
        for pkg, version, _ in pins:
            assert pkg not in out, f"{pkg} locked twice (requirements/{name})"
            out[pkg] = version
    return out


def _inputs() -> list[Requirement]:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines() + cfg["options.extras_require"]["test"].splitlines()
    lines += (REQ / "cpu.txt").read_text().splitlines()
    return [Requirement(l.split("#", 1)[0].strip()) for l in lines if l.split("#", 1)[0].strip()]


def test_every_declared_requirement_is_locked_inside_its_range() -> None:
    pins = locked()
    for req in _inputs():
        name = _canon(req.name)
        assert name in pins, f"{req} is declared but not locked: run python scripts/lock.py"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), f"{req}: locked {pins[name]}"


def test_the_mutation_tools_are_locked_on_top_of_the_rest() -> None:
    every = locked(LOCKS + ("lock-mutation.txt",))  # a package locked twice fails here
    assert _canon("mutmut") in every
    for line in (REQ / "mutation.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert req.specifier.contains(Version(every[_canon(req.name)]), prereleases=True), req


def test_the_lock_holds_one_fbgemm_build_per_variant() -> None:
    pins = locked()
    assert "fbgemm-gpu-cpu" in pins and "fbgemm-gpu" not in pins
    assert "metaps" not in pins


def test_this_environment_is_the_locked_one() -> None:
    wrong = []
    for pkg, version in locked().items():
        try:
            have = md.version(pkg)
        except md.PackageNotFoundError:
            wrong.append(f"{pkg}: locked {version}, not installed")
            continue
        if Version(have) != Version(version):
            wrong.append(f"{pkg}: locked {version}, installed {have}")
    assert not wrong, "the environment is not the lock (make install): " + "; ".join(wrong)
