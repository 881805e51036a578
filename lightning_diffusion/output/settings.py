"""The settings of a run, each declared once: the writer group's options (``WriterSettings``:
default, choices, bounds), which ``ImageWriter``'s signature, ``store.writer_problems``,
``preflight`` and run.json all read; and what run.json records of the model, the prompt set and the storage, which
the writer and ``preflight`` both compute (so that a folder made with other settings is refused
before anything starts, and again by the writer when the run starts).

Kept free of torch and Lightning: the CLI's checks and the writer process import it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.groups import group_options
from lightning_diffusion.core.records import CallArgs, RunSettings
from lightning_diffusion.output.manifest import PROMPTS_HASH, prompts_hash
from lightning_diffusion.output.storage import StorageOptions

if TYPE_CHECKING:
    from lightning_diffusion.output.boundaries import RunPlan


# The choices of the writer's options.
LAYOUTS = ("auto", "flat", "sharded")
FORMATS = ("files", "webdataset", "parquet", "litdata")
SHARD_FORMATS = ("webdataset", "parquet", "litdata")  # the samples of a rank's batches in shards, in order
# writer.format: litdata's package (``litdata_shards``)
LITDATA_INSTALL = "pip install 'lightning-diffusion[litdata]' (or pip install litdata)"
FILES_PER_FOLDER = 10_000  # img2dataset's shard size; listing and backing up folders stays fast
SAMPLES_PER_SHARD = 1_000  # a tar shard: about 1 GB of 1024x1024 PNGs; a kill loses at most the open one
VIDEO_FORMATS = ("mp4", "webp", "gif")
IMAGE_FORMATS = {"png": ".png", "webp": ".webp", "jpeg": ".jpg"}
FSYNC = ("file", "batch", "off")
# PNG's zlib level: 1 encodes several times faster than Pillow's default 6, for slightly larger
# files (measured in docs/writing.md).
PNG_COMPRESS_LEVEL = 1
WRITE_IN = ("process", "thread")  # the writer process (``background.WriterProcess``), or threads
SIDE_OUTPUTS = ("save_latents", "save_text_embeddings")  # tensors saved beside each image


def resolve_layout(layout: str, expected: Optional[int], files_per_folder: int) -> str:
    """``auto``: ``flat`` when the run's images fit in one folder of ``files_per_folder`` (or their
    count is unknown: a data module other than ``PromptDataModule``), else ``sharded`` (no folder of
    a million-image run holds more than ``files_per_folder`` files)."""
    if layout != "auto":
        return layout
    return "flat" if expected is None or expected <= files_per_folder else "sharded"


@dataclass(frozen=True)
class Rule:
    """The values one option of a config group may take (``choices``, or an integer from
    ``minimum`` to ``maximum``); ``label`` names it in messages where its config key alone would not
    say enough, ``hint`` ends its message."""

    choices: tuple[Any, ...] = ()
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    integer: bool = False
    label: str = ""
    hint: str = ""


def ruled(default: Any, **rule: Any) -> Any:
    """A settings field with its default and its ``Rule``."""
    return field(default=default, metadata={"rule": Rule(**rule)})


@dataclass(frozen=True)
class WriterSettings:
    """``ImageWriter``'s options (the ``writer`` group), each declared once: its default here is the
    one ``ImageWriter``'s signature, ``store.writer_problems``, ``preflight`` and run.json use.
    Values are as given: ``store.writer_problems`` says what is wrong with them.

    Options:
        output_dir: folder for images and ``manifest.jsonl``; created if missing. A rerun into the
            same folder resumes: images already in the manifest are skipped. An object-store URL
            (``s3://bucket/prefix``, any fsspec URL) takes ``format: webdataset`` (``object_store``).
        save_arrays: also save the decoded float image as ``NNNNNN.npy`` (for numerical checks).
        save_latents: also save the latents the VAE decoded into each image, as safetensors beside
            it in the dtype computed (a file, a tar member, a Parquet column; docs/writing.md).
        save_text_embeddings: also save the prompt embeddings the denoiser saw, the same way.
        video_format: how videos are written: ``mp4`` (H.264, needs PyAV), ``webp`` or ``gif``.
        fps: frames per second of written videos.
        allow_config_change: resume into a folder whose images were made with other settings
            (model, size, steps, guidance, seeds...); refused by default, so that one folder never
            mixes two configs silently.
        image_format: ``png`` (lossless), ``webp`` or ``jpeg`` (lossy, ``quality`` 1-100); the
            parameters go in PNG text chunks, or the EXIF ImageDescription (JSON) of WebP and JPEG.
        quality: the encoder quality of ``webp`` and ``jpeg`` files, 1-100.
        png_compress_level: zlib level of PNG files, 0-9 (default 1: fast, slightly larger).
        fsync: ``batch`` (default: every file synced before its rename, the manifest after each
            batch), ``file`` (the manifest also after each image) or ``off`` (nothing synced: a
            power cut may lose the last seconds of files and lines, which a resume redoes).
        write_workers: threads that encode and write off the prediction thread (0: on it).
        write_queue: batches that may wait for a writer before prediction blocks.
        write_in: where the ``write_workers`` threads run: ``process`` (default: a writer process
            of this rank, so that writing never holds the rank's GIL) or ``thread`` (in the rank).
        layout: ``flat`` (every file in the folder), ``sharded`` (``00012/000120000-slug.png``:
            subfolder ``index // files_per_folder``) or ``auto`` (default: flat when the run's
            images fit in one folder of ``files_per_folder``, else sharded).
        files_per_folder: files per subfolder of the sharded layout (default 10,000).
        format: ``files`` (default: one file an output), ``webdataset`` (tar shards of
            ``samples_per_shard`` samples, as WebDataset and img2dataset write them), ``parquet``
            or ``litdata`` (a LitData dataset a shard, which ``litdata.StreamingDataset`` reads).
        samples_per_shard: samples a tar shard holds (``format: webdataset``); a kill loses at
            most the open shard.
        staging_dir: with ``output_dir`` in an object store (``s3://bucket/prefix``), the local
            folder where each rank builds its tar shards before they are uploaded (default: a
            temporary folder).
        storage_options: the object store's fsspec options (endpoint, credentials...); a value
            ``env:NAME`` is read from the environment variable ``NAME``. Never recorded.
        audit: re-make a sample with the accelerators off, the drift in ``audit.jsonl``:
            ``{fraction: 0.01, min_psnr: 30, on_drift: warn}`` (docs/caching.md).
        metrics_port: serve live metrics for Prometheus on this port from global rank 0 (0: none).
        metrics_file: keep the same metrics in this textfile (node_exporter's textfile collector).
    """

    output_dir: str = "outputs"  # checked as a folder, or a bucket's URL, by its store
    save_arrays: bool = False
    save_latents: bool = False  # refused before weights where the pipeline has none (``side_outputs``)
    save_text_embeddings: bool = False
    video_format: str = ruled("mp4", choices=VIDEO_FORMATS)
    fps: int = ruled(16, minimum=1, integer=True)
    allow_config_change: bool = False
    image_format: str = ruled("png", choices=tuple(IMAGE_FORMATS))
    quality: int = ruled(90, minimum=1, maximum=100, integer=True, label="writer.quality (WebP and JPEG)")
    png_compress_level: int = ruled(PNG_COMPRESS_LEVEL, minimum=0, maximum=9, integer=True)
    fsync: str = ruled("batch", choices=FSYNC)
    write_queue: int = ruled(2, minimum=1, integer=True)
    write_workers: int = ruled(2, minimum=0, integer=True, hint=" (0: write on the prediction thread)")
    write_in: str = ruled("process", choices=WRITE_IN)
    layout: str = ruled("auto", choices=LAYOUTS)
    files_per_folder: int = ruled(FILES_PER_FOLDER, minimum=1, integer=True)
    format: str = ruled("files", choices=FORMATS)
    samples_per_shard: int = ruled(SAMPLES_PER_SHARD, minimum=1, integer=True)
    # an object store (output_dir s3://...): where tar shards are built, and fsspec's options
    staging_dir: Optional[str] = None
    storage_options: Optional[StorageOptions] = field(default=None, repr=False)  # credentials: never shown
    audit: Optional[dict[str, Any]] = None  # checked by ``audit.audit_problems``
    # live metrics (``metrics.LiveMetrics``), kept by global rank 0; not in run.json: they decide no picture
    metrics_port: int = ruled(0, minimum=0, maximum=65535, integer=True, hint=" (0: none)")
    metrics_file: Optional[str] = None

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> WriterSettings:
        """The group's values: ``given`` (a parsed config's ``writer`` section, or keyword arguments), every
        absent option at its default."""
        return cls(**group_options(cls, given, "the writer"))

    @classmethod
    def rules(cls) -> Iterator[tuple[str, Rule]]:
        """Each option that has a rule, with it."""
        for option in fields(cls):
            if "rule" in option.metadata:
                yield option.name, option.metadata["rule"]


# ----------------------------------------------------------------------------- what run.json records



def recorded_options(options: CallArgs) -> CallArgs:
    """``options`` as run.json and the metadata record them: adapters by file name, SHA-256 and
    scale (not by path, which may differ between machines that make the same pictures); the
    adapters records choose (``model.adapters``) by their names too."""
    if not options.get("lora") and not options.get("adapters"):
        return options
    from lightning_diffusion.pipelines import lora
    from lightning_diffusion.pipelines.adapters import parse_named

    recorded = dict(options)
    try:
        if options.get("lora"):
            recorded["lora"] = lora.record(lora.parse(options["lora"]))
        if options.get("adapters"):
            named = parse_named(options["adapters"])
            recorded["adapters"] = {name: found for name, found in zip(named, lora.record(list(named.values())))}
    except ConfigError:  # reported by pipelines.checks.model_problems
        return options
    return recorded


def image_settings(
    path: str, torch_dtype: str, call_args: CallArgs, from_pretrained_kwargs: Mapping[str, Any],
    cache: Optional[Mapping[str, Any]] = None, options: Optional[Mapping[str, Any]] = None,
) -> RunSettings:
    """The model settings that decide the pictures, as run.json records them. ``options``: the
    model's decoding and speed options (``vae_tiling``, ``compile``...), recorded when set."""
    return {
        "model": path,
        "torch_dtype": torch_dtype,
        **{f"model.{k}": v for k, v in sorted(call_args.items())},
        **{f"from_pretrained.{k}": from_pretrained_kwargs[k] for k in ("revision", "variant")
           if k in from_pretrained_kwargs},
        **({"model.cache": dict(cache)} if cache is not None else {}),
        **{f"model.{k}": v for k, v in sorted((options or {}).items()) if v not in (None, False) and k != "adapters"},
        # one key an adapter, so that a resume refused for a changed file names it
        **{f"model.adapters.{name}": v for name, v in sorted(((options or {}).get("adapters") or {}).items())},
    }


def storage_settings(writer: WriterSettings, expected: Optional[int]) -> RunSettings:
    """Where outputs go, as run.json records it (the defaults, loose files in one folder, record
    nothing: a folder made before these keys resumes): a resume with another layout or format is
    refused like other settings, and so is one that turns the side outputs on or off. ``expected``:
    the prompt set's images (``auto`` decides by it)."""
    settings: RunSettings = {}
    if writer.format != "files":
        settings["writer.format"] = writer.format
    elif resolve_layout(writer.layout, expected, writer.files_per_folder) == "sharded":
        settings.update({"writer.layout": "sharded", "writer.files_per_folder": writer.files_per_folder})
    for side in SIDE_OUTPUTS:  # a folder whose images all have them, or none
        if getattr(writer, side):
            settings[f"writer.{side}"] = True
    return settings


def run_settings(image: RunSettings, plan: Optional[RunPlan], writer: WriterSettings) -> RunSettings:
    """run.json's settings: the model's (``image_settings``), the seeds and the prompt set (its
    content hash compared, its path recorded) of ``plan`` (None: a data module that gives none),
    a non-default video or image encoding and the storage of the ``writer`` group's values
    (``WriterSettings``)."""
    settings = {**image, **storage_settings(writer, plan.num_images if plan is not None else None)}
    if plan is not None:
        settings["data.seed"] = plan.seed
        settings["data.num_images_per_prompt"] = plan.num_images_per_prompt
        if isinstance(plan.prompts, (str, Path)):
            settings["data.prompts"] = (plan.prompts if "://" in str(plan.prompts)
                                        else str(Path(plan.prompts).expanduser().resolve()))
        settings[PROMPTS_HASH] = prompts_hash(plan.prompts, plan.files)
        settings.update(plan.reading or {})
        if plan.adapter_sets:  # a function of the prompt set's content, as its hash is
            settings["data.adapter_sets"] = plan.adapter_sets
    if writer.video_format != WriterSettings.video_format or writer.fps != WriterSettings.fps:
        settings.update({"writer.video_format": writer.video_format, "writer.fps": writer.fps})
    if writer.image_format != "png":  # lossy files differ from the PNGs of the same pictures
        settings.update({"writer.image_format": writer.image_format, "writer.quality": writer.quality})
    return json.loads(json.dumps(settings, default=str))
