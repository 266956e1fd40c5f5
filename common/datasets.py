"""Rows of a dataset as it comes: one file, a `datasets.save_to_disk` folder or a hub dataset folder.

`iter_rows(path, split)` yields `(where, row)` for every row, `where` naming the file and line
("data/train.jsonl:12") or row ("data/train-00000-of-00001.parquet: row 3") the row came from, so
whoever rejects a row can say where it is. Every reader of training data (the offline trainers'
loaders, the buffer's prompt loader) goes through it, so they all accept the same things:

  file.jsonl / .ndjson   one JSON object per line (blank lines are no rows)
  file.json              JSON lines too, or one JSON array of objects (as `datasets` reads .json)
  file.parquet           needs pyarrow
  save_to_disk folder    `dataset_dict.json` or `state.json` inside; needs the `datasets` package;
                         `split` picks one split of a DatasetDict. Rows come as stored, not decoded:
                         an image (`datasets.Image`) is {"bytes": ..., "path": ...}, as in Parquet
  hub dataset folder     a folder of .parquet / .jsonl / .json files as a dataset repository holds
                         them; `split` picks files by name, as `datasets.load_dataset(folder)` does:
                         1. `data/{split}-00000-of-00001.parquet` (sharded, any split name);
                         2. else a folder named after the split (`train/`, `test/`, `dev/`, ...);
                         3. else a file named after it (`train.jsonl`, `my_test_set.parquet`);
                         4. else every file is split "train".
                         Steps 2-3 know the split names train, validation and test and their
                         aliases (training; valid, dev, val; testing, eval, evaluation).

A line that is not JSON comes back as a `BadRow` in place of the row, so the caller decides whether
it is fatal; a file or folder that cannot be read at all raises `DatasetError`. `chat_messages`
checks a column that holds a conversation ([{"role": ..., "content": ...}, ...]) the same way for
every reader. `where_folder` gives the folder a row's relative file paths (images) start from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from common.wire import short

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson")
# `datasets`' split names and the words a file or folder name may use for them
SPLIT_ALIASES = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                 "test": ("test", "testing", "eval", "evaluation")}
SHARDED = re.compile(r"(?P<split>\w+)-\d{5}-of-\d{5}")  # data/train-00000-of-00003[...].parquet
SEP = "-._ 0-9"  # what may stand around a split word in a name (the class `datasets` uses)


class DatasetError(ValueError):
    """A data file that cannot be used; the message names the file (and line) and why."""


class BadRow(ValueError):
    """One row that cannot be used; its reader turns it into a DatasetError or skips it."""


def iter_rows(path: str | Path, split: str = "train") -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of a file or dataset folder (see the module docstring)."""
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            yield from _iter_saved_dataset(p, split)
        else:
            for f in hub_split_files(p, split):
                yield from _iter_file(f)
    elif not p.is_file():
        raise DatasetError(f"{path}: no such file or folder")
    else:
        yield from _iter_file(p)


def _iter_file(p: Path) -> Iterator[tuple[str, Any]]:
    if p.suffix == ".parquet":
        yield from _iter_parquet(p)
    elif p.suffix == ".json" and _starts_with(p, "["):
        yield from _iter_json_array(p)
    elif p.suffix in (".jsonl", ".json", ".ndjson"):
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, a separator) are no rows
                try:
                    yield f"{p}:{n}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"{p}:{n}", BadRow(f"not valid JSON ({e.msg} at column {e.colno})")
    else:
        raise DatasetError(f"{p}: unknown format {p.suffix!r}; use .jsonl, .json, .parquet, a "
                           f"datasets.save_to_disk folder or a folder of such files")


def _starts_with(p: Path, char: str) -> bool:
    with p.open(encoding="utf-8") as f:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip().startswith(char)
    return False


def _iter_json_array(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{p}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    for n, row in enumerate(rows):
        yield f"{p}: row {n}", row


def _iter_parquet(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{p}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    n = 0
    for batch in pq.ParquetFile(str(p)).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{p}: row {n}", row
            n += 1


def _iter_saved_dataset(p: Path, split: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{p}: reading a datasets.save_to_disk folder needs the `datasets` package "
                           f"(pip install datasets)") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DatasetError(f"{p}: no split {split!r} (it has {sorted(ds)})")
        ds = ds[split]
    # Arrow rows are what the folder stores: iterating `ds` itself would decode an Image column into
    # PIL images (and audio into arrays), work thrown away by a reader that wants the file's bytes
    n = 0
    for batch in ds.with_format("arrow").iter(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{p}: row {n}", row
            n += 1


def where_folder(where: str) -> Path:
    """The folder relative paths in the row at `where` (as `iter_rows` names it) are read from: the
    folder of its file, or the `save_to_disk` folder it came from."""
    m = re.fullmatch(r"(.*?)(?::\d+|: row \d+)", where, re.DOTALL)
    p = Path(m[1] if m else where)
    return p if p.is_dir() else p.parent


def chat_messages(value: Any, key: str) -> list[dict]:
    """A column as a list of {role, content} messages (a string is one user message); BadRow if it is neither."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRow(f"{key!r} must be a string or a non-empty list of messages, got {short(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow(f"{key!r}[{i}] must be {{'role': str, 'content': str}}, got {short(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


# ------------------------------------------------------------------------------------------------
# hub dataset folders


def hub_splits(folder: str | Path) -> dict[str, list[Path]]:
    """Split name -> its data files (sorted) in a hub dataset folder, by the rules of the module docstring."""
    root = Path(folder)
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES
                   and not any(part.startswith((".", "__")) for part in f.relative_to(root).parts))
    if not files:
        raise DatasetError(f"{root}: no data files in the folder (looked for {', '.join(DATA_SUFFIXES)} "
                           f"files, and for dataset_dict.json / state.json of a datasets.save_to_disk folder)")
    sharded: dict[str, list[Path]] = {}
    for f in files:
        m = SHARDED.match(f.name)
        if m and f.relative_to(root).parts == ("data", f.name):
            sharded.setdefault(m["split"], []).append(f)
    if sharded:
        return sharded
    for names_of in (lambda f: f.relative_to(root).parts[:-1], lambda f: (f.name,)):
        found: dict[str, list[Path]] = {}
        for f in files:
            for split, words in SPLIT_ALIASES.items():
                if any(_names_split(name, words) for name in names_of(f)):
                    found.setdefault(split, []).append(f)
        if found:
            return found
    return {"train": files}


def _names_split(name: str, words: tuple[str, ...]) -> bool:
    """Whether a file or folder name holds one of `words` as a word of its own: `train.jsonl`,
    `my_test_set`, `dev` (but not `trainer.jsonl` or `contest`)."""
    return any(re.search(rf"(^|[{SEP}]){w}([{SEP}]|$)", name) for w in words)


def hub_split_files(folder: Path, split: str) -> list[Path]:
    """The data files of `split` (or of the split it is an alias of: `dev` -> validation)."""
    splits = hub_splits(folder)
    if split in splits:
        return splits[split]
    for name, words in SPLIT_ALIASES.items():
        if split in words and name in splits:
            return splits[name]
    raise DatasetError(f"{folder}: no split {split!r} (its files make the splits {sorted(splits)})")
