"""Loading a ``DiffusionModule``'s pipeline: the weights fetched once a node, ``from_pretrained``
with the strategy's ``LoadPlan``, then the options that change the loaded pipeline (quantization,
LoRA adapters fused, VAE tiling and slicing, the attention backend, the step cache, compilation).

``PipelineLoading`` is the part of ``DiffusionModule`` that Lightning's ``configure_model`` runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_diffusion.console import log
from lightning_diffusion.contract import LoadPlan
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.pipelines import compat, quantization
from lightning_diffusion.pipelines.cache import StepCache, install


class PipelineLoading:
    """Mixed into ``DiffusionModule``: ``configure_model`` and what it calls."""

    info: Any
    dtype_: torch.dtype
    from_pretrained_kwargs: dict[str, Any]
    options: dict[str, Any]
    adapters: list[Any]
    cache: Optional[dict[str, Any]]
    show_inner_progress: bool
    load_plan: LoadPlan
    pipeline: Any
    components: nn.ModuleDict
    step_cache: Optional[StepCache]
    compiled: bool
    _trainer: Any
    global_rank: int

    @property
    def call_args(self) -> dict[str, Any]:
        raise NotImplementedError  # DiffusionModule's

    def configure_model(self) -> None:
        if self.pipeline is not None:
            return
        self.fetch_weights()
        quantized = self.quantization_configs()
        self.load_pipeline(**{
            name: load(self.info, self.dtype_,
                       **({"quantization_config": quantized[name]} if name in quantized else {}))
            for name, load in self.load_plan.components.items()
        })

    def fetch_weights(self) -> None:
        """A hub id with network: the first process of each node fetches what ``from_pretrained``
        reads while the node's other processes wait, instead of every rank downloading (and
        locking) the same tens of gigabytes at once; offline, the cache was checked before loading."""
        from lightning_diffusion.pipelines import hub

        if not hub.is_hub_id(self.info.path) or hub.offline() or self.from_pretrained_kwargs.get("local_files_only"):
            return
        strategy: Any = self._trainer.strategy if self._trainer is not None else None  # (Any: as above)
        if strategy is None or strategy.local_rank == 0:
            try:
                folder = hub.fetch(self.info.path, self.from_pretrained_kwargs, progress=self.global_rank == 0)
            except Exception as err:
                known = hub.message(err, self.info.path, self.from_pretrained_kwargs)
                if known is None:
                    raise
                raise ConfigError(known) from err
            if self.global_rank == 0:
                log.info(f"{self.info.path}: weights in the cache at {folder}")
        if strategy is not None and strategy.world_size > 1:
            strategy.barrier("weights_fetched")

    def quantization_configs(self) -> dict[str, Any]:
        """``model.quantization`` as each quantized component's backend config (none without it)."""
        spec = self.options["quantization"]
        return quantization.component_configs(spec, self.info.model_index, tuple(self.info.denoisers())) if spec else {}

    def load_pipeline(self, **components: Any) -> None:
        """Load the pipeline on the CPU; ``components`` are pre-built components (a strategy may
        build the transformer itself, sharded) passed through to ``from_pretrained``."""
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        if not self.show_inner_progress:
            diffusers_logging.disable_progress_bar()
            transformers_logging.disable_progress_bar()
        # safetensors only and no remote code unless the user opts in (from_pretrained_kwargs).
        options = {"use_safetensors": True, "trust_remote_code": False, **self.from_pretrained_kwargs}
        quantized = {name: c for name, c in self.quantization_configs().items() if name not in components}
        if quantized:  # a component the strategy built was quantized by its loader
            options["quantization_config"] = quantization.pipeline_config(quantized)
        compat.apply_pipeline_patches()
        pipeline = self.info.pipeline_class.from_pretrained(  # model.pipeline_class, else the folder's
            self.info.path, dtype=self.dtype_, **options, **self.load_plan.pipeline_kwargs, **components
        )
        if not self.show_inner_progress:
            pipeline.set_progress_bar_config(disable=True)
        if self.options["quantization"] is not None and self.global_rank == 0:
            spec = self.options["quantization"]
            for name, (left, total) in quantization.left_unquantized(
                    pipeline, spec, quantization.quantized(spec, tuple(self.info.denoisers()))).items():
                log.warning(f"model.quantization: {left} of {name}'s {total} linear layers loaded in full precision "
                            "(a device map offloaded them: diffusers does not quantize weights on the CPU or disk)")
        if self.adapters:  # fused before any strategy hook, cache or compile sees the weights
            from lightning_diffusion.pipelines import lora

            (self.load_plan.fuse_adapters or lora.fuse)(pipeline, self.adapters)
            if self.global_rank == 0:
                log.info(f"model.lora: {', '.join(f'{a.name} x {a.scale:g}' for a in self.adapters)} fused")
        tiling = self.options["vae_tiling"]
        if tiling:
            pipeline.vae.enable_tiling(**(tiling if isinstance(tiling, dict) else {}))
        if self.options["vae_slicing"]:
            pipeline.vae.enable_slicing()
        self.pipeline = pipeline
        if self.options["attention_backend"] is not None:
            for component in self.denoiser_modules().values():
                component.set_attention_backend(self.options["attention_backend"])
        for name, component in pipeline.components.items():
            if isinstance(component, nn.Module):
                self.components[name] = component
        if self.cache is not None:
            steps = self.call_args.get("num_inference_steps") or self.info.call_default("num_inference_steps")
            self.step_cache = install(self.cache, pipeline, steps, separate_passes=self.info.spec.cfg is not None)

    def compile_denoisers(self) -> None:
        """``model.compile`` on each denoiser of the pipeline the strategy set up (after its
        context-parallel hooks, sharding and caches), once."""
        mode = self.options["compile"]
        if mode is None or self.compiled or self.pipeline is None:
            return
        modules = self.denoiser_modules()
        for component in modules.values():
            if mode == "regional":
                component.compile_repeated_blocks()
            else:
                component.compile()
        self.compiled = True
        if self.global_rank == 0:
            log.info(f"model.compile: {mode} on {', '.join(modules)}; the first batch of each shape compiles")

    def denoiser_modules(self) -> dict[str, Any]:
        """The pipeline's denoisers that are loaded (Wan 2.1 lists an empty ``transformer_2``): diffusers
        models (``Any``: their methods, such as ``set_attention_backend``, are not nn.Module's)."""
        found = {name: getattr(self.pipeline, name, None) for name in self.info.denoisers()}
        return {name: module for name, module in found.items() if isinstance(module, nn.Module)}
