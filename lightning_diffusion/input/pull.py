"""``PullSampler``: a replica's batches claimed one at a time from the pool (``data.schedule: pull``)
instead of dealt before the run (``data.PlanSampler``).

The replica's writing rank claims the costliest batch nobody holds (``output.pool.Pool``), yields it,
and claims the next when the loader asks; the replica's other ranks (model-parallel) receive each
claim from it. Once every batch is claimed, the worker stays while other workers hold batches that
are not recorded yet: one whose worker stops working (ended without making it, failed, silent for
longer than ``data.lease_s``) is taken over, and only its images not recorded are made. A key the
sampler yields is ``(batch, generation, recorded)``: the batch's position in the plan, the claim's
generation (0, or the takeover's), and the batch's images recorded by others since this job
started (left out of the batch).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from lightning_diffusion.core.console import log
from lightning_diffusion.output.fence import Claim
from lightning_diffusion.output.pool import SEALED, Pool, claim_order

if TYPE_CHECKING:
    from torch.utils.data import Dataset

Key = tuple[int, int, tuple[int, ...]]
WAIT = "wait"  # what the writing rank sends its replica's other ranks while it waits for other workers


class PullSampler(DistributedSampler):
    """The batches this replica claims from ``pool`` (None on a rank that only follows its replica's
    writing rank, through ``share``: that rank's object to every rank of the replica). ``dataset``:
    a ``data.BatchDataset`` of the whole set's plan, whose samples are the images left to make."""

    def __init__(self, dataset: Dataset, pool: Optional[Pool], share: Optional[Callable[[object], object]] = None,
                 stopping: Optional[threading.Event] = None, poll_s: Optional[float] = None,
                 requested: Optional[threading.Event] = None) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=False, drop_last=False)
        self.batches: Any = dataset  # a data.BatchDataset (its plan, its samples)
        self.pool = pool
        self.share = share
        self.stopping = stopping if stopping is not None else threading.Event()
        lease = pool.lease_s if pool is not None else 1.0
        self.poll_s = poll_s if poll_s is not None else min(1.0, lease / 4)
        # A stop this rank was asked for (a signal): seen in the end wait, where no batch's stop check runs.
        self.requested = requested if requested is not None else threading.Event()
        self.claimed = 0  # batches this worker claimed (takeovers included)
        # The images recorded, read when a worker was first found stopped after this job started (a
        # worker that stopped before keeps to what this job found recorded when it started).
        self._recorded = np.zeros(0, dtype=np.int64)
        self._read_after: set[str] = set()
        self._started = pool.clock() if pool is not None else time.time()  # the pool's clock (tests drive it)

    def __len__(self) -> int:
        raise TypeError("a pool's batches are claimed while the run goes: the sampler has no length")

    def __iter__(self) -> Iterator[object]:
        if self.pool is None:  # a follower: the writing rank's claims, until it says None
            while (key := self.share(None) if self.share is not None else None) is not None:
                if key != WAIT:
                    yield key
            return
        try:
            for key in self._claims():
                if self.share is not None:
                    self.share(key)  # WAIT too: the followers' broadcast never waits past a poll
                if key != WAIT:
                    yield key
        finally:
            self.pool.wait(True)  # claims nothing more, holds at most the batch fetched ahead
        if self.share is not None:
            self.share(None)

    def _stopped(self, seconds: float = 0.0) -> bool:
        """Whether this worker is to stop (its replica agreed, or this rank got a signal), waiting up
        to ``seconds`` for it."""
        end = time.monotonic() + seconds
        while True:
            if self.stopping.is_set() or self.requested.is_set():
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, 0.1))

    # ----------------------------------------------------------------- the writing rank's claims

    def _left(self, batch: int) -> np.ndarray:
        """The batch's images this job has to make (not recorded when it started)."""
        images = self.batches.plan.batch(batch)
        pending = self.batches.samples.indices
        positions = np.minimum(np.searchsorted(pending, images), max(len(pending) - 1, 0))
        return images[pending[positions] == images] if len(pending) else images[:0]

    def _claims(self) -> Iterator[Union[Key, str]]:
        pool = self.pool
        assert pool is not None
        waiting: list[int] = []  # batches held by other workers that work
        for batch in claim_order(self.batches.plan.costs).tolist():
            if self._stopped():
                return
            if not len(self._left(batch)):
                continue
            if pool.claim(batch):
                self.claimed += 1
                yield batch, 0, ()
                continue
            key = self._settle(batch)
            if key is None:
                waiting.append(batch)
            elif key is not False:
                yield key
        # Every batch is claimed. The loader has fetched this worker's last batch ahead, so it is
        # made only once this wait ends: the worker waits while another worker works on a batch (to
        # take it over if that worker stops), and ends once every batch left is held by a worker that
        # waits too (each makes its own as soon as its wait ends).
        if waiting:
            pool.wait(True)
            log.info(f"pool: every batch is claimed; waiting while other workers make {len(waiting)}, to take over "
                     "any whose worker stops.")
        while waiting:
            pool.refresh()
            still = []
            for batch in waiting:
                key = self._settle(batch)
                if key is None:
                    still.append(batch)
                elif key is not False:
                    pool.wait(False)
                    yield key
                    if self._stopped():
                        return
                    pool.wait(True)
            waiting = still
            if all(pool.waiting(pool.holder(batch)[1].removeprefix(SEALED)) for batch in waiting):
                return
            yield WAIT  # the replica's other ranks hear from this rank at every poll
            if self._stopped(self.poll_s):
                return

    def _settle(self, batch: int) -> Union[Key, Literal[False], None]:
        """For a batch another worker claimed: None while its worker works (wait), False when it is
        recorded or another worker took it over first (nothing to do), else this worker's takeover.
        A bucket's batch sealed by a worker that stopped is taken over only once the seal lapsed
        (``Pool.seal_lapsed``)."""
        pool = self.pool
        assert pool is not None
        generation, holder = pool.holder(batch)
        sealed = holder.startswith(SEALED)
        holder = holder.removeprefix(SEALED)
        if holder == pool.worker:
            return False  # this worker's own (a takeover it already made)
        if pool.working(holder):
            return None
        if sealed and not pool.seal_lapsed(holder):
            return None  # its upload may still come: nothing to read until its worker is proven gone
        if sealed or (holder not in self._read_after and not pool.stopped_before(holder, self._started)):
            self._recorded = pool.files.recorded()  # what it recorded since this job started (a seal: its upload)
            self._read_after.add(holder)
        left = self._left(batch)
        if np.isin(left, self._recorded).all():
            return False
        taken, recorded = pool.take_over(batch, generation, left)
        if not taken:
            # recorded meanwhile (nothing to do), or another worker took it at the same moment (settled next round)
            return False if len(recorded) == len(left) else None
        self.claimed += 1
        log.info(f"pool: took over batch {batch} from worker {holder or 'unknown'} (not working any more): "
                 f"{len(left) - len(recorded)} of its images are not recorded.")
        return batch, generation + 1, tuple(recorded.tolist())


def claim_of(pool: Optional[Pool], keys: Optional[Sequence[object]]) -> Union[Claim, None, Literal[False]]:
    """The claim this worker holds the batch of ``keys`` under (Lightning's batch indices: the one
    key this sampler yielded), False once another worker took it over (seen before any of its
    images is encoded; the fence, at publication, is what decides), None where it is not a pool's."""
    if pool is None or not keys:
        return None
    key = keys[0]
    if not isinstance(key, tuple):
        return None
    if pool.lost(key[0], key[1]):
        log.warning(f"pool: batch {key[0]} was taken over by another worker while this one made it (its renewals "
                    "stopped for longer than data.lease_s); its images are left to that worker.")
        return False
    return Claim(pool.claims, key[0], key[1], pool.worker)
