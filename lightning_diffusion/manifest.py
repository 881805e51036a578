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
from pathlib import Path
from typing import Any, Optional

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


def shard_name(shard: Optional[tuple[int, int]]) -> Optional[str]:
    """``shard-T-of-N`` for shard ``(T, N)``; None for a run of the whole prompt set."""
    return None if shard is None else f"shard-{shard[0]}-of-{shard[1]}"


def in_shard(index: int, shard: Optional[tuple[int, int]]) -> bool:
    """Whether image ``index`` belongs to shard ``(T, N)`` (every image belongs to no shard: None)."""
    return shard is None or index % shard[1] == shard[0]


def shard_size(total: int, shard: Optional[tuple[int, int]]) -> int:
    """How many of ``total`` images a shard holds."""
    return total if shard is None else len(range(shard[0], total, shard[1]))


def parts_glob(shard: Optional[tuple[int, int]]) -> str:
    """The manifest parts of one run: of the whole set, or of one shard."""
    return "manifest.part-*.jsonl" if shard is None else f"manifest.{shard_name(shard)}.part-*.jsonl"


def part_name(shard: Optional[tuple[int, int]], rank: int) -> str:
    return parts_glob(shard).replace("*", str(rank))


def failures_part(part: Path) -> Path:
    """The failure part beside a manifest part (``failed.part-R.jsonl``)."""
    return part.with_name("failed." + part.name.removeprefix("manifest."))


def _atomic_write(path: Path, write, fsync: bool = True) -> int:
    """``path`` appears whole or not at all (written under a temporary name, then renamed); with
    ``fsync`` its bytes are on disk before the rename. The temporary name is unique across the
    nodes and threads writing into one folder (equal pids are common in containers). Returns the
    file's size."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(6).hex()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _inside(folder: Path, name: str) -> bool:
    """A manifest's file name stays inside its folder (no absolute path, no ``..``)."""
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _finished(file: Path, size: Optional[int]) -> bool:
    """The file of a manifest line is there and whole (its size is recorded, so a truncated file is
    caught with a stat, without reading every image on resume)."""
    try:
        return file.is_file() and (size is None or file.stat().st_size == size)
    except OSError:
        return False


RUN_FILE = "run.json"
# Keys of run.json that describe runs rather than decide pictures: not compared on resume. The
# prompt file is compared by content (``data.prompts_sha256``), its path only recorded.
RUN_META = ("expected", "history", "data.prompts")
PROMPTS_HASH = "data.prompts_sha256"


def prompts_hash(prompts: Any) -> str:
    """SHA-256 of a prompt file's bytes, or of an inline list's JSON: a copy under another path is
    the same prompt set."""
    import hashlib

    digest = hashlib.sha256()
    if isinstance(prompts, (str, os.PathLike)) and Path(prompts).expanduser().is_file():
        with open(Path(prompts).expanduser(), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    else:
        digest.update(json.dumps(prompts, sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()


def settings_conflict(output_dir: str | os.PathLike, settings: dict[str, Any]) -> Optional[str]:
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
    before = {k: v for k, v in recorded.items() if k not in RUN_META}
    now = {k: v for k, v in settings.items() if k not in RUN_META}
    if PROMPTS_HASH not in before:  # made before prompt hashes: the path is what was recorded
        before.pop(PROMPTS_HASH, None)
        now.pop(PROMPTS_HASH, None)
        before["data.prompts"], now["data.prompts"] = recorded.get("data.prompts"), settings.get("data.prompts")
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if not changed:
        return None
    details = "; ".join(f"{k}: {before.get(k)!r} then, {now.get(k)!r} now" for k in changed)
    return (f"{output_dir} holds images made with other settings ({details}). Use another writer.output_dir, or "
            "writer.allow_config_change=true to add to it anyway.")


def scan_manifest(output_dir: str | os.PathLike, parts: Optional[list[Path]] = None,
                  trust_manifest: bool = False) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Finished images by index (the merged manifest plus parts left by a running or killed run),
    and what was not counted, as ``file:line: why`` (``parts``: these parts only, not every one;
    ``trust_manifest``: the merged manifest's lines count without a look at their files). A line
    that does not parse (cut by a kill), a line whose file is gone or has another size than
    recorded (truncated, replaced), a line whose file lies outside the folder, and two lines for
    one index with different files do not count: those images are made again. An unterminated
    last line is a write in progress, not a problem."""
    folder = Path(output_dir)
    entries: dict[int, dict[str, Any]] = {}
    where: dict[int, str] = {}
    conflicts: set[int] = set()
    problems: list[str] = []
    for file in [folder / MANIFEST, *(sorted(folder.glob(PART_GLOB)) if parts is None else parts)]:
        if not file.is_file():
            continue
        with file.open(encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if not line.endswith("\n"):
                    continue
                try:
                    entry = json.loads(line)
                    index = int(entry["index"])
                    name = str(entry.get("file", ""))
                except (ValueError, KeyError, TypeError):
                    problems.append(f"{file.name}:{number}: not a manifest line")
                    continue
                if not _inside(folder, name):
                    problems.append(f"{file.name}:{number}: {name!r} is outside the output folder")
                    continue
                if index in entries and entries[index].get("file") != name:
                    problems.append(f"{file.name}:{number}: image {index} is also {entries[index].get('file')!r} "
                                    f"({where[index]}); neither counts")
                    conflicts.add(index)
                    continue
                if (trust_manifest and file.name == MANIFEST) or _finished(folder / name, entry.get("bytes")):
                    entries[index] = entry
                    where[index] = f"{file.name}:{number}"
                else:
                    problems.append(f"{file.name}:{number}: {entry.get('file')!r} is missing or not the size recorded")
    for index in conflicts:
        entries.pop(index, None)
    return entries, problems


def read_manifest(output_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Finished images by index (see ``scan_manifest``)."""
    return scan_manifest(output_dir)[0]


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


@contextlib.contextmanager
def merge_lock(folder: Path):
    """One merge of ``manifest.jsonl`` at a time in a folder (the shards of a job array merge into
    it from several nodes): a POSIX lock, which NFS serves too."""
    import fcntl

    with open(folder / MERGE_LOCK, "a") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def _parts_to_merge(folder: Path, shard: Optional[tuple[int, int]], glob: str = PART_GLOB) -> list[Path]:
    """Every part of the folder (manifest parts, or failure parts with ``glob``), except those
    other shards of ``shard``'s count may still be appending to: parts of the whole set and of
    other counts are left by runs that are over (a live one would have refused this run, see
    ``lock.conflicting_runs``)."""
    parts = sorted(folder.glob(glob))
    if shard is None:
        return parts
    siblings = re.compile(rf"(?:manifest|failed)\.shard-(\d+)-of-{shard[1]}\.part-\d+\.jsonl")
    return [p for p in parts if not ((m := siblings.fullmatch(p.name)) and int(m.group(1)) != shard[0])]


def merge_manifest(output_dir: str | os.PathLike, shard: Optional[tuple[int, int]] = None) -> dict[int, dict[str, Any]]:
    """Fold finished parts into ``manifest.jsonl`` (sorted by index) and drop them; returns the
    merged manifest's entries. A shard's run leaves alone the parts its sibling shards still
    append to. The manifest's own lines are not checked against their files here (a merge holds
    the folder's lock, and the shards of an array queue for it): a resume checks them."""
    folder = Path(output_dir)
    with merge_lock(folder):
        parts = _parts_to_merge(folder, shard)
        entries, _ = scan_manifest(folder, parts, trust_manifest=True)
        text = "".join(json.dumps(entries[i], ensure_ascii=False) + "\n" for i in sorted(entries))
        _atomic_write(folder / MANIFEST, lambda f: f.write(text.encode("utf-8")))
        for part in parts:
            part.unlink(missing_ok=True)
    return entries


def merge_failures(output_dir: str | os.PathLike, shard: Optional[tuple[int, int]],
                   done: dict[int, Any]) -> int:
    """Fold the failure parts into ``failed.jsonl``: the images that failed in this run, and those
    of earlier runs that are still not made (``done``: the merged manifest's indices) and were not
    tried again; returns how many failed in this run."""
    folder = Path(output_dir)
    with merge_lock(folder):
        parts = _parts_to_merge(folder, shard, FAILURES_GLOB)
        now: dict[int, dict[str, Any]] = {}
        for part in parts:
            now.update(_lines(part))
        failed = {**_lines(folder / FAILED), **now}
        failed = {index: line for index, line in failed.items() if index not in done}
        if failed or (folder / FAILED).exists():
            text = "".join(json.dumps(failed[i], ensure_ascii=False) + "\n" for i in sorted(failed))
            _atomic_write(folder / FAILED, lambda f: f.write(text.encode("utf-8")))
        for part in parts:
            part.unlink(missing_ok=True)
    return len(now)


def _lines(file: Path) -> dict[int, dict[str, Any]]:
    """The complete JSON lines of a failure file by index (a line cut by a kill is skipped)."""
    found: dict[int, dict[str, Any]] = {}
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
