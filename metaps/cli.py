"""The ``metaps`` command line: one entry point, one subcommand per role or tool.

Each subsystem registers its own subcommands from its ``cli`` module (a
``register(subparsers)`` function), so a new command lives next to its code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from metaps import __version__
from metaps.core import log
from metaps.core.errors import MetapsError

# Modules that contribute subcommands, in help order.
COMMAND_MODULES = (
    "meta_io.cli",      # gen-data, meta-io build|inspect
    "ps.cli",           # ps
    "workers.cli",      # worker, train-local
    "controller.cli",   # controller, agent
    "metaps.launch",    # launch
    "delivery.cli",     # deliver, predict
    "metaps.evaluate",  # evaluate
    "metaps.deploy.cli",  # deploy k8s|wait
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metaps", description="Parameter-server recommender training.")
    parser.add_argument("--version", action="version", version=f"metaps {__version__}")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # subsystem not built in this tree
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    log.configure(args.log_level, role=args.command)
    return run_command(args.command, args.func, args)


def error_line(command: str, exc: BaseException) -> str:
    """The one line the CLI prints for a deliberate error (newlines folded, never empty).

    Args:
        command: the subcommand that failed (``launch``, ``ps``, ...).
        exc: the error raised.
    """
    msg = str(exc).replace("\r", " ").replace("\n", " ").strip() or type(exc).__name__
    return f"metaps {command}: error: {msg}"


def run_command(command: str, func: Callable[[argparse.Namespace], int | None],
                args: argparse.Namespace) -> int:
    """Run one subcommand: a deliberate error (any ``MetapsError``) is one stderr line and exit 1.

    Args:
        command: the subcommand name, used in the error line.
        func: the subcommand's handler.
        args: its parsed arguments.
    """
    try:
        rc = func(args)
    except MetapsError as exc:
        print(error_line(command, exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
