"""Loading a ``DiffusionModule``'s pipeline: the weights fetched once a node, ``from_pretrained``
with the strategy's ``LoadPlan``, then the options that change the loaded pipeline (quantization,
LoRA adapters fused, VAE tiling and slicing, the attention backend, the step cache, compilation).

``PipelineLoader`` holds the model's loading settings; ``DiffusionModule`` holds one, and its
``configure_model`` (Lightning's hook) loads with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol, Union

import torch
from torch import nn

from lightning_diffusion.core.console import log
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.pipelines import compat, quantization
from lightning_diffusion.pipelines.cache import StepCache, install
from lightning_diffusion.pipelines.settings import LoadPlan

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    from lightning_diffusion.pipelines.lora import Adapter
    from lightning_diffusion.pipelines.model_folder import PipelineInfo
    from lightning_diffusion.pipelines.quantization import BackendConfig


class NodeRanks(Protocol):
    """What fetching the weights reads of the run's strategy (every Lightning strategy has these
    once its processes have started, though its base class does not declare the ranks)."""

    @property
    def local_rank(self) -> int:
        ...

    @property
    def world_size(self) -> int:
        ...

    def barrier(self, name: Optional[str] = None) -> None:
        ...


def decoding_defaults(info: PipelineInfo, options: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The decoding options a pipeline cannot run without, where ``model.vae_tiling`` is unset: a VAE
    that decodes only by tiles (``PipelineFacts.tiled_only``) gets ``vae_tiling: true`` and, where it
    can, ``vae_slicing`` (Allegro's tiled decode fills a one-sample buffer), with the lines that say
    so; and what a run says of a size it cannot check (``PipelineInfo.size_note``). An explicit
    ``vae_tiling: false`` is refused by ``checks.vae_tiling_problems``."""
    changed: dict[str, Any] = {}
    notes = [note for note in (info.size_note(),) if note]
    vae = info.facts.tiled_only
    if vae and options.get("vae_tiling") is None:
        changed["vae_tiling"] = True
        slicing = not options.get("vae_slicing") and callable(getattr(info.component_class("vae"), "enable_slicing",
                                                                       None))
        if slicing:
            changed["vae_slicing"] = True
        also = " and model.vae_slicing (its tiled decode takes one sample)" if slicing else ""
        notes.append(f"model.vae_tiling: on{also}, as {info.class_name}'s VAE ({vae}) decodes only by tiles; "
                     "set model.vae_tiling to choose its tiles")
    return changed, notes


class LoadedPipeline(NamedTuple):
    """What ``PipelineLoader.load_pipeline`` made: the pipeline with its options applied, and the
    step cache installed on it (``None`` without ``model.cache``)."""

    pipeline: DiffusionPipeline
    step_cache: Optional[StepCache]


@dataclass(frozen=True)
class PipelineLoader:
    """How the pipeline of ``info`` loads, from the model's settings: ``dtype``, the user's
    ``from_pretrained_kwargs``, ``quantization``, the LoRA ``adapters``, ``vae_tiling``,
    ``vae_slicing``, ``attention_backend``, ``compile``, the step ``cache`` (with the config's
    ``num_inference_steps``; ``None``: the pipeline's default), ``show_inner_progress`` and the
    ``notes`` logged once it loads (``decoding_defaults``).

    It keeps no pipeline: the one it loads is returned (``LoadedPipeline``) and owned by the module
    (``DiffusionModule.pipeline``, which a strategy may then replace with its parallelised one)."""

    info: PipelineInfo
    dtype: torch.dtype
    from_pretrained_kwargs: dict[str, Any] = field(default_factory=dict)
    quantization: Optional[Mapping[str, Any]] = None
    adapters: Sequence[Adapter] = ()
    vae_tiling: Union[bool, Mapping[str, int], None] = None
    vae_slicing: bool = False
    attention_backend: Optional[str] = None
    compile: Optional[str] = None
    cache: Optional[Mapping[str, Any]] = None
    num_inference_steps: Optional[int] = None
    show_inner_progress: bool = False
    notes: Sequence[str] = ()

    def build_components(self, plan: LoadPlan) -> dict[str, nn.Module]:
        """The components ``plan`` builds itself (a transformer sharded while it loads, one placed
        by a device map), each quantized as ``model.quantization`` says."""
        quantized = self.quantization_configs()
        return {name: load(self.info, self.dtype,
                           **({"quantization_config": quantized[name]} if name in quantized else {}))
                for name, load in plan.components.items()}

    def fetch_weights(self, strategy: Optional[NodeRanks], global_rank: int) -> None:
        """A hub id with network: the first process of each node fetches what ``from_pretrained``
        reads while the node's other processes wait, instead of every rank downloading (and
        locking) the same tens of gigabytes at once; offline, the cache was checked before loading."""
        from lightning_diffusion.pipelines import hub

        if not hub.is_hub_id(self.info.path) or hub.offline() or self.from_pretrained_kwargs.get("local_files_only"):
            return
        if strategy is None or strategy.local_rank == 0:
            try:
                folder = hub.fetch(self.info.path, self.from_pretrained_kwargs, progress=global_rank == 0)
            except Exception as err:
                known = hub.message(err, self.info.path, self.from_pretrained_kwargs)
                if known is None:
                    raise
                raise ConfigError(known) from err
            if global_rank == 0:
                log.info(f"{self.info.path}: weights in the cache at {folder}")
        if strategy is not None and strategy.world_size > 1:
            strategy.barrier("weights_fetched")

    def quantization_configs(self) -> dict[str, BackendConfig]:
        """``model.quantization`` as each quantized component's backend config (none without it)."""
        spec = self.quantization
        return quantization.component_configs(spec, self.info.model_index, tuple(self.info.denoisers())) if spec else {}

    def load_pipeline(self, plan: LoadPlan, components: Mapping[str, nn.Module], global_rank: int) -> LoadedPipeline:
        """Load the pipeline on the CPU; ``components`` are pre-built components (a strategy may
        build the transformer itself, sharded) passed through to ``from_pretrained``, with the
        ``plan``'s extra arguments."""
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
        # model.pipeline_class, else the folder's
        try:
            pipeline: DiffusionPipeline = self.info.pipeline_class.from_pretrained(
                self.info.path, dtype=self.dtype, **options, **plan.pipeline_kwargs, **components
            )
        except OSError as err:  # a file the Hub was asked for (remote code, a custom pipeline) and could not give
            from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

            if not isinstance(err, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
                raise
            custom = options.get("custom_pipeline")
            what = f"model.from_pretrained_kwargs.custom_pipeline {custom!r}" if custom else str(self.info.path)
            raise ConfigError(f"{what} could not be fetched from the Hugging Face Hub (no network here, or not in "
                              "the cache): fetch it where there is network (lightning-diffusion download), or give a "
                              "local folder.") from None
        if not self.show_inner_progress:
            pipeline.set_progress_bar_config(disable=True)
        if self.quantization is not None and global_rank == 0:
            spec = self.quantization
            for name, (left, total) in quantization.left_unquantized(
                    pipeline, spec, quantization.quantized(spec, tuple(self.info.denoisers()))).items():
                log.warning(f"model.quantization: {left} of {name}'s {total} linear layers loaded in full precision "
                            "(a device map offloaded them: diffusers does not quantize weights on the CPU or disk)")
        if self.adapters:  # fused before any strategy hook, cache or compile sees the weights
            from lightning_diffusion.pipelines import lora

            (plan.fuse_adapters or lora.fuse)(pipeline, self.adapters)
            if global_rank == 0:
                log.info(f"model.lora: {', '.join(f'{a.name} x {a.scale:g}' for a in self.adapters)} fused")
        if global_rank == 0:
            for note in self.notes:
                log.info(note)
        tiling = self.vae_tiling
        if tiling:
            pipeline.vae.enable_tiling(**(tiling if isinstance(tiling, dict) else {}))
        if self.vae_slicing:
            pipeline.vae.enable_slicing()
        if self.attention_backend is not None:
            for component in self.denoiser_modules(pipeline).values():
                component.set_attention_backend(self.attention_backend)
        step_cache = None
        if self.cache is not None:
            steps = self.num_inference_steps or self.info.call_default("num_inference_steps")
            step_cache = install(self.cache, pipeline, steps, separate_passes=self.info.spec.cfg is not None)
        return LoadedPipeline(pipeline, step_cache)

    def compile_denoisers(self, pipeline: object, global_rank: int) -> bool:
        """``model.compile`` on each denoiser of ``pipeline`` (the one the strategy set up: after
        its context-parallel hooks, sharding and caches); whether it compiled (not without
        ``model.compile``). The module calls it once."""
        mode = self.compile
        if mode is None:
            return False
        modules = self.denoiser_modules(pipeline)
        for component in modules.values():
            if mode == "regional":
                component.compile_repeated_blocks()
            else:
                component.compile()
        if global_rank == 0:
            log.info(f"model.compile: {mode} on {', '.join(modules)}; the first batch of each shape compiles")
        return True

    def denoiser_modules(self, pipeline: object) -> dict[str, Any]:
        """The pipeline's denoisers that are loaded (Wan 2.1 lists an empty ``transformer_2``): diffusers
        models (``Any``: their methods, such as ``set_attention_backend``, are not nn.Module's)."""
        found = {name: getattr(pipeline, name, None) for name in self.info.denoisers()}
        return {name: module for name, module in found.items() if isinstance(module, nn.Module)}
