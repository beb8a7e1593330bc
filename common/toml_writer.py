"""TOML out, through tomlkit (``tomllib`` reads TOML but cannot write it).

Two uses:

* :func:`dumps` / :func:`write`: plain data (what job files hold: nested tables of
  strings, ints, floats, bools, lists of those, lists of tables) as TOML text. TOML has
  no null: a key whose value is ``None`` is an unset key and is left out (a config's
  optional field, e.g. a ``[[ps.tables]]`` override's ``dim``, reads back as unset, i.e.
  ``None`` again); ``None`` in an array, and any other type, is refused with the dotted
  key named. The output parses back with ``tomllib`` to the mapping less its ``None`` keys.
* :func:`set_keys`: change dotted keys in existing TOML text and keep everything else
  as it was: comments, blank lines, key order, quoting (``metaps config-write``).

Example::

    text = dumps({"ps": {"shards": 2, "host": "0.0.0.0"},
                  "faults": {"faults": [{"target": "worker", "index": 1}]}})
    assert tomllib.loads(text)["ps"]["shards"] == 2
    set_keys("# mine\\n[ps]\\nshards = 2  # two\\n", [(["ps", "shards"], 4)])   # comments kept
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.exceptions
from tomlkit.items import Table

from common.atomic_write import write_text_atomic
from common.errors import MetapsError


class TomlWriteError(MetapsError, ValueError):
    """A value has no TOML form (None, an object, a non-string key), or a key cannot be set."""


def _plain(v: Any, where: str) -> Any:
    """``v`` checked for a TOML form (the error names ``where``), Paths as strings, tuples as lists,
    keys whose value is ``None`` (unset) left out of their table."""
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, Mapping):
        out: dict[str, Any] = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise TomlWriteError(f"{where}: TOML keys must be strings, got {type(k).__name__} {k!r}")
            if x is None:  # an unset key: TOML says so by its absence
                continue
            out[k] = _plain(x, f"{where}.{k}" if where != "<root>" else k)
        return out
    if isinstance(v, (list, tuple)):
        return [_plain(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if v is None:
        raise TomlWriteError(f"{where}: TOML has no null; give a value (only a table's key can be unset: left out)")
    raise TomlWriteError(f"{where}: cannot write {type(v).__name__} {v!r} as TOML")


def dumps(data: Mapping[str, Any]) -> str:
    """``data`` as TOML text: scalars first, then one ``[section]`` per nested table.

    Args:
        data: a mapping of str keys to scalars, lists and nested mappings; a key whose value is
            ``None`` is left out.

    Raises:
        TomlWriteError: a value has no TOML form (the message names its key).
    """
    plain = _plain(data, "<root>")
    try:
        return tomlkit.dumps(plain)
    except (tomlkit.exceptions.TOMLKitError, TypeError, ValueError) as exc:  # pragma: no cover - checked above
        raise TomlWriteError(f"cannot write as TOML: {exc}") from None


def set_keys(text: str, overrides: Sequence[tuple[Sequence[str], Any]], where: str = "<toml>") -> str:
    """Set dotted keys in TOML ``text``; every comment, blank line and untouched key stays as written.

    Missing tables are created (as ``[a.b]`` sections at the end).

    Args:
        text: the TOML document.
        overrides: (key parts, value) pairs, e.g. ``(["ps", "host"], "10.0.0.2")``.
        where: what to name in errors (the source file).

    Raises:
        TomlWriteError: the text does not parse, a value has no TOML form, or a key
            runs through a value that is not a table.
    """
    try:
        doc = tomlkit.parse(text)
    except tomlkit.exceptions.TOMLKitError as exc:
        raise TomlWriteError(f"{where}: not valid TOML: {exc}") from None
    for parts, value in overrides:
        dotted = ".".join(parts)
        node: Any = doc
        for i, p in enumerate(parts[:-1]):
            if p not in node:
                node[p] = tomlkit.table(is_super_table=i < len(parts) - 2)
            nxt = node[p]
            if not isinstance(nxt, (Mapping, Table)):
                raise TomlWriteError(f"{where}: cannot set {dotted}: {'.'.join(parts[:i + 1])} is not a table")
            node = nxt
        _put(node, parts[-1], _plain(value, dotted))
    return tomlkit.dumps(doc)


def _put(node: Any, key: str, value: Any) -> None:
    """Set ``key``; a new plain key goes right after the table's last plain key, not after
    the comments that introduce the next section."""
    container: Any = getattr(node, "value", None)  # a Table's Container
    body = getattr(container, "body", None)
    if key in node or body is None or isinstance(value, dict):
        node[key] = value
        return
    last = [k for k, v in body if k is not None and not isinstance(v, (Table, tomlkit.items.AoT))]
    if not last:
        node[key] = value
        return
    container._insert_after(last[-1].key, key, value)


def write(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Write ``dumps(data)`` to ``path`` atomically (temp file + rename).

    Example::

        write("runs/x/job.toml", {"train": {"workers": 4}})
    """
    return write_text_atomic(path, dumps(data))
