"""``ImageWriter``: image files with metadata and a ``manifest.jsonl`` that makes a run resumable.

Layout of the output folder::

    000000-a-red-fox.png      image 0, prompt and parameters in PNG text chunks (or EXIF: WebP, JPEG);
                              00000/000000-a-red-fox.png in the sharded layout, a member of
                              shard-000000000.tar with writer.format: webdataset
    manifest.jsonl            one JSON object per finished image, appended run by run (sorted within a merge)
    rejected.jsonl            records data.on_bad_record: skip left out; failed.jsonl: failed calls
    manifest.part-R.jsonl     lines appended by global rank R while a run is going
                              (manifest.shard-T-of-N.part-R.jsonl for shard T of N of a job array)
    run.json                  the settings that decide the pictures, the runs' summaries
                              (a shard's summaries: run.shard-T-of-N.json)

Every file appears by an atomic rename, and an image's manifest line is appended only after its file
is complete, so a killed run leaves no truncated image and at most one unterminated manifest line,
which is ignored. The manifest is the single source of truth: a rerun skips the indices it lists
(whose files exist) before the work is split over replicas, and redoes everything else.

Encoding and writing run off the prediction thread (``background``): each batch goes to a bounded
queue drained by a writer process of the rank (or by threads), so the device does not wait for the
CPU after every batch; a full queue blocks the prediction step, so at most
``write_queue + write_workers + 1`` batches of decoded images are held. The run's end drains the
queue before the manifest parts are merged. The files themselves are ``files.OutputFiles``' work.
"""

from __future__ import annotations

import builtins
import os
import re
import shutil
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, cast

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_diffusion.core.console import counted, log
from lightning_diffusion.core.errors import ConfigError, PeerLost, WritingFailed, raise_problems
from lightning_diffusion.core.groups import called_with, documented_by
from lightning_diffusion.core.records import AuditSummary, ImageResult, RunSettings, RunSummary
from lightning_diffusion.output import audit as audit_
from lightning_diffusion.output.background import WriterProcess, WriterThreads
from lightning_diffusion.output.boundaries import (
    ImageSource,
    PoolSource,
    PromptSource,
    RunPlan,
    ShardSource,
    SideOutputSource,
    WorkStats,
    require,
    run_strategy,
)
from lightning_diffusion.output.files import OutputFiles, size_text, to_uint8
from lightning_diffusion.output.manifest import FAILED, REJECTED
from lightning_diffusion.output.metrics import LiveMetrics, port_problem
from lightning_diffusion.output.pool import batching_conflict, quit_join
from lightning_diffusion.output.settings import (
    SHARD_FORMATS,
    WriterSettings,
    resolve_layout,
    run_settings,
)
from lightning_diffusion.output.shard import adopt, plan_file
from lightning_diffusion.output.store import OutputStore, open_store, store_class, writer_problems


def summary_text(summary: RunSummary, manifest: str) -> str:
    """The run's summary as one line for the log."""
    rates = summary["images_per_s_by_rank"]
    pace = ", ".join(f"rank {rank}: {rate:.2f}" for rank, rate in rates.items()) or "none"
    expected = f" of {summary['expected']:,}" if summary.get("expected") is not None else ""
    if summary.get("shard"):
        expected += f" (shard {summary['shard'][0]} of {summary['shard'][1]})"
    left = "".join(f", {summary.get(key):,} {key} ({name})"
                   for key, name in (("rejected", REJECTED), ("failed", FAILED)) if summary.get(key))
    if summary.get("padded"):
        left += f", {counted(summary['padded'], 'padded image')} computed"
    return (f"made {counted(summary['made'], 'output')}, {summary['skipped']:,} skipped by resume{left}; "
            f"{summary['in_manifest']:,}{expected} in {manifest}; wall {summary['wall_s']:.1f} s, "
            f"load {summary['load_s']:.1f} s; "
            f"images/s per writing rank: {pace}")


# A write that found the file system full: ENOSPC, a quota, or the short write a full disk makes.
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (28|122)\]|\d+ requested and \d+ written")


def _bug_details(cause: Optional[BaseException]) -> str:
    """The traceback of a writer's failure that was not the file system's (an OSError says all in
    its message; anything else is a bug, and its traceback is what a report needs)."""
    if cause is None:
        return ""
    kind = getattr(cause, "kind", type(cause).__name__)  # background.WriteFailed names the writer's error
    error_type = getattr(builtins, kind, None)
    if isinstance(error_type, type) and issubclass(error_type, OSError):
        return ""
    details = getattr(cause, "details", "")
    return details or "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))


def writing_failed(error: str, folder: Path, rank: Optional[int] = None,
                   cause: Optional[BaseException] = None) -> WritingFailed:
    """The one-line failure of a write (``error``: what the writer raised, ``cause`` the exception
    where this rank has it), on ``rank`` when it is another rank's; a full file system is said in
    words, with the folder and its free space."""
    where = "" if rank is None else f" on rank {rank}"
    if _NO_SPACE.search(error):
        try:
            free = f" ({size_text(shutil.disk_usage(folder).free)} free)"
        except OSError:
            free = ""
        return WritingFailed(f"writing images failed{where}: no space left on the file system of {folder}{free}; the "
                             "images recorded are kept: free some space and run the same command to resume.")
    return WritingFailed(f"writing images failed{where}: {error} (the images recorded are kept: a rerun makes the "
                         "rest)",
                         _bug_details(cause))


def _cause(failed: Optional[BaseException]) -> Optional[str]:
    """What a writer's failure says, without the ``writing images failed:`` that ``_raise_error`` adds."""
    if failed is None:
        return None
    return str(failed.__cause__ or failed)


def gather_idle(strategy: Any, obj: Any) -> list[Any]:
    """``obj`` of every rank by global rank: with our strategies on their idle group (no collective
    timeout); with another strategy on the default group (its timeout applies)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    objects: list[Any] = [None] * dist.get_world_size()
    try:
        ours = run_strategy(strategy)
        dist.all_gather_object(objects, obj, group=ours.idle_group if ours is not None else None)
    except RuntimeError as err:  # gloo: "Connection closed by peer"; NCCL: a DistBackendError
        if not _PEER_GONE.search(str(err)):
            raise
        raise PeerLost(f"rank {dist.get_rank()}: another process of this run ended before the end of the run "
                       "(its connection was lost); the images recorded are kept, and the same command resumes."
                       ) from err
    return objects


# How a collective says that a peer's connection is gone (gloo: "Connection closed by peer",
# "Connection reset by peer"; NCCL: an aborted communicator).
_PEER_GONE = re.compile(r"closed|reset by peer|broken pipe|remote worker|NCCL communicator was aborted", re.I)


@documented_by(WriterSettings)
class ImageWriter(BasePredictionWriter):
    """Writes each predicted image once, as PNG with metadata, and records it in the manifest.

    The files are written by ``files_class`` (``OutputFiles``; a subclass may encode otherwise:
    it is sent to the writer process, so it must live in an importable module); the folder's
    bookkeeping (lock, run.json, the manifest parts and their merge) is a ``folder_store.FolderStore``.
    The writer reads its data module as a ``boundaries.PromptSource`` (``PromptDataModule``) and its
    module as a ``boundaries.ImageSource`` (``DiffusionModule``), checked when the run starts.

    Args: the options of ``WriterSettings``.

    The defaults are the writer group's declaration (``settings.WriterSettings``). Only one run may write
    into a folder at a time (``.lock``, taken over when its run is dead), or one run a shard for the
    shards of one count (``PromptDataModule(num_shards=...)``).
    """

    files_class: type[OutputFiles] = OutputFiles

    def __init__(
        self,
        output_dir: str = WriterSettings.output_dir,
        save_arrays: bool = WriterSettings.save_arrays,
        save_latents: bool = WriterSettings.save_latents,
        save_text_embeddings: bool = WriterSettings.save_text_embeddings,
        video_format: str = WriterSettings.video_format,
        fps: int = WriterSettings.fps,
        allow_config_change: bool = WriterSettings.allow_config_change,
        image_format: str = WriterSettings.image_format,
        quality: int = WriterSettings.quality,
        png_compress_level: int = WriterSettings.png_compress_level,
        fsync: str = WriterSettings.fsync,
        write_workers: int = WriterSettings.write_workers,
        write_queue: int = WriterSettings.write_queue,
        write_in: str = WriterSettings.write_in,
        layout: str = WriterSettings.layout,
        files_per_folder: int = WriterSettings.files_per_folder,
        format: str = WriterSettings.format,
        samples_per_shard: int = WriterSettings.samples_per_shard,
        staging_dir: Optional[str] = WriterSettings.staging_dir,
        storage_options: Optional[dict[str, Any]] = WriterSettings.storage_options,
        audit: Optional[dict[str, Any]] = WriterSettings.audit,
        metrics_port: int = WriterSettings.metrics_port,
        metrics_file: Optional[str] = WriterSettings.metrics_file,
    ) -> None:
        settings: WriterSettings = called_with(WriterSettings, locals())  # each option once, in its settings
        super().__init__(write_interval="batch")
        self.settings = settings
        raise_problems(writer_problems(self.settings))
        if write_workers and write_in == "process" and self.files_class.__module__ == "__main__":
            raise ConfigError(f"{type(self).__name__}.files_class {self.files_class.__name__} is defined in the "
                              "script being run, so the writer process cannot import it: move it into a module, "
                              "or set writer.write_in: thread.")
        # A folder; for a store the nodes reach on their own (a bucket), where its files are built.
        shared = store_class(output_dir).needs_shared_folder
        self.output_dir = Path(output_dir).expanduser() if shared else Path(staging_dir or ".")
        # Set by setup, for one run:
        self.plan: Optional[RunPlan] = None  # the data module's, handed over at setup
        self.store: Optional[OutputStore] = None
        self.total: Optional[int] = None  # the prompt set's images (every shard's): layout auto decides by it
        self.shard: Optional[tuple[int, int]] = None  # (index, count) when the run makes one shard
        self.expected: Optional[int] = None  # this run's images
        self.done = np.zeros(0, dtype=np.int64)  # this run's images already in the manifest (sorted)
        self.pending: Optional[int] = None  # images left to make
        self.started_at = time.time()
        self.predicting_at: Optional[float] = None
        self._part: Optional[Path] = None
        self._rank = 0
        self._files: Optional[OutputFiles] = None
        self._writers: Optional[WriterProcess | WriterThreads] = None
        self._batches = 0  # this rank's batches handed to its writers: the order of tar shard members
        self._pool: Optional[PoolSource] = None  # the data module, where its workers pull from a pool
        self._drains: Optional[list[Callable[[], None]]] = None  # the run context's, while set up
        self.audit_settings = audit_.settings_of(audit)
        self._auditor: Optional[audit_.Auditor] = None  # this rank's, while set up (writer.audit)
        self._metrics: Optional[LiveMetrics] = None  # global rank 0's, while set up (writer.metrics_*)
        self._batch_started: Optional[float] = None
        # Known at the run's end:
        self.rejected = 0  # images of records data.on_bad_record: skip left out (global rank 0)
        self.summary: Optional[RunSummary] = None
        self._work: dict[int, WorkStats] = {}  # what each writing rank computed
        self._buckets: Optional[int] = None  # the batch plan's buckets
        # Told the final count on global rank 0 once the manifest is merged (``ImageProgressBar``).
        self.progress_listener: Optional[Any] = None

    @property
    def parts_glob(self) -> str:
        """This run's manifest parts (of its shard, if it makes one)."""
        return self.store.parts_glob if self.store is not None else ""

    @property
    def audit_glob(self) -> Optional[str]:
        """This run's audit parts (``writer.audit``), in ``parts_folder``; None without an audit."""
        if self.audit_settings is None or self.store is None:
            return None
        return self.store.parts_glob.replace("manifest", "audit", 1)

    @property
    def parts_folder(self) -> Path:
        """The folder this process writes its files and manifest part into (the output folder, or
        its staging folder for a bucket; a full disk is said with its free space)."""
        return self.store.local_dir if self.store is not None else self.output_dir

    @staticmethod
    def writes_outputs(trainer: pl.Trainer) -> bool:
        # Ranks of one model-parallel group hold the same images: the strategy names one to write.
        strategy = run_strategy(trainer.strategy)
        return strategy is None or bool(strategy.writes_outputs)

    def run_settings(self, pl_module: ImageSource) -> RunSettings:
        """What decides the pictures of this folder: model, call arguments, seeds, prompts."""
        return run_settings(pl_module.image_settings(), self.plan, self.settings)

    def _check_shared(self, trainer: pl.Trainer) -> None:
        """Every node sees the output folder rank 0 prepared (one file system, not node-local
        storage, where each node would write a folder of its own and a resume would find half):
        rank 0 leaves a file there, the first process of each node looks for it, all learn the
        verdict. Under any launcher (SLURM's script checks it too, before the job starts)."""
        import socket

        token = f".nodes-check-{os.urandom(6).hex()}" if trainer.is_global_zero else None
        if token is not None:
            (self.output_dir / token).write_bytes(b"")
        token = trainer.strategy.broadcast(token)
        assert token is not None  # rank 0's, on every rank
        sees = (self.output_dir / token).exists() if trainer.local_rank == 0 else None
        node = f"node {trainer.node_rank} ({socket.gethostname()})"
        seen = [entry for entry in gather_idle(trainer.strategy, (node, sees)) if entry[1] is not None]
        if trainer.is_global_zero:
            (self.output_dir / token).unlink(missing_ok=True)
        blind = sorted({name for name, saw in seen if not saw})
        if blind:
            if trainer.is_global_zero:
                self._release()
            raise ConfigError(f"writer.output_dir {self.output_dir} is not one folder shared by the nodes: "
                              f"{', '.join(blind)} {'does' if len(blind) == 1 else 'do'} not see what {seen[0][0]} "
                              "writes there (node-local storage?). Put it on a file system every node mounts.")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning sets trainer.datamodule only for a run given a data module
        data: PromptSource = require(getattr(trainer, "datamodule", None), PromptSource, "a data module (datamodule=)")
        module: ImageSource = require(pl_module, ImageSource, "a LightningModule")
        if self.settings.save_latents or self.settings.save_text_embeddings:  # refused before the weights load
            require(pl_module, SideOutputSource, "a LightningModule that captures latents and text embeddings"
                    ).save_side_outputs(self.settings.save_latents, self.settings.save_text_embeddings)
        self.started_at, self.predicting_at = time.time(), None
        strategy = run_strategy(trainer.strategy)
        self._drains = strategy.run_context.drains if strategy is not None else None
        if self._drains is not None:  # a rank stalled in a collective writes what it queued before it ends
            self._drains.append(self.drain_on_stall)
        self.plan = data.run_plan()
        self.total, self.shard, self.expected = self.plan.num_images, self.plan.shard, self.plan.expected
        # a job of a pool (data.schedule: pull) has a name of its own, the same on its ranks
        job = trainer.strategy.broadcast(os.urandom(4).hex()) if self.plan.pull else None
        given = self.settings
        self.store = open_store(given.output_dir, self.plan.shard, allow_config_change=given.allow_config_change,
                                options=given.storage_options, staging_dir=given.staging_dir, pool=job,
                                lease_s=self.plan.lease_s)
        result: tuple[Optional[str], Any, bool, Optional[tuple[str, str]]] = (None, [], False, None)
        problem = port_problem(given.metrics_port) if given.metrics_port and trainer.is_global_zero else None
        if problem:  # refused before the folder is taken
            result = (problem, [], False, None)
        elif trainer.is_global_zero:
            result = (*self.store.prepare(self.run_settings(module), self.expected, self.total), self.store.adopted,
                      self.store.lock_token)
            if job is not None and result[0] is None:  # a pool's batches: refused before the weights load
                conflict = batching_conflict(self.store.pool_files(), self.plan.batch_size, self.plan.bucket)
                if conflict:
                    result = (quit_join(self.store, conflict), [], False, None)
        # Every rank learns rank 0's verdict and raises the same error: nobody waits for a peer.
        error, done, adopted, self.store.lock_token = trainer.strategy.broadcast(result)
        if error:
            raise ConfigError(error)
        if adopted:  # rank 0 took the folder's recorded shard plan: so does every rank, and its data module
            shard = self.store.shard
            assert shard is not None
            if not trainer.is_global_zero:
                recorded = self.store.shard_plan(shard.num_shards)
                shard, problem = adopt(shard, recorded, self.total, f"{self.store.where}/{plan_file(shard.num_shards)}")
                if recorded is None or problem:
                    raise ConfigError(problem or f"{self.store.where}: rank {trainer.global_rank} does not see the "
                                      "shard plan rank 0 recorded there.")
            require(data, ShardSource, "a data module that makes one shard of a job array").use_shard(shard)
            self.plan = data.run_plan()
            self.shard = self.plan.shard
        self.expected = self.plan.expected
        if job is not None:
            self._pool = require(data, PoolSource, "a data module that pulls batches (data.schedule: pull)")
            self._pool.use_pool(self.store.pool_files(), job, self.store.worker)
        if trainer.num_nodes > 1 and self.store.needs_shared_folder:
            self._check_shared(trainer)
        self.done = np.asarray(done, dtype=np.int64)
        self.pending = max(0, self.expected - len(self.done))
        if len(self.done):
            log.info(f"resumed: {len(self.done):,} already in the manifest of {self.store.where}, "
                     f"{self.pending:,} to make.")
        data.skip_indices(self.done)
        self._rank = trainer.global_rank
        self._part = self.store.part(trainer.global_rank)
        self._auditor = self._start_audit(trainer, pl_module) if self.audit_settings is not None else None
        if self.settings.write_workers and self.writes_outputs(trainer):
            kind = WriterProcess if self.settings.write_in == "process" else WriterThreads
            self._writers = kind(self.files, self.settings.write_workers, self.settings.write_queue,
                                 f"rank {trainer.global_rank}'s image writers")
        if trainer.is_global_zero and (given.metrics_port or given.metrics_file):
            self._start_metrics()

    def _start_metrics(self) -> None:
        try:
            self._metrics = LiveMetrics(self.settings.output_dir, self.settings.metrics_port,
                                        self.settings.metrics_file, queue_depth=self._queue_depth,
                                        options=self.settings.storage_options)
        except (ConfigError, OSError):  # taken since the check (another process): the folder is given back
            self._release()
            raise

    def _queue_depth(self) -> int:
        writers = self._writers
        return writers.jobs.qsize() if writers is not None else 0

    def _finish_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.finish()
            self._metrics = None

    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                               batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_started = time.perf_counter()

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        if self._metrics is not None and self._batch_started is not None:
            self._metrics.observe_batch(time.perf_counter() - self._batch_started)

    @property
    def files(self) -> OutputFiles:
        """What writes this run's files and appends their lines to this rank's manifest part (one
        for the run: a tar shard stays open between batches)."""
        if self._files is None or self._files.part != self._part:
            store, rank = self.store, self._rank
            where = store.local_dir if store is not None else self.output_dir
            # the store's credentials stay in this process: the files need none
            publisher = store.publisher(rank) if store is not None else None
            self._files = self.files_class(
                where, replace(self.settings, storage_options=None), self._part,
                resolve_layout(self.settings.layout, self.total, self.settings.files_per_folder), publisher,
                store.fence(publisher) if store is not None else None)
        return self._files

    # ----------------------------------------------------------------- writing off the prediction thread

    def _drain(self, wait: bool = True) -> None:
        """Write everything queued (``wait``; else only what is being written), stop the writers,
        and raise a writer's error. Safe to call twice, and from an interrupted drain."""
        writers = self._writers
        if writers is not None:
            writers.close(wait)  # interrupted (a second Ctrl-C): kept, on_exception closes it again
            self._writers = None
            self._raise_error(writers)
        elif self._files is not None:  # written on the prediction thread: close its open tar shard
            try:
                self._files.finish()
            except Exception as err:
                raise writing_failed(f"{type(err).__name__}: {err}", self.parts_folder, cause=err) from err

    def drain_on_stall(self) -> None:
        """From the stall watch's thread, while the prediction thread waits in a collective that will
        not end: write the images already queued, then the rank ends (``StallWatch``)."""
        self._drain(wait=True)

    def _raise_error(self, writers: Optional[WriterProcess | WriterThreads]) -> None:
        error = writers.take_error() if writers is not None else None
        if error is not None:
            raise writing_failed(str(error), self.parts_folder, cause=error) from error

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: list[ImageResult],
        batch_indices: Optional[Sequence[int]],
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if self._auditor is not None:  # every rank of a group: they make the sampled images together
            self._audit_batch(trainer, pl_module, batch, prediction)
        if not self.writes_outputs(trainer):
            return
        if self._pool is not None:  # a pool's batch: written under its claim (``fence``), if still held
            claim = self._pool.claim_of(batch_indices)
            if claim is False:  # taken over by another worker meanwhile
                return
            if claim is not None:
                prediction = [{**item, "claim": claim} for item in prediction]
        if self.settings.format in SHARD_FORMATS:  # a shard keeps the batches' order, whoever writes
            prediction = [{**item, "batch": self._batches} for item in prediction]
            self._batches += 1
        if self._writers is None:
            self.files.write_batch(prediction)
            return
        self._raise_error(self._writers)
        if not self.settings.save_arrays:  # videos are queued as 8-bit frames, a quarter of their float memory; images
            # as the pipeline's floats (converted by the writer: no time of the prediction thread)
            prediction = [{**item, "image": to_uint8(item["image"])} if "image" in item and item["image"].ndim == 4
                          else item for item in prediction]
        self._writers.put(prediction)  # blocks while the queue is full: memory stays bounded

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.predicting_at = time.time()
        if self.pending is not None:  # the records data.on_bad_record: skip leaves out are not to make
            self.pending = max(0, self.pending - len(self._data(trainer).rejected_images()))

    @staticmethod
    def _data(trainer: pl.Trainer) -> PromptSource:
        return trainer.datamodule  # type: ignore[attr-defined]  # a PromptSource: setup required it

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Not on_predict_end: a replica with no images skips the predict loop and its end hooks,
        # but every rank reaches teardown (and only after a run that did not raise).
        if stage != "predict":
            return
        try:
            self._drain()  # every queued image written (and its line appended) before the merge
        except RuntimeError as err:
            failed: Optional[RuntimeError] = err
        else:
            failed = None
        # Reached by every rank, failed or not; each learns how the others' writing ended, so that
        # a rank whose writer failed at its drain does not leave the job ending with exit 0 (and,
        # from the writing ranks, what their replica computed, for the summary).
        work = cast(ImageSource, pl_module).stats if self.writes_outputs(trainer) else None  # setup required it
        data = self._data(trainer)
        try:
            gathered = gather_idle(trainer.strategy, (_cause(failed), work))
        except PeerLost:
            self._leave_pool(ended=False)
            if trainer.is_global_zero:
                self._release()  # this run is over; the next one merges what its ranks recorded
            raise
        others = [(rank, text) for rank, (text, _) in enumerate(gathered)
                  if text is not None and rank != trainer.global_rank]
        self._work = {rank: stats for rank, (_, stats) in enumerate(gathered) if stats is not None}
        if failed is None and others:
            rank, text = others[0]
            failed = writing_failed(text, self.parts_folder, rank)
        self._leave_pool(ended=failed is None)  # every rank's images are written: a pool's batches are settled
        if failed is not None:
            if trainer.is_global_zero:
                self._release()
            raise failed
        assert self.store is not None  # made by setup
        if trainer.is_global_zero:
            self._buckets = data.plan.num_buckets if data.plan is not None else None
            self.rejected = len(data.rejected_images())
            try:
                self.store.write_rejected(data.rejected_lines(), bool(self.rejected))
                parts, done, failures = self.store.merge(self.done)
            except OSError as err:  # a bucket that went away at the end: what is recorded stays
                self._release()
                raise writing_failed(f"{type(err).__name__}: {err}", self.parts_folder, cause=err) from err
            self.summary = self._summary(parts, len(done), failures)
            if self._auditor is not None:
                self.summary["audit"] = self._finish_audit()
            self.store.record(self.summary)
            if self.progress_listener is not None:
                self.progress_listener.finish(self.summary["made"], self.pending)
            log.info(summary_text(self.summary, self._manifest_where))
            strategy = run_strategy(trainer.strategy)
            if strategy is not None:  # for the run's last line ("stopped after 8 of 40 images")
                strategy.run_context.stop.totals = (len(done), self.expected)
        self._release()

    # ----------------------------------------------------------------- the shadow audit (writer.audit)

    def _start_audit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> audit_.Auditor:
        """This rank's auditor; what the audit compares said once, before the weights load."""
        if not isinstance(pl_module, audit_.PlainRemaker):
            raise ConfigError(f"writer.audit needs a module that re-makes images without its accelerators "
                              f"(accelerators, remake_plain: DiffusionModule); got {type(pl_module).__name__}.")
        settings = self.audit_settings
        assert settings is not None and self._part is not None
        accelerators = pl_module.accelerators()  # every rank: it refuses what it cannot turn off
        if trainer.is_global_zero:
            log.info(f"audit: {100 * settings.fraction:g}% of the images ({audit_.AUDIT_FILE}), "
                     f"{accelerators.describe()}; bound {settings.min_psnr:g} dB, on drift: "
                     f"{settings.on_drift}")
        folder = self.store.local_dir if self.store is not None else None
        auditor = audit_.Auditor(settings, audit_.part_name(self._part), self.writes_outputs(trainer), folder)
        if settings.clip_model is not None and auditor.writes:  # loaded now: a folder that is no CLIP model fails here
            from lightning_diffusion.output.clip import ClipScorer

            auditor.clip = ClipScorer(settings.clip_model, "writer.audit.clip_model")
        return auditor

    def _audit_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                     prediction: list[ImageResult]) -> None:
        auditor = self._auditor
        assert auditor is not None
        module = cast(audit_.PlainRemaker, pl_module)
        self._on_drift(trainer, auditor.after_batch(module, batch, prediction, module.batch_size or len(batch)))

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The sampled images still waiting for a full call; not after a stop (a signal, Ctrl-C, a
        # drift): its time is the grace the scheduler gives to finish the batch in flight and merge.
        strategy = run_strategy(trainer.strategy)
        stopped = strategy is not None and strategy.run_context.stop.stopping.is_set()
        if self._auditor is not None and not stopped:
            self._on_drift(trainer, self._auditor.flush(cast(audit_.PlainRemaker, pl_module)))

    def _on_drift(self, trainer: pl.Trainer, drift: Optional[str]) -> None:
        auditor = self._auditor
        if drift is None or auditor is None:
            return
        stop = auditor.settings.on_drift == "stop"
        if auditor.writes:
            log.warning(f"[rank {trainer.global_rank}] {drift}" + ("; stopping (writer.audit.on_drift: stop)."
                                                                     if stop else "."), extra={"all_ranks": True})
        strategy = run_strategy(trainer.strategy)
        if stop and strategy is not None:
            strategy.run_context.stop.drift()

    def _finish_audit(self) -> AuditSummary:
        """On global rank 0 after the manifest merge: the ranks' audit parts added to audit.jsonl,
        and this run's audit summarised (logged, and recorded in run.json)."""
        assert self.store is not None and self.audit_settings is not None
        folder = self.store.local_dir
        parts = sorted(folder.glob(self.audit_glob or ""))
        lines = audit_.merge(folder, parts)
        busy = sum(w["busy_s"] for w in self._work.values())
        # the batch size: what ``lightning-diffusion audit`` re-makes images at after the fact
        batch = {"batch_size": self.plan.batch_size} if self.plan is not None else {}
        summary = cast(AuditSummary, {**audit_.summary(lines, busy), **asdict(self.audit_settings), **batch})
        log.info(audit_.summary_text(summary))
        return summary

    def _leave_pool(self, ended: bool) -> None:
        """Stop this worker's renewals in the pool, saying whether its batches are settled."""
        if self._pool is not None:
            self._pool.leave_pool(ended)
            self._pool = None

    @property
    def _manifest_where(self) -> str:
        """Where the run's manifest is, as the summary names it."""
        assert self.store is not None
        return self.store.manifest_where

    def _release(self) -> None:
        """The folder's lock given back (this process's staging folder removed); the stall watch no
        longer drains this writer; then the live metrics' last counts written (no run holding the
        output any more) and their port closed."""
        if self._drains is not None and self.drain_on_stall in self._drains:
            self._drains.remove(self.drain_on_stall)
        try:
            if self.store is not None:
                self.store.release()
        finally:
            self._finish_metrics()

    def _summary(self, parts: dict[int, int], total: int, failed: int = 0) -> RunSummary:
        end = time.time()
        start = self.predicting_at or end
        seconds = max(end - start, 1e-9)
        return {
            "finished": round(end, 3),
            "made": sum(parts.values()),
            "skipped": len(self.done),
            "rejected": self.rejected,
            "failed": failed,
            **self._batch_summary(),
            "in_manifest": total,
            "expected": self.expected,
            "wall_s": round(end - self.started_at, 3),
            "load_s": round(start - self.started_at, 3),
            "images_per_s_by_rank": {str(rank): round(count / seconds, 4) for rank, count in sorted(parts.items())},
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            **({"shard": list(self.shard)} if self.shard is not None else {}),
        }

    def _batch_summary(self) -> RunSummary:
        """The batch plan's buckets and what the writing ranks computed: images computed for the
        images kept (padding), and each one's seconds in pipeline calls."""
        if not self._work:
            return {}
        computed = sum(w["computed"] for w in self._work.values())
        kept = sum(w["kept"] for w in self._work.values())
        return {"buckets": self._buckets, "computed": computed, "padded": computed - kept,
                "busy_s_by_rank": {str(r): round(w["busy_s"], 3) for r, w in self._work.items()}}

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:  # the queued images are whole pictures: write them, so that a resume need not redo them,
            # except after Ctrl-C, which promises to stop after the images in flight
            self._drain(wait=not isinstance(exception, KeyboardInterrupt))
        except RuntimeError:
            pass  # the run already fails with the exception that brought it here
        self._leave_pool(ended=False)  # its batches are taken over at once (their images recorded are kept)
        self._release()
