"""The model group checked before any weight loads (``pipelines.settings.ModelSettings``):
the pipeline's folder and class, the call arguments, and each option against the pipeline
(attention backend, compile, VAE tiling and slicing, step cache, LoRA adapters, quantization).
Rules follow ``core.checks``' convention: each returns its problems.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from lightning_diffusion.core.checks import MAX_GUIDANCE, MAX_PIXELS, MAX_STEPS, finite, integer, number
from lightning_diffusion.core.errors import ConfigError, is_int, run_check
from lightning_diffusion.core.records import INPUT_FIELDS, RecordSet

if TYPE_CHECKING:
    import torch

    from lightning_diffusion.pipelines.lora import Adapter
    from lightning_diffusion.pipelines.model_folder import PipelineInfo
    from lightning_diffusion.pipelines.settings import ModelSettings

# ----------------------------------------------------------------------------- call arguments


@dataclass(frozen=True)
class ArgRule:
    """The type and bound of one call argument (``integer`` or ``number``); ``high`` may be given
    by the pipeline or the run (``text``: its text encoder's limit, ``pixels``: ``data.max_pixels``)."""

    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_from: Optional[str] = None

    def problems(self, name: str, value: object, limits: Mapping[str, Optional[int]]) -> list[str]:
        if self.kind in ("size", "frames"):
            return []  # the pipeline's own rules: ``PipelineInfo.size_problems`` and ``frames_problems``
        high = limits.get(self.high_from) if self.high_from else self.high
        if self.kind == "integer":
            return integer(value, name, int(self.low) if self.low is not None else None,
                           int(high) if high is not None else None)
        return number(value, name, self.low, high, self.low_open)


# The call arguments a prompt record may set (``PipelineSpec.record_args`` picks among them), with
# their types and bounds; the config's values are held to the same rules.
CALL_ARGS: dict[str, ArgRule] = {
    "height": ArgRule("size"),
    "width": ArgRule("size"),
    "num_inference_steps": ArgRule("integer", 1, MAX_STEPS),
    "guidance_scale": ArgRule("number", 0, MAX_GUIDANCE),
    "guidance_scale_2": ArgRule("number", 0, MAX_GUIDANCE),
    "true_cfg_scale": ArgRule("number", 0, MAX_GUIDANCE),
    "max_sequence_length": ArgRule("integer", 1, high_from="text"),
    "num_frames": ArgRule("frames"),
    "strength": ArgRule("number", 0, 1, low_open=True),
    "max_area": ArgRule("integer", 256, high_from="pixels"),
}


def record_args(info: PipelineInfo) -> list[str]:
    """The call arguments a record may set for this pipeline: its spec's, that its call takes."""
    return [name for name in info.spec.record_args if name in info.call_parameters and name in CALL_ARGS]


def record_keys(info: PipelineInfo) -> list[str]:
    """Every key a record of this pipeline may have."""
    inputs = [name for name in INPUT_FIELDS if name in info.call_parameters]
    negative = ["negative_prompt"] if "negative_prompt" in info.call_parameters else []
    return ["prompt", "seed", *negative, *inputs, *record_args(info)]


def call_arg_problems(info: PipelineInfo, values: Mapping[str, Any], base: Optional[Mapping[str, Any]] = None,
                      max_pixels: Optional[int] = MAX_PIXELS, record: bool = False, where: str = "") -> list[str]:
    """Problems of call arguments ``values``. ``base``: the call arguments ``values`` override (a
    record's over the config's); ``record``: ``values`` come from a prompt record, which may set
    only ``record_args`` (the config may set any argument the pipeline's ``__call__`` takes, except
    those the project sets itself). ``where``: the config key holding them (``model``,
    ``model.call_kwargs``); a record's problems are bare, the caller names its line."""
    problems: list[str] = []
    names = set(values)
    prefix = f"{where}." if where else ""
    if record:
        allowed = record_args(info)
        unknown = sorted(names - set(allowed))
        if unknown:
            problems.append(f"{', '.join(unknown)}: not something a record may set; a {info.class_name} record may "
                            f"have {', '.join(record_keys(info))}.")
        names -= set(unknown)
    else:
        problems += info.call_argument_problems(names, where or "model")
        names &= info.call_parameters
    limits = {"text": info.spec.text_length_max, "pixels": max_pixels}
    typed = {}
    for name in sorted(names):
        value = values[name]
        rule = CALL_ARGS.get(name)
        if value is None and (rule is None or name in info.optional_parameters):
            found: list[str] = []  # the pipeline's own default
        elif rule is not None:
            found = rule.problems(prefix + name, value, limits)
        else:
            found = finite(value, prefix + name) or [f"{where}: {p}" for p in info.call_value_problems({name: value})]
        problems += found
        if not found:
            typed[name] = value
    merged = {**(base or {}), **typed}
    if "height" in typed or "width" in typed:
        sizes = info.size_problems(typed.get("height"), typed.get("width"))
        problems += sizes or pixel_problems(info, merged, max_pixels)
    if "num_frames" in typed:
        problems += info.frames_problems(typed["num_frames"])
    if "strength" in typed or "num_inference_steps" in typed:
        problems += [f"{where}: {p}" if where else p for p in strength_problems(info, merged)]
    return problems


def pixel_problems(info: PipelineInfo, call_args: Mapping[str, Any], max_pixels: Optional[int]) -> list[str]:
    """An image (or frame) of more than ``max_pixels`` pixels: refused before it is found by the
    device's memory (``None``: no budget)."""
    default = info.spec.default_size or (None, None)
    height, width = call_args.get("height") or default[0], call_args.get("width") or default[1]
    longest = max((v for v in (height, width) if is_int(v, 1)), default=0)
    if info.facts.max_side and longest > info.facts.max_side:
        return [f"{height}x{width}: {info.class_name}'s transformer places at most {info.facts.max_side:,} pixels per "
                "side (its pos_embed_max_size); choose a smaller size."]
    if max_pixels is None:
        return []
    side = 4 * math.isqrt(max_pixels)
    if longest > side:
        return [f"{height}x{width}: a side of {longest:,} pixels is over {side:,}, four times the side of "
                f"data.max_pixels' square ({max_pixels:,} pixels); raise data.max_pixels if you mean it."]
    if is_int(height, 1) and is_int(width, 1) and height * width > max_pixels:
        return [f"{height}x{width} is {height * width:,} pixels, over data.max_pixels {max_pixels:,} (raise it if "
                "you mean it)."]
    return []


def strength_problems(info: PipelineInfo, args: Mapping[str, Any]) -> list[str]:
    """An image-to-image ``strength`` that runs no denoising step (diffusers raises only after loading)."""
    if "strength" not in info.call_parameters:
        return []
    strength, steps = args.get("strength", info.call_default("strength")), args.get("num_inference_steps")
    steps = steps if steps is not None else info.call_default("num_inference_steps")
    if (isinstance(strength, (int, float)) and isinstance(steps, int) and 0 < strength <= 1
            and int(steps * strength) < 1):
        return [f"strength {strength} of num_inference_steps {steps} runs no step (the pipeline runs "
                f"int(steps x strength) = 0 of them): raise one of the two."]
    return []



# ----------------------------------------------------------------------------- the model section


COMPILE_MODES = ("regional", "full")


def model_problems(settings: ModelSettings, records: Optional[RecordSet] = None,
                   max_pixels: Optional[int] = MAX_PIXELS) -> tuple[Optional[PipelineInfo], list]:
    """Every weight-free check of the model group's values (``DiffusionModule``'s arguments);
    returns the pipeline's info (None when the path itself is wrong) and the problems.
    ``records``: the prompt records' ``RecordSummary``, when known (their negative prompts decide whether a guidance
    pass on the negative runs, which some caches cannot share)."""
    from lightning_diffusion.pipelines import quantization
    from lightning_diffusion.pipelines.model_folder import inspect_pipeline, resolve_dtype

    named = settings.named_call_args()
    call_kwargs = dict(settings.call_kwargs or {})
    from_pretrained_kwargs = dict(settings.from_pretrained_kwargs or {})
    problems: list = []
    run_check(problems, resolve_dtype, settings.torch_dtype)
    if settings.attention_backend is not None:
        problems += attention_backend_problems(settings.attention_backend)
        if not problems:
            problems += backend_dtype_problems(settings.attention_backend, resolve_dtype(settings.torch_dtype))
    if settings.quantization is not None and "quantization_config" in from_pretrained_kwargs:
        problems.append("model.quantization and model.from_pretrained_kwargs.quantization_config both quantize: keep "
                        "model.quantization.")
    path_problems: list = []
    info = run_check(path_problems, inspect_pipeline, settings.pretrained_model_name_or_path,
                     settings.pipeline_class, from_pretrained_kwargs)
    if info is None:
        # The path is wrong: still report what needs no pipeline.
        steps = named.get("num_inference_steps")
        return None, [*path_problems, *problems, *(integer(steps, "model.num_inference_steps", 1, MAX_STEPS)
                                                   if steps is not None else [])]
    given = {k: v for k, v in named.items() if v is not None}
    problems += info.run_problems(set(given) | set(call_kwargs), set(record_keys(info)))
    problems += call_arg_problems(info, given, max_pixels=max_pixels, where="model")
    if call_kwargs:
        problems += call_arg_problems(info, call_kwargs, base=given, max_pixels=max_pixels, where="model.call_kwargs")
    if not set(given) & {"height", "width"}:  # the folder's or the pipeline's default size
        base, _ = info.effective_call_args(named, call_kwargs)
        problems += pixel_problems(info, base, max_pixels)
    negative = call_kwargs.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        problems.append(f"model.call_kwargs.negative_prompt is the default negative prompt of every record: "
                        f"give one string, not {negative!r} (records set their own in the prompt file).")
    cache = settings.cache
    if cache is not None:
        base, extra = info.effective_call_args(named, call_kwargs)
        problems += model_cache_problems(info, cache, {**base, **extra}, records)
    problems += vae_tiling_problems(info, settings.vae_tiling)
    problems += compile_problems(info, settings.compile)
    if settings.lora:
        problems += lora_problems(info, settings.lora, settings.quantization)
    if settings.adapters:
        problems += lora_problems(info, settings.adapters, settings.quantization, named=True)
    if not is_int(settings.max_loaded_adapters, 1):
        problems.append(f"model.max_loaded_adapters is how many adapters a replica holds read at once (the least "
                        "recently used dropped first): an integer of at least 1, got "
                        f"{settings.max_loaded_adapters!r}.")
    if settings.quantization is not None:
        classes = {name: info.component_class(name) for name in info.model_index}
        problems += quantization.check(settings.quantization, info.model_index, classes, tuple(info.denoisers()))
    if settings.vae_slicing and not _vae_has(info.component_class("vae"), info.configs.get("vae", {}),
                                                    "use_slicing"):
        problems.append(f"model.vae_slicing: {info.class_name}'s VAE cannot decode sample by sample; "
                        "remove model.vae_slicing.")
    return info, problems


def attention_backend_problems(name: object, where: str = "model.attention_backend", installed: bool = True,
                               context_parallel: bool = False) -> list[str]:
    """The one attention-backend rule, for the model's backend and a strategy's: ``name`` is a
    diffusers attention backend; ``installed``: its package is installed (the model's);
    ``context_parallel``: it supports context parallelism in the installed diffusers (a
    context-parallel strategy's). ``where`` names the setting in the messages."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        _check_attention_backend_requirements,
    )

    try:
        backend = AttentionBackendName(name)
    except ValueError:
        return [f"{where} {name!r} is not a diffusers attention backend; choose one of: "
                f"{', '.join(sorted(b.value for b in AttentionBackendName))}."]
    if installed:
        try:
            _check_attention_backend_requirements(backend)
        except (RuntimeError, ImportError) as err:
            return [f"{where} {name!r}: {err}"]
    if context_parallel and not _AttentionBackendRegistry._is_context_parallel_available(backend):
        return [f"{where} {name!r} cannot do context parallelism; choose one of: "
                f"{', '.join(sorted(_AttentionBackendRegistry._supports_context_parallel))}."]
    return []


def backend_dtype_problems(name: str, dtype: torch.dtype, where: str = "model.attention_backend") -> list[str]:
    """A backend whose kernels take half precision only (flash, sage, ``_native_cudnn``...: read
    from the backend's own constraints in diffusers) with float32 weights would fail at the first
    step, after every weight loaded: diffusers checks the dtype only under ``DIFFUSERS_ATTN_CHECKS``."""
    import torch
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    try:
        backend = AttentionBackendName(name)
    except ValueError:
        return []  # named by attention_backend_problems
    checks = {getattr(check, "__name__", "") for check in _AttentionBackendRegistry._constraints.get(backend, ())}
    if "_check_qkv_dtype_bf16" in checks and dtype != torch.bfloat16:
        need = "bfloat16"
    elif "_check_qkv_dtype_bf16_or_fp16" in checks and dtype not in (torch.bfloat16, torch.float16):
        need = "bfloat16 or float16"
    else:
        return []
    return [f"{where} {name!r} needs {need} (its kernels take half precision only), but model.torch_dtype is "
            f"{str(dtype).removeprefix('torch.')}: set model.torch_dtype to bfloat16, or choose a backend that takes "
            "float32 (native, _native_efficient, flex, xformers)."]


def lora_problems(info: PipelineInfo, spec: object, quantized: Optional[Mapping[str, Any]],
                  named: bool = False) -> list:
    """``model.lora`` (``named``: ``model.adapters``, adapters by name): files, scales, finite
    weights, targets that are modules of this pipeline with the shapes of its layers, and no adapter
    on a component that loads quantized (an update cannot be fused into quantized weights)."""
    import importlib.util

    import torch

    from lightning_diffusion.pipelines import lora, quantization
    from lightning_diffusion.pipelines.adapters import parse_named

    if importlib.util.find_spec("peft") is None:
        return [f"model.{'adapters' if named else 'lora'} needs the peft package, which is not installed: "
                "pip install peft."]
    problems: list = []
    parsed: Optional[Mapping[str, Adapter]] = run_check(
        problems, (lambda s: parse_named(s)) if named else (lambda s: {
            f"[{n}]": a for n, a in enumerate(lora.parse(s))}), spec)
    if parsed is None:
        return problems
    adapters = list(parsed.values())
    labels = [f"model.adapters.{name}" if named else f"model.lora{name}" for name in parsed]
    modules = {}  # the diffusers models' module names (text encoders' parts are left to diffusers)
    models = {}  # and the models themselves, empty (meta device), for the updates' shapes
    for name in getattr(info.pipeline_class, "_lora_loadable_modules", []):
        cls = info.component_class(name)
        if isinstance(cls, type) and hasattr(cls, "from_config") and name in info.configs:
            with torch.device("meta"):
                model = cls.from_config(info.configs[name])
            modules[name] = {n for n, _ in model.named_modules()}
            models[name] = model
    loadable = list(getattr(info.pipeline_class, "_lora_loadable_modules", []))
    targeted = []  # each adapter's components, for the quantization rule
    for where, adapter in zip(labels, adapters):
        try:
            state, _, _ = lora.read(info.pipeline_class, adapter)  # once: the rules below read this state
        except ConfigError as err:
            problems.append(str(err))
            continue
        except Exception as err:  # a file diffusers cannot read as an adapter
            problems.append(f"{where}: {adapter.file} is not a LoRA adapter diffusers can read "
                            f"({type(err).__name__}: {err}).")
            continue
        found = lora.targets_in(state)
        missing = lora.unknown_targets(found, modules)
        targeted.append(set(found))
        bad = [key for key, value in state.items() if value.is_floating_point() and not torch.isfinite(value).all()]
        if bad:
            problems.append(f"{where}: {adapter.file.name} has NaN or infinite weights in {len(bad)} tensor(s) "
                            f"({', '.join(bad[:3])}): it would make every image it touches black or noise.")
            continue
        strays = sorted(set(found) - set(loadable))
        if strays:
            problems.append(f"{where}: {adapter.name}'s layers name no component of {info.class_name} that "
                            f"takes adapters ({', '.join(loadable)}): they start with {', '.join(strays[:3])}. A file "
                            "saved without its component prefix? Its keys should start with "
                            f"'{loadable[0] if loadable else 'transformer'}.'.")
        elif missing:
            problems.append(f"{where}: {len(missing)} of {adapter.name}'s layers match no layer of "
                            f"{info.class_name}: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                            "(an adapter for another model?).")
        else:
            problems += [f"{where}: {p}" for p in lora_shape_problems(info, adapter, state, models)]
    if quantized is not None and not problems:
        both = [c for c in quantization.quantized(quantized, tuple(info.denoisers()))
                if any(c in components for components in targeted)]
        if both:
            problems.append(f"model.{'adapters' if named else 'lora'}: {', '.join(both)} loads quantized "
                            "(model.quantization), and an adapter "
                            "cannot be fused into quantized weights: leave it out of model.quantization.components.")
    return problems


def lora_shape_problems(info: PipelineInfo, adapter: Adapter, state: Mapping[str, torch.Tensor],
                        models: Mapping[str, Any], most: int = 3) -> list[str]:
    """Low-rank pairs of ``adapter`` (its ``state`` as read) whose shapes do not fit the layer they
    update (an adapter for another size of the model): diffusers would fail with a size mismatch after
    every weight has loaded. A pair may widen a layer's input (FLUX.1's control adapters, which
    diffusers expands), never its output."""
    wrong = []
    for key, a in state.items():
        if not key.endswith(".lora_A.weight") or a.ndim != 2:
            continue
        component, _, module = key[: -len(".lora_A.weight")].partition(".")
        b = state.get(key.replace(".lora_A.", ".lora_B."))
        model = models.get(component)
        try:
            weight = model.get_submodule(module).weight if model is not None else None
        except AttributeError:
            continue  # not a module of it: named by the layer check
        if weight is None or b is None or weight.ndim != 2:
            continue
        if b.shape[0] != weight.shape[0] or a.shape[1] < weight.shape[1] or a.shape[0] != b.shape[1]:
            wrong.append(f"{component}.{module} ({tuple(weight.shape[::-1])} in x out) gets an update of "
                         f"{a.shape[1]} x {b.shape[0]} (rank {a.shape[0]}/{b.shape[1]})")
    if not wrong:
        return []
    more = f" and {len(wrong) - most} more" if len(wrong) > most else ""
    return [f"{adapter.name} does not fit {info.class_name}'s layers: {'; '.join(wrong[:most])}{more} (an adapter "
            "for another size of the model?)."]


def compile_problems(info: PipelineInfo, mode: object) -> list[str]:
    """``model.compile``: ``regional`` (``compile_repeated_blocks``: each distinct transformer block
    compiled once and reused) needs denoisers that name their repeated blocks; ``full`` compiles
    each denoiser whole."""
    if mode is None:
        return []
    if mode not in COMPILE_MODES:
        return [f"model.compile is regional, full or null, not {mode!r}."]
    if mode == "regional":
        for name, cls in info.denoisers().items():
            if cls is not None and not getattr(cls, "_repeated_blocks", None):  # None: an absent component
                which = cls.__name__ if isinstance(cls, type) else "unknown"
                return [f"model.compile: regional compiles a transformer's repeated blocks, and {info.class_name}'s "
                        f"{name} ({which}) names none; use model.compile: full."]
    return []


def vae_tiling_problems(info: PipelineInfo, vae_tiling: object) -> list[str]:
    """``model.vae_tiling``: ``true``, or the settings of the VAE's ``enable_tiling``, for a VAE
    that has a tiled decode; not ``false`` for a VAE that decodes only by tiles."""
    tiled_only = info.facts.tiled_only
    if vae_tiling is False and tiled_only:
        return [f"model.vae_tiling: false, but {info.class_name}'s VAE ({tiled_only}) decodes only by tiles (its "
                "decode raises without tiling): set model.vae_tiling: true, or leave it unset (it is then turned on)."]
    if vae_tiling is None or vae_tiling is False:
        return []
    if vae_tiling is not True and not isinstance(vae_tiling, dict):
        return [f"model.vae_tiling is true, false or the settings of the VAE's enable_tiling (a mapping), "
                f"not {vae_tiling!r}."]
    vae: Any = info.component_class("vae")  # a class or None; its enable_tiling is read once known callable
    if not callable(getattr(vae, "enable_tiling", None)) or not _vae_has(vae, info.configs.get("vae", {}),
                                                                          "use_tiling"):
        which = f"its VAE ({vae.__name__})" if isinstance(vae, type) else "it has no VAE that"
        return [f"model.vae_tiling: {info.class_name} cannot decode by tiles: {which} has no tiled decoding; "
                "remove model.vae_tiling."]
    if isinstance(vae_tiling, dict):
        accepted = [name for name in inspect.signature(vae.enable_tiling).parameters if name != "self"]
        unknown = sorted(set(vae_tiling) - set(accepted))
        if unknown:
            takes = f"takes {', '.join(accepted)}" if accepted else "takes no settings (use model.vae_tiling: true)"
            return [f"model.vae_tiling: {vae.__name__}.enable_tiling {takes}; unknown: {', '.join(unknown)}."]
        problems = [problem for k, v in vae_tiling.items() if v is not None
                    for problem in integer(v, f"model.vae_tiling.{k}")]
        for side in ("height", "width"):
            tile, stride = vae_tiling.get(f"tile_sample_min_{side}"), vae_tiling.get(f"tile_sample_stride_{side}")
            if not problems and tile is not None and stride is not None and stride > tile:
                problems.append(f"model.vae_tiling: tile_sample_stride_{side} {stride} is larger than "
                                f"tile_sample_min_{side} {tile}: tiles must overlap (stride <= tile size).")
        return problems
    return []


def model_cache_problems(info: PipelineInfo, cache: object, call_args: Mapping[str, Any], records: Optional[Any] = None
                         ) -> list[str]:
    """``model.cache`` against this pipeline, the call arguments and (when known) the records'
    ``RecordSummary`` (``records.summarize_records``)."""
    from lightning_diffusion.pipelines.cache import check_cache

    problems = check_cache(cache, info.denoisers(), info.class_name, negative_branch(info, call_args, records),
                           separate_passes=info.spec.cfg is not None)
    if isinstance(cache, dict) and cache.get("type") == "magcache":
        sets = records.override_sets() if records is not None else []
        steps = {overrides.get("num_inference_steps") for _, overrides in sets} - {None}
        if steps - {call_args.get("num_inference_steps")}:
            problems.append("model.cache: magcache's ratios are laid out for one step count, and prompt records set "
                            f"num_inference_steps {sorted(steps)}; give every record the config's step count.")
    return problems


def negative_branch(info: PipelineInfo, call_args: Mapping[str, Any], summary: Optional[RecordSet] = None) -> bool:
    """Whether some image runs a guidance pass on a negative prompt (true CFG): the scale above 1
    and, where the pipeline needs one, a negative prompt in the config or a record (``summary``:
    the records' ``RecordSummary``)."""
    entry = info.spec.cfg
    if entry is None:
        return False
    scales = {call_args.get(entry.scale_arg, info.call_default(entry.scale_arg))}
    if summary is not None:
        scales |= {overrides.get(entry.scale_arg) for _, overrides in summary.override_sets()} - {None}
    negative = call_args.get("negative_prompt") is not None or (summary is not None
                                                                 and summary.first_negative is not None)
    return any(entry.runs(scale, negative) for scale in scales)


def _vae_has(vae: Optional[type[Any]], config: dict[str, Any], attribute: str) -> bool:
    """Whether a VAE class decodes by tiles (``use_tiling``) or by sample (``use_slicing``):
    diffusers' VAEs say so by an attribute set in ``__init__``, so the class is built from its
    config on the meta device (no memory)."""
    import torch

    if not isinstance(vae, type):
        return False
    try:
        with torch.device("meta"):
            model = vae.from_config(config)
    except Exception:  # a config this class cannot build: leave the verdict to the load
        return True
    return hasattr(model, attribute)
