"""The settings of a run, each declared once: the writer group's options (default, choices,
bounds), which ``ImageWriter``'s signature, ``validation.writer_problems``, ``preflight`` and
run.json all read; and what run.json records of the model, the prompt set and the storage, which
the writer and ``preflight`` both compute (so that a folder made with other settings is refused
before anything starts, and again by the writer when the run starts).

Kept free of torch and Lightning: the CLI's checks and the writer process import it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_diffusion.errors import ConfigError
from lightning_diffusion.output.background import WRITE_IN
from lightning_diffusion.output.files import (
    FILES_PER_FOLDER,
    FORMATS,
    FSYNC,
    IMAGE_FORMATS,
    LAYOUTS,
    PNG_COMPRESS_LEVEL,
    SAMPLES_PER_SHARD,
    VIDEO_FORMATS,
    resolve_layout,
)
from lightning_diffusion.output.manifest import PROMPTS_HASH, prompts_hash

if TYPE_CHECKING:
    from lightning_diffusion.boundaries import RunPlan


@dataclass(frozen=True)
class Option:
    """One option of a config group: its default, and the values it may take (``choices``, or an
    integer from ``minimum`` to ``maximum``); ``label`` names it in messages where its config key
    alone would not say enough, ``hint`` ends its message."""

    default: Any
    choices: tuple[Any, ...] = ()
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    integer: bool = False
    label: str = ""
    hint: str = ""


# ``ImageWriter``'s options (``output_dir`` is checked as a folder by ``validation``).
WRITER: dict[str, Option] = {
    "output_dir": Option("outputs"),
    "save_arrays": Option(False),
    "video_format": Option("mp4", VIDEO_FORMATS),
    "fps": Option(16, minimum=1, integer=True),
    "allow_config_change": Option(False),
    "image_format": Option("png", tuple(IMAGE_FORMATS)),
    "quality": Option(90, minimum=1, maximum=100, integer=True, label="writer.quality (WebP and JPEG)"),
    "png_compress_level": Option(PNG_COMPRESS_LEVEL, minimum=0, maximum=9, integer=True),
    "fsync": Option("batch", FSYNC),
    "write_queue": Option(2, minimum=1, integer=True),
    "write_workers": Option(2, minimum=0, integer=True, hint=" (0: write on the prediction thread)"),
    "write_in": Option("process", WRITE_IN),
    "layout": Option("auto", LAYOUTS),
    "files_per_folder": Option(FILES_PER_FOLDER, minimum=1, integer=True),
    "format": Option("files", FORMATS),
    "samples_per_shard": Option(SAMPLES_PER_SHARD, minimum=1, integer=True),
    # an object store (output_dir s3://...): where tar shards are built, and fsspec's options
    "staging_dir": Option(None),
    "storage_options": Option(None),
}


def writer_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """The writer group's values: ``given`` (a parsed config's ``writer`` section, or keyword
    arguments), every absent option at its default."""
    unknown = sorted(set(given) - set(WRITER))
    if unknown:
        raise ConfigError(f"the writer has no option {', '.join(unknown)}; it has: {', '.join(WRITER)}.")
    return {name: given.get(name, option.default) for name, option in WRITER.items()}


# ----------------------------------------------------------------------------- what run.json records

# The module's options that change pictures (float rounding, seams): recorded in run.json and in
# each image's metadata, so that a folder is not resumed with other values.
OPTIONS = ("pipeline_class", "lora", "vae_tiling", "compile", "vae_slicing", "attention_backend", "quantization")


def recorded_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as run.json and the metadata record them: adapters by file name, SHA-256 and
    scale (not by path, which may differ between machines that make the same pictures)."""
    if not options.get("lora"):
        return options
    from lightning_diffusion.pipelines import lora

    try:
        return {**options, "lora": lora.record(lora.parse(options["lora"]))}
    except ConfigError:  # reported by model_checks.model_problems
        return options


def image_settings(
    path: str, torch_dtype: str, call_args: dict[str, Any], from_pretrained_kwargs: dict[str, Any],
    cache: Optional[dict[str, Any]] = None, options: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The model settings that decide the pictures, as run.json records them. ``options``: the
    model's decoding and speed options (``vae_tiling``, ``compile``...), recorded when set."""
    return {
        "model": path,
        "torch_dtype": torch_dtype,
        **{f"model.{k}": v for k, v in sorted(call_args.items())},
        **{f"from_pretrained.{k}": from_pretrained_kwargs[k] for k in ("revision", "variant")
           if k in from_pretrained_kwargs},
        **({"model.cache": dict(cache)} if cache is not None else {}),
        **{f"model.{k}": v for k, v in sorted((options or {}).items()) if v not in (None, False)},
    }


def storage_settings(writer: Mapping[str, Any], expected: Optional[int]) -> dict[str, Any]:
    """Where outputs go, as run.json records it (the defaults, loose files in one folder, record
    nothing: a folder made before these keys resumes): a resume with another layout or format is
    refused like other settings. ``expected``: the prompt set's images (``auto`` decides by it)."""
    settings: dict[str, Any] = {}
    if writer["format"] != "files":
        settings["writer.format"] = writer["format"]
    elif resolve_layout(writer["layout"], expected, writer["files_per_folder"]) == "sharded":
        settings.update({"writer.layout": "sharded", "writer.files_per_folder": writer["files_per_folder"]})
    return settings


def run_settings(image: dict[str, Any], plan: Optional["RunPlan"], writer: Mapping[str, Any]) -> dict[str, Any]:
    """run.json's settings: the model's (``image_settings``), the seeds and the prompt set (its
    content hash compared, its path recorded) of ``plan`` (None: a data module that gives none),
    a non-default video or image encoding and the storage of the ``writer`` group's values
    (``writer_settings``)."""
    settings = {**image, **storage_settings(writer, plan.num_images if plan is not None else None)}
    if plan is not None:
        settings["data.seed"] = plan.seed
        settings["data.num_images_per_prompt"] = plan.num_images_per_prompt
        if isinstance(plan.prompts, (str, Path)):
            settings["data.prompts"] = (plan.prompts if "://" in str(plan.prompts)
                                        else str(Path(plan.prompts).expanduser().resolve()))
        settings[PROMPTS_HASH] = prompts_hash(plan.prompts, plan.files)
        settings.update(plan.reading or {})
    if writer["video_format"] != WRITER["video_format"].default or writer["fps"] != WRITER["fps"].default:
        settings.update({"writer.video_format": writer["video_format"], "writer.fps": writer["fps"]})
    if writer["image_format"] != "png":  # lossy files differ from the PNGs of the same pictures
        settings.update({"writer.image_format": writer["image_format"], "writer.quality": writer["quality"]})
    return json.loads(json.dumps(settings, default=str))
