"""``MeshStrategy``: data x CFG x context x tensor parallelism on one device mesh, through diffusers'
own parallel machinery. The data-, CFG-, context- and tensor-parallel strategies are presets of it.

Each model-parallel axis of a replica (one ``dp`` coordinate) is one object (``mesh_axes``): its
checks before any weight loads, its change to the load, its hooks on the loaded pipeline.
* ``tp > 1`` (``TensorAxis``): the transformer is created shard by shard (``sharded_load``);
* ``ring * ulysses > 1`` (``ContextAxis``): diffusers' context-parallel hooks split each image's
  tokens over the ``("ring", "ulysses")`` sub-mesh; with ``tp`` too, Ulysses splits the heads each
  TP rank holds, so ``tp * ulysses`` must divide the heads;
* ``cfg == 2`` (``CFGAxis``): the two guidance passes run on the two ranks of a pair, as a hook
  outside the context-parallel ones.
The rules checked before any weight loads are in ``checks`` (they return problems; the constructor,
``make_parallel_dims`` and the set-up raise them); the degrees in ``parallel_dims.ParallelDims``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import lightning.pytorch as pl
import torch

from lightning_diffusion.contract import DiffusionModel, LoadPlan, ModelRequest
from lightning_diffusion.core.errors import ConfigError, raise_problems, run_check
from lightning_diffusion.pipelines.checks import backend_dtype_problems
from lightning_diffusion.strategies.base import DEFAULT_TIMEOUT_S, DiffusionParallelStrategy
from lightning_diffusion.strategies.checks import backend_device_problems
from lightning_diffusion.strategies.context_parallel_hooks import mode_name
from lightning_diffusion.strategies.mesh_axes import (
    CFGAxis,
    ContextAxis,
    MeshAxis,
    TensorAxis,
    context_backend_problems,
)
from lightning_diffusion.strategies.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    from lightning_diffusion.pipelines.staged import StagedPipeline



class MeshStrategy(DiffusionParallelStrategy):
    """Data x CFG x ring x Ulysses x tensor parallelism on one ``("dp", "cfg", "ring", "ulysses", "tp")`` mesh.

    Args:
        dp, ring, ulysses, tp: the degrees; their product with ``cfg`` is the world size (devices x
            num_nodes). ``-1`` for one of them means "what the world size leaves"; ``dp`` left out
            is ``-1``, or 1 when another degree is ``-1`` (as in the presets). ``tp`` is innermost
            (adjacent ranks, one node), ``dp`` outermost (the only dimension that may span nodes at
            no cost).
        cfg: 2 runs the conditional and unconditional passes of classifier-free guidance on two
            ranks at once (pipelines whose ``PipelineSpec`` has ``cfg``, with their negative branch
            on); 1 runs them in turn, as diffusers does.
        ulysses_anything: Ulysses for sequence lengths and head counts that do not divide the degree.
        ring_anything: ring attention for sequence lengths that do not divide the degree.
        attention_backend: a diffusers attention backend that supports context parallelism; ``None``
            keeps diffusers' default (``native``), except ring on CUDA, which takes ``_native_cudnn``
            because ``native`` returns no log-sum-exp there.
        process_group_backend: ``None``: ``gloo`` on CPU; on CUDA ``nccl``, or ``cpu:gloo,cuda:nccl``
            with context parallelism (its anything-modes exchange sizes on the CPU without syncs).
        timeout: seconds a collective may wait before the process group gives up.
    """

    # A preset names the group it exists for ("cp", "tp" or "cfg"): a world too small for it is an error.
    required_group: Optional[str] = None
    # The axes' classes (``mesh_axes``), in the order they wrap the pipeline; a subclass may replace one.
    context_axis: type[ContextAxis] = ContextAxis
    cfg_axis: type[CFGAxis] = CFGAxis
    tensor_axis: type[TensorAxis] = TensorAxis

    def __init__(
        self,
        dp: Optional[int] = None,
        ring: int = 1,
        ulysses: int = 1,
        tp: int = 1,
        cfg: int = 1,
        ulysses_anything: bool = False,
        ring_anything: bool = False,
        attention_backend: Optional[str] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        if cfg not in (1, 2) or isinstance(cfg, bool):
            raise ConfigError(f"cfg degree must be 1 or 2 (the two passes of classifier-free guidance), got {cfg!r}.")
        if dp is None:
            dp = 1 if -1 in (ring, ulysses, tp) else -1
        self._requested = {"dp": dp, "cfg": cfg, "ring": ring, "ulysses": ulysses, "tp": tp}
        raise_problems(ParallelDims.degree_problems(self._requested))
        if ulysses_anything and ring_anything:
            raise ConfigError("Set at most one of ulysses_anything and ring_anything.")
        if attention_backend is not None:
            raise_problems(context_backend_problems(attention_backend))
        self.ulysses_anything = ulysses_anything
        self.ring_anything = ring_anything
        self.attention_backend = attention_backend
        self.configured_backend = attention_backend  # with the model's, once the request is known
        self.tensor = self.tensor_axis(self)
        self._axes: tuple[MeshAxis, ...] = (self.context_axis(self), self.cfg_axis(self), self.tensor)

    def axes(self, dims: Optional[ParallelDims] = None) -> list[MeshAxis]:
        """The model-parallel axes of ``dims`` (this run's) whose degree is over 1."""
        dims = dims or self.parallel_dims
        return [axis for axis in self._axes if getattr(dims, axis.name) > 1]

    # ----------------------------------------------------------------- degrees and their rules

    def degrees(self) -> dict[str, int]:
        return dict(self._requested)

    def make_parallel_dims(self, world_size: int) -> ParallelDims:
        dims = super().make_parallel_dims(world_size)
        if self.required_group is not None and getattr(dims, self.required_group) == 1:
            kind = {"cp": "Context", "tp": "Tensor", "cfg": "CFG"}[self.required_group]
            raise ConfigError(
                f"{kind} parallelism over {world_size} process(es) leaves a group of 1: "
                "launch more devices (trainer.devices x trainer.num_nodes) or use strategy data_parallel."
            )
        raise_problems(dims.context_degree_problems(self.ulysses_anything, self.ring_anything))
        return dims

    @property
    def tp_degree(self) -> int:
        return self.parallel_dims.tp

    @property
    def ulysses_degree(self) -> int:
        return self.parallel_dims.ulysses

    @property
    def ring_degree(self) -> int:
        return self.parallel_dims.ring

    @property
    def cp_mode(self) -> str:
        return mode_name(self.ring_degree, self.ulysses_degree, self.ulysses_anything or self.ring_anything)

    # ----------------------------------------------------------------- the contract with the module

    def check_request(self, request: ModelRequest, world_size: Optional[int] = None,
                      device_type: Optional[str] = None) -> list:
        problems: list = super().check_request(request, world_size, device_type)
        dims = self.make_parallel_dims(world_size) if world_size is not None else self.parallel_dims
        device = torch.device(self.planned_device_type(device_type))
        backend = run_check(problems, self._backend, request)
        if backend is not None:
            problems += backend_device_problems(backend, device)
            if request.attention_backend is None:  # the model's is checked with the model
                problems += backend_dtype_problems(backend, request.dtype, "the strategy's attention_backend")
        for axis in self.axes(dims):
            problems += axis.problems(request, dims, backend, device)
        return problems

    def _backend(self, request: ModelRequest) -> Optional[str]:
        """A reader: the attention backend, the strategy's ``attention_backend`` or the model's; a
        ConfigError when both are set and differ."""
        ours, theirs = self.attention_backend, request.attention_backend
        if ours is not None and theirs is not None and ours != theirs:
            raise ConfigError(f"the strategy's attention_backend {ours!r} and model.attention_backend {theirs!r} "
                              "differ; set one of them.")
        return ours or theirs

    def load_plan(self, request: ModelRequest) -> LoadPlan:
        self.configured_backend = self._backend(request)
        plan = LoadPlan()
        for axis in self.axes():
            axis.load_plan(plan, request)
        return plan

    def setup_pipeline(self, pipeline: DiffusionPipeline) -> Union[DiffusionPipeline, StagedPipeline]:
        for axis in self.axes():
            axis.apply(pipeline)
        return pipeline

    # ----------------------------------------------------------------- lifecycle

    def setup_environment(self) -> None:
        if self._process_group_backend is None and self.root_device.type == "cuda" and self.parallel_dims.cp > 1:
            self._process_group_backend = "cpu:gloo,cuda:nccl"
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        if self.tp_degree > 1:
            # Lightning predicts under torch.inference_mode on NCCL, and DTensor operations fail on
            # inference tensors (pytorch/pytorch#142190); no_grad gives the same memory savings here.
            trainer.predict_loop.inference_mode = False
        super().setup(trainer)

    def model_to_device(self) -> None:
        # Move whole components only: sharded ones are already on this rank's device, and moving
        # DTensor shards through Module.to would at best do nothing.
        module = self.lightning_module
        components: dict[str, Any] = dict(module.components) if isinstance(module, DiffusionModel) else {}
        for name, component in components.items():
            if name not in self.tensor.sharded:
                component.to(self.root_device)

    def on_predict_end(self) -> None:
        super().on_predict_end()
        for axis in self.axes():
            axis.finish()
