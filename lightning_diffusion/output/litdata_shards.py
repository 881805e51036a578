"""``writer.format: litdata``: each shard a LitData dataset that ``litdata.StreamingDataset`` reads.

A shard is a folder ``shard-{first index}.litdata`` holding one chunk and its ``index.json``, both
written by LitData's own writer (``BinaryWriter``, then ``litdata.complete_dataset``) into a
temporary folder beside it; once they are closed (and synced) the folder is renamed into place, and
only then are its samples' manifest lines appended, as a tar or Parquet shard is published
(``shard_writers.TarShards``). A kill loses at most the open shard: its temporary folder is never read and
is swept by the next run. Each manifest line names the shard's chunk file (``file``, its size as
``shard_bytes``) and the sample's ``member`` (``000000123.png``), so the checks that count a tar
shard's outputs count these.

Each sample is a dict with a Parquet row's keys (``shard_writers.PARQUET_COLUMNS``), the image's encoded
bytes as ``image`` and its member name as ``image_path``; its types are the same in every sample
and every shard (no value is None: an empty negative prompt, ``-1`` steps and NaN guidance where a
call has none), so that ``litdata.merge_datasets`` joins the shards of a run into one dataset.

A pool's shard (``data.schedule: pull``) is published through the fence as a tar shard is: the
samples of batches taken over meanwhile are left out (the shard is written again by LitData without
them). Imported only where the format is chosen: LitData (and torch, which it imports) are not needed
by the other formats. A bucket's output (``object_store``) is refused before the weights load.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from PIL import Image

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import ImageResult
from lightning_diffusion.output.manifest import temporary_name
from lightning_diffusion.output.settings import IMAGE_FORMATS, LITDATA_INSTALL
from lightning_diffusion.output.shard_writers import TarShards, side_columns


def _litdata() -> Any:
    try:
        import litdata
        from litdata.streaming.writer import BinaryWriter
    except ImportError:
        raise ConfigError(f"writer.format: litdata needs the litdata package: {LITDATA_INSTALL}.") from None
    return litdata, BinaryWriter


def litdata_sample(key: str, suffix: str, data: bytes, metadata: dict[str, Any]) -> dict[str, Any]:
    """A sample of a LitData shard: a Parquet row's keys (the image's bytes as ``image``, its member
    name as ``image_path``), each of one type whatever the call gave."""
    with Image.open(io.BytesIO(data)) as picture:
        width, height = picture.size
    steps, guidance = metadata.get("num_inference_steps"), metadata.get("guidance_scale")
    return {"image": data, "image_path": f"{key}{suffix}", "index": int(metadata["index"]),
            "prompt": str(metadata["prompt"]), "seed": int(metadata["seed"]),
            "negative_prompt": str(metadata.get("negative_prompt") or ""), "width": width, "height": height,
            "num_inference_steps": int(steps) if isinstance(steps, (int, float)) else -1,
            "guidance_scale": float(guidance) if isinstance(guidance, (int, float)) else math.nan,
            "parameters": json.dumps(metadata, ensure_ascii=False)}


def write_litdata(folder: Path, samples: list[dict[str, Any]], fsync: bool) -> str:
    """``samples`` as one LitData chunk and its ``index.json`` in ``folder`` (made here), by LitData's
    writer; returns the chunk's file name."""
    litdata, BinaryWriter = _litdata()
    folder.mkdir()
    writer = BinaryWriter(os.fspath(folder), chunk_size=max(1, len(samples)))
    for position, sample in enumerate(samples):
        writer.add_item(position, sample)
    chunks = [Path(path).name for path in writer.done()]
    litdata.complete_dataset(os.fspath(folder))
    if len(chunks) != 1:
        raise RuntimeError(f"LitData wrote {len(chunks)} chunks for one shard in {folder}: {chunks}")
    if fsync:
        for entry in os.scandir(folder):
            with open(entry.path, "rb") as f:
                os.fsync(f.fileno())
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    return chunks[0]


class LitdataShards(TarShards):
    """The LitData shards of one writer: samples kept in memory while a shard is open, written
    whole by LitData into a temporary folder when it closes, then published as a tar shard is."""

    suffix = ".litdata"

    def _open(self, first_index: int, owner: str = "") -> None:
        super()._open_name(first_index, owner)
        self.samples: list[dict[str, Any]] = []
        self.chunk = ""

    def _add(self, item: ImageResult, key: str, suffix: str, data: bytes, metadata: dict[str, Any]) -> None:
        if suffix not in IMAGE_FORMATS.values():
            raise ConfigError(f"writer.format: litdata holds images; {item['index']} is a video ({suffix}): write "
                              "videos with writer.format: files or webdataset.")
        sample = litdata_sample(key, suffix, data, metadata)
        sample.update({side: output["data"] for side, output in (item.get("sides") or {}).items()})
        missing = [side for side in side_columns(self.files.settings) if side not in sample]
        if missing:
            raise ValueError(f"output {item['index']} has no {', '.join(missing)}, which every sample of this run has")
        self.samples.append(sample)

    @staticmethod
    def _side_place(key: str, side: str) -> dict[str, str]:
        return {"key": side}

    def _finish(self, tmp: Path) -> int:
        samples, self.samples = self.samples, []
        self.chunk = write_litdata(tmp, samples, self.files.settings.fsync != "off")
        return (tmp / self.chunk).stat().st_size

    def _recorded_file(self, name: str) -> str:
        return f"{name}/{self.chunk}"

    @staticmethod
    def _discard(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def _keep_only(self, path: Path, keys: set[str]) -> int:
        """A pool's shard written again with only the samples of ``keys`` (the batches still held):
        read back through LitData, written by it into a new temporary folder that replaces ``path``."""
        litdata, _ = _litdata()
        dataset = litdata.StreamingDataset(os.fspath(path))
        kept = [sample for sample in (dataset[position] for position in range(len(dataset)))
                if str(sample["image_path"]).partition(".")[0] in keys]
        again = temporary_name(path)
        try:
            self.chunk = write_litdata(again, kept, self.files.settings.fsync != "off")
            shutil.rmtree(path)
            os.replace(again, path)
        finally:
            shutil.rmtree(again, ignore_errors=True)
        return (path / self.chunk).stat().st_size

    @staticmethod
    def _place(tmp: Path, path: Path) -> None:
        """A folder is not renamed over another: one a killed run published without its lines (none
        of its samples count) is moved aside and removed first."""
        if path.exists():
            aside = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(6).hex()}")
            os.replace(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(tmp, path)
