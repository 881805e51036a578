"""``RunContext``: the state one run shares between its parts, passed where it is used.

A strategy makes one for each run it drives (``DiffusionParallelStrategy.run_context``), and the CLI
hands its own to the strategy it instantiates. It holds:

- ``stop``, the run's ``preemption.StopController``: the stop signals, the per-batch agreement of a
  replica's ranks, the images this run made and the folder's totals, and the requeue decision
  (``finish_job``). The strategy asks it at every batch, the prompt sampler ends when it says so,
  the writer records the totals in it;
- ``checked``: whether this rank's config passed every weight-free check in the process that
  started it (the CLI's launching process checks the whole command line before Lightning re-runs
  it for the other ranks), so the strategy and the module skip repeating those checks.

The launching process tells the ranks it starts through their environment: a token that names the
exact command line (``mark_checked``). Only the CLI reads it (``checked_by_launcher``), once per
process, into its context; the strategy and the module read ``checked``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from lightning_diffusion.core.preemption import StopController

# Set by a launching process whose command line passed preflight, for the ranks it starts.
_CHECKED_ENV = "LIGHTNING_DIFFUSION_PREFLIGHT_PASSED"


def _command_token() -> str:
    return hashlib.sha1("\0".join(sys.argv[1:]).encode("utf-8"), usedforsecurity=False).hexdigest()[:16]


def checked_by_launcher() -> bool:
    """Whether the process that started this one checked this process's command line."""
    return os.environ.get(_CHECKED_ENV) == _command_token()


@dataclass
class RunContext:
    stop: StopController = field(default_factory=StopController)
    checked: bool = False
    # What writes this run's images, drained by the stall watch before a stalled rank ends: the
    # writer adds its ``drain_on_stall`` at setup and removes it at teardown.
    drains: list[Callable[[], None]] = field(default_factory=list)

    def drain_writers(self) -> None:
        for drain in list(self.drains):
            drain()

    def mark_checked(self) -> None:
        """This command line passed every check: the ranks this process starts trust it."""
        self.checked = True
        os.environ[_CHECKED_ENV] = _command_token()

    def finish_job(self) -> int:
        """After ``predict`` returned on every rank: the process's exit code, requeueing a SLURM job
        that stopped early (``StopController.finish_job``)."""
        return self.stop.finish_job()


def first_process(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this is the job's first process: global rank 0 (``RANK``; ``SLURM_PROCID`` for the
    tasks ``srun`` starts on every node; ``NODE_RANK`` 0 for Lightning's own launcher on several
    nodes) and its node's first (a rank the launcher started inside srun's task 0 inherits its
    SLURM_PROCID); without any, the first process of its node."""
    for variable in ("RANK", "SLURM_PROCID", "NODE_RANK"):
        if variable in environ:
            if environ[variable] != "0":
                return False
            break
    return first_process_of_node(environ)


def first_process_of_node(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this is its node's first process: local rank 0 (``LOCAL_RANK``, set by the launcher
    for the ranks it starts, or ``SLURM_LOCALID`` for srun's tasks); a process with neither is one."""
    for variable in ("LOCAL_RANK", "SLURM_LOCALID"):
        if variable in environ:
            return environ[variable] == "0"
    return True
