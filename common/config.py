"""TOML config files parsed into frozen, validated dataclasses.

Every config section is a ``@dataclass(frozen=True)``. :func:`from_mapping`
builds one from a plain mapping (a parsed TOML table), checking every key and
type on the way: an unknown key, a missing required key or a value of the wrong
type is a :class:`~common.errors.ConfigError` naming the file and the dotted key.
A section may define ``validate(self)``; a ``ValueError`` it raises is reported
the same way.

Example::

    @dataclass(frozen=True)
    class PsConfig:
        shards: int = 2
        def validate(self) -> None:
            if self.shards < 1:
                raise ValueError(f"must be >= 1, got {self.shards}")

    cfg = load_toml(PsConfig, "job.toml", section="ps")
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

from common.errors import ConfigError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, key: str, where: str) -> Any:
    """Convert ``value`` to type ``tp`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(
            f"{where}: key '{key}': expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: key '{key}': expected one of {list(args)}, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{where}: key '{key}': expected a table for {tp.__name__}, got {type(value).__name__}"
            )
        return from_mapping(tp, value, where=where, prefix=key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = [m.value for m in tp]
            raise ConfigError(
                f"{where}: key '{key}': expected one of {allowed}, got {value!r}"
            ) from None
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: key '{key}': expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise ConfigError(
                    f"{where}: key '{key}': expected {len(args)} items, got {len(value)}"
                )
            return tuple(_convert(a, v, f"{key}[{i}]", where) for i, (a, v) in enumerate(zip(args, value)))
        item_tp = args[0] if args else Any
        items = [_convert(item_tp, v, f"{key}[{i}]", where) for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: key '{key}': expected a table, got {type(value).__name__}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _convert(vt, v, f"{key}.{k}", where) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: key '{key}': expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: key '{key}': expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: key '{key}': expected bool, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: key '{key}': expected str, got {type(value).__name__} {value!r}")
        return value
    if tp is Path:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: key '{key}': expected a path string, got {type(value).__name__}")
        return Path(value)
    raise ConfigError(f"{where}: key '{key}': unsupported config type {_type_name(tp)}")


def toml_key(field: dataclasses.Field[Any]) -> str:
    """The key a field has in a TOML file: its name, or ``metadata["toml"]`` when the TOML key is
    not a Python name (``[model] class`` is ``ModelConfig.class_path``).

    Args:
        field: a config dataclass field.
    """
    return str(field.metadata.get("toml", field.name))


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, once per class (read only; evaluating the string
    annotations costs ~0.5 ms for a bundle manifest, paid on every parse before)."""
    return typing.get_type_hints(cls)


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "<config>", prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, validating keys, types and values.

    Args:
        cls: a dataclass type (usually frozen).
        data: the parsed mapping (e.g. one TOML table).
        where: what to name in errors (usually the file path).
        prefix: dotted key of this table inside the file, for error messages.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = _type_hints(cls)
    fields = {toml_key(f): f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        dotted = ", ".join(f"'{prefix + '.' if prefix else ''}{k}'" for k in unknown)
        raise ConfigError(
            f"{where}: unknown key {dotted} in [{prefix or cls.__name__}]; known keys: {sorted(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if name in data:
            kwargs[field.name] = _convert(hints[field.name], data[name], dotted, where)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key '{dotted}'")
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: [{prefix or cls.__name__}]: {exc}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as exc:
            raise ConfigError(f"{where}: [{prefix or cls.__name__}]: {exc}") from None
    return obj


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file, turning syntax errors into ConfigError naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load_toml(cls: type[T], path: str | Path, section: str | None = None) -> T:
    """Load ``cls`` from a TOML file, optionally from one top-level table."""
    data = read_toml(path)
    if section is not None:
        sub = data.get(section, {})
        if not isinstance(sub, Mapping):
            raise ConfigError(f"{path}: key '{section}' must be a table")
        return from_mapping(cls, sub, where=str(path), prefix=section)
    return from_mapping(cls, data, where=str(path))


def to_dict(obj: Any) -> Any:
    """A config dataclass as plain data (enums as their values, paths as str)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {toml_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
