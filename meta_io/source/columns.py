"""Read any Parquet/CSV input with a schema into normalized Arrow batches.

Every consumer of raw logs (the Meta-IO builder, tools, tests) reads through
:func:`iter_source`, so "any Parquet or CSV data plus a schema file works
everywhere the generator's output works". Input is streamed: one batch of at
most ``batch_rows`` rows is in memory at a time.

Normalized columns (one per schema column, schema order, exact types)::

    kind        input accepted                                 normalized
    ---------   --------------------------------------------   ----------------------------------
    sparse      int*, uint*, string, binary, dictionary         int64            (null -> -1: missing)
    multi_hot   list<int|string>, "a b,c" string                fixed_size_list<int64>[max_len]
    text        (same as multi_hot)                             (first max_len kept, -1 padded)
    vector      list<float|int>, "0.1 0.2" string               fixed_size_list<float32>[dim]
    dense       int, float, bool, decimal                       float32          (null/NaN/inf: error)
    label       int, float, bool: 0 or 1                        float32          (else: error)
    oracle      int, float in [0, 1]                            float32
    timestamp   int seconds, timestamp[unit], date, ISO string  int64 seconds
    extra       any non-nested type                             string

Ids: integers stay as they are (negative is an error: -1 is padding); strings
are hashed with :func:`metaps.hashing.hash_strings` (FNV-1a, non-negative
int64). ``hash = true`` on a column hashes integers too (their decimal text),
so the same ids typed as int in Parquet and as text in CSV agree.

CSV: every declared column is read as text and parsed here (so a bad value
is reported with its row). For an id column without ``hash = true`` the
first batch of each file decides: if every value is a decimal integer the
column is integer (a later non-integer is an error that suggests
``hash = true``), otherwise every value of that file is hashed. List and
vector cells are tokens separated by spaces, commas, ``;`` or ``|``. Empty
cells are nulls. Naive ISO times are UTC.

Rows in error messages are 0-based data rows within the file (a CSV header
line is not counted).

Example::

    >>> schema = load_schema("configs/schema_example.toml")
    >>> for b in iter_source("logs/", schema, batch_rows=10_000):
    ...     print(b.file.name, b.first_row, b.table.num_rows)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from meta_io.schema import LIST_KINDS, PAD_ID, ColumnKind, ColumnSpec, Schema
from metaps.errors import DataError, SchemaError
from metaps.hashing import hash_strings
from metaps.log import kv

log = logging.getLogger(__name__)

PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".tsv")
TOKEN_SEP = r"[\s,;|]+"

_INT_RE = r"^[0-9]+$"
_FLOAT_RE = r"^[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[nN]a[nN]|[iI]nf(inity)?)$"
_ISO_RE = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}([T ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)?)?(Z|[+-][0-9]{2}:?[0-9]{2})?$"
_TS_DIVISOR = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


@dataclass
class SourceBatch:
    """Up to ``batch_rows`` normalized rows of one input file.

    Args:
        file: the input file the rows come from.
        first_row: 0-based index of the first row within that file.
        table: the rows, typed as :func:`normalized_arrow_schema`.
    """

    file: Path
    first_row: int
    table: pa.Table

    @property
    def num_rows(self) -> int:
        return self.table.num_rows


# -- normalized types -----------------------------------------------------------


def normalized_type(col: ColumnSpec) -> pa.DataType:
    """The Arrow type a column has after :func:`iter_source`."""
    if col.kind == ColumnKind.SPARSE or col.kind == ColumnKind.TIMESTAMP:
        return pa.int64()
    if col.kind in LIST_KINDS:
        return pa.list_(pa.int64(), col.max_len)
    if col.kind == ColumnKind.VECTOR:
        return pa.list_(pa.float32(), col.dim)
    if col.kind in (ColumnKind.DENSE, ColumnKind.LABEL, ColumnKind.ORACLE):
        return pa.float32()
    return pa.string()  # extra


def normalized_arrow_schema(schema: Schema) -> pa.Schema:
    """Arrow schema of every :class:`SourceBatch` table for ``schema``.

    Example::

        >>> normalized_arrow_schema(schema).field("tags").type
        FixedSizeListType(fixed_size_list<item: int64>[4])
    """
    return pa.schema([pa.field(c.name, normalized_type(c)) for c in schema.columns])


# -- files ------------------------------------------------------------------------


def list_source_files(path: str | Path) -> list[Path]:
    """The input files of ``path``: the file itself, or a folder's Parquet/CSV files by name.

    Raises:
        DataError: the path does not exist, has an unknown suffix, or the
            folder holds no Parquet/CSV file.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: input not found")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in PARQUET_SUFFIXES + CSV_SUFFIXES)
        if not files:
            raise DataError(
                f"{p}: no input files (expected *{', *'.join(PARQUET_SUFFIXES + CSV_SUFFIXES)}); "
                f"found {sorted(f.name for f in p.iterdir())[:10]}"
            )
        return files
    if p.suffix.lower() not in PARQUET_SUFFIXES + CSV_SUFFIXES:
        raise DataError(f"{p}: unknown input format '{p.suffix}' (expected Parquet or CSV)")
    return [p]


def _is_csv(path: Path) -> bool:
    return path.suffix.lower() in CSV_SUFFIXES


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file (corrupt or truncated?): {exc}") from None


def _csv_options(
    path: Path, names: list[str] | None, block_size: int = 1 << 20
) -> tuple[pcsv.ReadOptions, pcsv.ParseOptions, pcsv.ConvertOptions]:
    read = pcsv.ReadOptions(block_size=block_size)
    parse = pcsv.ParseOptions(delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
    convert = pcsv.ConvertOptions(
        column_types={n: pa.string() for n in names} if names else None,
        include_columns=names,
        strings_can_be_null=True,
        quoted_strings_can_be_null=True,
        null_values=[""],
    )
    return read, parse, convert


def _open_csv(path: Path, names: list[str] | None) -> pcsv.CSVStreamingReader:
    read, parse, convert = _csv_options(path, names)
    try:
        return pcsv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid as exc:
        if "Empty CSV file" in str(exc):
            raise DataError(f"{path}: empty CSV file (no header line)") from None
        raise DataError(f"{path}: unreadable CSV: {exc}") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read CSV: {exc}") from None


def _file_columns(path: Path) -> pa.Schema:
    """The columns a file has (Parquet: typed; CSV: names, types as inferred)."""
    if _is_csv(path):
        reader = _open_csv(path, None)
        try:
            return reader.schema
        finally:
            reader.close()
    return _open_parquet(path).schema_arrow


# -- type checks (Parquet; CSV is all text) ------------------------------------------


def _base(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_text(t: pa.DataType) -> bool:
    t = _base(t)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _accepts(col: ColumnSpec, t: pa.DataType) -> bool:
    b = _base(t)
    k = col.kind
    if k == ColumnKind.SPARSE:
        return pa.types.is_integer(b) or _is_text(b)
    if k in LIST_KINDS:
        return _is_text(b) or (_is_list(b) and (pa.types.is_integer(b.value_type) or _is_text(b.value_type)))
    if k == ColumnKind.VECTOR:
        return _is_list(b) and (pa.types.is_floating(b.value_type) or pa.types.is_integer(b.value_type))
    if k == ColumnKind.DENSE:
        return pa.types.is_integer(b) or pa.types.is_floating(b) or pa.types.is_boolean(b) or pa.types.is_decimal(b)
    if k in (ColumnKind.LABEL, ColumnKind.ORACLE):
        return pa.types.is_integer(b) or pa.types.is_floating(b) or pa.types.is_boolean(b)
    if k == ColumnKind.TIMESTAMP:
        return pa.types.is_integer(b) or pa.types.is_timestamp(b) or pa.types.is_date(b)
    return not (pa.types.is_nested(b))  # extra


_EXPECTED = {
    ColumnKind.SPARSE: "an integer or string id",
    ColumnKind.MULTI_HOT: "a list of integer or string ids (or a string of tokens)",
    ColumnKind.TEXT: "a list of integer or string tokens (or a string of tokens)",
    ColumnKind.VECTOR: "a list of floats",
    ColumnKind.DENSE: "a number",
    ColumnKind.LABEL: "0/1 as int, float or bool",
    ColumnKind.ORACLE: "a probability (float)",
    ColumnKind.TIMESTAMP: "int seconds, a timestamp or a date",
    ColumnKind.EXTRA: "any non-nested type",
}


def check_file(path: Path, schema: Schema) -> None:
    """Check that one file has every schema column with an acceptable type.

    Raises:
        DataError: a column is missing (the message lists what the file has), a
            Parquet column has the wrong type (expected vs got), or the file is
            not readable.
    """
    have = _file_columns(path)
    names = set(have.names)
    missing = [c.name for c in schema.columns if c.name not in names]
    if missing:
        raise DataError(
            f"{path}: missing column{'s' if len(missing) > 1 else ''} {missing} declared in the schema; "
            f"the file has {have.names}"
        )
    if _is_csv(path):
        return
    for c in schema.columns:
        t = have.field(c.name).type
        if not _accepts(c, t):
            raise DataError(f"{path}: column '{c.name}' ({c.kind.value}): expected {_EXPECTED[c.kind]}, got {t}")


def check_source(path: str | Path, schema: Schema) -> list[Path]:
    """Check every input file's columns before anything is read; return the files."""
    files = list_source_files(path)
    for f in files:
        check_file(f, schema)
    return files


def count_rows(path: str | Path, schema: Schema) -> int:
    """Rows of the input: Parquet from metadata, CSV by streaming one column."""
    total = 0
    for f in list_source_files(path):
        if _is_csv(f):
            first = schema.columns[0].name
            check_file(f, schema)
            reader = _open_csv(f, [first])
            try:
                for rb in reader:
                    total += rb.num_rows
            except pa.ArrowException as exc:
                raise DataError(f"{f}: unreadable CSV after row {total}: {exc}") from None
        else:
            total += _open_parquet(f).metadata.num_rows
    return total


# -- per-file state ------------------------------------------------------------------


@dataclass
class _FileState:
    path: Path
    csv: bool
    int_mode: dict[str, bool] = field(default_factory=dict)  # CSV id columns: integers or hashed
    truncated: dict[str, int] = field(default_factory=dict)
    null_ids: dict[str, int] = field(default_factory=dict)

    def where(self, col: ColumnSpec, row: int | None = None) -> str:
        at = f"{self.path}: column '{col.name}' ({col.kind.value})"
        return at if row is None else f"{at}: row {row}"


def _first_bad(mask: np.ndarray, first_row: int) -> tuple[int, str]:
    """(file row of the first True, ' (and N more in rows a-b)' suffix for this batch)."""
    idx = np.flatnonzero(mask)
    more = f" (and {idx.size - 1} more in rows {first_row}-{first_row + mask.size - 1})" if idx.size > 1 else ""
    return first_row + int(idx[0]), more


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return arr.is_valid().to_numpy(zero_copy_only=False)


def _decode(arr: pa.Array) -> pa.Array:
    return arr.dictionary_decode() if pa.types.is_dictionary(arr.type) else arr


def _text_matches(arr: pa.Array, pattern: str) -> np.ndarray:
    """True where a (non-null) string matches ``pattern``; nulls count as matching."""
    m = pc.match_substring_regex(arr, pattern)
    return m.fill_null(True).to_numpy(zero_copy_only=False)


def _parse_floats(arr: pa.Array, st: _FileState, col: ColumnSpec, rows_of: np.ndarray | None, first_row: int) -> pa.Array:
    """Strings -> float64, naming the first unparsable value's row."""
    arr = pc.utf8_trim_whitespace(arr)
    ok = _text_matches(arr, _FLOAT_RE)
    if not ok.all():
        bad = ~ok
        i = int(np.flatnonzero(bad)[0])
        row = first_row + (int(rows_of[i]) if rows_of is not None else i)
        raise DataError(f"{st.where(col, row)}: expected a number, got {arr[i].as_py()!r}")
    try:
        return pc.cast(arr, pa.float64())
    except pa.ArrowInvalid as exc:
        raise DataError(f"{st.where(col)}: rows {first_row}..: cannot parse numbers: {exc}") from None


# -- ids ---------------------------------------------------------------------------


def _ids_from_text(
    arr: pa.Array, st: _FileState, col: ColumnSpec, rows_of: np.ndarray | None, first_row: int, parsed: bool
) -> np.ndarray:
    """String ids -> int64: hashed, or integer-parsed.

    ``parsed``: the strings were cut out of text (a CSV cell, a token string),
    so decimal integers may be meant as integers; the first batch of the file
    decides. Typed Parquet strings are always hashed.
    """
    arr = _decode(arr)
    if not parsed or col.hash:
        return hash_strings(arr)
    arr = pc.utf8_trim_whitespace(arr)
    is_int = _text_matches(arr, _INT_RE)
    if col.name not in st.int_mode:
        if len(arr) == arr.null_count:  # nothing to decide on yet (all empty)
            return np.full(len(arr), PAD_ID, dtype=np.int64)
        # The first batch with values decides for the file: all decimal -> integer ids.
        st.int_mode[col.name] = bool(is_int.all())
    if not st.int_mode[col.name]:
        return hash_strings(arr)
    if not is_int.all():
        i = int(np.flatnonzero(~is_int)[0])
        row = first_row + (int(rows_of[i]) if rows_of is not None else i)
        raise DataError(
            f"{st.where(col, row)}: expected an integer id like the earlier rows of this file, got "
            f"{arr[i].as_py()!r}; set hash = true on this column to hash all its values"
        )
    try:
        out = pc.cast(arr, pa.int64())
    except pa.ArrowInvalid as exc:  # e.g. more than 19 digits
        raise DataError(f"{st.where(col)}: rows {first_row}..: integer id out of int64 range: {exc}") from None
    return out.fill_null(PAD_ID).to_numpy(zero_copy_only=False)


def _ids(
    arr: pa.Array, st: _FileState, col: ColumnSpec, rows_of: np.ndarray | None, first_row: int, parsed: bool
) -> np.ndarray:
    """Any accepted id array -> int64 numpy (nulls -> PAD_ID; negatives rejected)."""
    arr = _decode(arr)
    t = arr.type
    if _is_text(t):
        return _ids_from_text(arr, st, col, rows_of, first_row, parsed)
    if not pa.types.is_integer(t):
        raise DataError(f"{st.where(col)}: expected integer or string ids, got {t}")
    if col.hash:
        return hash_strings(pc.cast(arr, pa.string()))
    if pa.types.is_signed_integer(t):
        vals = pc.cast(arr, pa.int64())
        vals = (vals.fill_null(PAD_ID) if vals.null_count else vals).to_numpy(zero_copy_only=False)
        neg = (vals < 0) & _valid(arr)
        if neg.any():
            i = int(np.flatnonzero(neg)[0])
            row = first_row + (int(rows_of[i]) if rows_of is not None else i)
            raise DataError(
                f"{st.where(col, row)}: negative id {int(vals[i])} (ids must be >= 0; {PAD_ID} is padding)"
            )
        return vals
    u = arr.fill_null(0).to_numpy(zero_copy_only=False).astype(np.uint64)
    big = u > np.uint64(np.iinfo(np.int64).max)
    if big.any():
        i = int(np.flatnonzero(big)[0])
        row = first_row + (int(rows_of[i]) if rows_of is not None else i)
        raise DataError(f"{st.where(col, row)}: id {int(u[i])} does not fit in int64; set hash = true to hash it")
    vals = u.astype(np.int64)
    vals[~_valid(arr)] = PAD_ID
    return vals


def _sparse(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int, schema: Schema) -> pa.Array:
    valid = _valid(_decode(arr))
    if not valid.all():
        if col.name == schema.task_key:
            row, more = _first_bad(~valid, first_row)
            raise DataError(f"{st.where(col, row)}: null task key{more} (every row needs a task)")
        st.null_ids[col.name] = st.null_ids.get(col.name, 0) + int((~valid).sum())
    vals = _ids(arr, st, col, None, first_row, parsed=st.csv)  # nulls already PAD_ID on every path
    return pa.array(vals, pa.int64())


# -- lists -------------------------------------------------------------------------------


def _split_tokens(arr: pa.Array) -> pa.Array:
    """'a b,c' -> ['a', 'b', 'c'] (empty tokens dropped later)."""
    return pc.split_pattern_regex(pc.utf8_trim_whitespace(_decode(arr)), TOKEN_SEP)


def _flatten(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(values of the non-null lists in order, length per row with null -> 0)."""
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return arr.flatten(), lengths


def _drop_empty_tokens(values: pa.Array, lengths: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    if not (_is_text(values.type) and len(values)):
        return values, lengths
    keep = pc.not_equal(values, "").fill_null(True).to_numpy(zero_copy_only=False)
    if keep.all():
        return values, lengths
    row_of = np.repeat(np.arange(lengths.size), lengths)
    return values.filter(pa.array(keep)), np.bincount(row_of[keep], minlength=lengths.size)


def _pad(values: np.ndarray, lengths: np.ndarray, width: int, fill, dtype) -> tuple[np.ndarray, int]:
    """Pack ragged rows into [rows, width]: first ``width`` values kept, rest ``fill``.

    Layout (width 3)::

        values  [a b c d | e | f g]     lengths [4, 1, 2]
        out     [[a b c]                truncated rows: 1
                 [e . .]
                 [f g .]]
    """
    n = lengths.size
    out = np.full((n, width), fill, dtype=dtype)
    kept = np.minimum(lengths, width)
    truncated = int((lengths > width).sum())
    if truncated:  # drop each row's values past ``width`` (row-major order is kept)
        starts = np.cumsum(lengths) - lengths
        pos = np.arange(values.size) - np.repeat(starts, lengths)
        values = values[pos < width]
    out[np.arange(width)[None, :] < kept[:, None]] = values  # boolean fill is row-major
    return out, truncated


def _id_list(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    arr = _decode(arr)
    parsed = _is_text(arr.type)
    if parsed:
        arr = _split_tokens(arr)
    values, lengths = _flatten(arr)
    values, lengths = _drop_empty_tokens(_decode(values), lengths)
    row_of = np.repeat(np.arange(lengths.size), lengths)
    if values.null_count:
        row, more = _first_bad(np.bincount(row_of[~_valid(values)], minlength=lengths.size) > 0, first_row)
        raise DataError(f"{st.where(col, row)}: null element inside a list{more}")
    ids = _ids(values, st, col, row_of, first_row, parsed) if len(values) else np.zeros(0, np.int64)
    padded, truncated = _pad(ids, lengths, col.max_len, PAD_ID, np.int64)
    if truncated:
        st.truncated[col.name] = st.truncated.get(col.name, 0) + truncated
    return pa.FixedSizeListArray.from_arrays(pa.array(padded.reshape(-1), pa.int64()), col.max_len)


def _vector(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    arr = _decode(arr)
    valid = _valid(arr)
    if not valid.all():
        row, more = _first_bad(~valid, first_row)
        raise DataError(f"{st.where(col, row)}: null vector{more} (expected {col.dim} floats)")
    if _is_text(arr.type):
        arr = _split_tokens(arr)
    values, lengths = _flatten(arr)
    values, lengths = _drop_empty_tokens(values, lengths)
    wrong = lengths != col.dim
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        _, more = _first_bad(wrong, first_row)
        raise DataError(f"{st.where(col, first_row + i)}: expected {col.dim} values, got {int(lengths[i])}{more}")
    row_of = np.repeat(np.arange(lengths.size), lengths)
    if _is_text(values.type):
        values = _parse_floats(values, st, col, row_of, first_row)
    if values.null_count:
        row, _ = _first_bad(np.bincount(row_of[~_valid(values)], minlength=lengths.size) > 0, first_row)
        raise DataError(f"{st.where(col, row)}: null element inside the vector")
    flat = pc.cast(values, pa.float32()).to_numpy(zero_copy_only=False)
    bad = ~np.isfinite(flat)
    if bad.any():
        row = first_row + int(row_of[np.flatnonzero(bad)[0]])
        raise DataError(f"{st.where(col, row)}: NaN or infinite value in the vector")
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), col.dim)


# -- scalars ---------------------------------------------------------------------------


def _floats(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> np.ndarray:
    """Any numeric (or CSV text) column -> float64 numpy; nulls are errors."""
    arr = _decode(arr)
    valid = _valid(arr)
    if not valid.all():
        row, more = _first_bad(~valid, first_row)
        raise DataError(f"{st.where(col, row)}: missing value (null){more}")
    if _is_text(arr.type):
        arr = _parse_floats(arr, st, col, None, first_row)
    return pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)


# Scalar float kinds: (mask of bad values, what a good value is). One rule per kind.
_SCALAR_RULES: dict[ColumnKind, tuple[Callable[[np.ndarray], np.ndarray], str]] = {
    ColumnKind.DENSE: (lambda x: ~np.isfinite(x), "a finite number"),
    ColumnKind.LABEL: (lambda x: (x != 0) & (x != 1), "a 0/1 label"),  # NaN compares unequal to both
    ColumnKind.ORACLE: (lambda x: ~((x >= 0) & (x <= 1)), "a probability in [0, 1]"),
}


def _scalar(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    """A dense, label or oracle column -> float32, naming the first value its rule rejects."""
    is_bad, expected = _SCALAR_RULES[col.kind]
    x = _floats(arr, st, col, first_row)
    bad = is_bad(x)
    if bad.any():
        row, more = _first_bad(bad, first_row)
        raise DataError(f"{st.where(col, row)}: expected {expected}, got {x[row - first_row]}{more}")
    return pa.array(x.astype(np.float32), pa.float32())


def _timestamp(arr: pa.Array, st: _FileState, col: ColumnSpec, first_row: int) -> pa.Array:
    arr = _decode(arr)
    valid = _valid(arr)
    if not valid.all():
        row, more = _first_bad(~valid, first_row)
        raise DataError(f"{st.where(col, row)}: missing time (null){more}")
    t = arr.type
    if _is_text(t):
        arr = pc.utf8_trim_whitespace(arr)
        is_int = _text_matches(arr, r"^-?[0-9]+$")
        is_iso = _text_matches(arr, _ISO_RE)
        # One form per batch: all int seconds or all ISO times; name the first odd row.
        bad = ~(is_int if is_int[0] else is_iso)
        if bad.any():
            row, more = _first_bad(bad, first_row)
            form = "int seconds like row %d" % first_row if is_int[0] else "an ISO-8601 time like row %d" % first_row
            raise DataError(
                f"{st.where(col, row)}: expected {form}, got {arr[row - first_row].as_py()!r}{more}"
            )
        if is_int[0]:
            return pc.cast(arr, pa.int64())
        naive = pc.replace_substring_regex(arr, r"Z$", "")
        try:
            arr = pc.cast(naive, pa.timestamp("ns"))
        except pa.ArrowInvalid:
            try:
                arr = pc.cast(arr, pa.timestamp("ns", tz="UTC"))
            except pa.ArrowInvalid as exc:
                raise DataError(
                    f"{st.where(col)}: rows {first_row}..: mixed or unsupported time zones: {exc}"
                ) from None
        t = arr.type
    if pa.types.is_integer(t):
        return pc.cast(arr, pa.int64())
    if pa.types.is_timestamp(t):
        vals = pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False) // _TS_DIVISOR[t.unit]  # floor: before-1970 stays right
        return pa.array(vals, pa.int64())
    if pa.types.is_date32(t):
        return pa.array(pc.cast(arr, pa.int32()).to_numpy(zero_copy_only=False).astype(np.int64) * 86_400, pa.int64())
    if pa.types.is_date64(t):
        return pa.array(pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False) // 1000, pa.int64())
    raise DataError(f"{st.where(col)}: expected {_EXPECTED[col.kind]}, got {t}")


def _extra(arr: pa.Array, st: _FileState, col: ColumnSpec) -> pa.Array:
    arr = _decode(arr)
    if pa.types.is_string(arr.type):
        return arr
    try:
        return pc.cast(arr, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"{st.where(col)}: cannot carry {arr.type} as text: {exc}") from None


def _normalize(table: pa.Table, st: _FileState, schema: Schema, out_schema: pa.Schema, first_row: int) -> pa.Table:
    arrays = []
    for col in schema.columns:
        chunked = table.column(col.name)
        arr = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        k = col.kind
        if k == ColumnKind.SPARSE:
            out = _sparse(arr, st, col, first_row, schema)
        elif k in LIST_KINDS:
            out = _id_list(arr, st, col, first_row)
        elif k == ColumnKind.VECTOR:
            out = _vector(arr, st, col, first_row)
        elif k in _SCALAR_RULES:
            out = _scalar(arr, st, col, first_row)
        elif k == ColumnKind.TIMESTAMP:
            out = _timestamp(arr, st, col, first_row)
        else:
            out = _extra(arr, st, col)
        arrays.append(out)
    return pa.Table.from_arrays(arrays, schema=out_schema)


# -- raw batches ------------------------------------------------------------------------


def _raw_parquet(path: Path, names: list[str], batch_rows: int) -> Iterator[tuple[int, pa.Table]]:
    pf = _open_parquet(path)
    row = 0
    it = pf.iter_batches(batch_size=batch_rows, columns=names)
    while True:
        try:
            rb = next(it)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{path}: corrupt Parquet data after row {row}: {exc}") from None
        yield row, pa.Table.from_batches([rb])
        row += rb.num_rows


def _raw_csv(path: Path, names: list[str], batch_rows: int) -> Iterator[tuple[int, pa.Table]]:
    reader = _open_csv(path, names)
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    row = 0
    try:
        while True:
            try:
                rb = next(reader)
            except StopIteration:
                break
            except pa.ArrowException as exc:
                raise DataError(f"{path}: malformed CSV after row {row + pending_rows}: {exc}") from None
            pending.append(rb)
            pending_rows += rb.num_rows
            while pending_rows >= batch_rows:  # re-chunk CSV blocks into batch_rows
                table = pa.Table.from_batches(pending)
                yield row, table.slice(0, batch_rows)
                rest = table.slice(batch_rows)
                row += batch_rows
                pending, pending_rows = rest.to_batches(), rest.num_rows
        if pending_rows:
            yield row, pa.Table.from_batches(pending, schema=pending[0].schema)
    finally:
        reader.close()


def iter_source(
    path: str | Path, schema: Schema, batch_rows: int = 65_536, validate_schema: bool = True
) -> Iterator[SourceBatch]:
    """Stream normalized batches of a Parquet/CSV file or a folder of them.

    Every file's columns are checked before the first batch is yielded, so a
    missing or mistyped column fails before anything is written downstream.

    Args:
        path: a ``.parquet``/``.pq``/``.csv``/``.tsv`` file, or a folder of them
            (read in name order; other files are ignored).
        schema: the columns to read; undeclared columns are ignored.
        batch_rows: at most this many rows per batch (a batch never spans files).
        validate_schema: check ``schema`` as a training schema first (labels
            required); ``metaps predict`` reads a features-only view of a
            validated schema and passes False.

    Yields:
        :class:`SourceBatch` tables typed as :func:`normalized_arrow_schema`.

    Raises:
        DataError: missing input, missing column, wrong type, bad value (the
            message names the file, the column and the row), corrupt file, or
            no rows at all.

    Example::

        >>> batches = list(iter_source(data.out_dir, load_schema(data.schema_path), 1000))
        >>> batches[0].table.schema == normalized_arrow_schema(schema)
        True
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    if validate_schema:
        try:
            schema.validate()
        except ValueError as exc:
            raise SchemaError(f"invalid schema: {exc}") from None
    files = check_source(path, schema)
    out_schema = normalized_arrow_schema(schema)
    names = [c.name for c in schema.columns]
    total = 0
    for f in files:
        st = _FileState(path=f, csv=_is_csv(f))
        raw = _raw_csv(f, names, batch_rows) if st.csv else _raw_parquet(f, names, batch_rows)
        rows = 0
        for first_row, table in raw:
            if table.num_rows == 0:
                continue
            yield SourceBatch(file=f, first_row=first_row, table=_normalize(table, st, schema, out_schema, first_row))
            rows += table.num_rows
        total += rows
        if st.truncated:
            log.warning("lists truncated to max_len", extra=kv(file=str(f), rows_truncated=st.truncated))
        if st.null_ids:
            log.warning("null ids read as missing (-1)", extra=kv(file=str(f), null_rows=st.null_ids))
        if rows == 0:
            log.warning("input file has no rows", extra=kv(file=str(f)))
        log.debug("source file read", extra=kv(file=str(f), rows=rows))
    if total == 0:
        raise DataError(f"{path}: the input has no rows ({len(files)} file{'s' if len(files) != 1 else ''})")
