"""One error tree: every deliberate error derives from ``MetapsError`` and the CLI prints one line for it.

The classes are found by importing every module of every package and walking
``MetapsError.__subclasses__()`` recursively, so a new error class is covered
without editing this file. A project exception class outside the tree fails
``test_every_project_exception_is_in_the_tree`` unless it is listed in
``NOT_ERRORS`` with the reason it is not a deliberate error.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
from pathlib import Path

import grpc
import pytest

from metaps.cli import run_command
from common.errors import MetapsError

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "metaps", "ps", "controller", "workers", "meta_io", "models", "delivery", "protos")

# Exception classes of the project that are not deliberate errors (internal control flow).
NOT_ERRORS = {
    "ps.gate.RpcAbort": "internal: carries a gRPC status from a handler to the servicer's abort",
    "metaps.api.StopTraining": "a request, not an error: a callback raises it to end the run cleanly (as returning STOP does)",
}

# The errors issue 12 named as bypassing the tree; they must stay in it.
NAMED = {
    "ps.migration.MigrationError", "ps.coordinator.CheckpointCoordinationError",
    "controller.ps_recovery.RecoveryError", "metaps.fleet.FleetError", "ps.wire.WireError",
    "ps.staleness.StalenessTimeout", "controller.ps_mover.NothingToMove",
    "common.toml_writer.TomlWriteError",
}


def _import_all() -> list[object]:
    modules = []
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        modules.append(mod)
        for info in pkgutil.walk_packages(mod.__path__, prefix=pkg + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__":
                continue
            modules.append(importlib.import_module(info.name))
    return modules


def _qual(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _tree(cls: type) -> list[type]:
    out: list[type] = []
    for sub in cls.__subclasses__():
        if sub.__module__.split(".")[0] in PACKAGES:
            out.append(sub)
        out.extend(_tree(sub))
    return sorted(set(out), key=_qual)


MODULES = _import_all()
OWN_EXIT_CODES = {"workers.worker.FinalCheckpointFailed": 4}
"""Errors a command exits with other than 1 on (``MetapsError.exit_code``): a retry cannot help."""
ERRORS = [MetapsError, *_tree(MetapsError)]


def _make(cls: type[BaseException], message: str) -> BaseException:
    """An instance of ``cls`` whose text contains ``message``, whatever its constructor takes."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or not params:
        return cls(message)
    args = []
    for p in params:
        ann = str(p.annotation)
        if "StatusCode" in ann:
            args.append(grpc.StatusCode.FAILED_PRECONDITION)
        elif ann.startswith("list"):
            args.append([message, "second problem"])
        elif ann in ("int", "float"):  # a number the message is built from (e.g. a clock, a lease)
            args.append(7)
        else:
            args.append(message)
    return cls(*args)


def test_the_named_errors_are_in_the_tree():
    found = {_qual(c) for c in ERRORS}
    assert NAMED <= found, f"outside MetapsError: {sorted(NAMED - found)}"


def test_every_project_exception_is_in_the_tree():
    stray = set()
    for mod in MODULES:
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if (issubclass(obj, BaseException) and obj.__module__ == mod.__name__
                    and not issubclass(obj, MetapsError) and _qual(obj) not in NOT_ERRORS):
                stray.add(_qual(obj))
    assert not stray, f"exception classes outside MetapsError (derive them, or list them in NOT_ERRORS): {sorted(stray)}"


@pytest.mark.parametrize("cls", ERRORS, ids=_qual)
def test_cli_prints_one_line(cls, capsys):
    exc = _make(cls, "the thing is wrong\n  on a second line")

    def handler(args: argparse.Namespace) -> int:
        raise exc

    rc = run_command("check", handler, argparse.Namespace())
    err = capsys.readouterr().err
    assert rc == OWN_EXIT_CODES.get(_qual(cls), 1)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("metaps check: error: ") and "the thing is wrong" in lines[0], err
    assert "Traceback" not in err
