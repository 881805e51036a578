"""The model-parallel axes of ``MeshStrategy``'s mesh, one object each, as diffusers keeps one
``apply_*`` per kind of parallelism: what an axis checks before any weight loads (``problems``),
what it changes in how the pipeline loads (``load_plan``), and how it parallelises the loaded
pipeline (``apply``). The strategy asks the axes whose degree is over 1, in the order they wrap the
pipeline: the context split inside the CFG pair (``CFGAxis`` sees whole inputs); tensor shards are
made while loading, before either.

An axis holds its strategy (its mesh, device and ranks, known once the processes start); a strategy
of your own replaces one by its class attribute (``MeshStrategy.tensor_axis`` and the others).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from lightning_diffusion.contract import LoadPlan, ModelRequest
from lightning_diffusion.core.console import log
from lightning_diffusion.core.errors import run_check
from lightning_diffusion.pipelines import compat
from lightning_diffusion.pipelines.checks import attention_backend_problems
from lightning_diffusion.pipelines.specs import spec_for
from lightning_diffusion.strategies.cfg_parallel_hooks import CFGSplit
from lightning_diffusion.strategies.checks import (
    cfg_problems,
    context_parallel_problems,
    resolved_attention_backend,
    tensor_parallel_problems,
)
from lightning_diffusion.strategies.context_parallel_hooks import enable_context_parallel
from lightning_diffusion.strategies.parallel_dims import ParallelDims
from lightning_diffusion.strategies.sharded_load import PASSED_OPTIONS, load_sharded

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_diffusion.pipelines.lora import Adapter
    from lightning_diffusion.pipelines.model_folder import PipelineInfo


class AxisHost(Protocol):
    """What an axis reads of its strategy (``MeshStrategy``): the run's degrees and mesh, this rank's
    device and place, the context-parallel settings."""

    ulysses_anything: bool
    ring_anything: bool
    configured_backend: Optional[str]

    @property
    def parallel_dims(self) -> ParallelDims: ...

    @property
    def device_mesh(self) -> DeviceMesh: ...  # indexed by axis names

    @property
    def root_device(self) -> torch.device: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def cp_mode(self) -> str: ...


def context_backend_problems(name: str) -> list[str]:
    """A strategy's attention backend under context parallelism: a diffusers backend that supports it
    (``pipelines.checks.attention_backend_problems``; whether its package is installed is checked for the
    model's backend only)."""
    return attention_backend_problems(name, "attention_backend", installed=False, context_parallel=True)


class MeshAxis:
    """One axis of the mesh (``name``: its degree in ``ParallelDims``); each step does nothing unless
    the axis needs it."""

    name = ""

    def __init__(self, strategy: AxisHost) -> None:
        self.strategy = strategy

    def problems(self, request: ModelRequest, dims: ParallelDims, backend: Optional[str],
                 device: torch.device) -> list:
        """Why this axis cannot run ``request`` over ``dims`` (nothing is loaded yet)."""
        return []

    def load_plan(self, plan: LoadPlan, request: ModelRequest) -> None:
        """Change how the pipeline of ``request`` loads (``plan``)."""

    def apply(self, pipeline: DiffusionPipeline) -> None:
        """Parallelise the loaded pipeline, placed on this rank's device."""

    def finish(self) -> None:
        """After the prediction loop."""


class ContextAxis(MeshAxis):
    """Ring x Ulysses: diffusers' context-parallel hooks split each image's tokens over the
    ``("ring", "ulysses")`` sub-mesh (``context_parallel_hooks``), on every model with a ``_cp_plan``."""

    name = "cp"

    def problems(self, request: ModelRequest, dims: ParallelDims, backend: Optional[str],
                 device: torch.device) -> list:
        strategy = self.strategy
        problems: list = context_backend_problems(backend) if backend is not None else []
        run_check(problems, resolved_attention_backend, backend, device, dims, request.dtype)
        return problems + context_parallel_problems(request, dims, strategy.ulysses_anything, strategy.ring_anything)

    def apply(self, pipeline: DiffusionPipeline) -> None:
        strategy, dims = self.strategy, self.strategy.parallel_dims
        compat.apply_parallel_patches()
        if strategy.root_device.type == "cpu":
            compat.apply_cpu_rehearsal_patches()
        for component in pipeline.components.values():
            if not (isinstance(component, torch.nn.Module) and getattr(component, "_cp_plan", None) is not None):
                continue
            model: Any = component  # a diffusers model (its dtype is not nn.Module's)
            backend = resolved_attention_backend(strategy.configured_backend, strategy.root_device, dims, model.dtype)
            enable_context_parallel(
                component, strategy.device_mesh["ring", "ulysses"], dims.ring, dims.ulysses,
                strategy.ulysses_anything, strategy.ring_anything, backend, strategy.global_rank,
                strategy.world_size, strategy.root_device,
            )
            log.info(
                f"context parallel {strategy.cp_mode} (ring={dims.ring}, ulysses={dims.ulysses}"
                f"{f', on tp={dims.tp} shards' if dims.tp > 1 else ''}) on {type(component).__name__}, "
                f"attention backend {backend or 'default'}"
            )


class CFGAxis(MeshAxis):
    """The two passes of classifier-free guidance on the two ranks of a pair (``cfg_parallel_hooks``),
    a hook outside the context-parallel ones."""

    name = "cfg"

    def __init__(self, strategy: AxisHost) -> None:
        super().__init__(strategy)
        self.split: Optional[CFGSplit] = None

    def problems(self, request: ModelRequest, dims: ParallelDims, backend: Optional[str],
                 device: torch.device) -> list:
        info = request.info
        return cfg_problems(info.class_name, dict(request.call_args), info.call_default, request.records)

    def apply(self, pipeline: DiffusionPipeline) -> None:
        pair = self.strategy.device_mesh["cfg"]
        entry = spec_for(type(pipeline).__name__).cfg
        assert entry is not None  # cfg_problems refused a pipeline without one before loading
        self.split = CFGSplit(pipeline, entry, pair.get_group(), pair.get_local_rank())
        log.info(f"cfg parallel: {type(pipeline).__name__}'s cond and uncond passes on the two ranks of each pair")

    def finish(self) -> None:
        if self.split is not None:
            # Parity cannot tell a split from both ranks running both passes; this count can.
            split, plain = self.split.split_calls, self.split.plain_calls
            log.info(f"cfg parallel: {split} transformer calls split over the pair, {plain} run whole on both ranks")


class TensorAxis(MeshAxis):
    """Tensor parallelism: every model with a ``_tp_plan`` is created shard by shard, each rank
    reading only its slice of each weight (``sharded_load``); LoRA updates are fused into the shards."""

    name = "tp"

    def __init__(self, strategy: AxisHost) -> None:
        super().__init__(strategy)
        self.sharded: set[str] = set()  # the components loaded as shards (already on their device)

    def problems(self, request: ModelRequest, dims: ParallelDims, backend: Optional[str],
                 device: torch.device) -> list:
        return tensor_parallel_problems(request, dims)

    def load_plan(self, plan: LoadPlan, request: ModelRequest) -> None:
        options = {k: v for k, v in request.from_pretrained_kwargs.items() if k in PASSED_OPTIONS}
        for name, cls in request.info.models_with("_tp_plan").items():
            plan.components[name] = partial(self.load, name, cls, options)
        if request.lora:
            plan.fuse_adapters = self.fuse

    def load(self, name: str, cls: type[ModelMixin], options: dict, info: PipelineInfo,
             dtype: torch.dtype) -> torch.nn.Module:
        """Component ``name`` (a ``cls``) of the model folder ``info`` as this rank's shards."""
        strategy = self.strategy
        if strategy.root_device.type == "cuda":
            torch.cuda.set_device(strategy.root_device)
        model = load_sharded(cls, info.path, name, dtype, strategy.device_mesh["tp"], **options)
        self.sharded.add(name)
        return model

    def fuse(self, pipeline: DiffusionPipeline, adapters: Sequence[Adapter]) -> None:
        """Each rank adds its slice of every adapter update to its shards (diffusers refuses adapters
        on a tensor-parallel model), cut as diffusers' ``_tp_plan`` cut the weights."""
        from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

        from lightning_diffusion.pipelines import lora

        degree = self.strategy.parallel_dims.tp
        specs = {name: resolve_tp_shard_specs(getattr(pipeline, name), type(getattr(pipeline, name))._tp_plan,
                                              degree) for name in self.sharded}
        lora.fuse_in_place(pipeline, adapters, specs, self.strategy.device_mesh["tp"])
