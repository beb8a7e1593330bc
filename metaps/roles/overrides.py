"""``--set SECTION.KEY=VALUE`` overrides of a job file, checked against the config dataclasses.

``metaps launch``, ``metaps train-local`` and ``metaps config-write`` take any number
of ``--set``. Each key is a dotted job-file key (``train.max_steps``,
``controller.dds.lease_s``); it must name a real field of the section's frozen
dataclass (or lie inside a table-valued field such as a ``dict``), else the error
names the key and the nearest real ones (``did you mean 'train.max_steps'?``).
VALUE is read as TOML (``4``, ``2.5``, ``true``, ``"x"``, ``[1, 2]``); for a string
field a bare word stays text (``ps.host=10.0.0.2``, ``run.name=2024``). Types and
ranges are then checked by loading the whole job (:func:`metaps.job.job_from_mapping`),
with errors naming the source file and the overrides, never an output file.

Example::

    sets = parse_sets(["train.max_steps=20", "ps.host=10.0.0.2"])
    data = apply_overrides(read_toml("job.toml"), sets)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any

from common.config import toml_key
from common.errors import ConfigError

Override = tuple[list[str], Any]


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


@functools.cache
def job_keys() -> dict[str, Any]:
    """Every settable dotted key of a job file -> its type (nested dataclass tables included)."""
    from metaps.job import _section_types

    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            key = f"{prefix}.{toml_key(f)}"
            tp = _unwrap(hints[f.name])
            out[key] = tp
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, key)

    for name, cls in _section_types().items():
        walk(cls, name)
    return out


def _field_of(key: str, keys: dict[str, Any]) -> tuple[str, Any] | None:
    """The field ``key`` sets: itself, or a table-valued (dict) field it lies inside."""
    if key in keys:
        return key, keys[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 1, -1):
        head = ".".join(parts[:n])
        tp = keys.get(head)
        if tp is not None and (typing.get_origin(tp) is dict or tp is dict or tp is Any):
            return head, tp
    return None


def _is_text(tp: Any) -> bool:
    if tp in (str, Path):
        return True
    if typing.get_origin(tp) is typing.Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    return isinstance(tp, type) and issubclass(tp, str)  # str-valued enums


def parse_sets(texts: list[str]) -> list[Override]:
    """Parse and check ``--set`` arguments against the job's real keys.

    Args:
        texts: ``SECTION.KEY=VALUE`` strings, as given on the command line.

    Raises:
        ConfigError: bad syntax, or a key that is no job-file key (with the nearest real keys).
    """
    import tomllib

    keys = job_keys()
    out: list[Override] = []
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. ps.host=10.0.0.2")
        found = _field_of(key, keys)
        if found is None:
            close = difflib.get_close_matches(key, list(keys), n=3, cutoff=0.75)
            direct = sorted(k for k in keys if k.startswith(parts[0] + ".") and k.count(".") == 1)
            if close:
                hint = f"; did you mean {' or '.join(repr(c) for c in close)}?"
            elif direct:
                hint = f"; the [{parts[0]}] keys are {direct}"
            else:
                hint = f"; the sections are {sorted({k.split('.')[0] for k in keys})}"
            raise ConfigError(f"--set {text!r}: unknown job-file key {key!r}{hint}")
        raw = raw.strip()
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word: text
        if found[0] == key and _is_text(keys[key]) and not isinstance(value, str):
            value = raw  # typed by the field: run.name=2024 is the text "2024"
        out.append((parts, value))
    return out


def apply_overrides(data: dict[str, Any], overrides: list[Override]) -> dict[str, Any]:
    """Set dotted keys in a parsed job mapping (in place; returns it).

    Args:
        data: the parsed job file.
        overrides: from :func:`parse_sets` (or built in code).

    Raises:
        ConfigError: a key runs through a value that is not a table.
    """
    for parts, value in overrides:
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"cannot set {'.'.join(parts)}: {p} is not a table")
            node = nxt
        node[parts[-1]] = value
    return data


def describe(config: str | Path, texts: list[str]) -> str:
    """How errors name an overridden job: ``job.toml with --set a=1 --set b=2``.

    Args:
        config: the source job file.
        texts: the ``--set`` arguments.
    """
    return str(config) + "".join(f" --set {t}" for t in texts) if texts else str(config)
