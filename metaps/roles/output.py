"""One CLI voice: a short human summary on a terminal, or exactly one JSON object with ``--json``.

Every ``metaps`` command that ends with a result calls :func:`emit` once: with the
global ``--json`` flag (before or after the subcommand) stdout holds that one JSON
object and nothing else; without it, the human lines. Logs go to stderr either way.
A library that logs its own completion line (``generated``, ``build done``) would
say the summary twice; :func:`summary_replaces` drops that log twin while the
command prints the summary itself (progress lines stay).

Example::

    emit(args, {"rows": 600, "out": "data/"}, "wrote 600 rows to data/")
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any


def wants_json(args: argparse.Namespace) -> bool:
    """True when the command was given the global ``--json`` flag.

    Args:
        args: the parsed command line.
    """
    return bool(getattr(args, "json", False))


def emit(args: argparse.Namespace, data: Mapping[str, Any], human: str | list[str]) -> None:
    """Print the command's result once: ``data`` as one JSON object with ``--json``, else ``human``.

    Args:
        args: the parsed command line (reads ``json``).
        data: the machine-readable result (values that JSON lacks are written with ``str``).
        human: the terminal summary (a string, or lines).
    """
    if wants_json(args):
        print(json.dumps(dict(data), default=str), flush=True)
        return
    print(human if isinstance(human, str) else "\n".join(human), flush=True)


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str, messages: frozenset[str]) -> None:
        super().__init__()
        self.prefix = prefix
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith(self.prefix) and record.getMessage() in self.messages)


@contextlib.contextmanager
def summary_replaces(logger_prefix: str, *messages: str) -> Iterator[None]:
    """Within the block, drop the log records ``messages`` of loggers under ``logger_prefix``.

    Args:
        logger_prefix: e.g. ``meta_io``.
        messages: the completion messages the command's own summary replaces.
    """
    flt = _DropMessages(logger_prefix, frozenset(messages))
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(flt)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(flt)
