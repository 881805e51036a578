"""``lightning-diffusion predict --config X.yaml [--group.key value ...]``: the main job."""

from __future__ import annotations

import os
import sys

from lightning_diffusion import preemption
from lightning_diffusion.config import DiffusionCLI, config_error_message


def main(argv: list[str]) -> int:
    if preemption.in_slurm_job():
        preemption.STOP.install()  # before the weights load: SIGUSR1's default action kills the process
    try:
        cli = DiffusionCLI(args=["predict", *argv])
    except ValueError as err:
        message = config_error_message(err)
        if message is None:
            raise
        # Input that cannot work: the message says what to change; a traceback adds nothing.
        # Every rank finds the same problem; the first process of each node says it.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"lightning-diffusion: error: {message}", file=sys.stderr)
        return 2
    # Stopped on SLURM's signal with images left: requeue the job (global rank 0).
    code = preemption.STOP.finish_job()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Left to interpreter exit, gloo's extra groups can abort the process ("terminate called").
        dist.destroy_process_group()
    return code
