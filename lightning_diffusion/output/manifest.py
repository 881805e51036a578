"""The output folder's records, readable without Lightning or torch: ``manifest.jsonl`` and the
parts each rank appends while a run goes, ``run.json``, and atomic writes.

``ImageWriter`` writes them; ``status`` and the checks before a run read them (from a login node
too: nothing heavy is imported here).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from lightning_diffusion.core.records import FailureLine, RunSettings
from lightning_diffusion.output.shard import shard_name

MANIFEST = "manifest.jsonl"
# Every run's parts: ``manifest.part-R.jsonl`` for a run of the whole prompt set, and
# ``manifest.shard-T-of-N.part-R.jsonl`` for shard T of N (the tasks of a job array, which write
# into one folder at once, each merging only its own parts).
PART_GLOB = "manifest.*part-*.jsonl"
MERGE_LOCK = ".manifest.merge-lock"
# Records ``data.on_bad_record: skip`` left out (file:line, reason), and images whose pipeline call
# failed under ``data.on_error: skip`` (index, record, error; a rerun retries them), merged from
# ``failed.part-R.jsonl`` (``failed.shard-T-of-N.part-R.jsonl``) like the manifest.
REJECTED = "rejected.jsonl"
FAILED = "failed.jsonl"
FAILURES_GLOB = "failed.*part-*.jsonl"


def parts_glob(shard: Optional[tuple[int, int]], pool: Optional[str] = None) -> str:
    """The manifest parts of one run: of the whole set, of one shard, or of one job of a pool
    (``manifest.pool-JOB.part-R.jsonl``: the jobs of a pool append beside each other)."""
    if pool is not None:
        return f"manifest.pool-{pool}.part-*.jsonl"
    return "manifest.part-*.jsonl" if shard is None else f"manifest.{shard_name(shard)}.part-*.jsonl"


def part_name(shard: Optional[tuple[int, int]], rank: int, pool: Optional[str] = None) -> str:
    return parts_glob(shard, pool).replace("*", str(rank))


def failures_part(part: Path) -> Path:
    """The failure part beside a manifest part (``failed.part-R.jsonl``)."""
    return part.with_name("failed." + part.name.removeprefix("manifest."))


def temporary_name(path: Path, owner: str = "") -> Path:
    """A temporary name beside ``path``: ``.NAME.tmp-PID-RANDOM``, unique across the nodes and threads
    writing into one folder (equal pids are common in containers); ``.NAME.OWNER.tmp-PID-RANDOM`` for
    a pool's worker ``owner``, whose leftovers another job sweeps once that worker is gone."""
    return path.with_name(f".{path.name}{'.' + owner if owner else ''}.tmp-{os.getpid()}-{os.urandom(6).hex()}")


def temporary_write(path: Path, write, fsync: bool = True, owner: str = "") -> tuple[Path, int]:
    """``path``'s bytes written under a temporary name beside it (``temporary_name``), with ``fsync``
    on disk; returns (the temporary, its size). Renamed into place by the caller, or removed."""
    tmp = temporary_name(path, owner)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, size


def atomic_write(path: Path, write, fsync: bool = True) -> int:
    """``path`` appears whole or not at all (``temporary_write``, then renamed); with ``fsync`` its
    bytes are on disk before the rename. Returns the file's size."""
    tmp, size = temporary_write(path, write, fsync)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


RUN_FILE = "run.json"
# Keys of run.json that describe runs rather than decide pictures: not compared on resume. The
# prompt file is compared by content (``data.prompts_sha256``), its path only recorded.
RUN_META = ("expected", "history", "data.prompts")
PROMPTS_HASH = "data.prompts_sha256"
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def prompts_hash(prompts: Union[str, os.PathLike[str], Sequence[object]], files: Sequence[str] = ()) -> str:
    """SHA-256 of a prompt file's bytes, of the bytes of ``files`` in order (a set read from several:
    a folder or glob of Parquet files, a dataset), or of an inline list's JSON: a copy under another
    path is the same prompt set."""
    import hashlib

    digest = hashlib.sha256()
    if files:
        for name in files:
            with open(name, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    elif isinstance(prompts, (str, os.PathLike)) and Path(prompts).expanduser().is_file():
        with open(Path(prompts).expanduser(), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    else:
        digest.update(json.dumps(prompts, sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()


def settings_conflict(output_dir: str | os.PathLike, settings: RunSettings) -> Optional[str]:
    """Why ``output_dir`` may not be resumed with ``settings`` (the message), or None: its run.json
    records other settings that decide pictures. A folder from before prompt hashes compares the
    prompt file's path, as it was made."""
    run_file = Path(output_dir) / RUN_FILE
    if not run_file.is_file():
        return None
    try:
        recorded = json.loads(run_file.read_text())
    except ValueError:
        return f"{run_file} is not valid JSON; move it away to start the folder afresh."
    return recorded_conflict(recorded, settings, str(output_dir))


def recorded_conflict(recorded: Mapping[str, Any], settings: RunSettings, where: str) -> Optional[str]:
    """``settings_conflict`` against the settings ``recorded`` in the run.json of ``where``."""
    before = {k: v for k, v in recorded.items() if k not in RUN_META}
    now = {k: v for k, v in settings.items() if k not in RUN_META}
    if PROMPTS_HASH not in before:  # made before prompt hashes: the path is what was recorded
        before.pop(PROMPTS_HASH, None)
        now.pop(PROMPTS_HASH, None)
        before["data.prompts"], now["data.prompts"] = recorded.get("data.prompts"), settings.get("data.prompts")
    for values in (before, now):  # a dtype's alias is the same dtype (bf16 is bfloat16)
        if "torch_dtype" in values:
            values["torch_dtype"] = _DTYPE_NAMES.get(values["torch_dtype"], values["torch_dtype"])
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if not changed:
        return None
    details = "; ".join("the prompt file's content changed" if k == PROMPTS_HASH
                        else f"{k}: {before.get(k)!r} then, {now.get(k)!r} now" for k in changed)
    return (f"{where} holds images made with other settings ({details}). Use another writer.output_dir, or "
            "writer.allow_config_change=true to add to it anyway.")


_WRITTEN = re.compile(rb'"written": ([0-9.]+)\}\n')


def part_counts(output_dir: str | os.PathLike, glob: str = "manifest.part-*.jsonl") -> dict[int, int]:
    """Complete lines in each rank's manifest part of one run (``glob``: ``parts_glob(shard)``), by
    global rank."""
    counts = {}
    for file in Path(output_dir).glob(glob):
        try:
            rank = int(file.name.rpartition(".part-")[2][:-len(".jsonl")])
            counts[rank] = file.read_bytes().count(b"\n")
        except (ValueError, OSError):
            continue
    return counts


# Per folder in this process: a re-entrant lock for its threads and how deep the holder is: POSIX
# locks belong to a process, so threads are kept apart here, and only the outermost hold takes and
# releases the file's lock (an inner release would free it for every process).
_HELD: dict[str, list[Any]] = {}
_HELD_GUARD = threading.Lock()


@contextlib.contextmanager
def merge_lock(folder: Path):
    """One merge of ``manifest.jsonl`` (or one publication of a pool's batch, ``fence``) at a time in
    a folder (the shards of a job array merge into it from several nodes): a POSIX lock, which NFS
    serves too, held by one thread of a process at a time; nested holds by one thread are allowed."""
    import fcntl

    key = os.path.realpath(folder)  # one entry however the folder is spelt (a link to it included)
    with _HELD_GUARD:
        held = _HELD.setdefault(key, [threading.RLock(), 0, None])
    with held[0]:
        if held[1] == 0:
            handle = open(Path(folder) / MERGE_LOCK, "a")
            try:
                fcntl.lockf(handle, fcntl.LOCK_EX)
            except BaseException:
                handle.close()
                raise
            held[2] = handle
        held[1] += 1
        try:
            yield
        finally:
            held[1] -= 1
            if held[1] == 0:
                handle, held[2] = held[2], None
                fcntl.lockf(handle, fcntl.LOCK_UN)
                handle.close()


def _parts_to_merge(folder: Path, shard: Optional[tuple[int, int]], glob: str = PART_GLOB,
                    live_jobs: Sequence[str] = ()) -> list[Path]:
    """Every part of the folder (manifest parts, or failure parts with ``glob``), except those
    other shards of ``shard``'s count may still be appending to, and those of the pool's
    ``live_jobs``: parts of the whole set and of other counts are left by runs that are over (a
    live one would have refused this run, see ``lock.conflicting_runs``)."""
    parts = sorted(folder.glob(glob))
    if live_jobs:
        live = re.compile(r"(?:manifest|failed)\.pool-(.+)\.part-\d+\.jsonl")
        parts = [p for p in parts if not ((m := live.fullmatch(p.name)) and m.group(1) in live_jobs)]
    if shard is None:
        return parts
    siblings = re.compile(rf"(?:manifest|failed)\.shard-(\d+)-of-{shard[1]}\.part-\d+\.jsonl")
    return [p for p in parts if not ((m := siblings.fullmatch(p.name)) and int(m.group(1)) != shard[0])]


def merge_failures(output_dir: str | os.PathLike, shard: Optional[tuple[int, int]], done: np.ndarray,
                   live_jobs: Sequence[str] = ()) -> int:
    """Fold the failure parts into ``failed.jsonl``: the images that failed in this run, and those
    of earlier runs that are still not made (``done``: the indices in the manifest, an array) and
    were not tried again; returns how many failed in this run."""
    folder = Path(output_dir)
    with merge_lock(folder):
        parts = _parts_to_merge(folder, shard, FAILURES_GLOB, live_jobs)
        now: dict[int, FailureLine] = {}
        for part in parts:
            now.update(_lines(part))
        failed = {**_lines(folder / FAILED), **now}
        made = set(np.asarray(list(failed), dtype=np.int64)[np.isin(list(failed), done)].tolist()) if failed else set()
        failed = {index: line for index, line in failed.items() if index not in made}
        if failed or (folder / FAILED).exists():
            text = "".join(json.dumps(failed[i], ensure_ascii=False) + "\n" for i in sorted(failed))
            atomic_write(folder / FAILED, lambda f: f.write(text.encode("utf-8")))
        for part in parts:
            part.unlink(missing_ok=True)
    return len(now)


def _lines(file: Path) -> dict[int, FailureLine]:
    """The complete JSON lines of a failure file by index (a line cut by a kill is skipped)."""
    found: dict[int, FailureLine] = {}
    if not file.is_file():
        return found
    with file.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                entry = json.loads(line)
                found[int(entry["index"])] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return found


def count_lines(file: Path) -> int:
    """Complete lines of a small record file (``rejected.jsonl``, ``failed.jsonl``); 0 if absent."""
    try:
        return file.read_bytes().count(b"\n")
    except OSError:
        return 0


def rejected_images(output_dir: str | os.PathLike) -> set[int]:
    """The image indices of the records ``rejected.jsonl`` lists: never made from this prompt file,
    so a folder whose other images are all made is complete."""
    found: set[int] = set()
    file = Path(output_dir) / REJECTED
    if not file.is_file():
        return found
    with file.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                found.update(int(i) for i in json.loads(line)["images"])
            except (ValueError, KeyError, TypeError):
                continue
    return found


def recent_written(output_dir: str | os.PathLike, tail: int = 8 << 20) -> np.ndarray:
    """When the latest outputs were written (``status``'s rate): the times of the running run's
    parts and of the manifest's last ``tail`` bytes (it is appended in merge order)."""
    folder = Path(output_dir)
    times: list[bytes] = []
    for file in [folder / MANIFEST, *sorted(folder.glob(PART_GLOB))]:
        try:
            with file.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - tail) if file.name == MANIFEST else 0)
                times += _WRITTEN.findall(f.read())
        except OSError:
            continue
    return np.asarray(times).astype(np.float64) if times else np.zeros(0)
