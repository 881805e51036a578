"""Context-parallel wiring through diffusers' own machinery.

Alone, context parallelism is diffusers' entry point: ``enable_parallelism(ContextParallelConfig)``
with the ``("ring", "ulysses")`` sub-mesh. On a model that is already tensor-parallel (sharded while
loading), ``enable_parallelism`` refuses a second kind, so the same pieces it uses are composed
here: the attention processors get the parallel config (the dispatch then runs Ulysses, Ring or
Unified attention over the sub-mesh) and ``apply_context_parallel`` adds the hooks that split the
inputs and gather the output along the sequence, following the model's ``_cp_plan``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def enable_context_parallel(component: torch.nn.Module, cp_mesh: DeviceMesh, ring: int, ulysses: int,
                            ulysses_anything: bool, ring_anything: bool, backend: Optional[str],
                            rank: int, world_size: int, device: torch.device) -> None:
    """Split ``component``'s sequence over ``cp_mesh`` (``ring`` x ``ulysses`` ranks)."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    model: Any = component  # a diffusers model: its parallel methods and plan are not nn.Module's
    if backend is not None:
        model.set_attention_backend(backend)
    cp_config = ContextParallelConfig(
        ring_degree=ring, ulysses_degree=ulysses, ulysses_anything=ulysses_anything, ring_anything=ring_anything,
        mesh=cp_mesh,
    )
    if getattr(component, "_parallel_config", None) is None:
        model.enable_parallelism(config=cp_config)
    else:
        config = ParallelConfig(context_parallel_config=cp_config)
        config.setup(rank, world_size, device, mesh=cp_mesh)
        for module in component.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = config
        apply_context_parallel(component, cp_config, model._cp_plan)


def mode_name(ring: int, ulysses: int, anything: bool) -> str:
    if ring > 1 and ulysses > 1:
        return "unified"
    name = "ring" if ring > 1 else "ulysses"
    return f"{name}-anything" if anything else name
