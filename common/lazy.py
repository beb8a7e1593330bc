"""A module imported on first use, for torch-free paths through torch-using modules.

Importing torch costs ~2.7 s of CPU and ~300 MB here. Some modules use torch
only in a few functions while processes that never call them import the
module for its other parts: the controller and the launcher open a Meta-IO
dataset (``meta_io.reader``) for its batch counts and checks, never for a
tensor. In such a module::

    from typing import TYPE_CHECKING
    from common.lazy import LazyModule

    if TYPE_CHECKING:
        import torch
    else:
        torch = LazyModule("torch", globals())

The first attribute read (``torch.from_numpy``) imports torch and rebinds the
module's global ``torch`` to the real module, so later reads cost nothing
extra (no proxy on the hot path after the first call).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for module ``name`` in ``namespace`` (a module's ``globals()``) until first used.

    Args:
        name: the module to import (e.g. ``"torch"``).
        namespace: the importing module's globals; its binding named like the module
            (the last dotted part) is replaced by the real module on first use.
    """

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name = name
        self._namespace = namespace

    def _load(self) -> ModuleType:
        module = importlib.import_module(self._name)
        key = self._name.rpartition(".")[2]
        if self._namespace.get(key) is self:
            self._namespace[key] = module
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r} (not imported yet)>"
