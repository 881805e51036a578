"""A submitted SLURM job followed from the submitting machine: ``sbatch`` and ``scontrol``, what the
job made (``Outputs``, read through the output's store), and job arrays (the shards to submit,
the record of each submission, the wait for all of them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:
    from lightning_diffusion.output.settings import StorageOptions

# Job states after which a job runs no more (scontrol's names).
FINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT",
}


def _slurm_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(
            f"{name} is not installed here (not on PATH). Run this on the cluster's login node, or write the "
            "script with --script FILE (without --submit) and submit it there with sbatch."
        )
    return path


def submit(script: Path) -> str:
    proc = subprocess.run([_slurm_command("sbatch"), "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def job_fields(job_id: str) -> Optional[dict[str, str]]:
    """``scontrol show job`` as a dict; None once SLURM has forgotten the job."""
    proc = subprocess.run(
        [_slurm_command("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True
    )
    if proc.returncode != 0 or "=" not in proc.stdout:
        return None
    fields = {}
    for word in proc.stdout.split():
        key, sep, value = word.partition("=")
        if sep:
            fields[key] = value
    return fields


def count_done(outputs: Outputs) -> int:
    """Outputs in the manifest, and images of records that cannot be made (``rejected.jsonl``)."""
    done, rejected = outputs.made()
    return len(done) + len(rejected)


def wait_for(job_id: str, outputs: Outputs, log: Path, expected: Optional[int], poll_s: float = 2.0) -> int:
    """Follow the job until it ends; report its state, starts and the images in the manifest."""
    last_state, fields = None, None
    while True:
        current = job_fields(job_id)
        if current is None:
            break
        fields = current
        state = fields.get("JobState")
        if state != last_state:
            print(f"job {job_id}: {state} (restarts: {fields.get('Restarts', '0')})", flush=True)
            last_state = state
        if state in FINAL_STATES:
            break
        time.sleep(poll_s)
    done = count_done(outputs)
    total = f" of {expected}" if expected is not None else ""
    print(f"job {job_id}: {last_state or 'gone'}, exit code {(fields or {}).get('ExitCode', '?')}; "
          f"{done}{total} outputs in {outputs.manifest}; log: {log}")
    complete = expected is not None and done >= expected
    return 0 if last_state == "COMPLETED" or (last_state is None and complete) else 1


class Outputs:
    """Where the job's images are recorded, read from the submitting machine (``store.open_store``:
    a folder every node sees, or an object-store prefix read with ``writer.storage_options``)."""

    def __init__(self, output: Any, options: Optional[StorageOptions] = None) -> None:
        from lightning_diffusion.output.store import open_store

        self.store = open_store(output, options=options)
        # The folder the job's nodes share and its logs go into; None for a store they reach on their own.
        self.folder = Path(output) if self.store.is_folder else None
        self.url = None if self.store.is_folder else self.store.where

    @property
    def manifest(self) -> str:
        """Where the records are, for messages."""
        return self.store.manifest_where

    def made(self) -> tuple[Any, set[int]]:
        """The recorded images (a sorted integer array) and the rejected ones not among them."""
        try:
            return self.store.made()
        finally:
            self.store.release()

    def plan(self, num_shards: int, config: Any, total: int) -> Any:
        """The shard of every image among ``num_shards``: the recorded plan (``shard``), else the one
        the array's first task will record (``shard.first_plan``)."""
        from lightning_diffusion.input.data import shard_owners
        from lightning_diffusion.input.formats import read_data
        from lightning_diffusion.output.shard import first_plan

        data = config.data

        def compute() -> Any:
            return shard_owners(read_data(data), int(data.num_images_per_prompt), int(data.batch_size),
                                bool(data.bucket), num_shards)

        try:
            owners = self.store.shard_plan(num_shards)
            return owners if owners is not None else first_plan(self.store, num_shards, total, compute)
        except FileNotFoundError:  # nothing written into the prefix yet
            return compute()
        finally:
            self.store.release()

    def live(self) -> dict[Optional[tuple[int, int]], str]:
        """The runs writing into it now, by shard (as ``lock.live_locks``)."""
        try:
            return self.store.live_locks()
        except FileNotFoundError:
            return {}
        finally:
            self.store.release()


class ArrayPlan(TypedDict, total=False):
    """A job array to submit: ``num_shards``, the ``shards`` submitted (its tasks), ``max_concurrent``
    tasks at once, the images ``expected`` and, for a pool's array, ``pool`` (each task a job of it)."""

    num_shards: int
    shards: list[int]
    max_concurrent: Optional[int]
    expected: Optional[int]
    pool: bool


def plan_array(args: argparse.Namespace, config: Any, outputs: Outputs, job_dir: Path, total: int) -> ArrayPlan:
    """The shards to submit: ``--shards`` or all of ``--array N``; with ``--resubmit`` only the
    incomplete ones. A shard whose run still writes (its lock) or whose task is still queued or
    running is left out, and said so; shards of another count still running refuse the lot.
    ``job_dir`` holds the record of the arrays submitted before (``array.json``)."""
    import numpy as np

    from lightning_diffusion.commands import status
    from lightning_diffusion.output.shard import Shard

    if int(config.data.num_shards) != 1:
        raise ConfigError("--array sets data.num_shards and data.shard_index for each task; drop them from the config.")
    count = args.array or status.shard_count(job_dir)
    if count is None:
        if outputs.url is None:
            raise ConfigError(f"--resubmit: {job_dir} holds no shards of a job array; submit one with --array N.")
        raise ConfigError(f"--resubmit: the job folder {job_dir} holds no record of a job array into {outputs.url} "
                          "(--job-dir names the folder its --array submission used); submit one with --array N.")
    wanted = args.shards if args.shards is not None else list(range(count))
    beyond = [t for t in wanted if t >= count]
    if beyond:
        raise ConfigError(f"--shards {','.join(map(str, beyond))}: an array of {count} has shards 0 to {count - 1}.")
    live = outputs.live()
    states = status.task_states(job_dir) if job_dir.is_dir() else {}
    queued = {n for n, tasks in states.items() if any(t["state"] in status.ACTIVE_STATES for t in tasks.values())}
    others = sorted({shard[1] for shard in live if shard is not None and shard[1] != count} | (queued - {count}))
    if None in live or others:
        what = "a run of the whole prompt set" if None in live else f"shards of an array of {others[0]}"
        where = outputs.url or outputs.folder
        raise ConfigError(f"{where} is being written by {what} (running or queued); shards of {count} would make "
                          "some of the same images. Wait for it to end, or submit the same shard count.")
    done, rejected = outputs.made()
    accounted = np.union1d(done, np.fromiter(rejected, dtype=np.int64, count=len(rejected)))
    plan = outputs.plan(count, config, total)
    empty = [t for t in range(count) if not Shard(t, count).with_owners(plan).size(total)]
    if empty and args.array is not None and count <= total:  # more shards than images: check_config says so
        batches = len(np.unique(plan)) if len(plan) else 0
        raise ConfigError(f"--array {count}: the prompt set's batches (data.batch_size "
                          f"{config.data.batch_size}) fill only {batches} shards; shards "
                          f"{','.join(map(str, empty[:10]))}{'...' if len(empty) > 10 else ''} would have nothing to "
                          f"make. Use --array {batches} or fewer, or a smaller data.batch_size.")
    shards = []
    for shard in wanted:
        task = states.get(count, {}).get(shard, {})
        if (shard, count) in live or task.get("state") in status.ACTIVE_STATES:
            job = f" (job {task['job']}, {task.get('state')})" if task else f" ({live.get((shard, count))})"
            print(f"shard {shard}: still running{job}; not submitted again.", flush=True)
            continue
        members = Shard(shard, count).with_owners(plan)
        if args.resubmit and len(members.select(accounted)) >= members.size(total):
            continue
        shards.append(shard)
    return {"num_shards": count, "shards": shards, "max_concurrent": args.max_concurrent, "expected": total}


def record_array(job_dir: Path, job_id: str, array: ArrayPlan) -> None:
    """``array.json``: every array submitted from the job folder (``status`` and ``--resubmit`` read it)."""

    from lightning_diffusion.commands.status import ARRAY_FILE
    from lightning_diffusion.output.manifest import atomic_write

    path = job_dir / ARRAY_FILE
    try:
        submissions = json.loads(path.read_text()).get("submissions", [])
    except (OSError, ValueError):
        submissions = []
    submissions.append({"job": job_id, "num_shards": array["num_shards"], "shards": array["shards"],
                        "expected": array["expected"], "submitted": round(time.time(), 3)})
    atomic_write(path, lambda f: f.write(json.dumps({"submissions": submissions}, indent=2).encode("utf-8")))


def pool_array(args: argparse.Namespace, expected: Optional[int]) -> ArrayPlan:
    """``--array N`` of a pool (``data.schedule: pull``): N tasks, each a job that joins the pool (no
    shards: nothing to plan or record)."""
    if args.resubmit or args.shards is not None:
        raise ConfigError("--resubmit and --shards pick the shards of a job array; a pool (data.schedule: pull) has "
                          "none: submit the command again, and its jobs join the pool and make what is left.")
    return {"num_shards": args.array, "shards": list(range(args.array)), "max_concurrent": args.max_concurrent,
            "expected": expected, "pool": True}


def follow_tasks(job_id: str, label: str, poll_s: float) -> None:
    """Print each task's state of array ``job_id`` as it changes (``label`` names a task: ``shard``,
    ``worker job``) until none is queued or running."""
    from lightning_diffusion.commands.status import ACTIVE_STATES, array_states

    last: dict[int, str] = {}
    while True:
        states = array_states(job_id)
        for task, state in sorted(states.items()):
            if last.get(task) != state["state"]:
                print(f"job {state['job']} ({label} {task}): {state['state']}", flush=True)
                last[task] = state["state"]
        if not any(state["state"] in ACTIVE_STATES for state in states.values()):
            return
        time.sleep(poll_s)


def wait_for_pool(job_id: str, outputs: Outputs, expected: Optional[int], poll_s: float = 2.0) -> int:
    """Follow the tasks of a pool's array until none is queued or running; report the outputs."""
    follow_tasks(job_id, "worker job", poll_s)
    done = count_done(outputs)
    print(f"job {job_id}: {done} of {expected} outputs in {outputs.manifest}", flush=True)
    return 0 if expected is not None and done >= expected else 1


def wait_for_array(job_id: str, outputs: Outputs, expected: int, array: ArrayPlan, config: Any,
                   poll_s: float = 2.0) -> int:
    """Follow the array's tasks until none is queued or running; report each shard."""
    from lightning_diffusion.output.shard import Shard

    follow_tasks(job_id, "shard", poll_s)
    indices, rejected = outputs.made()
    complete = True
    plan = outputs.plan(array["num_shards"], config, expected)
    for index in range(array["num_shards"]):
        shard = Shard(index, array["num_shards"]).with_owners(plan)
        done = len(shard.select(indices))
        wanted = shard.size(expected) - len(shard.select(sorted(rejected)))
        complete = complete and done >= wanted
        print(f"shard {index}: {done} of {wanted} outputs", flush=True)
    print(f"job {job_id}: {len(indices)} of {expected} outputs in {outputs.manifest}", flush=True)
    return 0 if complete else 1
