"""Prompt records -> (index, seed) samples -> batches over the data-parallel dimension.

Every output image has a global index and its own seed:

* a prompt set of ``N`` records with ``num_images_per_prompt = K`` has images ``0 .. N*K-1``;
  image ``i`` belongs to record ``i // K`` and is that record's copy ``i % K``;
* its seed is ``record["seed"] + i % K`` when the record gives a seed, else ``seed + i`` where
  ``seed`` is the data module's global seed.

Noise is then drawn from a CPU ``torch.Generator`` seeded with that number, one per image, so image
``i`` does not depend on the batch size, the number of processes or the strategy.
"""

from __future__ import annotations

from lightning_diffusion.errors import ConfigError, check_int, is_int, raise_problems
from lightning_diffusion.preemption import STOP

import csv
import json
import os
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# Input files a record may carry (a path, or a list of paths for pipelines that take several);
# relative paths resolve against the prompt file's folder.
INPUT_FIELDS = ("image", "mask_image", "last_image")
# Record fields that are not pipeline-call overrides.
_RECORD_FIELDS = ("prompt", "seed", "negative_prompt", *INPUT_FIELDS)
_SUFFIXES = (".txt", ".jsonl", ".csv")


class PromptFileError(ConfigError):
    """A prompt file or inline prompt list that cannot be used; the message names file and line."""


_READ: dict[tuple, Sequence[dict[str, Any]]] = {}


class RecordSummary:
    """What the checks before loading need from every record, gathered in one pass.

    A ``LineRecords`` file is summarised while it is first scanned, so the checks (pipeline
    arguments, negative prompts for CFG parallel, sequence lengths for context parallelism) cost
    nothing more for a file of millions of lines; other record lists are walked once per call.
    """

    KEEP = 5  # record numbers kept for messages

    def __init__(self) -> None:
        self.count = 0
        self._overrides: dict[str, tuple[int, dict[str, Any]]] = {}
        self.without_negative = 0
        self.first_without_negative: list[int] = []
        self.first_negative: Optional[int] = None
        self.with_inputs: dict[str, int] = {}  # input field -> first record (from 1) that has it
        self.without_inputs: dict[str, int] = {}  # input field -> first record that lacks it

    def add(self, record: dict[str, Any]) -> None:
        self.count += 1
        overrides = {k: v for k, v in record.items() if k not in _RECORD_FIELDS}
        key = json.dumps(overrides, sort_keys=True, default=repr) if overrides else ""
        if key not in self._overrides:
            self._overrides[key] = (self.count, overrides)
        if record.get("negative_prompt") is None:
            self.without_negative += 1
            if len(self.first_without_negative) < self.KEEP:
                self.first_without_negative.append(self.count)
        elif self.first_negative is None:
            self.first_negative = self.count
        for name in INPUT_FIELDS:
            found = self.with_inputs if record.get(name) is not None else self.without_inputs
            found.setdefault(name, self.count)

    def override_sets(self) -> list[tuple[int, dict[str, Any]]]:
        """Each distinct set of pipeline-argument overrides (``{}`` included) with the number of
        the first record (from 1) that has it."""
        return sorted(self._overrides.values(), key=lambda item: item[0])


def summarize_records(records: Sequence[dict[str, Any]]) -> RecordSummary:
    summary = getattr(records, "summary", None)
    if summary is None:
        summary = RecordSummary()
        for record in records:
            summary.add(record)
    return summary


def load_records(prompts: Union[str, Sequence[Any]]) -> Sequence[dict[str, Any]]:
    """Read prompt records from a ``.txt``/``.jsonl``/``.csv`` path or an inline list.

    Inline lists may hold strings or mappings with the same fields as a ``.jsonl`` line. ``.txt``
    and ``.jsonl`` files are checked line by line once and then read lazily (``LineRecords``), so a
    file of millions of prompts costs 8 bytes a line in memory, not the records themselves.
    """
    if isinstance(prompts, (str, Path)):
        path = Path(prompts).expanduser()
        if not path.exists():
            raise PromptFileError(f"Prompt file {str(path)!r} does not exist.")
        if not path.is_file():
            raise PromptFileError(f"Prompt file {str(path)!r} is not a file.")
        suffix = path.suffix.lower()
        if suffix not in _SUFFIXES:
            raise PromptFileError(
                f"Prompt file {str(path)!r} has suffix {suffix!r}; use one of {', '.join(_SUFFIXES)}."
            )
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in _READ:
            _READ.clear()  # keep one file's index at most
            _READ[key] = _read_csv(path) if suffix == ".csv" else LineRecords(path)
        records: Sequence[dict[str, Any]] = _READ[key]
        where = str(path)
    else:
        records = [_check_record(item, "inline prompts", n + 1) for n, item in enumerate(prompts)]
        where = "the inline prompt list"
    if not len(records):
        raise PromptFileError(f"No prompts found in {where}.")
    return records


class LineRecords(Sequence):
    """Records of a ``.txt`` or ``.jsonl`` file: every line checked once at start, then read on
    demand through an index of byte offsets (an ``array`` of 8 bytes a record)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.jsonl = path.suffix.lower() == ".jsonl"
        self.offsets = array("q")
        self._file: Optional[Any] = None
        self._pid: Optional[int] = None
        self.summary = RecordSummary()
        with path.open("rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    # Syntax errors surface now, with file and line; the checks read the summary.
                    self.summary.add(self._parse(raw, lineno))
                    self.offsets.append(offset)
                offset += len(raw)

    def _parse(self, raw: bytes, lineno: int) -> dict[str, Any]:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PromptFileError(f"{self.path}:{lineno}: not valid UTF-8.") from None
        if not self.jsonl:
            return {"prompt": line.strip()}
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{self.path}:{lineno}: not valid JSON ({err.msg}).") from None
        return _check_record(item, str(self.path), lineno)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, position):  # type: ignore[override]
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        if self._file is None or self._pid != os.getpid():  # one handle per process (DataLoader workers)
            self._file, self._pid = self.path.open("rb"), os.getpid()
        self._file.seek(self.offsets[position])
        return self._parse(self._file.readline(), position + 1)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": None}


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "prompt" not in reader.fieldnames:
            raise PromptFileError(f"{path}:1: the CSV header has no 'prompt' column.")
        records = []
        for lineno, row in enumerate(reader, start=2):
            row = {k: v for k, v in row.items() if k is not None and v not in (None, "")}
            if "seed" in row:
                try:
                    row["seed"] = int(row["seed"])
                except ValueError:
                    raise PromptFileError(f"{path}:{lineno}: seed {row['seed']!r} is not an integer.") from None
            records.append(_check_record(row, str(path), lineno))
        return records


def _check_record(item: Any, where: str, lineno: int) -> dict[str, Any]:
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict):
        raise PromptFileError(f"{where}:{lineno}: expected a JSON object with a 'prompt' field.")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptFileError(f"{where}:{lineno}: no 'prompt' (a non-empty string).")
    seed = item.get("seed")
    if seed is not None and not is_int(seed, 0):
        raise PromptFileError(f"{where}:{lineno}: 'seed' must be a non-negative integer, got {seed!r}.")
    negative = item.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise PromptFileError(f"{where}:{lineno}: 'negative_prompt' must be a string.")
    item = dict(item)
    for name in INPUT_FIELDS:
        value = item.get(name)
        if value is None:
            continue
        paths = value if isinstance(value, list) else [value]
        if not paths or not all(isinstance(p, str) and p.strip() for p in paths):
            raise PromptFileError(f"{where}:{lineno}: {name!r} must be a path (or a list of paths), got {value!r}.")
        # relative to the prompt file's folder (the working directory for an inline list)
        base = Path(where).resolve().parent if Path(where).suffix.lower() in _SUFFIXES else Path.cwd()
        resolved = [str((base / Path(p).expanduser())) for p in paths]
        item[name] = resolved if isinstance(value, list) else resolved[0]
    return item


def record_inputs(record: dict[str, Any]) -> dict[str, Any]:
    """The record's input files by field (``image``: a path or a list of paths)."""
    return {name: record[name] for name in INPUT_FIELDS if record.get(name) is not None}


def image_seed(record: dict[str, Any], index: int, copy: int, global_seed: int) -> int:
    """The documented seed of image ``index`` (copy ``copy`` of ``record``)."""
    if record.get("seed") is not None:
        return int(record["seed"]) + copy
    return global_seed + index


class PromptDataset(Dataset):
    """Samples ``{"index", "prompt", "seed", "negative_prompt", "overrides"}``, one per output image,
    and ``inputs`` (``{"image": path, ...}``) for records with input files.

    ``indices`` restricts the dataset to those global image indices (resume skips finished ones).
    """

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        seed: int = 0,
        num_images_per_prompt: int = 1,
        indices: Optional[Sequence[int]] = None,
    ) -> None:
        self.records = records
        self.seed = seed
        self.num_images_per_prompt = num_images_per_prompt
        self.total = len(records) * num_images_per_prompt
        self.indices = np.arange(self.total, dtype=np.int64) if indices is None else np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> dict[str, Any]:
        index = int(self.indices[position])
        record = self.records[index // self.num_images_per_prompt]
        copy = index % self.num_images_per_prompt
        return {
            "index": index,
            "prompt": record["prompt"],
            "seed": image_seed(record, index, copy, self.seed),
            "negative_prompt": record.get("negative_prompt"),
            "overrides": {k: v for k, v in record.items() if k not in _RECORD_FIELDS},
            **({"inputs": inputs} if (inputs := record_inputs(record)) else {}),
        }


class ShardSampler(DistributedSampler):
    """Positions ``rank, rank + num_replicas, ...``: no duplicate, no drop, and a replica with nothing
    to do gets an empty shard (Lightning's own predict sampler asserts instead)."""

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(rank, len(dataset), num_replicas))  # type: ignore[arg-type]
        self.total_size = len(dataset)  # type: ignore[arg-type]
    def __iter__(self) -> Iterator[int]:
        for position in range(self.rank, self.total_size, self.num_replicas):
            if STOP.stopping.is_set():  # a stopped job ends the loader instead of skipping every batch
                return
            yield position

    def __len__(self) -> int:
        return self.num_samples


def collate_samples(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return samples


def check_data_args(batch_size: Any, seed: Any, num_images_per_prompt: Any, num_shards: Any = 1,
                    shard_index: Any = 0, num_images: Optional[int] = None) -> list[str]:
    problems = []
    for name, value in (("batch_size", batch_size), ("num_images_per_prompt", num_images_per_prompt),
                        ("num_shards", num_shards)):
        problems += filter(None, [check_int(value, f"data.{name}")])
    if not is_int(seed, 0):
        problems.append(f"data.seed must be a non-negative integer, got {seed!r}.")
    if is_int(num_shards, 1) and not (is_int(shard_index, 0) and shard_index < num_shards):
        problems.append(f"data.shard_index must be an integer from 0 to data.num_shards - 1 = {num_shards - 1}, "
                        f"got {shard_index!r}.")
    if is_int(num_shards, 1) and num_images is not None and num_shards > num_images:
        problems.append(f"data.num_shards {num_shards} exceeds the {num_images} images of the prompt set: shards "
                        f"{num_images} to {num_shards - 1} would have nothing to make. Use at most {num_images} shards.")
    return problems


def shard_indices(total: int, num_shards: int, shard_index: int) -> np.ndarray:
    """The images of shard ``shard_index`` of ``num_shards``: every index ``i`` with
    ``i % num_shards == shard_index``. An image keeps its index, seed and file name whatever the
    shard count, and the shards of a count share no image."""
    return np.arange(shard_index, total, num_shards, dtype=np.int64)


class PromptDataModule(pl.LightningDataModule):
    """Prompts for ``Trainer.predict``.

    Args:
        prompts: a ``.txt`` (one prompt a line), ``.jsonl`` (field ``prompt``; optional ``seed``,
            ``negative_prompt`` and per-record pipeline arguments such as ``guidance_scale``),
            ``.csv`` (a ``prompt`` column) path, or an inline list of prompts.
        batch_size: images per pipeline call on each data-parallel replica.
        seed: global seed; image ``i`` of a record without a seed uses ``seed + i``.
        num_images_per_prompt: images made from each record.
        num_workers: DataLoader workers (prompts are tiny; 0 is usually right).
        inputs_root: records' input files (``image``, ``mask_image``...) must lie under this folder
            once links and ``..`` are resolved (for prompt files from elsewhere).
        num_shards, shard_index: make only shard ``shard_index`` of ``num_shards`` of the prompt
            set (the images ``i`` with ``i % num_shards == shard_index``): the tasks of a SLURM job
            array, each its own shard, writing into one output folder.
    """

    def __init__(
        self,
        prompts: Union[str, list[Any]],
        batch_size: int = 1,
        seed: int = 0,
        num_images_per_prompt: int = 1,
        num_workers: int = 0,
        inputs_root: Optional[str] = None,
        num_shards: int = 1,
        shard_index: int = 0,
    ) -> None:
        super().__init__()
        raise_problems(check_data_args(batch_size, seed, num_images_per_prompt, num_shards, shard_index))
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed
        self.num_images_per_prompt = num_images_per_prompt
        self.num_workers = num_workers
        self.inputs_root = inputs_root
        self.num_shards = num_shards
        self.shard_index = shard_index
        # Read now so that a bad prompt file fails before any process starts or weights load.
        self.records = load_records(prompts)
        raise_problems(check_data_args(batch_size, seed, num_images_per_prompt, num_shards, shard_index,
                                       self.num_images))
        self.skip: set[int] = set()
        # More replicas than images is fine: the idle ones wait.
        self.allow_zero_length_dataloader_with_multiple_devices = True

    @property
    def num_images(self) -> int:
        return len(self.records) * self.num_images_per_prompt

    @property
    def shard(self) -> Optional[tuple[int, int]]:
        """``(shard_index, num_shards)`` when this run makes one shard of the prompt set, else None."""
        return (self.shard_index, self.num_shards) if self.num_shards > 1 else None

    def shard_images(self) -> np.ndarray:
        """The indices this run is for: every image, or its shard's."""
        return shard_indices(self.num_images, self.num_shards, self.shard_index)

    def skip_indices(self, indices: set[int]) -> None:
        """Leave out images that are already done (called by the writer on resume, before the split)."""
        self.skip = set(indices)

    def predict_dataloader(self) -> DataLoader:
        todo = np.zeros(self.num_images, dtype=bool)
        todo[self.shard_images()] = True
        if self.skip:
            todo[np.fromiter(self.skip, dtype=np.int64, count=len(self.skip))] = False
        pending = np.flatnonzero(todo)
        dataset = PromptDataset(self.records, self.seed, self.num_images_per_prompt, pending)
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        kwargs = kwargs or {"num_replicas": 1, "rank": 0}
        sampler = ShardSampler(dataset, num_replicas=kwargs["num_replicas"], rank=kwargs["rank"])
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=collate_samples,
        )
