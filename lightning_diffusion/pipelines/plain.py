"""A loaded pipeline's accelerators, and the same pipeline with them off for one call (the audit's
paired baseline, ``output.audit``).

What can be turned off in place, with nothing loaded again: the step cache (``model.cache``: ours
is bypassed, diffusers' hooks removed and put back) and ``model.compile`` (the compiled call of
each module set aside, so the eager forward runs). What stays on, because its plain equivalent
is other weights or another kernel set up by the strategy: ``model.quantization`` (its
full-precision weights are not loaded twice), ``model.attention_backend`` (a context-parallel
group needs the one it set up) and a low-precision ``model.torch_dtype``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from lightning_diffusion.pipelines.cache import StepCache

# What turns off in place, and what stays on, as the audit names them.
TURNED_OFF = ("cache", "compile")
KEPT_ON = ("quantization", "attention_backend", "torch_dtype")


@dataclass(frozen=True)
class Accelerators:
    """The accelerators a run has on: ``off`` those an audit turns off (``TURNED_OFF``), ``kept``
    those it leaves on (``KEPT_ON``), each as ``model.<name>``."""

    off: tuple[str, ...]
    kept: tuple[str, ...]

    @classmethod
    def of(cls, cache: Optional[Mapping[str, Any]], options: Mapping[str, Any], torch_dtype: str) -> Accelerators:
        """From the model's settings: ``cache`` (``model.cache``), ``options`` (``ModelSettings.options``)
        and the dtype's name."""
        on = {"cache": cache is not None, "compile": bool(options.get("compile")),
              "quantization": bool(options.get("quantization")),
              "attention_backend": options.get("attention_backend") is not None,
              "torch_dtype": torch_dtype in ("bfloat16", "float16")}
        return cls(tuple(f"model.{n}" for n in TURNED_OFF if on[n]), tuple(f"model.{n}" for n in KEPT_ON if on[n]))

    def describe(self) -> str:
        """One line: what the audit compares (a determinism check when nothing is turned off)."""
        kept = f"; {', '.join(self.kept)} stay{'s' if len(self.kept) == 1 else ''} on" if self.kept else ""
        if not self.off:
            return (f"no accelerator to turn off{kept}: the audit re-makes the same images the same way, a "
                    "determinism check")
        return f"re-made with {', '.join(self.off)} off{kept}"


@contextmanager
def accelerators_off(pipeline: Any, step_cache: Optional[StepCache], denoisers: Mapping[str, nn.Module]
                     ) -> Iterator[None]:
    """``pipeline`` with its step cache and compilation off inside the ``with`` block, back on after.
    ``denoisers``: its denoiser components (``PipelineLoader.denoiser_modules``)."""
    from diffusers.models.cache_utils import CacheMixin

    removed: list[tuple[Any, Any]] = []
    compiled: list[tuple[nn.Module, Any]] = []
    first_block = step_cache is not None and step_cache.kind == "first_block"
    try:
        if first_block:
            assert step_cache is not None
            step_cache.bypass = True
        else:
            for component in pipeline.components.values():
                config = getattr(component, "_cache_config", None)
                if isinstance(component, CacheMixin) and config is not None:
                    component.disable_cache()
                    removed.append((component, config))
        for denoiser in denoisers.values():
            for module in denoiser.modules():
                call = getattr(module, "_compiled_call_impl", None)
                if call is not None:  # nn.Module.compile's: the module calls it in place of forward
                    compiled.append((module, call))
                    module._compiled_call_impl = None
        yield
    finally:
        for module, call in compiled:
            module._compiled_call_impl = call
        for component, config in removed:
            component.enable_cache(config)
        if first_block:
            assert step_cache is not None
            step_cache.bypass = False
