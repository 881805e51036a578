"""Checks of the config's sections before anything loads, and the one convention every check follows.

The convention: a rule takes the values it checks and returns the problems it finds, a ``list`` of
messages (empty when all is well); it never raises for bad input. Callers add lists together, and
``errors.raise_problems`` turns the lot into one refusal (exit code 2) at the boundary: the CLI's
preflight, or the constructor of a data module, module or writer. A message says what is wrong
and where (``model.height``, ``prompts.jsonl:3``), then what to do. A reader, which computes a
value and raises a ``ConfigError`` when it cannot (``resolve_dtype``, ``inspect_pipeline``), runs as
a rule through ``errors.run_check``: its refusal joins the list as that ``ConfigError`` (which keeps
a subclass such as ``NodeConfigError``).

Where each kind of input is checked:

* config sections: here (``data_problems``, ``writer_problems``) and ``model_checks.model_problems``, option names
  and defaults read from the signatures of ``DiffusionModule``, ``PromptDataModule`` and ``ImageWriter``;
* call arguments, from the config or a record: ``CALL_ARGS`` (type and bound of each argument a
  record may set) and ``call_arg_problems``;
* prompt records: ``records`` (fields while reading, ``check_records`` against the pipeline);
* input files: ``inputs.file_problems``; adapter files: ``lora``; step caches: ``cache.check_cache``;
  quantization: ``quantization.check``; degrees, plans and devices: ``strategies/checks.py`` and
  each strategy's ``check_request``.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_diffusion.errors import is_int
from lightning_diffusion.input.settings import MAX_PIXELS, ON_BAD_RECORD, ON_ERROR, DataSettings
from lightning_diffusion.output.settings import WriterSettings
from lightning_diffusion.output.shard import MAX_SHARDS

if TYPE_CHECKING:
    from lightning_diffusion.pipelines.model_folder import PipelineInfo

MAX_STEPS = 1000  # schedulers are trained on 1000 timesteps
# torch.Generator.manual_seed takes 0 .. 2**64 - 1 (a larger seed raises "Overflow when unpacking long long").
SEED_MAX = 2 ** 64 - 1
MAX_GUIDANCE = 100.0
# Images in one pipeline call: every call is padded to data.batch_size (model.pad_batches; a set
# of fewer images to its own size), so a batch size past the device's is refused from the text.
MAX_BATCH_SIZE = 4096
# Processes a CPU run may start for each CPU core of this machine (trainer.devices on accelerator cpu).
MAX_PROCESSES_PER_CORE = 4
# Folders a run does not write into, nor below: the system's own (/dev/shm, memory for files, is
# not; /proc and /sys are refused as kernel file systems by the output store's check, wherever they
# are mounted).
SYSTEM_FOLDERS = ("/etc", "/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev")
# Folders a run does not write into themselves (below them is fine): the root and the folders of
# other folders; the user's home folder (HOME) is one too.
PARENT_FOLDERS = ("/", "/var", "/home", "/root")



# ----------------------------------------------------------------------------- value rules


def integer(value: object, name: str, minimum: Optional[int] = 1, maximum: Optional[int] = None) -> list[str]:
    """``value`` is an ``int`` (not a ``bool``) in [``minimum``, ``maximum``]."""
    if is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return []
    if maximum is not None:
        return [f"{name} must be an integer from {minimum} to {maximum:,}, got {value!r}."]
    return [f"{name} must be an integer >= {minimum}, got {value!r}."]


def devices_problems(devices: object, num_nodes: object) -> list[str]:
    """``trainer.devices`` as Lightning takes it (a count, ``auto``, -1 for all, or a list of
    device indices such as ``[0, 1]`` or ``"0,1"``) and ``trainer.num_nodes`` a count: refused here,
    in one line, rather than by Lightning's accelerator with a traceback."""
    problems = integer(num_nodes if num_nodes is not None else 1, "trainer.num_nodes")
    if devices is None or devices == "auto" or devices == -1 or devices == "-1" or is_int(devices, 1):
        return problems
    text = devices if isinstance(devices, str) else ""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if parts and all(part.isdigit() for part in parts) and ("," in text or int(parts[0]) >= 1):
        return problems  # "0,1" names devices; "0" is a count, as Lightning reads it
    if isinstance(devices, list) and devices and all(is_int(d, 0) for d in devices):
        return problems
    return problems + [f"trainer.devices must be a count of devices (1, 8), auto, -1 (all of them) or a list of device "
                       f"indices such as [0, 1], got {devices!r}."]


def number(value: Any, name: str, low: Optional[float] = None, high: Optional[float] = None,
           low_open: bool = False) -> list[str]:
    """``value`` is a finite number in [``low``, ``high``] (``(low, high]`` with ``low_open``)."""
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    inside = finite and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
    if inside:
        return []
    if not finite:
        kind = "a finite number" if isinstance(value, float) else "a number"
        return [f"{name} must be {kind}, got {value!r}."]
    bracket = "(" if low_open else "["
    return [f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}."]


def cpu_devices_problems(devices: object, cores: int) -> list[str]:
    """``trainer.devices`` of a run on this machine's CPU (a valid value, ``devices_problems``):
    a count of processes, as Lightning's CPU accelerator takes it (not -1, not device indices), at
    most ``MAX_PROCESSES_PER_CORE`` for each of the machine's ``cores``: refused before any
    process starts, each of which would load the whole pipeline."""
    if devices is None or devices == "auto":
        return []
    count = int(devices) if isinstance(devices, str) and devices.strip().isdigit() else devices
    if not is_int(count, 1):
        return [f"trainer.devices on accelerator cpu is a count of processes (1, 4), not -1 nor a list of devices, "
                f"got {devices!r}."]
    most = MAX_PROCESSES_PER_CORE * cores
    if count > most:
        return [f"trainer.devices {count:,} on accelerator cpu would start {count:,} processes on this machine's "
                f"{cores} CPU core{'s' if cores != 1 else ''}; at most {MAX_PROCESSES_PER_CORE} a core ({most:,}): "
                "lower trainer.devices."]
    return []


def one_of(value: object, name: str, choices: Sequence[Any]) -> list[str]:
    if value in choices:
        return []
    return [f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}."]


def non_finite(value: object, path: str = "") -> list[str]:
    """The places of non-finite numbers (NaN, Infinity) in a value: ``guidance_scale``,
    ``sigmas[3]``... (they make black images that would be recorded as finished, and are not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path or "the value"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in non_finite(v, f"{path}[{i}]")]
    return []


def finite(value: object, name: str) -> list[str]:
    """No NaN or Infinity anywhere in ``value`` (a number, or a mapping or list holding numbers)."""
    places = non_finite(value)
    return [f"{name}{'' if p == 'the value' else '.' + p}: not a finite number (NaN and Infinity are refused)."
            for p in places]


def defaults(cls: type[Any]) -> dict[str, Any]:
    """The keyword arguments of ``cls.__init__`` and their defaults: the one declaration of a
    section's options, which the parser (jsonargparse) reads too."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.default is not inspect.Parameter.empty}


# ----------------------------------------------------------------------------- call arguments


@dataclass(frozen=True)
class ArgRule:
    """The type and bound of one call argument (``integer`` or ``number``); ``high`` may be given
    by the pipeline or the run (``text``: its text encoder's limit, ``pixels``: ``data.max_pixels``)."""

    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_from: Optional[str] = None

    def problems(self, name: str, value: object, limits: Mapping[str, Optional[int]]) -> list[str]:
        if self.kind in ("size", "frames"):
            return []  # the pipeline's own rules: ``PipelineInfo.size_problems`` and ``frames_problems``
        high = limits.get(self.high_from) if self.high_from else self.high
        if self.kind == "integer":
            return integer(value, name, int(self.low) if self.low is not None else None,
                           int(high) if high is not None else None)
        return number(value, name, self.low, high, self.low_open)


# The call arguments a prompt record may set (``PipelineSpec.record_args`` picks among them), with
# their types and bounds; the config's values are held to the same rules.
CALL_ARGS: dict[str, ArgRule] = {
    "height": ArgRule("size"),
    "width": ArgRule("size"),
    "num_inference_steps": ArgRule("integer", 1, MAX_STEPS),
    "guidance_scale": ArgRule("number", 0, MAX_GUIDANCE),
    "guidance_scale_2": ArgRule("number", 0, MAX_GUIDANCE),
    "true_cfg_scale": ArgRule("number", 0, MAX_GUIDANCE),
    "max_sequence_length": ArgRule("integer", 1, high_from="text"),
    "num_frames": ArgRule("frames"),
    "strength": ArgRule("number", 0, 1, low_open=True),
    "max_area": ArgRule("integer", 256, high_from="pixels"),
}


def record_args(info: PipelineInfo) -> list[str]:
    """The call arguments a record may set for this pipeline: its spec's, that its call takes."""
    return [name for name in info.spec.record_args if name in info.call_parameters and name in CALL_ARGS]


def record_keys(info: PipelineInfo) -> list[str]:
    """Every key a record of this pipeline may have."""
    from lightning_diffusion.input.images import INPUT_FIELDS

    inputs = [name for name in INPUT_FIELDS if name in info.call_parameters]
    negative = ["negative_prompt"] if "negative_prompt" in info.call_parameters else []
    return ["prompt", "seed", *negative, *inputs, *record_args(info)]


def call_arg_problems(info: PipelineInfo, values: Mapping[str, Any], base: Optional[Mapping[str, Any]] = None,
                      max_pixels: Optional[int] = MAX_PIXELS, record: bool = False, where: str = "") -> list[str]:
    """Problems of call arguments ``values``. ``base``: the call arguments ``values`` override (a
    record's over the config's); ``record``: ``values`` come from a prompt record, which may set
    only ``record_args`` (the config may set any argument the pipeline's ``__call__`` takes, except
    those the project sets itself). ``where``: the config key holding them (``model``,
    ``model.call_kwargs``); a record's problems are bare, the caller names its line."""
    problems: list[str] = []
    names = set(values)
    prefix = f"{where}." if where else ""
    if record:
        allowed = record_args(info)
        unknown = sorted(names - set(allowed))
        if unknown:
            problems.append(f"{', '.join(unknown)}: not something a record may set; a {info.class_name} record may "
                            f"have {', '.join(record_keys(info))}.")
        names -= set(unknown)
    else:
        problems += info.call_argument_problems(names, where or "model")
        names &= info.call_parameters
    limits = {"text": info.spec.text_length_max, "pixels": max_pixels}
    typed = {}
    for name in sorted(names):
        value = values[name]
        rule = CALL_ARGS.get(name)
        if value is None and (rule is None or name in info.optional_parameters):
            found: list[str] = []  # the pipeline's own default
        elif rule is not None:
            found = rule.problems(prefix + name, value, limits)
        else:
            found = finite(value, prefix + name) or [f"{where}: {p}" for p in info.call_value_problems({name: value})]
        problems += found
        if not found:
            typed[name] = value
    merged = {**(base or {}), **typed}
    if "height" in typed or "width" in typed:
        sizes = info.size_problems(typed.get("height"), typed.get("width"))
        problems += sizes or pixel_problems(info, merged, max_pixels)
    if "num_frames" in typed:
        problems += info.frames_problems(typed["num_frames"])
    if "strength" in typed or "num_inference_steps" in typed:
        problems += [f"{where}: {p}" if where else p for p in strength_problems(info, merged)]
    return problems


def pixel_problems(info: PipelineInfo, call_args: Mapping[str, Any], max_pixels: Optional[int]) -> list[str]:
    """An image (or frame) of more than ``max_pixels`` pixels: refused before it is found by the
    device's memory (``None``: no budget)."""
    default = info.spec.default_size or (None, None)
    height, width = call_args.get("height") or default[0], call_args.get("width") or default[1]
    longest = max((v for v in (height, width) if is_int(v, 1)), default=0)
    if info.facts.max_side and longest > info.facts.max_side:
        return [f"{height}x{width}: {info.class_name}'s transformer places at most {info.facts.max_side:,} pixels per "
                "side (its pos_embed_max_size); choose a smaller size."]
    if max_pixels is None:
        return []
    side = 4 * math.isqrt(max_pixels)
    if longest > side:
        return [f"{height}x{width}: a side of {longest:,} pixels is over {side:,}, four times the side of "
                f"data.max_pixels' square ({max_pixels:,} pixels); raise data.max_pixels if you mean it."]
    if is_int(height, 1) and is_int(width, 1) and height * width > max_pixels:
        return [f"{height}x{width} is {height * width:,} pixels, over data.max_pixels {max_pixels:,} (raise it if "
                "you mean it)."]
    return []


def strength_problems(info: PipelineInfo, args: Mapping[str, Any]) -> list[str]:
    """An image-to-image ``strength`` that runs no denoising step (diffusers raises only after loading)."""
    if "strength" not in info.call_parameters:
        return []
    strength, steps = args.get("strength", info.call_default("strength")), args.get("num_inference_steps")
    steps = steps if steps is not None else info.call_default("num_inference_steps")
    if (isinstance(strength, (int, float)) and isinstance(steps, int) and 0 < strength <= 1
            and int(steps * strength) < 1):
        return [f"strength {strength} of num_inference_steps {steps} runs no step (the pipeline runs "
                f"int(steps x strength) = 0 of them): raise one of the two."]
    return []


# ----------------------------------------------------------------------------- the model section


# ----------------------------------------------------------------------------- the data section


def column_problems(columns: Optional[Mapping[str, Optional[str]]], keep: Optional[Sequence[str]],
                    split: Optional[str]) -> list[str]:
    """``data.columns`` (record field -> a source's column, or null: not read), ``data.keep_columns``
    (column names) and ``data.split`` (a dataset's split), by themselves; against a file:
    ``tables.TableRecords``."""
    from lightning_diffusion.input.images import INPUT_FIELDS

    fields = ("prompt", "seed", "negative_prompt", *INPUT_FIELDS, *CALL_ARGS)
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
    from lightning_diffusion.input.settings import MIN_LEASE_S, SCHEDULES

    schedule, lease = settings.schedule, settings.lease_s
    problems = one_of(schedule, "data.schedule", SCHEDULES)
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease >= MIN_LEASE_S:
        problems.append(f"data.lease_s must be a number of seconds, at least {MIN_LEASE_S:g} (a worker renews its "
                        f"claims every lease/4), got {lease!r}.")
    if schedule == "pull" and is_int(settings.num_shards, 2):
        problems.append("data.schedule: pull makes the whole prompt set with every job that joins the pool: set "
                        "data.num_shards to 1 (the tasks of a job array join as workers, without shards).")
    return problems


# ----------------------------------------------------------------------------- the writer section


def writer_problems(settings: WriterSettings) -> list[str]:
    """The writer group's values (``ImageWriter``'s arguments) against their rules
    (``settings.WriterSettings``), and the output location's own (``OutputStore.settings_problems``)."""
    from lightning_diffusion.output.store import store_class

    output_dir = settings.output_dir
    named = isinstance(output_dir, (str, os.PathLike)) and bool(str(output_dir).strip())
    local = named and store_class(output_dir).needs_shared_folder  # a folder, not a bucket
    problems: list[str] = (system_folder_problems(str(output_dir)) if local else []) or (
        store_class(output_dir).settings_problems(settings) if named else [
            f"writer.output_dir must name a folder, got {output_dir!r} (an empty name would write into the working "
            "folder)."])
    from lightning_diffusion.output.audit import audit_problems

    problems += audit_problems(settings.audit)
    if settings.audit is not None and named and not local:
        problems.append("writer.audit writes audit.jsonl beside a folder's manifest; a bucket's output "
                        f"({output_dir}) is not audited yet: audit into a folder, or leave writer.audit out.")
    for name, rule in WriterSettings.rules():
        value, key = getattr(settings, name), f"writer.{name}"
        if rule.choices:
            problems += one_of(value, key, rule.choices)
        elif rule.integer:
            problems += [p.replace(key, rule.label or key) + rule.hint
                         for p in integer(value, key, rule.minimum, rule.maximum)]
    return problems


def system_folder_problems(output_dir: str, home: Optional[str] = None) -> list[str]:
    """``writer.output_dir`` in a folder a run must not write into: the file system's root, a
    system folder or below one (``SYSTEM_FOLDERS``: /etc, /usr...), or one of ``PARENT_FOLDERS``
    or the user's home folder (``home``, by default HOME) itself; below those is fine. Judged on the
    folder as given and with its links resolved (``/lib`` is ``/usr/lib`` on many systems)."""
    given = Path(output_dir).expanduser()
    home = os.environ.get("HOME", "") if home is None else home
    homes = {os.path.normpath(home), os.path.realpath(home)} if home.strip() else set()
    for folder in dict.fromkeys([os.path.normpath(os.path.abspath(given)), os.path.realpath(given)]):
        system = next((s for s in SYSTEM_FOLDERS if folder == s or folder.startswith(s + "/")), None)
        if folder == "/dev/shm" or folder.startswith("/dev/shm/"):
            system = None  # a file system of files in memory, for files
        if folder == "/":
            return [f"writer.output_dir {output_dir!r} is the file system's root: a run writes its images, manifest "
                    "and lock into writer.output_dir; choose a folder of your own."]
        if system is not None:
            return [f"writer.output_dir {output_dir!r} is {'in ' if folder != system else ''}{system}, a folder of "
                    "the system's (no run writes in /etc, /usr, /bin, /sbin, /lib*, /boot, /dev or below them); "
                    "choose a folder of your own."]
        if folder in PARENT_FOLDERS or folder in homes:
            which = "the home folder (HOME)" if folder in homes else folder
            return [f"writer.output_dir {output_dir!r} is {which} itself, which holds other folders: choose a "
                    f"folder below it, such as {os.path.join(folder, 'outputs')}."]
    return []
