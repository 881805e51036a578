"""Outputs in an object store (``writer.output_dir: s3://bucket/prefix``, or any fsspec URL: ``gs://``,
``file://``...), for clusters whose nodes share no folder.

What a folder's rename, append and lock give (``folder_store.FolderStore``) is rebuilt on what an object
store guarantees: a PUT is whole (a reader sees the old object or the new one, never half), and a
conditional PUT (``If-None-Match: *``, fsspec's ``mode="create"``) makes an object only where none
is. So:

- each rank builds its tar shards on local disk (``writer.staging_dir``) and ``Uploader`` PUTs each
  one whole once it is closed, then PUTs its manifest object (``manifest/shard-XXXXXXXXX.tar.rank-R.jsonl``,
  the shard's samples as manifest lines); an image counts when its manifest object exists and names
  a tar of the recorded size. A kill loses at most the shards not yet uploaded (their images have no
  manifest object), which a resume makes again with the same bytes; a tar uploaded without its
  manifest object is overwritten whole by the resume's;
- ``run.json`` (the settings that decide the pictures, the runs' history) and, for a job array, each
  shard's ``run.shard-T-of-N.json`` are objects written whole; the first shard's run.json is made by
  a conditional PUT, so two tasks cannot both make it;
- one run at a time: the lock is an object made by a conditional PUT (``.lock``, or
  ``.lock.shard-T-of-N``), refreshed every ``HEARTBEAT_S`` while the run lives and taken over once
  ``STALE_S`` old (its run is dead), as the folder's is.

Endpoint and credentials come from where the store's SDK reads them (for S3: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, the SDK's config files, an
instance role) or from ``writer.storage_options`` (fsspec's options; a value ``env:NAME`` is read from
the environment variable ``NAME`` when the run starts). None of them is written to run.json, a log
line or the manifest.

Kept free of torch and Lightning: the writer process imports it to upload.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import socket
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from lightning_diffusion.core.checks import LEASE_S
from lightning_diffusion.core.console import log
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import (
    FailureLine,
    JsonObject,
    ManifestLine,
    RejectedLine,
    RunSettings,
    RunSummary,
)
from lightning_diffusion.core.system import pid_alive
from lightning_diffusion.output.bucket import (
    FAILURES,
    MANIFESTS,
    STAGING,
    Uploader,
    _host,
    _lines,
    _objects,
    _why,
    access_problems,
    read_problems,
    remove_dead_staging,
    tried,
)
from lightning_diffusion.output.bucket_pool import BucketPoolFiles, join_pool
from lightning_diffusion.output.fence import BucketFence, counted_generations, parse_token
from lightning_diffusion.output.folder_store import output_dir_problems
from lightning_diffusion.output.lock import LockState, pool_beside_deal_message
from lightning_diffusion.output.manifest import FAILED, MANIFEST, REJECTED, RUN_FILE, RUN_META, recorded_conflict
from lightning_diffusion.output.pool import POOL, Pool, live_workers
from lightning_diffusion.output.recorded import writer_name
from lightning_diffusion.output.settings import WriterSettings
from lightning_diffusion.output.shard import (
    Shard,
    adopt,
    first_plan,
    owners_bytes,
    owners_from_bytes,
    plan_file,
    select,
    shard_name,
)
from lightning_diffusion.output.status import JobArrays, RunStatus, bucket_status
from lightning_diffusion.output.storage import Storage, open_storage

HEARTBEAT_S = 30.0
# A manifest object written this many seconds after its lines (their ``written``) was edited, not
# uploaded with its shard (an upload of a large shard takes a while): each member it names is
# looked for in its shard, and a line naming one that is not there (or other bytes) does not count.
EDITED_AFTER_S = 600.0
STALE_S = 120.0


class ObjectStore:
    """An object-store prefix as a run's ``store.OutputStore``. ``staging_dir``: where this process
    builds its tar shards before they go up (a temporary folder when None)."""

    needs_shared_folder = False
    is_folder = False

    def __init__(self, url: str, shard: Optional[Shard], allow_config_change: bool = False,
                 options: Optional[Mapping[str, Any]] = None, staging_dir: Optional[str] = None) -> None:
        self.url = url.rstrip("/")
        self.where = self.url
        self.shard = shard
        self.allow_config_change = allow_config_change
        self.options = dict(options or {})
        self.run = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"
        self.staging_dir = staging_dir
        self._local_dir: Optional[Path] = None
        self.expected: Optional[int] = None
        self.storage: Storage = open_storage(self.url, self.options)  # reaches nothing until first used
        self._history: list = []
        self._locked = False
        self._beat: Optional[threading.Event] = None
        self._beating: Optional[threading.Thread] = None
        self.adopted = False  # the shard deals as the prefix's recorded plan, not as this run computed
        self.lock_token: Optional[tuple[str, str]] = None  # not checked at a bucket's publication
        self.pool: Optional[str] = None  # this job's name in a pool of workers (``data.schedule: pull``)
        self.lease_s = LEASE_S
        self.worker: Optional[Pool] = None  # the job's first worker, registered by ``prepare`` (a pool's)

    @classmethod
    def open(cls, location: Union[str, os.PathLike[str]], shard: Optional[Shard], *, allow_config_change: bool = False,
             options: Optional[Mapping[str, Any]] = None, staging_dir: Optional[str] = None,
             pool: Optional[str] = None, lease_s: Optional[float] = None) -> "ObjectStore":
        """``store.open_store``'s bucket prefix."""
        store = cls(str(location), shard, allow_config_change, options, staging_dir)
        store.pool, store.lease_s = pool, lease_s or LEASE_S
        return store

    @property
    def local_dir(self) -> Path:
        """This process's staging folder, made on first use (a store opened to read makes none)."""
        if self._local_dir is None:
            parent = Path(self.staging_dir).expanduser() if self.staging_dir else Path(tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            remove_dead_staging(parent)
            self._local_dir = Path(tempfile.mkdtemp(prefix=f"{STAGING}{_host()}-{os.getpid()}-", dir=parent))
        return self._local_dir

    # --- read side (``store.OutputStore``) ------------------------------------------------------

    @property
    def manifest_where(self) -> str:
        return f"{self.url}/{MANIFESTS}/"

    @staticmethod
    def settings_problems(settings: WriterSettings) -> list[str]:
        """A ``writer.output_dir`` URL's settings (reaching the store is ``write_problems``)."""
        url, problems = settings.output_dir, []
        if settings.format == "litdata":
            problems.append(f"writer.format: litdata writes its shards into a folder, not an object store ({url}) yet: "
                            "write them into a folder, or set writer.format: webdataset or parquet.")
        elif settings.format not in ("webdataset", "parquet"):
            problems.append(f"writer.output_dir {url} is an object store, which takes shards uploaded whole: set "
                            "writer.format: webdataset (or parquet).")
        if settings.save_arrays:
            problems.append(f"writer.save_arrays writes .npy files beside the images, which an object store "
                            f"({url}) does not take; leave it off.")
        if settings.layout == "sharded":
            problems.append(f"writer.layout sharded puts loose files in numbered subfolders; an object store ({url}) "
                            "holds tar shards, which have no layout: leave writer.layout at auto.")
        path = str(url).split("://", 1)[-1]
        if any(part in (".", "..") for part in path.split("/")[1:]):
            problems.append(f"writer.output_dir {url} has '.' or '..' in its path, which an object store takes as "
                            "part of its keys, not as a folder above: name the prefix as it is.")
        options = settings.storage_options
        if options is not None and not (isinstance(options, Mapping) and all(isinstance(k, str) for k in options)):
            problems.append("writer.storage_options must be a mapping of fsspec options, got "
                            f"{type(options).__name__}.")
        staging = settings.staging_dir
        if staging is not None and (not isinstance(staging, (str, os.PathLike)) or not str(staging).strip()):
            problems.append(f"writer.staging_dir must name a local folder, got {staging!r}.")
        elif staging is not None:
            problems += [p.replace("writer.output_dir", "writer.staging_dir")
                         for p in output_dir_problems(Path(str(staging)).expanduser())]
        return problems

    def write_problems(self) -> list[str]:
        return access_problems(self.url, self.options)

    def read_problems(self, what: str) -> list[str]:
        return read_problems(self.url, what, self.options)

    def made(self) -> tuple[np.ndarray, set[int]]:
        try:
            indices, rejected = self.recorded()[0], self.rejected_images()
        except FileNotFoundError:  # nothing written into the prefix yet
            return np.zeros(0, dtype=np.int64), set()
        return indices, rejected - set(indices.tolist())

    @contextlib.contextmanager
    def local_records(self, what: str) -> Iterator[Path]:
        problems = self.read_problems(what)
        if problems:
            raise ConfigError(problems[0])
        with tempfile.TemporaryDirectory(prefix="lightning-diffusion-records-") as folder:
            if not self.download_records(Path(folder)):
                raise ConfigError(f"{what} {self.url} records no finished image.")
            yield Path(folder)

    def status(self, now: Optional[float] = None, arrays: Optional[JobArrays] = None) -> RunStatus:
        return bucket_status(self)

    @property
    def fs(self) -> Any:
        """(file system, prefix) of a storage on fsspec (``storage.FsspecStorage``), for tests that
        look at the objects themselves."""
        return getattr(self.storage, "fs")

    @property
    def parts_glob(self) -> str:
        return "manifest.part-*.jsonl"

    def part(self, rank: int) -> Path:
        return self.local_dir / f"manifest.part-{rank}.jsonl"

    def publisher(self, rank: int) -> Uploader:
        return Uploader(self.url, self.options, rank, self.run, "" if self.pool is None else f".pool-{self.pool}")

    def fence(self, publisher: Uploader) -> Optional[BucketFence]:
        """A pool's publication: each batch sealed by a conditional PUT before its upload (``fence``);
        a run that deals its work publishes as it writes (its lock is renewed by a heartbeat)."""
        return BucketFence(publisher) if self.pool is not None else None

    @property
    def lock_name(self) -> str:
        name = shard_name(self.shard)
        return ".lock" if name is None else f".lock.{name}"

    @property
    def record_name(self) -> str:
        name = shard_name(self.shard)
        return RUN_FILE if name is None else f"run.{name}.json"

    # ----------------------------------------------------------------- the lock

    def _lock_text(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "run": self.run,
                           "slurm_job": os.environ.get("SLURM_JOB_ID"), "heartbeat": time.time()}).encode()

    def lock_state(self, name: str) -> Optional[LockState]:
        """Lock ``name`` as recorded (host, pid, run), its heartbeat's age and whether it is live;
        None where there is none. Reads only."""
        try:
            held = json.loads(self.storage.read(name))
        except (FileNotFoundError, ValueError):
            return None
        age = time.time() - float(held.get("heartbeat", 0))
        return {**held, "heartbeat_age_s": round(age, 1), "live": self._holder(name) is not None}

    def _holder(self, name: str) -> Optional[str]:
        """The live run that holds lock ``name``, described; None when there is none or it is stale."""
        try:
            held = json.loads(self.storage.read(name))
        except FileNotFoundError:
            return None
        except ValueError:
            held = {}
        if time.time() - float(held.get("heartbeat", 0)) > STALE_S:
            return None  # its run stopped beating
        if held.get("host") == socket.gethostname() and not pid_alive(int(held.get("pid", 0))):
            return None  # its run was on this machine, and is gone
        job = os.environ.get("SLURM_JOB_ID")
        if job is not None and held.get("slurm_job") == job:
            return None  # an earlier run of this SLURM job (requeued after a preemption): gone
        return f"host {held.get('host')}, pid {held.get('pid')}"

    def live_locks(self) -> dict[Optional[tuple[int, int]], str]:
        """The prefix's live runs by shard (None: a run of the whole prompt set), described: what
        ``lock.live_locks`` says of a folder."""
        from lightning_diffusion.output.lock import shard_of_lock

        found: dict[Optional[tuple[int, int]], str] = {}
        for name in self.storage.names():
            shard = shard_of_lock(name)
            if name != ".lock" and shard is None:
                continue
            holder = self._holder(name)
            if holder is not None:
                found[shard] = holder
        return found

    def _take_lock(self) -> Optional[str]:
        lock = self.lock_name
        for _ in range(2):
            try:
                if not self.storage.create(lock, self._lock_text()):
                    raise FileExistsError(f"{self.url}/{lock}")
                self._locked = True
                break
            except FileExistsError:
                seen = self._read(lock)
                holder = self._holder(self.lock_name)
                if holder is not None:
                    return f"{self.url} is being written by another run ({holder}); wait for it to end, or use " \
                           "another writer.output_dir."
                self._remove_if_unchanged(lock, seen)  # its run stopped beating: dead
        else:
            return f"{self.url}: another run took its lock at the same moment; run the command again."
        for name in self.storage.names():
            if not name.startswith(".lock") or name == self.lock_name:
                continue
            other = name.removeprefix(".lock.") if name != ".lock" else None
            same_count = (other is not None and self.shard is not None
                          and other.endswith(f"-of-{self.shard.num_shards}"))
            if not same_count and (holder := self._holder(name)) is not None:
                self.release()
                what = "a run of the whole prompt set" if other is None else other.replace("-", " ")
                return f"{self.url} is being written by {what} ({holder}), which makes some of the same images."
        workers = live_workers(BucketPoolFiles(self))
        if workers:
            self.release()
            return pool_beside_deal_message(self.url, workers)
        self._beat = threading.Event()
        self._beating = threading.Thread(target=self._heartbeat, args=(self._beat,), daemon=True,
                                         name="object-store lock heartbeat")
        self._beating.start()
        return None

    def _read(self, name: str) -> Optional[bytes]:
        try:
            return self.storage.read(name)
        except FileNotFoundError:
            return None

    def _remove_if_unchanged(self, name: str, seen: Optional[bytes]) -> bool:
        """Remove a stale lock, unless it changed since it was judged stale: another run taking it
        over at the same moment made its own, which stays (the next try finds it live). A store
        without conditional deletes leaves the milliseconds between this read and the removal;
        the heartbeat's ownership check (``beat``) catches a run that lost its lock that way."""
        if seen is None or self._read(name) != seen:
            return False
        self.storage.delete(name)
        return True

    def beat(self) -> bool:
        """One heartbeat: the lock's time renewed, if the lock is still this run's; False, said
        once as an error, where another run took it over (this run was judged stale: its store
        unreachable for longer than the stale time), whose lock is then left alone."""
        lock = self.lock_name
        found = self._read(lock)
        if found is None:  # removed meanwhile (by hand, or a takeover half done): made again, as a new lock
            if self.storage.create(lock, self._lock_text()):
                return True
            found = self._read(lock) or b"{}"  # another run made it first: judged below
        try:
            held = json.loads(found)
        except ValueError:
            held = {}
        if held.get("run") != self.run:
            log.error(f"{self.url}: this run's lock was taken over by another run (host {held.get('host')}, pid "
                      f"{held.get('pid')}) after its heartbeat lapsed; both may make the same images. Stop one; "
                      f"`lightning-diffusion status {self.url}` shows the holder.")
            self._locked = False  # the other run's lock: not removed at the end
            return False
        self.storage.write(lock, self._lock_text())
        return True

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                if not self.beat():
                    return
            except Exception as err:  # the next beat tries again; STALE_S is four beats
                log.warning(f"{self.url}: the lock's heartbeat failed ({_why(err)})")

    def pool_files(self) -> "BucketPoolFiles":
        return BucketPoolFiles(self)

    def release(self) -> None:
        if self._beat is not None:
            self._beat.set()
            self._beat = None
            if self._beating is not None:  # a beat in flight would make the lock again after its removal
                self._beating.join(timeout=60)
                self._beating = None
        if self._locked:
            self._locked = False
            try:
                self.storage.delete(self.lock_name)
            except Exception as err:
                log.warning(f"{self.url}: the lock could not be removed ({_why(err)}); it goes stale in "
                            f"{STALE_S:.0f} s.")
        if self._local_dir is not None:  # kept as the path: a message may name it, nothing makes it again
            shutil.rmtree(self._local_dir, ignore_errors=True)

    # ----------------------------------------------------------------- the run's records

    def read_json(self, name: str) -> Optional[JsonObject]:
        try:
            return tried(f"reading {name} at", self.url, lambda: json.loads(self.storage.read(name)))
        except FileNotFoundError:
            return None

    def write_json(self, name: str, content: Mapping[str, object], create: bool = False) -> None:
        data = json.dumps(content, indent=2).encode("utf-8")
        if not create:
            tried(f"writing {name} at", self.url, lambda: self.storage.write(name, data))
        elif not tried(f"writing {name} at", self.url, lambda: self.storage.create(name, data)):
            raise FileExistsError(f"{self.url}/{name} exists")

    def recorded(self) -> tuple[np.ndarray, dict[int, int], list[FailureLine]]:
        """Every image recorded in the store: (indices, the rank that made each, failed lines). An
        image counts when its manifest object names a tar of the recorded size."""
        return tried("reading the records at", self.url, self._recorded)

    def _recorded_lines(self) -> Iterator[tuple[int, ManifestLine]]:
        """Each manifest line that counts (``_counts``), with the rank that wrote it, in the manifest
        objects' order (an image recorded twice: its first line counts)."""
        for _, rank, lines, verdicts in self._manifest_objects():
            for line, counts in zip(lines, verdicts):
                if counts:
                    yield rank, line

    def _manifest_objects(self) -> Iterator[tuple[str, int, list[ManifestLine], list[Optional[bool]]]]:
        """Each manifest object: (its path, the rank that wrote it, its lines, each line's verdict:
        True where it counts; False where its claim was taken over, ``fence``; None where it names
        no tar of its recorded size, or not the writer's name for its image)."""
        # listings are read afresh: other ranks and tasks add to them
        listing = {name: stat.size for name, stat in self.storage.stat().items()}
        found = self.storage.stat(MANIFESTS, recursive=True)
        blobs = self.storage.read_many(list(found))  # one gone since the listing: skipped
        counted: dict[str, dict[int, int]] = {}  # a pool's claims: digest -> batch -> the generation that counts
        members: dict[str, dict[str, str]] = {}  # shards read to verify a manifest object edited after its lines
        for name, blob in sorted(blobs.items()):
            rank = int(name.rsplit(".rank-", 1)[-1].split(".")[0]) if ".rank-" in name else 0
            lines = _lines(blob)
            verdicts = [self._counts(line, listing, counted) for line in lines]
            changed = found[name].modified if name in found else None
            if changed is not None and lines:  # written again long after its lines: each member looked for
                for n, line in enumerate(lines):
                    late = changed > float(line.get("written") or 0) + EDITED_AFTER_S
                    if verdicts[n] and late and not self._member_there(line, members):
                        verdicts[n] = None
            yield name, rank, lines, verdicts

    def _member_there(self, line: ManifestLine, members: dict[str, dict[str, str]]) -> bool:
        """The line's member is in its shard, with the SHA-256 the line records (where it records one)."""
        import hashlib
        import io

        shard = str(line["file"])
        if shard not in members:
            try:
                blob = self.storage.read(shard)
                if shard.endswith(".parquet"):
                    import pyarrow.parquet as pq

                    column = pq.read_table(io.BytesIO(blob), columns=["image"]).column("image").combine_chunks()
                    found = dict(zip(column.field("path").to_pylist(), column.field("bytes").to_pylist()))
                else:
                    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
                        found = {info.name: data.read() for info in tar
                                 if (data := tar.extractfile(info)) is not None}
                members[shard] = {member: hashlib.sha256(data).hexdigest() for member, data in found.items()}
            except (OSError, ValueError, tarfile.TarError):
                members[shard] = {}
        digest = members[shard].get(str(line["member"]))
        return digest is not None and line.get("sha256") in (None, digest)

    def _counts(self, line: ManifestLine, listing: dict[str, int],
                counted: dict[str, dict[int, int]]) -> Optional[bool]:
        """A manifest line counts where it names a tar of the prefix of the size it records, a
        member named as the writer names the line's image, and, for a pool's line, a claim whose
        batch was not taken over after it was sealed (``fence``)."""
        file, member, size = line.get("file"), line.get("member"), line.get("shard_bytes")
        if not (isinstance(file, str) and isinstance(member, str) and isinstance(size, int)
                and listing.get(file) == size and writer_name(line["index"], file, member)):
            return None
        token = parse_token(line.get("claim"))
        if token is None:
            return True
        digest, batch, generation = token
        if digest not in counted:
            try:
                counted[digest] = counted_generations(self.storage.names(f"{POOL}/claims-{digest}"))
            except FileNotFoundError:
                counted[digest] = {}
        sealed = counted[digest].get(batch)
        if sealed is None or sealed < generation:  # no evidence either way (claims removed): not counted, kept
            return None
        return sealed == generation  # False: a later slot exists, positive evidence it was taken over

    def _recorded(self) -> tuple[np.ndarray, dict[int, int], list[FailureLine]]:
        rank_of: dict[int, int] = {}
        for rank, line in self._recorded_lines():
            rank_of.setdefault(line["index"], rank)
        failed_names = list(self.storage.stat(FAILURES, recursive=True))
        failed = [line for blob in self.storage.read_many(failed_names).values() for line in _lines(blob)]
        return np.asarray(sorted(rank_of), dtype=np.int64), rank_of, failed

    def rejected_images(self) -> set[int]:
        """The images of records that cannot be made (the prefix's ``rejected.jsonl``)."""
        try:
            blob = self.storage.read(REJECTED)
        except FileNotFoundError:
            return set()
        # rejected lines name their record, not an index (``RejectedLine``): every object line counts
        return {int(i) for line in _objects(blob) for i in line.get("images", [])}

    def download_records(self, into: Path) -> int:
        """The recorded images as a folder (``into``): the tar shards they are in, and their
        manifest lines as ``manifest.jsonl`` (each image once, as ``recorded`` counts it), for
        readers of a folder (``eval``). Returns the images."""
        return tried("downloading the records of", self.url, lambda: self._download_records(into))

    def _download_records(self, into: Path) -> int:
        kept: dict[int, ManifestLine] = {}
        for _, line in self._recorded_lines():
            kept.setdefault(int(line["index"]), line)
        into.mkdir(parents=True, exist_ok=True)
        for tar in sorted({str(line["file"]) for line in kept.values()}):
            self.storage.download(tar, into / tar)
        with open(into / MANIFEST, "w") as f:
            f.writelines(json.dumps(kept[index]) + "\n" for index in sorted(kept))
        return len(kept)

    def prepare(self, settings: RunSettings, expected: Optional[int],
                total: Optional[int]) -> tuple[Optional[str], np.ndarray]:
        self.expected = expected
        nothing = np.zeros(0, dtype=np.int64)
        problems = access_problems(self.url, self.options)
        if problems:
            return problems[0], nothing
        if self.pool is not None:
            return join_pool(self, settings, total)
        busy = self._take_lock()
        if busy is not None:
            return busy, nothing
        try:
            recorded = self.read_json(RUN_FILE)
        except ValueError:
            self.release()
            return f"{self.url}/{RUN_FILE} is not valid JSON; move it away to start the prefix afresh.", nothing
        if recorded is None and self.shard is not None:
            try:  # the first shard makes run.json; the others compare with it
                self.write_json(RUN_FILE, {**settings, "expected": total, "history": []}, create=True)
            except FileExistsError:
                recorded = self.read_json(RUN_FILE)
        if recorded is not None and not self.allow_config_change:
            conflict = recorded_conflict(recorded, settings, self.url)
            if conflict:
                self.release()
                return conflict, nothing
        conflict = self._record_plan(total)
        if conflict:
            self.release()
            return conflict, nothing
        self._history = list((self.read_json(self.record_name) or {}).get("history") or [])
        if self.shard is None:
            self.write_json(RUN_FILE, {**settings, "expected": expected, "history": self._history})
        else:
            self.write_json(self.record_name, {"shard": list(self.shard), "expected": self.expected,
                                                "history": self._history})
        done, _, _ = self.recorded()
        return None, select(done, self.shard)

    def _record_plan(self, total: Optional[int]) -> Optional[str]:
        """The shard plan (``shard.plan_file``): made by the first task of its count
        (``shard.first_plan``, by a conditional PUT), adopted by the others."""
        if self.shard is None or self.shard.owners is None or total is None:
            return None
        owners, count = self.shard.owners, self.shard.num_shards
        name = plan_file(count)
        recorded = tried(f"reading {name} at", self.url, lambda: self.shard_plan(count))
        if recorded is None:
            mine = first_plan(self, count, total, lambda: owners)
            tried(f"writing {name} at", self.url, lambda: self.storage.create(name, owners_bytes(mine)))
            recorded = owners_from_bytes(tried(f"reading {name} at", self.url, lambda: self.storage.read(name)))
        self.adopted = not np.array_equal(recorded, owners)
        self.shard, problem = adopt(self.shard, recorded, total, f"{self.url}/{name}")
        self.expected = self.shard.size(total)
        return problem

    def shard_plan(self, num_shards: int) -> Optional[np.ndarray]:
        """The prefix's recorded shard plan of ``num_shards``; None where no task of it started."""
        try:
            return owners_from_bytes(self.storage.read(plan_file(num_shards)))
        except FileNotFoundError:
            return None

    def ran_shards_of(self, num_shards: int) -> bool:
        """Whether shards of ``num_shards`` left their run records in the prefix."""
        return any(re.fullmatch(rf"run\.shard-\d+-of-{num_shards}\.json", name) for name in self.storage.names())

    def write_rejected(self, lines: list[RejectedLine], rejected: bool) -> None:
        if rejected or self.storage.exists(REJECTED):
            self.storage.write(REJECTED,
                               "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode("utf-8"))

    def merge(self, done: np.ndarray) -> tuple[dict[int, int], np.ndarray, int]:
        every, rank_of, failed = self.recorded()
        mine = select(every, self.shard)
        made: dict[int, int] = {}
        if self.pool is not None:  # this job's images: its ranks' manifest lines that count (``.pool-JOB``)
            for name, rank, lines, verdicts in self._manifest_objects():
                if name.endswith(f".pool-{self.pool}.jsonl"):
                    made[rank] = made.get(rank, 0) + sum(counts is True for counts in verdicts)
            self._remove_stale()
        for index in np.setdiff1d(mine, done).tolist() if self.pool is None else []:
            made[rank_of[index]] = made.get(rank_of[index], 0) + 1  # this run's images, by the rank that made them
        # failed.jsonl: every shard's failures not made since (a rerun retries them), one line an image
        finished = set(every.tolist())
        left = {line["index"]: line for line in failed if line["index"] not in finished}
        if left or self.storage.exists(FAILED):
            self.storage.write(FAILED, "".join(json.dumps(line, ensure_ascii=False) + "\n"
                                               for _, line in sorted(left.items())).encode("utf-8"))
        now = {line["index"] for line in self.failed_now() if line["index"] not in finished}
        return made, np.union1d(done, mine), len(now)

    def _remove_stale(self) -> None:
        """Remove what a pool's worker uploaded under a claim taken over after its seal (a worker
        silent for ``pool.SEAL_GRACE`` leases that came back): its manifest objects, none of whose
        lines count, and their tars, which no line that counts names."""
        stale: list[tuple[str, set[str]]] = []
        named: set[str] = set()
        for name, _, lines, verdicts in self._manifest_objects():
            if lines and all(counts is False for counts in verdicts):
                stale.append((name, {str(line["file"]) for line in lines}))
            else:
                named.update(str(line["file"]) for line, counts in zip(lines, verdicts) if counts)
        for name, tars in stale:
            for tar in sorted(tars - named):
                self.storage.delete(tar)
            self.storage.delete(name)
            log.info(f"{self.url}: removed {name.rsplit('/', 1)[-1]}, uploaded under a claim another worker took "
                     "over: its images are that worker's.")

    def failed_now(self) -> list[FailureLine]:
        """This run's failed lines (its ranks' ``failed/RUN.rank-R.jsonl`` objects)."""
        names = [name for name in self.storage.stat(FAILURES, recursive=True)
                 if fnmatch.fnmatchcase(name, f"{FAILURES}/{self.run}.rank-*.jsonl")]
        return [line for blob in self.storage.read_many(names).values() for line in _lines(blob)]

    def record(self, summary: RunSummary) -> None:
        if self.pool is not None:  # the jobs of a pool add to one history (read just before: a bucket has no lock)
            current = self.read_json(RUN_FILE) or {}
            self.write_json(RUN_FILE, {**current, "history": [*(current.get("history") or []), summary]})
            return
        self._history.append(summary)
        if self.shard is None:
            current = self.read_json(RUN_FILE) or {}
            self.write_json(RUN_FILE, {**{k: v for k, v in current.items() if k not in RUN_META},
                                        "expected": self.expected, "history": self._history})
        else:
            self.write_json(self.record_name, {"shard": list(self.shard), "expected": self.expected,
                                                "history": self._history})
