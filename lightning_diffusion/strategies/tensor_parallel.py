"""``TensorParallelStrategy``: shard the transformer's linear layers over a group of devices with
diffusers' ``TensorParallelConfig`` and the model's ``_tp_plan``, reading only each rank's slice of
every weight while loading; processes beyond one group become data-parallel replicas."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Union

from lightning_diffusion.core.errors import raise_problems
from lightning_diffusion.strategies.base import DEFAULT_TIMEOUT_S
from lightning_diffusion.strategies.mesh_parallel import MeshStrategy
from lightning_diffusion.strategies.parallel_dims import ParallelDims


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism through diffusers: each linear layer of the transformer's ``_tp_plan`` is
    split column- or row-wise over ``tp_degree`` processes, which read only their own slice of each
    weight from the safetensors files (no rank ever holds the whole transformer). Text encoders and
    VAE are whole on every rank. ``MeshStrategy`` with the ``dp`` and ``tp`` dimensions.

    Args:
        tp_degree: processes per tensor-parallel group; ``-1``: every process of the job.
        process_group_backend, timeout: as for ``MeshStrategy``.
    """

    required_group = "tp"

    def __init__(
        self,
        tp_degree: int = -1,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
    ) -> None:
        raise_problems(ParallelDims.degree_problems({"tp_degree": tp_degree}))
        super().__init__(
            dp=1 if tp_degree == -1 else -1,
            tp=tp_degree,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
