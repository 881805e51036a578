"""The checks' one convention, the rules of single values, and the bounds several parts share.

The convention: a rule takes the values it checks and returns the problems it finds, a ``list`` of
messages (empty when all is well); it never raises for bad input. Callers add lists together, and
``errors.raise_problems`` turns the lot into one refusal (exit code 2) at the boundary: the CLI's
preflight, or the constructor of a data module, module or writer. A message says what is wrong
and where (``model.height``, ``prompts.jsonl:3``), then what to do. A reader, which computes a
value and raises a ``ConfigError`` when it cannot (``resolve_dtype``, ``inspect_pipeline``), runs as
a rule through ``errors.run_check``: its refusal joins the list as that ``ConfigError`` (which keeps
a subclass such as ``NodeConfigError``).

Where each kind of input is checked: a section's rules beside its settings (``input.settings.data_problems``,
``output.store.writer_problems``, ``pipelines.checks.model_problems``), option names and defaults read from
the signatures of ``DiffusionModule``, ``PromptDataModule`` and ``ImageWriter``; call arguments, from the config or
a record: ``pipelines.checks.CALL_ARGS`` and ``call_arg_problems``; prompt records: ``input.records`` (fields while
reading) and ``input.record_checks`` (against the pipeline); input files: ``input.images.file_problems``; adapter
files: ``pipelines.lora``; step caches: ``pipelines.cache.check_cache``; quantization: ``pipelines.quantization``;
degrees, plans and devices: ``strategies.checks`` and each strategy's ``check_request``.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_diffusion.core.errors import is_int

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
# The pixels of one image (or video frame) a config or record may ask for unless ``data.max_pixels``
# says more: 4096 x 4096, four times FLUX.1's largest published size. A typo of 10000 x 10000 would
# otherwise be found by the device's memory, after the weights loaded.
MAX_PIXELS = 4096 * 4096
LEASE_S = 180.0  # data.lease_s's default: how long a silent worker's claims wait before a takeover
MAX_SHARDS = 2**16 - 1  # data.num_shards: a shard number is kept in 2 bytes an image
MIN_LEASE_S = 2.0  # a renewal every lease/4: below this, renewals would cost more than they protect


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

