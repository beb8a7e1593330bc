"""Large host tensors backed by transparent huge pages (2 MiB) where the kernel allows it.

Random row access into a table of tens of GB misses the TLB on nearly every
row with 4 KiB pages, and the page walk itself misses the caches (the page
tables of a 13 GB table are ~26 MB). With 2 MiB pages the page tables shrink
512x. Linux hands out huge pages at first touch to ranges marked
``madvise(MADV_HUGEPAGE)`` when ``/sys/kernel/mm/transparent_hugepage/enabled``
is ``madvise`` or ``always``, so the memory must be marked *before* it is
touched: :func:`empty` allocates untouched memory, marks its 2 MiB-aligned
span and returns a tensor on it (pages become resident, as huge pages, when
first written); :func:`full` fills such a tensor.

Nothing depends on getting huge pages: where madvise is unavailable or refused
(another OS, THP ``never``) the tensors are ordinary memory, logged once.

Example::

    t = empty((50_000_000, 64), torch.float32)   # like torch.empty, THP-advised
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys

import numpy as np
import torch

from common.log import kv

log = logging.getLogger(__name__)

HUGE = 2 << 20
MIN_BYTES = 64 << 20
"""Tensors smaller than this stay ordinary memory (the gain is for big random-access tables)."""
ENABLED = True
"""Benchmarks flip this to compare with 4 KiB pages (``bench.ps_scale --no-hugepages``)."""
_MADV_HUGEPAGE = 14
_libc = None
_warned = False


def _madvise(addr: int, length: int) -> bool:
    global _libc, _warned
    if not ENABLED or not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ok = _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    if not ok and not _warned:
        _warned = True
        log.info("madvise(MADV_HUGEPAGE) refused; big tables use 4 KiB pages",
                 extra=kv(errno=ctypes.get_errno()))
    return bool(ok)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Like ``torch.empty(shape, dtype=dtype)`` on the CPU, 2 MiB-aligned and THP-advised.

    Args:
        shape: tensor shape.
        dtype: element type.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)  # fresh mmap: no page touched yet
    off = (-raw.data_ptr()) % HUGE
    _madvise(raw.data_ptr() + off, nbytes // HUGE * HUGE)  # the last partial 2 MiB stays 4 KiB pages
    return raw[off : off + nbytes].view(dtype).view(shape)


def full(shape: tuple[int, ...], value: float | int, dtype: torch.dtype) -> torch.Tensor:
    """Like ``torch.full`` on the CPU, THP-advised before the fill touches the pages."""
    return empty(shape, dtype).fill_(value)


def numpy_full(n: int, value: int, dtype: torch.dtype) -> np.ndarray:
    """A 1-D numpy array of ``n`` x ``value`` on THP-advised memory (the array keeps the tensor alive)."""
    return full((n,), value, dtype).numpy()


def huge_bytes() -> int:
    """AnonHugePages of this process (bytes), for benchmarks and tests; 0 when unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
