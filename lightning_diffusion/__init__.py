"""Run Hugging Face diffusers pipelines over many devices and nodes with PyTorch Lightning.

The public names load on first use (so that ``lightning-diffusion --help`` and the command line's
quiet start-up come before torch, Lightning and diffusers are imported); using any of them also
registers the strategy names (``data_parallel``, ``context_parallel``...) with Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_diffusion import interrupt

interrupt.on_import()  # Ctrl-C while the command line starts: one line, exit 130

from lightning_diffusion import console  # noqa: E402

console.configure()

__all__ = ["DiffusionModule", "ImageProgressBar", "ImageWriter", "PromptDataModule", "strategies"]
__version__ = "0.1.0"

_PUBLIC = {
    "DiffusionModule": "lightning_diffusion.module",
    "ImageProgressBar": "lightning_diffusion.progress",
    "ImageWriter": "lightning_diffusion.writer",
    "PromptDataModule": "lightning_diffusion.data",
}


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
