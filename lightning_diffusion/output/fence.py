"""A pool's batches published under their claims (fencing): the one step that makes a worker's
outputs visible is taken only while the claim it made them under still holds the batch.

Every batch of a pool (``pool.Pool``) has a chain of claim slots, each made by an atomic create
(``O_EXCL`` in a folder, a conditional PUT in a bucket): ``B`` (generation 0), ``B.1``, ``B.2``...
A worker makes a batch under the generation of the slot it made, its *claim* (``Claim``: the
fencing token, written on each manifest line as ``"claim": "DIGEST/B.G"``). A takeover makes the
next slot. Publication (``Fence.publish``) is where a stale claim is refused:

- **a folder** (``FolderFence``): under the folder's merge lock, the publisher looks for the slot
  after its claim; where there is none, it renames its files (or its tar shard) into place and
  appends their lines to its part, all before the lock is released. A takeover (``FolderPoolFiles
  .take_over``) reads what is recorded and makes its slot under the same lock. The two are
  serialised: either the batch's lines are in a part before the takeover looks (and it takes over
  only the images not recorded), or the takeover's slot exists before the publisher looks (and
  nothing of that batch is published). A freeze anywhere before the lock publishes nothing once
  the batch is taken over; a freeze inside the lock holds the lock, and the takeover waits for it
  (a kill releases it); a freeze after the lock has published already, and is read as recorded.
- **a bucket** (``BucketFence``): there is no lock, so the publisher makes the slot after its
  claim itself, as a *seal* (``sealed WORKER``), before it uploads anything. Exactly one of the
  seal and a takeover makes that slot: a worker whose seal failed publishes nothing of the batch;
  a batch sealed is taken over only once its worker is proven gone (``pool.SEAL_GRACE`` leases of
  silence). A manifest line of a pool counts only where its batch's latest slot is the one after
  its claim (its own seal): lines of a generation taken over after its seal never count, and the
  merge removes a tar whose lines all stopped counting.

Kept free of torch and Lightning: the writer process imports it (through ``files``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Optional, Protocol

from lightning_diffusion.output.manifest import merge_lock

if TYPE_CHECKING:
    from lightning_diffusion.output.storage import Storage

# Where a test places a freeze: called with the name of the step a publication reaches
# (``written``: its files are under temporary names; ``locked``: inside the fence, before the look;
# ``published``: renamed into place, before the lines), or a folder's takeover (``taking over``:
# the records read, before its slot). None in a run.
PAUSE: Optional[Callable[[str], None]] = None


def pause(step: str) -> None:
    if PAUSE is not None:
        PAUSE(step)


def slot_name(batch: int, generation: int) -> str:
    """The file (or object) of a batch's claim of ``generation`` in its claims folder."""
    return str(batch) if generation == 0 else f"{batch}.{generation}"


@dataclass(frozen=True)
class Claim:
    """A batch held by ``worker`` under the claim of ``generation`` in ``claims`` (the pool's
    claims folder, relative to the output location: ``pool/claims-DIGEST``)."""

    claims: str
    batch: int
    generation: int
    worker: str

    @property
    def token(self) -> str:
        """What a manifest line records of it: ``DIGEST/B.G``."""
        return f"{self.claims.rsplit('claims-', 1)[-1]}/{self.batch}.{self.generation}"

    def slot(self, generation: int) -> str:
        return f"{self.claims}/{slot_name(self.batch, generation)}"


def parse_token(token: object) -> Optional[tuple[str, int, int]]:
    """(digest, batch, generation) of a line's ``claim``; None for any other value."""
    if not isinstance(token, str) or "/" not in token:
        return None
    digest, _, rest = token.partition("/")
    batch, _, generation = rest.partition(".")
    if not (batch.isdigit() and generation.isdigit()):
        return None
    return digest, int(batch), int(generation)


class Fence(Protocol):
    """Publication under claims: ``publish(held)`` is called once, with the claims of ``claims``
    that still hold their batches, at a moment no takeover of them can interleave with; returns
    the claims lost."""

    def publish(self, claims: Collection[Claim], publish: Callable[[set[Claim]], None]) -> set[Claim]:
        ...


class LockLost(RuntimeError):
    """A run that deals its work found its folder's lock taken over: it publishes nothing more."""


class FolderFence:
    """Publication in a folder every worker sees: under its merge lock (``manifest.merge_lock``).
    ``lock``: a run that deals its work (not a pool's), its lock file and the token it wrote there
    (``lock.OutputLock``): a run whose lock another run took over (it was frozen past the lock's
    staleness) publishes nothing, and stops."""

    def __init__(self, folder: Path, lock: Optional[tuple[str, str]] = None) -> None:
        self.folder = Path(folder)
        self.lock = lock

    def _lock_lost(self) -> bool:
        if self.lock is None:
            return False
        import json

        try:
            return json.loads((self.folder / self.lock[0]).read_text()).get("token") != self.lock[1]
        except (OSError, ValueError):
            return True

    def publish(self, claims: Collection[Claim], publish: Callable[[set[Claim]], None]) -> set[Claim]:
        with merge_lock(self.folder):
            pause("locked")
            if self._lock_lost():
                raise LockLost(f"{self.folder}: another run took this run's lock over (its heartbeat stopped for "
                               "longer than the lock's 2 minutes: a frozen node?); this run writes nothing more, "
                               "and the images it had not published are that run's.")
            lost = {claim for claim in claims if (self.folder / claim.slot(claim.generation + 1)).exists()}
            publish(set(claims) - lost)
        return lost


class Uploads(Protocol):
    """What a bucket's fence shares with the rank's uploads (``bucket.Uploader``): its storage."""

    @property
    def storage(self) -> Storage: ...


class BucketFence:
    """Publication in a bucket: each batch sealed by a conditional PUT of the slot after its claim
    (through the rank's ``bucket.Uploader``, whose storage it shares)."""

    def __init__(self, uploader: Uploads) -> None:
        self.uploader = uploader

    def _seal(self, claim: Claim) -> bool:
        storage = self.uploader.storage
        seal = f"sealed {claim.worker}".encode()
        if storage.create(claim.slot(claim.generation + 1), seal):
            return True
        # sealed before (a batch whose images span two tar shards): still ours while nobody took it after
        try:
            mine = storage.read(claim.slot(claim.generation + 1)) == seal
            return mine and not storage.exists(claim.slot(claim.generation + 2))
        except FileNotFoundError:
            return False

    def publish(self, claims: Collection[Claim], publish: Callable[[set[Claim]], None]) -> set[Claim]:
        held = {claim for claim in claims if self._seal(claim)}
        pause("locked")
        publish(held)
        return set(claims) - held


def counted_generations(slots: Collection[str]) -> dict[int, int]:
    """For a bucket's claims folder listing (``slots``: ``B``, ``B.1``...): batch -> the generation
    whose lines count (the one before the latest slot: that slot is its seal)."""
    latest: dict[int, int] = {}
    for name in slots:
        batch, _, generation = os.path.basename(name).partition(".")
        if batch.isdigit() and (not generation or generation.isdigit()):
            latest[int(batch)] = max(latest.get(int(batch), 0), int(generation or 0))
    return {batch: generation - 1 for batch, generation in latest.items()}
