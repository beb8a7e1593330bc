"""``runs/latest``: names the running run from its start and never a failed run
(``mark_latest`` at start, ``settle_latest`` at the end; ``last-failed`` names a failed one).
A run continued with ``metaps launch --resume`` follows the same rule when it is an
auto-named run (:func:`follows_latest`): ``latest`` names it while it runs and after it succeeds."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from common.log import kv


log = logging.getLogger(__name__)


LATEST, LAST_FAILED = "latest", "last-failed"


def _point(link: Path, target: str) -> None:
    """Make ``link`` a symlink to ``target`` (relative) in one rename: readers never see it missing."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)


def follows_latest(run_dir: Path, run_name: str) -> bool:
    """Whether a run continued in ``run_dir`` (``--resume``) moves ``latest``: it was auto-named
    (``<[run] name>-YYYYmmdd-HHMMSS[-N]``, as :func:`metaps.launch.config._new_run_dir` names runs), or
    ``latest`` / ``last-failed`` beside it names it. A run in a directory the user named does not.

    Args:
        run_dir: the run directory being continued.
        run_name: its job's ``[run] name``.
    """
    if re.fullmatch(re.escape(run_name) + r"-\d{8}-\d{6}(-\d+)?", run_dir.name):
        return True
    for name in (LATEST, LAST_FAILED):
        link = run_dir.parent / name
        if link.is_symlink() and os.readlink(link) == run_dir.name:
            return True
    return False


def mark_latest(run_dir: Path) -> str | None:
    """Point ``<runs>/latest`` at ``run_dir`` as the run starts; returns the previous target ('' if none;
    None when ``latest`` is not a symlink and was left alone).

    Its logs can be tailed (``runs/latest/logs``) while it runs. A ``latest`` that is not a
    symlink (a user's directory) is left alone.

    Args:
        run_dir: the new run directory (its parent holds ``latest``).
    """
    link = run_dir.parent / LATEST
    previous = os.readlink(link) if link.is_symlink() else ""
    if link.exists() and not link.is_symlink():
        log.warning("runs/latest is not a symlink; not touching it", extra=kv(path=str(link)))
        return None
    _point(link, run_dir.name)
    log.info("latest points at the running run", extra=kv(link=str(link), run=run_dir.name))
    return previous


def settle_latest(run_dir: Path, succeeded: bool, previous: str | None) -> None:
    """At the end of a run: ``latest`` stays on it when it succeeded; otherwise ``latest`` goes
    back to the run it named before (or goes away) and ``last-failed`` names this one.

    Args:
        run_dir: the run that ended.
        succeeded: whether it succeeded (failed and interrupted runs never stay ``latest``).
        previous: :func:`mark_latest`'s return value (None: latest was not marked).
    """
    if previous is None:
        return
    link = run_dir.parent / LATEST
    try:
        if succeeded:
            _point(link, run_dir.name)
            return
        _point(run_dir.parent / LAST_FAILED, run_dir.name)
        if link.is_symlink() and os.readlink(link) == run_dir.name:
            if previous and previous != run_dir.name:  # (a continued run that latest still named)
                _point(link, previous)
            else:
                link.unlink()
        log.info("run did not succeed: latest restored", extra=kv(latest=previous or "-", last_failed=run_dir.name))
    except OSError as exc:
        log.error("could not update runs/latest", extra=kv(dir=str(run_dir.parent), error=str(exc)[:200]))


