"""The few operations a bucket's records are kept with (``Storage``), and the one place that opens
them for a URL (``open_storage``). ``object_store.ObjectStore`` (its lock, run records, shard plan,
merge and status), ``bucket.Uploader``, ``bucket_pool`` (a pool's registrations and claims) and
``fence.BucketFence`` are written on these alone, so a new kind of storage is one class that follows
``Storage`` (``FsspecStorage`` for any fsspec URL, ``memory_storage.MemoryStorage`` for
``memory://``) and one line in ``_SCHEMES``.

Names are relative to the URL's prefix (``manifest/shard-000000000.tar.rank-0.jsonl``); each call
reads the storage afresh (no listing is cached between calls).

Kept free of torch and Lightning: the writer process imports it to upload.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# ``writer.storage_options``: the user's fsspec options for a bucket (endpoint, credentials), passed on as given.
StorageOptions = dict[str, Any]


class Stat(NamedTuple):
    """An object's size in bytes and when it was last written (Unix seconds; None where the storage
    does not say)."""

    size: int
    modified: Optional[float]


class Storage(Protocol):
    """A prefix of objects, each written whole: what a bucket's run records are kept with."""

    url: str  # as messages name it

    def read(self, name: str) -> bytes:
        """The object's bytes; ``FileNotFoundError`` where there is none."""
        ...

    def read_many(self, names: list[str]) -> dict[str, bytes]:
        """The objects' bytes by name; one gone meanwhile is left out."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Make or replace the object, whole (a reader sees the old bytes or the new)."""
        ...

    def create(self, name: str, data: bytes) -> bool:
        """Write-if-absent, atomic: make the object where none is (True), else leave it (False). Two
        creates of one name at once: one of them makes it. (A conditional PUT, ``If-None-Match: *``.)"""
        ...

    def delete(self, name: str) -> None:
        """Remove the object (``FileNotFoundError`` where there is none)."""
        ...

    def exists(self, name: str) -> bool:
        ...

    def names(self, folder: str = "") -> list[str]:
        """The entries directly in ``folder`` (objects and subfolders), by their last name, sorted;
        ``FileNotFoundError`` where nothing is there."""
        ...

    def stat(self, folder: str = "", recursive: bool = False) -> dict[str, Stat]:
        """The objects in ``folder`` (all below it where ``recursive``): name -> ``Stat``. Nothing
        there: empty where ``recursive``, else ``FileNotFoundError``."""
        ...

    def upload(self, local: Path, name: str) -> None:
        """Copy the local file in as the object, whole."""
        ...

    def download(self, name: str, local: Path) -> None:
        """Copy the object out into the local file."""
        ...


def already_there(err: BaseException) -> bool:
    """A conditional PUT refused because the object exists: s3fs says FileExistsError for AWS's
    412; an S3-compatible store may answer 412 or 409 without the header s3fs looks for."""
    text = f"{err} {err.__cause__ or ''}"
    return isinstance(err, FileExistsError) or any(
        word in text for word in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"))


def resolved_options(options: Optional[Mapping[str, Any]]) -> StorageOptions:
    """``writer.storage_options`` with each ``env:NAME`` value read from the environment."""
    resolved: StorageOptions = {}
    for key, value in (options or {}).items():
        if isinstance(value, str) and value.startswith("env:"):
            name = value[4:]
            if name not in os.environ:
                raise OSError(f"writer.storage_options.{key} reads the environment variable {name}, which is not set")
            value = os.environ[name]
        resolved[key] = value
    return resolved


def open_url(url: str, options: Optional[Mapping[str, Any]] = None) -> tuple[AbstractFileSystem, str]:
    """(fsspec file system, path inside it) of ``url``."""
    import fsspec

    options = resolved_options(options)
    if url.startswith("s3://"):  # a request is tried twice by the client; an upload's tries are Uploader's
        options.setdefault("config_kwargs", {"retries": {"max_attempts": 2, "mode": "standard"},
                                             "connect_timeout": 10})
    # a fresh client: fsspec's cache would keep one made with other credentials or endpoint
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    if hasattr(fs, "retries"):  # s3fs's own loop around each request (5 tries by default)
        fs.retries = 1
    return fs, root.rstrip("/")


def _modified(info: Mapping[str, Any]) -> Optional[float]:
    """An object's modification time from its listing (``LastModified`` on S3, ``mtime`` elsewhere)."""
    value = info.get("LastModified", info.get("mtime", info.get("last_modified")))
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


class FsspecStorage:
    """``Storage`` on an fsspec file system (``s3://``, ``gs://``, ``file://``...), opened on first
    use with ``writer.storage_options`` (``options``). Pickled without its file system: the writer
    process opens its own."""

    def __init__(self, url: str, options: Optional[Mapping[str, Any]] = None) -> None:
        self.url = url.rstrip("/")
        self.options = dict(options or {})
        self._fs: Optional[tuple[AbstractFileSystem, str]] = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_fs": None}

    @property
    def fs(self) -> tuple[AbstractFileSystem, str]:
        """(the file system, the prefix's path in it)."""
        if self._fs is None:
            self._fs = open_url(self.url, self.options)
        return self._fs

    def path(self, name: str) -> str:
        root = self.fs[1]
        return f"{root}/{name}" if name else root

    def _name(self, path: str) -> str:
        return path.rstrip("/").removeprefix(self.fs[1] + "/")

    def read(self, name: str) -> bytes:
        return self.fs[0].cat_file(self.path(name))

    def read_many(self, names: list[str]) -> dict[str, bytes]:
        if not names:
            return {}
        blobs = self.fs[0].cat([self.path(name) for name in names], on_error="return")
        return {self._name(path): blob for path, blob in blobs.items() if not isinstance(blob, Exception)}

    def write(self, name: str, data: bytes) -> None:
        self.fs[0].pipe_file(self.path(name), data)

    def create(self, name: str, data: bytes) -> bool:
        try:
            self.fs[0].pipe_file(self.path(name), data, mode="create")
        except OSError as err:
            if already_there(err):
                return False
            raise
        return True

    def delete(self, name: str) -> None:
        self.fs[0].rm(self.path(name))

    def exists(self, name: str) -> bool:
        fs = self.fs[0]
        fs.invalidate_cache(self.path(name))
        return bool(fs.exists(self.path(name)))

    def names(self, folder: str = "") -> list[str]:
        fs = self.fs[0]
        fs.invalidate_cache(self.path(folder))
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(self.path(folder), detail=False))

    def stat(self, folder: str = "", recursive: bool = False) -> dict[str, Stat]:
        fs = self.fs[0]
        fs.invalidate_cache(self.path(folder))
        if recursive:
            found = fs.find(self.path(folder), detail=True)
            entries = list(found.values()) if isinstance(found, dict) else []
        else:
            entries = fs.ls(self.path(folder), detail=True)
        return {self._name(entry["name"]): Stat(int(entry.get("size") or 0), _modified(entry))
                for entry in entries if entry.get("type") != "directory"}

    def upload(self, local: Path, name: str) -> None:
        self.fs[0].put_file(str(local), self.path(name))

    def download(self, name: str, local: Path) -> None:
        self.fs[0].get_file(self.path(name), str(local))


# scheme -> "module:class" of its ``Storage`` (a scheme not named: ``FsspecStorage``)
_SCHEMES = {"memory": "lightning_diffusion.output.memory_storage:MemoryStorage"}


def open_storage(url: str, options: Optional[Mapping[str, Any]] = None) -> Storage:
    """The storage at ``url`` (``scheme://...``) with ``writer.storage_options``. Opening reaches nothing."""
    where = _SCHEMES.get(url.split("://", 1)[0])
    if where is None:
        return FsspecStorage(url, options)
    module, _, name = where.partition(":")
    storage: Storage = getattr(importlib.import_module(module), name)(url, options)
    return storage
