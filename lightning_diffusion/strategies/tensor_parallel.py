"""``TensorParallelStrategy``: shard the transformer's linear layers over a group of devices with
diffusers' ``TensorParallelConfig`` and the model's ``_tp_plan``, reading only each rank's slice of
every weight while loading; processes beyond one group become data-parallel replicas."""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_diffusion import compat
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.strategies.parallel import DEFAULT_TIMEOUT_S, DiffusionParallelStrategy

# from_pretrained options that diffusers cannot combine with a tensor-parallel load, and why.
_INCOMPATIBLE_OPTIONS = {
    "quantization_config": "quantized weights cannot be sharded into DTensors",
    "device_map": "tensor parallelism already places each rank's shard on its device",
    "max_memory": "it only applies with device_map",
    "offload_folder": "offloaded weights cannot be sharded",
    "offload_state_dict": "offloaded weights cannot be sharded",
}


def check_shardable(cls: type, config: dict[str, Any], tp_degree: int, name: str) -> None:
    """Heads and every (packed) block of the plan must divide by ``tp_degree``; checked on an empty
    (meta) model built from the config alone, so no weight is read."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp_degree:
        raise ConfigError(f"{name} has {heads} attention heads, not divisible by tp_degree={tp_degree}.")
    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    try:
        resolve_tp_shard_specs(model, cls._tp_plan, tp_degree)
    except ValueError as err:
        raise ConfigError(f"{name}: {err} Choose a tp_degree that divides it.") from None


def load_sharded(cls: type, path: str, subfolder: str | None, dtype: torch.dtype, tp_mesh: Any, **options: Any):
    """Create a diffusers model with a tensor-parallel ``parallel_config``: diffusers builds it empty
    and streams this rank's slice of every planned weight straight into a DTensor."""
    from diffusers import TensorParallelConfig

    if tp_mesh.device_type == "cpu":
        compat.apply_cpu_rehearsal_patches()
    return cls.from_pretrained(
        path, subfolder=subfolder, dtype=dtype, parallel_config=TensorParallelConfig(mesh=tp_mesh), **options
    )


class TensorParallelStrategy(DiffusionParallelStrategy):
    """Tensor parallelism through diffusers: each linear layer of the transformer's ``_tp_plan`` is
    split column- or row-wise over ``tp_degree`` processes, which read only their own slice of each
    weight from the safetensors files (no rank ever holds the whole transformer). Text encoders and
    VAE are whole on every rank. Processes beyond one group become data-parallel replicas.

    Args:
        tp_degree: processes per tensor-parallel group; ``-1``: all processes.
        process_group_backend: ``nccl`` on CUDA and ``gloo`` on CPU when left ``None``.
        timeout: seconds a collective may wait before the process group gives up.
    """

    def __init__(
        self,
        tp_degree: int = -1,
        process_group_backend: str | None = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or (tp_degree < 1 and tp_degree != -1):
            raise ConfigError(f"tp_degree must be an integer >= 1 (or -1: all processes), got {tp_degree!r}.")
        self._tp_request = tp_degree
        self._sharded: set[str] = set()

    def degrees(self) -> dict[str, int]:
        return {"dp": 1 if self._tp_request == -1 else -1, "tp": self._tp_request}

    def make_parallel_dims(self, world_size: int):
        dims = super().make_parallel_dims(world_size)
        if dims.tp == 1:
            raise ConfigError(
                f"Tensor parallelism over {world_size} process(es) leaves a group of 1: launch more devices "
                "(trainer.devices x trainer.num_nodes) or use strategy data_parallel."
            )
        return dims

    @property
    def tp_degree(self) -> int:
        return self.parallel_dims.tp

    def check_model(self, module: pl.LightningModule) -> None:
        info = getattr(module, "info", None)
        if info is None:
            return
        planned = info.models_with("_tp_plan")
        if not planned:
            raise ConfigError(
                f"{info.class_name} has no model with a tensor-parallel plan (_tp_plan) in diffusers; "
                "use data_parallel or context parallelism, or a pipeline with one (FLUX, FLUX.2, Qwen-Image)."
            )
        options = getattr(module, "from_pretrained_kwargs", {})
        for option, reason in _INCOMPATIBLE_OPTIONS.items():
            if options.get(option) is not None:
                raise ConfigError(f"model.from_pretrained_kwargs.{option} cannot be used with tensor parallelism: {reason}.")
        if options.get("use_safetensors") is False or options.get("low_cpu_mem_usage") is False:
            raise ConfigError(
                "Tensor parallelism reads each rank's slice of safetensors files while loading: "
                "drop use_safetensors=False and low_cpu_mem_usage=False."
            )
        for name, cls in planned.items():
            folder = Path(info.path) / name
            if folder.is_dir() and not any(folder.glob("*.safetensors")):
                raise ConfigError(
                    f"{folder} has no .safetensors weights; tensor parallelism reads each rank's slice from "
                    "safetensors files. Convert the checkpoint (save_pretrained(safe_serialization=True))."
                )
            check_shardable(cls, info.configs.get(name, {}), self.tp_degree, name)

    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        info = getattr(module, "info", None)
        if info is None or not hasattr(module, "component_loaders"):
            return
        for name, cls in info.models_with("_tp_plan").items():
            module.component_loaders[name] = partial(self._load_sharded, name, cls, dict(module.from_pretrained_kwargs))

    def _load_sharded(self, name: str, cls: type, options: dict, info: Any, dtype: torch.dtype) -> torch.nn.Module:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        passed = {k: v for k, v in options.items() if k in ("revision", "variant", "token", "cache_dir")}
        model = load_sharded(cls, info.path, name, dtype, self.device_mesh["tp"], **passed)
        self._sharded.add(name)
        from torch.distributed.tensor import DTensor

        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        rank_zero_info(
            f"tensor parallel tp={self.tp_degree}: {cls.__name__} '{name}' loaded shard by shard, "
            f"{local:,} of {total:,} parameters on this rank"
        )
        return model

    def setup(self, trainer: pl.Trainer) -> None:
        # Lightning predicts under torch.inference_mode on NCCL, and DTensor operations fail on
        # inference tensors (pytorch/pytorch#142190); no_grad gives the same memory savings here.
        trainer.predict_loop.inference_mode = False
        super().setup(trainer)

    def model_to_device(self) -> None:
        # Move the whole components only: the sharded ones are already on this rank's device, and
        # moving DTensor shards through Module.to would be pointless at best.
        module = self.lightning_module
        for name, component in getattr(module, "components", {}).items():
            if name not in self._sharded:
                component.to(self.root_device)
