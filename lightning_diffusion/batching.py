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
from typing import Any, Optional, Sequence

import numpy as np


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
        keys, bucket, cost = {}, [], []
        for entry in summary.sets:
            key = call_key(entry.overrides, sorted(entry.with_inputs))
            bucket.append(keys.setdefault(key, len(keys)))
            o = entry.overrides
            cost.append(float((o.get("height") or 1) * (o.get("width") or 1) * (o.get("num_inference_steps") or 1)))
        return cls(bucket, cost, list(keys))


def call_key(call_args: dict[str, Any], input_fields: Sequence[str], input_sizes: Any = None) -> str:
    """What must be equal for images to share one pipeline call (``DiffusionModule.predict_step``
    groups a batch by the same key)."""
    key = json.dumps(call_args, sort_keys=True, default=str)
    if input_fields:
        key += json.dumps(sorted(input_fields))
        if input_sizes is not None:
            key += json.dumps(input_sizes)
    return key


@dataclass
class BatchPlan:
    """Batches of image indices, each with its bucket and estimated cost."""

    batches: list[np.ndarray]
    buckets: np.ndarray
    costs: np.ndarray
    batch_size: int
    pad: bool = True

    @property
    def num_buckets(self) -> int:
        return len(set(self.buckets.tolist()))

    @property
    def images(self) -> int:
        return sum(len(b) for b in self.batches)

    @property
    def padded(self) -> int:
        """Images a padded run computes and drops (each bucket's short last batch)."""
        return sum(self.batch_size - len(b) for b in self.batches) if self.pad else 0

    def deal(self, replicas: int) -> list[list[int]]:
        """Batch positions for each replica: longest first, each to the replica with the least
        estimated work so far (ties: the lower rank). A pure function of the plan and ``replicas``."""
        if replicas == 1:
            return [sorted(range(len(self.batches)), key=lambda b: -self.costs[b])]
        order = sorted(range(len(self.batches)), key=lambda b: (-self.costs[b], b))
        loads = [(0.0, rank) for rank in range(replicas)]
        dealt: list[list[int]] = [[] for _ in range(replicas)]
        for position in order:
            load, rank = heapq.heappop(loads)
            dealt[rank].append(position)
            heapq.heappush(loads, (load + float(self.costs[position]), rank))
        return dealt

    def shares(self, replicas: int) -> list[float]:
        """Each replica's estimated share of the work (1.0 for each when perfectly even)."""
        dealt = self.deal(replicas)
        total = float(self.costs.sum()) or 1.0
        return [replicas * float(self.costs[positions].sum()) / total if positions else 0.0 for positions in dealt]

    def describe(self, replicas: int) -> str:
        padded = self.padded
        share = f" ({100 * padded / (self.images + padded):.1f}% of those computed)" if self.images else ""
        line = (f"batch plan: {self.images:,} images in {len(self.batches):,} batches of {self.batch_size} from "
                f"{self.num_buckets} bucket{'s' if self.num_buckets != 1 else ''}, {padded:,} padded{share}")
        if replicas > 1:
            line += "; estimated work per replica: " + ", ".join(f"{s:.2f}" for s in self.shares(replicas))
        return line


def plan_batches(indices: np.ndarray, bucket_of_image: np.ndarray, cost_of_image: np.ndarray, batch_size: int,
                 bucket: bool = True, pad: bool = True) -> BatchPlan:
    """The batches of ``indices`` (sorted image indices; ``bucket_of_image`` and ``cost_of_image``
    give each one's bucket and cost): within each bucket in index order with ``bucket``, else
    consecutive images whatever their buckets."""
    indices = np.asarray(indices, dtype=np.int64)
    buckets = np.asarray(bucket_of_image, dtype=np.int64)
    costs = np.asarray(cost_of_image, dtype=np.float64)
    batches, batch_buckets, batch_costs = [], [], []
    if bucket and len(indices):
        order = np.argsort(buckets, kind="stable")  # by bucket, index order inside each
        edges = np.flatnonzero(np.diff(buckets[order])) + 1
        groups = np.split(order, edges)
        groups.sort(key=lambda g: indices[g[0]])  # buckets in the order of their first image
    else:
        groups = [np.arange(len(indices))]
    for group in groups:
        for start in range(0, len(group), batch_size):
            chosen = group[start:start + batch_size]
            batches.append(indices[chosen])
            batch_buckets.append(int(buckets[chosen[0]]) if bucket else -1)
            size = batch_size if pad else len(chosen)
            batch_costs.append(float(costs[chosen].mean()) * size)
    return BatchPlan(batches, np.asarray(batch_buckets, dtype=np.int64), np.asarray(batch_costs), batch_size, pad)


def image_facts(facts: SetFacts, set_of: Any, indices: np.ndarray, num_images_per_prompt: int,
                bucket_of_position: Optional[dict[int, int]] = None) -> tuple[np.ndarray, np.ndarray]:
    """Each image's bucket and cost, from its record's set (``set_of``: record position -> set)."""
    sets = np.frombuffer(set_of, dtype=np.uint32).astype(np.int64) if len(set_of) else np.zeros(0, np.int64)
    positions = indices // num_images_per_prompt
    image_sets = sets[positions]
    buckets = np.asarray(facts.bucket, dtype=np.int64)[image_sets]
    costs = np.asarray(facts.cost, dtype=np.float64)[image_sets]
    if bucket_of_position:
        for n, position in enumerate(positions.tolist()):
            if position in bucket_of_position:
                buckets[n] = bucket_of_position[position]
    return buckets, costs
