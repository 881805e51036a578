"""``ContextParallelStrategy``: split each image's token sequence over a group of devices with
diffusers' own Ulysses / Ring / Unified attention (``ContextParallelConfig``, the model's ``_cp_plan``,
``enable_parallelism``); processes beyond one group become data-parallel replicas."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_diffusion import compat
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.strategies.parallel import DEFAULT_TIMEOUT_S, DiffusionParallelStrategy


def _attention_registry():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return AttentionBackendName, _AttentionBackendRegistry


def check_attention_backend(name: str) -> None:
    """The backend must exist and support context parallelism in the installed diffusers."""
    names, registry = _attention_registry()
    try:
        backend = names(name)
    except ValueError:
        raise ConfigError(
            f"attention_backend {name!r} is not a diffusers attention backend; "
            f"choose one of: {', '.join(sorted(b.value for b in names))}."
        ) from None
    if not registry._is_context_parallel_available(backend):
        raise ConfigError(
            f"attention_backend {name!r} cannot do context parallelism; choose one of: "
            f"{', '.join(sorted(registry._supports_context_parallel))}."
        )


def parallel_components(pipeline: Any) -> dict[str, torch.nn.Module]:
    """The pipeline's models that carry a context-parallel plan (the transformer(s))."""
    return {
        name: component
        for name, component in pipeline.components.items()
        if isinstance(component, torch.nn.Module) and getattr(component, "_cp_plan", None) is not None
    }


class ContextParallelStrategy(DiffusionParallelStrategy):
    """Context parallelism through diffusers: each image's sequence is split over
    ``ulysses_degree * ring_degree`` processes; the world size must be a multiple of that, and the
    remaining factor becomes data-parallel replicas (4 processes with ``ulysses_degree=2``: 2
    replicas of a 2-way Ulysses group). Every rank of a group gets the same prompts and seeds;
    the first rank of each group writes.

    Args:
        ulysses_degree: all-to-all over attention heads (needs heads divisible by it, or ``ulysses_anything``).
        ring_degree: ring attention over key/value blocks.
        ulysses_anything: Ulysses for sequence lengths and head counts that do not divide the degree.
        ring_anything: ring attention for sequence lengths that do not divide the degree.
        attention_backend: a diffusers attention backend that supports context parallelism; ``None``
            keeps diffusers' default (``native``), except ring on CUDA, which takes ``_native_cudnn``
            because ``native`` returns no log-sum-exp there.
        process_group_backend: ``None`` picks ``cpu:gloo,cuda:nccl`` on CUDA (size exchanges of the
            anything-modes then avoid device syncs, as the diffusers guide recommends) and ``gloo`` on CPU.
        timeout: seconds a collective may wait before the process group gives up.
    """

    def __init__(
        self,
        ulysses_degree: int = 1,
        ring_degree: int = 1,
        ulysses_anything: bool = False,
        ring_anything: bool = False,
        attention_backend: Optional[str] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
                raise ConfigError(f"{name} must be an integer >= 1 (or -1: every process of a replica), got {value!r}.")
        if ulysses_degree == -1 and ring_degree == -1:
            raise ConfigError("Only one of ulysses_degree and ring_degree may be -1.")
        if ulysses_degree * ring_degree == 1:
            raise ConfigError(
                "Context parallelism needs ulysses_degree > 1 or ring_degree > 1; "
                "for one device per image use strategy data_parallel."
            )
        if ulysses_anything and ring_anything:
            raise ConfigError("Set at most one of ulysses_anything and ring_anything.")
        if attention_backend is not None:
            check_attention_backend(attention_backend)
        self._requested = {"ulysses": ulysses_degree, "ring": ring_degree}
        self.ulysses_anything = ulysses_anything
        self.ring_anything = ring_anything
        self.attention_backend = attention_backend

    def degrees(self) -> dict[str, int]:
        inferred = -1 in self._requested.values()
        return {"dp": 1 if inferred else -1, **self._requested}

    def make_parallel_dims(self, world_size: int):
        dims = super().make_parallel_dims(world_size)
        if dims.cp == 1:
            raise ConfigError(
                f"Context parallelism over {world_size} process(es) leaves a group of 1: "
                "launch more devices (trainer.devices x trainer.num_nodes) or use strategy data_parallel."
            )
        # diffusers' own rules for the anything-modes, checked here so they fail before any process starts.
        if self.ring_anything and dims.ring == 1:
            raise ConfigError("ring_anything needs ring_degree > 1; for Ulysses use ulysses_anything instead.")
        if self.ulysses_anything and dims.ulysses == 1:
            raise ConfigError("ulysses_anything needs ulysses_degree > 1; for ring use ring_anything instead.")
        if self.ulysses_anything and dims.ring > 1:
            raise ConfigError("ulysses_anything works with ring_degree=1 only (diffusers has no unified anything-mode).")
        if self.ring_anything and dims.ulysses > 1:
            raise ConfigError("ring_anything works with ulysses_degree=1 only (diffusers has no unified anything-mode).")
        return dims

    @property
    def ulysses_degree(self) -> int:
        return self.parallel_dims.ulysses

    @property
    def ring_degree(self) -> int:
        return self.parallel_dims.ring

    @property
    def mode(self) -> str:
        if self.ring_degree > 1 and self.ulysses_degree > 1:
            return "unified"
        name = "ring" if self.ring_degree > 1 else "ulysses"
        return f"{name}-anything" if self.ulysses_anything or self.ring_anything else name

    # ----------------------------------------------------------------- checks before weights

    def check_model(self, module: pl.LightningModule) -> None:
        info = getattr(module, "info", None)
        if info is None:  # not a DiffusionModule: nothing known before loading
            return
        planned = info.models_with("_cp_plan")
        if not planned:
            raise ConfigError(
                f"{info.class_name} has no model with a context-parallel plan (_cp_plan) in diffusers; "
                "use data_parallel, or a pipeline whose transformer has one (FLUX, FLUX.2, Qwen-Image, Wan, LTX)."
            )
        for name in planned:
            heads = info.configs.get(name, {}).get("num_attention_heads")
            if isinstance(heads, int) and heads % self.ulysses_degree and not self.ulysses_anything:
                raise ConfigError(
                    f"{name} has {heads} attention heads, not divisible by ulysses_degree={self.ulysses_degree}: "
                    f"use ulysses_anything=True or a ulysses_degree that divides {heads}."
                )
        trainer = getattr(module, "_trainer", None)
        records = getattr(getattr(trainer, "datamodule", None), "records", None) or [{}]
        for record in records:
            call_args = {**module.base_call_args, **module.call_kwargs, **{k: v for k, v in record.items()}}
            self.check_sequence(info, call_args.get("height"), call_args.get("width"), call_args)

    def check_sequence(self, info: Any, height: Optional[int], width: Optional[int], call_args: dict) -> None:
        if self.ulysses_anything or self.ring_anything:
            return
        degree = self.ulysses_degree * self.ring_degree
        flag = "ulysses_anything" if self.ring_degree == 1 else "ring_anything"
        if self.ring_degree > 1 and self.ulysses_degree > 1:
            fix = "choose sizes"
        else:
            fix = f"use {flag}=True or choose sizes"
        for kind, length in info.sequence_lengths(height, width, call_args).items():
            if length % degree == 0:
                continue
            if kind == "image":
                m = info.size_multiple
                raise ConfigError(
                    f"{height}x{width} gives {length} image tokens ((height/{m}) x (width/{m})), not divisible by "
                    f"the context-parallel degree {degree}: {fix} whose token count is divisible by {degree}."
                )
            raise ConfigError(
                f"{info.traits.text_length_arg}={length} text tokens are not divisible by the context-parallel "
                f"degree {degree}: {fix.replace('sizes', 'a ' + info.traits.text_length_arg)} divisible by {degree}."
            )

    # ----------------------------------------------------------------- process group and placement

    def setup_environment(self) -> None:
        if self._process_group_backend is None and self.root_device.type == "cuda":
            self._process_group_backend = "cpu:gloo,cuda:nccl"
        super().setup_environment()

    def resolved_attention_backend(self, dtype: torch.dtype) -> Optional[str]:
        if self.attention_backend is not None or self.root_device.type == "cpu" or self.ring_degree == 1:
            return self.attention_backend
        if dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(
                "Ring attention on CUDA needs an attention backend that returns the log-sum-exp; those that "
                "diffusers has need bfloat16 or float16: set model.torch_dtype to bfloat16, or attention_backend."
            )
        return "_native_cudnn"

    def parallelize(self, pipeline: Any) -> None:
        from diffusers import ContextParallelConfig

        if self.root_device.type == "cpu":
            compat.apply_cpu_rehearsal_patches()
        mesh = self.device_mesh["ring", "ulysses"]
        for component in parallel_components(pipeline).values():
            backend = self.resolved_attention_backend(component.dtype)
            if backend is not None:
                component.set_attention_backend(backend)
            component.enable_parallelism(
                config=ContextParallelConfig(
                    ring_degree=self.ring_degree,
                    ulysses_degree=self.ulysses_degree,
                    ulysses_anything=self.ulysses_anything,
                    ring_anything=self.ring_anything,
                    mesh=mesh,
                )
            )
            rank_zero_info(
                f"context parallel {self.mode} (ring={self.ring_degree}, ulysses={self.ulysses_degree}) on "
                f"{type(component).__name__}, attention backend {backend or 'default'}"
            )
