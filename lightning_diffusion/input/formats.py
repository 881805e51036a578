"""Where a prompt set comes from, one reader a format: ``read_records`` finds the source of
``data.prompts`` (a path, a folder, a glob, ``hf://datasets/NAME``, an inline list) and reads it
with the reader its kind names in ``READERS``: ``.txt`` and ``.jsonl`` lines (``LineRecords``, 4
bytes a line in memory), ``.csv`` (``ListRecords``), Parquet and datasets (``tables.TableRecords``).
"""

from __future__ import annotations

import csv
import glob
import json
import os
import shlex
from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Union

from lightning_diffusion.core.records import KeptColumns, Record
from lightning_diffusion.input.records import (
    _CONSTANTS,
    _DECODER,
    _JSON_WHITESPACE,
    HF_DATASETS,
    SUFFIXES,
    Columns,
    ListRecords,
    PromptFileError,
    Records,
    _first_missing,
    _shown,
    check_record,
)
from lightning_diffusion.input.settings import MAX_PROMPT_CHARS, column_problems
from lightning_diffusion.input.tables import TableRecords

BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which Windows editors put first in a file


class Offsets:
    """Byte offsets of a file's lines in 4 bytes a line: each offset less its block's base (an
    8-byte offset every ``BLOCK`` lines, or sooner where a block would span 4 GiB)."""

    BLOCK = 4096

    def __init__(self) -> None:
        self.relative = array("I")
        self.bases = array("q")
        self.firsts = array("q")  # the first line of each block
        self._base = 0  # the current block's base, and the first line past it
        self._end = 0

    def append(self, offset: int) -> None:
        count = len(self.relative)
        relative = offset - self._base
        if count >= self._end or relative >= 2**32:
            self.bases.append(offset)
            self.firsts.append(count)
            self._base, self._end, relative = offset, count + self.BLOCK, 0
        self.relative.append(relative)

    def __len__(self) -> int:
        return len(self.relative)

    def __getitem__(self, position: int) -> int:
        if position < 0:
            position += len(self.relative)
        if not 0 <= position < len(self.relative):
            raise IndexError(position)
        block = bisect_right(self.firsts, position) - 1
        return self.bases[block] + self.relative[position]


class LineRecords(Records):
    """Records of a ``.txt`` or ``.jsonl`` file: every line checked once at start, then read on
    demand through an index of byte offsets (``Offsets``: 4 bytes a record)."""

    def __init__(self, path: Path, max_chars: int = MAX_PROMPT_CHARS, columns: Columns = Columns()) -> None:
        super().__init__(max_chars, columns)
        self.path = path
        self.where = str(path)
        self.jsonl = path.suffix.lower() == ".jsonl"
        self.offsets = Offsets()
        self.blanks = array("q")  # for each blank line: the records before it (for line numbers)
        self._file: Optional[BinaryIO] = None
        self._pid: Optional[int] = None
        self._base = path.resolve().parent
        shape = self.columns.shape if self.columns else None
        with path.open("rb") as f:
            offset = len(BOM) if f.read(len(BOM)) == BOM else 0  # UTF-8 with or without a byte-order mark
            f.seek(offset)
            for raw in f:
                if raw.isspace():
                    self.blanks.append(len(self.offsets))
                else:
                    position = len(self.offsets)
                    self.offsets.append(offset)
                    try:
                        item, constants = self._parse(raw, position)
                    except PromptFileError as err:
                        self._reject(position, err)
                    else:
                        self._accept_plain(position, shape(item)[0] if shape else item, constants)
                offset += len(raw)

    @property
    def base(self) -> Path:
        return self._base

    def source(self, position: int) -> str:
        return f"{self.where}:{position + 1 + bisect_right(self.blanks, position)}"

    def _parse(self, raw: bytes, position: int) -> tuple[object, bool]:
        """The line's value, and whether it holds a NaN or Infinity (to be refused)."""
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PromptFileError(f"{self.source(position)}: not valid UTF-8.") from None
        if not self.jsonl:
            return {"prompt": line.strip()}, False
        try:  # the decoder's scanner itself; what it leaves must be JSON whitespace, as ``decode`` asks
            item, end = _DECODER.raw_decode(line)
            whole = end == len(line) or not line[end:].strip(_JSON_WHITESPACE)
        except (ValueError, RecursionError):
            whole = False
        if not whole:  # leading whitespace, or no JSON value: ``decode`` reads it or words the problem
            _CONSTANTS.clear()
            try:
                item = _DECODER.decode(line)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{self.source(position)}: not valid JSON ({err.msg}).") from None
            except (ValueError, RecursionError) as err:  # a number of thousands of digits; nesting past the stack
                reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
                raise PromptFileError(f"{self.source(position)}: not valid JSON ({reason}).") from None
            finally:
                constants = bool(_CONSTANTS)
                _CONSTANTS.clear()
            return item, constants
        if _CONSTANTS:
            _CONSTANTS.clear()
            return item, True
        return item, False

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        return self.read(position)[0]

    def read(self, position: int) -> tuple[Record, Optional[KeptColumns]]:
        if self._file is None or self._pid != os.getpid():  # one handle per process (DataLoader workers)
            self._file, self._pid = self.path.open("rb"), os.getpid()
        self._file.seek(self.offsets[position])
        item, constants = self._parse(self._file.readline(), position)
        item, kept = self.columns.shape(item)
        return check_record(item, self.source(position), self._base, constants, self.max_chars), kept

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_file": None, "_pid": None}


@dataclass(frozen=True)
class _Source:
    """Where a prompt set lies: its kind (``txt``, ``jsonl``, ``csv``, ``parquet``, ``arrow``: a
    dataset's files), its files, its name in messages and the folder its input paths resolve in."""

    kind: str
    files: tuple[Path, ...]
    where: str
    base: Path
    rows_by_file: bool = True

    def read(self, max_chars: int, columns: Columns) -> Records:
        return READERS[self.kind](self, max_chars, columns)


def _read_table(source: _Source, max_chars: int, columns: Columns) -> Records:
    return TableRecords(source.files, source.where, source.kind, source.base, max_chars, columns, source.rows_by_file)


def _read_lines(source: _Source, max_chars: int, columns: Columns) -> Records:
    if columns and source.kind == "txt":
        raise PromptFileError(f"{source.where} is a .txt file of prompts, without named fields: data.columns and "
                              "data.keep_columns apply to .jsonl, .csv, Parquet and datasets.")
    return LineRecords(source.files[0], max_chars, columns)


# A source's kind -> its reader: a new format is one reader here (and its suffix in ``records.SUFFIXES``).
READERS: dict[str, Callable[[_Source, int, Columns], Records]] = {
    "txt": _read_lines,
    "jsonl": _read_lines,
    "csv": lambda source, max_chars, columns: _read_csv(source.files[0], max_chars, columns),
    "parquet": _read_table,
    "arrow": _read_table,  # a dataset's files
}


def split_names(names: Sequence[str], split: str) -> list[str]:
    """The files (repository paths) of a Hub dataset's ``split``, by the Hub's naming: a folder of
    that name, or a file name with it as a word (``train-00000-of-00002.parquet``,
    ``data/train.parquet``). A dataset whose names mention no split is all ``train``."""
    import re

    def named(name: str, word: str) -> bool:
        parts = name.split("/")
        parts[-1] = parts[-1].rsplit(".", 1)[0]
        return any(re.search(rf"(^|[-_. ]){re.escape(word)}($|[-_. ])", part) for part in parts)

    chosen = [name for name in names if named(name, split)]
    others = ("train", "test", "validation", "valid", "dev", "eval")
    if not chosen and split == "train" and not any(named(name, word) for name in names for word in others):
        chosen = list(names)
    return sorted(chosen)


def hub_dataset(url: str) -> tuple[str, Optional[str]]:
    """``hf://datasets/NAME[@REVISION]`` -> (NAME, REVISION)."""
    name = url[len(HF_DATASETS):] if url.startswith(HF_DATASETS) else ""
    name, _, revision = name.partition("@")
    if name.count("/") > 1 or not name.strip("/") or " " in name:
        raise PromptFileError(f"data.prompts {url!r}: a Hugging Face dataset is named hf://datasets/NAME (NAME as "
                              "owner/name, @revision optional).")
    return name.strip("/"), revision or None


def _hub_source(url: str, split: Optional[str]) -> _Source:
    """A Hub dataset's Parquet files of ``split`` from the local cache (``HF_HOME``), never the
    network: the snapshot its ``refs/main`` (or revision) names, in the hub cache's layout
    (``datasets--owner--name/snapshots/COMMIT``), which may hold only the split ``download`` fetched."""
    from huggingface_hub import constants

    name, revision = hub_dataset(url)
    split = split or "train"
    fetch = ("fetch it where there is network with `lightning-diffusion download --config CONFIG` (the config "
             "naming this data.prompts and data.split), or set HF_HOME to a cache that holds it")
    repo = Path(constants.HF_HUB_CACHE) / ("datasets--" + name.replace("/", "--"))
    ref = repo / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision or ""
    folder = repo / "snapshots" / commit
    if not commit or not folder.is_dir():
        raise PromptFileError(f"{url} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); {fetch}.")
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.parquet"))
    files = split_names(names, split)
    if not files:
        raise PromptFileError(f"{url} has no Parquet file of split {split!r} in the local cache ({folder}); {fetch}.")
    return _Source("parquet", tuple(folder / f for f in files), url, folder)


def _saved_dataset(path: Path, split: Optional[str]) -> _Source:
    """A folder ``datasets.Dataset.save_to_disk`` wrote (``DatasetDict``: a folder a split)."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = [str(s) for s in json.loads((path / "dataset_dict.json").read_text())["splits"]]
        except (ValueError, KeyError, TypeError):
            raise PromptFileError(f"{path / 'dataset_dict.json'}: not a dataset's list of splits.") from None
        if split is None and len(splits) != 1:
            raise PromptFileError(f"{path} is a dataset of splits {', '.join(splits)}: choose one with data.split.")
        split = split if split is not None else splits[0]
        if split not in splits:
            raise PromptFileError(f"{path} has no split {split!r} (its splits: {', '.join(splits)}).")
        path, split = path / split, None
    try:
        state = json.loads((path / "state.json").read_text())
        files = tuple(path / str(entry["filename"]) for entry in state["_data_files"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise PromptFileError(f"{path / 'state.json'}: not the state of a dataset saved with save_to_disk.") from None
    if split is not None and split != state.get("_split"):
        raise PromptFileError(f"data.split {split!r}: {path} is a dataset of one split ({state.get('_split')}); "
                              "data.split chooses among the splits of a DatasetDict's folder: leave it out.")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise PromptFileError(f"{path}: its state.json lists {missing[0]}, which is missing.")
    return _Source("arrow", files, str(path), path.resolve(), rows_by_file=False)


def _source(prompts: Union[str, os.PathLike], split: Optional[str]) -> _Source:
    text = str(prompts)
    if text.startswith("hf://"):
        return _hub_source(text, split)
    path = Path(text).expanduser()
    one_split = (f"data.split {split!r} chooses a split of a dataset (hf://datasets/NAME, a save_to_disk folder of "
                 f"splits); {text} has none: leave it out.")
    if not path.exists() and any(c in text for c in "*?["):
        matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True) if Path(m).is_file())
        if not matches:
            raise PromptFileError(f"data.prompts {text!r} matches no file.")
        other = [m for m in matches if m.suffix.lower() != ".parquet"]
        if other:
            raise PromptFileError(f"data.prompts {text!r} matches {other[0]}, which is not a .parquet file (a glob "
                                  "names Parquet files).")
        if split is not None:
            raise PromptFileError(one_split)
        base = Path(os.path.commonpath([str(m.resolve().parent) for m in matches]))
        return _Source("parquet", tuple(matches), text, base)
    if not path.exists():
        looks_like_a_prompt = " " in text and not path.suffix and os.sep not in text
        as_list = shlex.quote(json.dumps([text]))
        raise PromptFileError(f"Prompt file {str(path)!r} does not exist."
                              + (f" Prompts given in place are a list: --data.prompts {as_list}."
                                 if looks_like_a_prompt else ""))
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _saved_dataset(path, split)
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() == ".parquet"
                       and not p.name.startswith((".", "_")))
        if not files:
            raise PromptFileError(f"Prompt folder {str(path)!r} holds no .parquet file (nor a dataset saved with "
                                  "save_to_disk, whose folder has a state.json).")
        if split is not None:
            raise PromptFileError(one_split)
        return _Source("parquet", tuple(files), str(path), path.resolve())
    if not path.is_file():
        raise PromptFileError(f"Prompt file {str(path)!r} is not a file.")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise PromptFileError(f"Prompt file {str(path)!r} has suffix {suffix!r}; use one of {', '.join(SUFFIXES)} "
                              "(or a folder of Parquet files, a dataset saved with save_to_disk).")
    if split is not None:
        raise PromptFileError(one_split)
    return _Source(suffix[1:], (path,), str(path), path.resolve().parent)


def check_source(prompts: Union[str, os.PathLike], split: Optional[str] = None) -> None:
    """Raise ``PromptFileError`` where ``prompts`` names no prompt set this can read (missing, of
    another kind, a glob that matches nothing...); no record is read."""
    _source(prompts, split)


_READ: dict[tuple, Records] = {}


def read_records(prompts: Union[str, os.PathLike, Sequence[object]], max_chars: int = MAX_PROMPT_CHARS,
                 columns: Optional[Mapping[str, Optional[str]]] = None, keep_columns: Optional[Sequence[str]] = None,
                 split: Optional[str] = None) -> Records:
    """Read prompt records from a path (``.txt``, ``.jsonl``, ``.csv``, ``.parquet``; a folder of
    Parquet files or a glob of them; a ``save_to_disk`` dataset folder; ``hf://datasets/NAME``
    from the local hub cache, ``split`` choosing a dataset's split) or an inline list (strings, or
    mappings with the fields of a ``.jsonl`` line). ``columns`` and ``keep_columns``: ``Columns``.
    Problems of the source itself (missing, of another kind, a column map that does not fit it,
    without a record) raise ``PromptFileError``; problems of single records are kept in
    ``records.bad``. Files are read lazily after one checking pass: a ``.txt`` or ``.jsonl`` file
    costs 8 bytes a line in memory (``LineRecords``), Parquet and datasets a few numbers a row group
    (``TableRecords``), plus 4 bytes a record for its call-argument set."""
    problems = column_problems(columns, keep_columns, split)
    if problems:
        raise PromptFileError(" ".join(problems))
    shape = Columns.of(columns, keep_columns)
    if isinstance(prompts, (str, os.PathLike)):
        source = _source(prompts, split)
        stats = [(f, f.stat()) for f in source.files]
        key = (source.kind, source.where, tuple((str(f.resolve()), st.st_mtime_ns, st.st_size) for f, st in stats),
               max_chars, shape)
        if key not in _READ:
            _READ.clear()  # keep one prompt set's index at most
            _READ[key] = source.read(max_chars, shape)
        records = _READ[key]
        where = source.where
    else:
        records = ListRecords(list(prompts), "inline prompts", max_chars=max_chars, columns=shape)
        where = "the inline prompt list"
    if not len(records):
        raise PromptFileError(f"No prompts found in {where}.")
    return records


def read_data(data: Mapping[str, Any]) -> Records:
    """The records of a ``data`` config group (``prompts``, ``max_prompt_chars``, ``columns``,
    ``keep_columns``, ``split``): ``read_records`` with every setting that shapes them."""
    return read_records(data["prompts"], data.get("max_prompt_chars") or MAX_PROMPT_CHARS, data.get("columns"),
                        data.get("keep_columns"), data.get("split"))


def _read_csv(path: Path, max_chars: int = MAX_PROMPT_CHARS, columns: Columns = Columns()) -> ListRecords:
    with path.open(encoding="utf-8-sig", newline="") as f:  # with or without a byte-order mark
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        missing = _first_missing(columns, header)
        if missing:
            raise PromptFileError(f"{path}:1: {missing}, which is not a column of the CSV header ({_shown(header)}).")
        if columns.column("prompt") not in header:
            raise PromptFileError(f"{path}:1: the CSV header has no {columns.described('prompt')} column.")
        seed = columns.column("seed")
        rows, lines = [], []
        for row in reader:
            row = {k: v for k, v in row.items() if k is not None and v not in (None, "")}
            if seed is not None and seed in row:
                try:
                    row[seed] = int(row[seed])
                except ValueError:
                    pass  # refused by check_record, with its line
            rows.append(row)
            lines.append(reader.line_num)
    return ListRecords(rows, str(path), lines, path.resolve().parent, max_chars, columns)


