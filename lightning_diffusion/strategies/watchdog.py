"""``Watchdog``: a dead rank never leaves the others hanging on one node.

Lightning's script launcher starts ranks 1..N-1 of a node as children of rank 0. Its own observer
(lightning 2.6) polls them every 5 s and, when one fails, SIGKILLs everything, the launching
process included, with a message at INFO level that a user rarely sees; nothing watches the
other way, so a killed rank 0 leaves its children running until their next collective times out.
``Launcher`` is Lightning's launcher without that observer (left running, it raced the watchdog
and now and then killed the job before the watchdog could name the rank: seen in CI). The
watchdog runs a daemon thread in every process of a node, from just before the rendezvous:

* in the launching process (local rank 0), it polls the children; when one exits non-zero it
  names that rank and the reason, kills the other children and ends the job with exit code 1;
* in a child, it ends the process when the launching process is gone (and asks the kernel to do
  the same at once, with ``PR_SET_PDEATHSIG``); the launcher's pid comes in the child's
  environment (``LIGHTNING_DIFFUSION_LAUNCHER_PID``), so a launcher that died before the child's
  watchdog started is noticed too.

It stands down when Lightning tears the strategy down: at the end of the run (the writer's drain
and merge) the ranks wait in the writer's end-of-run gather instead, where each says how its
writing ended; a peer that dies there is noticed by gloo (its connections close), a lost node at
the idle group's timeout.

Ranks on other nodes find out through the process-group timeout (the strategy's ``timeout``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_diffusion.core import interrupt
from lightning_diffusion.core.console import INTERRUPTED_LINE, log

if TYPE_CHECKING:
    import lightning.pytorch as pl

_ALL = {"all_ranks": True}  # a rank's own news: printed on every rank

_POLL_S = 0.5
INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for Ctrl-C
# The launching process's pid, for its children: one whose launcher died before the child's watchdog
# started (while it imported torch, say) would otherwise find only a live parent (init or a
# subreaper) and wait at the rendezvous until RENDEZVOUS_TIMEOUT.
LAUNCHER_PID = interrupt.LAUNCHER_PID


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Launcher(_SubprocessScriptLauncher):
    """Lightning's script launcher, less its child-process observer: the ``Watchdog`` watches."""

    @override
    def launch(self, function: Callable[..., object], *args: object, trainer: Optional[pl.Trainer] = None,
               **kwargs: object) -> object:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            inherited = os.environ.get(LAUNCHER_PID)
            os.environ[LAUNCHER_PID] = str(os.getpid())  # in the children's environment only
            mask = interrupt.block_for_children()  # they unblock as they import the package
            try:
                self._call_children_scripts()
            finally:
                if inherited is None:
                    os.environ.pop(LAUNCHER_PID, None)
                else:
                    os.environ[LAUNCHER_PID] = inherited
                interrupt.restore(mask, list(getattr(self, "procs", [])))  # last: a Ctrl-C that waited lands here
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def launching_process() -> int:
    """The pid a child rank watches: its launcher's, taken from the environment (and dropped from
    it, for the rank's own children), where that process is gone or is the parent; else the
    parent's (a rank started otherwise, or through a wrapper that forks: the launcher alive but
    not the parent). The parent alone may already be init, where the launcher died while the
    child imported torch."""
    launcher = os.environ.pop(LAUNCHER_PID, "")
    parent = os.getppid()
    if not launcher.isdigit() or int(launcher) == parent:
        return parent
    try:
        os.kill(int(launcher), 0)
    except ProcessLookupError:
        return int(launcher)  # gone: the watch ends this rank at once
    except PermissionError:
        pass  # alive, another user's: not our launcher
    return parent


class Watchdog:
    def __init__(
        self, children: Optional[Sequence[subprocess.Popen]], rank: int, node_rank: int, processes_per_node: int
    ) -> None:
        self.children = list(children or [])
        self.rank = rank
        self.node_rank = node_rank
        self.processes_per_node = processes_per_node
        self._stop = threading.Event()

    def start(self) -> None:
        if self.children:
            target = self._watch_children
        elif self.rank % self.processes_per_node != 0 and os.environ.get("LOCAL_RANK", "0") != "0":
            target = self._watch_parent
            self._die_with_parent()
            self._parent = launching_process()
        else:
            return
        threading.Thread(target=target, name="lightning-diffusion-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _global_rank(self, position: int) -> int:
        # The launcher's children are local ranks 1..N-1, in order.
        return self.node_rank * self.processes_per_node + position + 1

    def dead_child(self, wait_s: float = 0.0) -> Optional[str]:
        """The first child that exited non-zero, described; waits up to ``wait_s`` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            for position, child in enumerate(self.children):
                code = child.poll()
                if code not in (None, 0):
                    return f"rank {self._global_rank(position)} (pid {child.pid}) {_describe(code)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def report_failure(self) -> None:
        """Called when this process fails: say whether a child rank died first (often the cause:
        a collective with a dead peer fails on the survivors)."""
        if not self.children:  # a child rank: nothing to wait for, its own message comes next
            return
        dead = self.dead_child(wait_s=1.0)
        if dead:
            log.error(f"lightning-diffusion: {dead} first; stopping the other ranks of this node.", extra=_ALL)

    def interrupted_child(self) -> bool:
        """A child ended by Ctrl-C (exit 130, or killed by SIGINT while it started up): a terminal
        sends SIGINT to every process of the job, so the job was interrupted, not failed."""
        return any(child.poll() in (INTERRUPTED, -signal.SIGINT) for child in self.children)

    def _watch_children(self) -> None:
        while not self._stop.wait(_POLL_S):
            dead = self.dead_child()
            if not dead or self._stop.is_set():  # stopped: this process is failing by itself
                continue
            if self.interrupted_child():
                self._stop_children()
                log.error(INTERRUPTED_LINE, extra=_ALL)
                os._exit(INTERRUPTED)
            log.error(f"lightning-diffusion: {dead}; stopping the other ranks of this node.", extra=_ALL)
            self._stop_children()
            os._exit(1)

    def _stop_children(self) -> None:
        for other in self.children:
            if other.poll() is None:
                other.kill()
        for other in self.children:
            try:
                other.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _watch_parent(self) -> None:
        parent = self._parent
        while True:
            if os.getppid() != parent:
                log.error(f"lightning-diffusion: rank {self.rank}: the launching process is gone; exiting.", extra=_ALL)
                os._exit(1)
            if self._stop.wait(_POLL_S):
                return

    @staticmethod
    def _die_with_parent() -> None:
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


DRAIN_S = 60  # the most a stalled rank waits for its writer to finish the images queued


class StallWatch:
    """Ends a rank whose batch makes no progress for ``timeout`` seconds, with a message, before the
    process-group backend's own timeout (which the strategy sets ``BACKEND_GRACE`` later).

    Inside a batch of a model-parallel replica, the ranks wait on each other in collectives; a peer
    that is gone or stuck leaves them waiting. On gloo the wait ends in an exception at the group's
    timeout, which the run reports and survives cleanly (the writer drains, the rank says why); on
    NCCL the backend's watchdog thread aborts the process instead (``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s
    default), with no message and no drain. This watch makes both backends behave alike: the
    strategy beats it at every model call (forward hooks on the pipeline's models), and when a batch
    has gone ``timeout`` seconds without a beat, the watch thread says so on this rank, lets the
    writer finish the images already queued (``drain``, bounded), and ends the process with exit code
    1. The first batch is not watched: it compiles (``model.compile``) and warms up, which may take
    longer than one model call.
    """

    def __init__(self, timeout_s: float, rank: int, drain: Callable[[], None], poll_s: float = 1.0,
                 writes: bool = True) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.drain = drain
        # A rank that writes no image has nothing to drain: it waits the drain's bound before ending, or
        # its exit would get the replica's writing rank killed (the launcher ends the node's ranks when
        # one fails) before that rank has written what it queued.
        self.writes = writes
        self.poll_s = poll_s
        self._last = time.monotonic()
        self._batches = 0
        self._busy = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="lightning-diffusion-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self, *_: object) -> None:
        """Progress (a model call began or ended); also a forward (pre-)hook."""
        self._last = time.monotonic()

    def batch_started(self) -> None:
        self._last = time.monotonic()
        self._busy = True

    def batch_ended(self) -> None:
        self._busy = False
        self._batches += 1

    def stalled_for(self) -> Optional[float]:
        """Seconds without progress inside a watched batch, past the timeout; else None."""
        if not self._busy or self._batches == 0:
            return None
        waited = time.monotonic() - self._last
        return waited if waited >= self.timeout_s else None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = self.stalled_for()
            if waited is None:
                continue
            log.error(f"lightning-diffusion: rank {self.rank} made no progress for {self.timeout_s:.0f} s inside a "
                      "batch (the strategy's timeout): a rank it waits on in a collective is gone or stuck. Ending "
                      "this rank; the images written so far are kept, and rerunning the command makes the rest.",
                      extra=_ALL)
            if self.writes:
                writer = threading.Thread(target=self._drain, name="lightning-diffusion-stall-drain", daemon=True)
                writer.start()
                writer.join(timeout=DRAIN_S)
            else:
                time.sleep(DRAIN_S)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(1)

    def _drain(self) -> None:
        try:
            self.drain()
        except Exception as err:  # the rank ends anyway; say why the queue was not written
            log.error(f"lightning-diffusion: rank {self.rank}: the images queued for writing were not all written "
                      f"({type(err).__name__}: {err}); a rerun makes them.", extra=_ALL)
