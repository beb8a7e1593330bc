"""Input files: discovery (a file or a folder's Parquet/CSV by name), opening, and the column check
that runs before anything is read.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from meta_io.schema import LIST_KINDS, ColumnKind, ColumnSpec, Schema
from common.errors import DataError


PARQUET_SUFFIXES = (".parquet", ".pq")


CSV_SUFFIXES = (".csv", ".tsv")


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
    if k in (ColumnKind.SPARSE, ColumnKind.KEY):
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
    ColumnKind.KEY: "an integer or string key",
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
