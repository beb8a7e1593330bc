"""The ``metaps`` command line: one entry point, one subcommand per role or tool.

Each role entry point in :mod:`metaps.roles` (and the launcher, the deploy tools)
registers its subcommands with a ``register(subparsers)`` function. The entry points
live on the app floor: subsystems never import the job composition.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Iterator

from metaps import __version__
from common import log
from common.errors import MetapsError

# Modules that contribute subcommands, in help order.
COMMAND_MODULES = (
    "metaps.roles.data",        # gen-data, meta-io build|inspect
    "metaps.roles.ps",          # ps
    "metaps.roles.worker",      # worker, train-local
    "metaps.roles.controller",  # controller, agent, status, cut
    "metaps.launch",            # launch
    "metaps.roles.deliver",     # deliver, predict
    "metaps.evaluate",          # evaluate
    "metaps.deploy.cli",  # deploy k8s|wait
    "metaps.roles.monitor",  # monitor
)


class HelpFormatter(argparse.HelpFormatter):
    """Every valued flag's help ends with its default, unless the text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.default is argparse.SUPPRESS or action.required
                or "default" in text.lower() or "%(default)" in text):
            return text
        shown = "none" if action.default in (None, "", [], ()) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def _add_global_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """``--log-level`` and ``--json`` on ``parser``: before or after the subcommand alike.

    Below the top they default to SUPPRESS, so a subcommand that does not repeat them
    keeps the value given before it.
    """
    parser.add_argument("--log-level", default="INFO" if top else argparse.SUPPRESS, metavar="LEVEL",
                        help="logging level on stderr: DEBUG, INFO, WARNING, ERROR (default: INFO)")
    parser.add_argument("--json", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="print exactly one JSON object on stdout instead of the human summary")


def walk_parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser below ``parser`` (depth first) with its command path, e.g. ``meta-io build``.

    Args:
        parser: the root parser (from :func:`build_parser`).
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # aliases
                    continue
                seen.add(id(sub))
                yield name, sub
                for deeper, p in walk_parsers(sub):
                    yield f"{name} {deeper}", p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metaps", description="Parameter-server recommender training.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"metaps {__version__}")
    _add_global_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # subsystem not built in this tree
                continue
            raise
        module.register(sub)
    for _, p in walk_parsers(parser):
        p.formatter_class = HelpFormatter
        _add_global_flags(p, top=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:  # a job's [log] format applies from the command's first line (METAPS_LOG_FORMAT without one)
        fmt = job_log_format(getattr(args, "config", None), getattr(args, "sets", None))
        log.configure(args.log_level, role=args.command, fmt=fmt)
    except MetapsError as exc:
        print(error_line(args.command, exc), file=sys.stderr)
        return int(exc.exit_code)
    return run_command(args.command, args.func, args)


def job_log_format(config: object, sets: object = None) -> str:
    """``[log] format`` of the job file a command was given (``--config``, with its ``--set log.*``
    overrides); '' without one.

    Args:
        config: the command's ``--config`` value (None or '' when it has none; a file that does
            not exist is left to the command to report).
        sets: the command's ``--set SECTION.KEY=VALUE`` arguments, if it takes them.

    Raises:
        ConfigError: the file is not TOML, or its ``[log]`` table (or a ``--set log.*``) is wrong.
    """
    from pathlib import Path

    from common.config import from_mapping, read_toml

    section: dict[str, object] = {}
    if isinstance(config, (str, Path)) and config and Path(config).is_file():
        found = read_toml(config).get("log", {})
        if not isinstance(found, dict):
            return ""  # the command's own load names the error
        section = dict(found)
    log_sets = [t for t in (sets if isinstance(sets, list) else []) if isinstance(t, str) and t.startswith("log.")]
    if log_sets:
        from metaps.roles.overrides import apply_overrides, parse_sets

        section = apply_overrides({"log": section}, parse_sets(log_sets))["log"]
    return from_mapping(log.LogConfig, section, where=str(config or "--set"), prefix="log").format if section else ""


def error_line(command: str, exc: BaseException) -> str:
    """The one line the CLI prints for a deliberate error (newlines folded, never empty).

    Args:
        command: the subcommand that failed (``launch``, ``ps``, ...).
        exc: the error raised.
    """
    msg = str(exc).replace("\r", " ").replace("\n", " ").strip()
    # a message that already names the command ("metaps worker: ...") is not prefixed twice
    msg = re.sub(rf"^(metaps {re.escape(command)}(:\s*error:|:)\s*)+", "", msg).strip() or type(exc).__name__
    return f"metaps {command}: error: {msg}"


def run_command(command: str, func: Callable[[argparse.Namespace], int | None],
                args: argparse.Namespace) -> int:
    """Run one subcommand: a deliberate error (any ``MetapsError``) is one stderr line and exit 1
    (or the error's own ``exit_code``, e.g. 4 for a final checkpoint that could not be written).

    Args:
        command: the subcommand name, used in the error line.
        func: the subcommand's handler.
        args: its parsed arguments.
    """
    try:
        rc = func(args)
    except MetapsError as exc:
        print(error_line(command, exc), file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
