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
"""

from __future__ import annotations

import csv
import json
import os
from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_diffusion import validation
from lightning_diffusion.errors import ConfigError, is_int
from lightning_diffusion.inputs import INPUT_FIELDS, file_problems
from lightning_diffusion.validation import MAX_PROMPT_CHARS, SEED_MAX, non_finite

# Fields of a record that are not pipeline-call arguments.
RECORD_FIELDS = ("prompt", "seed", "negative_prompt", *INPUT_FIELDS)
SUFFIXES = (".txt", ".jsonl", ".csv")
REPORTED = 20  # bad records named in a refusal; the rest are counted
BAD_SET = 0xFFFFFFFF  # the call-argument set of a line rejected while reading
_PRESENCE = ("negative_prompt", *INPUT_FIELDS)


class PromptFileError(ConfigError):
    """A prompt file or inline prompt list that cannot be used; the message names file and line."""


class CallArgSet:
    """One distinct set of call arguments given by records, and what the checks need of the
    records that share it (counted while the file is read, so nothing is read twice)."""

    KEEP = 5  # record numbers kept for messages

    def __init__(self, first: int, overrides: dict[str, Any]) -> None:
        self.first = first          # the first record (from 1) that has it
        self.overrides = overrides
        self.count = 0
        self.without_negative = 0
        self.first_without_negative: list[int] = []
        self.first_negative: Optional[int] = None
        self.with_inputs: dict[str, int] = {}     # input field -> first record (from 1) that has it
        self.without_inputs: dict[str, int] = {}  # input field -> first record that lacks it

    def add(self, number: int, record: dict[str, Any]) -> None:
        self.count += 1
        if record.get("negative_prompt") is None:
            self.without_negative += 1
            if len(self.first_without_negative) < self.KEEP:
                self.first_without_negative.append(number)
        elif self.first_negative is None:
            self.first_negative = number
        for name in INPUT_FIELDS:
            found = self.with_inputs if record.get(name) is not None else self.without_inputs
            found.setdefault(name, number)


class RecordSummary:
    """Every record's call-argument set (4 bytes a record), and the sets themselves.

    ``override_sets``, ``without_negative``... describe the records that are not rejected: the
    checks of the strategies (CFG branches, token splits) look at what will run.
    """

    def __init__(self) -> None:
        self.set_of = array("I")  # record position -> index into ``sets`` (BAD_SET: rejected while read)
        self.sets: list[CallArgSet] = []
        self._ids: dict[Any, int] = {}
        self.rejected_sets: frozenset[int] = frozenset()  # sets the pipeline refuses (``check_records``)
        self.large_seeds: dict[int, int] = {}  # position -> seed, for seeds near the generator's limit

    def add(self, record: dict[str, Any]) -> None:
        number = len(self.set_of) + 1
        overrides = {k: v for k, v in record.items() if k not in RECORD_FIELDS}
        # Records share a set when they set the same arguments and have the same fields, so that a
        # check of the set (an input the pipeline needs, a negative prompt it cannot take) is
        # every one of its records' verdict.
        fields = tuple(record.get(name) is not None for name in _PRESENCE)
        try:
            key: Any = (tuple(sorted(overrides.items())), fields)
            hash(key)
        except TypeError:  # a list or mapping among the values
            key = (json.dumps(overrides, sort_keys=True, default=repr), fields)
        set_id = self._ids.get(key)
        if set_id is None:
            set_id = self._ids[key] = len(self.sets)
            self.sets.append(CallArgSet(number, overrides))
        self.sets[set_id].add(number, record)
        self.set_of.append(set_id)
        seed = record.get("seed")
        if seed is not None and seed > SEED_MAX // 2:
            self.large_seeds[number - 1] = seed

    def add_bad(self) -> None:
        self.set_of.append(BAD_SET)

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

    def __init__(self, max_chars: int = MAX_PROMPT_CHARS) -> None:
        self.max_chars = max_chars
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
            record = check_record(item, self.source(position), self.base, constants, self.max_chars)
        except PromptFileError as err:
            self._reject(position, err)
            return None
        self.summary.add(record)
        return record

    def _reject(self, position: int, err: PromptFileError) -> None:
        source = self.source(position)
        self.bad[position] = (source, str(err).removeprefix(f"{source}: "))
        self.summary.add_bad()

    @property
    def base(self) -> Path:
        return Path.cwd()

    def accepted(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(position, record) of every record not rejected while reading."""
        for position in range(len(self)):
            if position not in self.bad:
                yield position, self[position]


class LineRecords(Records):
    """Records of a ``.txt`` or ``.jsonl`` file: every line checked once at start, then read on
    demand through an index of byte offsets (an ``array`` of 8 bytes a record)."""

    def __init__(self, path: Path, max_chars: int = MAX_PROMPT_CHARS) -> None:
        super().__init__(max_chars)
        self.path = path
        self.where = str(path)
        self.jsonl = path.suffix.lower() == ".jsonl"
        self.offsets = array("q")
        self.blanks = array("q")  # for each blank line: the records before it (for line numbers)
        self._file: Optional[Any] = None
        self._pid: Optional[int] = None
        self._base = path.resolve().parent
        with path.open("rb") as f:
            offset = 0
            for raw in f:
                if raw.strip():
                    position = len(self.offsets)
                    self.offsets.append(offset)
                    try:
                        item, constants = self._parse(raw, position)
                    except PromptFileError as err:
                        self._reject(position, err)
                    else:
                        self._accept(position, item, constants)
                else:
                    self.blanks.append(len(self.offsets))
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
        try:
            item = _DECODER.decode(line)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{self.source(position)}: not valid JSON ({err.msg}).") from None
        finally:
            constants, _CONSTANTS[:] = bool(_CONSTANTS), []
        return item, constants

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        if self._file is None or self._pid != os.getpid():  # one handle per process (DataLoader workers)
            self._file, self._pid = self.path.open("rb"), os.getpid()
        self._file.seek(self.offsets[position])
        item, constants = self._parse(self._file.readline(), position)
        return check_record(item, self.source(position), self._base, constants, self.max_chars)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": None}


class ListRecords(Records):
    """Records held in memory: a ``.csv`` file's rows (with their line numbers) or an inline list."""

    def __init__(self, items: Sequence[Any], where: str, lines: Optional[Sequence[int]] = None,
                 base: Optional[Path] = None, max_chars: int = MAX_PROMPT_CHARS) -> None:
        super().__init__(max_chars)
        self.where = where
        self.lines = list(lines) if lines is not None else None
        self._base = base or Path.cwd()
        self.items: list[Optional[dict[str, Any]]] = []
        for position, item in enumerate(items):
            self.items.append(self._accept(position, item))

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

    def __eq__(self, other: Any) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Records)) else NotImplemented


_READ: dict[tuple, Records] = {}


def read_records(prompts: Union[str, os.PathLike, Sequence[Any]], max_chars: int = MAX_PROMPT_CHARS) -> Records:
    """Read prompt records from a ``.txt``/``.jsonl``/``.csv`` path or an inline list (strings, or
    mappings with the fields of a ``.jsonl`` line). Problems of the file itself (missing, of
    another kind, without a record) raise ``PromptFileError``; problems of single lines are kept
    in ``records.bad``. ``.txt`` and ``.jsonl`` files are read lazily after one checking pass
    (``LineRecords``): a file of millions of prompts costs 8 bytes a line in memory, plus 4 for
    its call-argument set."""
    if isinstance(prompts, (str, os.PathLike)):
        path = Path(prompts).expanduser()
        if not path.exists():
            raise PromptFileError(f"Prompt file {str(path)!r} does not exist.")
        if not path.is_file():
            raise PromptFileError(f"Prompt file {str(path)!r} is not a file.")
        suffix = path.suffix.lower()
        if suffix not in SUFFIXES:
            raise PromptFileError(f"Prompt file {str(path)!r} has suffix {suffix!r}; use one of {', '.join(SUFFIXES)}.")
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, max_chars)
        if key not in _READ:
            _READ.clear()  # keep one file's index at most
            _READ[key] = _read_csv(path, max_chars) if suffix == ".csv" else LineRecords(path, max_chars)
        records = _READ[key]
        where = str(path)
    else:
        records = ListRecords(list(prompts), "inline prompts", max_chars=max_chars)
        where = "the inline prompt list"
    if not len(records):
        raise PromptFileError(f"No prompts found in {where}.")
    return records


def _read_csv(path: Path, max_chars: int = MAX_PROMPT_CHARS) -> ListRecords:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "prompt" not in reader.fieldnames:
            raise PromptFileError(f"{path}:1: the CSV header has no 'prompt' column.")
        rows, lines = [], []
        for row in reader:
            row = {k: v for k, v in row.items() if k is not None and v not in (None, "")}
            if "seed" in row:
                try:
                    row["seed"] = int(row["seed"])
                except ValueError:
                    pass  # refused by check_record, with its line
            rows.append(row)
            lines.append(reader.line_num)
    return ListRecords(rows, str(path), lines, path.resolve().parent, max_chars)


_CONSTANTS: list[str] = []  # NaN / Infinity seen by the decoder since the last look


def _non_finite_constant(name: str) -> float:
    """JSON has no NaN or Infinity, but Python's json reads them: noted, so that only a line that
    has one is searched for it (``check_record`` refuses it)."""
    _CONSTANTS.append(name)
    return float(name.replace("Infinity", "inf"))


_DECODER = json.JSONDecoder(parse_constant=_non_finite_constant)


def check_record(item: Any, where: str, base: Optional[Path] = None, constants: bool = True,
                 max_chars: int = MAX_PROMPT_CHARS) -> dict[str, Any]:
    """One record's fields, checked without the pipeline; returns it with its input paths resolved
    against ``base`` (the prompt file's folder). Raises ``PromptFileError`` naming ``where``.
    ``constants``: it may hold a NaN or Infinity (a JSON line that had none is not searched)."""
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise PromptFileError(f"{where}: expected a JSON object with a 'prompt' field.")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptFileError(f"{where}: no 'prompt' (a non-empty string).")
    seed = item.get("seed")
    if seed is not None and not (is_int(seed, 0) and seed <= SEED_MAX):
        raise PromptFileError(f"{where}: 'seed' must be an integer from 0 to 2**64 - 1, got {seed!r}.")
    negative = item.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise PromptFileError(f"{where}: 'negative_prompt' must be a string.")
    for name, text in (("prompt", prompt), ("negative_prompt", negative)):
        if text is not None and len(text) > max_chars:
            raise PromptFileError(f"{where}: {name!r} has {len(text):,} characters, over data.max_prompt_chars "
                                  f"{max_chars:,} (raise it if you mean it).")
    places = non_finite(item) if constants else []
    if places:
        raise PromptFileError(f"{where}: {', '.join(places)} is not a finite number (NaN and Infinity are refused).")
    item = dict(item)
    for name in INPUT_FIELDS:
        value = item.get(name)
        if value is None:
            continue
        paths = value if isinstance(value, list) else [value]
        if not paths or not all(isinstance(p, str) and p.strip() for p in paths):
            raise PromptFileError(f"{where}: {name!r} must be a path (or a list of paths), got {value!r}.")
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
