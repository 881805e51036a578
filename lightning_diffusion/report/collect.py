"""What a run recorded, for the report page: every output that counts (``recorded.finished``'s
verdicts, the same as ``status`` and a resume), the records that failed or were rejected with their
reasons, the lines that did not count, and the runs' histories (``run.json``, a job array's
``run.shard-T-of-N.json``).

Reads every layout the writer makes: loose files (flat or in numbered subfolders), webdataset tar
shards, and a bucket (``s3://...``), whose records ``OutputStore.local_records`` downloads into a
temporary folder for the ``with`` block of ``opened``. Reads only: safe while a run writes.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import numpy as np

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import FailureLine, JsonObject, RejectedLine, RunSettings, RunSummary
from lightning_diffusion.output.manifest import FAILED, FAILURES_GLOB, MANIFEST, PART_GLOB, REJECTED, RUN_FILE
from lightning_diffusion.output.recorded import finished
from lightning_diffusion.output.store import open_store

if TYPE_CHECKING:
    from lightning_diffusion.output.settings import StorageOptions

# Keys of a manifest line the page shows in their own places (the rest: the call's parameters).
_OWN_KEYS = {"index", "prompt", "seed", "file", "member", "bytes", "shard_bytes", "written", "claim", "height",
             "width", "num_frames", "fps", "model", "negative_prompt", "columns", "sha256", "md5", "crc32"}
_SHARD_RECORD = re.compile(r"run\.shard-(\d+)-of-(\d+)\.json")
VIDEO_SUFFIXES = (".mp4", ".webm", ".gif")


@dataclass(slots=True)
class Record:
    """One output that counts, as the page shows it (kept small: a million of them fit in memory)."""

    index: int
    prompt: str
    seed: Optional[int]
    file: str  # relative to the records' folder (a tar shard for ``member``)
    member: Optional[str]
    size: int  # bytes recorded: the file's, or the tar member's
    written: Optional[float]  # when its line was written (unix seconds)
    worker: str  # the manifest part that wrote it, or the stretch of the merged manifest (``_stretches``)
    shape: str  # "64x64", "9 frames of 32x32"
    details: str  # the call's other parameters, "key=value · key=value"

    @property
    def name(self) -> str:
        return self.member or self.file

    @property
    def is_video(self) -> bool:
        return self.name.lower().endswith(VIDEO_SUFFIXES)


@dataclass
class Collected:
    where: str  # the output as given (a folder or a URL)
    folder: Path  # the local folder the records are read from (a bucket's: downloaded)
    records: list[Record]
    failed: list[FailureLine]  # failed.jsonl's lines of images not made since
    rejected: list[RejectedLine]  # rejected.jsonl's lines
    not_counted: list[str]  # manifest lines that do not count, "file:line: why"
    run: JsonObject  # run.json as read: its settings, ``expected`` and ``history``
    histories: dict[str, list[RunSummary]] = field(default_factory=dict)  # "run.json", "shard 0 of 4" -> runs
    running: bool = False  # a run holds the output's lock now
    is_bucket: bool = False

    @property
    def expected(self) -> Optional[int]:
        value = self.run.get("expected")
        return int(value) if isinstance(value, (int, float)) else None

    @property
    def settings(self) -> RunSettings:
        return {key: value for key, value in self.run.items() if key not in ("history", "expected")}


def _interned(cache: dict[str, str], text: str) -> str:
    return cache.setdefault(text, text)


def _shape(line: Mapping[str, Any]) -> str:
    size = f"{line['width']}x{line['height']}" if "width" in line and "height" in line else ""
    if line.get("num_frames"):
        return f"{line['num_frames']} frames of {size}" if size else f"{line['num_frames']} frames"
    return size


def _details(line: Mapping[str, Any]) -> str:
    parts = [f"{key}={_adapters(value) if key in ('adapters', 'lora') else value}" for key, value in line.items()
             if key not in _OWN_KEYS]
    if line.get("negative_prompt"):
        parts.append(f"negative_prompt={line['negative_prompt']}")
    return " · ".join(parts)


def _adapters(value: object) -> object:
    """An image's adapters as ``style x 0.8, subject x 1``: names (files for ``model.lora``) and
    scales, not their hashes."""
    if not isinstance(value, list) or not all(isinstance(a, dict) for a in value):
        return value
    return ", ".join(f"{a.get('name') or a.get('file')} x {a.get('scale', 1):g}" for a in value) or "none"


def _part_worker(name: str) -> str:
    """``manifest.shard-1-of-4.part-0.jsonl`` -> ``shard-1-of-4.part-0``."""
    return name.removeprefix("manifest.").removesuffix(".jsonl")


def read_records(folder: Path) -> tuple[list[Record], list[str]]:
    """The outputs of ``folder`` that count (each index once, its last line) and the lines that
    do not. The merged manifest's lines carry no writer: its stretches of rising times are told
    apart (``stretch N``: a merge appends part after part, each in the order it was written); a live
    run's parts are named by their file (``part-R``)."""
    found = finished(folder)
    counts = np.zeros(int(found.indices.max()) + 1 if len(found.indices) else 0, dtype=bool)
    counts[found.indices] = True
    kept: dict[int, Record] = {}
    texts: dict[str, str] = {}
    for file in [folder / MANIFEST, *sorted(folder.glob(PART_GLOB))]:
        if not file.is_file():
            continue
        stretch, last = 1, None
        with file.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    continue
                try:
                    line = json.loads(raw)
                    index = int(line["index"])
                except (ValueError, KeyError, TypeError):
                    continue
                if index >= len(counts) or not counts[index]:
                    continue
                written = line.get("written")
                written = float(written) if isinstance(written, (int, float)) else None
                if file.name == MANIFEST:
                    if written is not None and last is not None and written < last - 1.0:
                        stretch += 1  # the times went back: the next part merged
                    last = written if written is not None else last
                    worker = f"stretch {stretch}"
                else:
                    worker = _part_worker(file.name)
                member = line.get("member") or None
                size = line.get("bytes")
                kept[index] = Record(
                    index=index, prompt=_interned(texts, str(line.get("prompt", ""))),
                    seed=line.get("seed") if isinstance(line.get("seed"), int) else None,
                    file=str(line.get("file", "")), member=member,
                    size=int(size) if isinstance(size, int) else 0, written=written,
                    worker=_interned(texts, worker), shape=_interned(texts, _shape(line)),
                    details=_interned(texts, _details(line)))
    return [kept[index] for index in sorted(kept)], found.problems


def _json_lines(blob: bytes) -> list[Any]:
    """The whole JSON object lines of a record file (failure or rejected lines: the caller knows which)."""
    lines = []
    for raw in blob.splitlines():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict):
            lines.append(entry)
    return lines


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _folder_side(folder: Path) -> tuple[JsonObject, dict[str, list[RunSummary]], list[FailureLine],
                                        list[RejectedLine]]:
    """run.json, the histories, failed and rejected lines of an output folder."""
    try:
        run = json.loads((folder / RUN_FILE).read_text()) if (folder / RUN_FILE).is_file() else {}
    except ValueError:
        raise ConfigError(f"{folder / RUN_FILE} is not valid JSON.") from None
    histories = {RUN_FILE: list(run.get("history") or [])}
    for record in sorted(folder.glob("run.shard-*-of-*.json")):
        matched = _SHARD_RECORD.fullmatch(record.name)
        if matched:
            with contextlib.suppress(OSError, ValueError):
                histories[f"shard {matched.group(1)} of {matched.group(2)}"] = list(
                    json.loads(record.read_text()).get("history") or [])
    failed = _json_lines(_read(folder / FAILED))
    for part in sorted(folder.glob(FAILURES_GLOB)):
        failed += _json_lines(_read(part))
    return run, histories, failed, _json_lines(_read(folder / REJECTED))


def is_output_folder(folder: Path) -> bool:
    return folder.is_dir() and ((folder / RUN_FILE).is_file() or (folder / MANIFEST).is_file()
                                or any(folder.glob(PART_GLOB)))


@contextlib.contextmanager
def opened(where: str, options: Optional[StorageOptions] = None) -> Iterator[Collected]:
    """The records of output ``where`` (a folder or a bucket URL) for the ``with`` block. Raises
    ``ConfigError`` (one line) where it is not an output of lightning-diffusion."""
    store = open_store(where, options=options)
    if not store.is_folder:  # a bucket: its records through the store
        with _bucket(store, where) as collected:
            yield collected
        return
    folder = Path(where)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder.")
    if not is_output_folder(folder):
        raise ConfigError(f"{folder} is not an output folder of lightning-diffusion: it has no {RUN_FILE} and no "
                          f"{MANIFEST}.")
    run, histories, failed, rejected = _folder_side(folder)
    records, problems = read_records(folder)
    made = {record.index for record in records}
    yield Collected(where=str(where), folder=folder, records=records,
                    failed=[line for line in failed if line.get("index") not in made], rejected=rejected,
                    not_counted=problems, run=run, histories=histories, running=bool(store.live_locks()))


@contextlib.contextmanager
def _bucket(store: Any, where: str) -> Iterator[Collected]:
    try:
        run = store.read_json(RUN_FILE)
    except Exception as err:  # unreachable: the store's own words
        problems = store.read_problems("output")
        raise ConfigError(problems[0] if problems else f"{where}: {err}") from None
    if run is None:
        raise ConfigError(f"{where} is not an output of lightning-diffusion: it has no {RUN_FILE}.")
    names = store.storage.names()
    histories = {RUN_FILE: list(run.get("history") or [])}
    for name in sorted(names):
        matched = _SHARD_RECORD.fullmatch(name)
        if matched:
            histories[f"shard {matched.group(1)} of {matched.group(2)}"] = list(
                (store.read_json(name) or {}).get("history") or [])
    rejected = _json_lines(store.storage.read(REJECTED)) if REJECTED in names else []
    failed = store.failed_now()
    running = bool(store.live_locks())
    try:
        with store.local_records("output") as folder:
            records, problems = read_records(Path(folder))
            made = {record.index for record in records}
            yield Collected(where=str(where), folder=Path(folder), records=records,
                            failed=[line for line in failed if line.get("index") not in made], rejected=rejected,
                            not_counted=problems, run=run, histories=histories, running=running, is_bucket=True)
    finally:
        store.release()


def devices_of(run: RunSummary) -> int:
    """The devices a run held: its recorded ``world_size`` (or ``devices``) where the writer
    records one, else its writing ranks (a context- or tensor-parallel group writes from one rank:
    pass ``--devices`` to the command for such runs)."""
    for key in ("world_size", "devices"):
        value = run.get(key)
        if isinstance(value, int) and value > 0:
            return value
    ranks = run.get("busy_s_by_rank") or run.get("images_per_s_by_rank") or {}
    return max(1, len(ranks))


def env_of(run: Mapping[str, Any]) -> dict[str, object]:
    """What a history entry records of where it ran (not what it made)."""
    keys = ("slurm_job", "shard", "world_size", "devices", "host", "versions", "device_names")
    found = {key: run[key] for key in keys if run.get(key) is not None}
    found["writing ranks"] = sorted((run.get("images_per_s_by_rank") or {}), key=lambda r: int(r) if r.isdigit() else 0)
    return found


def when(seconds: Optional[float]) -> str:
    """Unix seconds as local ``YYYY-MM-DD HH:MM:SS``."""
    if seconds is None:
        return "?"
    import datetime

    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")

