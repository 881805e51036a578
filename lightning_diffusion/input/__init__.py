"""Prompt records -> (index, seed) samples -> batches over the data-parallel dimension.

Entry point: ``PromptDataModule`` (``data``). The rest, in the order a run uses it: ``records`` (prompt
files read, what a record may hold), ``images`` (per-record input images), ``verdicts`` (the records a
pipeline cannot make), ``costs`` (what an image costs, which images share a call) and ``batching``
(the batch plan dealt to the replicas).
"""

from typing import Any

__all__ = ["PromptDataModule"]


def __getattr__(name: str) -> Any:
    if name == "PromptDataModule":  # imported on first use: torch and Lightning load with it
        from lightning_diffusion.input.data import PromptDataModule
        return PromptDataModule
    raise AttributeError(f"module 'lightning_diffusion.input' has no attribute {name!r}")
