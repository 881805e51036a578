"""Prompt records: what a record may hold, and the records of a prompt set.

A record is a prompt and, optionally, its own ``seed``, ``negative_prompt``, input files
(``image``, ``mask_image``, ``last_image``) and the call arguments its pipeline lets a record set
(``PipelineSpec.record_args``: sizes, steps, guidance...), each typed and bounded by
``pipelines.checks.CALL_ARGS``. Anything else is refused, naming the keys a record may set.

Records are checked in two passes, both before any weight loads:

1. while a file is read (``formats.read_records``): JSON, a prompt, the seed's type and range, input paths,
   finite numbers; a line that fails is kept as a *rejected* position (its index stays its own, so
   the other records keep their image indices and seeds);
2. against the pipeline (``record_checks.check_records``): the allow-list, each value's type and bound, sizes,
   input files. Each distinct set of call arguments is checked once, and every record that has it
   shares its verdict; input files are checked record by record.

``RecordVerdicts`` holds the outcome: record position -> reason. ``data.on_bad_record: fail``
(the default) refuses the run naming up to ``REPORTED`` of them with ``file:line``;
``skip`` makes the others and lists these in the output folder's ``rejected.jsonl``.

Here: ``Records`` (the sequence every reader returns, with its ``RecordSummary``), an inline list
(``ListRecords``) and the check of one record. Where a prompt set comes from, one reader a format,
is ``formats`` (``.txt``, ``.jsonl``, ``.csv``) and ``tables`` (Parquet, datasets). ``Columns``
(``data.columns``, ``data.keep_columns``) turns a source's named fields into a record's, and sets
aside the columns an image's metadata carries.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_diffusion.core.checks import SEED_MAX, non_finite
from lightning_diffusion.core.errors import ConfigError, is_int
from lightning_diffusion.core.records import INPUT_FIELDS, RECORD_FIELDS, CallArgs, KeptColumns, Record
from lightning_diffusion.input.settings import MAX_PROMPT_CHARS
from lightning_diffusion.pipelines.adapters import choice, choice_key
from lightning_diffusion.pipelines.checks import CALL_ARGS

if TYPE_CHECKING:
    import numpy as np

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


def _json_ready(value: object) -> object:
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

    def shape(self, item: object) -> tuple[object, Optional[KeptColumns]]:
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

    def __init__(self, first: int, overrides: CallArgs, record: Mapping[str, Any]) -> None:
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
        # the set of adapters chosen (None: the default)
        self.adapters: Optional[Mapping[str, Optional[float]]] = record.get("adapters")

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
        self._ids: dict[tuple[object, tuple[bool, ...]], int] = {}  # (overrides, fields present) -> set
        self.rejected_sets: frozenset[int] = frozenset()  # sets the pipeline refuses (``check_records``)
        self.large_seeds: dict[int, int] = {}  # position -> seed, for seeds near the generator's limit

    @property
    def set_of(self) -> Sequence[int]:
        """Each record's set: an ``array`` of 4 bytes a record, or ``Same`` while all share one."""
        return self._set_of if self._set_of is not None else Same(self._same, self._count)

    def set_array(self) -> np.ndarray:
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

    def add(self, record: Record) -> None:
        # Records share a set when they set the same arguments and have the same fields, so that a
        # check of the set (an input the pipeline needs, a negative prompt it cannot take) is
        # every one of its records' verdict. (Set operations on the keys first: most records of a
        # large set have only a prompt and a seed.)
        overrides: CallArgs = {}
        if record.keys() <= _PLAIN_FIELDS:
            key: tuple[object, tuple[bool, ...]] = _PLAIN_KEY
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
            if record.get("adapters") is not None:  # records of one set of adapters share a set
                key = (key, choice_key(record["adapters"]))  # type: ignore[assignment]
        self._add(key, overrides, record, record.get("seed"))

    def add_plain(self, seed: Optional[int]) -> None:
        """``add`` for a record of a prompt and perhaps a seed, nothing else (checked)."""
        self._add(_PLAIN_KEY, {}, _NO_FIELDS, seed)

    def _add(self, key: tuple[object, tuple[bool, ...]], overrides: CallArgs, record: Mapping[str, Any],
             seed: Optional[int]) -> None:
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

    def override_sets(self) -> list[tuple[int, CallArgs]]:
        """Each distinct set of call-argument overrides (``{}`` included) of the records that run,
        with the number of the first record (from 1) that has it."""
        first: dict[str, tuple[int, CallArgs]] = {}
        for s in self._live():
            key = json.dumps(s.overrides, sort_keys=True, default=repr)
            if key not in first or s.first < first[key][0]:
                first[key] = (s.first, s.overrides)
        return sorted(first.values(), key=lambda item: item[0])

    def adapter_sets(self, live: bool = True) -> int:
        """How many sets of adapters the records that run (``live``; else every record read)
        choose (``model.adapters``; records without a choice are the default set); 0 where no record
        chooses."""
        sets = self._live() if live else self.sets
        if all(s.adapters is None for s in sets):
            return 0
        return len({choice_key(s.adapters) for s in sets})

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

    def _accept(self, position: int, item: object, constants: bool = True) -> Optional[Record]:
        """Check one parsed item; a bad one is kept as a rejected position (``constants``: it may
        hold a NaN or Infinity)."""
        try:
            record = _checked(item, self.base, constants, self.max_chars)
        except _Problem as problem:
            self._reject(position, str(problem))
            return None
        self.summary.add(record)
        return record

    def _accept_plain(self, position: int, item: object, constants: bool = True) -> None:
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

    def read(self, position: int) -> tuple[Record, Optional[KeptColumns]]:
        """The record at ``position`` and the columns its images' metadata carries
        (``data.keep_columns``; None when none is asked)."""
        return self[position], None

    def accepted(self) -> Iterator[tuple[int, Record]]:
        """(position, record) of every record not rejected while reading."""
        for position in range(len(self)):
            if position not in self.bad:
                yield position, self[position]


class ListRecords(Records):
    """Records held in memory: a ``.csv`` file's rows (with their line numbers) or an inline list."""

    def __init__(self, items: Sequence[object], where: str, lines: Optional[Sequence[int]] = None,
                 base: Optional[Path] = None, max_chars: int = MAX_PROMPT_CHARS, columns: Columns = Columns()) -> None:
        super().__init__(max_chars, columns)
        self.where = where
        self.lines = list(lines) if lines is not None else None
        self._base = base or Path.cwd()
        self.items: list[Optional[Record]] = []
        self.kept: Optional[list[Optional[KeptColumns]]] = [] if columns.keep else None
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

    def read(self, position: int) -> tuple[Record, Optional[KeptColumns]]:
        return self[position], self.kept[position] if self.kept is not None else None

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Records)) else NotImplemented


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


def check_record(item: object, where: str, base: Optional[Path] = None, constants: bool = True,
                 max_chars: int = MAX_PROMPT_CHARS) -> Record:
    """One record's fields, checked without the pipeline; returns it with its input paths resolved
    against ``base`` (the prompt file's folder). Raises ``PromptFileError`` naming ``where``.
    ``constants``: it may hold a NaN or Infinity (a JSON line that had none is not searched)."""
    try:
        return _checked(item, base, constants, max_chars)
    except _Problem as problem:
        raise PromptFileError(f"{where}: {problem}") from None


def _checked(item: object, base: Optional[Path], constants: bool, max_chars: int) -> Record:
    """``check_record``'s checks, once a record of the reading pass (kept lean: it runs for each of
    millions of records); raises ``_Problem``."""
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise _Problem("expected a JSON object with a 'prompt' field.")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt or prompt.isspace():
        raise _Problem("no 'prompt' (a non-empty string)." + ("" if "prompt" in item else _unknown_fields(item)))
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
    if item.get("adapters") is not None:
        try:
            item["adapters"] = choice(item["adapters"])
        except ValueError as err:
            raise _Problem(str(err)) from None
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


def _unknown_fields(item: Record) -> str:
    """`` It has 'promt' (did you mean 'prompt'?).``: the fields no record may hold, each with the
    closest one it may (for a refusal's message; the allow-list itself is ``check_records``')."""
    import difflib

    unknown = [str(key) for key in item if key not in COLUMN_FIELDS]
    named = [repr(key) + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
        key, COLUMN_FIELDS, n=1, cutoff=0.6)) else "") for key in unknown]
    return f" It has {', '.join(named)}, which no record may hold." if named else ""


def call_overrides(record: Record) -> CallArgs:
    """The call arguments a record sets (everything but its own fields)."""
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS}


def as_records(records: Sequence[object]) -> Records:
    """``records`` as ``Records`` (a plain list of mappings is wrapped, as an inline list)."""
    return records if isinstance(records, Records) else ListRecords(list(records), "inline prompts")


def summarize_records(records: Sequence[object]) -> RecordSummary:
    return as_records(records).summary


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


def _shown(names: Sequence[str], most: int = 12) -> str:
    more = f", ... ({len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


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
