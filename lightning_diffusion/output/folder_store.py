"""An output folder as a ``store.OutputStore``.

``FolderStore`` is a folder that every rank
sees (one file system: a local disk, NFS, Lustre, GPFS): its lock (``lock``), ``run.json`` and the
shards' run records, the manifest parts each rank appends to and their merge (``manifest``). The
files themselves are written by ``files.OutputFiles`` (encoding, atomic renames, tar shards), in
the writer process or threads (``background``).

``prepare`` runs on global rank 0 before any image is made: it takes the lock, refuses a folder made
with other settings (or from input files that changed since), removes the temporaries of a run that
was killed, merges its leftover parts and returns the indices already made. ``merge`` and ``record``
run on global rank 0 once every rank's writing has ended.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Union

import numpy as np

from lightning_diffusion.core.checks import LEASE_S
from lightning_diffusion.core.console import log
from lightning_diffusion.core.records import RejectedLine, RunSettings, RunSummary
from lightning_diffusion.output.fence import FolderFence
from lightning_diffusion.output.files import remove_temporary, stale_temporaries, worker_temporaries
from lightning_diffusion.output.lock import OutputLock, busy_message, live_locks
from lightning_diffusion.output.manifest import (
    MANIFEST,
    PART_GLOB,
    REJECTED,
    RUN_FILE,
    RUN_META,
    atomic_write,
    merge_failures,
    merge_lock,
    part_counts,
    part_name,
    parts_glob,
    rejected_images,
    settings_conflict,
)
from lightning_diffusion.output.pool import FolderPoolFiles, Pool, gone_workers, live_jobs, log_joined, quit_join
from lightning_diffusion.output.recorded import finished, merge_manifest, repair_manifest
from lightning_diffusion.output.settings import WriterSettings
from lightning_diffusion.output.shard import (
    Shard,
    adopt,
    first_plan,
    in_shard,
    owners_bytes,
    plan_file,
    recorded_owners,
    select,
    shard_name,
)
from lightning_diffusion.output.status import JobArrays, RunStatus, folder_status

if TYPE_CHECKING:
    from lightning_diffusion.output.recorded import Finished

# Kernel file systems that hold no files of ours (writes fail or vanish); from /proc/mounts.
PSEUDO_FILE_SYSTEMS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                       "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs", "autofs",
                       "binfmt_misc", "efivarfs", "rpc_pipefs", "nsfs"}


def mount_of(path: Path) -> Optional[tuple[str, str]]:
    """The mount point and file system type that hold ``path`` (an existing path), from
    /proc/mounts; None where that file is absent (not Linux)."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved, best = str(path.resolve()), None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2])
    return best


def _read_only(path: Path) -> bool:
    """Whether ``path`` is on a read-only file system; False where statvfs cannot tell (a stale
    network mount answers the write checks that follow instead)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def output_dir_problems(path: Path) -> list[str]:
    """``writer.output_dir``: a folder (or one that can be made) on a writable file system that
    stores files: not below a file, not read-only, not a kernel pseudo file system (/proc, /sys)."""
    if path.exists() and not path.is_dir():
        return [f"writer.output_dir {str(path)!r} is a file, not a folder."]
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        return [f"writer.output_dir {str(path)!r} is below {str(existing)!r}, which is a file."]
    mount = mount_of(existing)
    if mount is not None and mount[1] in PSEUDO_FILE_SYSTEMS:
        return [f"writer.output_dir {str(path)!r} is on {mount[0]}, a {mount[1]} file system of the kernel that "
                "stores no files: choose a folder on a disk."]
    if hasattr(os, "statvfs") and _read_only(existing):
        where = f" ({mount[0]})" if mount is not None else ""
        return [f"writer.output_dir {str(path)!r} is on a read-only file system{where}: choose a writable folder."]
    if not os.access(existing, os.W_OK):
        if existing == path:
            return [f"writer.output_dir {str(path)!r} is not writable by this user."]
        return [f"writer.output_dir {str(path)!r} cannot be created: {str(existing)!r} is not writable."]
    return []



class FolderStore:
    """An output folder shared by every rank (``OutputStore``) for a run of ``shard`` (None: the
    whole prompt set). ``allow_config_change``: resume into a folder made with other settings."""

    needs_shared_folder = True
    is_folder = True

    def __init__(self, folder: Path, shard: Optional[Shard], allow_config_change: bool = False,
                 pool: Optional[str] = None, lease_s: Optional[float] = None) -> None:
        self.folder = folder
        self.pool = pool  # this job's name in a pool of workers (``data.schedule: pull``), else None
        self.lease_s = lease_s or LEASE_S
        self.worker: Optional[Pool] = None  # the job's first worker, registered by ``prepare`` (a pool's)
        self.where = str(folder)
        self.local_dir = folder
        self.shard = shard
        self.allow_config_change = allow_config_change
        self.expected: Optional[int] = None
        self._history: list = []
        self._lock: Optional[OutputLock] = None
        self.adopted = False  # the shard deals as the folder's recorded plan, not as this run computed
        # (the lock file's name, the token this run wrote there): set where the lock was taken (global
        # rank 0), and handed to the other ranks by the writer, whose publications check it (``fence``)
        self.lock_token: Optional[tuple[str, str]] = None

    @classmethod
    def open(cls, location: Union[str, os.PathLike[str]], shard: Optional[Shard], *, allow_config_change: bool = False,
             options: Optional[Mapping[str, Any]] = None, staging_dir: Optional[str] = None,
             pool: Optional[str] = None, lease_s: Optional[float] = None) -> "FolderStore":
        """``store.open_store``'s folder (``options`` and ``staging_dir`` are a bucket's)."""
        return cls(Path(location).expanduser(), shard, allow_config_change, pool, lease_s)

    # --- read side (``store.OutputStore``) ------------------------------------------------------

    @property
    def manifest_where(self) -> str:
        return str(self.folder / MANIFEST)

    @staticmethod
    def settings_problems(settings: WriterSettings) -> list[str]:
        return output_dir_problems(Path(str(settings.output_dir)).expanduser())

    def write_problems(self) -> list[str]:
        return []  # the folder's checks are ``settings_problems`` and the lock's, when the run starts

    def read_problems(self, what: str) -> list[str]:
        return [] if self.folder.is_dir() else [f"{what} {self.folder} is not a folder."]

    def made(self) -> tuple[np.ndarray, set[int]]:
        if not self.folder.is_dir():
            return np.zeros(0, dtype=np.int64), set()
        indices = finished(self.folder).indices
        return indices, rejected_images(self.folder) - set(indices.tolist())

    def live_locks(self) -> dict[Optional[tuple[int, int]], str]:
        return live_locks(self.folder) if self.folder.is_dir() else {}

    @contextlib.contextmanager
    def local_records(self, what: str) -> Iterator[Path]:
        yield self.folder

    def status(self, now: Optional[float] = None, arrays: Optional[JobArrays] = None) -> RunStatus:
        return folder_status(self.folder, now, arrays)

    @property
    def parts_glob(self) -> str:
        """This run's manifest parts (of its shard, if it makes one)."""
        return parts_glob(self.shard, self.pool)

    def part(self, rank: int) -> Path:
        return self.folder / part_name(self.shard, rank, self.pool)

    def pool_files(self) -> FolderPoolFiles:
        """Where the pool's workers register and claim batches (``pool.Pool``)."""
        return FolderPoolFiles(self.folder)

    def _other_jobs(self) -> list[str]:
        """The other jobs of the pool whose workers work now."""
        return sorted(live_jobs(FolderPoolFiles(self.folder)) - {str(self.pool)})

    def publisher(self, rank: int) -> None:
        return None  # files are written in place

    def fence(self, publisher: None) -> Optional[FolderFence]:
        """Publication under the folder's merge lock (``fence``): a pool's, checking its claims; a
        run's that deals, checking that its lock (``lock_token``) is still its own."""
        if self.pool is not None:
            return FolderFence(self.folder)
        if self.lock_token is not None:
            return FolderFence(self.folder, (self.lock_token[0], self.lock_token[1]))
        return None

    @property
    def record_file(self) -> Path:
        """Where this run's history goes: ``run.json``, or its shard's ``run.shard-T-of-N.json``."""
        name = shard_name(self.shard)
        return self.folder / (RUN_FILE if name is None else f"run.{name}.json")

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _refuse(self, message: str) -> tuple[Optional[str], np.ndarray]:
        self.release()
        return message, np.zeros(0, dtype=np.int64)

    def prepare(self, settings: RunSettings, expected: Optional[int],
                total: Optional[int]) -> tuple[Optional[str], np.ndarray]:
        self.expected = expected
        nothing = np.zeros(0, dtype=np.int64)
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.pool is not None:
            return self._join(settings, total)
        self._lock = OutputLock(self.folder, self.shard)
        holder = self._lock.acquire()
        busy = busy_message(self.folder, self.shard, holder)
        if holder is not None:
            return busy, nothing  # the lock is the other run's
        self.lock_token = (self._lock.path.name, self._lock.token)
        if busy is not None:
            return self._refuse(busy)
        self._sweep()
        run_file = self.folder / RUN_FILE
        if run_file.is_file():
            conflict = None if self.allow_config_change else settings_conflict(self.folder, settings)
            if conflict:
                return self._refuse(conflict)
        try:
            self._history = list(json.loads(self.record_file.read_text()).get("history") or [])
        except (OSError, ValueError):
            self._history = []
        if self.shard is None:
            self._write_run_file(settings)
        else:  # shards share run.json (the same settings), made by the first; each keeps its history beside it
            with merge_lock(self.folder):
                conflict = None if self.allow_config_change else settings_conflict(self.folder, settings)
                if conflict:  # another shard made it meanwhile, with other settings
                    return self._refuse(conflict)
                if not run_file.is_file():
                    self._write_run_file(settings, run_file, total, history=[])
                conflict = self._record_plan(total)
                if conflict:
                    return self._refuse(conflict)
            self._write_run_file({"shard": list(self.shard)})
        if any(self.folder.glob(PART_GLOB)):
            merge_manifest(self.folder, self.shard)
        found = finished(self.folder)
        blocked = found.in_the_way_message(self.folder)
        if blocked:
            return self._refuse(blocked)
        self._repair(found)
        done = found.in_shard(self.shard)
        changed = self._inputs_changed(found)
        return (self._refuse(changed) if changed else (None, done))

    def _join(self, settings: RunSettings, total: Optional[int]) -> tuple[Optional[str], np.ndarray]:
        """``prepare`` for a job of a pool (``data.schedule: pull``): no lock (the jobs of a pool
        write beside each other), the settings compared with run.json's as any resume's, the parts
        of jobs that ended merged, the leftovers of killed runs cleaned only where no other job works."""
        nothing = np.zeros(0, dtype=np.int64)
        # Registered first, checked after: a run that deals takes its lock first and looks for a pool
        # after, so of two starting together at least one sees the other.
        self.worker = Pool(FolderPoolFiles(self.folder), str(self.pool), 0, self.lease_s)
        self.worker.start()
        busy = busy_message(self.folder, None, None, pull=True)
        if busy is not None:
            return quit_join(self, busy), nothing
        others = self._other_jobs()
        if not others:
            self._sweep()
        else:  # the temporaries of the pool's workers that are gone (theirs carry their names)
            self._sweep(worker_temporaries(self.folder, gone_workers(FolderPoolFiles(self.folder), self.lease_s)))
        run_file = self.folder / RUN_FILE
        with merge_lock(self.folder):
            conflict = None if self.allow_config_change else settings_conflict(self.folder, settings)
            if conflict:
                return quit_join(self, conflict), nothing
            if not run_file.is_file():
                self._write_run_file(settings, run_file, total, history=[])
        if any(self.folder.glob(PART_GLOB)):
            merge_manifest(self.folder, None, live_jobs=others)
        found = finished(self.folder)
        if not others:
            self._repair(found)
        changed = self._inputs_changed(found)
        if changed:
            return quit_join(self, changed), nothing
        log_joined(self.folder, others, total, len(found.indices))
        return None, found.indices

    def _sweep(self, stale: Optional[list[Path]] = None) -> None:
        """Remove the temporaries of an earlier run that was killed (where its parts were left
        unmerged, in the images' folders too), or ``stale``."""
        if stale is None:
            stale = stale_temporaries(self.folder, self.shard, deep=any(self.folder.glob(PART_GLOB)))
        for path in stale:
            remove_temporary(path)
        if stale:
            log.info("%s: removed %d half-written temporary file%s of an earlier run that was stopped.",
                     self.folder, len(stale), "" if len(stale) == 1 else "s")

    def _repair(self, found: Finished) -> None:
        """Drop the manifest's lines that do not count (their files are gone or cut)."""
        dropped = repair_manifest(self.folder, found)
        if dropped:
            shown = "; ".join(found.problems[:3]) + (f"; {len(found.problems) - 3} more" if found.problems[3:] else "")
            log.info("%s: %d line%s that did not count left the manifest%s; their images are made again.",
                     self.folder / MANIFEST, dropped, "" if dropped == 1 else "s",
                     f" ({shown})" if shown else " (lines repeated or cut)")

    def _inputs_changed(self, found: Finished) -> Optional[str]:
        """Why the folder's pictures no longer match their input files (their records' images
        changed since), or None."""
        with_inputs = {i: line for i, line in found.with_inputs.items() if in_shard(i, self.shard)}
        if self.allow_config_change or not with_inputs:
            return None
        from lightning_diffusion.output.recorded import changed_since

        changed = changed_since(with_inputs)
        if not changed:
            return None
        return (f"{self.folder} holds pictures made from input files that changed: " + "; ".join(changed)
                + ". Restore them, use another writer.output_dir, or writer.allow_config_change=true to keep those "
                "pictures anyway.")

    def _record_plan(self, total: Optional[int]) -> Optional[str]:
        """The shard plan (``shard.plan_file``): written by the first task of its count
        (``shard.first_plan``), adopted by the others. Called under the merge lock."""
        assert self.shard is not None
        owners, count = self.shard.owners, self.shard.num_shards
        if owners is None or total is None:
            return None
        path = self.folder / plan_file(count)
        recorded = recorded_owners(self.folder, count)
        if recorded is None:
            recorded = first_plan(self, count, total, lambda: owners)
            atomic_write(path, lambda f: f.write(owners_bytes(recorded)))
        self.adopted = not np.array_equal(recorded, owners)
        self.shard, problem = adopt(self.shard, recorded, total, str(path))
        self.expected = self.shard.size(total)
        return problem

    def shard_plan(self, num_shards: int) -> Optional[np.ndarray]:
        return recorded_owners(self.folder, num_shards)

    def ran_shards_of(self, num_shards: int) -> bool:
        """Whether shards of ``num_shards`` left their run records here."""
        return any(self.folder.glob(f"run.shard-*-of-{num_shards}.json"))

    def _write_run_file(self, settings: RunSettings, path: Optional[Path] = None, expected: Optional[int] = None,
                        history: Optional[list[RunSummary]] = None) -> None:
        """run.json (or the shard's record): the settings that decide the pictures, the expected
        count, the runs' summaries."""
        content = {**settings, "expected": self.expected if expected is None else expected,
                   "history": self._history if history is None else history}
        atomic_write(path or self.record_file, lambda f: f.write(json.dumps(content, indent=2).encode("utf-8")))

    def write_rejected(self, lines: list[RejectedLine], rejected: bool) -> None:
        """Written anew by each run: the verdicts of the prompt file as it is now."""
        if not rejected and not (self.folder / REJECTED).exists():
            return
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        atomic_write(self.folder / REJECTED, lambda f: f.write(text.encode("utf-8")))

    def merge(self, done: np.ndarray) -> tuple[dict[int, int], np.ndarray, int]:
        parts = part_counts(self.folder, self.parts_glob)
        others = self._other_jobs() if self.pool is not None else []
        merged = merge_manifest(self.folder, self.shard, live_jobs=others)
        # a pool's: every image recorded now, the other jobs' too (their parts still being appended)
        done = finished(self.folder).indices if self.pool is not None else np.union1d(done, select(merged, self.shard))
        return parts, done, merge_failures(self.folder, self.shard, done, live_jobs=others)

    def record(self, summary: RunSummary) -> None:
        if self.pool is not None:  # the jobs of a pool add to one history, one at a time
            with merge_lock(self.folder):
                content = json.loads((self.folder / RUN_FILE).read_text())
                content["history"] = [*(content.get("history") or []), summary]
                atomic_write(self.folder / RUN_FILE, lambda f: f.write(json.dumps(content, indent=2).encode("utf-8")))
            return
        self._history.append(summary)
        settings = json.loads(self.record_file.read_text())
        self._write_run_file({k: v for k, v in settings.items() if k not in RUN_META})
