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
    key         int*, uint*, string, binary, dictionary         int64            (null: error)
    extra       any non-nested type                             string

Ids and keys: integers stay as they are (negative is an error: -1 is padding); strings
are hashed with :func:`common.hashing.hash_strings` (FNV-1a, non-negative
int64). ``hash = true`` on a column hashes integers too (their decimal text),
so the same ids typed as int in Parquet and as text in CSV agree.

CSV: every declared column is read as text and parsed here (so a bad value
is reported with its row). For an id or key column without ``hash = true`` the
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

Modules, along the stages of a read::

    files        discovery, opening, the column check before any read (check_source, count_rows)
    normalized   SourceBatch and the normalized Arrow type of each column kind
    columns      the per-kind normalizers (ids, lists, vectors, scalars, times, extras)
    stream       iter_source: check every file, then stream raw batches through the normalizers
"""

from meta_io.source.columns import TOKEN_SEP
from meta_io.source.files import CSV_SUFFIXES, PARQUET_SUFFIXES, check_file, check_source, count_rows, list_source_files
from meta_io.source.normalized import SourceBatch, normalized_arrow_schema, normalized_type
from meta_io.source.stream import iter_source

__all__ = [
    "CSV_SUFFIXES", "PARQUET_SUFFIXES", "TOKEN_SEP", "SourceBatch", "check_file", "check_source",
    "count_rows", "iter_source", "list_source_files", "normalized_arrow_schema", "normalized_type",
]
