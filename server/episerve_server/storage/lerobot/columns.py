"""Bounds on what a parquet file's columns may decode to, checked from its schema and
footer before pyarrow reads a row group, and on each decoded batch of a metadata file
before it becomes Python objects."""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


class FileProblem(Exception):
    """A file that cannot be read as what it should be; the message says why."""


def numeric_field(field: pa.Field) -> None:
    """Numbers, or lists of numbers (any depth), by the schema: checked before a row group
    is read, so a feature stored as bytes is refused without decoding them."""
    kind = field.type
    while pa.types.is_list(kind) or pa.types.is_large_list(kind) \
            or pa.types.is_fixed_size_list(kind):
        kind = kind.value_type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
            or pa.types.is_boolean(kind) or pa.types.is_null(kind)):
        raise FileProblem(f"column {field.name!r} is stored as {field.type}, not numbers")


def text_field(field: pa.Field) -> None:
    kind = field.type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise FileProblem(f"column {field.name!r} is stored as {field.type}, not text")


def row_bound(meta: pq.FileMetaData, wanted: Mapping[str, str], cap: int) -> int:
    """The most bytes one row of ``wanted`` can decode to, from the footer: a text is at
    most its column chunk's uncompressed size (its pages, dictionary included), a number
    8 bytes (lists are refused by the caller's types for texts, counted from the value
    counts for numbers). A chunk over ``cap`` uncompressed is refused here."""
    per_row = 0
    for c, kind in wanted.items():
        widest = 8
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for k in range(rg.num_columns):
                chunk = rg.column(k)
                if chunk.path_in_schema != c and not chunk.path_in_schema.startswith(c + "."):
                    continue
                size = int(chunk.total_uncompressed_size)
                if size > cap:
                    raise FileProblem(f"column {c!r} holds {size} bytes uncompressed in row "
                                      f"group {g}, more than {cap}")
                if kind == "text" or rg.num_rows < int(chunk.num_values):
                    widest = max(widest, size, 8 * int(chunk.num_values))
        per_row += widest
    return per_row


def decoded_bytes(values: pa.Array) -> int:
    """What ``values`` hold once each row is its own value (as Python lists make them): a
    dictionary's texts (the only dictionaries let through) once per row that uses them."""
    if pa.types.is_dictionary(values.type):
        used = pc.sum(pc.take(pc.binary_length(values.dictionary), values.indices)).as_py()
        return 8 * len(values) + int(used or 0)
    return int(values.nbytes)


def check_texts(values: pa.Array, column: str, most: int) -> None:
    if not most or not len(values):
        return
    if pa.types.is_dictionary(values.type):
        values = values.dictionary
    longest = pc.max(pc.binary_length(values)).as_py()
    if longest is not None and longest > most:
        raise FileProblem(f"column {column!r} holds a text of {longest} bytes, more than "
                          f"{most}")
