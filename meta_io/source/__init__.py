"""Read any Parquet/CSV input with a schema into normalized Arrow batches (see :mod:`meta_io.source.columns`)."""

from meta_io.source.columns import (
    CSV_SUFFIXES,
    PARQUET_SUFFIXES,
    TOKEN_SEP,
    SourceBatch,
    check_file,
    check_source,
    count_rows,
    iter_source,
    list_source_files,
    normalized_arrow_schema,
    normalized_type,
)

__all__ = [
    "CSV_SUFFIXES", "PARQUET_SUFFIXES", "TOKEN_SEP", "SourceBatch", "check_file", "check_source",
    "count_rows", "iter_source", "list_source_files", "normalized_arrow_schema", "normalized_type",
]
