"""Import a user's model class by its ``[model] class`` path (torch-free).

``"my_towers:TwoTower"`` names module ``my_towers`` and attribute ``TwoTower`` (both may be
dotted). The module is looked up on ``sys.path`` (``PYTHONPATH``, and the current
directory of ``python -m metaps``, as every fleet process is started), then in ``[model]
class_dir`` (the job file's folder by default, absolute once the job is read:
:func:`metaps.job.load_job`). ``class_dir`` is appended to ``sys.path`` once, at the end: a
user's package of several modules imports as in their own ``python`` session, and a folder
of theirs never shadows a package metaps imports later.

A class is imported once per process (cached by ``(path, class_dir)``); a failure is a
one-line :class:`~common.errors.ConfigError` naming ``model.class``, the module or attribute
that is missing, and where it looked. This module imports no torch: ``models.config``
calls it for the dims a class declares, in processes that may not build a model.
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from typing import Any, Mapping

from common.errors import ConfigError


def search_dirs(class_dir: str) -> list[str]:
    """The folders tried after ``sys.path``: ``class_dir`` when it is an existing folder."""
    return [class_dir] if class_dir and Path(class_dir).is_dir() else []


@functools.lru_cache(maxsize=None)
def import_model_class(class_path: str, class_dir: str = "") -> Any:
    """The object ``class_path`` (``"module:Class"``) names.

    Args:
        class_path: ``[model] class``.
        class_dir: ``[model] class_dir`` (absolute; '' or a missing folder: ``sys.path`` only).

    Raises:
        ConfigError: the module cannot be imported, or has no such attribute (one line).
    """
    module_name, _, attr = class_path.partition(":")
    where = f"model.class = {class_path!r}"
    if not module_name or not attr:
        raise ConfigError(f'{where}: expected "module:Class" (e.g. "my_towers:TwoTower")')
    for d in search_dirs(class_dir):
        if d not in sys.path:
            sys.path.append(d)
    looked = "PYTHONPATH/sys.path" + (f" and class_dir {class_dir}" if search_dirs(class_dir) else
                                      f" (class_dir {class_dir} does not exist)" if class_dir else "")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError(f"{where}: module {module_name!r} not found in {looked}; put its folder on "
                              f"PYTHONPATH or set model.class_dir") from None
        raise ConfigError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- the user's module raised while importing: name it, one line
        raise ConfigError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                              f"attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def declared_dims(cls: Any, class_path: str) -> dict[str, int]:
    """The ``embedding_dims`` a model class declares (table -> dim); ``{}`` when it declares none.

    Args:
        cls: the imported class.
        class_path: ``[model] class`` (for the error).

    Raises:
        ConfigError: ``embedding_dims`` is not a mapping of table names to ints.
    """
    dims = getattr(cls, "embedding_dims", None)
    if dims is None:
        return {}
    if not isinstance(dims, Mapping) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                for k, v in dims.items()):
        raise ConfigError(f"model.class = {class_path!r}: embedding_dims must be a class attribute "
                          f"{{table: dim}} of ints, got {dims!r}")
    return dict(dims)
