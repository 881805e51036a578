"""Callbacks for tests: each rank says how many intra-op threads torch uses as prediction starts
(``ThreadProbe``), and whether Python's cycle collector ran during its start-up and runs while it
predicts (``CollectorProbe``: the command line pauses it until the prediction loop, run.start_up)."""

import gc
import os
import sys

import torch
from lightning.pytorch import Callback


class ThreadProbe(Callback):
    def on_predict_start(self, trainer, pl_module) -> None:
        sys.stderr.write(f"threads of rank {trainer.global_rank}: {torch.get_num_threads()} "
                         f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})\n")
        sys.stderr.flush()


class CollectorProbe(Callback):
    def setup(self, trainer, pl_module, stage) -> None:
        self.at_setup = gc.isenabled()

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if batch_idx == 0:
            sys.stderr.write(f"collector of rank {trainer.global_rank}: at setup {self.at_setup}, "
                             f"predicting {gc.isenabled()}\n")
            sys.stderr.flush()
