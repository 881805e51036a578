"""Prompt records: reading prompt files, and what a record may hold.

A record is a prompt and, optionally, its own ``seed``, ``negative_prompt``, input files
(``image``, ``mask_image``, ``last_image``) and the call arguments its pipeline lets a record set
(``PipelineSpec.record_args``: sizes, steps, guidance...), each typed and bounded by
``validation.CALL_ARGS``. Anything else is refused, naming the keys a record may set.

Records are checked in two passes, both before any weight loads:

1. while a file is read (``read_records``): JSON, a prompt, the seed's type and range, input paths,
   finite numbers; a line that fails is kept as a *rejected* position (its index stays its own, so
   the other records keep their image indices and seeds);
2. against the pipeline (``check_records``): the allow-list, each value's type and bound, sizes,
   input files. Each distinct set of call arguments is checked once, and every record that has it
   shares its verdict; input files are checked record by record.

``RecordVerdicts`` holds the outcome: record position -> reason. ``data.on_bad_record: fail``
(the default) refuses the run naming up to ``REPORTED`` of them with ``file:line``;
``skip`` makes the others and lists these in the output folder's ``rejected.jsonl``.

Where a prompt set comes from: a ``.txt``, ``.jsonl`` or ``.csv`` file, an inline list, Parquet
(a file, a folder of files or a glob, ``TableRecords`` by row group) or a Hugging Face dataset (a
``save_to_disk`` folder, or ``hf://datasets/NAME`` from the local hub cache: ``TableRecords`` by
record batch). ``Columns`` (``data.columns``, ``data.keep_columns``) turns a source's named
fields into a record's, and sets aside the columns an image's metadata carries.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import shlex
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_diffusion.errors import ConfigError, is_int
from lightning_diffusion.input.images import INPUT_FIELDS, file_problems
from lightning_diffusion.run import validation
from lightning_diffusion.run.validation import CALL_ARGS, MAX_PROMPT_CHARS, SEED_MAX, column_problems, non_finite

# Fields of a record that are not pipeline-call arguments.
RECORD_FIELDS = ("prompt", "seed", "negative_prompt", *INPUT_FIELDS)
# The columns of a table (Parquet, a dataset) read as a record's fields, by name or through
# ``data.columns``: the fields a ``.jsonl`` line may have; a table's other columns are not read.
COLUMN_FIELDS = (*RECORD_FIELDS, *CALL_ARGS)
SUFFIXES = (".txt", ".jsonl", ".csv", ".parquet")
HF_DATASETS = "hf://datasets/"
REPORTED = 20  # bad records named in a refusal; the rest are counted
BAD_SET = 0xFFFFFFFF  # the call-argument set of a line rejected while reading
_PRESENCE = ("negative_prompt", *INPUT_FIELDS)
_PRESENCE_SET = frozenset(_PRESENCE)
_NONE_PRESENT = (False,) * len(_PRESENCE)
_RECORD_FIELD_SET = frozenset(RECORD_FIELDS)
_INPUT_FIELD_SET = frozenset(INPUT_FIELDS)
_LARGE_SEED = SEED_MAX // 2
_PLAIN_FIELDS = frozenset(("prompt", "seed"))  # a record of these alone: no override, no field of _PRESENCE
_PLAIN_KEY = ((), _NONE_PRESENT)
_NO_FIELDS: Mapping[str, Any] = {}


class PromptFileError(ConfigError):
    """A prompt file or inline prompt list that cannot be used; the message names file and line."""


def _json_ready(value: Any) -> Any:
    """A kept column's value as JSON holds it (a timestamp as ISO text, a decimal as text)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


@dataclass(frozen=True)
class Columns:
    """How a source's named fields become a record (``data.columns``: record field -> the source's
    column; a field mapped to None is not read), and the columns each image's metadata carries
    (``data.keep_columns``)."""

    names: tuple[tuple[str, Optional[str]], ...] = ()
    keep: tuple[str, ...] = ()

    @classmethod
    def of(cls, columns: Optional[Mapping[str, Optional[str]]] = None, keep: Optional[Sequence[str]] = None
           ) -> "Columns":
        return cls(tuple(sorted((columns or {}).items())), tuple(dict.fromkeys(keep or ())))

    def __bool__(self) -> bool:
        return bool(self.names or self.keep)

    def column(self, name: str) -> Optional[str]:
        """The source column a record field is read from (None: not read)."""
        return dict(self.names).get(name, name)

    def described(self, name: str) -> str:
        """How a message names field ``name``'s column: ``'caption' (data.columns prompt)``."""
        column = self.column(name)
        return f"{column!r} (data.columns {name})" if column != name else f"{name!r}"

    def wanted(self, available: Sequence[str]) -> list[str]:
        """The columns of a table to read: the record fields it has (by name or mapped), then the
        kept columns."""
        names = [self.column(name) for name in COLUMN_FIELDS]
        return list(dict.fromkeys(c for c in [*names, *self.keep] if c is not None and c in available))

    def shape(self, item: Any) -> tuple[Any, Optional[dict[str, Any]]]:
        """A source's item as a record's fields, and its kept columns (None when none is asked)."""
        if not self or not isinstance(item, dict):
            return item, None
        mapped = dict(self.names)
        kept = {name: _json_ready(item.get(name)) for name in self.keep} if self.keep else None
        sources = {column for column in mapped.values() if column is not None}
        record = {k: v for k, v in item.items() if k not in mapped and k not in sources
                  and (k not in self.keep or k in COLUMN_FIELDS)}
        for name, column in mapped.items():
            if column is not None and column in item:
                record[name] = item[column]
        return record, kept


class CallArgSet:
    """One distinct set of call arguments given by records, and what the checks need of the
    records that share it (counted while the file is read, so nothing is read twice). Records
    share a set only when they have the same fields present (``RecordSummary.add``), so the first
    one says which input fields and whether a negative prompt its records have."""

    KEEP = 5  # record numbers kept for messages

    def __init__(self, first: int, overrides: dict[str, Any], record: Mapping[str, Any]) -> None:
        self.first = first          # the first record (from 1) that has it
        self.overrides = overrides
        self.count = 0
        self.negative = record.get("negative_prompt") is not None
        self.without_negative = 0
        self.first_without_negative: list[int] = []
        self.first_negative: Optional[int] = first if self.negative else None
        # input field -> first record (from 1) that has it / that lacks it
        self.with_inputs = {name: first for name in INPUT_FIELDS if record.get(name) is not None}
        self.without_inputs = {name: first for name in INPUT_FIELDS if record.get(name) is None}

    def add(self, number: int) -> None:
        self.count += 1
        if not self.negative:
            self.without_negative += 1
            if len(self.first_without_negative) < self.KEEP:
                self.first_without_negative.append(number)


class Same(Sequence):
    """``size`` times one value, held once: a prompt set's ``set_of`` while all its records share
    one call-argument set."""

    def __init__(self, value: int, size: int) -> None:
        self._value, self._size = value, size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self._value] * len(range(*position.indices(self._size)))
        if not -self._size <= position < self._size:
            raise IndexError(position)
        return self._value

    def __iter__(self) -> Iterator[int]:
        return (self._value for _ in range(self._size))


class RecordSummary:
    """Every record's call-argument set (4 bytes a record once two records differ; none while all
    share one), and the sets themselves.

    ``override_sets``, ``without_negative``... describe the records that are not rejected: the
    checks of the strategies (CFG branches, token splits) look at what will run.
    """

    def __init__(self) -> None:
        self._set_of: Optional[array] = None  # record position -> index into ``sets`` (BAD_SET: rejected while read)
        self._same = 0  # while ``_set_of`` is None: the one set of every record so far
        self._count = 0
        self.sets: list[CallArgSet] = []
        self._ids: dict[Any, int] = {}
        self.rejected_sets: frozenset[int] = frozenset()  # sets the pipeline refuses (``check_records``)
        self.large_seeds: dict[int, int] = {}  # position -> seed, for seeds near the generator's limit

    @property
    def set_of(self) -> Sequence[int]:
        """Each record's set: an ``array`` of 4 bytes a record, or ``Same`` while all share one."""
        return self._set_of if self._set_of is not None else Same(self._same, self._count)

    def set_array(self) -> Any:
        """``set_of`` as a uint32 numpy array (a broadcast of one value, no memory, while all share one)."""
        import numpy as np

        if self._set_of is None:
            return np.broadcast_to(np.uint32(self._same), (self._count,))
        return np.frombuffer(self._set_of, dtype=np.uint32) if self._count else np.zeros(0, np.uint32)

    def _append(self, set_id: int) -> None:
        if self._set_of is not None:
            self._set_of.append(set_id)
        elif not self._count or set_id == self._same:
            self._same = set_id
        else:  # a second set: every record's from now on
            self._set_of = array("I", [self._same]) * self._count
            self._set_of.append(set_id)
        self._count += 1

    def add(self, record: dict[str, Any]) -> None:
        # Records share a set when they set the same arguments and have the same fields, so that a
        # check of the set (an input the pipeline needs, a negative prompt it cannot take) is
        # every one of its records' verdict. (Set operations on the keys first: most records of a
        # large set have only a prompt and a seed.)
        overrides: dict[str, Any] = {}
        if record.keys() <= _PLAIN_FIELDS:
            key: Any = _PLAIN_KEY
        else:
            named = record.keys() - _RECORD_FIELD_SET
            fields = _NONE_PRESENT if _PRESENCE_SET.isdisjoint(record) else tuple(
                record.get(name) is not None for name in _PRESENCE)
            overrides = {k: v for k, v in record.items() if k in named}  # in the record's order
            try:
                key = (tuple(sorted(overrides.items())), fields)
                hash(key)
            except TypeError:  # a list or mapping among the values
                key = (json.dumps(overrides, sort_keys=True, default=repr), fields)
        self._add(key, overrides, record, record.get("seed"))

    def add_plain(self, seed: Optional[int]) -> None:
        """``add`` for a record of a prompt and perhaps a seed, nothing else (checked)."""
        self._add(_PLAIN_KEY, {}, _NO_FIELDS, seed)

    def _add(self, key: Any, overrides: dict[str, Any], record: Mapping[str, Any], seed: Optional[int]) -> None:
        number = self._count + 1
        set_id = self._ids.get(key)
        if set_id is None:
            set_id = self._ids[key] = len(self.sets)
            self.sets.append(CallArgSet(number, overrides, record))
        self.sets[set_id].add(number)
        self._append(set_id)
        if seed is not None and seed > _LARGE_SEED:
            self.large_seeds[number - 1] = seed

    def add_bad(self) -> None:
        self._append(BAD_SET)

    def positions(self, set_ids: Sequence[int]) -> Iterator[int]:
        """The positions of the records of these sets."""
        wanted = set(set_ids)
        return (position for position, set_id in enumerate(self.set_of) if set_id in wanted)

    def _live(self) -> list[CallArgSet]:
        return [s for i, s in enumerate(self.sets) if i not in self.rejected_sets]

    @property
    def count(self) -> int:
        return sum(s.count for s in self._live())

    def override_sets(self) -> list[tuple[int, dict[str, Any]]]:
        """Each distinct set of call-argument overrides (``{}`` included) of the records that run,
        with the number of the first record (from 1) that has it."""
        first: dict[str, tuple[int, dict[str, Any]]] = {}
        for s in self._live():
            key = json.dumps(s.overrides, sort_keys=True, default=repr)
            if key not in first or s.first < first[key][0]:
                first[key] = (s.first, s.overrides)
        return sorted(first.values(), key=lambda item: item[0])

    @property
    def without_negative(self) -> int:
        return sum(s.without_negative for s in self._live())

    @property
    def first_without_negative(self) -> list[int]:
        return sorted(n for s in self._live() for n in s.first_without_negative)[:CallArgSet.KEEP]

    @property
    def first_negative(self) -> Optional[int]:
        return min((s.first_negative for s in self._live() if s.first_negative is not None), default=None)

    def _first(self, attribute: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for s in self._live():
            for name, number in getattr(s, attribute).items():
                found[name] = min(number, found.get(name, number))
        return found

    @property
    def with_inputs(self) -> dict[str, int]:
        return self._first("with_inputs")

    @property
    def without_inputs(self) -> dict[str, int]:
        return self._first("without_inputs")


class Records(Sequence):
    """Prompt records by position (from 0), with where each comes from (``source``), the lines
    rejected while reading (``bad``: position -> reason) and a ``summary`` made in the same pass."""

    where = "records"

    def __init__(self, max_chars: int = MAX_PROMPT_CHARS, columns: Columns = Columns()) -> None:
        self.max_chars = max_chars
        self.columns = columns
        self.summary = RecordSummary()
        self.bad: dict[int, tuple[str, str]] = {}  # position -> (file:line, reason)
        self.verdicts: Optional[RecordVerdicts] = None  # the last ``check_records`` outcome
        self._verdicts_key: Optional[str] = None

    def source(self, position: int) -> str:
        """``file:line`` of the record at ``position``."""
        return f"{self.where}:{position + 1}"

    def _accept(self, position: int, item: Any, constants: bool = True) -> Optional[dict[str, Any]]:
        """Check one parsed item; a bad one is kept as a rejected position (``constants``: it may
        hold a NaN or Infinity)."""
        try:
            record = _checked(item, self.base, constants, self.max_chars)
        except _Problem as problem:
            self._reject(position, str(problem))
            return None
        self.summary.add(record)
        return record

    def _accept_plain(self, position: int, item: Any, constants: bool = True) -> None:
        """``_accept`` for the reading pass, whose records are summarised, not kept: a record of a
        prompt and perhaps a seed, as most of a large set are, is checked here in a few steps."""
        if type(item) is dict and item.keys() <= _PLAIN_FIELDS:
            prompt, seed = item.get("prompt"), item.get("seed")
            if (type(prompt) is str and 0 < len(prompt) <= self.max_chars and not prompt.isspace()
                    and (seed is None or (type(seed) is int and 0 <= seed <= SEED_MAX))):
                self.summary.add_plain(seed)
                return
        self._accept(position, item, constants)

    def _reject(self, position: int, reason: Union[str, PromptFileError]) -> None:
        source = self.source(position)
        self.bad[position] = (source, str(reason).removeprefix(f"{source}: "))
        self.summary.add_bad()

    @property
    def base(self) -> Path:
        return Path.cwd()

    def read(self, position: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """The record at ``position`` and the columns its images' metadata carries
        (``data.keep_columns``; None when none is asked)."""
        return self[position], None

    def accepted(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(position, record) of every record not rejected while reading."""
        for position in range(len(self)):
            if position not in self.bad:
                yield position, self[position]


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
        self._file: Optional[Any] = None
        self._pid: Optional[int] = None
        self._base = path.resolve().parent
        shape = self.columns.shape if self.columns else None
        with path.open("rb") as f:
            offset = 0
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

    def _parse(self, raw: bytes, position: int) -> tuple[Any, bool]:
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

    def read(self, position: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        if self._file is None or self._pid != os.getpid():  # one handle per process (DataLoader workers)
            self._file, self._pid = self.path.open("rb"), os.getpid()
        self._file.seek(self.offsets[position])
        item, constants = self._parse(self._file.readline(), position)
        item, kept = self.columns.shape(item)
        return check_record(item, self.source(position), self._base, constants, self.max_chars), kept

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": None}


class ListRecords(Records):
    """Records held in memory: a ``.csv`` file's rows (with their line numbers) or an inline list."""

    def __init__(self, items: Sequence[Any], where: str, lines: Optional[Sequence[int]] = None,
                 base: Optional[Path] = None, max_chars: int = MAX_PROMPT_CHARS, columns: Columns = Columns()) -> None:
        super().__init__(max_chars, columns)
        self.where = where
        self.lines = list(lines) if lines is not None else None
        self._base = base or Path.cwd()
        self.items: list[Optional[dict[str, Any]]] = []
        self.kept: Optional[list[Optional[dict[str, Any]]]] = [] if columns.keep else None
        for position, item in enumerate(items):
            item, kept = columns.shape(item)
            self.items.append(self._accept(position, item))
            if self.kept is not None:
                self.kept.append(kept)

    @property
    def base(self) -> Path:
        return self._base

    def source(self, position: int) -> str:
        return f"{self.where}:{self.lines[position] if self.lines is not None else position + 1}"

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        record = self.items[position]
        if record is None:
            raise PromptFileError(": ".join(self.bad[position]))
        return record

    def read(self, position: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        return self[position], self.kept[position] if self.kept is not None else None

    def __eq__(self, other: Any) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Records)) else NotImplemented


def _text_type(kind: Any) -> bool:
    import pyarrow.types as types

    if types.is_dictionary(kind):
        return _text_type(kind.value_type)
    return bool(types.is_string(kind) or types.is_large_string(kind) or types.is_string_view(kind))


def _integer_type(kind: Any) -> bool:
    import pyarrow.types as types

    return bool(types.is_integer(kind) or (types.is_dictionary(kind) and types.is_integer(kind.value_type)))


def _holds_bytes(kind: Any) -> bool:
    """Whether a column of this Arrow type holds bytes somewhere (which JSON cannot)."""
    import pyarrow.types as types

    if types.is_binary(kind) or types.is_large_binary(kind) or types.is_fixed_size_binary(kind):
        return True
    if types.is_binary_view(kind):
        return True
    return any(_holds_bytes(kind.field(i).type) for i in range(kind.num_fields))


def _shown(names: Sequence[str], most: int = 12) -> str:
    more = f", ... ({len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class TableRecords(Records):
    """Records of Arrow data, read by position: Parquet files by row group, or the Arrow files of a
    Hugging Face dataset (``save_to_disk``) by record batch. Only the columns a record or its
    metadata needs are read (``Columns.wanted``). Every row is checked once at start, a chunk (row
    group, record batch) at a time; then a record is read from its chunk, the last ``KEEP`` chunks
    read kept per process. In memory: a few numbers a chunk (its first record, file and row group
    or byte offset), and the summary's 4 bytes a record.

    A row is named ``file.parquet:row N`` (``N`` from 0 within its file, as pyarrow and pandas
    count) or, in a dataset, ``folder:row N`` (``N`` the dataset's own index, ``dataset[N]``)."""

    KEEP = 4  # chunks kept decoded, per process

    def __init__(self, files: Sequence[Path], where: str, kind: str, base: Path, max_chars: int = MAX_PROMPT_CHARS,
                 columns: Columns = Columns(), rows_by_file: bool = True) -> None:
        super().__init__(max_chars, columns)
        self.files = [str(f) for f in files]
        self.where = where
        self.kind = kind  # "parquet" or "arrow"
        self.rows_by_file = rows_by_file
        self._base = base
        self.file_start = array("q")   # file -> its first record
        self.chunk_start = array("q")  # chunk -> its first record
        self.chunk_file = array("I")   # chunk -> its file
        self.chunk_key = array("q")    # chunk -> its row group, or the byte offset (a stream) or number of its batch
        self.schemas: list[Any] = []    # file -> its Arrow schema
        self.streams: list[bool] = []   # file -> an Arrow stream (not the random-access file format)
        self.projections: list[list[str]] = []  # file -> the columns read
        self.fields: list[list[tuple[str, str]]] = []  # file -> (record field, its column) of the fields it has
        self.floats: list[bool] = []  # file -> a field's column may hold a NaN or Infinity
        self._total = 0
        self._handles: dict[int, Any] = {}
        self._pid: Optional[int] = None
        self._chunks: OrderedDict[int, Any] = OrderedDict()
        for number, path in enumerate(files):
            self.file_start.append(self._total)
            for key, batches in self._scan(number, path):
                first = self._total
                for batch in batches:
                    for row in self._records(number, batch).to_pylist():
                        self._accept_plain(self._total, {k: v for k, v in row.items() if v is not None},
                                           self.floats[number])
                        self._total += 1
                if self._total > first:
                    self.chunk_start.append(first)
                    self.chunk_file.append(number)
                    self.chunk_key.append(key)

    @property
    def base(self) -> Path:
        return self._base

    def source(self, position: int) -> str:
        if not self.rows_by_file:
            return f"{self.where}:row {position}"
        number = bisect_right(self.file_start, position) - 1
        return f"{self.files[number]}:row {position - self.file_start[number]}"

    def _records(self, number: int, batch: Any) -> Any:
        """A batch of file ``number``'s rows as record fields: its columns renamed (an empty cell
        is an absent field)."""
        import pyarrow as pa

        fields = self.fields[number]
        kind = pa.Table if isinstance(batch, pa.Table) else pa.RecordBatch
        return kind.from_arrays([batch.column(column) for _, column in fields], names=[name for name, _ in fields])

    def _columns(self, path: Path, schema: Any) -> list[str]:
        """The columns of a file to read, after its schema is checked against ``data.columns``
        (and the record fields it has noted)."""
        import pyarrow.types as types

        names = list(schema.names)
        shape = self.columns
        missing = _first_missing(shape, names)
        if missing:
            raise PromptFileError(f"{path}: {missing}, which is not a column of it (its columns: {_shown(names)}).")
        for kept in shape.keep:
            kind = schema.field(kept).type
            if _holds_bytes(kind):
                raise PromptFileError(f"{path}: column {kept!r} (data.keep_columns) holds {kind}, bytes that an "
                                      "image's metadata (JSON text) cannot carry.")
        prompt = shape.column("prompt")
        if prompt is None or prompt not in names:
            raise PromptFileError(f"{path}: no 'prompt' column (its columns: {_shown(names)}); name the prompt's "
                                  "column with data.columns: {prompt: COLUMN}.")
        for name in ("prompt", "negative_prompt"):
            column = shape.column(name)
            if column in names and not _text_type(schema.field(column).type):
                raise PromptFileError(f"{path}: column {shape.described(name)} holds {schema.field(column).type}, "
                                      f"not text (a {name} is a string).")
        column = shape.column("seed")
        if column in names and not _integer_type(schema.field(column).type):
            raise PromptFileError(f"{path}: column {shape.described('seed')} holds {schema.field(column).type}, not "
                                  "integers (a seed is an integer from 0 to 2**64 - 1).")
        fields = [(name, column) for name in COLUMN_FIELDS
                  if (column := shape.column(name)) is not None and column in names]
        self.fields.append(fields)
        self.floats.append(any(not (types.is_string(t) or types.is_large_string(t) or types.is_integer(t)
                                    or types.is_boolean(t) or types.is_dictionary(t))
                               for t in (schema.field(column).type for _, column in fields)))
        return shape.wanted(names)

    def _scan(self, number: int, path: Path) -> Iterator[tuple[int, Iterator[Any]]]:
        """Open file ``number`` and check its schema; then each chunk's key and its record batches."""
        import pyarrow as pa

        if self.kind == "parquet":
            import pyarrow.parquet as pq

            try:
                handle = pq.ParquetFile(path)
            except (pa.ArrowException, OSError) as err:
                raise PromptFileError(f"{path}: not a Parquet file ({str(err).splitlines()[0]}).") from None
            self.schemas.append(handle.schema_arrow)
            self.streams.append(False)
            self.projections.append(self._columns(path, handle.schema_arrow))
            for group in range(handle.num_row_groups):
                table = handle.read_row_group(group, columns=self.projections[number])
                yield group, iter(table.to_batches(max_chunksize=4096))
            return
        try:
            source = pa.memory_map(str(path))
            stream = source.read(6) != b"ARROW1"
            source.seek(0)
            reader: Any = None if stream else pa.ipc.open_file(source)
            schema = pa.ipc.read_schema(pa.ipc.read_message(source)) if reader is None else reader.schema
        except (pa.ArrowException, OSError, EOFError) as err:
            raise PromptFileError(f"{path}: not an Arrow file of a dataset ({str(err).splitlines()[0]}).") from None
        self.schemas.append(schema)
        self.streams.append(stream)
        self.projections.append(self._columns(path, schema))
        if reader is not None:
            for batch in range(reader.num_record_batches):
                yield batch, iter([reader.get_batch(batch).select(self.projections[number])])
            return
        while True:
            offset = source.tell()
            try:
                message = pa.ipc.read_message(source)
            except EOFError:
                return
            if message.type != "record batch":
                raise PromptFileError(f"{path}: holds an Arrow {message.type} message, which is not read here "
                                      "(save the dataset with datasets' save_to_disk).")
            yield offset, iter([pa.ipc.read_record_batch(message, schema).select(self.projections[number])])

    def _handle(self, number: int) -> Any:
        if self._pid != os.getpid():  # one set of handles per process (DataLoader workers)
            self._handles, self._chunks, self._pid = {}, OrderedDict(), os.getpid()
        if number not in self._handles:
            import pyarrow as pa

            if self.kind == "parquet":
                import pyarrow.parquet as pq

                self._handles[number] = pq.ParquetFile(self.files[number])
            else:
                source = pa.memory_map(self.files[number])
                self._handles[number] = source if self.streams[number] else pa.ipc.open_file(source)
        return self._handles[number]

    def _chunk(self, chunk: int) -> Any:
        handle = self._handle(self.chunk_file[chunk])
        if chunk in self._chunks:
            self._chunks.move_to_end(chunk)
            return self._chunks[chunk]
        number, key = self.chunk_file[chunk], self.chunk_key[chunk]
        if self.kind == "parquet":
            data = handle.read_row_group(key, columns=self.projections[number])
        elif self.streams[number]:
            import pyarrow as pa

            handle.seek(key)
            data = pa.ipc.read_record_batch(pa.ipc.read_message(handle), self.schemas[number])
            data = data.select(self.projections[number])
        else:
            data = handle.get_batch(key).select(self.projections[number])
        self._chunks[chunk] = data
        while len(self._chunks) > self.KEEP:
            self._chunks.popitem(last=False)
        return data

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        return self.read(position)[0]

    def read(self, position: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        if position < 0:
            position += self._total
        if not 0 <= position < self._total:
            raise IndexError(f"record {position} of {self._total}")
        chunk = bisect_right(self.chunk_start, position) - 1
        number, row = self.chunk_file[chunk], self._chunk(chunk).slice(position - self.chunk_start[chunk], 1)
        item = {k: v for k, v in self._records(number, row).to_pylist()[0].items() if v is not None}
        kept = None
        if self.columns.keep:
            kept = {k: _json_ready(v) for k, v in row.select(list(self.columns.keep)).to_pylist()[0].items()}
        return check_record(item, self.source(position), self._base, self.floats[number], self.max_chars), kept

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}, "_chunks": OrderedDict(), "_pid": None}


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
        if self.kind in ("parquet", "arrow"):
            return TableRecords(self.files, self.where, self.kind, self.base, max_chars, columns, self.rows_by_file)
        if columns and self.kind == "txt":
            raise PromptFileError(f"{self.where} is a .txt file of prompts, without named fields: data.columns and "
                                  "data.keep_columns apply to .jsonl, .csv, Parquet and datasets.")
        if self.kind == "csv":
            return _read_csv(self.files[0], max_chars, columns)
        return LineRecords(self.files[0], max_chars, columns)


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


_READ: dict[tuple, Records] = {}


def read_records(prompts: Union[str, os.PathLike, Sequence[Any]], max_chars: int = MAX_PROMPT_CHARS,
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
    problems = column_problems({"columns": columns, "keep_columns": keep_columns, "split": split})
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


def _first_missing(columns: Columns, names: Sequence[str]) -> Optional[str]:
    """The first column that ``data.columns`` or ``data.keep_columns`` names and ``names`` lacks,
    as a message says it; None when every one is there."""
    for name, column in columns.names:
        if column is not None and column not in names:
            return f"data.columns maps {name} to {column!r}"
    for column in columns.keep:
        if column not in names:
            return f"data.keep_columns names {column!r}"
    return None


def _read_csv(path: Path, max_chars: int = MAX_PROMPT_CHARS, columns: Columns = Columns()) -> ListRecords:
    with path.open(encoding="utf-8", newline="") as f:
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


_CONSTANTS: list[str] = []  # NaN / Infinity seen by the decoder since the last look


def _non_finite_constant(name: str) -> float:
    """JSON has no NaN or Infinity, but Python's json reads them: noted, so that only a line that
    has one is searched for it (``check_record`` refuses it)."""
    _CONSTANTS.append(name)
    return float(name.replace("Infinity", "inf"))


_DECODER = json.JSONDecoder(parse_constant=_non_finite_constant)
_JSON_WHITESPACE = " \t\n\r"


class _Problem(Exception):
    """A record's problem, worded without its place (``check_record`` and ``Records`` add it)."""


def check_record(item: Any, where: str, base: Optional[Path] = None, constants: bool = True,
                 max_chars: int = MAX_PROMPT_CHARS) -> dict[str, Any]:
    """One record's fields, checked without the pipeline; returns it with its input paths resolved
    against ``base`` (the prompt file's folder). Raises ``PromptFileError`` naming ``where``.
    ``constants``: it may hold a NaN or Infinity (a JSON line that had none is not searched)."""
    try:
        return _checked(item, base, constants, max_chars)
    except _Problem as problem:
        raise PromptFileError(f"{where}: {problem}") from None


def _checked(item: Any, base: Optional[Path], constants: bool, max_chars: int) -> dict[str, Any]:
    """``check_record``'s checks, once a record of the reading pass (kept lean: it runs for each of
    millions of records); raises ``_Problem``."""
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise _Problem("expected a JSON object with a 'prompt' field.")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt or prompt.isspace():
        raise _Problem("no 'prompt' (a non-empty string).")
    seed = item.get("seed")
    if seed is not None and not (type(seed) is int and 0 <= seed <= SEED_MAX) and not (
            is_int(seed, 0) and seed <= SEED_MAX):
        raise _Problem(f"'seed' must be an integer from 0 to 2**64 - 1, got {seed!r}.")
    negative = item.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise _Problem("'negative_prompt' must be a string.")
    if len(prompt) > max_chars or (negative is not None and len(negative) > max_chars):
        name, text = ("prompt", prompt) if len(prompt) > max_chars else ("negative_prompt", negative or "")
        raise _Problem(f"{name!r} has {len(text):,} characters, over data.max_prompt_chars {max_chars:,} (raise "
                       "it if you mean it).")
    places = non_finite(item) if constants else []
    if places:
        raise _Problem(f"{', '.join(places)} is not a finite number (NaN and Infinity are refused).")
    item = dict(item)
    if _INPUT_FIELD_SET.isdisjoint(item):
        return item
    for name in INPUT_FIELDS:
        value = item.get(name)
        if value is None:
            continue
        paths = value if isinstance(value, list) else [value]
        if not paths or not all(isinstance(p, str) and p.strip() for p in paths):
            raise _Problem(f"{name!r} must be a path (or a list of paths), got {value!r}.")
        resolved = [str((base or Path.cwd()) / Path(p).expanduser()) for p in paths]
        item[name] = resolved if isinstance(value, list) else resolved[0]
    return item


def call_overrides(record: dict[str, Any]) -> dict[str, Any]:
    """The call arguments a record sets (everything but its own fields)."""
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS}


def as_records(records: Sequence[Any]) -> Records:
    """``records`` as ``Records`` (a plain list of mappings is wrapped, as an inline list)."""
    return records if isinstance(records, Records) else ListRecords(list(records), "inline prompts")


def summarize_records(records: Sequence[Any]) -> RecordSummary:
    return as_records(records).summary


@dataclass
class RecordVerdicts:
    """The records that cannot be made: position -> (``file:line``, reason)."""

    rejected: dict[int, tuple[str, str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rejected)

    def report(self, most: int = REPORTED) -> str:
        """One refusal naming the first ``most`` records and counting the rest."""
        shown = [": ".join(self.rejected[p]) for p in sorted(self.rejected)[:most]]
        more = len(self.rejected) - len(shown)
        count = len(self.rejected)
        head = f"{count} prompt record{'s' if count > 1 else ''} cannot be made"
        tail = f"\n    ... and {more:,} more" if more else ""
        return (f"{head} (data.on_bad_record: skip makes the others and lists these in rejected.jsonl):\n    "
                + "\n    ".join(shown) + tail)

    def refusal(self, num_records: int, on_bad_record: str) -> list[str]:
        """Why these verdicts refuse the run: any bad record under ``data.on_bad_record: fail``;
        under ``skip``, only a set where every record is bad."""
        if self and on_bad_record != "skip":
            return [self.report()]
        if self.rejected and len(self.rejected) == num_records:
            return ["every prompt record is rejected: " + self.report()]
        return []

    def image_indices(self, num_images_per_prompt: int) -> list[int]:
        """The image indices of the rejected records."""
        return [p * num_images_per_prompt + c for p in sorted(self.rejected) for c in range(num_images_per_prompt)]


def check_records(info: Any, records: Sequence[Any], call_args: Optional[dict[str, Any]] = None,
                  inputs_root: Optional[str] = None, max_pixels: Optional[int] = None,
                  num_images_per_prompt: int = 1) -> RecordVerdicts:
    """Every record against the pipeline ``info`` describes: the lines rejected while reading, each
    distinct set of call arguments (``validation.call_arg_problems``, with the config's
    ``call_args`` under it), input fields the pipeline needs or cannot take, a negative prompt it
    cannot take, seeds that leave the generator's range, and input files (``inputs.file_problems``).
    Rejected sets leave the summary the strategies read. The outcome is kept on ``records`` (the
    launching process checks, then runs as rank 0 with the same records)."""
    records = as_records(records)
    max_pixels = max_pixels or validation.MAX_PIXELS
    key = json.dumps([info.path, info.class_name, call_args, inputs_root, max_pixels, num_images_per_prompt],
                     sort_keys=True, default=repr)
    if records.verdicts is not None and records._verdicts_key == key:
        return records.verdicts
    summary = records.summary
    reasons: dict[int, str] = {}
    for set_id, entry in enumerate(summary.sets):
        found = validation.call_arg_problems(info, entry.overrides, base=call_args, max_pixels=max_pixels, record=True)
        found += _field_problems(info, entry)
        if found:
            reasons[set_id] = " ".join(found)
    rejected = dict(records.bad)
    for position in summary.positions(list(reasons)):
        rejected[position] = (records.source(position), reasons[summary.set_of[position]])
    for position, seed in summary.large_seeds.items():
        if position not in rejected and seed + num_images_per_prompt - 1 > SEED_MAX:
            rejected[position] = (records.source(position), f"seed {seed} + {num_images_per_prompt - 1} (its last "
                                  "copy's) passes the generator's largest seed, 2**64 - 1.")
    with_inputs = [i for i, entry in enumerate(summary.sets) if entry.with_inputs]
    if with_inputs:
        found_files = file_problems(records, summary.positions(with_inputs), inputs_root, max_pixels)
        for position, problems in found_files.items():
            before = rejected.get(position, (records.source(position), ""))
            rejected[position] = (before[0], " ".join(filter(None, [before[1], *problems])))
    summary.rejected_sets = frozenset(reasons)
    records.verdicts, records._verdicts_key = RecordVerdicts(rejected), key
    return records.verdicts


_TASKS = {"image": " (image-to-image on FLUX.1 weights: model.pipeline_class: FluxImg2ImgPipeline)",
          "mask_image": " (inpainting on FLUX.1 weights: model.pipeline_class: FluxInpaintPipeline)"}


def _field_problems(info: Any, entry: CallArgSet) -> list[str]:
    """Input fields and a negative prompt that this pipeline (or these weights) cannot take or needs."""
    problems = []
    for name in entry.with_inputs:
        if name not in info.call_parameters:
            hint = _TASKS.get(name, "") if info.class_name == "FluxPipeline" else ""
            problems.append(f"it has {name}, which {info.class_name} does not take{hint}.")
    if info.spec.input_if_config is not None:  # an input these weights either need or cannot take
        name, key = info.spec.input_if_config
        needed = info.configs.get("transformer", {}).get(key) is not None
        if name in entry.with_inputs and not needed:
            problems.append(f"it has {name}, which these {info.class_name} weights cannot take (their transformer "
                            f"config sets no {key}).")
        if name in entry.without_inputs and needed:
            problems.append(f"it has no {name}, which these {info.class_name} weights need (their transformer config "
                            f"sets {key}).")
    for name in info.spec.inputs:
        if name in entry.without_inputs:
            problems.append(f"it has no {name}, which {info.class_name} needs (a path in the record: "
                            f"{{\"prompt\": ..., \"{name}\": \"in/0001.png\"}}).")
    if entry.first_negative is not None and "negative_prompt" not in info.call_parameters:
        problems.append(f"it has a negative_prompt, which {info.class_name} does not take.")
    return problems
