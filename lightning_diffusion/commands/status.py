"""``lightning-diffusion status OUTPUT_DIR [--json]``: how far a run is, from its folder alone.

Reads only (safe while a job writes, from any machine that sees the folder): outputs done and
expected (``run.json``), what each writing rank has flushed (its manifest part), the rate over the
last minutes and an ETA (from the times in the manifest lines), and whether a run holds the lock.
Exit code 0 when complete, 3 when incomplete and a run is writing, 4 when incomplete and nobody is,
2 for a folder that is not an output folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lightning_diffusion.commands import add_json_option, json_argv, report
from lightning_diffusion.console import counted
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.output.folder_store import FolderStore
from lightning_diffusion.output.lock import OutputLock, live_locks
from lightning_diffusion.output.manifest import (
    FAILED,
    FAILURES_GLOB,
    MANIFEST,
    REJECTED,
    RUN_FILE,
    count_lines,
    part_counts,
    recent_written,
    rejected_images,
)
from lightning_diffusion.output.pool import POOL, FolderPoolFiles, pool_summary
from lightning_diffusion.output.recorded import finished
from lightning_diffusion.output.shard import Shard, recorded_owners
from lightning_diffusion.output.store import open_store

COMPLETE, RUNNING, STOPPED = 0, 3, 4
RATE_WINDOW_S = 300.0


def folder_status(folder: Path, now: Optional[float] = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder.")
    run_file = folder / RUN_FILE
    parts = part_counts(folder)
    submitted = submitted_array(folder)
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
    shards = shard_status(folder, indices, expected, rejected=rejected)
    # While a run goes: since the folder's lock was taken, or the earliest live shard's (a job array)
    starts = [(lock or {}).get("since") if running else None] + [shard["since"] for shard in shards]
    since = min((t for t in starts if t is not None), default=None)
    rate = write_rate(recent_written(folder), now, since, history)
    failed = count_lines(folder / FAILED) + sum(count_lines(p) for p in folder.glob(FAILURES_GLOB))
    complete = expected is not None and done + len(rejected) >= expected
    eta = (expected - done) / rate if running and rate and expected is not None and not complete else None
    pool = pool_summary(FolderPoolFiles(folder)) if (folder / POOL).is_dir() else None
    running = running or bool(pool and any(worker["live"] for worker in pool["workers"]))
    eta = (expected - done) / rate if running and rate and expected is not None and not complete else None
    if shards:  # a task still queued counts: the array is not over
        running = running or any(shard["running"] or shard.get("slurm_state") in ACTIVE_STATES for shard in shards)
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
    }


def bucket_status(store: Any) -> dict[str, Any]:
    """``folder_status`` of an object-store prefix (``writer.output_dir: s3://...``): its run.json,
    manifest objects, shards' records and locks."""
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
    fs, root = store.fs
    names = [entry.rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]
    rejected = store.rejected_images() - set(indices.tolist())
    expected, history = run.get("expected"), run.get("history") or []
    lock = store.lock_state(".lock")
    shards, plans = [], {}
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
    running = bool(lock and lock["live"]) or any(shard["running"] for shard in shards)
    done = len(indices)
    complete = expected is not None and done + len(rejected) >= expected
    rate = run_stats(history[-1:])["images_per_s"] if history else None
    return {"folder": url, "done": done, "expected": expected, "rejected": len(rejected),
            "failed": len({line["index"] for line in failed} - set(indices.tolist())), "complete": complete,
            "running": running, "by_rank": {}, "rate_per_s": rate, "rate_live": False, "eta_s": None, "lock": lock,
            "slurm_job": history[-1].get("slurm_job") if history else None, "not_counted": [],
            "last_run": history[-1] if history else None, "shards": shards}


def write_rate(written: np.ndarray, now: float, since: Optional[float], history: list[dict[str, Any]]
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


ARRAY_FILE = "array.json"


def shard_count(folder: Path) -> Optional[int]:
    """The shard count of the folder's job array: the last submission's (``array.json``), else the
    newest shard record's; None for a folder written without shards."""
    try:
        return int(json.loads((folder / ARRAY_FILE).read_text())["submissions"][-1]["num_shards"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    records = sorted(folder.glob("run.shard-*-of-*.json"), key=lambda p: p.stat().st_mtime)
    found = re.fullmatch(r"run\.shard-\d+-of-(\d+)\.json", records[-1].name) if records else None
    return int(found.group(1)) if found else None


# Job states in which an array task holds or will hold its shard.
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "REQUEUE_HOLD"}


def task_ids(text: str) -> list[int]:
    """SLURM's array task list ("0-3%2", "1,4,6-7", "1-7:2") as numbers; what it cannot read, none."""
    ids: list[int] = []
    for part in text.split("%")[0].split(","):
        found = re.fullmatch(r"\s*(\d+)(?:-(\d+)(?::(\d+))?)?\s*", part)
        if found:
            first, last, step = int(found.group(1)), int(found.group(2) or found.group(1)), int(found.group(3) or 1)
            ids += range(first, last + 1, max(step, 1))
    return ids


def array_states(job_id: str) -> dict[int, dict[str, str]]:
    """``scontrol show job`` of an array job: each task's ``JobId`` and ``JobState``; empty where
    scontrol is missing or has forgotten the job."""
    import shutil
    import subprocess

    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return {}
    proc = subprocess.run([scontrol, "show", "job", "-o", str(job_id)], capture_output=True, text=True)
    states: dict[int, dict[str, str]] = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        fields = dict(word.partition("=")[::2] for word in line.split() if "=" in word)
        for task in task_ids(fields.get("ArrayTaskId", "")):
            states[task] = {"job": f"{fields.get('ArrayJobId', job_id)}_{task}", "state": fields.get("JobState", "?")}
    return states


def submissions(folder: Path) -> list[dict[str, Any]]:
    """Every ``slurm --array`` submission into this folder (``array.json``), oldest first."""
    try:
        found = json.loads((folder / ARRAY_FILE).read_text())["submissions"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return found if isinstance(found, list) else []


def submitted_array(folder: Path) -> Optional[dict[str, Any]]:
    """The last ``slurm --array`` submission into this folder."""
    found = submissions(folder)
    return found[-1] if found else None


def task_states(folder: Path) -> dict[int, dict[int, dict[str, str]]]:
    """SLURM's state of every task submitted into this folder, by shard count and shard; a later
    submission of a shard replaces an earlier one's (where SLURM still knows both)."""
    states: dict[int, dict[int, dict[str, str]]] = {}
    for submission in submissions(folder):
        for task, state in array_states(submission["job"]).items():
            states.setdefault(int(submission["num_shards"]), {})[task] = state
    return states


def run_stats(history: list[dict[str, Any]]) -> dict[str, Any]:
    """A shard's (or a folder's) runs summed, as img2dataset's ``_stats.json``: outputs made,
    failed (in the last run: a rerun retries them), rejected, seconds of prediction and the rate."""
    made = sum(int(run.get("made") or 0) for run in history)
    seconds = sum(max(0.0, float(run.get("wall_s") or 0) - float(run.get("load_s") or 0)) for run in history)
    last = history[-1] if history else {}
    return {"made": made, "failed": int(last.get("failed") or 0), "rejected": int(last.get("rejected") or 0),
            "predict_s": round(seconds, 3), "images_per_s": round(made / seconds, 3) if seconds else None}


def shard_status(folder: Path, indices: np.ndarray, total: Optional[int],
                 count: Optional[int] = None, rejected: Optional[set[int]] = None) -> list[dict[str, Any]]:
    """Per shard of the folder's job array (``indices``: the images in the manifest): done and
    expected (less its rejected images), whether a run of it writes now, and its last SLURM job;
    empty for a folder written without shards."""
    indices = np.asarray(indices, dtype=np.int64)
    rejected = rejected_images(folder) - set(indices.tolist()) if rejected is None else rejected
    count = count or shard_count(folder)
    if not count or total is None:
        return []
    live = live_locks(folder)
    states = task_states(folder).get(count, {})
    owners = recorded_owners(folder, count)
    shards = []
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


def exit_code(status: dict[str, Any]) -> int:
    if status["complete"]:
        return COMPLETE
    return RUNNING if status["running"] else STOPPED


def text(status: dict[str, Any]) -> str:
    expected = status["expected"]
    of = f" of {expected:,} ({100 * status['done'] / expected:.0f}%)" if expected else " (expected count unknown)"
    state = "complete" if status["complete"] else ("incomplete, running" if status["running"] else
                                                   "incomplete, nobody is running it")
    lines = [f"{status['folder']}: {status['done']:,}{of} outputs, {state}"]
    if status.get("rejected"):
        lines.append(f"  rejected: {status['rejected']:,} images of records that cannot be made ({REJECTED}; not "
                     "counted as missing)")
    if status.get("failed"):
        lines.append(f"  failed: {status['failed']:,} images whose pipeline call failed ({FAILED}; a rerun retries "
                     "them)")
    if status["by_rank"]:
        lines.append("  this run, by writing rank: "
                     + ", ".join(f"rank {r}: {n:,}" for r, n in status["by_rank"].items()))
    if status["rate_per_s"] and status["rate_live"]:
        eta = f"; ETA {datetime.timedelta(seconds=int(status['eta_s']))}" if status["eta_s"] is not None else ""
        lines.append(f"  rate: {status['rate_per_s']:.2f} outputs/s over the last {RATE_WINDOW_S / 60:.0f} "
                     f"minutes{eta}")
    elif status["rate_per_s"]:
        lines.append(f"  rate of the last run: {status['rate_per_s']:.2f} outputs/s of prediction")
    lock = status["lock"]
    if lock:
        live = "live" if lock["live"] else "stale: its run is gone"
        lines.append(f"  lock: pid {lock.get('pid')} on {lock.get('host')}, heartbeat {lock['heartbeat_age_s']:.0f} "
                     f"s ago ({live})")
    if status["slurm_job"]:
        lines.append(f"  SLURM job {status['slurm_job']}")
    for shard in status.get("shards") or []:
        state = "complete" if shard["done"] >= shard["expected"] else ("running" if shard["running"] else
                                                                        "incomplete")
        if shard.get("slurm_state"):
            state += f", SLURM {shard['slurm_state']}"
        job = f", job {shard['slurm_job']}" if shard["slurm_job"] else ""
        lines.append(f"  shard {shard['shard']}: {shard['done']:,} of {shard['expected']:,}, {state}{job}")
    shards = status.get("shards") or []
    if shards:
        made = sum(shard["stats"]["made"] for shard in shards)
        failed = sum(shard["stats"]["failed"] for shard in shards)
        seconds = sum(shard["stats"]["predict_s"] for shard in shards)
        rate = f", {made / seconds:.2f} outputs/s a shard" if seconds else ""
        lines.append(f"  shards together: {made:,} made in {sum(shard['runs'] for shard in shards)} runs, {failed:,} "
                     f"failed, {seconds / 3600:.2f} h of prediction{rate}")
    pool = status.get("pool")
    if pool:
        working = [member for member in pool["workers"] if member["live"]]
        lines.append(f"  pool: {counted(len(working), 'worker')} live of {len(pool['workers'])} registered; "
                     + "; ".join(f"{plan['claimed']:,} of {plan['batches']:,} batches claimed (plan {plan['plan']})"
                                 for plan in pool["plans"]))
        for member in working:  # a member: {"worker", "state", "pid", "host", "claims", "slurm_job"}
            lines.append(f"  worker {member['worker']}: {member['state']}, pid {member['pid']} on {member['host']}, "
                         f"{counted(member['claims'], 'claim')}" + (f", SLURM job {member['slurm_job']}"
                                                                     if member["slurm_job"] else ""))
    for problem in status["not_counted"][:10]:
        lines.append(f"  not counted: {problem}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion status", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir")
    add_json_option(parser, "the status")
    args = parser.parse_args(json_argv(argv))
    try:
        store = open_store(args.output_dir)
        status = folder_status(store.folder) if isinstance(store, FolderStore) else bucket_status(store)
    except ConfigError as err:
        print(f"lightning-diffusion status: error: {err}", file=sys.stderr)
        return 2
    report(args.json, status, lambda: print(text(status)), repeats_json=True)
    return exit_code(status)
