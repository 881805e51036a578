"""Run Hugging Face diffusers pipelines over many devices and nodes with PyTorch Lightning.

The public names load on first use (so that ``lightning-diffusion --help`` and the command line's
quiet start-up come before torch, Lightning and diffusers are imported); using any of them also
registers the strategy names (``data_parallel``, ``context_parallel``...) with Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any, Optional, Sequence

from lightning_diffusion.core import interrupt

interrupt.on_import()  # Ctrl-C while the command line starts: one line, exit 130

from lightning_diffusion.core import console  # noqa: E402

console.configure()

__all__ = ["DiffusionModule", "ImageProgressBar", "ImageWriter", "PromptDataModule", "strategies"]
__version__ = "0.1.0"

_PUBLIC = {
    "DiffusionModule": "lightning_diffusion.module",
    "ImageProgressBar": "lightning_diffusion.run.progress",
    "ImageWriter": "lightning_diffusion.output.writer",
    "PromptDataModule": "lightning_diffusion.input.data",
}


# Modules that moved, by their old names: a config, a script or a SLURM job written with an old
# module path (the writer's class path before output/) keeps working, with a ``DeprecationWarning``
# naming the new path. A module that was split maps to the modules that hold its names now, looked
# up in order.
MOVED: dict[str, tuple[str, ...]] = {
    "records": ("input.records", "input.formats", "input.tables", "input.record_checks"),
    "data": ("input.data",), "batching": ("input.batching",), "costs": ("input.costs",),
    "inputs": ("input.images", "output.recorded"), "verdicts": ("input.verdicts",),
    "pipeline_facts": ("pipelines.facts",), "specs": ("pipelines.specs",), "tiny_zoo": ("pipelines.tiny_zoo",),
    "loading": ("pipelines.loading",), "lora": ("pipelines.lora",), "quantization": ("pipelines.quantization",),
    "cache": ("pipelines.cache",), "first_block_cache": ("pipelines.first_block_cache",), "tiny": ("pipelines.tiny",),
    "shapes": ("pipelines.shapes",), "staged": ("pipelines.staged",), "compat": ("pipelines.compat",),
    "hub": ("pipelines.hub",), "bare": ("pipelines.bare",),
    "group_work": ("strategies.group_work",), "accelerators": ("strategies.accelerators",),
    "writer": ("output.writer",), "store": ("output.folder_store", "output.store"),
    "object_store": ("output.object_store", "output.bucket"),
    "manifest": ("output.manifest", "output.recorded", "output.folder_store"),
    "files": ("output.files", "output.settings"),
    "background": ("output.background",), "lock": ("output.lock",), "shard": ("output.shard",),
    "settings": ("output.settings",),
    "config": ("run.config",), "config_guard": ("run.config_guard",), "preflight": ("run.preflight",),
    "progress": ("run.progress",), "run_context": ("core.context",),
    "errors": ("core.errors",), "console": ("core.console",), "groups": ("core.groups",),
    "boundaries": ("output.boundaries",),
    "interrupt": ("core.interrupt",), "run.interrupt": ("core.interrupt",),
    "preemption": ("core.preemption",), "run.preemption": ("core.preemption",), "run.context": ("core.context",),
    "failures": ("pipelines.failures",), "run.failures": ("pipelines.failures",),
    "model_checks": ("pipelines.checks",), "run.model_checks": ("pipelines.checks",),
    "validation": ("core.checks", "pipelines.checks", "input.settings", "output.store"),
    "run.validation": ("core.checks", "pipelines.checks", "input.settings", "output.store"),
}


class _SplitModule(ModuleType):
    """An old module whose names now live in several modules: each name from the first that has it."""

    def __init__(self, name: str, homes: tuple[ModuleType, ...]) -> None:
        super().__init__(name)
        self._homes = homes

    def __getattr__(self, attribute: str) -> Any:
        for home in self._homes:
            if hasattr(home, attribute):
                return getattr(home, attribute)
        raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(h.__name__ for h in self._homes)}) "
                             f"has no attribute {attribute!r}")


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A module's old dotted name imports as the module it moved to (the same module object), or as
    the modules it was split into; either way with a ``DeprecationWarning`` naming the new path."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        old = fullname[len(__name__) + 1:] if fullname.startswith(__name__ + ".") else None
        if old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = [f"{__name__}.{home}" for home in MOVED[spec.name[len(__name__) + 1:]]]
        warnings.warn(f"{spec.name} is now {' and '.join(new)}; import it from there (the old name will be removed).",
                      DeprecationWarning, stacklevel=2)
        homes = tuple(importlib.import_module(name) for name in new)
        if len(homes) > 1:
            return _SplitModule(spec.name, homes)
        spec.loader_state = homes[0].__spec__  # the import machinery sets ``__spec__`` to the alias's next
        return homes[0]

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        if alias is not None and isinstance(alias.loader_state, importlib.machinery.ModuleSpec):
            module.__spec__ = alias.loader_state


if not any(type(finder).__name__ == "_MovedModules" for finder in sys.meta_path):  # one, even after a reload
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    # Python scripts start as quietly as the command line: third-party start-up noise (transformers'
    # and diffusers' advisories, torchao's extension warnings, Lightning's banners) is hidden unless
    # LIGHTNING_DIFFUSION_VERBOSE=1 (the command line's --verbose). Before the imports below.
    console.quiet()
    if name == "strategies":
        return importlib.import_module("lightning_diffusion.strategies")
    if name in _PUBLIC:
        importlib.import_module("lightning_diffusion.strategies")  # registers the strategy names
        console.quiet_lightning()
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'lightning_diffusion' has no attribute {name!r}")
