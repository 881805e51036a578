"""``ImageWriter``: PNG files with metadata and a ``manifest.jsonl`` that makes a run resumable.

Layout of the output folder::

    000000-a-red-fox.png      image 0, prompt and parameters in PNG text chunks
    manifest.jsonl            one JSON object per finished image, sorted by index
    manifest.part-R.jsonl     lines appended by global rank R while a run is going

Every file appears by an atomic rename, and an image's manifest line is appended only after its PNG
is complete, so a killed run leaves no truncated PNG and at most one unterminated manifest line,
which is ignored. The manifest is the single source of truth: a rerun skips the indices it lists
(whose files exist) before the work is split over replicas, and redoes everything else.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from lightning_diffusion.console import log
from lightning_diffusion.errors import ConfigError, check_int, raise_problems
from lightning_diffusion.lock import OutputLock
from lightning_diffusion.preemption import STOP
from lightning_diffusion.manifest import (
    MANIFEST,
    PART_GLOB,
    PROMPTS_HASH,
    RUN_FILE,
    RUN_META,
    _atomic_write,
    merge_manifest,
    part_counts,
    prompts_hash,
    read_manifest,
    settings_conflict,
)


def slugify(prompt: str, max_length: int = 40) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")
    return slug[:max_length].rstrip("-") or "image"


def image_filename(index: int, prompt: str, suffix: str = ".png") -> str:
    return f"{index:06d}-{slugify(prompt)}{suffix}"


VIDEO_FORMATS = ("mp4", "webp", "gif")


def write_mp4(file, frames: np.ndarray, fps: int, metadata: dict[str, str]) -> None:
    """H.264 MP4 (yuv420p) with PyAV; ``metadata`` goes into the container's tags."""
    try:
        import av
    except ImportError:
        raise ConfigError("Writing MP4 needs PyAV: pip install 'lightning-diffusion[video]'.") from None
    height, width = frames.shape[1:3]
    with av.open(file, mode="w", format="mp4") as container:
        container.metadata.update(metadata)
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_animation(file, frames: np.ndarray, fps: int, fmt: str, comment: str) -> None:
    """Animated WebP or GIF with Pillow."""
    pictures = [Image.fromarray(frame) for frame in frames]
    extra = {"comment": comment.encode("utf-8")} if fmt == "gif" else {}
    pictures[0].save(
        file, format=fmt.upper(), save_all=True, append_images=pictures[1:], duration=round(1000 / fps), loop=0,
        **extra,
    )


def to_uint8(image: np.ndarray) -> np.ndarray:
    """Float [0, 1] -> uint8, rounding as diffusers' ``numpy_to_pil`` does."""
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def check_writer_args(output_dir: Any, video_format: Any, fps: Any) -> list[str]:
    problems = []
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        problems.append(f"writer.output_dir {str(path)!r} is a file, not a folder.")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                problems.append(f"writer.output_dir {str(path)!r} is below {str(parent)!r}, which is a file.")
            elif not os.access(parent, os.W_OK) and not path.exists():
                problems.append(f"writer.output_dir {str(path)!r} cannot be created: {str(parent)!r} is not writable.")
            break
    if video_format not in VIDEO_FORMATS:
        problems.append(f"writer.video_format must be one of {', '.join(VIDEO_FORMATS)}, got {video_format!r}.")
    problems += filter(None, [check_int(fps, "writer.fps")])
    return problems


def run_settings(image_settings: dict[str, Any], seed: Any, num_images_per_prompt: Any, prompts: Any,
                 video_format: str = "mp4", fps: int = 16) -> dict[str, Any]:
    """run.json's settings: the model's (``module.image_settings``), the seeds, the prompt set (its
    content hash compared, its path recorded) and a non-default video encoding."""
    settings = dict(image_settings)
    if seed is not None:
        settings["data.seed"] = seed
    if num_images_per_prompt is not None:
        settings["data.num_images_per_prompt"] = num_images_per_prompt
    if isinstance(prompts, (str, Path)):
        settings["data.prompts"] = str(Path(prompts).expanduser().resolve())
    if prompts is not None:
        settings[PROMPTS_HASH] = prompts_hash(prompts)
    if video_format != "mp4" or fps != 16:
        settings.update({"writer.video_format": video_format, "writer.fps": fps})
    return json.loads(json.dumps(settings, default=str))


def summary_text(summary: dict[str, Any], manifest: Path) -> str:
    """The run's summary as one line for the log."""
    rates = summary["images_per_s_by_rank"]
    pace = ", ".join(f"rank {rank}: {rate:.2f}" for rank, rate in rates.items()) or "none"
    expected = f" of {summary['expected']:,}" if summary.get("expected") is not None else ""
    return (f"made {summary['made']:,} outputs, {summary['skipped']:,} skipped by resume; {summary['in_manifest']:,}"
            f"{expected} in {manifest}; wall {summary['wall_s']:.1f} s, load {summary['load_s']:.1f} s; "
            f"images/s per writing rank: {pace}")


class ImageWriter(BasePredictionWriter):
    """Writes each predicted image once, as PNG with metadata, and records it in the manifest.

    Args:
        output_dir: folder for images and ``manifest.jsonl``; created if missing. A rerun into the
            same folder resumes: images already in the manifest are skipped.
        save_arrays: also save the decoded float image as ``NNNNNN.npy`` (for numerical checks).
        video_format: how videos are written: ``mp4`` (H.264, needs PyAV), ``webp`` or ``gif``.
        fps: frames per second of written videos.
        allow_config_change: resume into a folder whose images were made with other settings
            (model, size, steps, guidance, seeds...); refused by default, so that one folder never
            mixes two configs silently.

    Only one run may write into a folder at a time (``.lock``, taken over when its run is dead).
    """

    def __init__(
        self,
        output_dir: str = "outputs",
        save_arrays: bool = False,
        video_format: str = "mp4",
        fps: int = 16,
        allow_config_change: bool = False,
    ) -> None:
        super().__init__(write_interval="batch")
        raise_problems(check_writer_args(output_dir, video_format, fps))
        path = Path(output_dir).expanduser()
        self.output_dir = path
        self.save_arrays = save_arrays
        self.video_format = video_format
        self.fps = fps
        self.allow_config_change = allow_config_change
        self.done: set[int] = set()
        self.expected: Optional[int] = None
        self.pending: Optional[int] = None
        self.summary: Optional[dict[str, Any]] = None
        # Told the final count on global rank 0 once the manifest is merged (``ImageProgressBar``).
        self.progress_listener: Optional[Any] = None
        self._history: list = []
        self._part: Optional[Path] = None
        self._lock: Optional[OutputLock] = None

    @staticmethod
    def writes_outputs(trainer: pl.Trainer) -> bool:
        # Ranks of one model-parallel group hold the same images: the strategy names one to write.
        return bool(getattr(trainer.strategy, "writes_outputs", True))

    def run_settings(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """What decides the pictures of this folder: model, call arguments, seeds, prompts."""
        describe = getattr(pl_module, "image_settings", None)
        data = trainer.datamodule
        return run_settings(describe() if callable(describe) else {}, getattr(data, "seed", None),
                            getattr(data, "num_images_per_prompt", None), getattr(data, "prompts", None),
                            self.video_format, self.fps)

    def _prepare_folder(self, settings: dict[str, Any]) -> tuple[Optional[str], list[int]]:
        """On global rank 0: lock, compare settings, merge parts. Returns (error, done indices)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._lock = OutputLock(self.output_dir)
        holder = self._lock.acquire()
        if holder is not None:
            return (f"{self.output_dir} is being written by another run ({holder}); wait for it to end "
                    "or choose another writer.output_dir."), []
        run_file = self.output_dir / RUN_FILE
        history: list = []
        if run_file.is_file():
            conflict = None if self.allow_config_change else settings_conflict(self.output_dir, settings)
            if conflict:
                self._lock.release()
                return conflict, []
            try:
                history = list(json.loads(run_file.read_text()).get("history") or [])
            except ValueError:
                history = []
        self._history = history
        self._write_run_file(settings)
        if any(self.output_dir.glob(PART_GLOB)):
            merge_manifest(self.output_dir)
        done = read_manifest(self.output_dir)
        if not self.allow_config_change and any("inputs" in line for line in done.values()):
            from lightning_diffusion.inputs import changed_since

            changed = changed_since(done)
            if changed:
                self._lock.release()
                return (f"{self.output_dir} holds pictures made from input files that changed: "
                        + "; ".join(changed) + ". Restore them, use another writer.output_dir, or "
                        "writer.allow_config_change=true to keep those pictures anyway."), []
        return None, sorted(done)

    def _write_run_file(self, settings: dict[str, Any]) -> None:
        """run.json: the settings that decide the pictures, the expected count, the runs' summaries."""
        content = {**settings, "expected": self.expected, "history": self._history}
        _atomic_write(self.output_dir / RUN_FILE, lambda f: f.write(json.dumps(content, indent=2).encode("utf-8")))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.started_at = time.time()
        self.predicting_at: Optional[float] = None
        self.expected = getattr(trainer.datamodule, "num_images", None)
        result: tuple[Optional[str], list[int]] = (None, [])
        if trainer.is_global_zero:
            result = self._prepare_folder(self.run_settings(trainer, pl_module))
        # Every rank learns rank 0's verdict and raises the same error: nobody waits for a peer.
        error, done = trainer.strategy.broadcast(result)
        if error:
            raise ConfigError(error)
        self.done = set(done)
        self.pending = None if self.expected is None else max(0, self.expected - len(self.done))
        if self.done:
            todo = f", {self.pending:,} to make" if self.pending is not None else ""
            log.info(f"resumed: {len(self.done):,} already in the manifest of {self.output_dir}{todo}.")
        skip = getattr(trainer.datamodule, "skip_indices", None)
        if callable(skip):
            skip(self.done)
        self._part = self.output_dir / f"manifest.part-{trainer.global_rank}.jsonl"

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: list[dict[str, Any]],
        batch_indices: Optional[Sequence[int]],
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not self.writes_outputs(trainer):
            return
        lines = [self.write_output(item) for item in prediction]
        assert self._part is not None
        with self._part.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())

    def write_output(self, item: dict[str, Any]) -> dict[str, Any]:
        """Write one image or video (and its array) atomically; return its manifest line."""
        index, prompt, params = item["index"], item["prompt"], item["params"]
        metadata = {"index": index, "prompt": prompt, "seed": item["seed"], **params}
        if item.get("negative_prompt") is not None:
            metadata["negative_prompt"] = item["negative_prompt"]
        pixels = to_uint8(item["image"])
        if pixels.ndim == 4:  # a video: frames x height x width x 3
            name = image_filename(index, prompt, f".{self.video_format}")
            text = json.dumps(metadata, ensure_ascii=False)
            if self.video_format == "mp4":
                tags = {"title": prompt, "comment": text}
                _atomic_write(self.output_dir / name, lambda f: write_mp4(f, pixels, self.fps, tags))
            else:
                _atomic_write(
                    self.output_dir / name, lambda f: write_animation(f, pixels, self.fps, self.video_format, text)
                )
            metadata["fps"] = self.fps
        else:
            name = image_filename(index, prompt)
            info = PngInfo()
            for key, value in metadata.items():
                info.add_text(key, str(value))
            info.add_text("parameters", json.dumps(metadata, ensure_ascii=False))
            picture = Image.fromarray(pixels)
            _atomic_write(self.output_dir / name, lambda f: picture.save(f, format="PNG", pnginfo=info))
        if self.save_arrays:
            _atomic_write(self.output_dir / f"{index:06d}.npy", lambda f: np.save(f, item["image"]))
        size = (self.output_dir / name).stat().st_size
        return {"index": index, "prompt": prompt, "seed": item["seed"], "file": name, "bytes": size, **{
            k: v for k, v in metadata.items() if k not in ("index", "prompt", "seed")
        }, "written": round(time.time(), 3)}

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.predicting_at = time.time()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Not on_predict_end: a replica with no images skips the predict loop and its end hooks,
        # but every rank reaches teardown (and only after a run that did not raise).
        if stage != "predict":
            return
        trainer.strategy.barrier("image_writer_merge")
        if trainer.is_global_zero:
            parts = part_counts(self.output_dir)
            total = merge_manifest(self.output_dir)
            self.summary = self._summary(parts, total)
            self._history.append(self.summary)
            settings = json.loads((self.output_dir / RUN_FILE).read_text())
            self._write_run_file({k: v for k, v in settings.items() if k not in RUN_META})
            if self.progress_listener is not None:
                self.progress_listener.finish(self.summary["made"], self.pending)
            log.info(summary_text(self.summary, self.output_dir / MANIFEST))
            STOP.totals = (total, self.expected)
            if self._lock is not None:
                self._lock.release()

    def _summary(self, parts: dict[int, int], total: int) -> dict[str, Any]:
        end = time.time()
        start = self.predicting_at or end
        seconds = max(end - start, 1e-9)
        return {
            "finished": round(end, 3),
            "made": sum(parts.values()),
            "skipped": len(self.done),
            "in_manifest": total,
            "expected": self.expected,
            "wall_s": round(end - self.started_at, 3),
            "load_s": round(start - self.started_at, 3),
            "images_per_s_by_rank": {str(rank): round(count / seconds, 4) for rank, count in sorted(parts.items())},
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
        }

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._lock is not None:
            self._lock.release()
