"""``OutputLock``: one run at a time per output folder (or per shard of it), and no stale lock left
by a dead run.

The lock is ``.lock`` in the folder (``.lock.shard-T-of-N`` for shard T of N of a job array),
created atomically, holding the host and pid of its run. The holder refreshes its modification time
every ``HEARTBEAT_S``. Another run takes it over when the holder's pid is gone (same host), the
heartbeat is older than ``STALE_S`` (any host), or the holder was an earlier run of the same SLURM
job (a requeued job starts only after its previous run ended). The shards of one count write beside
each other; a run of the whole set, or shards of another count, would make the same images and wait
for them (``conflicting_runs``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Optional, TypedDict

from lightning_diffusion.core.console import counted
from lightning_diffusion.core.system import pid_alive
from lightning_diffusion.output.manifest import merge_lock
from lightning_diffusion.output.pool import FolderPoolFiles, WorkerRecord, live_workers
from lightning_diffusion.output.shard import Shard, shard_name

HEARTBEAT_S = 30.0
STALE_S = 120.0


def pool_beside_deal_message(where: object, workers: Mapping[str, WorkerRecord]) -> str:
    """The refusal of a run that deals its work where a pool's live ``workers`` write ``where``."""
    jobs = sorted({str(worker.get("job")) for worker in workers.values()})
    named = f"job{'s' if len(jobs) > 1 else ''} {', '.join(jobs)}"
    return (f"{where} is being written by a pool of {counted(len(workers), 'worker')} ({named}); set "
            "data.schedule: pull to join it, or wait for it to end.")


def deal_beside_pool_message(where: object, runs: dict[Optional[tuple[int, int]], str]) -> str:
    """The refusal of a job that joins a pool (``data.schedule: pull``) where ``runs`` (live runs
    that deal their work: shard or None -> holder) write ``where``."""
    which = ", ".join("a run of the whole prompt set" if other is None else f"shard {other[0]} of {other[1]}"
                      for other in runs)
    return (f"{where} is being written by {which} ({', '.join(runs.values())}), which deals its work: a job with "
            "data.schedule: pull joins only a pool. Wait for it to end, or choose another writer.output_dir.")


LOCK = ".lock"


class LockState(TypedDict, total=False):
    """A lock as ``status`` shows it (``OutputLock.describe``, a bucket's ``lock_state``): its holder
    as the lock file records it (``host``, ``pid``, ``since``, ``token``; a bucket's ``run``,
    ``slurm_job`` and ``heartbeat``), the heartbeat's age and whether it is ``live``. JSON, as the
    file it is read from."""

    host: str
    pid: int
    since: float
    token: str
    run: str
    slurm_job: Optional[str]
    heartbeat: float
    heartbeat_age_s: float
    live: bool


def lock_name(shard: Optional[tuple[int, int]]) -> str:
    return LOCK if shard is None else f"{LOCK}.{shard_name(shard)}"


def shard_of_lock(name: str) -> Optional[Shard]:
    """The shard whose lock file (or object) is called ``name``; None for any other name."""
    found = re.fullmatch(r"\.lock\.shard-(\d+)-of-(\d+)", name)
    return Shard(int(found.group(1)), int(found.group(2))) if found else None


def live_locks(folder: Path) -> dict[Optional[tuple[int, int]], str]:
    """The folder's live runs by shard (None: a run of the whole prompt set), described."""
    found: dict[Optional[tuple[int, int]], str] = {}
    for path in sorted(Path(folder).glob(f"{LOCK}*")):
        shard = shard_of_lock(path.name)
        if path.name != LOCK and shard is None:
            continue
        holder = OutputLock(folder, shard).holder()
        if holder is not None:
            found[shard] = holder
    return found


def conflicting_runs(folder: Path, shard: Optional[tuple[int, int]]) -> list[str]:
    """Live runs that share images with a run of ``shard``: a run of the whole set beside any
    shard, and shards of another count (shard 0 of 4 and shard 0 of 8 both hold image 0)."""
    conflicts = []
    for other, holder in live_locks(folder).items():
        if other == shard:
            continue
        if shard is None or other is None or other[1] != shard[1]:
            what = "a run of the whole prompt set" if other is None else f"shard {other[0]} of {other[1]}"
            conflicts.append(f"{what} ({holder})")
    return conflicts


def busy_message(folder: Path, shard: Optional[tuple[int, int]], holder: Optional[str],
                 pull: bool = False) -> Optional[str]:
    """Why a run of ``shard`` cannot write ``folder``: ``holder`` (the live run holding its lock),
    live runs of other shards that make some of the same images, or a pool of workers
    (``data.schedule: pull``) for a run that deals its work; for a run that joins the pool (``pull``),
    a live run that deals its work. None when it can."""
    if pull:
        runs = live_locks(folder)
        return deal_beside_pool_message(folder, runs) if runs else None
    if holder is not None:
        which = "" if shard is None else f"shard {shard[0]} of {shard[1]} of "
        return (f"{which}{folder} is being written by another run ({holder}); wait for it to end or choose another "
                "writer.output_dir.")
    others = conflicting_runs(folder, shard)
    if others:
        return (f"{folder} is being written by {', '.join(others)}, which makes some of the same images; wait for it "
                "to end, or run the same shard count (data.num_shards).")
    workers = live_workers(FolderPoolFiles(folder))
    return pool_beside_deal_message(folder, workers) if workers else None


class OutputLock:
    """The lock of a folder (or of a shard of it). Taken, and taken over, under the folder's merge
    lock, as a run's publications check it (``fence.FolderFence``): a run whose lock was taken over
    (frozen past ``STALE_S``) publishes nothing more. ``token`` names this holder in the lock file."""

    def __init__(self, folder: Path, shard: Optional[tuple[int, int]] = None) -> None:
        self.path = Path(folder) / lock_name(shard)
        self._stop = threading.Event()
        self._held = False
        self.token = os.urandom(8).hex()

    def holder(self) -> Optional[str]:
        """A description of the live run holding the lock, or None if it is free or stale."""
        try:
            owner = json.loads(self.path.read_text())
            age = time.time() - self.path.stat().st_mtime
        except (OSError, ValueError):
            return None
        job = os.environ.get("SLURM_JOB_ID")
        if job is not None and owner.get("slurm_job") == job:
            return None
        same_host = owner.get("host") == socket.gethostname()
        if same_host and not pid_alive(int(owner.get("pid", 0))):
            return None
        if age > STALE_S:
            return None
        return f"pid {owner.get('pid')} on {owner.get('host')}"

    def describe(self) -> Optional[LockState]:
        """The lock's holder as recorded (host, pid, SLURM job, start), its heartbeat age and
        whether it still counts as live; None when there is no lock. Reads only."""
        try:
            owner = json.loads(self.path.read_text())
            age = time.time() - self.path.stat().st_mtime
        except (OSError, ValueError):
            return None
        return {**owner, "heartbeat_age_s": round(age, 1), "live": self.holder() is not None}

    def acquire(self) -> Optional[str]:
        """Take the lock; return None, or a description of the run that holds it."""
        with merge_lock(self.path.parent):  # a takeover and a publication of the run it replaces are ordered
            return self._acquire()

    def _acquire(self) -> Optional[str]:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is not None:
                    return holder
                self.path.unlink(missing_ok=True)  # stale: its run is gone
                continue
            with os.fdopen(fd, "w") as f:
                owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "token": self.token}
                if "SLURM_JOB_ID" in os.environ:
                    owner["slurm_job"] = os.environ["SLURM_JOB_ID"]
                json.dump(owner, f)
            self._held = True
            threading.Thread(target=self._heartbeat, name="output-lock-heartbeat", daemon=True).start()
            return None
        return self.holder() or "another run"

    def ours(self) -> bool:
        """Whether the lock file is still this holder's (another run takes over a stale lock)."""
        try:
            return json.loads(self.path.read_text()).get("token") == self.token
        except (OSError, ValueError):
            return False

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.ours():  # taken over while this run was frozen: another run's to renew
                    return
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Give the lock back: removed only while it is still this holder's (a run frozen past the
        lock's staleness, then stopped, must not remove the lock of the run that took it over)."""
        self._stop.set()
        if self._held:
            self._held = False
            with merge_lock(self.path.parent):
                if self.ours():
                    self.path.unlink(missing_ok=True)
