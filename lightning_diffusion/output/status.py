"""How far a run is, read from its store alone (``OutputStore.status``, which ``lightning-diffusion
status`` prints): outputs done and expected, what each writing rank has flushed, the rate over the
last minutes and an ETA, the locks, each shard of a job array, a pool's workers.

Reads only: safe while a job writes, from any machine that reaches the store. What a batch scheduler
knows of the tasks submitted into a folder comes in as ``JobArrays`` (the ``status`` command gives
SLURM's).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, TypedDict

import numpy as np

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import AuditSummary, RunSummary
from lightning_diffusion.output.audit import folder_audit
from lightning_diffusion.output.lock import LockState, OutputLock, live_locks
from lightning_diffusion.output.manifest import (
    FAILED,
    FAILURES_GLOB,
    MANIFEST,
    RUN_FILE,
    count_lines,
    part_counts,
    recent_written,
    rejected_images,
)
from lightning_diffusion.output.pool import POOL, FolderPoolFiles, pool_summary
from lightning_diffusion.output.recorded import finished
from lightning_diffusion.output.shard import Shard, recorded_owners

if TYPE_CHECKING:
    from lightning_diffusion.output.pool import PoolSummary

RATE_WINDOW_S = 300.0


# What ``status`` reads and prints (``--json`` writes it as it is), hence TypedDicts.
class ArraySubmission(TypedDict, total=False):
    """A job array submitted into a folder (a line of the job folder's ``array.json``): its ``job``,
    ``num_shards``, the ``shards`` submitted, the images ``expected`` and when it was ``submitted``."""

    job: str
    num_shards: int
    shards: list[int]
    expected: int
    submitted: float


class RunStats(TypedDict):
    """A shard's (or a folder's) runs summed (``run_stats``)."""

    made: int
    failed: int
    rejected: int
    predict_s: float
    images_per_s: Optional[float]


class ShardStatus(TypedDict, total=False):
    """One shard of a job array (``shard_status``): ``done`` of ``expected``, whether a run of it
    is ``running`` (``since`` when), its SLURM job and task state, its ``runs`` and their stats."""

    shard: int
    done: int
    expected: int
    running: bool
    since: Optional[float]
    slurm_job: Optional[str]
    slurm_state: str
    runs: int
    stats: RunStats


class RunStatus(TypedDict, total=False):
    """How far a run is (``OutputStore.status``; ``folder_status`` says each key)."""

    folder: str
    done: int
    expected: Optional[int]
    rejected: int
    failed: int
    complete: bool
    running: bool
    by_rank: dict[str, int]
    rate_per_s: Optional[float]
    rate_live: bool
    eta_s: Optional[float]
    lock: Optional[LockState]
    slurm_job: Optional[str]
    not_counted: list[str]
    last_run: Optional[RunSummary]
    shards: list[ShardStatus]
    pool: Optional[PoolSummary]
    audit: Optional[AuditSummary]
    adapter_sets: Optional[int]  # the sets of adapters the records choose (``model.adapters``)
    images_per_device_h: Optional[float]  # the ``status`` command's, beside the rate


class JobArrays(Protocol):
    """What a batch scheduler knows of the job arrays submitted into an output folder: the last
    submission and the state of each task."""

    # The states in which a task holds or will hold its shard (queued or running).
    active_states: Collection[str]

    def submitted(self, folder: Path) -> Optional[ArraySubmission]:
        """The last array submitted into ``folder`` (``num_shards``, ``expected``, ``job``); None
        where none was."""
        ...

    def states(self, folder: Path) -> dict[int, dict[int, dict[str, str]]]:
        """Each task submitted into ``folder`` (its ``job`` and ``state``), by shard count and shard."""
        ...


def folder_status(folder: Path, now: Optional[float] = None, arrays: Optional[JobArrays] = None) -> RunStatus:
    """``FolderStore.status``: the status of output folder ``folder`` at time ``now`` (default:
    this moment); ``arrays``: the scheduler's record of the job arrays submitted into it."""
    now = time.time() if now is None else now
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder.")
    run_file = folder / RUN_FILE
    parts = part_counts(folder)
    submitted = arrays.submitted(folder) if arrays is not None else None
    if not run_file.is_file() and not (folder / MANIFEST).is_file() and not parts and submitted is None:
        raise ConfigError(f"{folder} is not an output folder of lightning-diffusion: it has no {RUN_FILE} and no "
                          f"{MANIFEST}.")
    try:
        run = json.loads(run_file.read_text()) if run_file.is_file() else {}
    except ValueError:
        raise ConfigError(f"{run_file} is not valid JSON.") from None
    found = finished(folder)
    indices, problems = found.indices, found.problems
    expected = run.get("expected", (submitted or {}).get("expected"))
    lock = OutputLock(folder).describe()
    running = bool(lock and lock["live"])
    history = run.get("history") or []
    done = len(indices)
    rejected = rejected_images(folder)
    rejected = set(np.setdiff1d(np.asarray(sorted(rejected), dtype=np.int64), indices).tolist()) if rejected else set()
    shards = shard_status(folder, indices, expected, shard_count(folder, submitted), rejected, arrays)
    pool = pool_summary(FolderPoolFiles(folder)) if (folder / POOL).is_dir() else None
    # While a run goes: since the folder's lock was taken, the earliest live shard's (a job array), or
    # the earliest live worker's of a pool (the pool's rate: every job's outputs)
    starts = ([(lock or {}).get("since") if running else None] + [shard["since"] for shard in shards]
              + [worker.get("since") for worker in (pool["workers"] if pool else []) if worker["live"]])
    since = min((t for t in starts if t is not None), default=None)
    rate = write_rate(recent_written(folder), now, since, history)
    failed = count_lines(folder / FAILED) + sum(count_lines(p) for p in folder.glob(FAILURES_GLOB))
    complete = expected is not None and done + len(rejected) >= expected
    running = running or bool(pool and any(worker["live"] for worker in pool["workers"]))
    active = arrays.active_states if arrays is not None else ()
    # a task still queued counts: the array is not over
    running = running or any(shard["running"] or shard.get("slurm_state") in active for shard in shards)
    eta = (expected - done) / rate if running and rate and expected is not None and not complete else None
    return {
        "folder": str(folder),
        "done": done,
        "expected": expected,
        "rejected": len(rejected),
        "failed": failed,
        "complete": complete,
        "running": running,
        "by_rank": {str(rank): count for rank, count in sorted(parts.items())},
        "rate_per_s": rate,
        "rate_live": since is not None,  # over the last minutes of a live run, else the last run's own
        "eta_s": eta,
        "lock": lock,
        "slurm_job": (lock or {}).get("slurm_job") or (history[-1].get("slurm_job") if history else None),
        "not_counted": problems,
        "last_run": history[-1] if history else None,
        "shards": shards,
        "pool": pool,
        "audit": folder_audit(folder),
        "adapter_sets": run.get("data.adapter_sets"),
    }


def bucket_status(store: Any) -> RunStatus:
    """``ObjectStore.status``: the status of an object-store prefix (``writer.output_dir:
    s3://...``) from its run.json, manifest objects, shards' records and locks, with the keys of
    ``folder_status`` (no rate over the last minutes: the last run's own)."""
    url = store.where
    try:
        run = store.read_json(RUN_FILE)
    except Exception as err:  # the store cannot be reached: the same words as a run's refusal
        problems = store.write_problems()
        raise ConfigError(problems[0] if problems else f"{url}: {err}") from None
    finally:
        store.release()
    if run is None:
        raise ConfigError(f"{url} is not an output of lightning-diffusion: it has no {RUN_FILE}.")
    indices, _, failed = store.recorded()
    names = store.storage.names()
    rejected = store.rejected_images() - set(indices.tolist())
    expected, history = run.get("expected"), run.get("history") or []
    lock = store.lock_state(".lock")
    shards: list[ShardStatus] = []
    plans = {}
    for name in sorted(n for n in names if re.fullmatch(r"run\.shard-\d+-of-\d+\.json", n)):
        record = store.read_json(name) or {}
        index, count = record.get("shard", [0, 1])
        if count not in plans:
            plans[count] = store.shard_plan(count)
        shard = Shard(index, count).with_owners(plans[count])
        shard_lock = store.lock_state(f".lock.shard-{index}-of-{count}")
        shard_history = record.get("history") or []
        shards.append({"shard": index, "done": len(shard.select(indices)),
                       "expected": shard.size(expected or 0) - len(shard.select(sorted(rejected))),
                       "running": bool(shard_lock and shard_lock["live"]), "slurm_job": None,
                       "runs": len(shard_history), "stats": run_stats(shard_history)})
    pool = pool_summary(store.pool_files()) if POOL in names else None  # its workers and claims, as a folder's
    running = (bool(lock and lock["live"]) or any(shard["running"] for shard in shards)
               or bool(pool and any(worker["live"] for worker in pool["workers"])))
    done = len(indices)
    complete = expected is not None and done + len(rejected) >= expected
    rate = run_stats(history[-1:])["images_per_s"] if history else None
    return {"folder": url, "done": done, "expected": expected, "rejected": len(rejected),
            "failed": len({line["index"] for line in failed} - set(indices.tolist())), "complete": complete,
            "running": running, "by_rank": {}, "rate_per_s": rate, "rate_live": False, "eta_s": None, "lock": lock,
            "slurm_job": history[-1].get("slurm_job") if history else None, "not_counted": [],
            "last_run": history[-1] if history else None, "shards": shards, "pool": pool,
            "adapter_sets": run.get("data.adapter_sets")}


def write_rate(written: np.ndarray, now: float, since: Optional[float], history: list[RunSummary]
               ) -> Optional[float]:
    """Outputs a second. While a run goes (``since``: when it took the folder): those written over
    the last ``RATE_WINDOW_S`` (or since it started, if later) divided by that whole time up to now,
    so that a batch written within milliseconds does not read as hundreds a second. Otherwise the
    last run's own rate (outputs made over its seconds of prediction)."""
    if since is not None:
        start = max(now - RATE_WINDOW_S, float(since))
        count = int((written >= start).sum())
        return count / max(now - start, 1.0) if count else None
    return run_stats(history[-1:])["images_per_s"] if history else None


def run_stats(history: list[RunSummary]) -> RunStats:
    """A shard's (or a folder's) runs summed, as img2dataset's ``_stats.json``: outputs made,
    failed (in the last run: a rerun retries them), rejected, seconds of prediction and the rate."""
    made = sum(int(run.get("made") or 0) for run in history)
    seconds = sum(max(0.0, float(run.get("wall_s") or 0) - float(run.get("load_s") or 0)) for run in history)
    last = history[-1] if history else {}
    return {"made": made, "failed": int(last.get("failed") or 0), "rejected": int(last.get("rejected") or 0),
            "predict_s": round(seconds, 3), "images_per_s": round(made / seconds, 3) if seconds else None}


def shard_count(folder: Path, submitted: Optional[ArraySubmission] = None) -> Optional[int]:
    """The shard count of the folder's job array: its last submission's (``submitted``), else the
    newest shard record's; None for a folder written without shards."""
    try:
        return int((submitted or {})["num_shards"])
    except (KeyError, TypeError, ValueError):
        pass
    records = sorted(folder.glob("run.shard-*-of-*.json"), key=lambda p: p.stat().st_mtime)
    found = re.fullmatch(r"run\.shard-\d+-of-(\d+)\.json", records[-1].name) if records else None
    return int(found.group(1)) if found else None


def shard_status(folder: Path, indices: np.ndarray, total: Optional[int], count: Optional[int],
                 rejected: set[int], arrays: Optional[JobArrays] = None) -> list[ShardStatus]:
    """Per shard of the folder's job array of ``count`` shards (``indices``: the images in the
    manifest; ``rejected``: the images of rejected records not among them): done and expected
    (less its rejected images), whether a run of it writes now, its last job, and its task's state
    where ``arrays`` knows it; empty for a folder written without shards."""
    indices = np.asarray(indices, dtype=np.int64)
    if not count or total is None:
        return []
    live = live_locks(folder)
    states = arrays.states(folder).get(count, {}) if arrays is not None else {}
    owners = recorded_owners(folder, count)
    shards: list[ShardStatus] = []
    for index in range(count):
        shard = Shard(index, count).with_owners(owners)
        try:
            record = json.loads((folder / f"run.shard-{index}-of-{count}.json").read_text())
        except (OSError, ValueError):
            record = {}
        history = record.get("history") or []
        lock = OutputLock(folder, (index, count)).describe() or {}
        shards.append({
            "shard": index,
            "done": len(shard.select(indices)),
            "expected": shard.size(total) - len(shard.select(sorted(rejected))),
            "running": (index, count) in live,
            "since": lock.get("since") if (index, count) in live else None,
            "slurm_job": lock.get("slurm_job") or (history[-1].get("slurm_job") if history else None),
            "runs": len(history),
            "stats": run_stats(history),
            **({"slurm_state": states[index]["state"], "slurm_job": states[index]["job"]} if index in states else {}),
        })
    return shards
