"""``DataParallelStrategy``: one whole pipeline per process, prompts split across the replicas."""

from __future__ import annotations

from lightning_diffusion.strategies.parallel import DiffusionParallelStrategy


class DataParallelStrategy(DiffusionParallelStrategy):
    """Every process loads its own copy of the pipeline (no weight broadcast from rank 0, unlike
    Lightning's DDP) and makes a disjoint share of the images. Use it when the model fits on one
    device and there are many prompts.

    ``Trainer(strategy="data_parallel", devices=8)`` or, in YAML, ``trainer.strategy: data_parallel``.
    """

    def degrees(self) -> dict[str, int]:
        return {"dp": -1}
