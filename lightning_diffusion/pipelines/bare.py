"""Diffusers called directly: the reference that ``benchmark --compare-diffusers`` and the scripts
in ``benchmarks/`` time this project against, written once so that every comparison makes the same
call (a hand-written script's: the pipeline loaded as it is, no progress bar, one CPU generator per
image seeded as ``DiffusionModule`` seeds it, under ``torch.inference_mode``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_diffusion.pipelines.model_folder import inspect_pipeline, resolve_dtype


def load(model: str, dtype: str = "float32", device: Optional[torch.device] = None,
         pipeline_class: Optional[str] = None) -> Any:
    """The pipeline of ``model`` (a path, hub id or ``tiny:NAME``) in ``dtype``, on ``device`` when
    given, with its progress bar off."""
    from lightning_diffusion.core.console import no_progress_bars

    info = inspect_pipeline(model, pipeline_class)
    with no_progress_bars():  # predict shows none either
        pipe = info.pipeline_class.from_pretrained(info.path, dtype=resolve_dtype(dtype))
    if device is not None:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call(pipe: Any, prompts: Sequence[str], seeds: Sequence[int], **call_args: Any) -> Any:
    """One call of ``pipe`` on ``prompts``, image ``i`` drawn from ``seeds[i]`` (a CPU generator each,
    as ``DiffusionModule`` draws it); returns the pipeline's output."""
    with torch.inference_mode():
        return pipe(prompt=list(prompts), generator=[torch.Generator("cpu").manual_seed(int(s)) for s in seeds],
                    **call_args)
