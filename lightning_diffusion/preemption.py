"""Stopping a run early on SLURM's warning signal, so that a requeued job resumes where it stopped.

SLURM sends ``SIGUSR1`` (``sbatch --signal=USR1@SECONDS``) before a time limit, and at a
preemption where the cluster sets ``PreemptParameters=send_user_signal``. The handler here only
records it. The strategies read the record at each batch boundary, agree on it within every group
of ranks that work on the same images, finish the batch in flight, skip the rest and end the
prediction loop normally: the writer flushes and merges the manifest as after a complete run. Then ``finish_job`` (called by the CLI after ``predict``; call it yourself after
``Trainer.predict`` in a script of your own) has global rank 0 run ``scontrol requeue``, and the
requeued job resumes from the manifest. No checkpoint is written: the manifest is the whole state
of an inference job.

``SIGTERM`` (``scancel``, or a preemption without ``PreemptParameters=send_user_signal``) comes
``KillWait`` seconds (30 by default) or the preemption grace time before ``SIGKILL``. While the
prediction loop runs it is recorded the same way, so the batch in flight is finished and the
manifest merged, but the job is not requeued from here: a cancelled job was meant to stop, and
SLURM requeues a preempted one itself. Lightning's own ``SIGTERM`` handler is replaced for the
loop: it swallows the signal and runs a broadcast inside the handler, which can interleave with
the collectives of a context- or tensor-parallel step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from typing import Any

# EX_TEMPFAIL from sysexits.h: "try again later".
REQUEUE_EXIT_CODE = 75
STOP_SIGNAL = signal.SIGUSR1

_requested = threading.Event()
_terminated = threading.Event()
_installed = False


def _record(signum: int, frame: Any) -> None:
    first = not _requested.is_set()
    _requested.set()
    if signum == signal.SIGTERM:
        first = first or not _terminated.is_set()
        _terminated.set()
    rank = os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0"))
    if first and rank == "0":
        if signum == signal.SIGTERM:
            then = "stopping (no requeue from here)"
        else:
            then = "stopping so that the job can be requeued"
        print(
            f"lightning-diffusion: received {signal.Signals(signum).name}: finishing the images in flight, "
            f"then {then}.",
            flush=True,
        )


def install() -> None:
    """Record ``SIGUSR1`` instead of dying of it (its default action). Main thread only."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(STOP_SIGNAL, _record)
    _installed = True


def record_terminate() -> None:
    """Record ``SIGTERM`` too, for the prediction loop (Lightning registers its own handler just
    before the loop and restores the previous one after it). Main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _record)


def in_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ


def requested() -> bool:
    return _requested.is_set()


def terminated() -> bool:
    return _terminated.is_set()


def finish_job(strategy: Any) -> int:
    """After ``predict`` returned on every rank: requeue the SLURM job if the run stopped early.

    Returns the exit code for this process: 0, or ``REQUEUE_EXIT_CODE`` on global rank 0 when the
    job stopped early and could not be requeued (no image was finished in this run, which would
    requeue forever, or ``scontrol`` refused)."""
    if not getattr(strategy, "stops_on_signal", False):
        return 0
    stopped, made, terminated = strategy.run_outcome()  # a collective: every rank is here after the merge
    if not stopped or strategy.global_rank != 0:
        return 0
    if terminated:
        print(
            f"lightning-diffusion: stopped on SIGTERM after {made} images in this run; not requeueing (a preempted "
            "job is requeued by SLURM, a cancelled one resumes when submitted again with the same output folder).",
            flush=True,
        )
        return 0
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ.get("SLURM_JOB_ID", "")
    if made == 0:
        print(
            "lightning-diffusion: stopped early without finishing an image in this run; not requeueing, "
            "which would repeat forever. Give the job more time (--time) or more warning (--signal-seconds).",
            flush=True,
        )
        return REQUEUE_EXIT_CODE
    if not re.fullmatch(r"[0-9_]+", job):
        print(f"lightning-diffusion: stopped early, but {job!r} is not a SLURM job id; run again to resume.")
        return REQUEUE_EXIT_CODE
    print(f"lightning-diffusion: stopped early after {made} images; requeueing job {job} to resume.", flush=True)
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        print("lightning-diffusion: scontrol not found; resubmit the job to resume.", flush=True)
        return REQUEUE_EXIT_CODE
    if proc.returncode != 0:
        print(f"lightning-diffusion: scontrol requeue {job} failed: {proc.stderr.strip()}", flush=True)
        return REQUEUE_EXIT_CODE
    return 0
