"""Stopping a run early on SLURM's warning signal, so that a requeued job resumes where it stopped.

SLURM sends ``SIGUSR1`` (``sbatch --signal=USR1@SECONDS``) before a time limit, and at a
preemption where the cluster sets ``PreemptParameters=send_user_signal``. The handler here only
records it. At each batch boundary the ranks of every group that works on the same images agree
on it, finish the batch in flight, end the prompt loader and so the prediction loop normally: the
writer flushes and merges the manifest as after a complete run. Then ``finish_job`` (called by the
CLI after ``predict``; call it yourself after ``Trainer.predict`` in a script of your own) has
global rank 0 run ``scontrol requeue``, and the requeued job resumes from the manifest. No checkpoint is written: the manifest is the whole state
of an inference job.

``SIGTERM`` (``scancel``, or a preemption without ``PreemptParameters=send_user_signal``) comes
``KillWait`` seconds (30 by default) or the preemption grace time before ``SIGKILL``. While the
prediction loop runs it is recorded the same way, so the batch in flight is finished and the
manifest merged, but the job is not requeued from here: a cancelled job was meant to stop, and
SLURM requeues a preempted one itself. Lightning's own ``SIGTERM`` handler is replaced for the
loop: it swallows the signal and runs a broadcast inside the handler, which can interleave with
the collectives of a context- or tensor-parallel step.

``SIGINT`` (Ctrl-C) from the strategy's setup to its teardown stops the same way in any run, SLURM
or not (outside SLURM jobs ``SIGTERM`` and ``SIGUSR1`` keep their default action): the
batch in flight is finished, the manifest merged, ``stopped after 8 of 40 images; run the same
command to resume`` printed, and the command exits with 130 (128 + SIGINT). A second Ctrl-C stops
at once (Lightning's shutdown; every file is still whole, being written under a temporary name).

All of it is one object, ``STOP`` (a ``StopController``; signals are per process, so there is one
per process): the strategies enable it in every run (SLURM's signals only in SLURM jobs) and ask it at every batch, the prompt sampler
ends when it says so, and the CLI asks it whether to requeue.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_diffusion.console import log

_ALL = {"all_ranks": True}

# EX_TEMPFAIL from sysexits.h: "try again later".
REQUEUE_EXIT_CODE = 75
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT
STOP_SIGNAL = signal.SIGUSR1


def in_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ


class StopController:
    """Owns the stop signals, the per-batch agreement of each replica's ranks, the count of images
    made and the requeue decision."""

    def __init__(self) -> None:
        self.requested = threading.Event()   # a signal arrived on this rank
        self.terminated = threading.Event()  # ... and it was SIGTERM
        self.interrupted = threading.Event()  # ... and it was SIGINT (Ctrl-C)
        self.slurm = False                   # requeue when stopped early (SLURM jobs only)
        self.totals: Optional[tuple[int, Optional[int]]] = None  # (in the manifest, expected), set by the writer
        self._previous_sigint: Any = None
        self.stopping = threading.Event()    # the ranks of this replica agreed to stop
        self.enabled = False
        self.stopped_early = False
        self.images_made = 0
        self._installed = False
        self._group: Optional[Any] = None
        self._device = torch.device("cpu")
        self._rank = 0

    # ----------------------------------------------------------------- signals

    def _record(self, signum: int, frame: Any) -> None:
        first = not self.requested.is_set()
        self.requested.set()
        if signum == signal.SIGTERM:
            first = first or not self.terminated.is_set()
            self.terminated.set()
        if first and self._rank == 0:
            then = "stopping (no requeue from here)" if signum == signal.SIGTERM else "stopping so that the job can be requeued"
            _say(f"lightning-diffusion: received {signal.Signals(signum).name}: finishing the images in flight, "
                 f"then {then}.")

    def _interrupt(self, signum: int, frame: Any) -> None:
        if self.interrupted.is_set():  # the second Ctrl-C: stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.interrupted.set()
        self.requested.set()
        if self._rank == 0:
            _say("\nlightning-diffusion: interrupted: finishing the images in flight, then stopping "
                 "(Ctrl-C again to stop at once).")

    def watch_interrupt(self) -> None:
        """Stop cleanly on Ctrl-C from here to ``finish_job`` (see the module's docstring): installed
        when the strategy sets up, so a Ctrl-C while the weights load stops at the first batch, and
        a replica without images (which skips the loop) stops with the others. Main thread only."""
        if threading.current_thread() is threading.main_thread() and self._previous_sigint is None:
            self._previous_sigint = signal.signal(signal.SIGINT, self._interrupt)

    def release_interrupt(self) -> None:
        """Give Ctrl-C back (the strategy's teardown and ``finish_job``): after the run it interrupts
        the caller's script as usual. The record of a Ctrl-C stays for ``finish_job``."""
        if self._previous_sigint is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def install(self) -> None:
        """Record ``SIGUSR1`` instead of dying of it (its default action). Main thread only."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        signal.signal(STOP_SIGNAL, self._record)
        self._installed = True

    def watch_terminate(self) -> None:
        """Record ``SIGTERM`` too, for the prediction loop of a SLURM job (Lightning registers its own
        handler just before the loop and restores the previous one after it). Main thread only."""
        if self.enabled and self.slurm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._record)

    # ----------------------------------------------------------------- the run

    def enable(self, replica_group: Optional[Any], device: torch.device, global_rank: int, slurm: bool = False) -> None:
        """Stop on the signals for this run: ``replica_group`` holds the ranks that make the same
        images (None for a replica of one rank); ``slurm``: a SLURM job, which also stops on SLURM's
        signals and is requeued when it stops early. Every run stops on Ctrl-C."""
        if slurm:
            self.install()
        self.enabled = True
        self.slurm = slurm
        self.totals = None
        if self.interrupted.is_set():  # a Ctrl-C belongs to the run it stopped
            self.interrupted.clear()
            self.requested.clear()
        self.watch_interrupt()
        # A new run in this process: only a signal that already arrived carries over.
        self.stopping.clear()
        self.stopped_early = False
        self.images_made = 0
        self._group, self._device, self._rank = replica_group, device, global_rank

    def should_stop(self) -> bool:
        """Whether this replica stops before its next batch: after a signal, agreed by every rank of
        the replica at the same batch so that none waits in a collective for the others."""
        if self.stopping.is_set() or not self.enabled:
            return self.stopping.is_set()
        stop = self.requested.is_set()
        if self._group is not None:
            flag = torch.tensor([int(stop)], device=self._device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            stop = bool(flag.item())
        if stop:
            self.stopping.set()
            self.stopped_early = True
        return stop

    def count(self, images: int) -> None:
        self.images_made += images

    def outcome(self) -> tuple[bool, int, bool, bool]:
        """After ``predict``, on every rank (a collective): whether any replica stopped early, the
        images made by this run over all replicas (counted by their writing ranks), and whether any
        rank received ``SIGTERM``, and whether any received ``SIGINT``."""
        mine = [int(self.stopped_early), self.images_made, int(self.terminated.is_set()), int(self.interrupted.is_set())]
        if dist.is_available() and dist.is_initialized():
            counts = torch.tensor(mine, dtype=torch.int64, device=self._device)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            mine = [int(c) for c in counts.tolist()]
        return bool(mine[0]), mine[1], bool(mine[2]), bool(mine[3])

    def finish_job(self) -> int:
        """After ``predict`` returned on every rank: requeue the SLURM job if the run stopped early.

        Returns the exit code for this process: 0, or ``REQUEUE_EXIT_CODE`` on global rank 0 when
        the job stopped early and could not be requeued (no image was finished in this run, which
        would requeue forever, or ``scontrol`` refused)."""
        if not self.enabled:
            return 0
        self.release_interrupt()
        stopped, made, terminated, interrupted = self.outcome()  # every rank is here after the manifest merge
        self.interrupted.clear()  # this run's; an in-process caller's next run starts afresh
        if stopped and interrupted:
            if self._rank == 0:
                done, expected = self.totals or (made, None)
                of = f" of {expected:,}" if expected is not None else ""
                log.info(f"lightning-diffusion: stopped after {done:,}{of} images; run the same command to resume.",
                         extra=_ALL)
            return INTERRUPT_EXIT_CODE
        if not stopped or self._rank != 0 or not self.slurm:
            return 0
        return _requeue(made, terminated)


def _say(line: str) -> None:
    """Write from a signal handler: ``print`` can raise "reentrant call" on a buffered stream the
    interrupted code was writing, and logging may wait for a lock it holds."""
    try:
        os.write(1, (line + "\n").encode())
    except OSError:
        pass


def _requeue(made: int, terminated: bool) -> int:
    if terminated:
        log.info(
            f"lightning-diffusion: stopped on SIGTERM after {made} images in this run; not requeueing (a preempted "
            "job is requeued by SLURM, a cancelled one resumes when submitted again with the same output folder).", extra=_ALL
        )
        return 0
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ.get("SLURM_JOB_ID", "")
    if made == 0:
        log.info(
            "lightning-diffusion: stopped early without finishing an image in this run; not requeueing, "
            "which would repeat forever. Give the job more time (--time) or more warning (--signal-seconds).", extra=_ALL
        )
        return REQUEUE_EXIT_CODE
    if not re.fullmatch(r"[0-9_]+", job):
        log.info(
            f"lightning-diffusion: stopped early, but {job!r} is not a SLURM job id; run again to resume.", extra=_ALL
        )
        return REQUEUE_EXIT_CODE
    log.info(f"lightning-diffusion: stopped early after {made} images; requeueing job {job} to resume.", extra=_ALL)
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        log.info(
            "lightning-diffusion: scontrol not found; resubmit the job to resume.", extra=_ALL
        )
        return REQUEUE_EXIT_CODE
    if proc.returncode != 0:
        log.info(
            f"lightning-diffusion: scontrol requeue {job} failed: {proc.stderr.strip()}", extra=_ALL
        )
        return REQUEUE_EXIT_CODE
    return 0


# One per process: signal handlers are per process.
STOP = StopController()
