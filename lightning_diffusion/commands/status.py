"""``lightning-diffusion status OUTPUT_DIR [--json]``: how far a run is, from its folder alone.

Reads only (safe while a job writes, from any machine that sees the folder): outputs done and
expected (``run.json``), what each writing rank has flushed (its manifest part), the rate over the
last minutes and an ETA (from the times in the manifest lines), and whether a run holds the lock.
The store reads its outputs (``OutputStore.status``, a folder's or a bucket's); this module adds
what SLURM knows of the tasks of a job array submitted into the folder (``array.json``, scontrol).
Exit code 0 when complete, 3 when incomplete and a run is writing, 4 when incomplete and nobody is,
2 for a folder that is not an output folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Optional

from lightning_diffusion.commands import add_json_option, help_text, json_argv, report
from lightning_diffusion.core.console import counted
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.output.manifest import FAILED, REJECTED
from lightning_diffusion.output.status import RATE_WINDOW_S, ArraySubmission, RunStatus
from lightning_diffusion.output.status import shard_count as recorded_shard_count
from lightning_diffusion.output.store import open_store

COMPLETE, RUNNING, STOPPED = 0, 3, 4
ARRAY_FILE = "array.json"

# Job states in which an array task holds or will hold its shard.
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "REQUEUE_HOLD"}


def folder_status(folder: Path, now: Optional[float] = None) -> RunStatus:
    """The status of output folder ``folder`` (``OutputStore.status``), its shards' SLURM tasks
    included."""
    return open_store(folder).status(now, SLURM_ARRAYS)


def shard_count(folder: Path) -> Optional[int]:
    """The shard count of the folder's job array: the last submission's (``array.json``), else the
    newest shard record's; None for a folder written without shards."""
    return recorded_shard_count(folder, submitted_array(folder))


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


def submissions(folder: Path) -> list[ArraySubmission]:
    """Every ``slurm --array`` submission into this folder (``array.json``), oldest first."""
    try:
        found = json.loads((folder / ARRAY_FILE).read_text())["submissions"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return found if isinstance(found, list) else []


def submitted_array(folder: Path) -> Optional[ArraySubmission]:
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


class SlurmArrays:
    """SLURM's job arrays as ``status.JobArrays``: the ``slurm --array`` submissions recorded in
    the folder (``array.json``) and ``scontrol``'s state of their tasks."""

    active_states: Collection[str] = ACTIVE_STATES

    def submitted(self, folder: Path) -> Optional[ArraySubmission]:
        return submitted_array(folder)

    def states(self, folder: Path) -> dict[int, dict[int, dict[str, str]]]:
        return task_states(folder)


SLURM_ARRAYS = SlurmArrays()


def exit_code(status: RunStatus) -> int:
    if status["complete"]:
        return COMPLETE
    return RUNNING if status["running"] else STOPPED


def device_hour_rate(status: RunStatus) -> Optional[float]:
    """Images per device-hour beside the rate: a live run's rate over its writing ranks (a device
    each), else the last run's outputs over its wall time (loading included) times its devices
    (``report.collect.devices_of``); None where neither is known."""
    from lightning_diffusion.report.collect import devices_of
    from lightning_diffusion.report.pace import per_device_hour

    if status.get("rate_per_s") and status.get("rate_live"):
        return float(status["rate_per_s"] or 0.0) * 3600.0 / max(1, len(status.get("by_rank") or {}))
    last = status.get("last_run") or {}
    return per_device_hour(int(last.get("made") or 0), float(last.get("wall_s") or 0.0), devices_of(last))


def text(status: RunStatus) -> str:
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
    if status.get("adapter_sets"):
        lines.append(f"  adapter sets: {status['adapter_sets']:,} (model.adapters: a batch has one)")
    if status["by_rank"]:
        lines.append("  this run, by writing rank: "
                     + ", ".join(f"rank {r}: {n:,}" for r, n in status["by_rank"].items()))
    per_hour = device_hour_rate(status)
    hourly = f", {per_hour:,.0f} images per device-hour" if per_hour else ""
    if status["rate_per_s"] and status["rate_live"]:
        eta = f"; ETA {datetime.timedelta(seconds=int(status['eta_s']))}" if status["eta_s"] is not None else ""
        lines.append(f"  rate: {status['rate_per_s']:.2f} outputs/s over the last {RATE_WINDOW_S / 60:.0f} "
                     f"minutes{hourly}{eta}")
    elif status["rate_per_s"]:
        lines.append(f"  rate of the last run: {status['rate_per_s']:.2f} outputs/s of prediction{hourly} (its wall "
                     "time, loading included)")
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
                     + "; ".join(f"{plan['claimed']:,} of {plan['batches']:,} batches claimed"
                                 + (f", {plan['taken_over']:,} taken over" if plan.get("taken_over") else "")
                                 + f" (plan {plan['plan']})" for plan in pool["plans"]))
        for member in working:  # a member: {"worker", "state", "pid", "host", "claims", "took_over", "slurm_job"}
            took = f" ({member['took_over']:,} by a takeover)" if member.get("took_over") else ""
            lines.append(f"  worker {member['worker']}: {member['state']}, pid {member['pid']} on {member['host']}, "
                         f"{counted(member['claims'], 'claim')}{took}" + (f", SLURM job {member['slurm_job']}"
                                                                           if member["slurm_job"] else ""))
    if audit := status.get("audit"):
        from lightning_diffusion.output.audit import audit_text

        lines.append(f"  {audit_text(audit)}")
    for problem in status["not_counted"][:10]:
        lines.append(f"  not counted: {problem}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion status", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir")
    add_json_option(parser, "the status")
    args = parser.parse_args(json_argv(argv))
    try:
        status = open_store(args.output_dir).status(arrays=SLURM_ARRAYS)
    except ConfigError as err:
        print(f"lightning-diffusion status: error: {err}", file=sys.stderr)
        return 2
    status["images_per_device_h"] = device_hour_rate(status)
    report(args.json, status, lambda: print(text(status)), repeats_json=True)
    return exit_code(status)
