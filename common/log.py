"""Structured logging for every metaps process.

Lines look like ``2026-11-29T12:00:00 INFO ps.servicer shard=0 msg="serving" port=5001``:
``key=value`` pairs after the message, so fleets can grep and parse them.
Use ``log.info("serving", extra=kv(port=port))``.

``[log] format = "json"`` in the job file (or ``METAPS_LOG_FORMAT=json`` in the environment,
for a process started before any job file is read) writes one JSON object per line instead:
``{"time": "2026-11-29T12:00:00.123Z", "level": "INFO", "logger": "ps.servicer",
"message": "serving", "port": 5001}`` (:class:`JsonFormatter`), for log collectors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from common.errors import ConfigError

_ROLE = os.environ.get("METAPS_ROLE", "")
ENV_FORMAT = "METAPS_LOG_FORMAT"
FORMATS = ("text", "json")


@dataclass(frozen=True)
class LogConfig:
    """How every metaps process writes its log lines (``[log]``).

    Args:
        format: ``"text"`` (``TIME LEVEL LOGGER msg="..." key=value ...``) or ``"json"`` (one
            JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
            ``role`` when known, the line's structured fields, ``exc`` for a traceback); ``''``:
            ``METAPS_LOG_FORMAT`` from the environment, else text. Every command given the job
            file (``--config``, and ``--set log.format=...`` where it takes ``--set``) honours it
            from its first line; ``metaps deploy k8s`` sets ``METAPS_LOG_FORMAT`` in every
            container when it is ``"json"``.
    """

    format: str = ""

    def validate(self) -> None:
        if self.format not in ("", *FORMATS):
            raise ValueError(f"format: expected one of 'text', 'json', got {self.format!r}")


def resolve_format(fmt: str = "") -> str:
    """The format a process uses: ``fmt`` (a job's ``[log] format``) if set, else
    ``METAPS_LOG_FORMAT``, else ``"text"``.

    Raises:
        ConfigError: ``METAPS_LOG_FORMAT`` holds something else than ``text`` or ``json``.
    """
    if fmt:
        return fmt
    env = os.environ.get(ENV_FORMAT, "").strip()
    if env and env not in FORMATS:
        raise ConfigError(f"{ENV_FORMAT}: expected one of 'text', 'json', got {env!r}")
    return env or "text"


def kv(**fields: Any) -> dict[str, Any]:
    """Fields for ``extra=``: rendered as ``key=value`` after the message."""
    return {"kv": fields}


class _DropRootInfo(logging.Filter):
    """Drop records logged on the root logger below WARNING.

    metaps logs through named loggers only; INFO on the root logger is third-party
    chatter (fbgemm-gpu announces every .so it loads) that would bury our lines.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != "root" or record.levelno >= logging.WARNING


def quote_value(v: object) -> str:
    """A field value as it appears in a log line: bare when it is one plain token, else quoted
    logfmt-style (``"`` and ``\\`` escaped, newlines as ``\\n``), so ``reason=the PS died`` reads
    back as one field (:func:`metaps.progress.parse_kv_line`)."""
    s = str(v)
    if s and not any(c in s for c in ' "=\\\n\t'):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


class KeyValueFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER [role=R] msg="..." key=value ...``; a value with spaces, quotes or ``=`` is
    quoted (:func:`quote_value`); ``msg`` is always quoted."""

    def format(self, record: logging.LogRecord) -> str:
        ts = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
        parts = [ts, record.levelname, record.name]
        if _ROLE:
            parts.append(f"role={_ROLE}")
        msg = quote_value(record.getMessage())
        parts.append(f"msg={msg if msg.startswith(chr(34)) else chr(34) + msg + chr(34)}")
        fields = getattr(record, "kv", None)
        if fields:
            parts.extend(f"{k}={quote_value(v)}" for k, v in fields.items())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


_RESERVED = ("time", "level", "logger", "message", "role", "exc")


def _json_value(v: object) -> object:
    """A field value as JSON holds it: numbers, bools, null and strings as they are (a NaN or
    infinity as its text: JSON has none), anything else as its ``str``."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    return str(v)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``message``, ``role`` (when
    known), then the record's ``kv`` fields (a field named like one of those comes as
    ``kv_NAME``), and ``exc`` with the traceback. Never more than one line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
        out: dict[str, object] = {"time": ts.replace("+00:00", "Z"), "level": record.levelname,
                                  "logger": record.name, "message": record.getMessage()}
        if _ROLE:
            out["role"] = _ROLE
        fields = getattr(record, "kv", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                out[f"kv_{k}" if k in _RESERVED else str(k)] = _json_value(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of ``fmt`` (``"text"`` or ``"json"``)."""
    return JsonFormatter() if fmt == "json" else KeyValueFormatter()


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not the stream it was
    when logging was configured: a replaced stderr (a test's capture, a redirect) that is
    later closed must not turn every later log line into a "--- Logging error ---" report."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it; sys.stderr wins
        pass


def configure(level: str | int = "INFO", role: str = "", fmt: str = "") -> None:
    """Install the metaps formatter on the root logger (idempotent; a second call switches the
    format).

    Args:
        level: the root logger's level.
        role: the process's role, written into every line.
        fmt: ``"text"`` or ``"json"``; ``''``: ``METAPS_LOG_FORMAT``, else text (:func:`resolve_format`).

    Raises:
        ConfigError: a bad ``METAPS_LOG_FORMAT``.
    """
    global _ROLE
    chosen = resolve_format(fmt)
    if role:
        _ROLE = role
    root = logging.getLogger()
    root.setLevel(level if isinstance(level, int) else level.upper())
    for h in root.handlers:
        if isinstance(h.formatter, (KeyValueFormatter, JsonFormatter)):
            if not isinstance(h.formatter, JsonFormatter if chosen == "json" else KeyValueFormatter):
                h.setFormatter(formatter(chosen))
            return
    handler = _StderrHandler()
    handler.setFormatter(formatter(chosen))
    handler.addFilter(_DropRootInfo())
    root.addHandler(handler)
