"""Structured logging for every metaps process.

Lines look like ``2026-11-29T12:00:00 INFO ps.servicer shard=0 msg="serving" port=5001``:
``key=value`` pairs after the message, so fleets can grep and parse them.
Use ``log.info("serving", extra=kv(port=port))``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

_ROLE = os.environ.get("METAPS_ROLE", "")


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


def configure(level: str | int = "INFO", role: str = "") -> None:
    """Install the key=value formatter on the root logger (idempotent)."""
    global _ROLE
    if role:
        _ROLE = role
    root = logging.getLogger()
    root.setLevel(level if isinstance(level, int) else level.upper())
    for h in root.handlers:
        if isinstance(h.formatter, KeyValueFormatter):
            return
    handler = _StderrHandler()
    handler.setFormatter(KeyValueFormatter())
    handler.addFilter(_DropRootInfo())
    root.addHandler(handler)
