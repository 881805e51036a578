"""``model.quantization``: diffusers' on-the-fly quantization of chosen components as they load.

A config names a diffusers quantization backend, its arguments and the components to quantize::

    quantization: {backend: torchao, quant_type: int8wo, components: [transformer]}

``check`` validates it against the pipeline's configs (no weight is read); ``device_problems`` says
why it cannot run on the strategy's device (a CPU rehearsal cannot run GPU kernels); ``config``
builds the ``PipelineQuantizationConfig`` that ``DiffusionPipeline.from_pretrained`` applies, with
one backend config per component (diffusers' class for diffusers models, transformers' for text
encoders). Backends that load pre-quantized checkpoints (gguf...) are not on-the-fly: such a model
folder carries its own quantization config and loads as it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

import torch

from lightning_diffusion.core.errors import ConfigError, NodeConfigError, run_check

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from diffusers.quantizers.pipe_quant_config import PipelineQuantizationConfig
    from diffusers.quantizers.quantization_config import QuantizationConfigMixin as DiffusersQuantizationConfig
    from transformers.utils.quantization_config import QuantizationConfigMixin as TransformersQuantizationConfig

    # A backend config of one component: diffusers' class for diffusers models, transformers' for text encoders.
    BackendConfig = Union[DiffusersQuantizationConfig, TransformersQuantizationConfig]

# Backends that quantize full-precision weights while they load, and the package each needs.
BACKEND_PACKAGES = {
    "torchao": "torchao",
    "bitsandbytes_4bit": "bitsandbytes",
    "bitsandbytes_8bit": "bitsandbytes",
    "quanto": "optimum.quanto",
    "modelopt": "modelopt",
}
# Backends whose kernels need a GPU (diffusers' bitsandbytes quantizer refuses a machine without one).
GPU_BACKENDS = ("bitsandbytes_4bit", "bitsandbytes_8bit", "modelopt")

# torchao's configs by short name, and whether their kernels run on a CPU (torchao 0.18: int4 needs
# the mslk package and a GPU; float8 dynamic activations need CUDA compute capability 8.9+).
TORCHAO_TYPES = {
    "int8wo": ("Int8WeightOnlyConfig", True),
    "int8dq": ("Int8DynamicActivationInt8WeightConfig", True),
    "float8wo": ("Float8WeightOnlyConfig", True),
    "float8dq": ("Float8DynamicActivationFloat8WeightConfig", False),
    "int4wo": ("Int4WeightOnlyConfig", False),
}
RESERVED = ("backend", "quant_type", "components")


@contextlib.contextmanager
def _quiet_torchao() -> Iterator[None]:
    """torchao warns at import about its CUDA extensions it cannot load on this machine."""
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _torchao_class(quant_type: str) -> type:
    with _quiet_torchao():
        import torchao.quantization as ao
    name = TORCHAO_TYPES[quant_type][0] if quant_type in TORCHAO_TYPES else quant_type
    cls = getattr(ao, name, None)
    if not isinstance(cls, type) or not name.endswith("Config"):
        raise ConfigError(
            f"model.quantization.quant_type {quant_type!r} is not a torchao quantization: use one of "
            f"{', '.join(TORCHAO_TYPES)} or a torchao.quantization config class name (such as Int8WeightOnlyConfig)."
        )
    return cls


def components(spec: Mapping[str, Any], default: tuple[str, ...]) -> list[str]:
    """The components a spec quantizes: its ``components``, else the pipeline's denoisers."""
    chosen = spec.get("components")
    if chosen is None:
        return list(default)
    return [chosen] if isinstance(chosen, str) else list(chosen)


def check(spec: object, model_index: Mapping[str, Any], classes: Mapping[str, Optional[type]],
          default: tuple[str, ...]) -> list:
    """``model.quantization`` against the installed backends and the pipeline's components
    (``model_index``: component name to ``[library, class]``; ``classes``: name to class, where
    diffusers or transformers has it); ``default``: the denoisers."""
    if not isinstance(spec, Mapping):
        return [f"model.quantization is a mapping such as {{backend: torchao, quant_type: int8wo}}, not {spec!r}."]
    backend = spec.get("backend")
    if backend not in BACKEND_PACKAGES:
        from diffusers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

        if backend in AUTO_QUANTIZATION_CONFIG_MAPPING:
            return [f"model.quantization.backend {backend!r} loads checkpoints that are already quantized: point "
                    "model.pretrained_model_name_or_path at such a folder (its config carries the quantization) and "
                    f"drop model.quantization. Quantizing while loading: {', '.join(BACKEND_PACKAGES)}."]
        return [f"model.quantization.backend must be one of {', '.join(BACKEND_PACKAGES)}, not {backend!r}."]
    package = BACKEND_PACKAGES[backend]
    if importlib.util.find_spec(package.split(".")[0]) is None or importlib.util.find_spec(package) is None:
        return [f"model.quantization.backend {backend!r} needs the {package} package, which is not installed: "
                f"pip install {package.replace('.', '-')}."]
    names = components(spec, default)
    models = sorted(name for name, cls in classes.items() if isinstance(cls, type) and issubclass(cls, torch.nn.Module))
    unknown = [n for n in names if n not in models]
    if not names or unknown:
        return [f"model.quantization.components {unknown or names!r}: this pipeline's models are {', '.join(models)}."]
    if backend == "torchao":
        quant_type = spec.get("quant_type")
        if not isinstance(quant_type, str):
            return [f"model.quantization with torchao needs quant_type: one of {', '.join(TORCHAO_TYPES)} "
                    "(or a torchao.quantization config class name)."]
    elif "quant_type" in spec:
        return [f"model.quantization.quant_type is torchao's; {backend} takes its own arguments "
                f"({', '.join(_arguments(_backend_class(backend, 'diffusers')))})."]
    problems: list = []
    for name in names:  # unknown arguments fail here, before any weight loads
        run_check(problems, _build, spec, model_index[name][0])
    return problems[:1]


def device_problems(spec: Optional[Mapping[str, Any]], device: torch.device) -> list:
    """Quantized kernels that cannot run on ``device``: GPU-only ones in a CPU rehearsal; on CUDA
    (where this process sees the GPUs) FP8 below compute capability 8.9 (this node's problem: a
    ``NodeConfigError``) and int4 without mslk."""
    if spec is None:
        return []
    backend, quant_type = spec.get("backend"), spec.get("quant_type")
    if device.type == "cuda" and backend == "torchao":
        if quant_type == "float8dq" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            return [NodeConfigError("model.quantization: torchao float8dq needs CUDA compute capability 8.9 or higher "
                                    f"(this GPU: {'.'.join(map(str, torch.cuda.get_device_capability()))}); use "
                                    "int8wo or int8dq.")]
        if quant_type == "int4wo" and importlib.util.find_spec("mslk") is None:
            return ["model.quantization: torchao int4wo needs the mslk package: pip install mslk."]
    if device.type != "cpu":
        return []
    gpu_only = backend in GPU_BACKENDS or (backend == "torchao" and quant_type in TORCHAO_TYPES
                                           and not TORCHAO_TYPES[quant_type][1])
    if gpu_only:
        what = f"torchao {quant_type}" if backend == "torchao" else backend
        cpu = [k for k, (_, on_cpu) in TORCHAO_TYPES.items() if on_cpu]
        return [f"model.quantization: {what} needs a GPU; on CPU use torchao with quant_type {', '.join(cpu)} "
                "(or quanto)."]
    return []


def _backend_class(backend: str, library: str) -> type:
    if library == "transformers":
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    else:
        from diffusers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    if backend not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise ConfigError(f"model.quantization: {library} has no {backend} quantizer, so it cannot quantize that "
                          f"library's components; leave them out of model.quantization.components.")
    return AUTO_QUANTIZATION_CONFIG_MAPPING[backend]


def _arguments(cls: type[Any]) -> list[str]:
    return [n for n, p in inspect.signature(cls.__init__).parameters.items()
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _build(spec: Mapping[str, Any], library: str) -> BackendConfig:
    """The backend config for one component of ``library`` (diffusers or transformers)."""
    backend = spec["backend"]
    extra = {k: v for k, v in spec.items() if k not in RESERVED}
    if backend == "torchao":
        ao_class = _torchao_class(spec["quant_type"])
        try:
            quant_type = ao_class(**extra)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.quantization: torchao's {ao_class.__name__} takes "
                              f"{', '.join(_arguments(ao_class)) or 'no arguments'}: {err}") from None
        with _quiet_torchao():
            return _backend_class(backend, library)(quant_type=quant_type)
    if backend.startswith("bitsandbytes"):
        extra = {f"load_in_{backend.rsplit('_', 1)[1]}": True, **extra}
    cls = _backend_class(backend, library)
    unknown = sorted(set(extra) - set(_arguments(cls)))
    if unknown:
        raise ConfigError(f"model.quantization: {library}'s {cls.__name__} takes {', '.join(_arguments(cls))}; "
                          f"unknown: {', '.join(unknown)}.")
    try:
        return cls(**extra)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.quantization: {library}'s {cls.__name__}: {err}") from None


def component_configs(spec: Mapping[str, Any], model_index: Mapping[str, Any],
                      default: tuple[str, ...]) -> dict[str, BackendConfig]:
    """Each quantized component's backend config (its ``from_pretrained(quantization_config=...)``)."""
    return {name: _build(spec, model_index[name][0]) for name in components(spec, default)}


def pipeline_config(configs: Mapping[str, BackendConfig]) -> PipelineQuantizationConfig:
    """The ``PipelineQuantizationConfig`` of ``DiffusionPipeline.from_pretrained`` for ``configs``."""
    from diffusers import PipelineQuantizationConfig

    return PipelineQuantizationConfig(quant_mapping=dict(configs))


def left_unquantized(pipeline: DiffusionPipeline, spec: Mapping[str, Any], names: Sequence[str]
                     ) -> dict[str, tuple[int, int]]:
    """torchao: the quantized components' linear layers that loaded in full precision (a device map
    offloaded them: diffusers does not quantize weights placed on the CPU or disk), as
    ``{component: (left, linear layers)}``; other backends are not inspected."""
    if spec.get("backend") != "torchao":
        return {}
    from torchao.utils import TorchAOBaseTensor

    left = {}
    for name in names:
        layers = [m for m in getattr(pipeline, name).modules() if isinstance(m, torch.nn.Linear)]
        plain = sum(not isinstance(m.weight, TorchAOBaseTensor) for m in layers)
        if plain:
            left[name] = (plain, len(layers))
    return left


def quantized(spec: Optional[Mapping[str, Any]], default: tuple[str, ...]) -> list[str]:
    """The components ``spec`` quantizes (none without a spec)."""
    return components(spec, default) if spec is not None else []
