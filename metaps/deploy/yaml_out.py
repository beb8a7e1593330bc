"""A small YAML writer for Kubernetes manifests (block style; no PyYAML needed at run time).

Strings are written as JSON strings (valid YAML double-quoted scalars) unless they are
plain words that YAML cannot mistake for another type, so ``"true"``, ``"0400"`` or
``"9400"`` stay strings.

Example::

    dumps_all([{"apiVersion": "v1", "kind": "ConfigMap", "data": {"a": "1"}}])
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./-]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED:
        return s
    return json.dumps(s)


def _emit(v: Any, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(v, Mapping):
        for k, x in v.items():
            key = _scalar(str(k))
            if isinstance(x, str) and "\n" in x:
                out.append(f"{pad}{key}: |")
                out.extend(f"{pad}  {line}" if line else "" for line in x.rstrip("\n").split("\n"))
            elif isinstance(x, (Mapping, list)) and x:
                out.append(f"{pad}{key}:")
                _emit(x, indent + 2 if isinstance(x, Mapping) else indent, out)
            else:
                out.append(f"{pad}{key}: {_scalar(x) if not isinstance(x, (Mapping, list)) else ('{}' if isinstance(x, Mapping) else '[]')}")
    elif isinstance(v, list):
        for x in v:
            if isinstance(x, (Mapping, list)) and x:
                sub: list[str] = []
                _emit(x, indent + 2, sub)
                out.append(f"{pad}- {sub[0].lstrip()}")
                out.extend(sub[1:])
            else:
                out.append(f"{pad}- {_scalar(x) if not isinstance(x, (Mapping, list)) else '[]'}")
    else:
        out.append(f"{pad}{_scalar(v)}")


def dumps(doc: Mapping[str, Any]) -> str:
    """One YAML document."""
    out: list[str] = []
    _emit(doc, 0, out)
    return "\n".join(out) + "\n"


def dumps_all(docs: Iterable[Mapping[str, Any]]) -> str:
    """Documents separated by ``---``."""
    return "---\n".join(dumps(d) for d in docs)
