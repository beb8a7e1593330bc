"""``torch.func.grad`` without importing ``torch._dynamo`` when dynamo is not loaded.

Why: in the pinned torch (2.13), ``torch._functorch.eager_transforms._autograd_grad``
(the backward of every ``torch.func.grad`` / ``grad_and_value``, so of every meta
step in :mod:`models.meta`) runs ``torch.autograd.grad`` inside
``torch._dynamo.compiled_autograd._disable()``. Reading ``torch._dynamo`` imports
all of dynamo and inductor on first use: ~2.2 s of CPU and ~1 s of wall time in
every process that runs a meta step (each worker, ``metaps evaluate``,
``train-local``, a bundle's adaptation), ~75 CPU-s over the test suite.

That context manager only switches compiled autograd off around the call:
``torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)``, then
restores the prior compiler, plus bookkeeping in globals of the dynamo module
itself. Compiled autograd can only be switched on through ``torch._dynamo``, so
while ``torch._dynamo`` is not in ``sys.modules`` no compiler can be set and those
globals do not exist. :func:`install` replaces ``_autograd_grad`` with a copy that
then does the same C-level switch (set to none, call, restore) without the import;
the gradients are the same ``torch.autograd.grad`` call, bit for bit. Once
``torch._dynamo`` is imported (by anyone, at any time) every call goes to the
original function unchanged.

Replacing a torch-internal function is fragile, so it is guarded: only for the
pinned torch version AND only if ``inspect.getsource`` of the function installed
in torch hashes to the pinned sha256. On any mismatch torch is left untouched
(the original keeps paying the import) and a DEBUG line says why. After a torch
upgrade: read the new ``_autograd_grad``, update the copy and both pins, or drop
this module if torch stopped importing dynamo there.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
from typing import Any, Callable, Sequence

import torch
import torch._functorch.eager_transforms as _eager

from common.log import kv

log = logging.getLogger(__name__)

PINNED_TORCH = "2.13.0"
"""The torch release (without a local ``+cpu`` suffix) whose ``_autograd_grad`` is copied below."""

PINNED_SHA256 = "70695a5ace382dd13ab91c5cbd8827ac3c2180d7fa68060f6e116525229d9f3b"
"""sha256 of ``inspect.getsource(torch._functorch.eager_transforms._autograd_grad)`` in that release."""

_original: Callable[..., tuple[torch.Tensor, ...]] | None = None


def source_sha256(fn: Callable[..., Any]) -> str:
    """sha256 (hex) of ``fn``'s source text.

    Args:
        fn: a Python function with source on disk.
    """
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def matches_pin(fn: Callable[..., Any], version: str) -> str | None:
    """Why ``fn`` may not be replaced, or None when it is the pinned torch's ``_autograd_grad``.

    Args:
        fn: the function currently installed in torch.
        version: the torch version string (``torch.__version__``).
    """
    base = version.split("+", 1)[0]
    if base != PINNED_TORCH:
        return f"torch {base} is not the pinned {PINNED_TORCH}"
    try:
        sha = source_sha256(fn)
    except (OSError, TypeError) as e:
        return f"no source for {getattr(fn, '__qualname__', fn)!r}: {e}"
    if sha != PINNED_SHA256:
        return f"source sha256 {sha} is not the pinned {PINNED_SHA256}"
    return None


def _autograd_grad(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor] | None = None,
    retain_graph: bool = False,
    create_graph: bool = True,
) -> tuple[torch.Tensor, ...]:
    """torch 2.13's ``_autograd_grad``, with compiled autograd switched off at the C level only.

    Goes to the original when ``torch._dynamo`` is loaded (its ``_disable`` then has state to keep).
    """
    if "torch._dynamo" in sys.modules:
        assert _original is not None
        return _original(outputs, inputs, grad_outputs, retain_graph, create_graph)
    if grad_outputs is None:
        diff_outputs = tuple(out for out in outputs if out.requires_grad)
    else:
        result = tuple((out, go) for out, go in zip(outputs, grad_outputs) if out.requires_grad)
        if len(result) == 0:
            diff_outputs, grad_outputs = (), ()
        else:
            diff_outputs, grad_outputs = zip(*result)  # type: ignore[assignment]
    if len(diff_outputs) == 0:
        return tuple(torch.zeros_like(inp) for inp in inputs)
    compiled = torch._C._dynamo.compiled_autograd  # the C switch; importing no Python dynamo
    prior_compiler, prior_dynamic = compiled.set_autograd_compiler(None, False)
    try:
        grad_inputs = torch.autograd.grad(
            diff_outputs,
            inputs,
            grad_outputs,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=True,
        )
    finally:
        compiled.set_autograd_compiler(prior_compiler, prior_dynamic)
    return tuple(torch.zeros_like(inp) if gi is None else gi for gi, inp in zip(grad_inputs, inputs))


def install() -> bool:
    """Put :func:`_autograd_grad` in torch if the guard allows; True when it is in place.

    Idempotent. On a version or source mismatch torch is left untouched and a DEBUG line says why.
    """
    global _original
    current = _eager._autograd_grad
    if current is _autograd_grad:
        return True
    why = matches_pin(current, torch.__version__)
    if why is not None:
        log.debug("torch's _autograd_grad left as is", extra=kv(why=why))
        return False
    _original = current
    _eager._autograd_grad = _autograd_grad
    return True
