"""A progress bar that counts images rather than batches."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


class ImageProgressBar(TQDMProgressBar):
    """Shows the images done by this replica (global rank 0's share) out of its total."""

    def init_predict_tqdm(self):
        bar = super().init_predict_tqdm()
        bar.set_description("Images")
        bar.unit = "img"
        return bar

    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.has_dataloader_changed(dataloader_idx):
            return
        loader = trainer.predict_dataloaders
        loader = loader[dataloader_idx] if isinstance(loader, (list, tuple)) else loader
        replicas = (trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)
        bar = self.predict_progress_bar
        bar.reset(total=len(loader.sampler))
        bar.unit = "img"
        bar.set_description("Images" + (f" (replica 1 of {replicas})" if replicas > 1 else ""))
        self._images_done = 0

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._images_done += len(batch)
        self.predict_progress_bar.n = self._images_done
        self.predict_progress_bar.refresh()
