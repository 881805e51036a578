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
import json
import os
import re
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_diffusion.background import WriterProcess, WriterThreads
from lightning_diffusion.console import log
from lightning_diffusion.errors import ConfigError, PeerLost, WritingFailed, raise_problems
from lightning_diffusion.files import (
    FILES_PER_FOLDER,
    PNG_COMPRESS_LEVEL,
    SAMPLES_PER_SHARD,
    OutputFiles,
    resolve_layout,
    size_text,
    stale_temporaries,
    to_uint8,
)
from lightning_diffusion.lock import OutputLock, busy_message
from lightning_diffusion.manifest import (
    FAILED,
    MANIFEST,
    PART_GLOB,
    PROMPTS_HASH,
    REJECTED,
    RUN_FILE,
    RUN_META,
    atomic_write,
    finished,
    in_shard,
    merge_failures,
    merge_lock,
    merge_manifest,
    part_counts,
    part_name,
    parts_glob,
    prompts_hash,
    repair_manifest,
    settings_conflict,
    shard_name,
    shard_size,
)
from lightning_diffusion.validation import writer_problems


def storage_settings(layout: str, files_per_folder: int, format: str, expected: Optional[int]) -> dict[str, Any]:
    """Where outputs go, as run.json records it (the defaults, loose files in one folder, record
    nothing: a folder made before these keys resumes): a resume with another layout or format is
    refused like other settings."""
    settings: dict[str, Any] = {}
    if format != "files":
        settings["writer.format"] = format
    elif resolve_layout(layout, expected, files_per_folder) == "sharded":
        settings.update({"writer.layout": "sharded", "writer.files_per_folder": files_per_folder})
    return settings


def run_settings(image_settings: dict[str, Any], seed: Any, num_images_per_prompt: Any, prompts: Any,
                 video_format: str = "mp4", fps: int = 16, image_format: str = "png",
                 quality: int = 90, storage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """run.json's settings: the model's (``module.image_settings``), the seeds, the prompt set (its
    content hash compared, its path recorded), a non-default video encoding and the storage
    (``storage_settings``)."""
    settings = {**image_settings, **(storage or {})}
    if seed is not None:
        settings["data.seed"] = seed
    if num_images_per_prompt is not None:
        settings["data.num_images_per_prompt"] = num_images_per_prompt
    if isinstance(prompts, (str, Path)):
        settings["data.prompts"] = str(Path(prompts).expanduser().resolve())
    if prompts is not None:
        settings[PROMPTS_HASH] = prompts_hash(prompts)
    if video_format != "mp4" or fps != 16:
        settings.update({"writer.video_format": video_format, "writer.fps": fps})
    if image_format != "png":  # lossy files differ from the PNGs of the same pictures
        settings.update({"writer.image_format": image_format, "writer.quality": quality})
    return json.loads(json.dumps(settings, default=str))


def summary_text(summary: dict[str, Any], manifest: Path) -> str:
    """The run's summary as one line for the log."""
    rates = summary["images_per_s_by_rank"]
    pace = ", ".join(f"rank {rank}: {rate:.2f}" for rank, rate in rates.items()) or "none"
    expected = f" of {summary['expected']:,}" if summary.get("expected") is not None else ""
    if summary.get("shard"):
        expected += f" (shard {summary['shard'][0]} of {summary['shard'][1]})"
    left = "".join(f", {summary[key]:,} {key} ({name})" for key, name in (("rejected", REJECTED), ("failed", FAILED))
                   if summary.get(key))
    if summary.get("padded"):
        left += f", {summary['padded']:,} padded images computed"
    return (f"made {summary['made']:,} outputs, {summary['skipped']:,} skipped by resume{left}; "
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


def _gather_idle(strategy: Any, obj: Any) -> list[Any]:
    """``obj`` of every rank by global rank: with our strategies on their idle group (no collective
    timeout); with another strategy on the default group (its timeout applies)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    objects: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(objects, obj, group=getattr(strategy, "idle_group", None))
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


class ImageWriter(BasePredictionWriter):
    """Writes each predicted image once, as PNG with metadata, and records it in the manifest.

    The files are written by ``files_class`` (``OutputFiles``; a subclass may encode otherwise:
    it is sent to the writer process, so it must live in an importable module).

    Args:
        output_dir: folder for images and ``manifest.jsonl``; created if missing. A rerun into the
            same folder resumes: images already in the manifest are skipped.
        save_arrays: also save the decoded float image as ``NNNNNN.npy`` (for numerical checks).
        video_format: how videos are written: ``mp4`` (H.264, needs PyAV), ``webp`` or ``gif``.
        fps: frames per second of written videos.
        allow_config_change: resume into a folder whose images were made with other settings
            (model, size, steps, guidance, seeds...); refused by default, so that one folder never
            mixes two configs silently.
        image_format: ``png`` (lossless), ``webp`` or ``jpeg`` (lossy, ``quality`` 1-100); the
            parameters go in PNG text chunks, or the EXIF ImageDescription (JSON) of WebP and JPEG.
        png_compress_level: zlib level of PNG files, 0-9 (default 1: fast, slightly larger).
        fsync: ``batch`` (default: every file synced before its rename, the manifest after each
            batch), ``file`` (the manifest also after each image) or ``off`` (nothing synced: a
            power cut may lose the last seconds of files and lines, which a resume redoes).
        write_workers: threads that encode and write off the prediction thread (0: on it).
        write_queue: batches that may wait for a writer before prediction blocks.
        write_in: where the ``write_workers`` threads run: ``process`` (default: a writer process
            of this rank, so that writing never holds the rank's GIL) or ``thread`` (in the rank).
        layout: ``flat`` (every file in the folder), ``sharded`` (``00012/000120000-slug.png``:
            subfolder ``index // files_per_folder``) or ``auto`` (default: flat when the run's
            images fit in one folder of ``files_per_folder``, else sharded).
        files_per_folder: files per subfolder of the sharded layout (default 10,000).
        format: ``files`` (default: one file an output) or ``webdataset`` (tar shards of
            ``samples_per_shard`` samples, ``{key}.png`` and ``{key}.json`` each, as WebDataset
            and img2dataset write them).

    Only one run may write into a folder at a time (``.lock``, taken over when its run is dead),
    or one run a shard for the shards of one count (``PromptDataModule(num_shards=...)``).
    """

    files_class: type[OutputFiles] = OutputFiles

    def __init__(
        self,
        output_dir: str = "outputs",
        save_arrays: bool = False,
        video_format: str = "mp4",
        fps: int = 16,
        allow_config_change: bool = False,
        image_format: str = "png",
        quality: int = 90,
        png_compress_level: int = PNG_COMPRESS_LEVEL,
        fsync: str = "batch",
        write_workers: int = 2,
        write_queue: int = 2,
        write_in: str = "process",
        layout: str = "auto",
        files_per_folder: int = FILES_PER_FOLDER,
        format: str = "files",
        samples_per_shard: int = SAMPLES_PER_SHARD,
    ) -> None:
        super().__init__(write_interval="batch")
        raise_problems(writer_problems(dict(output_dir=output_dir, video_format=video_format, fps=fps,
                                            image_format=image_format, quality=quality,
                                            png_compress_level=png_compress_level, fsync=fsync,
                                            write_workers=write_workers, write_queue=write_queue, write_in=write_in,
                                            layout=layout, files_per_folder=files_per_folder, format=format,
                                            samples_per_shard=samples_per_shard)))
        self.layout = layout
        self.files_per_folder = files_per_folder
        self.format = format
        self.samples_per_shard = samples_per_shard
        self._files: Optional[OutputFiles] = None
        self.total: Optional[int] = None
        self._batches = 0  # this rank's batches handed to its writers: the order of tar shard members
        if write_workers and write_in == "process" and self.files_class.__module__ == "__main__":
            raise ConfigError(f"{type(self).__name__}.files_class {self.files_class.__name__} is defined in the "
                              "script being run, so the writer process cannot import it: move it into a module, "
                              "or set writer.write_in: thread.")
        self.image_format = image_format
        self.quality = quality
        self.png_compress_level = png_compress_level
        self.fsync = fsync
        self.write_workers = write_workers
        self.write_queue = write_queue
        self.write_in = write_in
        self._writers: Optional[WriterProcess | WriterThreads] = None
        path = Path(output_dir).expanduser()
        self.output_dir = path
        self.save_arrays = save_arrays
        self.video_format = video_format
        self.fps = fps
        self.allow_config_change = allow_config_change
        self.done = np.zeros(0, dtype=np.int64)  # this run's images already in the manifest (sorted)
        self.expected: Optional[int] = None
        self.pending: Optional[int] = None
        self.rejected = 0  # images of records data.on_bad_record: skip left out (global rank 0)
        self.summary: Optional[dict[str, Any]] = None
        # Told the final count on global rank 0 once the manifest is merged (``ImageProgressBar``).
        self.progress_listener: Optional[Any] = None
        self._history: list = []
        self.shard: Optional[tuple[int, int]] = None  # (index, count) when the run makes one shard
        self._part: Optional[Path] = None
        self._lock: Optional[OutputLock] = None

    @property
    def parts_glob(self) -> str:
        """This run's manifest parts (of its shard, if it makes one)."""
        return parts_glob(self.shard)

    @staticmethod
    def writes_outputs(trainer: pl.Trainer) -> bool:
        # Ranks of one model-parallel group hold the same images: the strategy names one to write.
        return bool(getattr(trainer.strategy, "writes_outputs", True))

    def run_settings(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """What decides the pictures of this folder: model, call arguments, seeds, prompts."""
        describe = getattr(pl_module, "image_settings", None)
        data = getattr(trainer, "datamodule", None)
        return run_settings(describe() if callable(describe) else {}, getattr(data, "seed", None),
                            getattr(data, "num_images_per_prompt", None), getattr(data, "prompts", None),
                            self.video_format, self.fps, self.image_format, self.quality,
                            storage_settings(self.layout, self.files_per_folder, self.format, self.total))

    @property
    def record_file(self) -> Path:
        """Where this run's history goes: ``run.json``, or its shard's ``run.shard-T-of-N.json``."""
        name = shard_name(self.shard)
        return self.output_dir / (RUN_FILE if name is None else f"run.{name}.json")

    def _refuse(self, message: str) -> tuple[Optional[str], list[int]]:
        assert self._lock is not None
        self._lock.release()
        return message, []

    def _prepare_folder(self, settings: dict[str, Any], total: Optional[int]) -> tuple[Optional[str], Any]:
        """On global rank 0: lock, compare settings, merge parts. Returns (error, done indices)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._lock = OutputLock(self.output_dir, self.shard)
        holder = self._lock.acquire()
        busy = busy_message(self.output_dir, self.shard, holder)
        if holder is not None:
            return busy, []  # the lock is the other run's
        if busy is not None:
            return self._refuse(busy)
        # parts left unmerged: an earlier run was killed, and its images' folders may hold temporaries
        stale = stale_temporaries(self.output_dir, self.shard, deep=any(self.output_dir.glob(PART_GLOB)))
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            log.info("%s: removed %d half-written temporary file%s of an earlier run that was stopped.",
                     self.output_dir, len(stale), "" if len(stale) == 1 else "s")
        run_file = self.output_dir / RUN_FILE
        if run_file.is_file():
            conflict = None if self.allow_config_change else settings_conflict(self.output_dir, settings)
            if conflict:
                return self._refuse(conflict)
        try:
            self._history = list(json.loads(self.record_file.read_text()).get("history") or [])
        except (OSError, ValueError):
            self._history = []
        if self.shard is None:
            self._write_run_file(settings)
        else:  # shards share run.json (the same settings), made by the first; each keeps its history beside it
            with merge_lock(self.output_dir):
                conflict = None if self.allow_config_change else settings_conflict(self.output_dir, settings)
                if conflict:  # another shard made it meanwhile, with other settings
                    return self._refuse(conflict)
                if not run_file.is_file():
                    self._write_run_file(settings, run_file, total, history=[])
            self._write_run_file({"shard": list(self.shard)})
        if any(self.output_dir.glob(PART_GLOB)):
            merge_manifest(self.output_dir, self.shard)
        found = finished(self.output_dir)
        dropped = repair_manifest(self.output_dir, found)
        if dropped:
            shown = "; ".join(found.problems[:3]) + (f"; {len(found.problems) - 3} more" if found.problems[3:] else "")
            log.info("%s: %d line%s that did not count left the manifest (%s); their images are made again.",
                     self.output_dir / MANIFEST, dropped, "" if dropped == 1 else "s", shown)
        done = found.in_shard(self.shard)
        with_inputs = {i: line for i, line in found.with_inputs.items() if in_shard(i, self.shard)}
        if not self.allow_config_change and with_inputs:
            from lightning_diffusion.inputs import changed_since

            changed = changed_since(with_inputs)
            if changed:
                return self._refuse(f"{self.output_dir} holds pictures made from input files that changed: "
                                    + "; ".join(changed) + ". Restore them, use another writer.output_dir, or "
                                    "writer.allow_config_change=true to keep those pictures anyway.")
        return None, done

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
        seen = [entry for entry in _gather_idle(trainer.strategy, (node, sees)) if entry[1] is not None]
        if trainer.is_global_zero:
            (self.output_dir / token).unlink(missing_ok=True)
        blind = sorted({name for name, saw in seen if not saw})
        if blind:
            if self._lock is not None and trainer.is_global_zero:
                self._lock.release()
            raise ConfigError(f"writer.output_dir {self.output_dir} is not one folder shared by the nodes: "
                              f"{', '.join(blind)} {'does' if len(blind) == 1 else 'do'} not see what {seen[0][0]} "
                              "writes there (node-local storage?). Put it on a file system every node mounts.")

    def _write_run_file(self, settings: dict[str, Any], path: Optional[Path] = None, expected: Optional[int] = None,
                        history: Optional[list] = None) -> None:
        """run.json (or the shard's record): the settings that decide the pictures, the expected
        count, the runs' summaries."""
        content = {**settings, "expected": self.expected if expected is None else expected,
                   "history": self._history if history is None else history}
        atomic_write(path or self.record_file, lambda f: f.write(json.dumps(content, indent=2).encode("utf-8")))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.started_at = time.time()
        self.predicting_at: Optional[float] = None
        data = getattr(trainer, "datamodule", None)
        total = getattr(data, "num_images", None)
        self.total = total  # the prompt set's images (every shard's): layout auto decides by it
        self.shard = getattr(data, "shard", None)
        self.expected = None if total is None else shard_size(total, self.shard)
        result: tuple[Optional[str], list[int]] = (None, [])
        if trainer.is_global_zero:
            result = self._prepare_folder(self.run_settings(trainer, pl_module), total)
        # Every rank learns rank 0's verdict and raises the same error: nobody waits for a peer.
        error, done = trainer.strategy.broadcast(result)
        if error:
            raise ConfigError(error)
        if trainer.num_nodes > 1:
            self._check_shared(trainer)
        self.done = np.asarray(done, dtype=np.int64)
        self.pending = None if self.expected is None else max(0, self.expected - len(self.done))
        if len(self.done):
            todo = f", {self.pending:,} to make" if self.pending is not None else ""
            log.info(f"resumed: {len(self.done):,} already in the manifest of {self.output_dir}{todo}.")
        skip = getattr(getattr(trainer, "datamodule", None), "skip_indices", None)
        if callable(skip):
            skip(self.done)
        self._part = self.output_dir / part_name(self.shard, trainer.global_rank)
        if self.write_workers and self.writes_outputs(trainer):
            kind = WriterProcess if self.write_in == "process" else WriterThreads
            self._writers = kind(self.files, self.write_workers, self.write_queue,
                                 f"rank {trainer.global_rank}'s image writers")

    @property
    def files(self) -> OutputFiles:
        """What writes this run's files and appends their lines to this rank's manifest part (one
        for the run: a tar shard stays open between batches)."""
        if self._files is None or self._files.part != self._part:
            self._files = self.files_class(
                self.output_dir, self.image_format, self.quality, self.png_compress_level, self.fsync, self.save_arrays,
                self.video_format, self.fps, self._part, resolve_layout(self.layout, self.total, self.files_per_folder),
                self.files_per_folder, self.format, self.samples_per_shard)
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
                raise writing_failed(f"{type(err).__name__}: {err}", self.output_dir, cause=err) from err

    def drain_on_stall(self) -> None:
        """From the stall watch's thread, while the prediction thread waits in a collective that will
        not end: write the images already queued, then the rank ends (``StallWatch``)."""
        self._drain(wait=True)

    def _raise_error(self, writers: Optional[WriterProcess | WriterThreads]) -> None:
        error = writers.take_error() if writers is not None else None
        if error is not None:
            raise writing_failed(str(error), self.output_dir, cause=error) from error

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: list[dict[str, Any]],
        batch_indices: Optional[Sequence[int]],
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not self.writes_outputs(trainer):
            return
        if self.format == "webdataset":  # a shard's members in the order of the batches, whatever writes them
            prediction = [{**item, "batch": self._batches} for item in prediction]
            self._batches += 1
        if self._writers is None:
            self.files.write_batch(prediction)
            return
        self._raise_error(self._writers)
        if not self.save_arrays:  # videos are queued as 8-bit frames, a quarter of their float memory; images
            # as the pipeline's floats (converted by the writer: no time of the prediction thread)
            prediction = [{**item, "image": to_uint8(item["image"])} if "image" in item and item["image"].ndim == 4
                          else item for item in prediction]
        self._writers.put(prediction)  # blocks while the queue is full: memory stays bounded

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.predicting_at = time.time()
        if self.pending is not None:  # the records data.on_bad_record: skip leaves out are not to make
            self.pending = max(0, self.pending - self._rejected_images(trainer))

    @staticmethod
    def _rejected_images(trainer: pl.Trainer) -> int:
        """This run's images of rejected records (known once the module checked the records)."""
        data: Any = getattr(trainer, "datamodule", None)
        return len(data.rejected_images()) if getattr(data, "rejected", None) else 0

    def _write_rejected(self, data: Any) -> None:
        """``rejected.jsonl``: the prompt set's records that cannot be made, with file:line and reason
        (written anew by each run: the verdicts of the prompt file as it is now)."""
        copies = data.num_images_per_prompt
        lines = [{"record": position + 1, "line": source, "reason": reason,
                  "images": [position * copies + c for c in range(copies)]}
                 for position, (source, reason) in sorted(data.rejected.rejected.items())]
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        atomic_write(self.output_dir / REJECTED, lambda f: f.write(text.encode("utf-8")))

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
        work = getattr(pl_module, "stats", None) if self.writes_outputs(trainer) else None
        try:
            gathered = _gather_idle(trainer.strategy, (_cause(failed), work))
        except PeerLost:
            if self._lock is not None and trainer.is_global_zero:
                self._lock.release()  # this run is over; the next one merges what its ranks recorded
            raise
        others = [(rank, text) for rank, (text, _) in enumerate(gathered)
                  if text is not None and rank != trainer.global_rank]
        self._work = {rank: stats for rank, (_, stats) in enumerate(gathered) if stats is not None}
        if failed is None and others:
            rank, text = others[0]
            failed = writing_failed(text, self.output_dir, rank)
        if failed is not None:
            if self._lock is not None and trainer.is_global_zero:
                self._lock.release()
            raise failed
        if trainer.is_global_zero:
            self._plan = getattr(getattr(trainer, "datamodule", None), "plan", None)
            self.rejected = self._rejected_images(trainer)
            if self.rejected or (self.output_dir / REJECTED).exists():
                self._write_rejected(getattr(trainer, "datamodule", None))
            parts = part_counts(self.output_dir, self.parts_glob)
            merged = merge_manifest(self.output_dir, self.shard)
            new = merged if self.shard is None else merged[merged % self.shard[1] == self.shard[0]]
            done = np.union1d(self.done, new)
            failures = merge_failures(self.output_dir, self.shard, done)
            total = len(done)
            self.summary = self._summary(parts, total, failures)
            self._history.append(self.summary)
            settings = json.loads(self.record_file.read_text())
            self._write_run_file({k: v for k, v in settings.items() if k not in RUN_META})
            if self.progress_listener is not None:
                self.progress_listener.finish(self.summary["made"], self.pending)
            log.info(summary_text(self.summary, self.output_dir / MANIFEST))
            context = getattr(trainer.strategy, "run_context", None)
            if context is not None:  # for the run's last line ("stopped after 8 of 40 images")
                context.stop.totals = (total, self.expected)
            if self._lock is not None:
                self._lock.release()

    def _summary(self, parts: dict[int, int], total: int, failed: int = 0) -> dict[str, Any]:
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

    def _batch_summary(self) -> dict[str, Any]:
        """The batch plan's buckets and what the writing ranks computed: images computed for the
        images kept (padding), and each one's seconds in pipeline calls."""
        work = getattr(self, "_work", {})
        if not work:
            return {}
        computed = sum(w["computed"] for w in work.values())
        kept = sum(w["kept"] for w in work.values())
        plan = getattr(self, "_plan", None)
        return {"buckets": plan.num_buckets if plan is not None else None, "computed": computed,
                "padded": computed - kept, "busy_s_by_rank": {str(r): round(w["busy_s"], 3) for r, w in work.items()}}

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:  # the queued images are whole pictures: write them, so that a resume need not redo them,
            # except after Ctrl-C, which promises to stop after the images in flight
            self._drain(wait=not isinstance(exception, KeyboardInterrupt))
        except RuntimeError:
            pass  # the run already fails with the exception that brought it here
        if self._lock is not None:
            self._lock.release()
