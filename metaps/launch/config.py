"""The launch's inputs: ``LaunchConfig``, ``--set`` overrides, the effective job file, the run
directory and the resume checkpoint. Pure functions over the job; nothing starts here."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import exit_codes
from common.errors import ConfigError
from metaps.roles.overrides import parse_sets


log = logging.getLogger(__name__)


EXIT_OK, EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM = exit_codes.OK, exit_codes.FAILED, exit_codes.SIGINT, exit_codes.SIGTERM
_WILDCARD = ("", "0.0.0.0", "::", "[::]")

@dataclass(frozen=True)
class LaunchConfig:
    """What ``metaps launch`` was asked to do.

    Args:
        config: the job TOML.
        workers: worker count (None: ``[train] workers``).
        ps: PS shard count (None: ``[ps] shards``).
        run_dir: run directory ('' = ``[run] dir/<name>-<YYYYmmdd-HHMMSS>``); must be new or empty.
        resume_from: warm start from this run dir / checkpoints dir / checkpoint ('' = cold).
        resume: continue this interrupted run from its last committed cut (:mod:`metaps.launch.resume`);
            ``config`` then defaults to the run's own job.toml.
        progress: live rich view on a terminal.
        timeout_s: the run fails after this long (0 = no limit).
        ready_timeout_s: how long the controller and each PS get to come up.
        stop_grace_s: SIGTERM -> SIGKILL grace per role when stopping.
        status_every_s: controller status poll period.
        token_file: read the run's token from this 0600 file, or write it there ('' = ``[rpc] token_file``).
        file_log_level: the level every fleet process logs at into its ``RUN/logs/*.log`` (the
            launcher's own console follows ``--log-level``; the files keep INFO unless asked).
        sets: ``--set SECTION.KEY=VALUE`` overrides of the job file (:mod:`metaps.roles.overrides`).

    Example::

        LaunchConfig(config="configs/local.toml", workers=2, run_dir="runs/t").validate()
    """

    config: str
    workers: int | None = None
    ps: int | None = None
    run_dir: str = ""
    resume_from: str = ""
    resume: str = ""
    progress: bool = True
    timeout_s: float = 0.0
    ready_timeout_s: float = 180.0
    stop_grace_s: float = 20.0
    status_every_s: float = 1.0
    token_file: str = ""
    file_log_level: str = "INFO"
    sets: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.resume and (self.resume_from or self.run_dir):
            raise ValueError("--resume continues a run in its own directory: it takes no --resume-from or --run-dir")
        if not self.config and not self.resume:
            raise ValueError("--config is required (or --resume RUN)")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.ps is not None and self.ps < 1:
            raise ValueError(f"--ps must be >= 1, got {self.ps}")
        if self.timeout_s < 0:
            raise ValueError(f"--timeout must be >= 0, got {self.timeout_s}")
        if self.file_log_level not in LOG_LEVELS:
            raise ValueError(f"--file-log-level must be one of {', '.join(LOG_LEVELS)}, got {self.file_log_level!r}")
        for name in ("ready_timeout_s", "stop_grace_s", "status_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``ps.host=10.0.0.2`` -> (["ps", "host"], "10.0.0.2"); VALUE is read as TOML, else a string.

    Example::

        parse_override("train.workers=4")   # (["train", "workers"], 4)
    """
    return parse_sets([text])[0]


def write_job(path: Path, data: dict[str, Any]) -> Any:
    """Validate a job mapping, write it as TOML, load it back. Returns the JobConfig.

    Nothing is written when the mapping is invalid (the ConfigError names ``path``).
    """
    from metaps.job import job_from_mapping, load_job
    from common.toml_writer import write

    job_from_mapping(data, where=str(path))
    write(path, data)
    return load_job(path)


def _absolute_data_paths(data: dict[str, Any]) -> None:
    """Make [data] paths absolute (processes may run from another directory or host)."""
    sec = data.get("data", {})
    for k in ("train", "eval", "schema"):
        if isinstance(sec.get(k), str) and sec[k]:
            sec[k] = str(Path(sec[k]).resolve())


def find_resume_checkpoint(path: str | Path) -> Path:
    """The checkpoint to warm-start from: a checkpoint dir itself, else the latest under
    ``<path>/checkpoints`` or ``<path>``.

    Raises:
        ConfigError: nothing committed there.
    """
    from ps.checkpoint import latest_checkpoint

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--resume-from {p}: no such file or directory")
    if (p / "manifest.json").exists():
        return p
    for root in (p / "checkpoints", p):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ConfigError(f"--resume-from {p}: no committed checkpoint (ckpt-<step>/manifest.json) in {p} "
                      f"or {p / 'checkpoints'}")


def _new_run_dir(lc: LaunchConfig, job: Any) -> tuple[Path, bool]:
    """(run dir, auto-named). An explicit dir must be new or empty."""
    if lc.run_dir:
        d = Path(lc.run_dir).resolve()
        if d.exists() and any(d.iterdir()):
            raise ConfigError(f"--run-dir {d} is not empty (it holds another run); pick a new directory")
        return d, False
    root = Path(job.run.dir)
    base = f"{job.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    d, n = root / base, 1
    while d.exists():
        n += 1
        d = root / f"{base}-{n}"
    return d.resolve(), True


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in _WILDCARD else host


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _metaps(*args: str, level: str = "INFO") -> list[str]:
    """``python -m metaps --log-level LEVEL ARGS``: a fleet process logging at ``level`` into its log file."""
    return [sys.executable, "-m", "metaps", "--log-level", level, *args]


