"""Per-record adapters: ``model.adapters`` names LoRA adapters once, each record chooses a set.

    model:
      adapters:
        style: {path: loras/style.safetensors, scale: 0.8}
        subject: {path: loras/subject, weight_name: pytorch_lora_weights.safetensors}

    {"prompt": "a red chair", "adapters": ["style", "subject"]}
    {"prompt": "a blue chair", "adapters": {"style": 0.5}}
    {"prompt": "a plain chair"}

A record's choice (``choice``) is a list of names (each at its declared scale) or a mapping of names
to scales; a record without one gets the run's default, ``model.lora`` (or none). A batch never mixes
sets (the set is part of the call key that batches are cut by), and a replica switches between
sets without reloading the base weights (``AdapterSwitch``): the weights the adapters of the set
before touched are put back from a copy of the base weights held on the CPU, and the new set is fused
with the very function a ``model.lora`` run of the same strategy fuses with (diffusers' fuse on whole
weights, done on the CPU as a ``model.lora`` run's load does; each rank's slice under tensor
parallelism or a device map's placement, where the weights are). An image made with set S is thus
the image of a run with ``model.lora: S``, byte for byte, and no decision of a step cache or a
compiled graph outlives its batch: weights change in place between calls, never a module.

The adapters of a set are fused in name order (fusing is a sum, and floating-point sums depend on
their order), so ``["style", "subject"]`` and ``["subject", "style"]`` make the same images.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a switch runs: the prompt readers use this module's rules
    import torch
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    from lightning_diffusion.pipelines.lora import Adapter

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # an adapter's name in model.adapters and in records

# A record's choice once read: adapter name -> scale, None for the declared one; sorted by name.
Choice = dict[str, Optional[float]]
# A set as fused: the adapters (scales applied) in name order, with their names.
AdapterSet = tuple[tuple[str, "Adapter"], ...]


def choice(value: object) -> Choice:
    """A record's ``adapters`` as ``{name: scale or None}`` (sorted by name), or ValueError saying
    why not. A list of names, a mapping of names to scales, one name, or (a CSV cell) a JSON list or
    mapping, or names separated by commas."""
    import math

    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "[{":
            try:
                value = json.loads(text)
            except ValueError:
                raise ValueError(f"'adapters' {value!r} is not valid JSON.") from None
        else:
            value = [name.strip() for name in text.split(",") if name.strip()]
    if isinstance(value, Mapping):
        found: Choice = {}
        for name, scale in value.items():
            if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                      or not math.isfinite(scale)):
                raise ValueError(f"'adapters' gives {name!r} the scale {scale!r}: a number, or null for its own.")
            found[name] = None if scale is None else float(scale)
    elif isinstance(value, (list, tuple)) and value and all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in value):  # a Parquet map column
        return choice(dict(value))
    elif isinstance(value, (list, tuple)):
        found = {name: None for name in value}
        if len(found) != len(value):
            raise ValueError(f"'adapters' names an adapter twice: {list(value)!r}.")
    else:
        raise ValueError(f"'adapters' is a list of adapter names or a mapping of names to scales, not {value!r}.")
    bad = [name for name in found if not isinstance(name, str) or not NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"'adapters' has {bad[0]!r}, which is not an adapter name.")
    return dict(sorted(found.items()))


def parse_named(spec: object) -> dict[str, Adapter]:
    """``model.adapters`` (``{name: {path, weight_name, scale, allow_pickle}}``: the adapters records
    choose by name) as adapters by name; every problem is raised together."""
    from lightning_diffusion.pipelines.lora import _parse_one, _raise

    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ConfigError("model.adapters is a mapping of names to adapters, such as {style: {path: "
                          f"loras/style.safetensors, scale: 0.8}}, not {spec!r}.")
    adapters: dict[str, Adapter] = {}
    problems: list[str] = []
    for name, item in spec.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            problems.append(f"model.adapters: {name!r} is not an adapter name (letters, digits, '_', '-' and '.', "
                            "starting with a letter or digit).")
            continue
        adapter = _parse_one(item, f"model.adapters.{name}", problems)
        if adapter is not None:
            adapters[name] = adapter
    _raise(problems)
    return adapters


def every_adapter(lora: object, adapters: object) -> tuple[Adapter, ...]:
    """``model.lora``'s adapters and ``model.adapters``' (what a strategy checks and prepares for:
    any of them may be fused into its weights)."""
    from lightning_diffusion.pipelines import lora as lora_

    return (*lora_.parse(lora), *parse_named(adapters).values())


def choice_key(chosen: Optional[Mapping[str, Optional[float]]]) -> str:
    """What batches are cut by: '' for a record without a choice (the run's default set)."""
    return json.dumps(chosen, sort_keys=True) if chosen is not None else ""


class AdapterSets:
    """The adapters ``model.adapters`` declares, by name, and the run's default set (``model.lora``)."""

    def __init__(self, declared: Mapping[str, Adapter], default: Sequence[Adapter] = ()) -> None:
        self.declared = dict(declared)
        self.default: AdapterSet = tuple((f"lora[{n}]", a) for n, a in enumerate(default))
        self._hashes: dict[str, str] = {}

    def resolve(self, chosen: Optional[Mapping[str, Optional[float]]]) -> AdapterSet:
        """The set a record's choice makes (None: the default), its scales applied, in name order."""
        if chosen is None:
            return self.default
        return tuple((name, self.declared[name] if scale is None else dataclasses.replace(self.declared[name],
                                                                                              scale=scale))
                     for name, scale in sorted(chosen.items()))

    def record(self, adapters: AdapterSet) -> list[dict[str, Any]]:
        """What an image's metadata and manifest line say of its set: each adapter's name, file,
        SHA-256 and scale (hashed once a run)."""
        found = []
        for name, adapter in adapters:
            key = str(adapter.file)
            if key not in self._hashes:
                self._hashes[key] = adapter.sha256()
            found.append({"name": name, "file": adapter.file.name, "sha256": self._hashes[key],
                          "scale": adapter.scale})
        return found


class AdapterSwitch:
    """Fuses one adapter set at a time into a loaded pipeline and switches between sets.

    ``fuse``: the strategy's fuse, ``(pipeline, adapters)`` (``LoadPlan.fuse_adapters``, else
    diffusers' ``lora.fuse``). ``on_cpu``: fuse with the components moved to the CPU and back, as a
    ``model.lora`` run fuses at load (diffusers' fuse on whole weights; not for weights a device map
    placed or a tensor-parallel strategy sharded, which a ``model.lora`` run fuses where they are).

    Before a module's weights first change, its parameters are copied to the CPU (``base``); a
    switch puts back those of every module the set before touched, then fuses the next set. The
    copy is of the modules the run's adapters target, not of the whole model.
    """

    def __init__(self, pipeline: DiffusionPipeline, fuse: Callable[[DiffusionPipeline, Sequence[Adapter]], None],
                 on_cpu: bool = True) -> None:
        self.pipeline = pipeline
        self.fuse = fuse
        self.on_cpu = on_cpu
        self.current: AdapterSet = ()
        self.base: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (component, module) -> params on the CPU
        self._touched: set[tuple[str, str]] = set()
        self.switches = 0
        self.seconds = 0.0

    def use(self, adapters: AdapterSet) -> bool:
        """Make ``adapters`` the fused set; whether it switched (False: it was already)."""
        import time

        if adapters == self.current:
            return False
        start = time.perf_counter()
        from lightning_diffusion.pipelines import lora

        targets: set[tuple[str, str]] = set()
        for _, adapter in adapters:
            for component, modules in lora.targets(type(self.pipeline), adapter).items():
                targets |= {(component, module) for module in modules}
        components = sorted({c for c, _ in self._touched | targets})
        moved = self._to_cpu(components) if self.on_cpu else {}
        try:
            for key in sorted(targets - set(self.base)):
                self.base[key] = {name: _local(p).detach().to("cpu", copy=True)
                                  for name, p in self._module(key).named_parameters(recurse=False)}
            for key in sorted(self._touched):
                params = dict(self._module(key).named_parameters(recurse=False))
                for name, saved in self.base[key].items():
                    local = _local(params[name])
                    local.data.copy_(saved.to(local.device))
            self.current = ()
            self._touched = set(targets)  # restored at the next switch, even after a fuse that failed part-way
            if adapters:
                self.fuse(self.pipeline, [adapter for _, adapter in adapters])
            self.current = adapters
        finally:
            for name, device in moved.items():
                getattr(self.pipeline, name).to(device)
        self.switches += 1
        self.seconds += time.perf_counter() - start
        return True

    def summary(self) -> str:
        """``adapters: 4 switches, 1.20 s (0.30 s each); base weights held on the CPU: 41.9 MB``."""
        held = sum(t.numel() * t.element_size() for params in self.base.values() for t in params.values())
        return (f"adapters: {self.switches} switches, {self.seconds:.2f} s ({self.seconds / self.switches:.2f} s "
                f"each); base weights held on the CPU: {held / 1e6:.1f} MB")

    def _module(self, key: tuple[str, str]) -> torch.nn.Module:
        component, module = key
        return getattr(self.pipeline, component).get_submodule(module)

    def _to_cpu(self, components: Sequence[str]) -> dict[str, torch.device]:
        """Move these components to the CPU; their devices before, for those that moved."""
        moved = {}
        for name in components:
            model = getattr(self.pipeline, name, None)
            device = next(model.parameters()).device if model is not None else None
            if model is not None and device is not None and device.type != "cpu":
                model.to("cpu")
                moved[name] = device
        return moved


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard), else the parameter."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param
