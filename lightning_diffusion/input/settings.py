"""The data group's options (``PromptDataModule``'s arguments), each declared once: the defaults
here are the ones ``PromptDataModule``'s signature, ``data_problems`` (the rules below), ``preflight``
and SLURM's rendering use.

Kept free of torch and Lightning: the CLI's checks import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lightning_diffusion.core.checks import (
    LEASE_S,
    MAX_BATCH_SIZE,
    MAX_PIXELS,
    MAX_SHARDS,
    MIN_LEASE_S,
    SEED_MAX,
    integer,
    one_of,
)
from lightning_diffusion.core.errors import ConfigError, is_int
from lightning_diffusion.core.groups import group_options
from lightning_diffusion.core.records import RECORD_FIELDS
from lightning_diffusion.pipelines.checks import CALL_ARGS

# The most characters of a prompt or negative prompt (``data.max_prompt_chars``), counted before
# tokenizing: far past what any text encoder reads (CLIP 77 tokens, T5 512, Qwen-Image 1,024), and
# small enough that a runaway line (megabytes) costs one record, not the tokenizer's memory.
MAX_PROMPT_CHARS = 20_000
ON_BAD_RECORD = ("fail", "skip")
ON_ERROR = ("fail", "skip")
SCHEDULES = ("deal", "pull")


@dataclass(frozen=True)
class DataSettings:
    """``PromptDataModule``'s options (the ``data`` group). Values are as given:
    ``data_problems`` says what is wrong with them.

    Options:
        prompts: a ``.txt`` (one prompt a line), ``.jsonl`` (field ``prompt``; optional ``seed``,
            ``negative_prompt``, input files and the call arguments a record may set, such as
            ``guidance_scale``), ``.csv`` (a ``prompt`` column) or ``.parquet`` path (a row a
            record, the fields of a ``.jsonl`` line as columns), a folder of Parquet files or a glob
            of them (``prompts/*.parquet``), a folder written by ``datasets``' ``save_to_disk``,
            ``hf://datasets/NAME`` (read from the local Hugging Face cache), or an inline list.
        columns: record field -> the source's column (``{prompt: caption, seed: id}``); a field
            mapped to null is not read.
        keep_columns: columns carried into each image's metadata (not read as record fields).
        split: the split of a dataset (``hf://datasets/NAME``: default ``train``; a ``save_to_disk``
            folder of several splits).
        batch_size: images per pipeline call on each data-parallel replica (a set of fewer images
            is computed at its own size: ``call_size``).
        seed: global seed; image ``i`` of a record without a seed uses ``seed + i``.
        num_images_per_prompt: images made from each record.
        num_workers: DataLoader workers (prompts are tiny; 0 is usually right).
        inputs_root: records' input files must lie under this folder, links and ``..`` resolved.
        num_shards: split the prompt set into this many shards (the tasks of a SLURM job array,
            each its own shard, writing into one output folder); 1: the whole set.
        shard_index: make only this shard of ``num_shards``: the shards are dealt the whole
            set's batches by cost, as replicas are (``shard``), recorded in the output folder.
        max_pixels: the most pixels of one image or video frame a record (or the config) may ask
            for, input images included (checked from their headers, before they are decoded).
        max_prompt_chars: the most characters of a record's prompt or negative prompt; a longer
            one is a bad record (``on_bad_record``).
        on_bad_record: ``fail`` (default): a record that cannot be made (a key it may not set, a
            value out of bounds, a missing input file...) refuses the run before anything loads,
            naming every such record; ``skip``: the others are made, and those are listed in the
            output folder's ``rejected.jsonl`` with their line and reason.
        bucket: ``true`` (default): batches are cut among records that share every call argument
            (``batching``), so a mixed prompt set runs one full call a batch; ``false``: batches of
            consecutive images, each split into one padded call per kind of record in it.
        schedule: ``deal`` (default): batches dealt to the replicas by cost before the run;
            ``pull``: every job writing to this output joins one pool of workers that claim the next
            batch when ready, a dead worker's taken over (docs/config.md).
        lease_s: with ``pull``: seconds without a renewal after which a worker's batches are
            taken over (at once where its process is gone from this host); at least 2.
        on_error: ``fail`` (default): a pipeline call that fails stops the run naming its record;
            ``skip``: its records go to ``failed.jsonl`` and the run goes on (a rerun retries them).
    """

    prompts: Union[str, list[Any]]
    batch_size: int = 1
    seed: int = 0
    num_images_per_prompt: int = 1
    num_workers: int = 0
    inputs_root: Optional[str] = None
    num_shards: int = 1
    shard_index: int = 0
    max_pixels: int = MAX_PIXELS
    max_prompt_chars: int = MAX_PROMPT_CHARS
    on_bad_record: str = "fail"
    on_error: str = "fail"
    bucket: bool = True
    columns: Optional[dict[str, Optional[str]]] = None
    keep_columns: Optional[list[str]] = None
    split: Optional[str] = None
    schedule: str = "deal"
    lease_s: float = LEASE_S

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> DataSettings:
        """The group's values: ``given`` (a parsed config's ``data`` section, or keyword arguments), every
        absent option at its default."""
        given = group_options(cls, given, "the data module")
        if "prompts" not in given:
            raise ConfigError("data.prompts is required: a prompt file, a dataset, or a list of records.")
        return cls(**given)


# ----------------------------------------------------------------------------- the data section's rules


def column_problems(columns: Optional[Mapping[str, Optional[str]]], keep: Optional[Sequence[str]],
                    split: Optional[str]) -> list[str]:
    """``data.columns`` (record field -> a source's column, or null: not read), ``data.keep_columns``
    (column names) and ``data.split`` (a dataset's split), by themselves; against a file:
    ``tables.TableRecords``."""
    fields = (*RECORD_FIELDS, *CALL_ARGS)
    problems: list[str] = []
    if columns is not None and not (isinstance(columns, Mapping) and all(isinstance(k, str) for k in columns)):
        problems.append(f"data.columns must map record fields to columns ({{prompt: caption, seed: id}}), "
                        f"got {columns!r}.")
    elif columns is not None:
        unknown = [k for k in columns if k not in fields]
        if unknown:
            problems.append(f"data.columns maps record fields to a source's columns ({{prompt: caption}}); "
                            f"{unknown[0]!r} is not a record field ({', '.join(fields)}).")
        named = [k for k, v in columns.items() if v is not None and not (isinstance(v, str) and v.strip())]
        if named:
            problems.append(f"data.columns.{named[0]} must name a column (or be null: not read), "
                            f"got {columns[named[0]]!r}.")
        if "prompt" in columns and columns["prompt"] is None:
            problems.append("data.columns.prompt cannot be null: every record has a prompt.")
    if keep is not None and (isinstance(keep, str) or not isinstance(keep, Sequence)
                             or not all(isinstance(c, str) and c.strip() for c in keep)):
        problems.append(f"data.keep_columns must be a list of column names, got {keep!r}.")
    if split is not None and not (isinstance(split, str) and split.strip()):
        problems.append(f"data.split must name a split of the dataset (train, test, ...), got {split!r}.")
    return problems


def data_problems(settings: DataSettings, num_images: Optional[int] = None) -> list[str]:
    """The data group's values (``PromptDataModule``'s arguments); ``num_images``: the prompt
    set's, when known."""
    problems = column_problems(settings.columns, settings.keep_columns, settings.split)
    for name in ("batch_size", "num_images_per_prompt", "num_shards"):
        problems += integer(getattr(settings, name), f"data.{name}")
    if is_int(settings.batch_size, MAX_BATCH_SIZE + 1):
        problems.append(f"data.batch_size {settings.batch_size:,} is over {MAX_BATCH_SIZE:,}, the most images one "
                        "pipeline call is padded to; use a batch size the device holds.")
    seed = settings.seed
    if not (is_int(seed, 0) and seed <= SEED_MAX):
        problems.append(f"data.seed must be an integer from 0 to 2**64 - 1, got {seed!r}.")
    if num_images is not None and is_int(seed, 0) and seed + num_images - 1 > SEED_MAX:
        problems.append(f"data.seed {seed} + the {num_images:,} images of the prompt set passes the generator's "
                        "largest seed, 2**64 - 1; use a smaller data.seed.")
    problems += integer(settings.max_pixels, "data.max_pixels", 1)
    problems += integer(settings.max_prompt_chars, "data.max_prompt_chars", 1)
    problems += one_of(settings.on_bad_record, "data.on_bad_record", ON_BAD_RECORD)
    problems += one_of(settings.on_error, "data.on_error", ON_ERROR)
    root = settings.inputs_root
    if root is not None and not Path(str(root)).expanduser().is_dir():
        problems.append(f"data.inputs_root {root} is not a folder.")
    shards, index = settings.num_shards, settings.shard_index
    if is_int(shards, 1) and not (is_int(index, 0) and index < shards):
        problems.append(f"data.shard_index must be an integer from 0 to data.num_shards - 1 = {shards - 1}, "
                        f"got {index!r}.")
    if is_int(shards, 1) and shards > MAX_SHARDS:
        problems.append(f"data.num_shards must be at most {MAX_SHARDS:,} (the shard plan keeps 2 bytes an image), "
                        f"got {shards:,}.")
    if is_int(shards, 1) and num_images is not None and shards > num_images:
        problems.append(f"data.num_shards {shards} exceeds the {num_images} images of the prompt set: shards "
                        f"{num_images} to {shards - 1} would have nothing to make. Use at most {num_images} shards.")
    problems += pool_problems(settings)
    return problems


def pool_problems(settings: DataSettings) -> list[str]:
    """``data.schedule`` and ``data.lease_s``: a pool has no shards (its jobs are workers of the
    whole set), and a lease of a few seconds at least."""
    schedule, lease = settings.schedule, settings.lease_s
    problems = one_of(schedule, "data.schedule", SCHEDULES)
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease >= MIN_LEASE_S:
        problems.append(f"data.lease_s must be a number of seconds, at least {MIN_LEASE_S:g} (a worker renews its "
                        f"claims every lease/4), got {lease!r}.")
    if schedule == "pull" and is_int(settings.num_shards, 2):
        problems.append("data.schedule: pull makes the whole prompt set with every job that joins the pool: set "
                        "data.num_shards to 1 (the tasks of a job array join as workers, without shards).")
    return problems

