"""Stopping a run early on SLURM's warning signal, so that a requeued job resumes where it stopped.

SLURM sends ``SIGUSR1`` (``sbatch --signal=USR1@SECONDS``) before a time limit, and at a
preemption where the cluster sets ``PreemptParameters=send_user_signal``. The handler here only
records it. At each batch boundary the ranks of every group that works on the same images agree
on it, finish the batch in flight, end the prompt loader and so the prediction loop normally: the
writer flushes and merges the manifest as after a complete run. Then ``finish_job`` (called by the
CLI after ``predict``; call it yourself after ``Trainer.predict`` in a script of your own) has
global rank 0 run ``scontrol requeue``, and the requeued job resumes from the manifest. No
checkpoint is written: the manifest is the whole state of an inference job.

``SIGTERM`` (``scancel``, or a preemption without ``PreemptParameters=send_user_signal``) comes
``KillWait`` seconds (30 by default) or the preemption grace time before ``SIGKILL``. While the
prediction loop runs it is recorded the same way, so the batch in flight is finished and the
manifest merged, but the job is not requeued from here: a cancelled job was meant to stop, and
SLURM requeues a preempted one itself. Lightning's own ``SIGTERM`` handler is replaced for the
loop: it swallows the signal and runs a broadcast inside the handler, which can interleave with
the collectives of a context- or tensor-parallel step.

``SIGINT`` (Ctrl-C) and ``SIGTERM`` (Kubernetes, ``torchrun``'s agent, systemd, ``kill``) from the
strategy's setup to its teardown stop the same way in any run, SLURM or not (outside SLURM jobs
``SIGUSR1`` keeps its default action): the batch in flight is finished, the manifest merged,
``stopped after 8 of 40 images; run the same command to resume`` printed, and the command exits
with 130 (128 + SIGINT) or, outside SLURM, 143 (128 + SIGTERM). A signal that reaches one process
only reaches every rank through the job's store (``_share_stops``). A second Ctrl-C stops at once
(Lightning's shutdown; every file is still whole, being written under a temporary name).

All of it is one ``StopController`` a run, held by the run's ``RunContext`` (``run_context``): the
strategy enables it in every run (SLURM's SIGUSR1 only in SLURM jobs) and asks it at every batch,
the prompt sampler ends when it says so, and the CLI asks it whether to requeue. Its handlers are
installed while its run goes and given back at the strategy's teardown.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.distributed as dist

from lightning_diffusion.core.console import log

if TYPE_CHECKING:
    from types import FrameType

    from torch.distributed import ProcessGroup, Store

    # What ``signal.signal`` takes and answers: a handler, SIG_DFL or SIG_IGN, or None (one set outside Python).
    _Handler = Union[Callable[[int, Optional[FrameType]], object], int, None]

_ALL = {"all_ranks": True}

# EX_TEMPFAIL from sysexits.h: "try again later".
REQUEUE_EXIT_CODE = 75
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT
TERMINATE_EXIT_CODE = 128 + signal.SIGTERM
# A run stopped by its audit (``writer.audit.on_drift: stop``, ``output.audit``): not 1 (a failure),
# not 75 (a SLURM job is not requeued into the same drift).
DRIFT_EXIT_CODE = 3
# The key a rank that received a stop signal sets in the job's store, so that every rank stops at
# its next batch, whichever rank the signal reached (``kill PID`` reaches one process).
_STOP_KEY = "lightning_diffusion/stop"
STOP_SIGNAL = signal.SIGUSR1
# A SIGTERM repeated this long after the one a run is stopping on is ignored until the run's last
# collective: SLURM's scancel reaches a task twice (slurmstepd's signal and srun's forward of its
# own), and a second one arriving after the strategy's teardown would end the task before the end of
# run agreement, so that its peers would see it lost. SLURM's KillWait (30 s by default) still ends a
# run that does not end itself.
REPEAT_GRACE_S = 120.0


def in_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ


class StopController:
    """Owns the stop signals, the per-batch agreement of each replica's ranks, the count of images
    made and the requeue decision."""

    def __init__(self) -> None:
        self.requested = threading.Event()   # a signal arrived on this rank
        self.terminated = threading.Event()  # ... and it was SIGTERM
        self.interrupted = threading.Event()  # ... and it was SIGINT (Ctrl-C)
        self.drifted = threading.Event()     # this rank's audit found drift (``drift``)
        self.slurm = False                   # requeue when stopped early (SLURM jobs only)
        self.totals: Optional[tuple[int, Optional[int]]] = None  # (in the manifest, expected), set by the writer
        self._previous_sigint: _Handler = None
        self.stopping = threading.Event()    # the ranks of this replica agreed to stop
        self.enabled = False
        self.stopped_early = False
        self.images_made = 0
        self._installed = False
        self._group: Optional[ProcessGroup] = None
        self._device = torch.device("cpu")
        self._rank = 0
        self._store: Optional[Store] = None
        self._previous_sigterm: _Handler = None
        self._previous_sigterm_after: _Handler = None  # what SIGTERM does once the run gave it back
        self._watching_terminate = False
        self._terminated_at: Optional[float] = None  # the first SIGTERM of this run (``REPEAT_GRACE_S``)

    # ----------------------------------------------------------------- signals

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        if signum == signal.SIGTERM and not self._watching_terminate:
            if self._terminated_at is not None and time.monotonic() - self._terminated_at < REPEAT_GRACE_S:
                return  # a repeat of the SIGTERM this run is stopping on: the run ends itself
            # Left installed after the run (Lightning restores the handlers it found, ours among them,
            # after the strategy gave SIGTERM back): act as if it were not there.
            signal.signal(signal.SIGTERM, self._previous_sigterm_after or self._previous_sigterm or signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        first = not self.requested.is_set()
        self.requested.set()
        if signum == signal.SIGTERM:
            first = first or not self.terminated.is_set()
            self.terminated.set()
            if self._terminated_at is None:
                self._terminated_at = time.monotonic()
        if first and self._rank == 0:
            then = ("stopping" + (" (no requeue from here)" if self.slurm else "") if signum == signal.SIGTERM
                    else "stopping so that the job can be requeued")
            _say(f"lightning-diffusion: received {signal.Signals(signum).name}: finishing the images in flight, "
                 f"then {then}.")

    def drift(self) -> None:
        """Stop as on a signal, because this rank's audit found drift (``writer.audit.on_drift: stop``):
        every rank stops at its next batch, the manifest is merged, and the run exits with
        ``DRIFT_EXIT_CODE``."""
        self.drifted.set()
        self.requested.set()

    def _interrupt(self, signum: int, frame: Optional[FrameType]) -> None:
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
            if getattr(self._previous_sigint, "starting_only", False):  # the CLI's start-up exit: over now
                self._previous_sigint = signal.default_int_handler

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
        """Record ``SIGTERM`` (a scheduler's, Kubernetes', systemd's, ``kill``'s), in every run:
        called when the strategy sets up and again when the prediction loop starts (Lightning
        registers its own handler just before the loop, and restores the one before it after).
        Main thread only."""
        if self.enabled and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._record)
            if self._previous_sigterm is None and previous != self._record:
                self._previous_sigterm = previous
            self._watching_terminate = True

    def release_terminate(self, final: bool = True) -> None:
        """Give SIGTERM back (the strategy's teardown, ``finish_job``). Not ``final`` while a run stops on
        a SIGTERM: the handler stays, ignoring repeats (``REPEAT_GRACE_S``), until ``finish_job``'s
        last collective is over."""
        self._watching_terminate = False
        if not final and self.terminated.is_set():
            return
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            self._previous_sigterm_after = self._previous_sigterm
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # ----------------------------------------------------------------- the run

    def enable(self, replica_group: Optional[ProcessGroup], device: torch.device, global_rank: int,
               slurm: bool = False) -> None:
        """Stop on the signals for this run: ``replica_group`` holds the ranks that make the same
        images (None for a replica of one rank); ``slurm``: a SLURM job, which also stops on SLURM's
        signals and is requeued when it stops early. Every run stops on Ctrl-C."""
        if slurm:
            self.install()
        self.enabled = True
        self.slurm = slurm
        self.totals = None
        if self.drifted.is_set():  # so does a drift
            self.drifted.clear()
            self.requested.clear()
        if self.interrupted.is_set():  # a Ctrl-C belongs to the run it stopped
            self.interrupted.clear()
            self.requested.clear()
        self.watch_interrupt()
        # A new run in this process: only a signal that already arrived carries over.
        self.stopping.clear()
        self.stopped_early = False
        self.images_made = 0
        self._group, self._device, self._rank = replica_group, device, global_rank
        self.watch_terminate()
        self._share_stops()

    def _share_stops(self) -> None:
        """A signal that reaches one rank stops every rank: a thread of this rank sets a key in
        the job's store (the rendezvous' TCP store) as soon as a stop is requested here, and every
        rank looks for it before each batch (``should_stop``)."""
        import torch.distributed as dist

        self._store = None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
        except (ImportError, RuntimeError, ValueError):
            return
        store, requested = self._store, self.requested

        def post() -> None:
            requested.wait()
            try:
                store.set(_STOP_KEY, "1")
            except Exception:  # the job is ending: its store may be gone
                pass

        threading.Thread(target=post, name="stop-signal", daemon=True).start()

    def _stop_posted(self) -> bool:
        """Whether another rank received a stop signal (a look at the store, without waiting)."""
        if self._store is None:
            return False
        try:
            return bool(self._store.check([_STOP_KEY]))
        except Exception:
            return False

    def should_stop(self) -> bool:
        """Whether this replica stops before its next batch: after a signal, agreed by every rank of
        the replica at the same batch so that none waits in a collective for the others."""
        if self.stopping.is_set() or not self.enabled:
            return self.stopping.is_set()
        stop = self.requested.is_set() or self._stop_posted()
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

    def outcome(self) -> tuple[bool, int, bool, bool, bool]:
        """After ``predict``, on every rank (a collective): whether any replica stopped early, the
        images made by this run over all replicas (counted by their writing ranks), and whether any
        rank received ``SIGTERM``, whether any received ``SIGINT``, and whether any rank's audit
        found drift."""
        mine = [int(self.stopped_early), self.images_made, int(self.terminated.is_set()),
                int(self.interrupted.is_set()), int(self.drifted.is_set())]
        if dist.is_available() and dist.is_initialized():
            counts = torch.tensor(mine, dtype=torch.int64, device=self._device)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            mine = [int(c) for c in counts.tolist()]
        return bool(mine[0]), mine[1], bool(mine[2]), bool(mine[3]), bool(mine[4])

    def finish_job(self) -> int:
        """After ``predict`` returned on every rank: requeue the SLURM job if the run stopped early.

        Returns the exit code for this process: 0, or ``REQUEUE_EXIT_CODE`` on global rank 0 when
        the job stopped early and could not be requeued (no image was finished in this run, which
        would requeue forever, or ``scontrol`` refused)."""
        if not self.enabled:
            return 0
        self.release_interrupt()
        self.release_terminate(final=False)
        stopped, made, terminated, interrupted, drifted = self.outcome()  # every rank is here after the merge
        self.release_terminate()  # the last collective is over: a SIGTERM now ends the process as before
        self.interrupted.clear()  # this run's; an in-process caller's next run starts afresh
        if drifted and not (interrupted or terminated):  # also where no batch was left to stop
            if self._rank == 0:
                done, expected = self.totals or (made, None)
                of = f" of {expected:,}" if expected is not None else ""
                log.info(f"lightning-diffusion: stopped by the audit (writer.audit.on_drift: stop) after {done:,}{of} "
                         "images; audit.jsonl has the drift. Change the accelerators' settings in a new folder, or "
                         "run the same command with writer.audit.on_drift: warn to finish this one.", extra=_ALL)
            return DRIFT_EXIT_CODE
        if stopped and (interrupted or terminated and not self.slurm):
            if self._rank == 0:
                done, expected = self.totals or (made, None)
                of = f" of {expected:,}" if expected is not None else ""
                how = "" if interrupted else " on SIGTERM"
                log.info(f"lightning-diffusion: stopped{how} after {done:,}{of} images; run the same command to "
                         "resume.", extra=_ALL)
            return INTERRUPT_EXIT_CODE if interrupted else TERMINATE_EXIT_CODE
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
            "job is requeued by SLURM, a cancelled one resumes when submitted again with the same output folder).",
            extra=_ALL,
        )
        return 0
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ.get("SLURM_JOB_ID", "")
    if made == 0:
        log.info(
            "lightning-diffusion: stopped early without finishing an image in this run; not requeueing, "
            "which would repeat forever. Give the job more time (--time) or more warning (--signal-seconds).",
            extra=_ALL,
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

