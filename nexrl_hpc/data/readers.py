"""Dataset rows from jsonl, parquet or HF ``datasets`` sources, one at a time with their row numbers.

A reader yields ``(row_number, row, problem)``: ``row`` is a dict, or None when that row cannot be
read, with ``problem`` saying why (the loader skips and counts it, naming the file and row). A
source that cannot be opened at all raises ``DataSourceError``. Row numbers count from 1 (a jsonl
row number is its line number). ``pyarrow`` and ``datasets`` are imported only when used.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

Row = dict[str, Any]
RowResult = tuple[int, Row | None, str]

FILE_TYPES = ("jsonl", "parquet", "hf")  # data.type values whose rows come from data.data_files

# the ``datasets`` builder for a local data file, by extension (data.hf_builder overrides)
HF_BUILDERS = {
    ".parquet": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
}


class DataSourceError(ValueError):
    """A data file or folder cannot be opened as the configured type."""


def iter_rows(
    data_type: str, path: str, split: str = "train", hf_builder: str | None = None
) -> Iterator[RowResult]:
    """Every row of one source; ``split`` picks a split of an HF ``DatasetDict`` folder."""
    if data_type == "jsonl":
        return _jsonl_rows(path)
    if data_type == "parquet":
        return _parquet_rows(path)
    if data_type == "hf":
        return _hf_rows(path, split, hf_builder, streaming=False)
    raise DataSourceError(f"data type {data_type!r} has no file reader (one of {', '.join(FILE_TYPES)})")


def first_rows(
    data_type: str, path: str, limit: int, split: str = "train", hf_builder: str | None = None
) -> list[RowResult]:
    """The first ``limit`` rows, read cheaply (an HF data file is streamed, not converted to a cache)."""
    if data_type == "hf":
        return list(itertools.islice(_hf_rows(path, split, hf_builder, streaming=True), limit))
    return list(itertools.islice(iter_rows(data_type, path, split, hf_builder), limit))


def _jsonl_rows(path: str) -> Iterator[RowResult]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield line_no, None, "not valid UTF-8"
                continue
            except json.JSONDecodeError as exc:
                yield line_no, None, f"not valid JSON ({exc})"
                continue
            if not isinstance(row, dict):
                yield line_no, None, "not a JSON object"
                continue
            yield line_no, row, ""


def _parquet_rows(path: str) -> Iterator[RowResult]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # ArrowInvalid and friends: not a parquet file
        raise DataSourceError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc
    row_no = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            row_no += 1
            yield row_no, row, ""


def hf_builder_for(path: str, hf_builder: str | None) -> str:
    """The ``datasets`` builder that reads the local file ``path``."""
    if hf_builder:
        return hf_builder
    builder = HF_BUILDERS.get(os.path.splitext(path)[1].lower())
    if builder is None:
        raise DataSourceError(
            f"{path}: cannot tell the datasets builder from the file name (known: {', '.join(sorted(HF_BUILDERS))}); "
            "set data.hf_builder (e.g. parquet, json, csv)"
        )
    return builder


def _open_hf(path: str, split: str, hf_builder: str | None, streaming: bool) -> Any:
    import datasets

    datasets.disable_progress_bars()  # a run's log is not a terminal
    if os.path.isdir(path):  # a datasets.save_to_disk folder
        try:
            dataset = datasets.load_from_disk(path)
        except Exception as exc:
            raise DataSourceError(
                f"{path}: not a datasets.save_to_disk folder ({type(exc).__name__}: {exc})"
            ) from exc
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise DataSourceError(
                    f"{path}: no split {split!r} (it has {', '.join(dataset)}); set data.split or validate.data.split"
                )
            dataset = dataset[split]
        return dataset
    builder = hf_builder_for(path, hf_builder)
    try:  # local data files: a builder's one split is "train"
        return datasets.load_dataset(builder, data_files=[path], split="train", streaming=streaming)
    except Exception as exc:
        raise DataSourceError(
            f"{path}: datasets cannot read it as {builder!r} ({type(exc).__name__}: {exc})"
        ) from exc


def _hf_rows(path: str, split: str, hf_builder: str | None, streaming: bool) -> Iterator[RowResult]:
    dataset = _open_hf(path, split, hf_builder, streaming)
    for row_no, row in enumerate(dataset, start=1):
        yield row_no, dict(row), ""
