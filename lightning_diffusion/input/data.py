"""Prompt records -> (index, seed) samples -> batches (``batching``) over the data-parallel dimension.

Every output image has a global index and its own seed:

* a prompt set of ``N`` records with ``num_images_per_prompt = K`` has images ``0 .. N*K-1``;
  image ``i`` belongs to record ``i // K`` and is that record's copy ``i % K``;
* its seed is ``record["seed"] + i % K`` when the record gives a seed, else ``seed + i`` where
  ``seed`` is the data module's global seed.

Noise is then drawn from a CPU ``torch.Generator`` seeded with that number, one per image, so image
``i`` does not depend on the batch size, the number of processes or the strategy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from lightning_diffusion.core.console import counted, log
from lightning_diffusion.core.errors import ConfigError, raise_problems
from lightning_diffusion.core.groups import called_with, documented_by, read_from_settings
from lightning_diffusion.core.records import Record, RejectedLine, Sample
from lightning_diffusion.input.batching import BatchPlan, SetFacts, image_facts, index_array, plan_batches
from lightning_diffusion.input.formats import read_records
from lightning_diffusion.input.images import record_inputs
from lightning_diffusion.input.pull import PullSampler, claim_of
from lightning_diffusion.input.records import Records, RecordVerdicts, call_overrides, summarize_records  # noqa: F401
from lightning_diffusion.input.settings import DataSettings, data_problems
from lightning_diffusion.output.boundaries import RunPlan, run_strategy
from lightning_diffusion.output.fence import Claim
from lightning_diffusion.output.pool import Pool, PoolFiles, plan_conflict, plan_digest
from lightning_diffusion.output.shard import Shard, deal_shards, select, shard_members


def image_seed(record: Record, index: int, copy: int, global_seed: int) -> int:
    """The documented seed of image ``index`` (copy ``copy`` of ``record``)."""
    if record.get("seed") is not None:
        return int(record["seed"]) + copy
    return global_seed + index


class PromptDataset(Dataset):
    """Samples ``{"index", "prompt", "seed", "negative_prompt", "overrides"}``, one per output image,
    ``inputs`` (``{"image": path, ...}``) for records with input files, and ``columns`` (the
    record's ``data.keep_columns``, ``{name: value}``) when columns are kept.

    ``indices`` restricts the dataset to those global image indices (resume skips finished ones).
    """

    def __init__(
        self,
        records: Sequence[Record],
        seed: int = 0,
        num_images_per_prompt: int = 1,
        indices: Optional[Union[Sequence[int], np.ndarray]] = None,
    ) -> None:
        self.records = records
        self.seed = seed
        self.num_images_per_prompt = num_images_per_prompt
        self.total = len(records) * num_images_per_prompt
        self.indices = np.arange(self.total, dtype=np.int64) if indices is None else index_array(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> Sample:
        index = int(self.indices[position])
        if isinstance(self.records, Records):
            record, kept = self.records.read(index // self.num_images_per_prompt)
        else:
            record, kept = self.records[index // self.num_images_per_prompt], None
        copy = index % self.num_images_per_prompt
        sample: Sample = {
            "index": index,
            "prompt": record["prompt"],
            "seed": image_seed(record, index, copy, self.seed),
            "negative_prompt": record.get("negative_prompt"),
            "overrides": call_overrides(record),
            "source": self.records.source(index // self.num_images_per_prompt)
            if isinstance(self.records, Records) else f"prompt record {index // self.num_images_per_prompt + 1}",
        }
        if inputs := record_inputs(record):
            sample["inputs"] = inputs
        if record.get("adapters") is not None:  # model.adapters: the set this record chose
            sample["adapters"] = record["adapters"]
        if kept is not None:
            sample["columns"] = kept
        return sample


class BatchDataset(Dataset):
    """The batches of a ``BatchPlan``: item ``b`` is batch ``b``'s samples (``PromptDataset``'s)."""

    def __init__(self, samples: PromptDataset, plan: BatchPlan) -> None:
        self.samples = samples  # its indices are sorted: a batch's images are found by bisection
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, batch: Any) -> list[Sample]:
        if isinstance(batch, tuple):  # a pool's claim (``pull.PullSampler``): the batch's images left to make
            batch, _, recorded = batch
            images = self.plan.batch(batch)
            positions = np.minimum(np.searchsorted(self.samples.indices, images), max(len(self.samples) - 1, 0))
            left = (self.samples.indices[positions] == images) & ~np.isin(images, recorded)
            return [self.samples[int(position)] for position in positions[left]]
        positions = np.searchsorted(self.samples.indices, self.plan.batch(batch))
        return [self.samples[int(position)] for position in positions]


class PlanSampler(DistributedSampler):
    """This replica's batches of a ``BatchPlan`` (``BatchPlan.deal``): no duplicate, no drop, and a
    replica with nothing to do gets none (Lightning's own predict sampler asserts instead). A
    stopped job (``stopping``: the run's ``StopController.stopping``) ends the loader instead of
    skipping every batch."""

    def __init__(self, dataset: BatchDataset, num_replicas: int = 1, rank: int = 0,
                 stopping: Optional[threading.Event] = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.stopping = stopping if stopping is not None else threading.Event()
        self.positions = dataset.plan.deal(num_replicas)[rank].tolist() if len(dataset) else []
        self.num_samples = len(self.positions)
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        for position in self.positions:
            if self.stopping.is_set():
                return
            yield position

    def __len__(self) -> int:
        return self.num_samples


def collate_batch(items: list[list[Sample]]) -> list[Sample]:
    """The loader's batches of one item: the plan's batch itself."""
    return items[0]


def shard_owners(records: Records, num_images_per_prompt: int, batch_size: int, bucket: bool,
                 num_shards: int) -> np.ndarray:
    """The shard of every image of the set among ``num_shards`` (``shard.deal_shards``): the whole
    set's batch plan from the records alone, dealt by cost."""
    total = len(records) * num_images_per_prompt
    indices = np.arange(total, dtype=np.int32 if total < 2**31 else np.int64)
    buckets, costs = image_facts(SetFacts.from_summary(records.summary), records.summary.set_array(), indices,
                                 num_images_per_prompt)
    return deal_shards(plan_batches(indices, buckets, costs, batch_size, bucket), total, num_shards)


def run_plan(settings: DataSettings, records: Records, shard: Optional[Shard] = None) -> RunPlan:
    """The ``RunPlan`` of the prompt set of the data group's ``settings``, read as ``records``: the
    data module's, and ``preflight``'s before a run."""
    from lightning_diffusion.input.tables import TableRecords

    prompts, copies = settings.prompts, settings.num_images_per_prompt
    one_file = isinstance(prompts, (str, os.PathLike)) and Path(prompts).expanduser().is_file()
    files = tuple(records.files) if isinstance(records, TableRecords) and not one_file else ()
    reading = {"columns": settings.columns, "keep_columns": settings.keep_columns, "split": settings.split}
    shaped = {f"data.{key}": value for key, value in reading.items() if value}
    return RunPlan(prompts, settings.seed, copies, len(records) * copies, shard, files, shaped or None,
                   settings.schedule == "pull", settings.lease_s, settings.batch_size, settings.bucket,
                   records.summary.adapter_sets(live=False))


@documented_by(DataSettings)
@read_from_settings(DataSettings)
class PromptDataModule(pl.LightningDataModule):
    """Prompts for ``Trainer.predict``.

    Args: the options of ``DataSettings``.
    """

    def __init__(
        self,
        prompts: Union[str, list[Any]],
        batch_size: int = DataSettings.batch_size,
        seed: int = DataSettings.seed,
        num_images_per_prompt: int = DataSettings.num_images_per_prompt,
        num_workers: int = DataSettings.num_workers,
        inputs_root: Optional[str] = DataSettings.inputs_root,
        num_shards: int = DataSettings.num_shards,
        shard_index: int = DataSettings.shard_index,
        max_pixels: int = DataSettings.max_pixels,
        max_prompt_chars: int = DataSettings.max_prompt_chars,
        on_bad_record: str = DataSettings.on_bad_record,
        on_error: str = DataSettings.on_error,
        bucket: bool = DataSettings.bucket,
        columns: Optional[dict[str, Optional[str]]] = DataSettings.columns,
        keep_columns: Optional[list[str]] = DataSettings.keep_columns,
        split: Optional[str] = DataSettings.split,
        schedule: str = DataSettings.schedule,
        lease_s: float = DataSettings.lease_s,
    ) -> None:
        settings = called_with(DataSettings, locals())
        super().__init__()
        raise_problems(data_problems(settings))
        self.settings = settings  # every option, read as ``self.settings.batch_size``... (``read_from_settings``)
        self.pool: Optional[Pool] = None  # this worker's, with ``pull`` (on a replica's writing rank)
        self._pool_at: Optional[tuple[Any, str]] = None  # (the pool's files, this job's name): ``use_pool``
        self.pad = True  # the module's pad_batches (padded batches count at their padded size)
        self.facts: Optional[SetFacts] = None  # the module's buckets and costs of each call-argument set
        self.bucket_of_position: Optional[dict[int, int]] = None
        self.plan: Optional[BatchPlan] = None
        self._shard: Optional[Shard] = None  # with its plan (``shard_owners``), made when first asked for
        # Read now so that a bad prompt file fails before any process starts or weights load.
        self.records: Records = read_records(prompts, max_prompt_chars, columns, keep_columns, split)
        problems = data_problems(settings, self.num_images)
        if on_bad_record == "fail":  # with skip, the bad lines are judged with the others by the module
            problems += RecordVerdicts(dict(self.records.bad)).refusal(len(self.records), on_bad_record)
        raise_problems(problems)
        self.skip = np.zeros(0, dtype=np.int64)
        self.rejected = RecordVerdicts()
        # More replicas than images is fine: the idle ones wait.
        self.allow_zero_length_dataloader_with_multiple_devices = True

    @property
    def num_images(self) -> int:
        return len(self.records) * self.settings.num_images_per_prompt

    @property
    def call_size(self) -> int:
        """The images of one padded pipeline call: ``batch_size``, or the whole set's images where
        it has fewer (one prompt computes one image, not a batch of padding). A function of the set
        alone, never of the replicas, the shards or a pool, so an image is the same under any layout."""
        return max(1, min(self.settings.batch_size, self.num_images))

    @property
    def shard(self) -> Optional[Shard]:
        """The shard of the prompt set this run makes (``data.num_shards`` > 1), else None."""
        if self.settings.num_shards <= 1:
            return None
        if self._shard is None:
            settings = self.settings
            owners = shard_owners(self.records, settings.num_images_per_prompt, settings.batch_size, settings.bucket,
                                  settings.num_shards)
            self._shard = Shard(settings.shard_index, settings.num_shards).with_owners(owners)
        return self._shard

    def use_shard(self, shard: Shard) -> None:
        """Make ``shard``'s images as its plan deals them (the output location's recorded plan, which
        the writer adopted at setup: ``boundaries.ShardSource``)."""
        ours = (self.settings.shard_index, self.settings.num_shards)
        if (shard.shard_index, shard.num_shards) != ours:
            raise ValueError(f"shard {tuple(shard)} is not this data module's {ours}")
        self._shard = shard

    def shard_images(self) -> np.ndarray:
        """The indices this run is for: every image, or its shard's."""
        return shard_members(self.num_images, self.shard)

    def run_plan(self) -> RunPlan:
        """What the writer records of this prompt set (``boundaries.RunPlan``)."""
        return run_plan(self.settings, self.records, self.shard)

    def use_pool(self, files: PoolFiles, job: str, worker: Optional[Pool] = None) -> None:
        """Pull batches from the pool in ``files`` as job ``job`` (``data.schedule: pull``);
        ``worker``: this rank's registration, made when the job joined (global rank 0)."""
        self._pool_at = (files, job)
        self.pool = worker

    def claim_of(self, batch_indices: Any) -> Union[Claim, None, Literal[False]]:
        """The claim this worker holds the batch of ``batch_indices`` under (``pull.claim_of``)."""
        return claim_of(self.pool, batch_indices)

    def leave_pool(self, ended: bool) -> None:
        """Stop this worker's renewals and record how it ended (``pool.Pool.leave``)."""
        if self.pool is not None:
            self.pool.leave(ended)
            self.pool = None
        self._pool_at = None

    def skip_indices(self, indices: Any) -> None:
        """Leave out images that are already done (called by the writer on resume, before the split)."""
        self.skip = np.asarray(sorted(indices) if isinstance(indices, set) else indices, dtype=np.int64)

    def reject(self, verdicts: RecordVerdicts) -> None:
        """Leave out the records that cannot be made (``data.on_bad_record: skip``)."""
        self.rejected = verdicts

    def rejected_images(self) -> np.ndarray:
        """The image indices of rejected records that belong to this run (its shard's)."""
        return select(self.rejected.image_indices(self.settings.num_images_per_prompt), self.shard)

    def rejected_lines(self) -> list[RejectedLine]:
        """``rejected.jsonl``'s lines: each rejected record (1-based), its file:line, reason and images."""
        copies = self.settings.num_images_per_prompt
        return [{"record": position + 1, "line": source, "reason": reason,
                 "images": [position * copies + c for c in range(copies)]}
                for position, (source, reason) in sorted(self.rejected.rejected.items())]

    def use_batch_facts(self, facts: SetFacts, bucket_of_position: Optional[dict[int, int]] = None,
                        pad: bool = True) -> None:
        """The pipeline's view of the records (``costs.set_facts``): which sets share a
        call, and what an image of each costs."""
        self.facts, self.bucket_of_position, self.pad = facts, bucket_of_position, pad

    def samples(self, pending: np.ndarray) -> PromptDataset:
        """The ``pending`` images' samples, each seeded as the run seeds it."""
        return PromptDataset(self.records, self.settings.seed, self.settings.num_images_per_prompt, pending)

    def batch_plan(self, pending: np.ndarray) -> BatchPlan:
        """The batches of the ``pending`` images (``batching.plan_batches``)."""
        facts = self.facts or SetFacts.from_summary(self.records.summary)
        buckets, costs = image_facts(facts, self.records.summary.set_array(), pending,
                                     self.settings.num_images_per_prompt, self.bucket_of_position)
        return plan_batches(pending, buckets, costs, self.call_size, self.settings.bucket, self.pad)

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        """A batch is prompts, seeds and paths, no tensor: nothing to move (Lightning would walk
        every sample's fields, about 0.1 ms an image on a CPU)."""
        return batch

    def pending_images(self) -> np.ndarray:
        """The images this run makes, in index order: its shard's, less those already made and the
        rejected records'. 4 bytes an image where the set has fewer than 2**31."""
        dtype = np.int32 if self.num_images < 2**31 else np.int64
        shard = self.shard
        if shard is None and not len(self.skip) and not self.rejected:
            return np.arange(self.num_images, dtype=dtype)
        # the shard's images (1 byte an image), without an array of their indices
        if shard is None:
            todo = np.ones(self.num_images, dtype=bool)
        elif shard.owners is not None:
            todo = np.asarray(shard.owners == shard.shard_index)
        else:
            todo = np.zeros(self.num_images, dtype=bool)
            todo[shard.members(self.num_images)] = True
        if len(self.skip):
            todo[self.skip] = False
        if self.rejected:
            todo[self.rejected_images()] = False
        return np.flatnonzero(todo).astype(dtype, copy=False)

    def predict_dataloader(self) -> DataLoader:
        pending = self.pending_images()
        if self.settings.schedule == "pull":
            return self._pool_loader(pending)
        self.plan = self.batch_plan(pending)
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        kwargs = kwargs or {"num_replicas": 1, "rank": 0}
        if len(pending) and (self.trainer is None or self.trainer.is_global_zero):
            log.info(self.plan.describe(kwargs["num_replicas"]) + self._adapter_sets())
        dataset = BatchDataset(self.samples(pending), self.plan)
        strategy = run_strategy(self.trainer.strategy) if self.trainer is not None else None
        sampler = PlanSampler(dataset, num_replicas=kwargs["num_replicas"], rank=kwargs["rank"],
                              stopping=strategy.run_context.stop.stopping if strategy is not None else None)
        # One plan batch a loader batch: Lightning keeps its index tracking for batch size 1.
        return DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=self.settings.num_workers,
                          collate_fn=collate_batch)

    def _adapter_sets(self) -> str:
        """``; 6 adapter sets`` where records choose adapters (``model.adapters``): batches never mix them."""
        sets = self.records.summary.adapter_sets() if isinstance(self.records, Records) else 0
        return f"; {counted(sets, 'adapter set')} (a batch has one)" if sets else ""

    def _pool_loader(self, pending: np.ndarray) -> DataLoader:
        """The loader of a pool's worker: the whole set's batch plan (the same in every job), its
        batches claimed one at a time (``pull.PullSampler``)."""
        if self._pool_at is None:
            raise ConfigError("data.schedule: pull needs the ImageWriter callback: the pool is kept in its "
                              "writer.output_dir.")
        files, job = self._pool_at
        self.plan = self.batch_plan(np.arange(self.num_images, dtype=pending.dtype))
        digest = plan_digest(self.plan.order, self.plan.starts, self.settings.batch_size)
        trainer = self.trainer
        strategy = run_strategy(trainer.strategy) if trainer is not None else None
        head = trainer is None or trainer.is_global_zero
        problem = plan_conflict(files, digest, self.plan) if head else None
        if trainer is not None:
            problem = trainer.strategy.broadcast(problem)  # every rank refuses, none waits
        if problem:
            raise ConfigError(problem)
        if head and len(pending):
            log.info(self.plan.describe(1) + self._adapter_sets() + f"; pulled from the pool in {files.where} "
                     "(costliest first, lease "
                     f"{self.settings.lease_s:g} s)")
        kwargs = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {"rank": 0}
        if strategy is None or strategy.writes_outputs:
            if self.pool is None:  # (replica 0's writing rank registered when the job joined)
                self.pool = Pool(files, job, kwargs["rank"], self.settings.lease_s)
            self.pool.register(digest, {"batches": len(self.plan), "images": self.plan.images,
                                        "batch_size": self.settings.batch_size, "bucket": self.settings.bucket})
        dataset = BatchDataset(self.samples(pending), self.plan)
        stop = strategy.run_context.stop if strategy is not None else None
        sampler = PullSampler(dataset, self.pool, share=strategy.replica_share() if strategy is not None else None,
                              stopping=stop.stopping if stop is not None else None,
                              requested=stop.requested if stop is not None else None)
        return DataLoader(dataset, batch_size=1, sampler=sampler, num_workers=self.settings.num_workers,
                          collate_fn=collate_batch)
