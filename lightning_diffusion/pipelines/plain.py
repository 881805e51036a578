"""A loaded pipeline's accelerators, and the same pipeline with them off for one call (the audit's
paired baseline, ``output.audit``).

Turned off for the call and put back after it: the step cache (``model.cache``: ours is bypassed,
diffusers' hooks removed), ``model.compile`` (the compiled call of each module set aside, so the
eager forward runs), a fast attention backend (``model.attention_backend`` or the strategy's: each
attention processor set to diffusers' default, ``native``, torch's scaled dot-product attention;
under ring attention on CUDA, where ``native`` cannot run, ``_native_cudnn``, the one a ring group
picks when none is set), a float32 matmul precision under ``highest`` (TF32, set in the process)
and ``model.quantization`` (torchao: each quantized component's parameters swapped for those of a
full-precision copy loaded once, in the run's dtype, kept on the CPU and moved onto the devices
for the call; ``PlainWeights``).

The run's ``model.torch_dtype`` stays: the dtype is the product the run makes, not an accelerator
(a bfloat16 run's plain equivalent is the same weights in bfloat16 without the rest).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_diffusion.pipelines.cache import StepCache

# The model options an audit turns off (``model.<name>``); besides, the strategy's attention
# backend, ``DIFFUSERS_ATTN_BACKEND`` and a float32 matmul precision under highest (``MATMUL``).
TURNED_OFF = ("cache", "compile", "attention_backend", "quantization")
MATMUL = "torch.float32_matmul_precision"
# from_pretrained arguments that choose a component's files (the pipeline's own, such as custom_pipeline, do not)
FILE_ARGUMENTS = ("revision", "variant", "cache_dir", "local_files_only", "token", "use_safetensors")


@dataclass(frozen=True)
class Accelerators:
    """The accelerators a run has on, each as ``model.<name>`` (or ``torch.float32_matmul_precision``),
    all of which an audit turns off, and the run's dtype (``dtype``: it stays)."""

    off: tuple[str, ...]
    dtype: str = "float32"

    @classmethod
    def of(cls, cache: Optional[Mapping[str, Any]], options: Mapping[str, Any], torch_dtype: str,
           strategy_backend: Optional[str] = None, matmul_precision: str = "highest",
           environment_backend: Optional[str] = None) -> Accelerators:
        """From the model's settings: ``cache`` (``model.cache``), ``options`` (``ModelSettings.options``),
        the dtype's name, the strategy's attention backend, the process's float32 matmul precision
        and ``DIFFUSERS_ATTN_BACKEND``."""
        attention = ("model.attention_backend" if options.get("attention_backend") is not None
                     else "the strategy's attention_backend" if strategy_backend is not None
                     else "DIFFUSERS_ATTN_BACKEND" if environment_backend not in (None, "", "native") else None)
        on = {"model.cache": cache is not None, "model.compile": bool(options.get("compile")), attention: True,
              "model.quantization": bool(options.get("quantization")), MATMUL: matmul_precision != "highest"}
        off = [name for name, is_on in on.items() if is_on and name is not None]
        return cls(tuple(off), torch_dtype)

    def describe(self) -> str:
        """One line: what the audit compares (a determinism check when nothing is turned off)."""
        dtype = f" in the run's {self.dtype}"
        if not self.off:
            return (f"no accelerator to turn off: the audit re-makes the same images the same way{dtype}, a "
                    "determinism check")
        return f"re-made with {', '.join(self.off)} off{dtype}"


def quantization_problems(spec: Optional[Mapping[str, Any]], adapters: Sequence[object]) -> list[str]:
    """What keeps an audit from re-making a quantized run with full-precision weights, one line each
    (checked before the weights load)."""
    if not spec:
        return []
    backend = spec.get("backend")
    if backend != "torchao":
        return [f"writer.audit with model.quantization backend {backend!r}: the audit's plain re-make swaps the "
                f"quantized weights for full-precision ones, which only torchao's keep in the model's own layers "
                f"({backend} replaces the layers): audit a torchao run, or leave writer.audit out."]
    if adapters:
        return ["writer.audit with model.quantization and model.lora: the full-precision copy the audit loads "
                "would lack the fused adapters: leave writer.audit or model.lora out."]
    return []


@dataclass
class PlainWeights:
    """The full-precision parameters of a run's quantized components, by component and name, loaded
    once (``load``) on the CPU in the run's dtype."""

    weights: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def load(cls, info: Any, dtype: torch.dtype, names: Sequence[str],
             from_pretrained_kwargs: Mapping[str, Any]) -> PlainWeights:
        """``names``' weights from ``info``'s folder (a ``PipelineInfo``), without quantization."""
        options = {"use_safetensors": True, **{k: v for k, v in from_pretrained_kwargs.items() if k in FILE_ARGUMENTS}}
        weights = {}
        for name in names:
            model = info.component_class(name).from_pretrained(info.path, subfolder=name, dtype=dtype, **options)
            weights[name] = {key: p.detach() for key, p in model.named_parameters()}
        return cls(weights)

    @contextmanager
    def swapped_in(self, components: Mapping[str, nn.Module]) -> Iterator[None]:
        """Each of ``components`` (by name) with these parameters in place of its own, each moved to
        the device of the one it replaces; its own back after."""
        swapped: list[tuple[nn.Module, str, Any]] = []
        try:
            for name, weights in self.weights.items():
                component = components[name]
                for key, tensor in weights.items():
                    owner_name, _, leaf = key.rpartition(".")
                    owner = component.get_submodule(owner_name)
                    own = owner._parameters[leaf]
                    assert own is not None
                    swapped.append((owner, leaf, own))
                    owner._parameters[leaf] = nn.Parameter(tensor.to(own.device), requires_grad=False)
            yield
        finally:
            for owner, leaf, own in reversed(swapped):
                owner._parameters[leaf] = own


def plain_backend(processor: Any) -> str:
    """The attention backend a plain call gives ``processor``: diffusers' default, ``native``;
    ``_native_cudnn`` under ring attention on CUDA (``native`` returns no log-sum-exp there)."""
    config = getattr(processor, "_parallel_config", None)
    context = getattr(config, "context_parallel_config", None)
    ring = getattr(context, "ring_degree", 1) or 1
    return "_native_cudnn" if ring > 1 and torch.cuda.is_available() else "native"


@contextmanager
def _native_attention(denoisers: Mapping[str, nn.Module]) -> Iterator[None]:
    """The denoisers' attention processors that name a backend on ``plain_backend``, and diffusers'
    process-wide active backend (what the others follow; ``set_attention_backend`` and
    ``DIFFUSERS_ATTN_BACKEND`` set it) on ``native``; theirs back after."""
    from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend

    processors: list[Any] = [m.processor for d in denoisers.values() for m in d.modules()
                  if getattr(getattr(m, "processor", None), "_attention_backend", None) is not None]
    saved = [(p, p._attention_backend) for p in processors]
    try:
        for processor, _ in saved:
            processor._attention_backend = AttentionBackendName(plain_backend(processor))
        with attention_backend(AttentionBackendName.NATIVE):
            yield
    finally:
        for processor, backend in saved:
            processor._attention_backend = backend


@contextmanager
def _highest_matmul_precision() -> Iterator[None]:
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


@contextmanager
def accelerators_off(pipeline: Any, step_cache: Optional[StepCache], denoisers: Mapping[str, nn.Module],
                     plain_weights: Optional[PlainWeights] = None,
                     components: Optional[Mapping[str, nn.Module]] = None) -> Iterator[None]:
    """``pipeline`` with its step cache and compilation off inside the ``with`` block, back on after.
    ``denoisers``: its denoiser components (``PipelineLoader.denoiser_modules``), their attention
    on diffusers' default backend; ``plain_weights``: the full-precision
    parameters swapped into ``components`` (the pipeline's, by name) for the call."""
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
        with ExitStack() as stack:
            stack.enter_context(_highest_matmul_precision())
            stack.enter_context(_native_attention(denoisers))
            if plain_weights is not None:
                stack.enter_context(plain_weights.swapped_in(components or {}))
            yield
    finally:
        for module, call in compiled:
            module._compiled_call_impl = call
        for component, config in removed:
            component.enable_cache(config)
        if first_block:
            assert step_cache is not None
            step_cache.bypass = False

