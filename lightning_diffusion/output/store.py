"""Where a run's outputs are recorded: ``OutputStore``, the one interface for writing and reading
them, and ``open_store``, the one place that chooses a store for a location.

A location is a folder every rank sees (``folder_store.FolderStore``) or an object-store prefix,
``scheme://...`` (``object_store.ObjectStore``, on the storage primitives of ``storage.Storage``).
Nothing outside this package asks which; callers read what a store declares (``is_folder``). A new
kind of object storage is one ``storage.Storage`` class (``memory_storage.py`` is the example); a new
kind of store is one class that follows ``OutputStore`` and one line in ``_kinds``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Optional, Protocol, Union

import numpy as np

from lightning_diffusion.core.checks import integer, one_of, system_folder_problems
from lightning_diffusion.core.records import RejectedLine, RunSettings, RunSummary
from lightning_diffusion.output.settings import LITDATA_INSTALL, WriterSettings
from lightning_diffusion.output.shard import Shard
from lightning_diffusion.output.status import JobArrays, RunStatus

if TYPE_CHECKING:
    from lightning_diffusion.output.bucket import Uploader
    from lightning_diffusion.output.fence import Fence
    from lightning_diffusion.output.pool import Pool, PoolFiles

Location = Union[str, "os.PathLike[str]"]


class OutputStore(Protocol):
    """Where a run's outputs are recorded, for writing (``ImageWriter``) and for reading (``status``,
    ``eval``, ``slurm``, ``k8s``): ``FolderStore`` (a folder) or ``ObjectStore`` (a bucket prefix).
    A store opened only to read takes no lock and makes no local folder."""

    # A folder every node must see (the writer checks that before the run); False for a storage
    # the nodes reach on their own.
    needs_shared_folder: bool
    # The output is a folder of files named by its path: the readers that take a folder read it in
    # place, the checks before a run look at it, a cluster job mounts it and writes its logs beside
    # it. False: reached only through the store's own calls (``made``, ``local_records``...).
    is_folder: bool
    # (lock file, token) of the run's lock where its publications check it (a folder's); the writer
    # hands global rank 0's to the other ranks
    lock_token: Optional[tuple[str, str]]
    # The shard of a job array this run makes (None: the whole set); after ``prepare``, dealt by the
    # plan the store holds (``adopted``: that plan, not the one this run computed).
    shard: Optional[Shard]
    adopted: bool
    # After ``prepare`` of a job of a pool: its first worker's registration (``pool.Pool``), made
    # before anything loads so that a run that deals and starts meanwhile sees it; else None.
    worker: Optional[Pool]
    # The storage as messages name it (a folder, a URL), and the local folder this process's
    # files are written into (the folder itself, or where tar shards wait for their upload).
    where: str

    @classmethod
    def open(cls, location: Location, shard: Optional[Shard], *, allow_config_change: bool = False,
             options: Optional[Mapping[str, Any]] = None, staging_dir: Optional[str] = None,
             pool: Optional[str] = None, lease_s: Optional[float] = None) -> OutputStore:
        """The store at ``location`` (``open_store``'s arguments). Opening reads and writes nothing."""
        ...

    @property
    def local_dir(self) -> Path: ...  # read only: ``ObjectStore``'s is a property

    def prepare(self, settings: RunSettings, expected: Optional[int],
                total: Optional[int]) -> tuple[Optional[str], np.ndarray]:
        """Lock, compare ``settings`` with the recorded ones, recover a killed run's leftovers:
        (the refusal or None, the indices already made). ``expected``: this run's images (its
        shard's), ``total``: the prompt set's. On global rank 0 only."""
        ...

    def part(self, rank: int) -> Path:
        """Where ``rank`` appends the manifest lines of what it writes."""
        ...

    def publisher(self, rank: int) -> Optional[Uploader]:
        """What takes ``rank``'s closed tar shards on from ``local_dir`` (``files.OutputFiles.publish``)."""
        ...

    def fence(self, publisher: Any) -> Optional[Fence]:
        """How a pool's batches are published under their claims (``fence``; ``publisher``: the
        rank's, from ``publisher``)."""
        ...

    @property
    def parts_glob(self) -> str:
        """The files this run's ranks append their lines to (``ImageProgressBar`` counts them)."""
        ...

    def write_rejected(self, lines: list[RejectedLine], rejected: bool) -> None:
        """``rejected.jsonl``: ``lines`` (``PromptSource.rejected_lines``) where this run leaves out
        images (``rejected``) or an earlier run left the file."""
        ...

    def merge(self, done: np.ndarray) -> tuple[dict[int, int], np.ndarray, int]:
        """Merge the ranks' parts: (lines by rank, every index made, failed images)."""
        ...

    def shard_plan(self, num_shards: int) -> Optional[np.ndarray]:
        """The recorded shard plan of ``num_shards`` (``shard.plan_file``); None where none is."""
        ...

    def ran_shards_of(self, num_shards: int) -> bool:
        """Whether shards of ``num_shards`` left their run records here (``shard.first_plan``)."""
        ...

    def record(self, summary: RunSummary) -> None:
        """Add the run's summary to its history."""
        ...

    def release(self) -> None:
        """Give back what the store holds: the lock, a staging folder."""
        ...

    def pool_files(self) -> PoolFiles:
        """Where a pool's workers register and claim batches (``pool.PoolFiles``), for a store
        opened with ``pool`` (``data.schedule: pull``)."""
        ...

    # --- the side every reader uses ------------------------------------------------------------

    @property
    def manifest_where(self) -> str:
        """Where the records are, as messages name them."""
        ...

    @staticmethod
    def settings_problems(settings: WriterSettings) -> list[str]:
        """What this kind of store refuses among the writer's settings (``writer.output_dir`` and
        the keys that go with it), before anything runs."""
        ...

    def write_problems(self) -> list[str]:
        """Why a run could not write there now (a store that cannot be reached, no right to write);
        one line each, naming no secret."""
        ...

    def read_problems(self, what: str) -> list[str]:
        """Why it cannot be read (``what`` names it in the message: "output", "reference")."""
        ...

    def made(self) -> tuple[np.ndarray, set[int]]:
        """The recorded images (a sorted integer array; empty where nothing is written yet) and the
        images of rejected records that are not among them."""
        ...

    def live_locks(self) -> dict[Optional[tuple[int, int]], str]:
        """The runs writing into it now, by shard (None: a whole run), each with its holder."""
        ...

    def local_records(self, what: str) -> ContextManager[Path]:
        """The recorded images as a local folder that folder readers take (``eval``): the folder
        itself, or the records downloaded into a temporary one for the ``with`` block."""
        ...

    def status(self, now: Optional[float] = None, arrays: Optional[JobArrays] = None) -> RunStatus:
        """How far the run is at time ``now`` (default: this moment), as ``lightning-diffusion status``
        prints it (``status.folder_status`` names the keys): done and expected, failed and rejected,
        the rate and ETA, the locks, each shard, a pool's workers. ``arrays``: what the scheduler
        knows of the job arrays submitted into a folder (a bucket's are submitted from a job folder
        of their own, which it does not read). Raises ``ConfigError`` where there is no output to
        read."""
        ...



def _kinds() -> list[tuple[Callable[[Location], bool], type[OutputStore]]]:
    """(does this location belong to the store, the store) in the order they are asked."""
    from lightning_diffusion.output.bucket import is_url
    from lightning_diffusion.output.folder_store import FolderStore
    from lightning_diffusion.output.object_store import ObjectStore

    return [(is_url, ObjectStore), (lambda location: True, FolderStore)]


def store_class(location: Location) -> type[OutputStore]:
    """The kind of store that ``location`` (``writer.output_dir``) names."""
    return next(cls for belongs, cls in _kinds() if belongs(location))


def open_store(location: Location, shard: Optional[Shard] = None, *, allow_config_change: bool = False,
               options: Optional[Mapping[str, Any]] = None, staging_dir: Optional[str] = None,
               pool: Optional[str] = None, lease_s: Optional[float] = None) -> OutputStore:
    """The store at ``location`` for a run of ``shard`` (None: the whole prompt set), or to read.
    ``options``: ``writer.storage_options``; ``staging_dir``: where a store that uploads builds its
    files first; ``pool``: the job's name in a pool of workers that pull batches
    (``data.schedule: pull``) and ``lease_s`` its ``data.lease_s``. Opening reads and writes nothing."""
    return store_class(location).open(location, shard, allow_config_change=allow_config_change, options=options,
                    staging_dir=staging_dir, pool=pool, lease_s=lease_s)


def writer_problems(settings: WriterSettings) -> list[str]:
    """The writer group's values (``ImageWriter``'s arguments) against their rules
    (``settings.WriterSettings``), and the output location's own (``OutputStore.settings_problems``
    of the store its ``output_dir`` opens)."""
    output_dir = settings.output_dir
    named = isinstance(output_dir, (str, os.PathLike)) and bool(str(output_dir).strip())
    local = named and store_class(output_dir).is_folder  # a folder, not a bucket
    problems: list[str] = (system_folder_problems(str(output_dir)) if local else []) or (
        store_class(output_dir).settings_problems(settings) if named else [
            f"writer.output_dir must name a folder, got {output_dir!r} (an empty name would write into the working "
            "folder)."])
    from lightning_diffusion.output.audit import audit_problems

    problems += audit_problems(settings.audit)
    if settings.audit is not None and named and not local:
        problems.append("writer.audit writes audit.jsonl beside a folder's manifest; a bucket's output "
                        f"({output_dir}) is not audited yet: audit into a folder, or leave writer.audit out.")
    for name, rule in WriterSettings.rules():
        value, key = getattr(settings, name), f"writer.{name}"
        if rule.choices:
            problems += one_of(value, key, rule.choices)
        elif rule.integer:
            problems += [p.replace(key, rule.label or key).removesuffix(".") + rule.hint + "."
                         for p in integer(value, key, rule.minimum, rule.maximum)]
    return problems + litdata_problems(settings.format)


def litdata_problems(format: str, installed: Callable[[str], bool] | None = None) -> list[str]:
    """``writer.format: litdata`` where the litdata package is not installed (``installed``: whether a
    package is, by its import name)."""
    if format != "litdata":
        return []
    if installed is None:
        import importlib.util

        installed = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
    if installed("litdata"):
        return []
    return [f"writer.format: litdata needs the litdata package, which is not installed: {LITDATA_INSTALL}."]
