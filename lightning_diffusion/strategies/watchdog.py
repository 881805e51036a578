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
from typing import Any, Callable, Optional, Sequence

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_diffusion.console import log

_ALL = {"all_ranks": True}  # a rank's own news: printed on every rank

_POLL_S = 0.5
# The launching process's pid, for its children: one whose launcher died before the child's watchdog
# started (while it imported torch, say) would otherwise find only a live parent (init or a
# subreaper) and wait at the rendezvous until RENDEZVOUS_TIMEOUT.
LAUNCHER_PID = "LIGHTNING_DIFFUSION_LAUNCHER_PID"


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
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            inherited = os.environ.get(LAUNCHER_PID)
            os.environ[LAUNCHER_PID] = str(os.getpid())  # in the children's environment only
            try:
                self._call_children_scripts()
            finally:
                if inherited is None:
                    os.environ.pop(LAUNCHER_PID, None)
                else:
                    os.environ[LAUNCHER_PID] = inherited
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

    def _watch_children(self) -> None:
        while not self._stop.wait(_POLL_S):
            dead = self.dead_child()
            if dead and not self._stop.is_set():  # stopped: this process is failing by itself
                log.error(f"lightning-diffusion: {dead}; stopping the other ranks of this node.", extra=_ALL)
                for other in self.children:
                    if other.poll() is None:
                        other.kill()
                for other in self.children:
                    try:
                        other.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
                os._exit(1)

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
