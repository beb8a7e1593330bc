"""Generate ``docs/configuration.md`` from the config dataclasses.

The reference is derived, never hand-edited, so it cannot drift:
``tests/metaps/test_config_doc.py`` fails when the committed file differs from
what this module renders. Regenerate with ``python -m metaps.config_doc``.

Field descriptions come from each dataclass docstring's ``Args:`` section.
Defaults come from the field that holds a table, when it has one: ``[ps]
dense_optimizer`` defaults to ``OptimizerConfig(kind="adam", lr=1e-3)``, so its
table lists adam and 0.001, not ``OptimizerConfig``'s own field defaults (an
embedding table's rowwise_adagrad, 0.05).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
import typing
from pathlib import Path
from typing import Any

from common.config import toml_key

ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "docs" / "configuration.md"


def _args_docs(cls: type) -> dict[str, str]:
    """Parse ``Args:`` entries (``name: text`` with indented continuations)."""
    doc = cls.__doc__ or ""
    m = re.search(r"^\s*Args:\s*$", doc, flags=re.M)
    if not m:
        return {}
    out: dict[str, str] = {}
    current = None
    base_indent = None
    for line in doc[m.end():].splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if base_indent is None:
            base_indent = indent
        if indent < base_indent:
            break
        entry = re.match(r"\s*([A-Za-z_][\w ,/]*?):\s*(.*)$", line)
        if indent == base_indent and entry:
            names = [n.strip() for n in re.split(r"[,/]", entry.group(1)) if n.strip()]
            current = names
            for n in names:
                out[n] = entry.group(2).strip()
        elif current:
            for n in current:
                out[n] = (out[n] + " " + line.strip()).strip()
    return out


def _type_str(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return " | ".join(_type_str(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"list[{_type_str(args[0])}]" if args else "list"
    if origin is dict:
        return f"table[{_type_str(args[1])}]" if args else "table"
    if tp is type(None):
        return "none"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(f'"{m.value}"' for m in tp)
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


def _field_default(field: dataclasses.Field) -> Any:
    """The value a field takes when the key is absent (``dataclasses.MISSING``: required)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _default_str(v: Any) -> str:
    """A default value as the table's ``default`` cell."""
    if v is dataclasses.MISSING:
        return "(required)"
    if dataclasses.is_dataclass(v):
        return "(table below)"
    if isinstance(v, enum.Enum):
        return f'"{v.value}"'
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(str(x.value if isinstance(x, enum.Enum) else x) for x in v) + "]"
    return str(v)


def _module_docs(cls: type) -> dict[str, str]:
    """Args docs of every dataclass in ``cls``'s module: a fallback for fields
    documented once on a sibling (e.g. TableDefaults repeats TableConfig's)."""
    import sys as _sys

    pool: dict[str, str] = {}
    for obj in vars(_sys.modules[cls.__module__]).values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == cls.__module__:
            for k, v in _args_docs(obj).items():
                pool.setdefault(k, v)
    return pool


def _render_class(cls: type, key: str, lines: list[str], seen: set[tuple[type, str]],
                  default: Any = None) -> None:
    """Append the table of ``[key]`` (dataclass ``cls``), then its nested tables.

    Args:
        cls: the section's dataclass.
        key: its dotted TOML key.
        lines: the document so far.
        seen: (class, key) pairs already rendered.
        default: the instance the parent field defaults to (e.g. ``[ps] dense_optimizer``'s
            ``OptimizerConfig(kind=ADAM, lr=1e-3)``): its values are this table's defaults,
            not the class's own field defaults (None: a top-level section, the class's).
    """
    if (cls, key) in seen:
        return
    seen.add((cls, key))
    hints = typing.get_type_hints(cls)
    docs = {**_module_docs(cls), **_args_docs(cls)}
    lines.append(f"### `[{key}]` ({cls.__module__}.{cls.__name__})")
    lines.append("")
    summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
    if summary:
        lines.append(summary)
        lines.append("")
    lines.append("| key | type | default | meaning |")
    lines.append("|---|---|---|---|")
    nested: list[tuple[type, str, Any]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        value = getattr(default, f.name) if default is not None else _field_default(f)
        type_cell = _type_str(tp).replace("|", "\\|")
        default_cell = _default_str(value).replace("|", "\\|")
        name = toml_key(f)  # the TOML key ([model] class is ModelConfig.class_path)
        lines.append(f"| `{name}` | {type_cell} | {default_cell} | {docs.get(f.name, '')} |")
        inner = [a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        for a in inner:
            suffix = "[]" if typing.get_origin(tp) in (list, tuple) else ""
            # a table field's default instance gives the nested table's defaults; list items: the class's
            sub = value if not suffix and isinstance(value, a) else None
            nested.append((a, f"{key}.{name}{suffix}", sub))
    lines.append("")
    for a, k, sub in nested:
        _render_class(a, k, lines, seen, sub)


def render() -> str:
    from metaps.job import _section_types

    lines = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `python -m metaps.config_doc`;",
        "a test fails when this file is out of date. A job file is TOML with one",
        "table per section; every key is optional unless marked required. Unknown",
        "keys and wrong types are errors naming the file and the key.",
        "",
    ]
    seen: set[tuple[type, str]] = set()
    for name, cls in _section_types().items():
        _render_class(cls, name, lines, seen)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(render())
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
