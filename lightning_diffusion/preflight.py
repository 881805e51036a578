"""Checks of a whole config before anything starts: every problem found is reported at once.

The CLI runs ``preflight`` after parsing and before it builds any object, so a config with three
mistakes gets one message naming all three, in seconds, instead of a fix-and-retry loop with a
model load in between: model, prompts, writer, disk space, and the degrees of the project's
strategies against the world size and the model (``check_request``, the same rules a strategy runs
on every rank when the Trainer is used from Python). The ranks the CLI starts trust this check.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_diffusion.contract import ModelRequest
from lightning_diffusion.data import check_data_args, load_records
from lightning_diffusion.errors import ConfigError, gather, is_int
from lightning_diffusion import lora
from lightning_diffusion.module import (OPTIONS, check_model_args, check_records, effective_call_args, image_settings,
                                       recorded_options)
from lightning_diffusion.pipelines import PipelineInfo, resolve_dtype
from lightning_diffusion.manifest import in_shard, read_manifest, settings_conflict, shard_size
from lightning_diffusion.writer import WRITER_DEFAULTS, check_writer_args, run_settings

# PNG keeps about half of the raw RGB bytes for generated images; used only to warn early.
_PNG_RATIO = 0.5
_NAMED = ("height", "width", "num_inference_steps", "guidance_scale", "num_frames")


def check_disk_space(
    info: PipelineInfo, named: dict[str, Any], records: Sequence[Any], per_prompt: int, output_dir: str,
    num_shards: int = 1, shard_index: int = 0,
) -> None:
    folder = Path(output_dir).expanduser()
    done = read_manifest(folder) if folder.is_dir() else {}
    shard = (shard_index, num_shards) if num_shards > 1 else None
    pending = max(0, shard_size(len(records) * per_prompt, shard) - sum(in_shard(i, shard) for i in done))
    default = info.spec.default_size or (1024, 1024)
    height, width = named.get("height") or default[0], named.get("width") or default[1]
    frames = named.get("num_frames") or info.spec.default_frames or 1
    need = pending * height * width * 3 * frames * _PNG_RATIO
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if need > free:
        raise ConfigError(
            f"{pending:,} outputs of {height}x{width}{f' x {frames} frames' if frames > 1 else ''} need about "
            f"{need / 1e9:,.1f} GB, but {existing} has {free / 1e9:,.1f} GB free."
        )


def build_strategy(spec: Any) -> Optional[Any]:
    """The project's strategy a config names (a registered name or a class path), built to check
    its arguments; None for another strategy, which is checked by Lightning itself."""
    import importlib

    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_diffusion.strategies.parallel import DiffusionParallelStrategy

    if isinstance(spec, str):
        strategy = StrategyRegistry.get(spec) if spec in StrategyRegistry else None
    elif spec is not None and spec.get("class_path"):
        module_name, _, name = spec.class_path.rpartition(".")
        cls = getattr(importlib.import_module(module_name), name, None)
        if not (isinstance(cls, type) and issubclass(cls, DiffusionParallelStrategy)):
            return None
        strategy = cls(**dict(spec.get("init_args") or {}))
    else:
        return None
    return strategy if isinstance(strategy, DiffusionParallelStrategy) else None


def device_type(accelerator: Any) -> str:
    """The device type a config's ``trainer.accelerator`` gives on this machine."""
    name = str(accelerator or "auto").lower()
    if name in ("gpu", "cuda"):
        return "cuda"
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if name == "cpu" else name


def world_size(trainer: Any) -> Optional[int]:
    """devices x num_nodes when the config says it (None for "auto" or a device list)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        return None
    return devices * nodes


def preflight(config: Any) -> tuple[list, bool]:
    """Every weight-free check of the ``model``, ``data`` and ``writer`` groups of a parsed config.
    Returns the problems and whether the checks were complete: the strategy's rules need the world
    size, which a config with ``devices: auto`` (or a device list) leaves to the Trainer; then the
    ranks must run them themselves."""
    model, data, writer = config.model, config.data, config.writer
    named = {key: model.get(key) for key in _NAMED}
    info: Optional[PipelineInfo]
    problems: list = []
    options = {key: model.get(key) for key in OPTIONS}
    records = gather(problems, load_records, data.prompts)
    info, model_problems = check_model_args(
        model.pretrained_model_name_or_path, model.torch_dtype, named, model.get("call_kwargs"),
        model.get("cache"), records, options, dict(model.get("from_pretrained_kwargs") or {}),
    )
    problems = model_problems + problems
    problems += check_data_args(data.batch_size, data.seed, data.num_images_per_prompt, data.get("num_shards", 1),
                                data.get("shard_index", 0),
                                len(records) * data.num_images_per_prompt
                                if records is not None and is_int(data.num_images_per_prompt, 1) else None)
    if info is not None and records is not None:
        base, extra = effective_call_args(info, named, model.get("call_kwargs"))
        problems += check_records(info, records, call_args={**base, **extra}, inputs_root=data.get("inputs_root"))
    problems += check_writer_args(writer.output_dir, writer.video_format, writer.fps, *(
        writer.get(key, default) for key, default in WRITER_DEFAULTS.items()))
    # Built first, so that a bad strategy argument is reported with the other problems; its rules
    # against the model run once the model and records are known to be right.
    strategy = gather(problems, build_strategy, config.trainer.get("strategy"))
    size = world_size(config.trainer)
    complete = strategy is None or size is not None
    if strategy is not None and size is not None:
        gather(problems, strategy.make_parallel_dims, size)
        if info is not None and not problems:
            base, extra = effective_call_args(info, named, model.get("call_kwargs"))
            call_args = {**base, **extra}
            request = ModelRequest(info, resolve_dtype(model.torch_dtype), call_args,
                                   dict(model.get("from_pretrained_kwargs") or {}), records,
                                   options["attention_backend"], options["quantization"],
                                   tuple(lora.parse(options["lora"])))
            problems += strategy.check_request(request, size, device_type(config.trainer.get("accelerator")))
    if info is not None and records is not None and not problems:
        base, extra = effective_call_args(info, named, model.get("call_kwargs"))
        gather(problems, check_disk_space, info, base, records, data.num_images_per_prompt, writer.output_dir,
               data.get("num_shards", 1), data.get("shard_index", 0))
        if not writer.get("allow_config_change"):
            # The writer checks again when the run starts; here it costs no process start.
            settings = run_settings(
                image_settings(model.pretrained_model_name_or_path, model.torch_dtype, {**base, **extra},
                               dict(model.get("from_pretrained_kwargs") or {}), model.get("cache"),
                               recorded_options(options)),
                data.seed, data.num_images_per_prompt, data.prompts, writer.get("video_format") or "mp4",
                writer.get("fps") or 16, writer.get("image_format", "png"), writer.get("quality", 90))
            conflict = settings_conflict(Path(writer.output_dir).expanduser(), settings)
            if conflict:
                problems.append(conflict)
    return problems, complete
