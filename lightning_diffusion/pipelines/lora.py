"""``model.lora``: adapters fused into the weights before inference, under every strategy.

    lora:
      - {path: loras/style.safetensors, scale: 0.8}
      - {path: loras/subject, weight_name: pytorch_lora_weights.safetensors}

Whole weights (data, context and CFG parallel, device map): diffusers' own ``load_lora_weights``,
``set_adapters`` with the scales, ``fuse_lora`` and ``unload_lora_weights``, so inference runs on
plain layers at full speed. Weights a device map placed, and tensor-parallel shards: diffusers
would re-place the first and refuses the second, so ``fuse_in_place`` adds to each rank's shard
its own slice of every update, ``scale x alpha/r x B @ A`` cut exactly as the ``_tp_plan`` cuts
the weight (rows of B for a colwise weight, columns of A for a rowwise one, block by block for
packed projections): no rank builds a whole weight or a whole update. Both read the adapter
through the pipeline class's ``lora_state_dict`` (which converts the community formats) and
peft's rank and alpha rules.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch.distributed.device_mesh import DeviceMesh

ADAPTER_KEYS = ("path", "weight_name", "scale", "allow_pickle")


@dataclass(frozen=True)
class Adapter:
    file: Path
    scale: float = 1.0
    allow_pickle: bool = False

    @property
    def name(self) -> str:
        return self.file.name

    def sha256(self) -> str:
        digest = hashlib.sha256()
        with self.file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()


def parse(spec: object) -> list[Adapter]:
    """``model.lora`` as adapters; every problem is raised together."""
    if spec is None:
        return []
    adapters: list[Adapter] = []
    problems: list[str] = []
    for n, item in enumerate(spec if isinstance(spec, list) else [spec]):
        adapter = _parse_one(item, f"model.lora[{n}]", problems)
        if adapter is not None:
            adapters.append(adapter)
    _raise(problems)
    return adapters


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else f"{len(problems)} problems:\n  - "
                          + "\n  - ".join(problems))


def _parse_one(item: object, where: str, problems: list[str]) -> Optional[Adapter]:
    """One adapter's mapping (or a path alone), its problems added to ``problems``."""
    if isinstance(item, str):
        item = {"path": item}
    if not isinstance(item, Mapping) or "path" not in item:
        problems.append(f"{where} is a mapping such as {{path: loras/style.safetensors, scale: 0.8}}, not {item!r}.")
        return None
    unknown = sorted(set(item) - set(ADAPTER_KEYS))
    if unknown:
        problems.append(f"{where} takes {', '.join(ADAPTER_KEYS)}; unknown: {', '.join(unknown)}.")
    scale = item.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        problems.append(f"{where}.scale must be a number (negative for slider adapters), not {scale!r}.")
    path = Path(str(item["path"])).expanduser()
    file = path / item["weight_name"] if item.get("weight_name") else path
    if path.is_dir() and not item.get("weight_name"):
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if len(found) != 1:
            problems.append(f"{where}: {path} is a folder with {len(found)} .safetensors files; name one with "
                            f"weight_name{': ' + ', '.join(found[:5]) if found else ''}.")
            return None
        file = path / found[0]
    if not file.is_file():
        problems.append(f"{where}: {file} does not exist.")
        return None
    if not os.access(file, os.R_OK):
        problems.append(f"{where}: {file} cannot be read (permissions).")
        return None
    if file.suffix != ".safetensors" and not item.get("allow_pickle"):
        problems.append(f"{where}: {file.name} is not a .safetensors file; pickle files run code when they load: "
                        "convert it, or set allow_pickle: true for an adapter you trust.")
        return None
    return Adapter(file, float(scale) if isinstance(scale, (int, float)) else 1.0, bool(item.get("allow_pickle")))


def record(adapters: Sequence[Adapter]) -> list[dict[str, Any]]:
    """What run.json and each image's metadata record of the adapters."""
    return [{"file": a.name, "sha256": a.sha256(), "scale": a.scale} for a in adapters]


# Adapters read, most recently used last: a replica switching between adapter sets reads each once
# (``keep_read``: how many are held; ``model.max_loaded_adapters``).
_READ: OrderedDict[tuple, tuple[dict[str, torch.Tensor], dict, Optional[dict]]] = OrderedDict()
_KEEP = [0]


def keep_read(most: int) -> None:
    """Hold up to ``most`` adapters read (least recently used dropped first); 0: none."""
    _KEEP[0] = most
    while len(_READ) > most:
        _READ.popitem(last=False)


def read(pipeline_class: type, adapter: Adapter) -> tuple[dict[str, torch.Tensor], dict, Optional[dict]]:
    """(state dict in diffusers' naming, network alphas, peft metadata) of one adapter; held for the
    next call while ``keep_read`` allows (keyed by the file's path, size and time, so a file changed
    since is read again)."""
    stat = adapter.file.stat()
    key = (pipeline_class, str(adapter.file), stat.st_size, stat.st_mtime_ns, adapter.allow_pickle)
    if key in _READ:
        _READ.move_to_end(key)
        return _READ[key]
    found = _read(pipeline_class, adapter)
    if _KEEP[0]:
        _READ[key] = found
        keep_read(_KEEP[0])
    return found


def _read(pipeline_class: type, adapter: Adapter) -> tuple[dict[str, torch.Tensor], dict, Optional[dict]]:
    if not hasattr(pipeline_class, "lora_state_dict"):
        raise ConfigError(f"model.lora: {pipeline_class.__name__} cannot load LoRA adapters (diffusers has no "
                          "LoRA loader for it).")
    import inspect

    alphas_too = "return_alphas" in inspect.signature(pipeline_class.lora_state_dict).parameters  # FLUX.1's
    out = pipeline_class.lora_state_dict(
        str(adapter.file.parent), weight_name=adapter.file.name, return_lora_metadata=True,
        allow_pickle=adapter.allow_pickle, **({"return_alphas": True} if alphas_too else {}))
    state, alphas, metadata = out if alphas_too else (out[0], None, out[1])
    return state, alphas or {}, metadata


def targets(pipeline_class: type, adapter: Adapter) -> dict[str, set[str]]:
    """``{component: {module}}`` an adapter targets (``targets_in`` its state as read)."""
    return targets_in(read(pipeline_class, adapter)[0])


def targets_in(state: Mapping[str, torch.Tensor]) -> dict[str, set[str]]:
    """``{component: {module}}`` the converted keys of an adapter's state target (``x.lora_A.weight``,
    ``x.lora_linear_layer.up.weight``, ...): what any strategy can check before loading."""
    found: dict[str, set[str]] = {}
    for key in state:
        component, _, rest = key.partition(".")
        module = rest.split(".lora", 1)[0] if ".lora" in rest else rest.rsplit(".", 1)[0]
        found.setdefault(component, set()).add(module)
    return found


def updates(pipeline_class: type, adapter: Adapter) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]]:
    """``{component: {module: (A, B, scaling)}}``: the low-rank pairs of one adapter and the factor
    peft would apply (``scale x alpha / r``, or ``/ sqrt(r)`` with rsLoRA)."""
    from diffusers.utils.peft_utils import get_peft_kwargs
    from peft.utils.other import get_pattern_key

    state, alphas, metadata = read(pipeline_class, adapter)
    found: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    unknown = [k for k in state if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"))]
    if unknown:
        raise ConfigError(f"model.lora: {adapter.name} has entries that are not LoRA weight pairs "
                          f"({', '.join(unknown[:3])}: DoRA magnitudes, biases or full weights), which can be fused "
                          "only by diffusers on whole weights: use data_parallel or context parallelism, or a device "
                          "map, for this adapter.")
    for component in sorted({k.split(".", 1)[0] for k in state}):
        prefix = component + "."
        pairs = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        component_alphas = {k[len(prefix):]: v for k, v in alphas.items() if k.startswith(prefix)} or None
        # as diffusers' load_lora_adapter: the file's peft config when it has one, else one inferred
        # from the ranks and (community formats) the network alphas
        config = {k[len(prefix):]: v for k, v in (metadata or {}).items() if k.startswith(prefix)} or None
        if config is None:
            ranks = {f"^{k}": v.shape[1] for k, v in pairs.items() if "lora_B" in k and v.ndim > 1}
            config = get_peft_kwargs(ranks, network_alpha_dict=component_alphas, peft_state_dict=pairs)
        if config.get("use_dora") or config.get("lora_bias"):
            raise ConfigError(f"model.lora: {adapter.name} is a {'DoRA' if config.get('use_dora') else 'biased'} "
                              "adapter, which only diffusers can fuse, on whole weights: use data_parallel or context "
                              "parallelism for it.")
        modules = {}
        for key in pairs:
            if key.endswith(".lora_A.weight"):
                module = key[: -len(".lora_A.weight")]
                a, b = pairs[key], pairs[f"{module}.lora_B.weight"]
                rank = config.get("rank_pattern", {}).get(
                    get_pattern_key(config.get("rank_pattern", {}).keys(), module), config.get("r", a.shape[0]))
                alpha = config.get("alpha_pattern", {}).get(
                    get_pattern_key(config.get("alpha_pattern", {}).keys(), module), config.get("lora_alpha", rank))
                factor = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
                modules[module] = (a, b, adapter.scale * factor)
        found[component] = modules
    return found


def unknown_targets(found: Mapping[str, set[str]], modules: Mapping[str, set[str]]) -> list[str]:
    """The targets ``found`` (``targets``) that are no module of this pipeline (``modules``:
    component -> its module names; components not listed are not checked)."""
    missing = []
    for component, names in found.items():
        if component in modules:
            missing += [f"{component}.{m}" for m in sorted(names) if m not in modules[component]]
    return missing


def fuse(pipeline: DiffusionPipeline, adapters: Sequence[Adapter]) -> None:
    """diffusers' load, weight, fuse and unload on whole (unsharded) weights."""
    if not adapters:
        return
    names = [f"lora_{n}" for n in range(len(adapters))]
    for name, adapter in zip(names, adapters):
        pipeline.load_lora_weights(str(adapter.file.parent), weight_name=adapter.file.name, adapter_name=name,
                                   allow_pickle=adapter.allow_pickle)
    pipeline.set_adapters(names, adapter_weights=[a.scale for a in adapters])
    components = [c for c in getattr(pipeline, "_lora_loadable_modules", ["transformer"]) if getattr(pipeline, c, None)]
    pipeline.fuse_lora(components=components, lora_scale=1.0, adapter_names=names)
    pipeline.unload_lora_weights()


def fuse_in_place(pipeline: DiffusionPipeline, adapters: Sequence[Adapter],
                  shard_specs: Optional[Mapping[str, Mapping[str, Any]]] = None, tp_mesh: Optional[DeviceMesh] = None
                  ) -> None:
    """Add every adapter's update to the weights where they are (on their devices, placed by a
    device map), and of a sharded weight only this rank's slice (``shard_specs``: component ->
    diffusers' ``TPShardSpec`` by parameter name, on ``tp_mesh``)."""
    from diffusers.hooks.tensor_parallel import _local_shard
    from torch.distributed.tensor import DTensor

    for adapter in adapters:
        for component, modules in updates(type(pipeline), adapter).items():
            model = getattr(pipeline, component)
            specs = (shard_specs or {}).get(component, {})
            with torch.no_grad():
                for module, (a, b, factor) in modules.items():
                    weight = model.get_submodule(module).weight
                    if weight.device.type == "meta":
                        raise ConfigError(f"model.lora: {component}.{module} is offloaded (a device map put it on the "
                                          "CPU or disk behind a hook): an update cannot be fused into it.")
                    spec = specs.get(f"{module}.weight")
                    a, b = a.to(torch.float32), b.to(torch.float32)
                    if spec is not None and spec.dim == 0:
                        b = _local_shard(b, 0, spec.block_sizes, tp_mesh)  # the rows this rank holds
                    elif spec is not None and spec.dim == 1:
                        a = _local_shard(a, 1, spec.block_sizes, tp_mesh)  # the columns this rank holds
                    local = weight.to_local() if isinstance(weight, DTensor) else weight
                    a, b = a.to(local.device), b.to(local.device)  # on the rank's own device
                    delta = (b @ a) * factor
                    local.add_(delta.to(device=local.device, dtype=local.dtype))
