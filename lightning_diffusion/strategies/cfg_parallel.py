"""``CFGParallelStrategy``: the two passes of classifier-free guidance on two ranks at once;
processes beyond one pair become data-parallel replicas."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Union

from lightning_diffusion.strategies.base import DEFAULT_TIMEOUT_S
from lightning_diffusion.strategies.mesh_parallel import MeshStrategy


class CFGParallelStrategy(MeshStrategy):
    """CFG parallelism: in each pair of processes one runs the conditional transformer pass and the
    other the unconditional one, and they exchange the noise prediction once per step (see
    ``strategies.cfg_parallel_hooks``). The world size must be even; 4 processes are 2 replicas of a pair.
    ``MeshStrategy(cfg=2)``; combine with context or tensor parallelism through ``MeshStrategy``
    (``cfg: 2, ulysses: 2``).

    Args:
        process_group_backend, timeout: as for ``MeshStrategy``.
    """

    required_group = "cfg"

    def __init__(
        self,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(dp=-1, cfg=2, process_group_backend=process_group_backend, timeout=timeout)
