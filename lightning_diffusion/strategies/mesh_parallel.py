"""``MeshStrategy``: data x CFG x context x tensor parallelism on one device mesh, through diffusers'
own parallel machinery. The data-, CFG-, context- and tensor-parallel strategies are presets of it.

What runs where, per replica (one ``dp`` coordinate), each in its own module:
* ``tp > 1``: the transformer is created shard by shard (``sharded_load``);
* ``ring * ulysses > 1``: diffusers' context-parallel hooks split each image's tokens over the
  ``("ring", "ulysses")`` sub-mesh (``context_parallel_hooks``); with ``tp`` too, Ulysses splits
  the heads each TP rank holds, so ``tp * ulysses`` must divide the heads;
* ``cfg == 2``: the two guidance passes run on the two ranks of a pair (``cfg_parallel_hooks``),
  as a hook outside the context-parallel ones.
The rules checked before any weight loads are in ``checks`` (they return problems; the constructor,
``make_parallel_dims`` and the set-up raise them); the degrees in ``parallel_dims.ParallelDims``.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch

from lightning_diffusion.console import log
from lightning_diffusion.contract import DiffusionModel, LoadPlan, ModelRequest
from lightning_diffusion.errors import ConfigError, raise_problems, run_check
from lightning_diffusion.pipelines import compat
from lightning_diffusion.pipelines.specs import spec_for
from lightning_diffusion.run.model_checks import attention_backend_problems, backend_dtype_problems
from lightning_diffusion.strategies.base import DEFAULT_TIMEOUT_S, DiffusionParallelStrategy
from lightning_diffusion.strategies.cfg_parallel_hooks import CFGSplit
from lightning_diffusion.strategies.checks import (
    backend_device_problems,
    cfg_problems,
    context_parallel_problems,
    resolved_attention_backend,
    tensor_parallel_problems,
)
from lightning_diffusion.strategies.context_parallel_hooks import enable_context_parallel, mode_name
from lightning_diffusion.strategies.parallel_dims import ParallelDims
from lightning_diffusion.strategies.sharded_load import PASSED_OPTIONS, load_sharded


def _context_backend_problems(name: str) -> list[str]:
    """A strategy's attention backend under context parallelism: a diffusers backend that supports it
    (``model_checks.attention_backend_problems``; whether its package is installed is checked for the
    model's backend only)."""
    return attention_backend_problems(name, "attention_backend", installed=False, context_parallel=True)


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
            raise_problems(_context_backend_problems(attention_backend))
        self.ulysses_anything = ulysses_anything
        self.ring_anything = ring_anything
        self.attention_backend = attention_backend
        self._configured_backend = attention_backend  # with the model's, once the request is known
        self._sharded: set[str] = set()
        self._cfg_split: Optional[CFGSplit] = None

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
        info = request.info
        device = torch.device(self.planned_device_type(device_type))
        backend = run_check(problems, self._backend, request)
        if backend is not None:
            problems += backend_device_problems(backend, device)
            if request.attention_backend is None:  # the model's is checked with the model
                problems += backend_dtype_problems(backend, request.dtype, "the strategy's attention_backend")
            if dims.cp > 1:
                problems += _context_backend_problems(backend)
        if dims.cp > 1:
            run_check(problems, resolved_attention_backend, backend, device, dims, request.dtype)
        if dims.cfg > 1:
            problems += cfg_problems(info.class_name, dict(request.call_args), info.call_default, request.records)
        if dims.cp > 1:
            problems += context_parallel_problems(request, dims, self.ulysses_anything, self.ring_anything)
        if dims.tp > 1:
            problems += tensor_parallel_problems(request, dims)
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
        self._configured_backend = self._backend(request)
        plan = LoadPlan()
        if self.tp_degree > 1:
            options = {k: v for k, v in request.from_pretrained_kwargs.items() if k in PASSED_OPTIONS}
            for name, cls in request.info.models_with("_tp_plan").items():
                plan.components[name] = partial(self._load_sharded, name, cls, options)
            if request.lora:
                plan.fuse_adapters = self._fuse_sharded
        return plan

    def _fuse_sharded(self, pipeline: Any, adapters: Any) -> None:
        """Each rank adds its slice of every adapter update to its shards (diffusers refuses adapters
        on a tensor-parallel model), cut as diffusers' ``_tp_plan`` cut the weights."""
        from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

        from lightning_diffusion.pipelines import lora

        specs = {name: resolve_tp_shard_specs(getattr(pipeline, name), type(getattr(pipeline, name))._tp_plan,
                                              self.tp_degree) for name in self._sharded}
        lora.fuse_in_place(pipeline, adapters, specs, self.device_mesh["tp"])

    def _load_sharded(self, name: str, cls: type[Any], options: dict, info: Any, dtype: torch.dtype) -> torch.nn.Module:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        model = load_sharded(cls, info.path, name, dtype, self.device_mesh["tp"], **options)
        self._sharded.add(name)
        return model

    def setup_pipeline(self, pipeline: Any) -> Any:
        dims = self.parallel_dims
        if dims.cp > 1:
            compat.apply_parallel_patches()
            if self.root_device.type == "cpu":
                compat.apply_cpu_rehearsal_patches()
            for component in pipeline.components.values():
                if isinstance(component, torch.nn.Module) and getattr(component, "_cp_plan", None) is not None:
                    model: Any = component  # a diffusers model (its dtype is not nn.Module's)
                    backend = resolved_attention_backend(self._configured_backend, self.root_device, dims, model.dtype)
                    enable_context_parallel(
                        component, self.device_mesh["ring", "ulysses"], dims.ring, dims.ulysses,
                        self.ulysses_anything, self.ring_anything, backend, self.global_rank, self.world_size,
                        self.root_device,
                    )
                    log.info(
                        f"context parallel {self.cp_mode} (ring={dims.ring}, ulysses={dims.ulysses}"
                        f"{f', on tp={dims.tp} shards' if dims.tp > 1 else ''}) on {type(component).__name__}, "
                        f"attention backend {backend or 'default'}"
                    )
        if dims.cfg > 1:
            # After the context-parallel hooks, so that the split wraps them: each branch sees whole inputs.
            pair = self.device_mesh["cfg"]
            entry = spec_for(type(pipeline).__name__).cfg
            assert entry is not None  # cfg_problems refused a pipeline without one before loading
            self._cfg_split = CFGSplit(pipeline, entry, pair.get_group(), pair.get_local_rank())
            log.info(f"cfg parallel: {type(pipeline).__name__}'s cond and uncond passes on the two ranks of each pair")
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
            if name not in self._sharded:
                component.to(self.root_device)

    def on_predict_end(self) -> None:
        super().on_predict_end()
        if self._cfg_split is not None:
            # Parity cannot tell a split from both ranks running both passes; this count can.
            split, plain = self._cfg_split.split_calls, self._cfg_split.plain_calls
            log.info(f"cfg parallel: {split} transformer calls split over the pair, {plain} run whole on both ranks")
