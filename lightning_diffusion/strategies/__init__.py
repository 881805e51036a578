"""The project's strategies, one a file, registered with Lightning under short names."""

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_diffusion.strategies.base import DiffusionParallelStrategy
from lightning_diffusion.strategies.cfg_parallel import CFGParallelStrategy
from lightning_diffusion.strategies.context_parallel import ContextParallelStrategy
from lightning_diffusion.strategies.data_parallel import DataParallelStrategy
from lightning_diffusion.strategies.device_map import DeviceMapStrategy
from lightning_diffusion.strategies.mesh_parallel import MeshStrategy
from lightning_diffusion.strategies.parallel_dims import MeshError, ParallelDims
from lightning_diffusion.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["CFGParallelStrategy", "ContextParallelStrategy", "DataParallelStrategy", "DeviceMapStrategy",
           "DiffusionParallelStrategy", "MeshError", "MeshStrategy", "ParallelDims", "TensorParallelStrategy"]

_REGISTRY: dict[str, tuple[type, str, dict[str, Any]]] = {
    "mesh": (MeshStrategy, "dp x cfg x ring x ulysses x tp on one device mesh (default: data parallel).", {}),
    "data_parallel": (DataParallelStrategy, "One pipeline per process; prompts split across replicas.", {}),
    "context_parallel": (ContextParallelStrategy, "Ulysses over all processes.", {"ulysses_degree": -1}),
    "ulysses": (ContextParallelStrategy, "Ulysses attention over all processes.", {"ulysses_degree": -1}),
    "ring": (ContextParallelStrategy, "Ring attention over all processes.", {"ring_degree": -1}),
    "ulysses_anything": (ContextParallelStrategy, "Ulysses over all processes, any head or token count.",
                         {"ulysses_degree": -1, "ulysses_anything": True}),
    "ring_anything": (ContextParallelStrategy, "Ring attention over all processes, any token count.",
                      {"ring_degree": -1, "ring_anything": True}),
    "cfg_parallel": (CFGParallelStrategy, "Conditional and unconditional guidance passes on two processes at once.",
                     {}),
    "device_map": (DeviceMapStrategy, "One pipeline spread over a process's GPUs, CPU and disk.", {}),
    "tensor_parallel": (TensorParallelStrategy, "Transformer weights sharded over all processes.", {"tp_degree": -1}),
}

STRATEGY_NAMES = tuple(_REGISTRY)

for _name, (_cls, _description, _kwargs) in _REGISTRY.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, _cls, description=_description, **_kwargs)
