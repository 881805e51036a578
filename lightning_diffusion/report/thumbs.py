"""Thumbnails, made once and kept beside the outputs: ``OUT/.thumbs/NNNNN/INDEX-BYTES.jpg`` (a
bucket's beside the page, ``PAGE.thumbs/``: the report writes nothing into a bucket). The name holds
the output's recorded size, so an output made again gets a new thumbnail; a later report reuses
every one that is there.

An image is read from its file, its tar shard's member or its Parquet shard's row (each shard opened
once), decoded with Pillow and scaled to fit ``THUMB_PX``; a video's poster is its first frame (GIF
and animated WebP by Pillow, MP4 and WebM by PyAV where installed). What cannot be decoded is returned with the reason,
for the page to mark.
"""

from __future__ import annotations

import io
import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from PIL import Image

from lightning_diffusion.output.recorded import is_litdata_chunk, litdata_members, parquet_members
from lightning_diffusion.report.collect import Record

THUMB_PX = 160
FOLDER = ".thumbs"
_CHUNK = 256  # loose files a task


def thumb_path(root: Path, record: Record) -> Path:
    return root / f"{record.index // 10000:05d}" / f"{record.index:09d}-{record.size}.jpg"


def _first_frame(data: bytes, name: str) -> Image.Image:
    if name.lower().endswith((".mp4", ".webm")):
        try:
            import av
        except ImportError:
            raise ValueError("its poster needs PyAV: pip install 'lightning-diffusion[video]'") from None
        with av.open(io.BytesIO(data), mode="r") as container:
            for frame in container.decode(video=0):
                return frame.to_image()
        raise ValueError("the video has no frame")
    picture = Image.open(io.BytesIO(data))
    picture.seek(0)
    picture.load()
    return picture


def _save(data: bytes, record: Record, path: Path) -> None:
    picture = _first_frame(data, record.name).convert("RGB")
    picture.thumbnail((THUMB_PX, THUMB_PX))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}")
    try:
        picture.save(tmp, format="JPEG", quality=82)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _make(folder: Path, root: Path, group: list[Record]) -> dict[int, str]:
    """The thumbnails of ``group`` (loose files, or the members of one tar or Parquet shard);
    returns the outputs that could not be read, with why."""
    broken: dict[int, str] = {}
    tar: Optional[tarfile.TarFile] = None
    rows: Optional[dict[str, bytes]] = None  # a Parquet or LitData shard's images by member
    try:
        if group[0].member is not None:
            try:
                if group[0].file.endswith(".parquet"):
                    rows = parquet_members(folder / group[0].file)
                elif is_litdata_chunk(group[0].file):
                    rows = litdata_members(folder / group[0].file)
                else:
                    tar = tarfile.open(folder / group[0].file)
            except Exception as err:  # missing, truncated, not a tar or Parquet file
                return {record.index: f"its shard {group[0].file} cannot be read: {err}" for record in group}
        for record in group:
            try:
                if rows is not None:
                    if record.member not in rows:
                        raise ValueError(f"{record.member} is not a row of {record.file}")
                    data = rows[str(record.member)]
                elif tar is not None:
                    assert record.member is not None
                    handle = tar.extractfile(record.member)
                    if handle is None:
                        raise ValueError(f"{record.member} is not a file in {record.file}")
                    data = handle.read()
                else:
                    data = (folder / record.file).read_bytes()
                _save(data, record, thumb_path(root, record))
            except Exception as err:  # a truncated or garbled file: marked on the page, not a crash
                why = str(err).splitlines()[0] if str(err) else repr(err)
                broken[record.index] = f"{record.name} cannot be read: {why}"
    finally:
        if tar is not None:
            tar.close()
    return broken


def make_thumbs(records: list[Record], folder: Path, root: Path,
                threads: Optional[int] = None) -> tuple[int, dict[int, str]]:
    """The missing thumbnails of ``records`` (read from ``folder``) made into ``root``: (how many
    were made, the outputs that could not be read with why)."""
    todo = [record for record in records if not thumb_path(root, record).is_file()]
    groups: dict[str, list[Record]] = {}
    loose: list[Record] = []
    for record in todo:
        if record.member is not None:
            groups.setdefault(record.file, []).append(record)
        else:
            loose.append(record)
    tasks = list(groups.values()) + [loose[i:i + _CHUNK] for i in range(0, len(loose), _CHUNK)]
    broken: dict[int, str] = {}
    if tasks:
        with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
            for found in pool.map(lambda group: _make(folder, root, group), tasks):
                broken.update(found)
    return len(todo) - len(broken), broken
