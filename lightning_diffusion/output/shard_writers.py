"""The shards of a run's outputs: webdataset tars (``TarShards``) and Parquet files
(``ParquetShards``), and what their names and rows are; ``litdata_shards`` adds LitData's chunks on
the same publication. A shard writer serves a ``ShardOwner`` (``files.OutputFiles``): it encodes
through it and publishes through its fence and uploader, so this module needs nothing of it but that
protocol.

Kept free of torch and Lightning, as ``files`` is (the writer process imports both).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Optional, Protocol, cast

from PIL import Image

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import ImageResult, ManifestLine, Params
from lightning_diffusion.output.fence import Claim, Fence, pause
from lightning_diffusion.output.manifest import temporary_name, temporary_write
from lightning_diffusion.output.settings import IMAGE_FORMATS, WriterSettings

if TYPE_CHECKING:
    from lightning_diffusion.output.bucket import Uploader


SIDE_SUFFIX = ".safetensors"  # a side output's file or tar member (``writer.save_latents``)


def shard_name(first_index: int, suffix: str = ".tar") -> str:
    """A tar (or Parquet) shard, named by the first image it holds: unique (an image is in one
    finished shard, and a resume never makes it again) and the same whatever the layout of the run."""
    return f"shard-{first_index:09d}{suffix}"


def claim_key(item: ImageResult) -> dict[str, str]:
    """A pool's manifest line records the claim its output was made under (``fence.Claim.token``)."""
    claim = item.get("claim")
    return {"claim": claim.token} if claim is not None else {}




class ShardOwner(Protocol):
    """What a shard writer uses of the files it writes for (``files.OutputFiles``)."""

    settings: WriterSettings
    output_dir: Path
    publish: Optional[Uploader]
    fence: Optional[Fence]

    def encoded(self, item: ImageResult) -> Any: ...

    def fence_publish(self, *args: Any, **kwargs: Any) -> Any: ...

    def _append(self, *args: Any, **kwargs: Any) -> Any: ...


class TarShards:
    """The tar shards of one writer (``writer.format: webdataset``): samples ``{key}.png`` (or
    ``.webp``, ``.jpg``, ``.mp4``...) and ``{key}.json`` (their metadata) appended to an open shard
    under a temporary name; at ``samples_per_shard`` samples, or when the run ends or stops, the
    shard is synced, renamed into place (``shard-{first index}.tar``), and only then are its
    samples' manifest lines appended. A kill loses at most the open shard: its temporary file is
    never read, its images have no line, and a resume makes them again with the same bytes.
    Members carry no time or owner, so a shard of the same samples is the same bytes. A pool's
    shard is published through the fence (``fence``): the members of batches taken over meanwhile
    are left out of it (the shard is written again without them), and it is named by the first
    member it keeps."""

    def __init__(self, files: ShardOwner) -> None:
        self.files = files
        self.lock = threading.Lock()
        self.turn = threading.Condition(self.lock)
        self.next_batch = 0  # batches are appended in the rank's order (several threads encode them)
        self.tar: Optional[tarfile.TarFile] = None
        self.handle: Optional[IO[bytes]] = None
        self.tmp: Optional[Path] = None
        self.lines: list[ManifestLine] = []
        self.claims: list[Optional[Claim]] = []  # each line's (a pool's batches), else None

    def add(self, prediction: list[ImageResult], batch: Optional[int] = None) -> None:
        """Encode a batch (in parallel with other threads), then append it after the batches the
        rank handed over before it (``batch``: its number), so that a shard holds the same samples
        in the same order however many threads write."""
        try:
            encoded = [(item, *self.files.encoded(item)) for item in prediction]
        except BaseException:
            self._skip(batch)
            raise
        with self.turn:
            if batch is not None:
                self.turn.wait_for(lambda: self.next_batch >= batch)
            try:
                self._append_samples(encoded)
            finally:
                if batch is not None:
                    self.next_batch = batch + 1
                    self.turn.notify_all()

    def _skip(self, batch: Optional[int]) -> None:
        """A batch that failed to encode gives its turn to the next one."""
        if batch is None:
            return
        with self.turn:
            self.turn.wait_for(lambda: self.next_batch >= batch)
            self.next_batch = batch + 1
            self.turn.notify_all()

    def _append_samples(self, encoded: list) -> None:
        for item, suffix, data, metadata in encoded:
            if self.tmp is None:
                self._open(item["index"], item["claim"].worker if item.get("claim") else "")
            key = f"{item['index']:09d}"
            sides = item.get("sides") or {}
            if sides:  # named in the sample's metadata and its line: where each is, its shapes and scaling
                metadata = {**metadata, **{side: {**self._side_place(key, side), "bytes": len(output["data"]),
                                                  **output["about"]} for side, output in sides.items()}}
            self._add(item, key, suffix, data, metadata)
            self.lines.append(cast(ManifestLine, {
                "index": item["index"], "prompt": item["prompt"], "seed": item["seed"], "file": "",
                "member": f"{key}{suffix}", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                **{k: v for k, v in metadata.items() if k not in ("index", "prompt", "seed")}, **claim_key(item)}))
            self.claims.append(item.get("claim"))
            if len(self.lines) >= self.files.settings.samples_per_shard and item.get("claim") is None:
                self._close()
        if self.lines and len(self.lines) >= self.files.settings.samples_per_shard:
            # a pool's batch is never split over two shards: it is sealed and published whole
            self._close()

    def close(self) -> None:
        with self.lock:
            self._close()

    suffix = ".tar"

    def _open_name(self, first_index: int, owner: str = "") -> None:
        """The open shard's temporary name (``tmp``), beside the name it is published under."""
        self.tmp = temporary_name(self.files.output_dir / shard_name(first_index, self.suffix), owner)

    def _open(self, first_index: int, owner: str = "") -> None:
        self._open_name(first_index, owner)
        assert self.tmp is not None
        self.handle = open(self.tmp, "wb")
        self.tar = tarfile.open(fileobj=self.handle, mode="w", format=tarfile.USTAR_FORMAT)  # no per-member PAX header

    def _add(self, item: ImageResult, key: str, suffix: str, data: bytes, metadata: Params) -> None:
        """A sample: ``{key}{suffix}`` (its bytes), ``{key}.json`` (its metadata) and its side outputs
        (``{key}.latents.safetensors``...)."""
        self._member(f"{key}{suffix}", data)
        self._member(f"{key}.json", json.dumps(metadata, ensure_ascii=False).encode("utf-8"))
        for side, output in (item.get("sides") or {}).items():
            self._member(f"{key}.{side}{SIDE_SUFFIX}", output["data"])

    @staticmethod
    def _side_place(key: str, side: str) -> dict[str, str]:
        """Where a sample's side output is in the shard."""
        return {"member": f"{key}.{side}{SIDE_SUFFIX}"}

    def _finish(self, tmp: Path) -> int:
        """The open shard complete on disk under its temporary name ``tmp``; returns its size."""
        assert self.tar is not None and self.handle is not None
        try:
            self.tar.close()
            self.handle.flush()
            if self.files.settings.fsync != "off":
                os.fsync(self.handle.fileno())
            return os.fstat(self.handle.fileno()).st_size
        finally:
            self.handle.close()
            self.tar = None

    def _keep_only(self, path: Path, keys: set[str]) -> int:
        return _without_members(path, keys, self.files.settings)

    def _member(self, name: str, data: bytes) -> None:
        assert self.tar is not None
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self.tar.addfile(info, io.BytesIO(data))

    def _close(self) -> None:
        if self.tmp is None:
            return
        tmp, lines, claims = self.tmp, self.lines, self.claims
        self.tmp, self.lines, self.claims = None, [], []
        try:
            size = self._finish(tmp)
        except BaseException:
            self._discard(tmp)
            raise
        pause("written")
        pool = {claim for claim in claims if claim is not None}
        try:
            if self.files.fence is not None:
                self.files.fence_publish(sorted(pool, key=lambda c: c.batch),
                                         lambda held: self._publish(tmp, size, lines, claims, held))
            else:
                self._publish(tmp, size, lines, claims, pool)
        finally:
            self._discard(tmp)

    @staticmethod
    def _discard(tmp: Path) -> None:
        """The shard's temporary, where it was not published."""
        tmp.unlink(missing_ok=True)

    @staticmethod
    def _place(tmp: Path, path: Path) -> None:
        """The closed shard renamed into place (over one a killed run left without lines)."""
        os.replace(tmp, path)

    def _recorded_file(self, name: str) -> str:
        """What a published shard's lines name as their ``file``: the shard itself."""
        return name

    def _publish(self, tmp: Path, size: int, lines: list[ManifestLine], claims: list[Optional[Claim]],
                 held: set[Claim]) -> None:
        """The closed shard renamed (uploaded, for a bucket) and then its lines appended: only the
        samples of the batches still held (``held``, of a pool's) or of no claim."""
        keep = [n for n, claim in enumerate(claims) if claim is None or claim in held]
        if not keep:
            return
        if len(keep) < len(lines):
            lines = [lines[n] for n in keep]
            size = self._keep_only(tmp, {line["member"].partition(".")[0] for line in lines})
        name = shard_name(lines[0]["index"], self.suffix)
        if self.files.publish is not None and claims[keep[0]] is not None:
            name = self.files.publish.pool_name(name)  # a pool's shards in a bucket: one name a worker
        self._place(tmp, self.files.output_dir / name)
        pause("published")
        stamp = round(time.time(), 3)
        lines = [{**line, "file": self._recorded_file(name), "shard_bytes": size, "written": stamp} for line in lines]
        if self.files.publish is not None:  # uploaded whole, and recorded there, before the lines count here
            local = self.files.output_dir / name
            try:
                self.files.publish.shard(local, lines)
            finally:
                local.unlink(missing_ok=True)
        self.files._append(lines)


def _without_members(path: Path, keys: set[str], settings: WriterSettings) -> int:
    """Write the tar ``path`` again with only the members of ``keys`` (their names before the first
    dot), headers and bytes as they were; returns its new size."""
    def copy(out: IO[bytes]) -> None:
        with tarfile.open(path, mode="r") as old, \
                tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as new:
            for info in old.getmembers():
                if info.name.partition(".")[0] in keys:
                    new.addfile(info, old.extractfile(info))

    tmp, size = temporary_write(path, copy, settings.fsync != "off")
    os.replace(tmp, path)
    return size


class ParquetShards(TarShards):
    """``writer.format: parquet``: the samples of a shard as the rows of a Parquet file
    (``shard-{first index}.parquet``) that Hugging Face ``datasets`` reads with its ``Image``
    feature: an ``image`` column of ``{bytes, path}`` and typed columns beside it (``PARQUET_COLUMNS``),
    the features named in the schema's ``huggingface`` metadata. Written whole under a temporary
    name when the shard closes, then published as a tar shard is (renamed, fenced, its lines after)."""

    suffix = ".parquet"

    def _open(self, first_index: int, owner: str = "") -> None:
        self._open_name(first_index, owner)
        self.rows: list[ParquetRow] = []

    def _add(self, item: ImageResult, key: str, suffix: str, data: bytes, metadata: Params) -> None:
        if suffix not in IMAGE_FORMATS.values():
            raise ConfigError(f"writer.format: parquet holds images; {item['index']} is a video ({suffix}): write "
                              "videos with writer.format: files or webdataset.")
        row = parquet_row(key, suffix, data, metadata)
        row.update({side: output["data"] for side, output in (item.get("sides") or {}).items()})
        self.rows.append(row)

    @staticmethod
    def _side_place(key: str, side: str) -> dict[str, str]:
        return {"column": side}

    @property
    def sides(self) -> tuple[str, ...]:
        """The side-output columns every shard of this run has (binary: safetensors bytes)."""
        return side_columns(self.files.settings)

    def _finish(self, tmp: Path) -> int:
        rows, self.rows = self.rows, []
        fsync = self.files.settings.fsync != "off"
        with open(tmp, "wb") as f:
            write_parquet(f, rows, self.sides)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            return os.fstat(f.fileno()).st_size

    def _keep_only(self, path: Path, keys: set[str]) -> int:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        keep = [n for n, member in enumerate(table.column("image").combine_chunks().field("path").to_pylist())
                if member.partition(".")[0] in keys]
        rows = table.take(keep).to_pylist()
        sides, fsync = self.sides, self.files.settings.fsync != "off"
        tmp, size = temporary_write(path, lambda f: write_parquet(f, rows, sides), fsync)
        os.replace(tmp, path)
        return size


# A Parquet shard's columns beside ``image``: the core of a manifest line, typed, and ``parameters``
# (every parameter of the call, as the PNG's ``parameters`` text); datasets' feature for each.
PARQUET_COLUMNS = {"index": "int64", "prompt": "string", "seed": "int64", "negative_prompt": "string",
                   "width": "int64", "height": "int64", "num_inference_steps": "int64", "guidance_scale": "float64",
                   "parameters": "string"}
# A row of a Parquet shard: ``image`` (``{bytes, path}``), the ``PARQUET_COLUMNS`` and each side output's bytes
# by name; values of several types, written by pyarrow against the fixed schema.
ParquetRow = dict[str, object]
PARQUET_ROW_GROUP = 100  # rows a row group: a reader streams a shard a hundred images at a time


def parquet_row(key: str, suffix: str, data: bytes, metadata: Params) -> ParquetRow:
    """A sample as a row of a Parquet shard (``image`` is ``{bytes, path}``: datasets' Image)."""
    with Image.open(io.BytesIO(data)) as picture:
        width, height = picture.size
    steps, guidance = metadata.get("num_inference_steps"), metadata.get("guidance_scale")
    return {"image": {"bytes": data, "path": f"{key}{suffix}"}, "index": int(metadata["index"]),
            "prompt": str(metadata["prompt"]), "seed": int(metadata["seed"]),
            "negative_prompt": metadata.get("negative_prompt"), "width": width, "height": height,
            "num_inference_steps": int(steps) if isinstance(steps, (int, float)) else None,
            "guidance_scale": float(guidance) if isinstance(guidance, (int, float)) else None,
            "parameters": json.dumps(metadata, ensure_ascii=False)}


def side_columns(settings: WriterSettings) -> tuple[str, ...]:
    """The side outputs a run saves (``writer.save_latents``, ``writer.save_text_embeddings``), by name."""
    return tuple(name for name, on in (("latents", settings.save_latents),
                                       ("text_embeddings", settings.save_text_embeddings)) if on)


def write_parquet(file: IO[bytes], rows: list[ParquetRow], sides: tuple[str, ...] = ()) -> None:
    """``rows`` as one Parquet file with pyarrow, its schema fixed (every shard of a run the same) and
    the features ``datasets`` restores in its metadata; ``sides``: binary columns of safetensors bytes."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("writer.format: parquet needs pyarrow: pip install pyarrow") from None
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    columns = {**PARQUET_COLUMNS, **{side: "binary" for side in sides}}
    fields = [pa.field("image", image)] + [pa.field(name, getattr(pa, kind)()) for name, kind in columns.items()]
    features = {"image": {"_type": "Image"},
                **{name: {"dtype": kind, "_type": "Value"} for name, kind in columns.items()}}
    schema = pa.schema(fields, metadata={b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, file, row_group_size=PARQUET_ROW_GROUP, compression="none")  # images are compressed


