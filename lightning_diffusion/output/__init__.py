"""Where the images go: the writer callback, the stores it records into, and their records.

Entry point: ``ImageWriter`` (``writer``). Beside it: ``files`` (names, formats, one atomic write),
``background`` (writing off the prediction thread), ``settings`` (the writer's options), the stores
(``folder_store``, ``object_store``) with their ``manifest``, ``lock`` and ``status``, ``shard`` (the
images of one job-array task) and ``pool`` (workers that claim batches).
"""

from typing import Any

__all__ = ["ImageWriter"]


def __getattr__(name: str) -> Any:
    if name == "ImageWriter":  # imported on first use: torch and Lightning load with it
        from lightning_diffusion.output.writer import ImageWriter
        return ImageWriter
    raise AttributeError(f"module 'lightning_diffusion.output' has no attribute {name!r}")
