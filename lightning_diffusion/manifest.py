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
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

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


def _finished(file: Path, size: Optional[int], sizes: Optional[dict[Path, Optional[int]]] = None) -> bool:
    """The file of a manifest line is there and whole (its size is recorded, so a truncated file is
    caught with a stat, without reading every image on resume). ``sizes``: files already looked at
    (a tar shard holds many outputs: one stat for all)."""
    if sizes is not None and file in sizes:
        found = sizes[file]
    else:
        try:
            found = file.stat().st_size if file.is_file() else None
        except OSError:
            found = None
        if sizes is not None:
            sizes[file] = found
    return found is not None and (size is None or found == size)


def read_output(folder: str | os.PathLike, entry: dict[str, Any]) -> bytes:
    """An output's bytes, from its file or its tar shard's member (``writer.format: webdataset``)."""
    path = Path(folder) / str(entry["file"])
    if entry.get("member"):
        import tarfile

        with tarfile.open(path) as tar:
            member = tar.extractfile(str(entry["member"]))
            assert member is not None
            return member.read()
    return path.read_bytes()


RUN_FILE = "run.json"
# Keys of run.json that describe runs rather than decide pictures: not compared on resume. The
# prompt file is compared by content (``data.prompts_sha256``), its path only recorded.
RUN_META = ("expected", "history", "data.prompts")
PROMPTS_HASH = "data.prompts_sha256"
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


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
    for values in (before, now):  # a dtype's alias is the same dtype (bf16 is bfloat16)
        if "torch_dtype" in values:
            values["torch_dtype"] = _DTYPE_NAMES.get(values["torch_dtype"], values["torch_dtype"])
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if not changed:
        return None
    details = "; ".join("the prompt file's content changed" if k == PROMPTS_HASH
                        else f"{k}: {before.get(k)!r} then, {now.get(k)!r} now" for k in changed)
    return (f"{output_dir} holds images made with other settings ({details}). Use another writer.output_dir, or "
            "writer.allow_config_change=true to add to it anyway.")


# A manifest line as the writer writes it (keys in this order); other lines are read as JSON.
_LINE = re.compile(rb'\{"index": (\d+), .*?"file": "([^"\\]*)"(?:, "member": "([^"\\]*)")?, "bytes": (\d+)')
_SHARD_BYTES = re.compile(rb'"shard_bytes": (\d+)')
_WRITTEN = re.compile(rb'"written": ([0-9.]+)\}\s*$')


def _parse(raw: bytes) -> Optional[tuple[int, str, Optional[str], Optional[int]]]:
    """(index, file, tar member, size to check) of a manifest line; None for one that is not."""
    match = _LINE.match(raw)
    if match is not None:
        member = match.group(3).decode() if match.group(3) is not None else None
        size = int(match.group(4))
        if member is not None:
            shard = _SHARD_BYTES.search(raw)
            size = int(shard.group(1)) if shard else None
        return int(match.group(1)), match.group(2).decode(), member, size
    try:
        entry = json.loads(raw)
        return (int(entry["index"]), str(entry.get("file", "")), entry.get("member"),
                entry.get("shard_bytes", entry.get("bytes")))
    except (ValueError, KeyError, TypeError):
        return None


def _scan(folder: Path, files: list[Path], trust_manifest: bool, keep: Any) -> list[str]:
    """The one reading of manifest files: each complete line checked (parsed, inside the folder,
    its file whole unless ``trust_manifest`` covers it), ``keep(index, key, raw, file name, line
    number)`` called for those that count; returns what did not count."""
    problems: list[str] = []
    sizes: dict[Path, Optional[int]] = {}
    for file in files:
        if not file.is_file():
            continue
        trusted = trust_manifest and file.name == MANIFEST
        with file.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    continue  # a write in progress (or cut by a kill)
                parsed = _parse(raw)
                if parsed is None:
                    problems.append(f"{file.name}:{number}: not a manifest line")
                    continue
                index, name, member, size = parsed
                if not _inside(folder, name):
                    problems.append(f"{file.name}:{number}: {name!r} is outside the output folder")
                elif trusted or _finished(folder / name, size, sizes):
                    keep(index, (name, member), raw, file.name, number)
                else:
                    problems.append(f"{file.name}:{number}: {name!r} is missing or not the size recorded")
    return problems


def _files(folder: Path, parts: Optional[list[Path]]) -> list[Path]:
    return [folder / MANIFEST, *(sorted(folder.glob(PART_GLOB)) if parts is None else parts)]


def scan_manifest(output_dir: str | os.PathLike, parts: Optional[list[Path]] = None,
                  trust_manifest: bool = False) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Finished images by index, their whole lines (the merged manifest plus parts left by a running
    or killed run), and what was not counted, as ``file:line: why`` (``parts``: these parts only,
    not every one; ``trust_manifest``: the merged manifest's lines count without a look at their
    files). A line that does not parse (cut by a kill), a line whose file is gone or has another
    size than recorded (truncated, replaced), a line whose file lies outside the folder, and two
    lines for one index with different files do not count: those images are made again. An
    unterminated last line is a write in progress, not a problem. For a whole folder of a large
    run, ``finished`` reads the same in a fraction of the memory."""
    folder = Path(output_dir)
    entries: dict[int, dict[str, Any]] = {}
    keys: dict[int, tuple[tuple[str, Optional[str]], str]] = {}
    conflicts: list[tuple[int, str, str]] = []

    def keep(index: int, key: tuple[str, Optional[str]], raw: bytes, name: str, number: int) -> None:
        where = f"{name}:{number}"
        if index in keys and keys[index][0] != key:
            conflicts.append((index, where, keys[index][1]))
            return
        keys[index] = (key, where)
        entries[index] = json.loads(raw)

    problems = _scan(folder, _files(folder, parts), trust_manifest, keep)
    for index, where, first in conflicts:
        problems.append(f"{where}: image {index} is also {keys[index][0][0]!r} ({first}); neither counts")
        entries.pop(index, None)
    return entries, problems


@dataclass
class Finished:
    """The finished images of a folder in compact form: their indices (sorted, 8 bytes each),
    what did not count, the whole lines of those that name input files (a resume checks them), and,
    when asked, when each was written (``status``'s rate)."""

    indices: np.ndarray
    problems: list[str]
    with_inputs: dict[int, dict[str, Any]]
    written: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.indices)

    def in_shard(self, shard: Optional[tuple[int, int]]) -> np.ndarray:
        return self.indices if shard is None else self.indices[self.indices % shard[1] == shard[0]]


def finished(output_dir: str | os.PathLike, parts: Optional[list[Path]] = None, written: bool = False) -> Finished:
    """``scan_manifest``'s verdicts for every line, keeping only each image's index (and its line
    when it names input files): a resume or ``status`` of a million-image folder reads each line
    once with a pattern (its JSON only where the pattern does not fit) and stats each file once
    (a tar shard once for all its members)."""
    folder = Path(output_dir)
    indices, keys, lines, times = array("q"), array("q"), array("q"), array("d")
    names: dict[str, int] = {}
    with_inputs: dict[int, dict[str, Any]] = {}

    def keep(index: int, key: tuple[str, Optional[str]], raw: bytes, name: str, number: int) -> None:
        indices.append(index)
        keys.append(hash(key))
        lines.append(names.setdefault(name, len(names)) << 40 | number)
        if written:
            found = _WRITTEN.search(raw)
            times.append(float(found.group(1)) if found else 0.0)
        if b'"inputs": {' in raw:
            with_inputs[index] = json.loads(raw)

    problems = _scan(folder, _files(folder, parts), False, keep)
    index_array = np.frombuffer(indices, dtype=np.int64) if len(indices) else np.zeros(0, dtype=np.int64)
    key_array = np.frombuffer(keys, dtype=np.int64) if len(keys) else np.zeros(0, dtype=np.int64)
    order = np.argsort(index_array, kind="stable")
    sorted_indices, sorted_keys = index_array[order], key_array[order]
    same = sorted_indices[1:] == sorted_indices[:-1]
    clash = same & (sorted_keys[1:] != sorted_keys[:-1])
    conflicted = np.unique(sorted_indices[1:][clash])
    if len(conflicted):
        by_id = {n: name for name, n in names.items()}
        line_array = np.frombuffer(lines, dtype=np.int64)[order]
        for position in np.flatnonzero(clash).tolist():
            first, second = int(line_array[position]), int(line_array[position + 1])
            problems.append(f"{by_id[second >> 40]}:{second & (1 << 40) - 1}: image {int(sorted_indices[position])} "
                            f"is also in {by_id[first >> 40]}:{first & (1 << 40) - 1} with another file; neither counts")
    unique = np.unique(sorted_indices)
    if len(conflicted):
        unique = np.setdiff1d(unique, conflicted, assume_unique=True)
        for index in conflicted.tolist():
            with_inputs.pop(index, None)
    times_array = None
    if written:
        times_array = np.frombuffer(times, dtype=np.float64) if len(times) else np.zeros(0)
    return Finished(unique, problems, with_inputs, times_array)


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
    """Append the finished lines of the parts to ``manifest.jsonl`` (sorted by index among
    themselves) and drop the parts; returns the lines appended, by index. A merge costs in
    proportion to its parts: the manifest is only appended to, never read or rewritten, so the 16
    shards of a job array merging into a manifest of a million lines cost what one merge of those
    lines costs. A shard's run leaves alone the parts its sibling shards still append to. A line
    cut by a kill at the manifest's end is ended first (it stays a line that does not parse)."""
    folder = Path(output_dir)
    with merge_lock(folder):
        parts = _parts_to_merge(folder, shard)
        entries: dict[int, dict[str, Any]] = {}

        def keep(index: int, key: Any, raw: bytes, name: str, number: int) -> None:
            entries.setdefault(index, json.loads(raw))

        _scan(folder, parts, False, keep)
        if not (folder / MANIFEST).exists():
            (folder / MANIFEST).touch()  # a run that made nothing still leaves its (empty) manifest
        if entries:
            text = "".join(json.dumps(entries[i], ensure_ascii=False) + "\n" for i in sorted(entries)).encode("utf-8")
            with open(folder / MANIFEST, "a+b") as f:
                end = f.seek(0, os.SEEK_END)
                if end:
                    f.seek(end - 1)
                    if f.read(1) != b"\n":
                        text = b"\n" + text
                f.write(text)  # appended at the end, whatever the position read from
                f.flush()
                os.fsync(f.fileno())
        for part in parts:
            part.unlink(missing_ok=True)
    return entries


def merge_failures(output_dir: str | os.PathLike, shard: Optional[tuple[int, int]], done: Any) -> int:
    """Fold the failure parts into ``failed.jsonl``: the images that failed in this run, and those
    of earlier runs that are still not made (``done``: the indices in the manifest, an array) and
    were not tried again; returns how many failed in this run."""
    folder = Path(output_dir)
    with merge_lock(folder):
        parts = _parts_to_merge(folder, shard, FAILURES_GLOB)
        now: dict[int, dict[str, Any]] = {}
        for part in parts:
            now.update(_lines(part))
        failed = {**_lines(folder / FAILED), **now}
        made = set(np.asarray(list(failed), dtype=np.int64)[np.isin(list(failed), done)].tolist()) if failed else set()
        failed = {index: line for index, line in failed.items() if index not in made}
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
