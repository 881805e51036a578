"""A callback for tests: each rank says how many intra-op threads torch uses as prediction starts."""

import os
import sys

import torch
from lightning.pytorch import Callback


class ThreadProbe(Callback):
    def on_predict_start(self, trainer, pl_module) -> None:
        sys.stderr.write(f"threads of rank {trainer.global_rank}: {torch.get_num_threads()} "
                         f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})\n")
        sys.stderr.flush()
