"""``Shard``: one part of a prompt set, made by one task of a job array; the one home of the rule
that says which images a shard holds.

The shards of ``N`` are dealt by cost, as a run's batches are dealt to its replicas: the whole
set's batch plan (``batching.plan_batches``, from the records alone: each image's pixels x steps
where the record gives them, never the pipeline's view, so any task and any reader plans the same)
is dealt batch by batch, the costliest first, each to the shard with the least work so far
(``BatchPlan.deal``). The deal is a pure function of the records, ``data.batch_size``,
``data.bucket`` and ``N``: whichever task starts first plans what the others plan. It is recorded in
the output folder as ``shards-of-N.u16`` (the shard of every image, 2 bytes little-endian each, in
index order: ``numpy.fromfile(path, "<u2")``) by the first task that starts, so that ``status``
and ``slurm --resubmit`` read it without the records; the other tasks take it (``adopt``). A folder
that holds records of shards of ``N`` but no plan keeps the rule they ran by (``index_rule``).

A ``Shard`` without a plan (``owners`` None) holds every image ``i`` with ``i % N == T``. An image
keeps its index, seed and file name whatever the shard count, and the shards of one count share no
image. ``None`` stands for a run of the whole prompt set wherever a shard is optional.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol

import numpy as np

from lightning_diffusion.core.checks import MAX_SHARDS as MAX_SHARDS  # a shard number: 2 bytes an image

if TYPE_CHECKING:
    from numpy.typing import ArrayLike



class Batches(Protocol):
    """What the output reads of a run's plan of batches (``input.batching.BatchPlan``, which the
    data module makes): how many batches and of what size, the image indices batch after batch, how
    they deal to replicas or shards, how many size buckets they group and how many images padding adds."""

    order: np.ndarray
    batch_size: int

    def __len__(self) -> int: ...

    @property
    def sizes(self) -> np.ndarray: ...

    @property
    def num_buckets(self) -> int: ...

    @property
    def images(self) -> int: ...

    @property
    def padded(self) -> int: ...

    def deal(self, replicas: int) -> list[np.ndarray]: ...


class _Pair(NamedTuple):
    shard_index: int
    num_shards: int


class Shard(_Pair):
    """Shard ``shard_index`` of ``num_shards`` (a tuple, so that run.json records it as ``[T, N]``);
    ``owners``: the shard of every image of the set, where it is known. Immutable: ``with_owners``
    and ``adopt`` make a new one, so a plan one part takes never changes what another part holds."""

    owners: Optional[np.ndarray] = None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Shard is immutable ({name}): with_owners makes one with a plan")

    def with_owners(self, owners: Optional[np.ndarray]) -> Shard:
        """This shard, dealt by ``owners`` (the shard of every image)."""
        shard = Shard(self.shard_index, self.num_shards)
        object.__setattr__(shard, "owners", owners)
        return shard

    @property
    def name(self) -> str:
        """``shard-T-of-N``: the infix of the shard's manifest parts, lock and run record."""
        return f"shard-{self.shard_index}-of-{self.num_shards}"

    def holds(self, index: int) -> bool:
        if self.owners is not None:
            return 0 <= index < len(self.owners) and int(self.owners[index]) == self.shard_index
        return index % self.num_shards == self.shard_index

    def select(self, indices: ArrayLike) -> np.ndarray:
        """The ``indices`` (an integer array) that belong to this shard."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.owners is None:
            return indices[indices % self.num_shards == self.shard_index]
        inside = indices[(indices >= 0) & (indices < len(self.owners))]
        return inside[self.owners[inside] == self.shard_index]

    def members(self, total: int) -> np.ndarray:
        """This shard's images among ``total``."""
        if self.owners is None:
            return np.arange(self.shard_index, total, self.num_shards, dtype=np.int64)
        return np.flatnonzero(self.owners[:total] == self.shard_index)

    def size(self, total: int) -> int:
        if self.owners is None:
            return len(range(self.shard_index, total, self.num_shards))
        return int(np.count_nonzero(self.owners[:total] == self.shard_index))


def _as(shard: tuple[int, int]) -> Shard:
    return shard if isinstance(shard, Shard) else Shard(*shard)


def as_shard(shard: Optional[tuple[int, int]]) -> Optional[Shard]:
    """A ``(T, N)`` pair (from run.json or a lock file) as a ``Shard``; None stays None."""
    return None if shard is None else Shard(int(shard[0]), int(shard[1]))


def shard_name(shard: Optional[tuple[int, int]]) -> Optional[str]:
    """``shard-T-of-N`` for shard ``(T, N)``; None for a run of the whole prompt set."""
    return None if shard is None else Shard(*shard).name


def in_shard(index: int, shard: Optional[tuple[int, int]]) -> bool:
    """Whether image ``index`` belongs to shard ``(T, N)`` (every image does to no shard: None)."""
    return shard is None or _as(shard).holds(index)


def select(indices: ArrayLike, shard: Optional[tuple[int, int]]) -> np.ndarray:
    """The ``indices`` that belong to ``shard`` (all of them for None)."""
    return np.asarray(indices, dtype=np.int64) if shard is None else _as(shard).select(indices)


def shard_size(total: int, shard: Optional[tuple[int, int]]) -> int:
    """How many of ``total`` images a shard holds."""
    return total if shard is None else _as(shard).size(total)


def shard_members(total: int, shard: Optional[tuple[int, int]]) -> np.ndarray:
    """The images of ``shard`` among ``total`` (every image for None)."""
    return np.arange(total, dtype=np.int64) if shard is None else _as(shard).members(total)


# ----------------------------------------------------------------------------- the deal and its record


def deal_shards(plan: Batches, total: int, num_shards: int) -> np.ndarray:
    """The shard of each of ``total`` images: ``plan``'s batches (a ``batching.BatchPlan`` of the
    whole set) dealt to ``num_shards`` by cost, the costliest first, each to the least loaded."""
    batch_owner = np.zeros(len(plan), dtype=np.uint16)
    for shard, positions in enumerate(plan.deal(num_shards)):
        batch_owner[positions] = shard
    owners = np.zeros(total, dtype=np.uint16)
    owners[plan.order] = np.repeat(batch_owner, plan.sizes)
    return owners


def plan_file(num_shards: int) -> str:
    """The name of the shard plan of ``num_shards`` in an output folder or prefix."""
    return f"shards-of-{num_shards}.u16"


def owners_bytes(owners: np.ndarray) -> bytes:
    return np.asarray(owners, dtype="<u2").tobytes()


def owners_from_bytes(blob: bytes) -> np.ndarray:
    """A recorded shard plan; an empty one where the bytes cannot be one (an odd length), which
    ``adopt`` refuses as the plan of another set."""
    return np.frombuffer(blob, dtype="<u2").astype(np.uint16) if len(blob) % 2 == 0 else np.zeros(0, np.uint16)


def recorded_owners(folder: Path, num_shards: int) -> Optional[np.ndarray]:
    """The folder's shard plan of ``num_shards``; None where no task of that count has started."""
    try:
        return owners_from_bytes((Path(folder) / plan_file(num_shards)).read_bytes())
    except OSError:
        return None


def adopt(shard: Shard, recorded: Optional[np.ndarray], total: int, where: str) -> tuple[Shard, Optional[str]]:
    """``shard`` dealt as the plan ``recorded`` at ``where`` deals it (the first task's: a task run
    with another ``data.batch_size`` or ``data.bucket`` makes the recorded shard's images all the
    same), and why it cannot be: the plan is not one of ``total`` images (another prompt set). Where
    there is no plan, or on a refusal, ``shard`` itself."""
    if recorded is None:
        return shard, None
    if len(recorded) != total or (len(recorded) and int(recorded.max()) >= shard.num_shards):
        return shard, (f"{where} deals {len(recorded):,} images to {shard.num_shards} shards, but this prompt set "
                       f"has {total:,}: the array's first task ran with another prompt set. Use another output "
                       "folder, or another shard count.")
    return shard.with_owners(recorded), None


def index_rule(total: int, num_shards: int) -> np.ndarray:
    """The plan of shards that left records but no plan: image ``i`` to shard ``i % N``."""
    return (np.arange(total, dtype=np.int64) % num_shards).astype(np.uint16)


def first_plan(store: Any, num_shards: int, total: int, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The plan the first task of ``num_shards`` records in ``store`` (a ``FolderStore`` or an
    ``ObjectStore`` that holds none): the cost deal (``compute()``), or the index rule where shards of
    that count left their records there without a plan."""
    return index_rule(total, num_shards) if store.ran_shards_of(num_shards) else compute()
