"""The files of a run: names, formats and the atomic write of each image or video with its metadata.

Kept free of torch and Lightning, so that the writer process (``background``) starts in a
fraction of a second: it imports this module, numpy and Pillow only (PyAV for MP4).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from lightning_diffusion.errors import ConfigError
from lightning_diffusion.manifest import _atomic_write, failures_part


def slugify(prompt: str, max_length: int = 40) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")
    return slug[:max_length].rstrip("-") or "image"


def image_filename(index: int, prompt: str, suffix: str = ".png") -> str:
    return f"{index:06d}-{slugify(prompt)}{suffix}"


VIDEO_FORMATS = ("mp4", "webp", "gif")
IMAGE_FORMATS = {"png": ".png", "webp": ".webp", "jpeg": ".jpg"}
FSYNC = ("file", "batch", "off")
# PNG's zlib level: 1 encodes several times faster than Pillow's default 6, for slightly larger
# files (measured in docs/writing.md).
PNG_COMPRESS_LEVEL = 1
EXIF_DESCRIPTION = 0x010E  # ImageDescription: where WebP and JPEG files carry the parameters (JSON)


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


def failure_line(item: dict[str, Any]) -> dict[str, Any]:
    """``failed.jsonl``'s line for an image whose pipeline call failed: its index, record (file:line),
    prompt, seed and the error's last line."""
    return {"index": item["index"], "record": item.get("record"), "prompt": item["prompt"], "seed": item["seed"],
            "error": item["error"], "failed": round(time.time(), 3)}


def to_uint8(image: np.ndarray) -> np.ndarray:
    """Float [0, 1] -> uint8, rounding as diffusers' ``numpy_to_pil`` does."""
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


@dataclass
class OutputFiles:
    """Writes one batch's files and then their manifest lines into this run's part (``part``).

    A plain picklable object: the writer process gets a copy of it and calls ``write_batch``;
    a subclass (another ``encode``, say) must be importable by its module path to be sent there.
    """

    output_dir: Path
    image_format: str = "png"
    quality: int = 90
    png_compress_level: int = PNG_COMPRESS_LEVEL
    fsync: str = "batch"
    save_arrays: bool = False
    video_format: str = "mp4"
    fps: int = 16
    part: Optional[Path] = None

    def __post_init__(self) -> None:
        self._part_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_part_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._part_lock = threading.Lock()

    def write_batch(self, prediction: list[dict[str, Any]]) -> None:
        """Each file atomically, then the manifest lines of the files written: each line after its
        file (``fsync: file``) or the batch's in one append (also when a file fails: the ones
        before it are recorded), synced unless ``fsync`` is off."""
        assert self.part is not None
        failed = [failure_line(item) for item in prediction if "error" in item]
        if failed:
            self._append(failed, failures_part(self.part))
        lines: list[dict[str, Any]] = []
        try:
            for item in prediction:
                if "error" in item:
                    continue
                lines.append(self.write_output(item))
                if self.fsync == "file":
                    done, lines = lines, []  # appended once, even if the append fails
                    self._append(done)
        finally:
            if lines:
                self._append(lines)

    def _append(self, lines: list[dict[str, Any]], part: Optional[Path] = None) -> None:
        part = part or self.part
        assert part is not None
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        with self._part_lock, part.open("a", encoding="utf-8") as f:
            f.write(text)
            if self.fsync != "off":
                f.flush()
                os.fsync(f.fileno())

    def write_output(self, item: dict[str, Any]) -> dict[str, Any]:
        """Write one image or video (and its array) atomically; return its manifest line."""
        index, prompt = item["index"], item["prompt"]
        metadata = self.metadata(item)
        pixels = item["image"] if item["image"].dtype == np.uint8 else to_uint8(item["image"])
        sync = self.fsync != "off"
        if pixels.ndim == 4:  # a video: frames x height x width x 3
            name = image_filename(index, prompt, f".{self.video_format}")
            text = json.dumps(metadata, ensure_ascii=False)
            if self.video_format == "mp4":
                tags = {"title": prompt, "comment": text}
                size = _atomic_write(self.output_dir / name, lambda f: write_mp4(f, pixels, self.fps, tags), sync)
            else:
                size = _atomic_write(self.output_dir / name,
                                     lambda f: write_animation(f, pixels, self.fps, self.video_format, text), sync)
            metadata["fps"] = self.fps
        else:
            name = image_filename(index, prompt, IMAGE_FORMATS[self.image_format])
            picture = Image.fromarray(pixels)
            size = _atomic_write(self.output_dir / name, lambda f: self.encode(picture, metadata, f), sync)
        if self.save_arrays:
            _atomic_write(self.output_dir / f"{index:06d}.npy", lambda f: np.save(f, item["image"]), sync)
        return {"index": index, "prompt": prompt, "seed": item["seed"], "file": name, "bytes": size, **{
            k: v for k, v in metadata.items() if k not in ("index", "prompt", "seed")
        }, "written": round(time.time(), 3)}

    @staticmethod
    def metadata(item: dict[str, Any]) -> dict[str, Any]:
        """The parameters a file carries: index, prompt, seed, the call's parameters (and the negative prompt)."""
        metadata = {"index": item["index"], "prompt": item["prompt"], "seed": item["seed"], **item["params"]}
        if item.get("negative_prompt") is not None:
            metadata["negative_prompt"] = item["negative_prompt"]
        return metadata

    def encode(self, picture: Image.Image, metadata: dict[str, Any], file: Any) -> None:
        """One picture in ``image_format``, its parameters where that format keeps text."""
        if self.image_format == "png":
            info = PngInfo()
            for key, value in metadata.items():
                info.add_text(key, str(value))
            info.add_text("parameters", json.dumps(metadata, ensure_ascii=False))
            picture.save(file, format="PNG", pnginfo=info, compress_level=self.png_compress_level)
            return
        exif = Image.Exif()
        exif[EXIF_DESCRIPTION] = json.dumps(metadata)  # ASCII (escaped), as EXIF text must be
        picture.save(file, format=self.image_format.upper(), quality=self.quality, exif=exif.tobytes())
