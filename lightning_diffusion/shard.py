"""``Shard``: one part of a prompt set, made by one task of a job array; the one home of the rule
that says which images a shard holds.

Shard ``T`` of ``N`` holds every image ``i`` with ``i % N == T``: an image keeps its index, seed and
file name whatever the shard count, and the shards of one count share no image. ``None`` stands for
a run of the whole prompt set wherever a shard is optional.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np


class Shard(NamedTuple):
    """Shard ``shard_index`` of ``num_shards`` (a tuple, so that run.json records it as ``[T, N]``)."""

    shard_index: int
    num_shards: int

    @property
    def name(self) -> str:
        """``shard-T-of-N``: the infix of the shard's manifest parts, lock and run record."""
        return f"shard-{self.shard_index}-of-{self.num_shards}"

    def holds(self, index: int) -> bool:
        return index % self.num_shards == self.shard_index

    def select(self, indices: Any) -> np.ndarray:
        """The ``indices`` (an integer array) that belong to this shard."""
        indices = np.asarray(indices, dtype=np.int64)
        return indices[indices % self.num_shards == self.shard_index]

    def members(self, total: int) -> np.ndarray:
        """This shard's images among ``total``."""
        return np.arange(self.shard_index, total, self.num_shards, dtype=np.int64)

    def size(self, total: int) -> int:
        return len(range(self.shard_index, total, self.num_shards))


def as_shard(shard: Optional[tuple[int, int]]) -> Optional[Shard]:
    """A ``(T, N)`` pair (from run.json or a lock file) as a ``Shard``; None stays None."""
    return None if shard is None else Shard(int(shard[0]), int(shard[1]))


def shard_name(shard: Optional[tuple[int, int]]) -> Optional[str]:
    """``shard-T-of-N`` for shard ``(T, N)``; None for a run of the whole prompt set."""
    return None if shard is None else Shard(*shard).name


def in_shard(index: int, shard: Optional[tuple[int, int]]) -> bool:
    """Whether image ``index`` belongs to shard ``(T, N)`` (every image does to no shard: None)."""
    return shard is None or Shard(*shard).holds(index)


def select(indices: Any, shard: Optional[tuple[int, int]]) -> np.ndarray:
    """The ``indices`` that belong to ``shard`` (all of them for None)."""
    return np.asarray(indices, dtype=np.int64) if shard is None else Shard(*shard).select(indices)


def shard_size(total: int, shard: Optional[tuple[int, int]]) -> int:
    """How many of ``total`` images a shard holds."""
    return total if shard is None else Shard(*shard).size(total)


def shard_members(total: int, shard: Optional[tuple[int, int]]) -> np.ndarray:
    """The images of ``shard`` among ``total`` (every image for None)."""
    return np.arange(total, dtype=np.int64) if shard is None else Shard(*shard).members(total)
