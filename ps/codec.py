"""Message codecs of the PS service beyond the data plane: row chunks, named arrays, dense tensors.

Migration (Export/ImportVshards) moves a table's rows as ``RowsChunk`` messages::

    RowsChunk.arrays: "ids" [k], "weights" [k, dim], "freq" [k], "last_step" [k],
                      "state.<name>" [k, ...] (optimizer state, e.g. state.momentum)

Every array is checked before it is decoded (numeric dtype, sane shape, exact byte
count); a bad one raises :class:`ps.gate.RpcAbort` (INVALID_ARGUMENT) or
:class:`ps.wire.WireError` naming the table and the array. Ids, rows and gradients
of pull/push are in ``ps/wire.py``.

Example::

    for chunk in rows_to_chunks("user", rows, max_bytes=4 << 20):
        stub.ImportVshards(chunk)
    rows = rows_from_chunk(chunk)            # on the receiving shard
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from protos import ps_pb2
from ps import wire
from ps.gate import bad

if TYPE_CHECKING:
    from ps.rows import TableRows


_ROW_FIELDS = ("ids", "weights", "freq", "last_step")


def rows_to_chunks(table: str, rows: TableRows, max_bytes: int) -> Iterator[ps_pb2.RowsChunk]:
    """Split one table's exported ``TableRows`` into messages of about ``max_bytes`` at most.

    Args:
        table: the table's name (carried in every chunk).
        rows: its exported rows.
        max_bytes: the most array bytes per chunk (one row at least).
    """
    arrays = {k: np.asarray(getattr(rows, k)) for k in _ROW_FIELDS}
    arrays.update({f"state.{k}": np.asarray(v) for k, v in rows.state.items()})
    n = int(arrays["ids"].shape[0])
    per_row = max(1, sum(a.nbytes for a in arrays.values()) // max(n, 1))
    step = max(1, max_bytes // per_row)
    for start in range(0, max(n, 1), step):
        stop = min(n, start + step)
        yield ps_pb2.RowsChunk(
            table=table, rows=stop - start, arrays=[wire.array_to_proto(k, a[start:stop]) for k, a in arrays.items()]
        )


def rows_from_chunk(chunk: ps_pb2.RowsChunk) -> TableRows:
    """A RowsChunk back to ``ps.embedding_table.TableRows`` (sizes checked by the store).

    Args:
        chunk: one message of :func:`rows_to_chunks`.
    """
    from ps.rows import TableRows as Rows

    fields: dict[str, np.ndarray] = {}
    for a in chunk.arrays:
        if a.name in fields:
            raise wire.WireError(f"table '{chunk.table}': rows chunk has array '{a.name}' twice")
        fields[a.name] = named_array(a, f"table '{chunk.table}': array")
    missing = [k for k in _ROW_FIELDS if k not in fields]
    if missing:
        raise wire.WireError(f"table '{chunk.table}': rows chunk lacks arrays {missing}")
    if fields["ids"].shape[0] != chunk.rows:
        raise wire.WireError(f"table '{chunk.table}': rows chunk says {chunk.rows} rows, ids have {fields['ids'].shape[0]}")
    state = {k[len("state."):]: v for k, v in fields.items() if k.startswith("state.")}
    return Rows(
        ids=fields["ids"].astype(np.int64, copy=False), weights=fields["weights"], state=state,
        freq=fields["freq"], last_step=fields["last_step"],
    )


_ARRAY_KINDS = "biuf"  # bool, signed/unsigned int, float: what TableRows hold


def check_shape(what: str, shape: Iterable[int], nbytes: int, itemsize: int, dtype: str) -> tuple[int, ...]:
    """The shape as a tuple once it is sane: no negative dims, exact byte count (Python ints: no overflow).

    Args:
        what: names the array in the error.
        shape, nbytes, itemsize, dtype: the header and the payload size to check.
    """
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise bad(f"{what}: shape {list(dims)} has a negative dimension")
    count = math.prod(dims)
    if count * itemsize != nbytes:
        raise bad(f"{what}: {nbytes} bytes, expected {count * itemsize} for shape {list(dims)} ({dtype})")
    return dims


def named_array(msg: ps_pb2.NamedArray, what: str) -> np.ndarray:
    """A NamedArray checked before decoding: numeric dtype, sane shape, exact size.

    Args:
        msg: the message.
        what: names the array's owner in the error (e.g. ``table 'user': array``).
    """
    where = f"{what} '{msg.name}'"
    if not msg.name:
        raise bad(f"{what} with an empty name")
    try:
        dt = np.dtype(msg.dtype)
    except (TypeError, ValueError):
        raise bad(f"{where}: unknown dtype {msg.dtype!r}") from None
    if dt.kind not in _ARRAY_KINDS or dt.itemsize == 0:
        raise bad(f"{where}: dtype {msg.dtype!r} is not a numeric dtype (bool/int/uint/float)")
    check_shape(where, msg.shape, len(msg.data), dt.itemsize, msg.dtype)
    return wire.array_from_proto(msg)


def dense_tensors(tensors: Iterable[ps_pb2.DenseTensor], what: str) -> dict[str, np.ndarray]:
    """DenseTensor messages -> name -> float32 array; names non-empty and unique, shapes sane.

    Args:
        tensors: the request's dense tensors.
        what: "param" or "gradient" (for the error).
    """
    out: dict[str, np.ndarray] = {}
    for t in tensors:
        if not t.name:
            raise bad(f"a dense {what} has an empty name")
        if t.name in out:
            raise bad(f"dense '{t.name}': {what} given twice in one request")
        dtype = wire.DType.from_proto(t.dtype, table=t.name, field="dense dtype")
        check_shape(f"dense '{t.name}'", t.shape, len(t.data), dtype.numpy.itemsize, dtype.value)
        out[t.name] = wire.dense_from_proto(t)
    return out


def checked_lease(method: str, value: float, cap: float) -> float:
    """A client-supplied lease: NaN/inf/negative refused, 0 = the default (60 s), clamped to ``cap``.

    Args:
        method: the RPC (for the error).
        value: the lease asked for, seconds.
        cap: the shard's largest lease.
    """
    if not math.isfinite(value) or value < 0:
        raise bad(f"{method}: lease_s must be a finite number >= 0, got {value}")
    return min(value or 60.0, cap)
