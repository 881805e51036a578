"""The pipeline: what it is before its weights load, how it loads, and what runs on top of it.

Entry point: ``PipelineInfo`` (``model_folder``), what the project knows of a model before its
weights load. Beside it: ``facts`` (read from the pipeline's class and configs), ``specs`` (what
cannot be read: one ``PipelineSpec`` a pipeline class), ``loading`` (``from_pretrained`` with the
strategy's load plan), ``lora``, ``quantization``, ``cache`` and ``first_block_cache``, ``staged``,
``hub`` (weights on the Hub), ``compat`` (workarounds for diffusers' version), ``bare`` (diffusers
called directly, the benchmarks' reference) and the tiny offline pipelines (``tiny``, ``tiny_zoo``,
``shapes``).
"""

from typing import Any

__all__ = ["PipelineInfo"]


def __getattr__(name: str) -> Any:
    if name == "PipelineInfo":
        from lightning_diffusion.pipelines.model_folder import PipelineInfo
        return PipelineInfo
    raise AttributeError(f"module 'lightning_diffusion.pipelines' has no attribute {name!r}")
