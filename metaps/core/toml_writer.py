"""A small TOML writer for plain data (``tomllib`` reads TOML but cannot write it).

Handles what job files hold: nested tables of strings, ints, floats, bools,
lists of those, and lists of tables (written as inline tables). ``None`` has no
TOML form and is refused, as is any other type, with the dotted key named.
The output parses back with ``tomllib`` to an equal mapping.

Example::

    text = dumps({"ps": {"shards": 2, "host": "0.0.0.0"},
                  "faults": {"faults": [{"target": "worker", "index": 1}]}})
    assert tomllib.loads(text)["ps"]["shards"] == 2
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metaps.core.errors import MetapsError
from metaps.core.atomic_write import write_text_atomic

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


class TomlWriteError(MetapsError, ValueError):
    """A value has no TOML form (None, an object, a non-string key)."""


def _key(k: Any, where: str) -> str:
    if not isinstance(k, str):
        raise TomlWriteError(f"{where}: TOML keys must be strings, got {type(k).__name__} {k!r}")
    return k if _BARE_KEY.match(k) else json.dumps(k, ensure_ascii=False)


def _scalar(v: Any, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # shortest round-trip form, always has '.' or 'e'
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML basic strings
    if isinstance(v, Path):
        return json.dumps(str(v), ensure_ascii=False)
    if isinstance(v, Mapping):
        items = ", ".join(f"{_key(k, where)} = {_value(x, f'{where}.{k}')}" for k, x in v.items())
        return "{" + (f" {items} " if items else "") + "}"
    if v is None:
        raise TomlWriteError(f"{where}: TOML has no null; drop the key or give a value")
    raise TomlWriteError(f"{where}: cannot write {type(v).__name__} {v!r} as TOML")


def _value(v: Any, where: str) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
    return _scalar(v, where)


def dumps(data: Mapping[str, Any]) -> str:
    """``data`` as TOML text: scalars first, then one ``[section]`` per nested table.

    Args:
        data: a mapping of str keys to scalars, lists and nested mappings.

    Raises:
        TomlWriteError: a value has no TOML form (the message names its key).
    """
    lines: list[str] = []

    def table(d: Mapping[str, Any], path: list[str]) -> None:
        where = ".".join(path) or "<root>"
        subs = []
        body = []
        for k, v in d.items():
            if isinstance(v, Mapping) and v:
                subs.append((k, v))
            else:
                body.append(f"{_key(k, where)} = {_value(v, f'{where}.{k}' if path else str(k))}")
        if path and (body or not subs):
            if lines:
                lines.append("")
            lines.append("[" + ".".join(_key(p, where) for p in path) + "]")
        lines.extend(body)
        for k, v in subs:
            table(v, path + [k])

    table(data, [])
    return "\n".join(lines) + "\n"


def write(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Write ``dumps(data)`` to ``path`` atomically (temp file + rename).

    Example::

        write("runs/x/job.toml", {"train": {"workers": 4}})
    """
    return write_text_atomic(path, dumps(data))
