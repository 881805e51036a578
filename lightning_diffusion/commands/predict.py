"""``lightning-diffusion predict --config X.yaml [--group.key value ...]``: the main job."""

from __future__ import annotations

import os
import sys

from lightning_diffusion import preemption
from lightning_diffusion.config import DiffusionCLI, config_error_message


def first_process() -> bool:
    """Whether this is the job's first process: global rank 0 (``RANK``, or ``SLURM_PROCID`` for the
    tasks ``srun`` starts on every node), else the first process of its node."""
    for variable in ("RANK", "SLURM_PROCID"):
        if variable in os.environ:
            return os.environ[variable] == "0"
    return os.environ.get("LOCAL_RANK", "0") == "0"


def main(argv: list[str]) -> int:
    if preemption.in_slurm_job():
        preemption.STOP.install()  # before the weights load: SIGUSR1's default action kills the process
    try:
        DiffusionCLI(args=["predict", *argv])
        # Stopped on SLURM's signal with images left: requeue the job (global rank 0).
        return preemption.STOP.finish_job()
    except SystemExit as exit_info:
        # A second Ctrl-C: Lightning's shutdown exits with 1; the shell's convention is 128 + SIGINT.
        if isinstance(exit_info.__context__, KeyboardInterrupt):
            preemption.STOP.interrupted.clear()
            return preemption.INTERRUPT_EXIT_CODE
        raise
    except ValueError as err:
        message = config_error_message(err)
        if message is None:
            raise
        # Input that cannot work: the message says what to change; a traceback adds nothing.
        # Every process finds the same problem; the job's first one says it.
        if first_process():
            print(f"lightning-diffusion: error: {message}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Left to interpreter exit, gloo's groups can abort the process ("terminate called"); a
            # refusal after the group started (a folder in use) must not leave it to the next run.
            dist.destroy_process_group()
