"""Tensor-parallel loading: a diffusers model created with a ``TensorParallelConfig``, so that each
rank reads only its slice of every weight of the model's ``_tp_plan`` from the safetensors files
(diffusers builds the model empty and streams the slices into DTensors). No rank ever holds a
whole planned weight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_diffusion.core.console import log
from lightning_diffusion.pipelines import compat

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin
    from torch.distributed.device_mesh import DeviceMesh

# from_pretrained options passed on to a sharded load (the others are refused before loading).
PASSED_OPTIONS = ("revision", "variant", "token", "cache_dir")


def load_sharded(cls: type[ModelMixin], path: str, subfolder: Optional[str], dtype: torch.dtype, tp_mesh: DeviceMesh,
                 **options: Any) -> ModelMixin:
    """Create ``cls`` from ``path/subfolder`` with this rank's shard of every planned weight."""
    from diffusers import TensorParallelConfig

    compat.apply_parallel_patches()
    if tp_mesh.device_type == "cpu":
        compat.apply_cpu_rehearsal_patches()
    model = cls.from_pretrained(
        path, subfolder=subfolder, dtype=dtype, parallel_config=TensorParallelConfig(mesh=tp_mesh), **options
    )
    from torch.distributed.tensor import DTensor

    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    log.info(
        f"tensor parallel tp={tp_mesh.size()}: {cls.__name__} '{subfolder}' loaded shard by shard, "
        f"{local:,} of {total:,} parameters on this rank"
    )
    return model
