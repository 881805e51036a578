"""The files of a run: names, formats and the atomic write of each image or video with its metadata.

Kept free of torch and Lightning, so that the writer process (``background``) starts in a
fraction of a second: it imports this module, numpy and Pillow only (PyAV for MP4).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Optional, cast

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import FailureLine, ImageResult, ManifestLine, Params
from lightning_diffusion.output.fence import Claim, Fence, pause
from lightning_diffusion.output.manifest import failures_part, temporary_write
from lightning_diffusion.output.settings import FILES_PER_FOLDER, IMAGE_FORMATS, WriterSettings
from lightning_diffusion.output.shard import in_shard
from lightning_diffusion.output.shard_writers import SIDE_SUFFIX, ParquetShards, TarShards, claim_key

if TYPE_CHECKING:
    from lightning_diffusion.output.bucket import Uploader


def slugify(prompt: str, max_length: int = 40) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")
    return slug[:max_length].rstrip("-") or "image"


def image_filename(index: int, prompt: str, suffix: str = ".png") -> str:
    return f"{index:06d}-{slugify(prompt)}{suffix}"




def output_name(index: int, prompt: str, suffix: str, layout: str = "flat",
                files_per_folder: int = FILES_PER_FOLDER) -> str:
    """An output's path in its folder: ``000123-a-red-fox.png``, or in the sharded layout
    ``00000/000123-a-red-fox.png`` (its subfolder: ``index // files_per_folder``)."""
    name = image_filename(index, prompt, suffix)
    return name if layout == "flat" else f"{index // files_per_folder:05d}/{name}"


# The temporary names ``atomic_write`` and the tar writer give a file while it is written:
# ``.NAME.tmp-PID-RANDOM``. The NAME's index (an output's, an array's, a tar shard's first image)
# says which shard of a job array wrote it.
_TEMPORARY = re.compile(r"^\.(?:shard-)?(\d{6,})?[^/]*\.tmp-\d+-[0-9a-f]{12}$")


def stale_temporaries(folder: Path, shard: Optional[tuple[int, int]], deep: bool = True) -> list[Path]:
    """Files an earlier run of this folder (of this shard, for a job-array task) left half-written
    when it was killed: only this project's temporary names, only in the folder and (``deep``: an
    earlier run did not end cleanly) its numbered subfolders, each of which lists thousands of
    images. Called with the folder's lock held, so no live run of the same images writes them."""
    found = []
    folders = [folder] + [Path(e.path) for e in os.scandir(folder) if deep and e.is_dir(follow_symlinks=False)
                          and re.fullmatch(r"\d{5,}", e.name)]
    for where in folders:
        for entry in os.scandir(where):
            match = _TEMPORARY.match(entry.name) if entry.name.startswith(".") else None
            if match is None or not (entry.is_file(follow_symlinks=False) or _shard_folder(entry)):
                continue
            index = match.group(1)
            if shard is None or (index is not None and in_shard(int(index), shard)):
                found.append(Path(entry.path))
    return found


def _shard_folder(entry: os.DirEntry) -> bool:
    """A temporary that is a folder: a LitData shard's (``writer.format: litdata``), never a link."""
    return ".litdata." in entry.name and entry.is_dir(follow_symlinks=False)


def remove_temporary(path: Path) -> None:
    """A temporary of ``stale_temporaries`` or ``worker_temporaries`` removed (a file, or a shard's folder)."""
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def worker_temporaries(folder: Path, workers: set[str]) -> list[Path]:
    """The temporaries a pool's ``workers`` left half-written (``manifest.temporary_name``: theirs
    carry their name), in the folder and its numbered subfolders."""
    found = []
    folders = [folder] + [Path(e.path) for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)
                          and re.fullmatch(r"\d{5,}", e.name)]
    for where in folders:
        for entry in os.scandir(where):
            if entry.name.startswith(".") and ".tmp-" in entry.name and (
                    entry.is_file(follow_symlinks=False) or _shard_folder(entry)):
                owner = entry.name.rpartition(".tmp-")[0].rpartition(".")[2]
                if owner in workers:
                    found.append(Path(entry.path))
    return found


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


def failure_line(item: ImageResult) -> FailureLine:
    """``failed.jsonl``'s line for an image whose pipeline call failed: its index, record (file:line),
    prompt, seed and the error's last line."""
    return {"index": item["index"], "record": item.get("record"), "prompt": item["prompt"], "seed": item["seed"],
            "error": item["error"], "failed": round(time.time(), 3)}


def _log_lost(claim: Claim) -> None:
    from lightning_diffusion.core.console import log

    log.warning(f"pool: batch {claim.batch} was taken over by another worker while this one made it (its "
                "renewals stopped for longer than data.lease_s); its images are left to that worker.")


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
    settings: WriterSettings = field(default_factory=WriterSettings)  # the writer group's values
    part: Optional[Path] = None
    layout: str = "flat"  # the writer's layout, resolved: flat or sharded
    # Where a closed tar shard goes from here (``bucket.Uploader``: a bucket), before its lines
    # are appended; None: it stays in ``output_dir``.
    publish: Optional[Uploader] = None
    # A pool's publication under its claims (``fence``): items that carry a ``claim`` are made
    # visible only while it holds their batch. None: a run that deals its work.
    fence: Optional[Fence] = None

    def __post_init__(self) -> None:
        self._part_lock = threading.Lock()
        kinds: dict[str, type[TarShards]] = {"webdataset": TarShards, "parquet": ParquetShards}
        shards = kinds.get(self.settings.format)
        if self.settings.format == "litdata":
            from lightning_diffusion.output.litdata_shards import LitdataShards

            shards = LitdataShards
        self._shards = shards(self) if shards is not None else None
        self._folders: set[str] = set()

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_part_lock", "_shards", "_folders")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def finish(self) -> None:
        """Close the open tar shard (its samples' manifest lines follow): at the end of a run,
        or when it stops. Nothing to do for loose files."""
        if self._shards is not None:
            self._shards.close()
        if self.publish is not None and self.part is not None and failures_part(self.part).exists():
            self.publish.failures(failures_part(self.part))

    def write_batch(self, prediction: list[ImageResult]) -> None:
        """Each file atomically, then the manifest lines of the files written: each line after its
        file (``fsync: file``) or the batch's in one append (also when a file fails: the ones
        before it are recorded), synced unless ``fsync`` is off."""
        assert self.part is not None
        failed = [failure_line(item) for item in prediction if "error" in item]
        if failed:
            self._append(failed, failures_part(self.part))
        if self._shards is not None:
            self._shards.add([item for item in prediction if "error" not in item],
                             prediction[0].get("batch") if prediction else None)
            return
        if self.fence is not None:
            self._write_fenced([item for item in prediction if "error" not in item],
                               prediction[0].get("claim") if prediction else None)
            return
        lines: list[ManifestLine] = []
        try:
            for item in prediction:
                if "error" in item:
                    continue
                lines.append(self.write_output(item))
                if self.settings.fsync == "file":
                    done, lines = lines, []  # appended once, even if the append fails
                    self._append(done)
        finally:
            if lines:
                self._append(lines)

    def _write_fenced(self, items: list[ImageResult], claim: Optional[Claim]) -> None:
        """A batch written through the fence: every file under its temporary name, then, inside the
        fence, renamed into place and its lines appended, or, where a pool's batch was taken over
        meanwhile (or, raising ``fence.LockLost``, the run's lock), removed. A file that fails to
        write ends the batch there: the files before it are still published, then the error raised."""
        renames: list[tuple[Path, Path]] = []
        lines: list[ManifestLine] = []
        failed: Optional[BaseException] = None
        try:
            for item in items:
                made: list[tuple[Path, Path]] = []
                try:
                    line = self.write_output(item, made)
                except BaseException as err:  # noqa: BLE001 (raised below, after what was written before it)
                    for tmp, _ in made:
                        tmp.unlink(missing_ok=True)
                    failed = err
                    break
                renames += made
                lines.append(line)
            if lines:
                pause("written")

                def publish(held: set[Claim]) -> None:
                    if claim is not None and claim not in held:
                        return
                    while renames:
                        tmp, path = renames.pop(0)
                        os.replace(tmp, path)
                    pause("published")
                    self._append(lines)

                self.fence_publish([claim] if claim is not None else [], publish)
        finally:
            for tmp, _ in renames:
                tmp.unlink(missing_ok=True)
        if failed is not None:
            raise failed

    def fence_publish(self, claims: list[Claim], publish) -> None:
        """``publish`` through the fence; the batches lost are said once each."""
        assert self.fence is not None
        for claim in sorted(self.fence.publish(claims, publish), key=lambda c: c.batch):
            _log_lost(claim)

    def _append(self, lines: Sequence[ManifestLine | FailureLine], part: Optional[Path] = None) -> None:
        part = part or self.part
        assert part is not None
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        with self._part_lock, part.open("a", encoding="utf-8") as f:
            f.write(text)
            if self.settings.fsync != "off":
                f.flush()
                os.fsync(f.fileno())

    def write_output(self, item: ImageResult, renames: Optional[list[tuple[Path, Path]]] = None) -> ManifestLine:
        """Write one image or video (and its array) atomically; return its manifest line. With
        ``renames``, each file is left under its temporary name and (temporary, path) is added
        there: the caller renames it into place (``_write_fenced``)."""
        index, prompt = item["index"], item["prompt"]
        metadata = self.metadata(item)
        pixels = item["image"] if item["image"].dtype == np.uint8 else to_uint8(item["image"])
        sync = self.settings.fsync != "off"

        digest = hashlib.sha256()

        def put(path: Path, write) -> int:
            """The file written whole under its temporary name (its bytes hashed back from the page
            cache: what a resume verifies, ``recorded``), then renamed, or left for the caller."""
            tmp, size = temporary_write(path, write, sync, item["claim"].worker if item.get("claim") else "")
            try:
                if path.suffix not in (".npy", SIDE_SUFFIX):  # the output's own bytes: what a resume verifies
                    digest.update(tmp.read_bytes())
                if renames is None:
                    os.replace(tmp, path)
                else:
                    renames.append((tmp, path))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return size

        if pixels.ndim == 4:  # a video: frames x height x width x 3
            name, fps = self._name(index, prompt, f".{self.settings.video_format}"), self.settings.fps
            text = json.dumps(metadata, ensure_ascii=False)
            if self.settings.video_format == "mp4":
                tags = {"title": prompt, "comment": text}
                size = put(self.output_dir / name, lambda f: write_mp4(f, pixels, fps, tags))
            else:
                size = put(self.output_dir / name,
                           lambda f: write_animation(f, pixels, fps, self.settings.video_format, text))
            metadata["fps"] = self.settings.fps
        else:
            name = self._name(index, prompt, IMAGE_FORMATS[self.settings.image_format])
            picture = Image.fromarray(pixels)
            size = put(self.output_dir / name, lambda f: self.encode(picture, metadata, f))
        if self.settings.save_arrays:
            put(self.output_dir / f"{index:06d}.npy", lambda f: np.save(f, item["image"]))
        sides = {}
        for side, output in (item.get("sides") or {}).items():  # beside the image: its name, another suffix
            side_name = f"{name.rpartition('.')[0]}.{side}{SIDE_SUFFIX}"
            put(self.output_dir / side_name, lambda f, data=output["data"]: f.write(data))
            sides[side] = {"file": side_name, "bytes": len(output["data"]), **output["about"]}
        # the parameters ride along under the pipeline's names: a line holds more keys than ``ManifestLine`` names
        return cast(ManifestLine, {"index": index, "prompt": prompt, "seed": item["seed"], "file": name, "bytes": size,
                                   "sha256": digest.hexdigest(), **{
            k: v for k, v in metadata.items() if k not in ("index", "prompt", "seed")
        }, **sides, **claim_key(item), "written": round(time.time(), 3)})

    def _name(self, index: int, prompt: str, suffix: str) -> str:
        """The output's path in the folder, its subfolder made once (``layout``)."""
        name = output_name(index, prompt, suffix, self.layout, self.settings.files_per_folder)
        folder = name.rpartition("/")[0]
        if folder and folder not in self._folders:
            (self.output_dir / folder).mkdir(exist_ok=True)
            self._folders.add(folder)
        return name

    def encoded(self, item: ImageResult) -> tuple[str, bytes, Params]:
        """One output encoded in memory: its file suffix, its bytes and its metadata (for a tar
        shard's members)."""
        metadata = self.metadata(item)
        pixels = item["image"] if item["image"].dtype == np.uint8 else to_uint8(item["image"])
        buffer = io.BytesIO()
        if pixels.ndim == 4:
            text = json.dumps(metadata, ensure_ascii=False)
            if self.settings.video_format == "mp4":
                write_mp4(buffer, pixels, self.settings.fps, {"title": item["prompt"], "comment": text})
            else:
                write_animation(buffer, pixels, self.settings.fps, self.settings.video_format, text)
            metadata["fps"] = self.settings.fps
            return f".{self.settings.video_format}", buffer.getvalue(), metadata
        self.encode(Image.fromarray(pixels), metadata, buffer)
        return IMAGE_FORMATS[self.settings.image_format], buffer.getvalue(), metadata

    @staticmethod
    def metadata(item: ImageResult) -> Params:
        """The parameters a file carries: index, prompt, seed, the call's parameters (and the negative prompt)."""
        metadata = {"index": item["index"], "prompt": item["prompt"], "seed": item["seed"], **item["params"]}
        if item.get("negative_prompt") is not None:
            metadata["negative_prompt"] = item["negative_prompt"]
        if item.get("columns") is not None:  # the record's data.keep_columns
            metadata["columns"] = item["columns"]
        return metadata

    def encode(self, picture: Image.Image, metadata: Params, file: IO[bytes]) -> None:
        """One picture in ``image_format``, its parameters where that format keeps text."""
        if self.settings.image_format == "png":
            info = PngInfo()
            for key, value in metadata.items():
                info.add_text(key, json.dumps(value, ensure_ascii=False) if key == "columns" else str(value))
            info.add_text("parameters", json.dumps(metadata, ensure_ascii=False))
            picture.save(file, format="PNG", pnginfo=info, compress_level=self.settings.png_compress_level)
            return
        exif = Image.Exif()
        exif[EXIF_DESCRIPTION] = json.dumps(metadata)  # ASCII (escaped), as EXIF text must be
        picture.save(file, format=self.settings.image_format.upper(), quality=self.settings.quality,
                     exif=exif.tobytes())


def size_text(count: float) -> str:
    """Bytes in the unit that shows them (``12.3 MB``, ``1.5 GB``), never ``0.0 GB`` for a small run."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{int(count)} bytes"
