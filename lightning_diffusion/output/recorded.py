"""What an output folder records as made: every manifest line checked against its file, read
without Lightning or torch (``status`` and the checks before a run read it from a login node too).

``scan_manifest`` gives each line's verdict; ``finished`` keeps only the indices of the images
that count (8 bytes each), reading each line once with a pattern and stating each file once;
``repair_manifest`` rewrites a manifest that holds lines that do not count.
"""

from __future__ import annotations

import functools
import json
import os
import re
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import numpy as np

from lightning_diffusion.core.records import ManifestLine
from lightning_diffusion.core.system import file_stat, sha256
from lightning_diffusion.output.manifest import MANIFEST, PART_GLOB, _parts_to_merge, atomic_write, merge_lock
from lightning_diffusion.output.shard import select

if TYPE_CHECKING:
    # ``keep(index, (file, member or None), raw line, file name, line number)``: a line that counts.
    _Keep = Callable[[int, tuple[str, Optional[str]], bytes, str, int], None]

# The names the writer gives an output: ``000123-a-red-fox.png`` (in a numbered subfolder in the
# sharded layout), or member ``000000123.png`` of tar shard ``shard-000000100.tar``: the output's
# own index first (``files_class`` subclasses may change the rest). A manifest line naming anything
# else (``run.json``, ``../x``, another output's file) is not this output.
_OUTPUT_FILE = re.compile(r"(?:\d{5,}/)?(\d{6,})-[^/]*")
# a pool's in a bucket: its worker too; a LitData shard's chunk (``shard-000000100.litdata/chunk-0-0.bin``)
_SHARD_FILE = re.compile(r"shard-\d{9,}(?:\.[0-9a-f]+-\d+)?\.(?:tar|parquet|litdata/chunk-\d+-\d+\.bin)")
_SHARD_MEMBER = re.compile(r"(\d{9,})\.[^/]+")

# A manifest line as the writer writes it (keys in this order); other lines are read as JSON.
_LINE = re.compile(rb'\{"index": (\d+), .*?"file": "([^"\\]*)"(?:, "member": "([^"\\]*)")?, "bytes": (\d+)')
_SHARD_BYTES = re.compile(rb'"shard_bytes": (\d+)')


# ``finished``'s reading of a whole block of lines at once: each key the check needs found in the
# whole block by its literal (an unescaped quote is never inside a JSON string, so a key's text
# cannot stand in a prompt), one a line, in the lines' order; a block where a key is not once a
# line (input files, adapters, a line of another shape) is read line by line.
_BLOCK_KEYS = {key: re.compile(pattern) for key, pattern in (
    ("index", rb'\{"index": (\d+), '), ("file", rb'"file": "([^"\\\n]*)"'), ("member", rb'"member": "([^"\\\n]*)"'),
    ("bytes", rb'"bytes": (\d+)'), ("shard_bytes", rb'"shard_bytes": (\d+)'),
    ("sha256", rb'"bytes": \d+, "sha256": "([0-9a-f]{64})"'), ("written", rb'"written": ([0-9.]+)'))}
_SHA = _BLOCK_KEYS["sha256"]
_AT = _BLOCK_KEYS["written"]
# An output whose file changed after its line was written (its modification time later than the
# line's ``written``, by more than this many seconds of clock difference between nodes and a file
# server) is read and
# its SHA-256 compared with the line's: a same-size foreign or corrupt file does not count.
CHANGED_AFTER_S = 30.0
_BLOCK = 8 << 20  # bytes read at once
NOT_THE_BYTES = "changed after it was recorded (not the bytes recorded)"
IN_THE_WAY = "is a folder where the output goes"  # a resume cannot write it: refused (``Finished.in_the_way``)


def _inside(folder: Path, name: str) -> bool:
    """A manifest's file name stays inside its folder (no absolute path, no ``..``)."""
    return bool(name) and not name.startswith(("/", "\\")) and ".." not in name.replace("\\", "/").split("/")


def writer_name(index: int, name: str, member: Optional[str]) -> bool:
    """``name`` (and ``member``) are named for output ``index`` as the writer names outputs."""
    if member is None:
        found = _OUTPUT_FILE.fullmatch(name)
        return found is not None and int(found.group(1)) == index
    found = _SHARD_MEMBER.fullmatch(member)
    return _SHARD_FILE.fullmatch(name) is not None and found is not None and int(found.group(1)) == index


def _finished(file: Path | str, size: Optional[int], sizes: Optional[dict[str, Optional[int]]] = None) -> bool:
    """The file of a manifest line is there and whole (its size is recorded, so a truncated file is
    caught with a stat, without reading every image on resume). ``sizes``: files already looked at
    (a tar shard holds many outputs: one stat for all)."""
    path = os.fspath(file)
    if sizes is not None and path in sizes:
        found = sizes[path]
    else:
        try:
            stat = os.lstat(path)  # a link, even to a file of the recorded size, is not an output
            found = stat.st_size if (stat.st_mode & 0o170000) == 0o100000 else None  # a regular file
        except OSError:
            found = None
        if sizes is not None:
            sizes[path] = found
    return found is not None and (size is None or found == size)


def read_output(folder: str | os.PathLike, entry: ManifestLine) -> bytes:
    """An output's bytes, from its file or its tar shard's member (``writer.format: webdataset``)."""
    path = Path(folder) / str(entry["file"])
    if entry.get("member") and path.suffix == ".parquet":
        return parquet_members(path)[str(entry["member"])]
    if entry.get("member") and is_litdata_chunk(path):
        return litdata_members(path)[str(entry["member"])]
    if entry.get("member"):
        import tarfile

        with tarfile.open(path) as tar:
            member = tar.extractfile(str(entry["member"]))
            assert member is not None
            return member.read()
    return path.read_bytes()


def parquet_members(path: Path) -> dict[str, bytes]:
    """A Parquet shard's images by member name (``writer.format: parquet``); the last few shards
    read are kept while they do not change (``eval`` reads a shard's images one after another)."""
    stat = os.stat(path)
    return _parquet_members(os.fspath(path), stat.st_mtime_ns, stat.st_size)


def is_litdata_chunk(path: Path | str) -> bool:
    """A LitData shard's chunk file (``writer.format: litdata``): ``shard-...litdata/chunk-R-C.bin``."""
    path = Path(path)
    return path.suffix == ".bin" and path.parent.suffix == ".litdata"


def litdata_members(chunk: Path) -> dict[str, bytes]:
    """A LitData shard's images by member name (``writer.format: litdata``), read through
    ``litdata.StreamingDataset`` from the folder of its ``chunk``; kept as ``parquet_members`` keeps them."""
    stat = os.stat(chunk)
    return _litdata_members(os.fspath(Path(chunk).parent), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _litdata_members(folder: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    from litdata import StreamingDataset

    try:
        dataset = StreamingDataset(folder)
        samples = (dataset[position] for position in range(len(dataset)))
        return {str(sample["image_path"]): bytes(sample["image"]) for sample in samples}
    except Exception as err:  # a chunk cut short or not LitData's: a ValueError, as pyarrow's are
        raise ValueError(f"{folder} is not a LitData shard that reads: {err}") from err


@functools.lru_cache(maxsize=2)
def _parquet_members(path: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    import pyarrow.parquet as pq

    column = pq.read_table(path, columns=["image"]).column("image").combine_chunks()
    return dict(zip(column.field("path").to_pylist(), column.field("bytes").to_pylist()))


def _parse(raw: bytes) -> Optional[tuple[int, str, Optional[str], Optional[int]]]:
    """(index, file, tar member, size to check) of a manifest line; None for one that is not."""
    match = _LINE.match(raw) if raw.endswith(b"}\n") else None  # a line cut short keeps no closing brace
    if match is not None:
        index, name, member, size = match.groups()
        if member is None:
            return int(index), name.decode(), None, int(size)
        shard = _SHARD_BYTES.search(raw, match.end())
        return int(index), name.decode(), member.decode(), int(shard.group(1)) if shard else None
    try:
        entry = json.loads(raw)
        return (int(entry["index"]), str(entry.get("file", "")), entry.get("member"),
                entry.get("shard_bytes", entry.get("bytes")))
    except (ValueError, KeyError, TypeError):
        return None


class _Looked:
    """What a scan has already looked at: shards' sizes and verdicts (one stat for all members)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.prefix = os.fspath(folder) + os.sep
        self.sizes: dict[str, Optional[int]] = {}
        self.shards: dict[tuple[str, Optional[int]], bool] = {}
        self.folders: dict[str, bool] = {}
        self.members: dict[str, dict[str, str]] = {}  # a tar read to verify its members: member -> SHA-256
        self.mtimes: dict[str, float] = {}  # tar shards' modification times (one look for all members)
        self.changed: set[str] = set()  # outputs whose bytes changed after their lines
        self.hashed = 0  # outputs read to verify them (changed after their lines)

    def changed_after(self, name: str, written: Optional[float], mtime: Optional[float] = None) -> bool:
        """``name``'s file was modified after ``written`` (its line's time): it must be verified."""
        if written is None or written != written:  # none recorded (NaN in a block)
            return False
        if mtime is None:
            mtime = self.mtimes.get(name)
        if mtime is None:
            try:
                mtime = self.mtimes[name] = os.stat(self.prefix + name).st_mtime
            except OSError:
                return False
        return mtime > written + CHANGED_AFTER_S

    def same_bytes(self, name: str, member: Optional[str], sha: str) -> bool:
        """The output's bytes (a file, or a tar member) have the SHA-256 its line records."""
        import hashlib
        import tarfile

        self.hashed += 1
        try:
            if member is None:
                digest = hashlib.sha256()
                with open(self.prefix + name, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                return digest.hexdigest() == sha
            if name not in self.members and (name.endswith(".parquet") or is_litdata_chunk(name)):
                read = parquet_members if name.endswith(".parquet") else litdata_members
                self.members[name] = {member: hashlib.sha256(data).hexdigest()
                                      for member, data in read(Path(self.prefix + name)).items()}
            if name not in self.members:
                found: dict[str, str] = {}
                with tarfile.open(self.prefix + name) as tar:
                    for info in tar:
                        data = tar.extractfile(info) if info.isfile() else None
                        if data is not None:
                            found[info.name] = hashlib.sha256(data.read()).hexdigest()
                self.members[name] = found
            return self.members[name].get(member) == sha
        except (OSError, tarfile.TarError, ValueError):  # pyarrow's errors are ValueErrors or OSErrors
            return False

    def verified(self, name: str, member: Optional[str], sha: Optional[str], written: Optional[float],
                 mtime: Optional[float] = None) -> bool:
        """An output whose size matched: the same bytes as recorded, where its file changed since
        (a tar shard's time is looked at once for all its members)."""
        if sha is None or not self.changed_after(name, written, mtime) or self.same_bytes(name, member, sha):
            return True
        self.changed.add(name if member is None else f"{name} member {member}")
        return False

    def real_folder(self, name: str) -> bool:
        """The subfolder of ``name`` (the sharded layout's ``00000/``), if any, is a folder of the
        output, not a link to one elsewhere (looked at once a subfolder)."""
        folder = name.rpartition("/")[0]
        if not folder:
            return True
        verdict = self.folders.get(folder)
        if verdict is None:
            try:
                verdict = (os.lstat(self.prefix + folder).st_mode & 0o170000) == 0o040000  # a folder, not a link
            except OSError:
                verdict = False
            self.folders[folder] = verdict
        return verdict

    def loose_ok(self, name: str, size: Optional[int], sha: Optional[str] = None,
                 written: Optional[float] = None) -> bool:
        """A loose file's line counts: its file is a regular file (not a link) in a real subfolder,
        of the recorded size, and, where it changed after the line, of the recorded bytes."""
        if not self.real_folder(name):
            return False
        try:
            stat = os.lstat(self.prefix + name)
        except OSError:
            return False
        if (stat.st_mode & 0o170000) != 0o100000 or (size is not None and stat.st_size != size):
            return False
        return self.verified(name, None, sha, written, stat.st_mtime)

    def why_not(self, name: str) -> str:
        """Why a loose file's line does not count."""
        if name in self.changed:
            return NOT_THE_BYTES
        if not self.real_folder(name):
            return f"is in {name.rpartition('/')[0]!r}, which is not a folder of the output (a link?)"
        if os.path.isdir(self.prefix + name):
            return IN_THE_WAY
        return "is missing or not the size recorded"

    def shard_ok(self, name: str, size: Optional[int], trusted: bool) -> bool:
        verdict = self.shards.get((name, size))
        if verdict is None:
            verdict = self.shards[(name, size)] = _inside(self.folder, name) and (
                trusted or _finished(self.prefix + name, size, self.sizes))
        return verdict


def _check_lines(looked: _Looked, where: str, lines: Iterable[tuple[int, bytes]], trusted: bool, keep: _Keep,
                 problems: list[str]) -> None:
    """Each complete line of ``lines`` ((number, raw) pairs) checked: parsed, inside the folder, its
    file whole unless ``trusted``; ``keep(index, key, raw, where, number)`` for those that count."""
    for number, raw in lines:
        if not raw.endswith(b"\n"):
            continue  # a write in progress (or cut by a kill)
        parsed = _parse(raw)
        if parsed is None:
            problems.append(f"{where}:{number}: not a manifest line")
            continue
        index, name, member, size = parsed
        if _inside(looked.folder, name) and not writer_name(index, name, member):
            shown = name + (f" member {member}" if member is not None else "")
            problems.append(f"{where}:{number}: {shown!r} is not what the writer names output {index}")
            continue
        sha, at = _SHA.search(raw), _AT.search(raw)
        check = (sha.group(1).decode() if sha else None, float(at.group(1)) if at else None)
        if member is not None and looked.shard_ok(name, size, trusted):
            if trusted or looked.verified(name, member, *check):
                keep(index, (name, member), raw, where, number)
            else:
                problems.append(f"{where}:{number}: {name!r} member {member} {NOT_THE_BYTES}")
        elif not _inside(looked.folder, name):
            problems.append(f"{where}:{number}: {name!r} is outside the output folder")
        elif trusted or (member is None and looked.loose_ok(name, size, *check)):
            keep(index, (name, member), raw, where, number)
        else:
            problems.append(f"{where}:{number}: {name!r} "
                            + (looked.why_not(name) if member is None else "is missing or not the size recorded"))


def _scan(folder: Path, files: list[Path], trust_manifest: bool, keep: _Keep) -> list[str]:
    """The one reading of manifest files, line by line (``_check_lines``); returns what did not
    count, as ``file:line: why``."""
    problems: list[str] = []
    looked = _Looked(folder)
    for file in files:
        if file.is_file():
            with file.open("rb") as f:
                _check_lines(looked, file.name, enumerate(f, start=1), trust_manifest and file.name == MANIFEST,
                             keep, problems)
    return problems


def _read_blocks(looked: _Looked, file: Path, indices: array, keep: _Keep, problems: list[str]) -> None:
    """``file``'s lines block by block: a block whose lines all have the writer's shape
    (``_block_columns``) is read with a pattern and arrays (a million lines in about a second),
    any other line by line."""
    first = 1
    with file.open("rb") as f:
        rest = b""
        while True:
            data = f.read(_BLOCK)
            block = rest + data
            end = block.rfind(b"\n") + 1 if data else len(block)
            block, rest = block[:end], block[end:]
            if block:
                count = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
                found = None
                if block.endswith(b"\n") and b'"inputs": {' not in block:
                    found = _block_columns(block, count)
                if found is not None:
                    _keep_block(looked, file.name, first, found, indices, problems)
                else:
                    _check_lines(looked, file.name, enumerate(block.splitlines(keepends=True), start=first), False,
                                 keep, problems)
                first += count
            if not data:
                return


def _block_columns(block: bytes, count: int) -> Optional[tuple]:
    """The columns of a block whose ``count`` lines all have the writer's shape, else None."""
    columns = {key: _BLOCK_KEYS[key].findall(block) for key in _BLOCK_KEYS}
    if not (len(columns["index"]) == len(columns["file"]) == len(columns["bytes"]) == count
            and len(columns["member"]) == len(columns["shard_bytes"]) in (0, count)
            and len(columns["sha256"]) in (0, count) and len(columns["written"]) in (0, count)
            and block.count(b"}\n") == count):  # every line whole: a line cut short is read line by line
        return None
    members = np.full(count, bool(columns["member"]))
    tar_bytes = np.asarray(columns["shard_bytes"]).astype(np.int64) if columns["member"] else np.zeros(count, np.int64)
    member_names = np.asarray(columns["member"]) if columns["member"] else np.full(count, b"")
    shas = [sha.decode() for sha in columns["sha256"]] if columns["sha256"] else [None] * count
    written = np.asarray(columns["written"]).astype(np.float64) if columns["written"] else np.full(count, np.nan)
    return (np.asarray(columns["index"]).astype(np.int64), np.asarray(columns["file"]), members,
            np.asarray(columns["bytes"]).astype(np.int64), tar_bytes, member_names, shas, written)


def _keep_block(looked: _Looked, where: str, first: int, found: tuple, indices: array, problems: list[str]) -> None:
    index, name, members, size, tar_bytes, member_names, shas, written = found
    ok = np.zeros(len(index), dtype=bool)
    named = np.array([writer_name(i, n.decode(), m.decode() if is_member else None)
                      for i, n, m, is_member in zip(index.tolist(), name.tolist(), member_names.tolist(),
                                                    members.tolist())], dtype=bool)
    changed = np.zeros(len(index), dtype=bool)  # a tar member of the recorded tar size, changed since
    if members.any():  # one verdict per shard (and recorded size)
        names, inverse = np.unique(name[members], return_inverse=True)
        for n, value in enumerate(names.tolist()):
            rows = np.flatnonzero(members)[inverse.ravel() == n]
            for recorded in np.unique(tar_bytes[rows]).tolist():
                chosen = rows[tar_bytes[rows] == recorded]
                ok[chosen] = looked.shard_ok(value.decode(), recorded, False)
            kept = rows[ok[rows]]
            if len(kept) and shas[0] is not None and looked.changed_after(value.decode(), float(written[kept].min())):
                for row in kept.tolist():  # the tar changed after its lines: each member verified
                    changed[row] = not looked.verified(value.decode(), member_names[row].decode(), shas[row],
                                                       float(written[row]))
    ok &= ~changed
    for row in np.flatnonzero(~members).tolist():  # loose files: one look each
        text = name[row].decode()
        ok[row] = _inside(looked.folder, text) and looked.loose_ok(text, int(size[row]), shas[row], float(written[row]))
    ok &= named
    for row in np.flatnonzero(~ok).tolist():
        text = name[row].decode() + (f" member {member_names[row].decode()}" if members[row] else "")
        why = ("is outside the output folder" if not _inside(looked.folder, text)
               else f"is not what the writer names output {index[row]}" if not named[row]
               else NOT_THE_BYTES if changed[row]
               else looked.why_not(name[row].decode()) if not members[row]
               else "is missing or not the size recorded")
        problems.append(f"{where}:{first + row}: {text!r} {why}")
    indices.extend(index[ok].tolist())


def _files(folder: Path, parts: Optional[list[Path]]) -> list[Path]:
    return [folder / MANIFEST, *(sorted(folder.glob(PART_GLOB)) if parts is None else parts)]


def scan_manifest(output_dir: str | os.PathLike, parts: Optional[list[Path]] = None,
                  trust_manifest: bool = False) -> tuple[dict[int, ManifestLine], list[str]]:
    """Finished images by index, their whole lines (the merged manifest plus parts left by a running
    or killed run), and what was not counted, as ``file:line: why`` (``parts``: these parts only,
    not every one; ``trust_manifest``: the merged manifest's lines count without a look at their
    files). A line that does not parse (cut by a kill), a line whose file is gone or has another
    size than recorded (truncated, replaced), a line whose file lies outside the folder, and two
    lines for one index with different files do not count: those images are made again. An
    unterminated last line is a write in progress, not a problem. For a whole folder of a large
    run, ``finished`` reads the same in a fraction of the memory."""
    folder = Path(output_dir)
    entries: dict[int, ManifestLine] = {}
    keys: dict[int, tuple[tuple[str, Optional[str]], str]] = {}
    conflicts: list[tuple[int, str, str]] = []

    unreadable: list[str] = []

    def keep(index: int, key: tuple[str, Optional[str]], raw: bytes, name: str, number: int) -> None:
        where = f"{name}:{number}"
        try:
            entry = json.loads(raw)
        except ValueError:  # its fields where a reader looks for them, cut or garbled elsewhere
            unreadable.append(f"{where}: not a manifest line")
            return
        if index in keys and keys[index][0] != key:
            conflicts.append((index, where, keys[index][1]))
            return
        keys[index] = (key, where)
        entries[index] = entry

    problems = _scan(folder, _files(folder, parts), trust_manifest, keep) + unreadable
    for index, where, first in conflicts:
        problems.append(f"{where}: image {index} is also {keys[index][0][0]!r} ({first}); neither counts")
        entries.pop(index, None)
    return entries, problems


@dataclass
class Finished:
    """The finished images of a folder in compact form: their indices (sorted, 8 bytes each),
    what did not count, and the whole lines of those that name input files (a resume checks them)."""

    indices: np.ndarray
    problems: list[str]
    with_inputs: dict[int, ManifestLine]
    conflicted: frozenset[int] = frozenset()
    untidy: bool = False  # the merged manifest holds lines that do not count (see ``repair_manifest``)

    @property
    def in_the_way(self) -> list[str]:
        """The lines whose output's place holds a folder: a resume could not write them."""
        return [problem for problem in self.problems if problem.endswith(IN_THE_WAY)]

    def in_the_way_message(self, where: object) -> Optional[str]:
        """The refusal of a resume that would write where a folder stands, or None."""
        blocked = self.in_the_way
        if not blocked:
            return None
        shown = "; ".join(blocked[:3]) + (f"; {len(blocked) - 3} more" if blocked[3:] else "")
        return f"{where}: a folder stands where an output goes ({shown}): move it away, then run again."

    def __len__(self) -> int:
        return len(self.indices)

    def in_shard(self, shard: Optional[tuple[int, int]]) -> np.ndarray:
        return select(self.indices, shard)


def finished(output_dir: str | os.PathLike, parts: Optional[list[Path]] = None) -> Finished:
    """``scan_manifest``'s verdicts for every line, keeping only each image's index (and its line
    when it names input files): a resume or ``status`` of a million-image folder reads each line
    once with a pattern (its JSON only where the pattern does not fit) and stats each file once
    (a tar shard once for all its members). Two lines for one index (rare: a merge cut by a kill
    repeats a part) are looked at again, alone, to tell a repeat from a conflict."""
    folder = Path(output_dir)
    files = _files(folder, parts)
    indices = array("q")
    with_inputs: dict[int, ManifestLine] = {}

    def keep(index: int, key: tuple[str, Optional[str]], raw: bytes, name: str, number: int) -> None:
        indices.append(index)
        if b'"inputs": {' in raw:
            with_inputs[index] = json.loads(raw)

    problems: list[str] = []
    looked = _Looked(folder)
    cut, in_manifest = False, 0
    for file in files:
        if file.is_file():
            _read_blocks(looked, file, indices, keep, problems)
            if file.name == MANIFEST:
                cut = _cut(file)
                in_manifest = len(indices)
    index_array = np.frombuffer(indices, dtype=np.int64) if len(indices) else np.zeros(0, dtype=np.int64)
    untidy = cut or any(problem.startswith(MANIFEST + ":") for problem in problems)
    if not untidy and (folder / MANIFEST).is_file():
        merged = index_array[:in_manifest]
        untidy = len(np.unique(merged)) != len(merged)
    unique, counts = np.unique(index_array, return_counts=True)
    repeated = set(unique[counts > 1].tolist())
    conflicted: set[int] = set()
    if repeated:  # the lines of those indices, with their files: a repeat counts, a conflict does not
        seen: dict[int, tuple[tuple[str, Optional[str]], str]] = {}

        def compare(index: int, key: tuple[str, Optional[str]], raw: bytes, name: str, number: int) -> None:
            if index not in repeated:
                return
            where = f"{name}:{number}"
            if index in seen and seen[index][0] != key:
                problems.append(f"{where}: image {index} is also in {seen[index][1]} with another file; neither counts")
                conflicted.add(index)
            seen.setdefault(index, (key, where))

        _scan(folder, files, False, compare)
        if conflicted:
            unique = np.setdiff1d(unique, np.asarray(sorted(conflicted), dtype=np.int64), assume_unique=True)
            for index in conflicted:
                with_inputs.pop(index, None)
    return Finished(unique, problems, with_inputs, frozenset(conflicted), untidy)


def _cut(file: Path) -> bool:
    """The file ends inside a line (a merge killed mid-write)."""
    with file.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        if not end:
            return False
        f.seek(end - 1)
        return f.read(1) != b"\n"


def repair_manifest(output_dir: str | os.PathLike, found: Finished) -> int:
    """Rewrite ``manifest.jsonl`` with only the lines that count, once each, when ``found``
    (``finished`` of the folder, its parts merged) says it holds others: a line cut by a kill, a
    line whose file is gone or truncated (the image is made again and appended), a repeat or a
    conflict. Merges only append, so without this a resume would leave the stale line beside the
    new one. Rare, and then the whole file is read once; the rewrite is atomic, under the merge
    lock, and keeps the lines a sibling shard appended since ``found`` was read. Returns the lines
    dropped."""
    if not found.untidy:
        return 0
    folder = Path(output_dir)
    path = folder / MANIFEST
    with merge_lock(folder):
        written = np.zeros(int(found.indices.max()) + 1 if len(found.indices) else 0, dtype=bool)
        dropped = int(_cut(path))

        def write(out) -> None:
            nonlocal written, dropped
            chunk: list[bytes] = []

            def keep(index: int, key: tuple[str, Optional[str]], raw: bytes, name: str, number: int) -> None:
                nonlocal written, dropped
                if index >= len(written):  # appended by a sibling shard since ``found``
                    written = np.concatenate([written, np.zeros(index + 1 - len(written) + len(written) // 2, bool)])
                if index in found.conflicted or written[index]:
                    dropped += 1
                    return
                written[index] = True
                chunk.append(raw)
                if len(chunk) >= 10_000:
                    out.write(b"".join(chunk))
                    chunk.clear()

            problems = _scan(folder, [path], False, keep)  # the lines that do not count
            dropped += len(problems)
            out.write(b"".join(chunk))

        atomic_write(path, write)
    return dropped


def merge_manifest(output_dir: str | os.PathLike, shard: Optional[tuple[int, int]] = None,
                   live_jobs: Sequence[str] = ()) -> np.ndarray:
    """Append the finished lines of the parts to ``manifest.jsonl``, part after part, and drop the
    parts; returns the indices appended. A merge costs in proportion to its parts: the manifest is
    only appended to, never read or rewritten, so the 16 shards of a job array merging into a
    manifest of a million lines cost what one merge of those lines costs; lines go through as they
    were written (bytes, never held all at once). A shard's run leaves alone the parts its sibling
    shards still append to. A line cut by a kill at the manifest's end is ended first (it stays a
    line that does not parse)."""
    folder = Path(output_dir)
    indices = array("q")
    with merge_lock(folder):
        parts = _parts_to_merge(folder, shard, live_jobs=live_jobs)
        with open(folder / MANIFEST, "a+b") as out:  # created if missing: a run that made nothing has one
            end = out.seek(0, os.SEEK_END)
            if end:
                out.seek(end - 1)
                if out.read(1) != b"\n":
                    out.write(b"\n")
            chunk: list[bytes] = []

            def keep(index: int, key: tuple[str, Optional[str]], raw: bytes, name: str, number: int) -> None:
                indices.append(index)
                chunk.append(raw)
                if len(chunk) >= 10_000:
                    out.write(b"".join(chunk))
                    chunk.clear()

            _scan(folder, parts, False, keep)
            out.write(b"".join(chunk))
            out.flush()
            os.fsync(out.fileno())
        for part in parts:
            part.unlink(missing_ok=True)
    return np.frombuffer(indices, dtype=np.int64) if len(indices) else np.zeros(0, dtype=np.int64)


def changed_since(lines: dict[int, ManifestLine], most: int = 5) -> list[str]:
    """Finished outputs (manifest lines by index) whose input files are gone or no longer have the
    SHA-256 they were made from: resuming would keep pictures of other inputs. A file whose size
    and modification time are those recorded is not read again (a resume of a large data set
    stays a stat a file)."""
    digests: dict[str, Optional[str]] = {}
    changed = []
    for index, line in sorted(lines.items()):
        for name, files in (line.get("inputs") or {}).items():
            for entry in files if isinstance(files, list) else [files]:
                path = entry.get("file")
                if path not in digests:
                    exists = bool(path) and Path(path).is_file()
                    same = exists and {k: entry.get(k) for k in ("bytes", "mtime_ns")} == file_stat(path)
                    digests[path] = entry.get("sha256") if same else sha256(path) if exists else None
                if digests[path] != entry.get("sha256"):
                    what = "is gone" if digests[path] is None else "changed"
                    changed.append(f"output {index} ({line.get('file')}): its {name} {path} {what} since it was made")
        if len(changed) >= most:
            break
    return changed[:most]
