"""The batch plan: a run's images -> buckets -> batches -> data-parallel replicas.

Images whose records share everything one pipeline call needs alike (the call arguments, the
input fields and, for pipelines that resize every input to the first one's size, the input sizes)
form a *bucket*. Batches are cut inside a bucket, ``batch_size`` images each in index order (a
bucket's last batch may be short; the module pads it), so a mixed prompt set runs one full
pipeline call per batch instead of one padded call per kind of record in a batch. The batches are a
pure function of the images and the batch size, never of the number of replicas or nodes: image
``i`` is computed in the same batch composition whatever the layout.

The batches are then dealt to the replicas by estimated cost (pixels x latent frames x steps x
guidance passes of each image, a padded batch counted at its padded size), longest first, each to
the replica with the least work so far, so that replicas end together. ``bucket=False`` keeps
index order: batches of consecutive images, whatever their kinds, dealt in turn.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from lightning_diffusion.core.console import counted
from lightning_diffusion.core.records import CallArgs
from lightning_diffusion.pipelines.adapters import choice_key

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


@dataclass
class SetFacts:
    """For each call-argument set of a ``RecordSummary`` (``summary.sets``): its bucket (sets that
    can share a pipeline call share a bucket) and the estimated cost of one of its images."""

    bucket: list[int]
    cost: list[float]
    describe: list[str] = field(default_factory=list)  # each bucket's settings, for messages

    @classmethod
    def from_summary(cls, summary: Any) -> "SetFacts":
        """Without the pipeline: sets with the same overrides and input fields share a bucket, and
        each image costs its pixels x steps where the record gives them (1 where it does not)."""
        keys: dict[str, int] = {}
        bucket, cost = [], []
        for entry in summary.sets:
            key = call_key(entry.overrides, sorted(entry.with_inputs), adapters=choice_key(entry.adapters))
            bucket.append(keys.setdefault(key, len(keys)))
            o = entry.overrides
            cost.append(float((o.get("height") or 1) * (o.get("width") or 1) * (o.get("num_inference_steps") or 1)))
        return cls(bucket, cost, list(keys))


def call_key(call_args: CallArgs, input_fields: Sequence[str],
             input_sizes: Optional[dict[str, list[tuple[int, int]]]] = None, adapters: str = "") -> str:
    """What must be equal for images to share one pipeline call (``DiffusionModule.predict_step``
    groups a batch by the same key); ``adapters``: the set of adapters chosen (``choice_key``)."""
    key = json.dumps(call_args, sort_keys=True, default=str) + adapters
    if input_fields:
        key += json.dumps(sorted(input_fields))
        if input_sizes is not None:
            key += json.dumps(input_sizes)
    return key


@dataclass
class BatchPlan:
    """Batches of image indices, each with its bucket and estimated cost, held flat: batch ``b``
    is ``order[starts[b]:starts[b + 1]]`` (a million images in 8 MB, not an array a batch)."""

    order: np.ndarray  # image indices, batch after batch
    starts: np.ndarray  # where each batch begins in ``order``, and its end last
    buckets: np.ndarray
    costs: np.ndarray
    batch_size: int
    pad: bool = True

    def __len__(self) -> int:
        return len(self.starts) - 1

    def batch(self, b: int) -> np.ndarray:
        return self.order[self.starts[b]:self.starts[b + 1]]

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def num_buckets(self) -> int:
        return len(np.unique(self.buckets))

    @property
    def images(self) -> int:
        return len(self.order)

    @property
    def padded(self) -> int:
        """Images a padded run computes and drops (each bucket's short last batch)."""
        return int((self.batch_size - self.sizes).sum()) if self.pad else 0

    def deal(self, replicas: int) -> list[np.ndarray]:
        """Batch positions for each replica: longest first, each to the replica with the least
        estimated work so far (ties: the lower rank). A pure function of the plan and ``replicas``."""
        if replicas == 1:
            return [np.argsort(-self.costs, kind="stable")]  # equal costs: the earlier batch first
        if len(self) and (self.costs == self.costs[0]).all():  # one cost: the deal is in turn, without a heap
            return [np.arange(rank, len(self), replicas, dtype=np.int64) for rank in range(replicas)]
        order = np.argsort(-self.costs, kind="stable")
        loads = [(0.0, rank) for rank in range(replicas)]
        dealt: list[list[int]] = [[] for _ in range(replicas)]
        for position, cost in zip(order.tolist(), self.costs[order].tolist()):
            load, rank = heapq.heappop(loads)
            dealt[rank].append(position)
            heapq.heappush(loads, (load + cost, rank))
        return [np.asarray(positions, dtype=np.int64) for positions in dealt]

    def shares(self, replicas: int) -> list[float]:
        """Each replica's estimated share of the work (1.0 for each when perfectly even)."""
        total = float(self.costs.sum()) or 1.0
        return [replicas * float(self.costs[positions].sum()) / total for positions in self.deal(replicas)]

    def describe(self, replicas: int) -> str:
        padded = self.padded
        share = f" ({100 * padded / (self.images + padded):.1f}% of those computed)" if self.images else ""
        line = (f"batch plan: {counted(self.images, 'image')} in {counted(len(self), 'batch', 'batches')} of "
                f"{self.batch_size} from {counted(self.num_buckets, 'bucket')}, {padded:,} padded{share}")
        if replicas > 1:
            line += "; estimated work per replica: " + ", ".join(f"{s:.2f}" for s in self.shares(replicas))
        return line


def index_array(indices: ArrayLike) -> np.ndarray:
    """``indices`` as an integer array: an index array as it is (int32 where a run keeps them so), a
    list or an empty one as int64."""
    found = np.asarray(indices)
    return found if found.dtype.kind in "iu" else found.astype(np.int64)


def plan_batches(indices: np.ndarray, bucket_of_image: np.ndarray, cost_of_image: np.ndarray, batch_size: int,
                 bucket: bool = True, pad: bool = True) -> BatchPlan:
    """The batches of ``indices`` (sorted image indices; ``bucket_of_image`` and ``cost_of_image``
    give each one's bucket and cost): within each bucket in index order with ``bucket`` (buckets
    in the order of their first image), else consecutive images whatever their buckets."""
    indices = index_array(indices)
    buckets = np.asarray(bucket_of_image)
    costs = np.asarray(cost_of_image, dtype=np.float64)
    if bucket and len(indices) and buckets.min() != buckets.max():
        kinds, first, group_of_image = np.unique(buckets, return_index=True, return_inverse=True)
        rank = np.empty(len(kinds), dtype=np.int64)
        rank[np.argsort(first)] = np.arange(len(kinds))  # groups in the order of their first image
        group_of_image = rank[group_of_image.ravel()]
        order = np.argsort(group_of_image, kind="stable")  # index order inside each group
        group_sizes = np.bincount(group_of_image, minlength=len(kinds))
    else:
        order = None  # index order: no permutation to hold
        group_sizes = np.asarray([len(indices)] if len(indices) else [], dtype=np.int64)
    group_starts = np.cumsum(group_sizes) - group_sizes
    per_group = -(-group_sizes // batch_size)  # batches a group makes
    group_of_batch = np.repeat(np.arange(len(group_sizes)), per_group)
    within = np.arange(len(group_of_batch)) - np.repeat(np.cumsum(per_group) - per_group, per_group)
    starts = group_starts[group_of_batch] + within * batch_size
    ends = np.minimum(starts + batch_size, (group_starts + group_sizes)[group_of_batch])
    sizes = ends - starts
    ordered_costs = costs if order is None else costs[order]
    if not len(starts):
        mean = np.zeros(0)
    elif costs.strides == (0,):  # one cost for every image (image_facts' single kind)
        mean = np.full(len(starts), float(costs[0]))
    else:
        mean = np.add.reduceat(ordered_costs, starts) / sizes
    first_images = starts if order is None else order[starts]
    batch_buckets = (buckets[first_images].astype(np.int64) if bucket and len(starts)
                     else np.full(len(starts), -1, dtype=np.int64))
    return BatchPlan(indices if order is None else indices[order], np.append(starts, len(indices)).astype(np.int64),
                     batch_buckets, mean * (batch_size if pad else sizes), batch_size, pad)


def image_facts(facts: SetFacts, set_of: np.ndarray, indices: np.ndarray, num_images_per_prompt: int,
                bucket_of_position: Optional[dict[int, int]] = None) -> tuple[np.ndarray, np.ndarray]:
    """Each image's bucket and cost, from its record's set (``set_of``: record position -> set, as
    ``RecordSummary.set_array`` gives it)."""
    if len(facts.bucket) == 1 and not bucket_of_position:  # one kind of image: the same for all, held once
        return (np.broadcast_to(np.int32(facts.bucket[0]), (len(indices),)),
                np.broadcast_to(np.float64(facts.cost[0]), (len(indices),)))
    sets = np.asarray(set_of, dtype=np.uint32)
    positions = indices // num_images_per_prompt if num_images_per_prompt > 1 else indices
    image_sets = sets[positions]
    if len(image_sets) and int(image_sets.max()) >= len(facts.bucket):  # lines rejected while read (BAD_SET)
        image_sets = np.where(image_sets < len(facts.bucket), image_sets, 0)  # planned as any other: never made
    buckets = np.asarray(facts.bucket, dtype=np.int32)[image_sets]
    costs = np.asarray(facts.cost, dtype=np.float64)[image_sets]
    del image_sets
    if bucket_of_position:
        for n, position in enumerate(positions.tolist()):
            if position in bucket_of_position:
                buckets[n] = bucket_of_position[position]
    return buckets, costs
