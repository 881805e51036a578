"""Reaching a bucket (``writer.output_dir: s3://...``, any fsspec URL): why a bucket cannot be read
or written in one line without a secret, bounded tries, and ``Uploader``, which puts a rank's closed
tar shards and their manifest objects whole, through the bucket's ``storage.Storage``.
``object_store.ObjectStore`` records a run on these.

Kept free of torch and Lightning: the writer process imports it to upload.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_diffusion.core.records import ManifestLine
from lightning_diffusion.core.system import pid_alive
from lightning_diffusion.output.storage import Storage, open_storage

UPLOAD_TRIES = 5  # an upload waits 1, 2, 4 and 8 s between tries, then the run stops


MANIFESTS = "manifest"


FAILURES = "failed"


def is_url(output_dir: object) -> bool:
    """Whether ``writer.output_dir`` names an object store (``scheme://...``) rather than a folder."""
    return isinstance(output_dir, str) and "://" in output_dir


def _why(err: BaseException) -> str:
    """What went wrong, in words that never carry a secret (the type, and the first line of the
    message: botocore's name the endpoint, the bucket or the missing credentials)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def access_problems(url: str, options: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Why a run cannot write into ``url``: a store that cannot be reached, no credentials, a bucket
    that does not exist, no right to write (a probe object is made and removed). One line each,
    naming the URL and never a secret."""
    bucket = url.split("://", 1)[-1].split("/", 1)[0]

    def probe(storage: Storage) -> None:
        name = f".write-check-{os.urandom(6).hex()}"
        storage.write(name, b"")
        storage.delete(name)

    return _problems(url, options, "writer.output_dir", "write", probe,
                     f"the bucket {bucket} does not exist; create it first.")


def read_problems(url: str, what: str, options: Optional[Mapping[str, Any]] = None) -> list[str]:
    """Why ``url`` cannot be read (``what`` names it: "output", "reference"): as
    ``access_problems``, with a listing instead of a probe object (nothing is written)."""
    return _problems(url, options, what, "read", lambda storage: storage.names(),
                     "nothing there (no bucket or prefix of that name).")


def _problems(url: str, options: Optional[Mapping[str, Any]], what: str, verb: str,
              probe: Callable[[Storage], object], missing: str) -> list[str]:
    try:
        probe(open_storage(url, options))
    except FileNotFoundError:
        return [f"{what} {url}: {missing}"]
    except ImportError as err:
        return [f"{what} {url}: this store needs a package that is not installed ({err.name}): pip install s3fs "
                "for s3://, gcsfs for gs://."]
    except PermissionError as err:
        return [f"{what} {url}: no right to {verb} there ({_why(err)})."]
    except Exception as err:  # botocore's NoCredentialsError, EndpointConnectionError...
        return [f"{what} {url}: cannot {verb} there ({_why(err)})."]
    return []


ANSWERS = (FileNotFoundError, FileExistsError, ValueError)  # a missing or existing object, bad JSON


def tried(what: str, url: str, call: Callable[[], Any], answers: tuple[type[BaseException], ...] = ANSWERS) -> Any:
    """``call()``, tried ``UPLOAD_TRIES`` times, 1, 2, 4 and 8 s apart; then an OSError in one line
    naming ``what`` and the URL. ``answers`` are not failures: raised at once."""
    for attempt in range(UPLOAD_TRIES):
        try:
            return call()
        except answers:
            raise
        except Exception as err:
            if attempt == UPLOAD_TRIES - 1:
                raise OSError(f"{what} {url} failed {UPLOAD_TRIES} times ({_why(err)})") from err
            time.sleep(2.0 ** attempt)


class Uploader:
    """Puts a rank's closed tar shards into the store (``files.OutputFiles.publish``): the tar
    whole, then its manifest object; each PUT tried ``UPLOAD_TRIES`` times with backoff. Sent to
    the writer process by pickling: the file system is opened there."""

    def __init__(self, url: str, options: Optional[Mapping[str, Any]], rank: int, run: str, tag: str = "") -> None:
        self.url, self.options, self.rank, self.run = url, dict(options or {}), rank, run
        self.tag = tag  # after the rank in its manifest objects' names: ``.pool-JOB`` for a job of a pool
        self._storage: Optional[Storage] = None
        self._failed: Optional[str] = None  # an upload that failed every try: the later ones are not tried

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_storage": None}

    @property
    def storage(self) -> Storage:
        if self._storage is None:
            self._storage = open_storage(self.url, self.options)
        return self._storage

    def _put(self, what: str, put: Callable[[], object]) -> None:
        if self._failed is not None:  # the run stops with that one; the queued shards wait for a resume
            raise OSError(self._failed)
        try:
            tried(f"uploading {what} to", self.url, put, answers=())  # an upload retries whatever failed
        except OSError as err:
            self._failed = str(err)
            raise

    def pool_name(self, name: str) -> str:
        """A pool's tar shard in the bucket: named by its first image and its worker (``JOB-R``), so
        that no two workers' shards can have one name."""
        stem, _, suffix = name.rpartition(".")
        return f"{stem}.{self.tag.removeprefix('.pool-')}-{self.rank}.{suffix}"

    def shard(self, local: Path, lines: Sequence[ManifestLine]) -> None:
        storage = self.storage
        self._put(local.name, lambda: storage.upload(local, local.name))
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode("utf-8")
        name = f"{MANIFESTS}/{local.name}.rank-{self.rank}{self.tag}.jsonl"
        self._put(name, lambda: storage.write(name, text))

    def failures(self, local: Path) -> None:
        storage = self.storage
        name = f"{FAILURES}/{self.run}.rank-{self.rank}.jsonl"
        self._put(name, lambda: storage.write(name, local.read_bytes()))


def _objects(blob: bytes) -> list[Any]:
    """The whole JSON object lines of a record object (a line cut by a kill is left out): manifest,
    failure or rejected lines (``core.records``), as the caller knows which."""
    found = []
    for raw in blob.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            found.append(line)
    return found


def _lines(blob: bytes) -> list[Any]:
    """The lines of a record object that carry an image ``index``: manifest or failure lines."""
    return [line for line in _objects(blob) if isinstance(line.get("index"), int)]


STAGING = "lightning-diffusion-staging-"  # + host-pid-random: a process's folder of shards not yet uploaded


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def remove_dead_staging(parent: Path) -> None:
    """Remove the staging folders in ``parent`` of processes of this machine that are gone (killed
    before they could remove their own): their shards were not recorded, and a resume makes them
    again."""
    host = _host()
    for path in parent.glob(f"{STAGING}{host}-*-*"):
        pid = path.name[len(STAGING) + len(host) + 1:].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
