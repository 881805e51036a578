"""``DataParallelStrategy``: one whole pipeline per process, prompts split across the replicas."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Union

from lightning_diffusion.strategies.base import DEFAULT_TIMEOUT_S
from lightning_diffusion.strategies.mesh_parallel import MeshStrategy


class DataParallelStrategy(MeshStrategy):
    """Every process loads its own copy of the pipeline (no weight broadcast from rank 0, unlike
    Lightning's DDP) and makes a disjoint share of the images. Use it when the model fits on one
    device and there are many prompts: ``MeshStrategy`` with only the ``dp`` dimension.

    ``Trainer(strategy="data_parallel", devices=8)`` or, in YAML, ``trainer.strategy: data_parallel``.
    """

    def __init__(
        self,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(dp=-1, process_group_backend=process_group_backend, timeout=timeout)
