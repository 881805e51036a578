"""A pool of workers (``data.schedule: pull``) in a bucket prefix: the pool's files on an object store
(``BucketPoolFiles``, what ``pool.PoolFiles`` asks) and a job's joining of the pool (``join_pool``).

Claims and takeovers are objects made by a conditional PUT (``If-None-Match: *``), so the store must
refuse a second create of one object; ``join_pool`` probes that before the job registers.

Kept free of torch and Lightning, as ``object_store`` is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Optional, Protocol

import numpy as np

from lightning_diffusion.core.records import FailureLine, JsonObject, RunSettings
from lightning_diffusion.output.lock import deal_beside_pool_message
from lightning_diffusion.output.manifest import RUN_FILE, recorded_conflict
from lightning_diffusion.output.pool import Pool, WorkerRecord, live_jobs, log_joined, quit_join

if TYPE_CHECKING:
    from lightning_diffusion.output.storage import Storage


class BucketStore(Protocol):
    """What a pool asks of its bucket (``object_store.ObjectStore``)."""

    url: str
    pool: Optional[str]  # this job's name in the pool
    lease_s: float
    worker: Optional[Pool]  # the job's first worker, once registered
    allow_config_change: bool

    @property
    def storage(self) -> Storage: ...

    def recorded(self) -> tuple[np.ndarray, dict[int, int], list[FailureLine]]: ...

    def live_locks(self) -> dict[Optional[tuple[int, int]], str]: ...

    def read_json(self, name: str) -> Optional[JsonObject]: ...

    def write_json(self, name: str, content: Mapping[str, object], create: bool = False) -> None: ...


class BucketPoolFiles:
    """A pool in a bucket prefix (``pool.PoolFiles``): creates by a conditional PUT (``If-None-Match:
    *``), renewals by writing the registration again; a registration's age is the time it holds
    (``beat``), so the workers' clocks must agree within the lease (NTP)."""

    def __init__(self, store: BucketStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.where = store.url
        self.clock = clock  # what a registration's ``beat`` is read against

    def create(self, name: str, data: bytes) -> bool:
        return self.store.storage.create(name, data)

    def read(self, name: str) -> Optional[bytes]:
        try:
            return self.store.storage.read(name)
        except FileNotFoundError:
            return None

    def put(self, name: str, data: bytes) -> None:
        self.store.storage.write(name, data)

    def exists(self, name: str) -> bool:
        return self.read(name) is not None  # one GET (an object store's exists may also list the prefix)

    def names(self, folder: str) -> list[str]:
        try:
            return self.store.storage.names(folder)
        except FileNotFoundError:
            return []

    def renew(self, name: str, data: bytes) -> None:
        self.put(name, data)

    def age(self, name: str, content: WorkerRecord) -> float:
        return max(0.0, self.clock() - float(content.get("beat") or 0.0))

    def recorded(self) -> np.ndarray:
        return self.store.recorded()[0]

    def take_over(self, name: str, data: bytes, images: np.ndarray) -> tuple[bool, np.ndarray]:
        # No lock: the slot is the fence. Once it is made, the lines of the claims before it stop
        # counting (``fence.counted_generations``), so the batch is made whole.
        return self.create(name, data), np.zeros(0, dtype=np.int64)


def join_pool(store: BucketStore, settings: RunSettings,
              total: Optional[int]) -> tuple[Optional[str], np.ndarray]:
    """``ObjectStore.prepare`` for a job of a pool (``data.schedule: pull``): no lock (the jobs of a pool
    write beside each other); refused beside a run that deals its work; run.json made by the
    first job (a conditional PUT) and compared by the others, as a resume's."""
    nothing = np.zeros(0, dtype=np.int64)
    if not conditional_puts(store):
        return (f"{store.url}: the store accepted a second conditional PUT (If-None-Match: *) of one object, so "
                "two workers could claim one batch: data.schedule: pull needs a store with conditional writes; "
                "use data.schedule: deal, or a shared folder."), nothing
    # Registered first, checked after (a run that deals takes its lock first, then looks for a pool).
    store.worker = Pool(BucketPoolFiles(store), str(store.pool), 0, store.lease_s)
    store.worker.start()
    runs = store.live_locks()
    if runs:
        return quit_join(store, deal_beside_pool_message(store.url, runs)), nothing
    try:
        recorded = store.read_json(RUN_FILE)
        if recorded is None:
            try:
                store.write_json(RUN_FILE, {**settings, "expected": total, "history": []}, create=True)
            except FileExistsError:
                recorded = store.read_json(RUN_FILE)
    except ValueError:
        return quit_join(store, f"{store.url}/{RUN_FILE} is not valid JSON; move it away to start the prefix "
                           "afresh."), nothing
    if recorded is not None and not store.allow_config_change:
        conflict = recorded_conflict(recorded, settings, store.url)
        if conflict:
            return quit_join(store, conflict), nothing
    done, _, _ = store.recorded()
    log_joined(store.url, sorted(live_jobs(BucketPoolFiles(store)) - {str(store.pool)}), total, len(done))
    return None, done


def conditional_puts(store: BucketStore) -> bool:
    """Whether the store refuses a second create of one object (what a pool's claims need)."""
    files = BucketPoolFiles(store)
    name = f".conditional-check-{os.urandom(6).hex()}"
    try:
        return files.create(name, b"1") and not files.create(name, b"2")
    finally:
        store.storage.delete(name)
