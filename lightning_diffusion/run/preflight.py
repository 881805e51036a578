"""Checks of a whole config before anything starts: every problem found is reported at once.

The CLI runs ``preflight`` after parsing and before it builds any object, so a config with three
mistakes gets one message naming all three, in seconds, instead of a fix-and-retry loop with a
model load in between: model, prompts, writer, disk space, and the degrees of the project's
strategies against the world size and the model (``check_request``, the same rules a strategy runs
on every rank when the Trainer is used from Python). The ranks the CLI starts trust this check.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from lightning_diffusion.contract import ModelRequest
from lightning_diffusion.core.checks import cpu_devices_problems, devices_problems
from lightning_diffusion.core.errors import ConfigError, is_int, run_check
from lightning_diffusion.core.records import CallArgs, RunSettings
from lightning_diffusion.input.data import run_plan, shard_owners
from lightning_diffusion.input.formats import read_records
from lightning_diffusion.input.record_checks import check_records
from lightning_diffusion.input.records import RecordVerdicts
from lightning_diffusion.input.settings import MAX_PROMPT_CHARS, DataSettings, column_problems, data_problems
from lightning_diffusion.output.files import size_text
from lightning_diffusion.output.lock import OutputLock, busy_message
from lightning_diffusion.output.manifest import MANIFEST, RUN_FILE, recorded_conflict, settings_conflict
from lightning_diffusion.output.metrics import port_problem
from lightning_diffusion.output.recorded import Finished, finished
from lightning_diffusion.output.settings import (
    WriterSettings,
    image_settings,
    recorded_options,
    run_settings,
)
from lightning_diffusion.output.shard import Shard, adopt, plan_file, recorded_owners, shard_size
from lightning_diffusion.output.store import open_store, store_class, writer_problems
from lightning_diffusion.pipelines.adapters import every_adapter
from lightning_diffusion.pipelines.checks import model_problems
from lightning_diffusion.pipelines.model_folder import PipelineInfo, dtype_name, resolve_dtype
from lightning_diffusion.pipelines.settings import ModelSettings
from lightning_diffusion.pipelines.side_outputs import side_output_problems

# PNG keeps about half of the raw RGB bytes for generated images; used only to warn early.
_PNG_RATIO = 0.5


def disk_space_problems(
    info: PipelineInfo, named: CallArgs, records: Sequence[Any], per_prompt: int, output_dir: str,
    shard: Optional[Shard] = None, found: Optional[Finished] = None,
) -> list[str]:
    """The outputs still to make need more space than the output folder's file system has free.
    ``found``: the folder's finished images, when already read."""
    folder = Path(output_dir).expanduser()
    if found is None and folder.is_dir():
        found = finished(folder)
    done = len(found.in_shard(shard)) if found is not None else 0
    pending = max(0, shard_size(len(records) * per_prompt, shard) - done)
    default = info.spec.default_size or (1024, 1024)
    height, width = named.get("height") or default[0], named.get("width") or default[1]
    frames = named.get("num_frames") or info.spec.default_frames or 1
    need = pending * height * width * 3 * frames * _PNG_RATIO
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if need <= free:
        return []
    return [f"{pending:,} outputs of {height}x{width}{f' x {frames} frames' if frames > 1 else ''} need about "
            f"{size_text(need)}, but {existing} has {size_text(free)} free."]


def busy_folder_problems(output_dir: str, num_shards: int = 1, shard_index: int = 0, pull: bool = False) -> list[str]:
    """Another live run writes the folder (or images of this shard): refused before any process
    starts, as the writer refuses it when the run starts (its lock is taken only then)."""
    folder = Path(output_dir).expanduser()
    if not folder.is_dir():
        return []
    shard = (shard_index, num_shards) if num_shards > 1 else None
    message = busy_message(folder, shard, None if pull else OutputLock(folder, shard).holder(), pull)
    return [message] if message else []


def build_strategy(spec: Any) -> Optional[Any]:
    """The project's strategy a config names (a registered name or a class path), built to check
    its arguments; None for another strategy, which is checked by Lightning itself."""
    import importlib

    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_diffusion.strategies.base import DiffusionParallelStrategy

    if isinstance(spec, str):
        if spec not in StrategyRegistry and spec not in ("auto", "dp"):
            raise ConfigError(strategy_name_problem(spec))
        strategy = StrategyRegistry.get(spec) if spec in StrategyRegistry else None
    elif spec is not None and spec.get("class_path"):
        module_name, _, name = spec.class_path.rpartition(".")
        cls = getattr(importlib.import_module(module_name), name, None)
        if not (isinstance(cls, type) and issubclass(cls, DiffusionParallelStrategy)):
            return None
        strategy = cls(**dict(spec.get("init_args") or {}))
    else:
        return None
    return strategy if isinstance(strategy, DiffusionParallelStrategy) else None


def strategy_name_problem(name: str) -> str:
    """An unknown ``trainer.strategy`` name, with the closest one and the project's own."""
    import difflib

    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_diffusion.strategies import STRATEGY_NAMES

    known = list(StrategyRegistry.available_strategies())
    close = difflib.get_close_matches(name, [*STRATEGY_NAMES, *known], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"trainer.strategy {name!r} is not a strategy; {hint}this project's: {', '.join(STRATEGY_NAMES)} "
            "(or a class path with init_args; Lightning's own names work too).")


def accelerator_problems(accelerator: Any) -> list[str]:
    """A GPU run asked for on a machine whose torch sees no GPU (Lightning would say "No supported
    gpu backend found!" in a traceback)."""
    name = str(accelerator or "auto").lower()
    if name in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            return [f"trainer.accelerator {name}: torch sees no CUDA GPU on this machine (torch "
                    f"{torch.__version__}{', a CPU build' if torch.version.cuda is None else ''}); to rehearse the "
                    "run on the CPU, set trainer.accelerator: cpu."]
    return []


def cpu_problems(trainer: Any) -> list[str]:
    """A run on this machine's CPU: ``trainer.devices`` as processes its cores can run
    (``core.checks.cpu_devices_problems``); a GPU run's devices are Lightning's to check."""
    import os

    if device_type(trainer.get("accelerator")) != "cpu":
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpu_devices_problems(trainer.get("devices"), cores)


def device_type(accelerator: Any) -> str:
    """The device type a config's ``trainer.accelerator`` gives on this machine."""
    name = str(accelerator or "auto").lower()
    if name in ("gpu", "cuda"):
        return "cuda"
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu" if name == "cpu" else name


def world_size(trainer: Any) -> Optional[int]:
    """devices x num_nodes when the config says it (None for "auto" or a device list)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        return None
    return devices * nodes


def preflight(config: Any, here: bool = True) -> "Verdict":
    """Every weight-free check of the ``model``, ``data`` and ``writer`` groups of a parsed config.
    Returns a ``Verdict``: the problems; whether the checks were complete (the strategy's rules need
    the world size, which a config with ``devices: auto`` (or a device list) leaves to the Trainer;
    then the ranks must run them themselves); and, ``here``, whether the folder already holds every
    image. ``here``: the run is on this machine (``slurm`` and ``k8s`` render a job for others: this
    machine's GPUs are not asked about)."""
    model = ModelSettings.of(dict(config.model))
    data, writer = DataSettings.of(dict(config.data)), WriterSettings.of(dict(config.writer))
    problems: list = []
    nothing_left: Optional[str] = None
    chars = data.max_prompt_chars
    # A bad data.columns, data.keep_columns or data.split is data_problems' to name: the records are not read.
    records = None if column_problems(data.columns, data.keep_columns, data.split) else run_check(
        problems, read_records, data.prompts, chars if is_int(chars, 1) else MAX_PROMPT_CHARS,
        data.columns, data.keep_columns, data.split)
    copies = data.num_images_per_prompt if is_int(data.num_images_per_prompt, 1) else None
    num_images = len(records) * copies if records is not None and copies is not None else None
    problems += data_problems(data, num_images)
    max_pixels = data.max_pixels if is_int(data.max_pixels, 1) else None
    info, model_found = model_problems(model, records.summary if records is not None else None, max_pixels)
    problems = model_found + problems
    named = model.named_call_args()
    call_args: CallArgs = {}
    if info is not None:
        base, extra = info.effective_call_args(named, model.call_kwargs)
        call_args = {**base, **extra}
    if records is not None:
        if info is not None and not model_found:
            verdicts = check_records(info, records, call_args, data.inputs_root, max_pixels, copies or 1,
                                     tuple(model.adapters) if isinstance(model.adapters, dict) else ())
        else:  # the lines that failed while reading; the rest is checked once the model is right
            verdicts = RecordVerdicts(dict(records.bad))
        problems += verdicts.refusal(len(records), data.on_bad_record)
    problems += writer_problems(writer)
    if info is not None:  # latents or embeddings asked of a pipeline that has none (the writer checks it again)
        problems += side_output_problems(info, writer.save_latents, writer.save_text_embeddings)
    if here and is_int(writer.metrics_port, 1) and writer.metrics_port <= 65535:  # the run's machine: its port
        problems += [problem] if (problem := port_problem(writer.metrics_port)) else []
    devices_found = devices_problems(config.trainer.get("devices"), config.trainer.get("num_nodes"))
    problems += devices_found
    if here:
        problems += accelerator_problems(config.trainer.get("accelerator"))
        problems += [] if devices_found else cpu_problems(config.trainer)
    # Built first, so that a bad strategy argument is reported with the other problems; its rules
    # against the model run once the model and records are known to be right.
    strategy = run_check(problems, build_strategy, config.trainer.get("strategy"))
    size = world_size(config.trainer)
    complete = strategy is None or size is not None
    if strategy is not None and size is not None:
        run_check(problems, strategy.make_parallel_dims, size)
        if info is not None and not problems:
            options = model.options()
            request = ModelRequest(info, resolve_dtype(model.torch_dtype), call_args,
                                   dict(model.from_pretrained_kwargs or {}), records,
                                   options["attention_backend"], options["quantization"],
                                   every_adapter(options["lora"], options["adapters"]))
            problems += strategy.check_request(request, size, device_type(config.trainer.get("accelerator")))
    if not store_class(writer.output_dir).is_folder:  # a bucket: its lock and settings are read
        nothing_left = None                                          # when the run starts
        if here and not problems:
            store = open_store(writer.output_dir, options=writer.storage_options)
            problems += store.write_problems()
            if (not problems and info is not None and records is not None and data.num_shards == 1
                    and not records.summary.with_inputs and not writer.allow_config_change):
                nothing_left = bucket_nothing_left(store, _run_settings(model, data, writer, records, call_args, info),
                                                   len(records) * data.num_images_per_prompt)
        return Verdict(problems, complete, nothing_left)
    if not problems and is_int(data.num_shards, 1) and is_int(data.shard_index, 0):
        problems += busy_folder_problems(writer.output_dir, data.num_shards, data.shard_index, data.schedule == "pull")
    if info is not None and records is not None and not problems:
        folder = Path(writer.output_dir).expanduser()
        found = finished(folder) if folder.is_dir() else None
        blocked = found.in_the_way_message(folder) if found is not None else None
        problems += [blocked] if blocked else []
        shard = None
        if data.num_shards > 1:  # as the run deals it (``data.shard_owners``, or the folder's plan)
            count = data.num_shards
            shard = Shard(data.shard_index, count)
            recorded = recorded_owners(folder, count) if folder.is_dir() else None
            if recorded is None:
                shard = shard.with_owners(
                    shard_owners(records, data.num_images_per_prompt, data.batch_size, data.bucket, count))
            shard, problem = adopt(shard, recorded, len(records) * data.num_images_per_prompt,
                                   str(folder / plan_file(count)))
            problems += [problem] if problem else []
        problems += disk_space_problems(info, call_args, records, data.num_images_per_prompt, writer.output_dir,
                                        shard, found)
        if not writer.allow_config_change:
            # The writer checks again when the run starts; here it costs no process start.
            conflict = settings_conflict(Path(writer.output_dir).expanduser(),
                                         _run_settings(model, data, writer, records, call_args, info))
            if conflict:
                problems.append(conflict)
        if here and not problems and found is not None and num_images is not None:
            nothing_left = nothing_to_make(folder, found, records, num_images, shard)
    return Verdict(problems, complete, nothing_left)


@dataclass
class Verdict:
    """``preflight``'s answer: the problems, whether the checks were complete (see ``preflight``),
    and, for a folder that holds every image of the run already, the line that says so."""

    problems: list
    complete: bool
    nothing_left: Optional[str] = None


def _run_settings(model: ModelSettings, data: DataSettings, writer: WriterSettings, records: Any,
                  call_args: CallArgs, info: PipelineInfo) -> RunSettings:
    """The settings run.json records for this run (what a resume compares), with the decoding
    options the module turns on itself (``decoding_defaults``)."""
    from lightning_diffusion.pipelines.loading import decoding_defaults

    options = model.options()
    options.update(decoding_defaults(info, options)[0])
    return run_settings(image_settings(model.pretrained_model_name_or_path, dtype_name(model.torch_dtype), call_args,
                                       dict(model.from_pretrained_kwargs or {}), model.cache,
                                       recorded_options(options)),
                        run_plan(data, records), writer)


def bucket_nothing_left(store: Any, settings: RunSettings, num_images: int) -> Optional[str]:
    """``nothing_to_make`` for a bucket prefix: its run.json records these ``settings``, every image
    of the set is recorded there (the lines that count, ``ObjectStore.recorded``), and no run holds
    it. A prefix made with other settings is left to the run, which refuses it naming the key."""
    try:
        recorded = store.read_json(RUN_FILE)
        if recorded is None or recorded_conflict(recorded, settings, store.where) or store.live_locks():
            return None
        done, _ = store.made()
    except Exception:  # unreadable now: the run says why when it starts
        return None
    if np.count_nonzero(np.asarray(done) < num_images) < num_images:
        return None
    return (f"nothing to make: the {num_images:,} images of this prompt set are all recorded in {store.where} "
            "(a new prompt set, other settings or another prefix makes more).")


def nothing_to_make(folder: Path, found: Finished, records: Any, num_images: int,
                    shard: Optional[Shard] = None) -> Optional[str]:
    """The line that ends a run whose folder holds all of its images, before any process starts or
    any weight loads; None where the run has something to do: an image not in the manifest (failed
    records, rejected ones, a shard's others), lines a resume repairs, parts a resume merges, or
    records with input files (the writer checks that they did not change), audit parts a run merges."""
    expected = shard_size(num_images, shard)
    if (not (folder / MANIFEST).is_file() or found.untidy or found.conflicted or records.summary.with_inputs
            or any(folder.glob("manifest*.part-*.jsonl")) or any(folder.glob("failed*.part-*.jsonl"))
            or any(folder.glob("audit*.part-*.jsonl"))
            or np.count_nonzero(found.in_shard(shard) < num_images) < expected):
        return None
    which = "" if shard is None else f" of shard {shard[0]} of {shard[1]}"
    return (f"nothing to make: the {expected:,} images{which} of this prompt set are all in {folder / MANIFEST} "
            "(a new prompt set, other settings or another folder makes more).")
