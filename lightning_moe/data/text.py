"""Streaming readers of local text corpora: text files, jsonl (one field) and parquet (one column).

Every reader is a generator: it holds one line (text, jsonl) or one record batch (parquet) at a
time, so a corpus larger than memory streams through. Each item is a :class:`Record`: the value
read (a ``str`` for text; whatever JSON or parquet holds for a jsonl field or parquet column, e.g.
a chat's list of messages) and ``where``, ``"<file>:<line>"`` (jsonl, text lines) or
``"<file>:row <n>"`` (parquet), which every later error about that record names.

Formats (``format=``):

* ``"text"``: ``.txt``-like files. ``text_unit`` says what one document is: the whole ``"file"``,
  each non-empty ``"line"``, or each ``"paragraph"`` (runs of non-blank lines, separated by blank
  lines; newlines inside kept).
* ``"jsonl"``: one JSON object per line; the document is ``object[field]``. Blank lines are
  skipped. Invalid JSON, a line that is not an object, or an object without ``field`` raise
  ``ValueError`` naming the file and the line number.
* ``"parquet"``: the document is each row's ``field`` column, read in record batches with
  ``pyarrow`` (an optional dependency: without it, ``ImportError`` saying how to install it).
* ``"datasets"``: a folder ``datasets.Dataset.save_to_disk`` wrote (``state.json``,
  ``dataset_info.json`` and Arrow files), opened with ``datasets.load_from_disk`` (memory-mapped)
  and read in batches; the document is each row's ``field`` column. ``datasets`` is an optional
  dependency: without it, ``ImportError`` saying how to install it. A saved ``DatasetDict`` is
  refused with its split names: pass ``<folder>/<split>``.
* ``"auto"``: by suffix (``.txt``/``.md``/``.text`` -> text, ``.jsonl``/``.json`` -> jsonl,
  ``.parquet`` -> parquet; a file named with another suffix is refused, so set the format); a
  folder that ``save_to_disk`` wrote is a ``datasets`` source, any other folder is searched for files.

``paths`` is a file, a folder (its files with the format's suffixes, sorted by relative path), a
saved dataset's folder or a list of them, read in the given order. Files must be UTF-8; any other is refused naming it.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

__all__ = ["FORMATS", "TEXT_UNITS", "Record", "TextFormat", "TextUnit", "expand_paths", "is_saved_dataset",
           "read_records"]

TextFormat = Literal["auto", "text", "jsonl", "parquet", "datasets"]
TextUnit = Literal["file", "line", "paragraph"]
FORMATS = ("auto", "text", "jsonl", "parquet", "datasets")
TEXT_UNITS = ("file", "line", "paragraph")
_SUFFIXES = {"text": (".txt", ".md", ".text"), "jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
_PARQUET_BATCH_ROWS = 1024
_DATASET_FILES = ("state.json", "dataset_info.json")  # a folder Dataset.save_to_disk wrote
_DATASET_DICT_FILE = "dataset_dict.json"  # a folder DatasetDict.save_to_disk wrote


class Record(NamedTuple):
    """One document as read: its ``value`` and ``where`` it came from (``file:line`` or ``file:row n``)."""

    value: Any
    where: str


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder that ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    if not path.is_dir():
        return False
    return all((path / n).is_file() for n in _DATASET_FILES) or (path / _DATASET_DICT_FILE).is_file()


def _format_of(path: Path, format: str) -> str:
    if format != "auto":
        return format
    if path.is_dir():
        return "datasets"
    for name, suffixes in _SUFFIXES.items():
        if path.suffix.lower() in suffixes:
            return name
    return "text"


def expand_paths(
    paths: str | Path | Sequence[str | Path], format: str = "auto", owner: str = "read_records"
) -> list[Path]:
    """The files ``paths`` names, in order: a folder becomes its files with the format's suffixes
    (all three formats' for ``"auto"``), sorted by relative path. Raises ``ValueError`` for a
    missing path, an empty folder or an empty list."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not items:
        raise ValueError(f"{owner}: no files given; pass a file, a folder or a list of them.")
    suffixes = tuple(s for name, group in _SUFFIXES.items() if format in ("auto", name) for s in group)
    files: list[Path] = []
    for item in items:
        if not isinstance(item, (str, Path)):
            raise TypeError(f"{owner}: path {item!r} is a {type(item).__name__}; pass str paths.")
        p = Path(item)
        if format == "datasets" and not is_saved_dataset(p):
            raise ValueError(f"{owner}: path {str(p)!r} is not a folder that datasets' save_to_disk wrote "
                             f"(none of {list(_DATASET_FILES)} / {_DATASET_DICT_FILE!r} in it); pass such a folder.")
        if p.is_file() and format == "auto" and not any(p.suffix.lower() in group for group in _SUFFIXES.values()):
            known = "/".join(s for group in _SUFFIXES.values() for s in group)
            raise ValueError(f"{owner}: file {str(p)!r} has an unknown extension {p.suffix or '(none)'!r} (known: "
                             f"{known}); rename it, or set format='text', 'jsonl' or 'parquet'.")  # fmt: skip
        if p.is_file() or is_saved_dataset(p):
            files.append(p)
        elif p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes),
                           key=lambda f: f.relative_to(p).as_posix())  # fmt: skip
            if not found:
                raise ValueError(f"{owner}: folder {str(p)!r} holds no {'/'.join(suffixes)} files; add some.")
            files.extend(found)
        else:
            raise ValueError(f"{owner}: path {str(p)!r} does not exist; pass an existing file or folder.")
    return files


def _text_records(path: Path, unit: str) -> Iterator[Record]:
    if unit == "file":
        text = path.read_text(encoding="utf-8")
        if text.strip():
            yield Record(text, f"{path}:1")
        return
    with path.open(encoding="utf-8") as f:
        if unit == "line":
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield Record(line.rstrip("\n"), f"{path}:{n}")
            return
        lines: list[str] = []
        first = 0
        for n, line in enumerate(f, 1):
            if line.strip():
                first = first or n
                lines.append(line)
            elif lines:
                yield Record("".join(lines).rstrip("\n"), f"{path}:{first}")
                lines, first = [], 0
        if lines:
            yield Record("".join(lines).rstrip("\n"), f"{path}:{first}")


def _jsonl_records(path: Path, field: str) -> Iterator[Record]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"read_records: {where} is not valid JSON ({exc.msg} at column {exc.colno}); "
                                 "write one JSON object per line.") from None  # fmt: skip
            if not isinstance(obj, dict):
                raise ValueError(f"read_records: {where} holds a JSON {type(obj).__name__}, not an object; "
                                 f"write one object with a {field!r} key per line.")  # fmt: skip
            if field not in obj:
                raise ValueError(f"read_records: {where} has no field {field!r} (keys: {sorted(obj)}); "
                                 "set the field name to the key that holds the document.")  # fmt: skip
            yield Record(obj[field], where)


def _optional_module(module: str, path: Path, source: str, needs: str, package: str, fallback: str) -> Any:
    """``module``, imported for ``path``; a clear ImportError naming the package to install when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"read_records: {path} is {source}, which needs {needs} (not installed); `pip install {package}`, "
            f"or {fallback}."
        ) from None


def _check_column(path: Path, field: str, columns: list[str]) -> None:
    if field not in columns:
        raise ValueError(f"read_records: {path} has no column {field!r} (columns: {columns}); "
                         "set the field name to the column that holds the documents.")  # fmt: skip


def _numbered_rows(path: Path, values: Iterable[Any]) -> Iterator[Record]:
    for row, value in enumerate(values):
        yield Record(value, f"{path}:row {row}")


def _parquet_records(path: Path, field: str) -> Iterator[Record]:
    pq = _optional_module("pyarrow.parquet", path, "parquet", "pyarrow", "pyarrow", "convert the data to jsonl")
    file = pq.ParquetFile(path)
    _check_column(path, field, file.schema_arrow.names)
    batches = file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[field])
    yield from _numbered_rows(path, (value for batch in batches for value in batch.column(0).to_pylist()))


def _datasets_records(path: Path, field: str) -> Iterator[Record]:
    datasets = _optional_module(
        "datasets", path, "a saved datasets folder", "the datasets package", "datasets",
        "export the data to jsonl or parquet",
    )
    data = datasets.load_from_disk(str(path))
    if not hasattr(data, "column_names") or isinstance(data.column_names, dict):
        splits = sorted(data.keys()) if hasattr(data, "keys") else []
        raise ValueError(f"read_records: {path} holds a DatasetDict (splits {splits}); pass one split's folder, "
                         f"e.g. {path / (splits[0] if splits else 'train')}.")  # fmt: skip
    _check_column(path, field, data.column_names)
    batches = data.select_columns([field]).iter(batch_size=_PARQUET_BATCH_ROWS)
    yield from _numbered_rows(path, (value for batch in batches for value in batch[field]))


def read_records(
    paths: str | Path | Sequence[str | Path],
    format: TextFormat = "auto",
    field: str = "text",
    text_unit: TextUnit = "file",
) -> Iterator[Record]:
    """Stream the documents of ``paths`` as :class:`Record` s (module doc: formats and errors).

    The arguments are checked, and the files listed, when this is called; the files are read as
    the iterator advances.
    """
    owner = "read_records"
    if format not in FORMATS:
        raise ValueError(f"{owner}: format={format!r} is unknown; choose one of {list(FORMATS)}.")
    if text_unit not in TEXT_UNITS:
        raise ValueError(f"{owner}: text_unit={text_unit!r} is unknown; choose one of {list(TEXT_UNITS)}.")
    if not isinstance(field, str) or not field:
        raise ValueError(f"{owner}: field={field!r} must be a non-empty str (the jsonl key or parquet column).")
    files = expand_paths(paths, format, owner)
    return _records(files, format, field, text_unit)


def _records(files: list[Path], format: str, field: str, text_unit: str) -> Iterator[Record]:
    for path in files:
        kind = _format_of(path, format)
        try:
            if kind == "jsonl":
                yield from _jsonl_records(path, field)
            elif kind == "parquet":
                yield from _parquet_records(path, field)
            elif kind == "datasets":
                yield from _datasets_records(path, field)
            else:
                yield from _text_records(path, text_unit)
        except UnicodeDecodeError as exc:
            raise ValueError(f"read_records: {path} is not UTF-8 text ({exc.reason}); re-encode it as UTF-8, or "
                             "leave it out.") from None  # fmt: skip
