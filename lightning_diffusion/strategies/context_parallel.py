"""``ContextParallelStrategy``: split each image's token sequence over a group of devices with
diffusers' own Ulysses / Ring / Unified attention; processes beyond one group become replicas."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Union

from lightning_diffusion.core.errors import ConfigError, raise_problems
from lightning_diffusion.strategies.base import DEFAULT_TIMEOUT_S
from lightning_diffusion.strategies.mesh_parallel import MeshStrategy
from lightning_diffusion.strategies.parallel_dims import ParallelDims


class ContextParallelStrategy(MeshStrategy):
    """Context parallelism through diffusers (``ContextParallelConfig``, the model's ``_cp_plan``,
    ``enable_parallelism``): each image's sequence is split over ``ulysses_degree * ring_degree``
    processes; the world size must be a multiple of that, and the remaining factor becomes
    data-parallel replicas (4 processes with ``ulysses_degree=2``: 2 replicas of a 2-way Ulysses
    group). ``MeshStrategy`` with the ``dp``, ``ring`` and ``ulysses`` dimensions.

    Args:
        ulysses_degree: all-to-all over attention heads (needs heads divisible by it, or
            ``ulysses_anything``); ``-1``: every process of the job.
        ring_degree: ring attention over key/value blocks; ``-1``: every process of the job.
        ulysses_anything, ring_anything, attention_backend, process_group_backend, timeout:
            as for ``MeshStrategy``.
    """

    required_group = "cp"

    def __init__(
        self,
        ulysses_degree: int = 1,
        ring_degree: int = 1,
        ulysses_anything: bool = False,
        ring_anything: bool = False,
        attention_backend: Optional[str] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
    ) -> None:
        raise_problems(ParallelDims.degree_problems({"ulysses_degree": ulysses_degree, "ring_degree": ring_degree}))
        if ulysses_degree * ring_degree == 1:
            raise ConfigError(
                "Context parallelism needs ulysses_degree > 1 or ring_degree > 1; "
                "for one device per image use strategy data_parallel."
            )
        inferred = -1 in (ulysses_degree, ring_degree)
        super().__init__(
            dp=1 if inferred else -1,
            ring=ring_degree,
            ulysses=ulysses_degree,
            ulysses_anything=ulysses_anything,
            ring_anything=ring_anything,
            attention_backend=attention_backend,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
