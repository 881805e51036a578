"""``DiffusionModule``: a diffusers pipeline as a LightningModule for ``Trainer.predict``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn

from lightning_diffusion.cache import CacheStats, StepCache, check_cache, install
from lightning_diffusion.console import log
from lightning_diffusion.contract import LoadPlan, ModelRequest
from lightning_diffusion.data import INPUT_FIELDS, PromptDataModule, summarize_records
from lightning_diffusion import compat, quantization
from lightning_diffusion.errors import ConfigError, check_int, gather, preflight_passed, raise_problems
from lightning_diffusion.pipelines import PipelineInfo, inspect_pipeline, resolve_dtype


def check_model_args(
    path: str, torch_dtype: str, named: dict[str, Any], call_kwargs: Optional[dict[str, Any]],
    cache: Optional[dict[str, Any]] = None, records: Optional[Sequence[dict[str, Any]]] = None,
    options: Optional[dict[str, Any]] = None, from_pretrained_kwargs: Optional[dict[str, Any]] = None,
) -> tuple[Optional[PipelineInfo], list[str]]:
    """Every check of the model settings that needs no weights; returns the pipeline's info (or
    None when the path itself is wrong) and the problems found. ``records``: the prompt records,
    when known (their negative prompts decide whether a guidance pass on the negative runs).
    ``options``: the module's ``OPTIONS`` (``vae_tiling``, ``compile``...), absent ones unset."""
    options = {key: (options or {}).get(key) for key in OPTIONS}
    attention_backend = options["attention_backend"]
    problems: list[str] = []
    steps = named.get("num_inference_steps")
    if steps is not None:
        problems += filter(None, [check_int(steps, "model.num_inference_steps")])
    gather(problems, resolve_dtype, torch_dtype)
    if attention_backend is not None:
        gather(problems, check_attention_backend_name, attention_backend)
    info = gather(problems, inspect_pipeline, path, options["pipeline_class"], from_pretrained_kwargs)
    if info is not None:
        gather(problems, info.check_size, named.get("height"), named.get("width"))
        gather(problems, info.check_frames, named.get("num_frames"), "model")
        gather(problems, info.check_call_arguments, set(call_kwargs or {}), "model.call_kwargs")
        gather(problems, info.check_call_values, dict(call_kwargs or {}), "model.call_kwargs")
        negative = (call_kwargs or {}).get("negative_prompt")
        if negative is not None and not isinstance(negative, str):
            problems.append(f"model.call_kwargs.negative_prompt is the default negative prompt of every record: "
                            f"give one string, not {negative!r} (records set their own in the prompt file).")
        given = {k for k, v in named.items() if v is not None and k != "num_frames"}
        gather(problems, info.check_call_arguments, given, "model")
        if cache is not None:
            base, extra = effective_call_args(info, named, call_kwargs)
            problems += model_cache_problems(info, cache, {**base, **extra}, records)
        problems += vae_tiling_problems(info, options["vae_tiling"])
        problems += compile_problems(info, options["compile"])
        if options["lora"]:
            problems += lora_problems(info, options["lora"], options["quantization"])
        if options["quantization"] is not None:
            classes = {name: info.component_class(name) for name in info.model_index}
            gather(problems, quantization.check, options["quantization"], info.model_index, classes,
                   tuple(denoisers(info)))
        if options["vae_slicing"] and not _vae_has(info.component_class("vae"), info.configs.get("vae", {}), "use_slicing"):
            problems.append(f"model.vae_slicing: {info.class_name}'s VAE cannot decode sample by sample; "
                            "remove model.vae_slicing.")
    return info, problems


COMPILE_MODES = ("regional", "full")
# The module's options that change pictures (float rounding, seams): recorded in run.json and in
# each image's metadata, so that a folder is not resumed with other values.
OPTIONS = ("pipeline_class", "lora", "vae_tiling", "compile", "vae_slicing", "attention_backend", "quantization")


def recorded_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as run.json and the metadata record them: adapters by file name, SHA-256 and
    scale (not by path, which may differ between machines that make the same pictures)."""
    if not options.get("lora"):
        return options
    from lightning_diffusion import lora

    try:
        return {**options, "lora": lora.record(lora.parse(options["lora"]))}
    except ConfigError:  # reported by check_model_args
        return options


def check_attention_backend_name(name: Any) -> None:
    """``model.attention_backend``: a diffusers attention backend whose package is installed."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        backend = AttentionBackendName(name)
    except ValueError:
        raise ConfigError(f"model.attention_backend {name!r} is not a diffusers attention backend; choose one of: "
                          f"{', '.join(sorted(b.value for b in AttentionBackendName))}.") from None
    try:
        _check_attention_backend_requirements(backend)
    except (RuntimeError, ImportError) as err:
        raise ConfigError(f"model.attention_backend {name!r}: {err}") from None


def lora_problems(info: PipelineInfo, spec: Any, quantized: Any) -> list[str]:
    """``model.lora``: files, scales, targets that are modules of this pipeline, and no adapter on
    a component that loads quantized (an update cannot be fused into quantized weights)."""
    import importlib.util

    from lightning_diffusion import lora

    if importlib.util.find_spec("peft") is None:
        return ["model.lora needs the peft package, which is not installed: pip install peft."]
    try:
        adapters = lora.parse(spec)
    except ConfigError as err:
        return [str(err)]
    modules = {}  # the diffusers models' module names (text encoders' parts are left to diffusers)
    for name in getattr(info.pipeline_class, "_lora_loadable_modules", []):
        cls = info.component_class(name)
        if isinstance(cls, type) and hasattr(cls, "from_config") and name in info.configs:
            with torch.device("meta"):
                model = cls.from_config(info.configs[name])
            modules[name] = {n for n, _ in model.named_modules()}
    problems = []
    for n, adapter in enumerate(adapters):
        try:
            missing = lora.unknown_targets(info.pipeline_class, adapter, modules)
        except ConfigError as err:
            problems.append(str(err))
            continue
        except Exception as err:  # a file diffusers cannot read as an adapter
            problems.append(f"model.lora[{n}]: {adapter.file} is not a LoRA adapter diffusers can read "
                            f"({type(err).__name__}: {err}).")
            continue
        if missing:
            problems.append(f"model.lora[{n}]: {len(missing)} of {adapter.name}'s layers match no layer of "
                            f"{info.class_name}: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                            "(an adapter for another model?).")
    if quantized is not None and not problems:
        both = [c for c in quantization.quantized(quantized, tuple(denoisers(info)))
                if any(c in lora.targets(info.pipeline_class, a) for a in adapters)]
        if both:
            problems.append(f"model.lora: {', '.join(both)} loads quantized (model.quantization), and an adapter "
                            "cannot be fused into quantized weights: leave it out of model.quantization.components.")
    return problems


def compile_problems(info: PipelineInfo, mode: Any) -> list[str]:
    """``model.compile``: ``regional`` (``compile_repeated_blocks``: each distinct transformer block
    compiled once and reused) needs denoisers that name their repeated blocks; ``full`` compiles
    each denoiser whole."""
    if mode is None:
        return []
    if mode not in COMPILE_MODES:
        return [f"model.compile is regional, full or null, not {mode!r}."]
    if mode == "regional":
        for name, cls in denoisers(info).items():
            if cls is not None and not getattr(cls, "_repeated_blocks", None):  # None: an absent component
                which = cls.__name__ if isinstance(cls, type) else "unknown"
                return [f"model.compile: regional compiles a transformer's repeated blocks, and {info.class_name}'s "
                        f"{name} ({which}) names none; use model.compile: full."]
    return []


def vae_tiling_problems(info: PipelineInfo, vae_tiling: Any) -> list[str]:
    """``model.vae_tiling``: ``true``, or the settings of the VAE's ``enable_tiling``, for a VAE
    that has a tiled decode."""
    if vae_tiling is None or vae_tiling is False:
        return []
    if vae_tiling is not True and not isinstance(vae_tiling, dict):
        return [f"model.vae_tiling is true, false or the settings of the VAE's enable_tiling (a mapping), "
                f"not {vae_tiling!r}."]
    vae = info.component_class("vae")
    if not callable(getattr(vae, "enable_tiling", None)) or not _vae_has(vae, info.configs.get("vae", {}),
                                                                          "use_tiling"):
        which = f"its VAE ({vae.__name__})" if isinstance(vae, type) else "it has no VAE that"
        return [f"model.vae_tiling: {info.class_name} cannot decode by tiles: {which} has no tiled decoding; "
                "remove model.vae_tiling."]
    if isinstance(vae_tiling, dict):
        import inspect

        accepted = [name for name in inspect.signature(vae.enable_tiling).parameters if name != "self"]
        unknown = sorted(set(vae_tiling) - set(accepted))
        if unknown:
            takes = f"takes {', '.join(accepted)}" if accepted else "takes no settings (use model.vae_tiling: true)"
            return [f"model.vae_tiling: {vae.__name__}.enable_tiling {takes}; unknown: {', '.join(unknown)}."]
        problems = [problem for k, v in vae_tiling.items() if v is not None
                    for problem in filter(None, [check_int(v, f"model.vae_tiling.{k}")])]
        for side in ("height", "width"):
            tile, stride = vae_tiling.get(f"tile_sample_min_{side}"), vae_tiling.get(f"tile_sample_stride_{side}")
            if not problems and tile is not None and stride is not None and stride > tile:
                problems.append(f"model.vae_tiling: tile_sample_stride_{side} {stride} is larger than "
                                f"tile_sample_min_{side} {tile}: tiles must overlap (stride <= tile size).")
        return problems
    return []


def model_cache_problems(info: PipelineInfo, cache: Any, call_args: dict[str, Any],
                         records: Optional[Sequence[dict[str, Any]]] = None) -> list[str]:
    """``model.cache`` against this pipeline, the call arguments and (when known) the records."""
    problems = check_cache(cache, denoisers(info), info.class_name, negative_branch(info, call_args, records),
                           separate_passes=info.spec.cfg is not None)
    if isinstance(cache, dict) and cache.get("type") == "magcache":
        sets = summarize_records(records).override_sets() if records else []
        steps = {overrides.get("num_inference_steps") for _, overrides in sets} - {None}
        if steps - {call_args.get("num_inference_steps")}:
            problems.append("model.cache: magcache's ratios are laid out for one step count, and prompt records set "
                            f"num_inference_steps {sorted(steps)}; give every record the config's step count.")
    return problems


def denoisers(info: PipelineInfo) -> dict[str, Optional[type]]:
    """The pipeline's transformer components (those its guidance loop calls) and their classes."""
    names = info.spec.cfg.transformers if info.spec.cfg is not None else ("transformer",)
    return {name: info.component_class(name) for name in names if name in info.model_index}


def negative_branch(info: PipelineInfo, call_args: dict[str, Any],
                    records: Optional[Sequence[dict[str, Any]]] = None) -> bool:
    """Whether some image runs a guidance pass on a negative prompt (true CFG): the scale above 1
    and, where the pipeline needs one, a negative prompt in the config or a record."""
    entry = info.spec.cfg
    if entry is None:
        return False
    summary = summarize_records(records) if records else None
    scales = {call_args.get(entry.scale_arg, info.call_default(entry.scale_arg))}
    if summary is not None:
        scales |= {overrides.get(entry.scale_arg) for _, overrides in summary.override_sets()} - {None}
    if not any(isinstance(scale, (int, float)) and scale > 1 for scale in scales):
        return False
    if not entry.needs_negative_prompt or call_args.get("negative_prompt") is not None:
        return True
    return summary is not None and summary.first_negative is not None


def _vae_has(vae: Optional[type], config: dict[str, Any], attribute: str) -> bool:
    """Whether a VAE class decodes by tiles (``use_tiling``) or by sample (``use_slicing``):
    diffusers' VAEs say so by an attribute set in ``__init__``, so the class is built from its
    config on the meta device (no memory)."""
    if not isinstance(vae, type):
        return False
    try:
        with torch.device("meta"):
            model = vae.from_config(config)
    except Exception:  # a config this class cannot build: leave the verdict to the load
        return True
    return hasattr(model, attribute)


def effective_call_args(
    info: PipelineInfo, named: dict[str, Any], call_kwargs: Optional[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(named arguments, other call arguments) as the pipeline is called: the config's, with the
    model folder's recommended values (``PipelineInfo.recommended``) where the config sets nothing."""
    recommended = {k: v for k, v in info.recommended.items() if k in info.call_parameters}
    base = {k: v if v is not None else recommended.get(k) for k, v in named.items()}
    extra = {**{k: v for k, v in recommended.items() if k not in named}, **dict(call_kwargs or {})}
    return {k: v for k, v in base.items() if v is not None}, extra


def image_settings(
    path: str, torch_dtype: str, call_args: dict[str, Any], from_pretrained_kwargs: dict[str, Any],
    cache: Optional[dict[str, Any]] = None, options: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The model settings that decide the pictures, as run.json records them (the writer and
    preflight both compute them, so that a folder is refused before anything starts). ``options``:
    the model's decoding and speed options (``vae_tiling``, ``compile``...), recorded when set."""
    return {
        "model": path,
        "torch_dtype": torch_dtype,
        **{f"model.{k}": v for k, v in sorted(call_args.items())},
        **{f"from_pretrained.{k}": from_pretrained_kwargs[k] for k in ("revision", "variant")
           if k in from_pretrained_kwargs},
        **({"model.cache": dict(cache)} if cache is not None else {}),
        **{f"model.{k}": v for k, v in sorted((options or {}).items()) if v not in (None, False)},
    }


def strength_problem(info: PipelineInfo, args: dict[str, Any], where: str) -> Optional[str]:
    """An image-to-image ``strength`` that runs no denoising step (diffusers raises only after loading)."""
    if "strength" not in info.call_parameters:
        return None
    strength, steps = args.get("strength", info.call_default("strength")), args.get("num_inference_steps")
    steps = steps if steps is not None else info.call_default("num_inference_steps")
    if (isinstance(strength, (int, float)) and isinstance(steps, int) and 0 < strength <= 1
            and int(steps * strength) < 1):
        return (f"{where}: strength {strength} of num_inference_steps {steps} runs no step (the pipeline runs "
                f"int(steps x strength) = 0 of them): raise one of the two.")
    return None


def check_records(info: PipelineInfo, records: Sequence[dict[str, Any]], most: int = 10,
                  call_args: Optional[dict[str, Any]] = None, inputs_root: Optional[str] = None) -> list[str]:
    """Per-record overrides, negative prompts and input files must be arguments this pipeline takes
    (the first ``most`` problems are reported; each distinct set of overrides is checked once,
    named by the first record that has it); input files must be readable images. ``call_args``:
    the config's, when known (checked with each record's overrides)."""
    problems: list[str] = []
    summary = summarize_records(records)
    for name, number in summary.with_inputs.items():
        if name not in info.call_parameters:
            task = {"image": " (image-to-image on FLUX.1 weights: model.pipeline_class: FluxImg2ImgPipeline)",
                    "mask_image": " (inpainting on FLUX.1 weights: model.pipeline_class: FluxInpaintPipeline)"}
            problems.append(f"prompt record {number} has {name}, which {info.class_name} does not take"
                            f"{task.get(name, '') if info.class_name == 'FluxPipeline' else ''}.")
    if info.spec.input_if_config is not None:  # an input these weights either need or cannot take
        name, key = info.spec.input_if_config
        needed = info.configs.get("transformer", {}).get(key) is not None
        if name in summary.with_inputs and not needed:
            problems.append(f"prompt record {summary.with_inputs[name]} has {name}, which these {info.class_name} weights "
                            f"cannot take (their transformer config sets no {key}).")
        if name in summary.without_inputs and needed:
            problems.append(f"prompt record {summary.without_inputs[name]} has no {name}, which these {info.class_name} "
                            f"weights need (their transformer config sets {key}).")
    for name in info.spec.inputs:
        if name in summary.without_inputs:
            problems.append(f"prompt record {summary.without_inputs[name]} has no {name}, which {info.class_name} "
                            f"needs (a path in the record: {{\"prompt\": ..., \"{name}\": \"in/0001.png\"}}).")
    if summary.with_inputs:
        from lightning_diffusion import inputs

        problems += inputs.file_problems(records, most, inputs_root)
    for n, overrides in summary.override_sets():
        if len(problems) >= most:
            break
        if overrides:
            gather(problems, info.check_call_arguments, set(overrides), f"prompt record {n}")
            gather(problems, info.check_call_values, overrides, f"prompt record {n}")
            gather(problems, info.check_size, overrides.get("height"), overrides.get("width"))
            gather(problems, info.check_frames, overrides.get("num_frames"), f"prompt record {n}")
        if call_args is not None:
            where = f"prompt record {n}" if overrides else "model"
            problems += filter(None, [strength_problem(info, {**call_args, **overrides}, where)])
    if summary.first_negative is not None and "negative_prompt" not in info.call_parameters:
        problems.append(
            f"prompt record {summary.first_negative} has a negative_prompt, which {info.class_name} does not take."
        )
    return problems[:most]


class DiffusionModule(pl.LightningModule):
    """Runs a diffusers ``DiffusionPipeline`` on batches of prompt samples.

    Args:
        pretrained_model_name_or_path: hub id, local folder written by ``save_pretrained``, or
            ``tiny:flux`` (a small random pipeline built offline, for rehearsal and tests).
        torch_dtype: ``float32``, ``bfloat16`` or ``float16``.
        height, width, num_inference_steps, guidance_scale: pipeline-call arguments for every image
            (``None`` leaves the pipeline's default); a prompt record may override them.
        num_frames: frames per video, for video pipelines (Wan: 4 x k + 1).
        call_kwargs: any other argument the pipeline's ``__call__`` accepts (``true_cfg_scale``,
            ``max_sequence_length``, ...); a ``negative_prompt`` here is the default of the records
            that have none.
        from_pretrained_kwargs: extra arguments for ``DiffusionPipeline.from_pretrained``
            (``revision``, ``variant``, ...).
        show_inner_progress: keep diffusers' per-step progress bars (off by default).
        cache: step caching, ``{type: first_block, threshold: 0.08}`` (or ``taylorseer``,
            ``magcache``, ``pyramid_attention_broadcast``, ``faster_cache``; other keys go to the
            diffusers config). A first-block cache decides per image, agreed over the ranks that
            share the transformer call (``cache``; docs/caching.md).
        pad_batches: run every pipeline call with the configured ``data.batch_size``: a short
            batch (a replica's last, or a group of records with their own overrides) is padded
            with copies of its last sample, whose outputs are dropped. Batched kernels round
            differently for different batch sizes, so this is what makes image i bit-identical
            for any number of replicas and nodes, and across resumes (docs/config.md).
        vae_tiling: decode by overlapping tiles (diffusers' ``enable_tiling``; ``true`` or its
            settings, such as ``tile_sample_min_height``): less memory for large images and videos,
            and under model parallelism the tiles are dealt over the group's ranks. Tiled decoding
            blends tile seams, so its pictures differ slightly from untiled ones.
        split_work: split text encoding and VAE decoding over the ranks of each model-parallel
            group (by sample, or by tile with ``vae_tiling``) instead of repeating it on each rank
            (``group_work``; docs/strategies.md).
        compile: ``regional`` (each distinct transformer block compiled once with
            ``torch.compile`` and reused: short compile, most of the gain) or ``full`` (each
            denoiser whole); compiled on the first batch of each shape (``pad_batches`` keeps one).
        vae_slicing: decode a batch sample by sample (diffusers' ``enable_slicing``: less memory).
        attention_backend: the denoisers' diffusers attention backend (``set_attention_backend``)
            under every strategy; context parallelism needs one that supports it.
        quantization: quantize components while they load (diffusers' quantization backends):
            ``{backend: torchao, quant_type: int8wo, components: [transformer]}``; components
            default to the denoisers; other keys are the backend config's arguments.
        lora: LoRA adapters fused into the weights before inference (``[{path, weight_name,
            scale}]``), under every strategy, tensor parallelism's shards included.
        pipeline_class: run the weights with another diffusers pipeline class, such as
            ``FluxImg2ImgPipeline`` or ``FluxInpaintPipeline`` on FLUX.1 weights (the records then
            carry ``image`` and ``mask_image`` paths).

    ``predict_step`` returns one dict per image: ``index``, ``prompt``, ``seed``, ``image`` (float32
    array H x W x 3 in [0, 1], or F x H x W x 3 for a video) and ``params`` (the pipeline arguments
    that made it).
    Nothing here depends on the strategy: a strategy reads ``request()``, hands a ``LoadPlan`` to
    ``use_load_plan`` and its parallelised pipeline to ``use_pipeline`` (see ``contract``).
    """

    def __init__(
        self,
        pretrained_model_name_or_path: str = "tiny:flux",
        torch_dtype: str = "float32",
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_inference_steps: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        num_frames: Optional[int] = None,
        call_kwargs: Optional[dict[str, Any]] = None,
        from_pretrained_kwargs: Optional[dict[str, Any]] = None,
        show_inner_progress: bool = False,
        pad_batches: bool = True,
        cache: Optional[dict[str, Any]] = None,
        vae_tiling: Optional[Union[bool, dict[str, int]]] = None,
        split_work: bool = True,
        compile: Optional[str] = None,
        vae_slicing: bool = False,
        attention_backend: Optional[str] = None,
        quantization: Optional[dict[str, Any]] = None,
        pipeline_class: Optional[str] = None,
        lora: Optional[list[dict[str, Any]]] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        named = {
            "height": height,
            "width": width,
            "num_inference_steps": num_inference_steps,
            "guidance_scale": guidance_scale,
            "num_frames": num_frames,
        }
        # Reads configs only: a bad path, a non-pipeline folder or an impossible size fails here,
        # in the launching process, before any worker starts or any weight is read.
        options = {"pipeline_class": pipeline_class, "lora": lora, "vae_tiling": vae_tiling, "compile": compile,
                   "vae_slicing": vae_slicing, "attention_backend": attention_backend, "quantization": quantization}
        info, problems = check_model_args(pretrained_model_name_or_path, torch_dtype, named, call_kwargs, cache,
                                          options=options, from_pretrained_kwargs=from_pretrained_kwargs)
        raise_problems(problems)
        assert info is not None
        self.info: PipelineInfo = info
        self.dtype_ = resolve_dtype(torch_dtype)
        self.base_call_args, self.call_kwargs = effective_call_args(info, named, call_kwargs)
        self.from_pretrained_kwargs = dict(from_pretrained_kwargs or {})
        self.show_inner_progress = show_inner_progress
        self.pad_batches = pad_batches
        self.batch_size: Optional[int] = None  # the data module's, read in setup; else the largest seen
        self.pipeline: Any = None
        self.cache = dict(cache) if cache is not None else None
        self.step_cache: Optional[StepCache] = None
        self.split_work = split_work
        self.group_work: Any = None
        if from_pretrained_kwargs and quantization is not None and "quantization_config" in from_pretrained_kwargs:
            raise ConfigError("model.quantization and model.from_pretrained_kwargs.quantization_config both "
                              "quantize: keep model.quantization.")
        from lightning_diffusion import lora as lora_

        self.adapters = lora_.parse(lora)
        self.options = recorded_options(options)  # OPTIONS: recorded in run.json and each image's metadata
        self.compiled = False
        self.cache_totals: Optional[list[float]] = None  # summed over processes at the end of a run
        # How to load: set by the strategy (``use_load_plan``), whole pipeline on the CPU by default.
        self.load_plan = LoadPlan()
        # The pipeline's torch modules, registered so that Lightning's device moves reach them.
        self.components = nn.ModuleDict()

    @property
    def model_path(self) -> str:
        return self.hparams.pretrained_model_name_or_path

    def image_settings(self) -> dict[str, Any]:
        """The settings that decide the pictures (a folder made with others is not resumed into)."""
        return image_settings(self.model_path, self.hparams.torch_dtype, self.call_args, self.from_pretrained_kwargs,
                              self.cache, self.options)

    @property
    def call_args(self) -> dict[str, Any]:
        """The pipeline-call arguments of the config (before per-record overrides)."""
        return {**self.base_call_args, **self.call_kwargs}

    # ----------------------------------------------------------------- the contract with strategies

    def request(self, records: Optional[Sequence[dict[str, Any]]] = None) -> ModelRequest:
        """What a strategy may know before the weights load (see ``contract``)."""
        return ModelRequest(self.info, self.dtype_, self.call_args, dict(self.from_pretrained_kwargs), records,
                            self.options["attention_backend"], self.options["quantization"], tuple(self.adapters))

    def use_load_plan(self, plan: LoadPlan) -> None:
        """Load with ``plan`` in ``configure_model`` (a strategy's components and options)."""
        self.load_plan = plan

    def use_pipeline(self, pipeline: Any) -> None:
        """Call ``pipeline`` from now on (a strategy's parallelised or wrapped pipeline)."""
        self.pipeline = pipeline

    @property
    def needs_shard_group(self) -> bool:
        """Whether decisions inside the transformer depend on the data (a first-block cache), so
        that the ranks sharing one transformer call must agree on them (``use_shard_group``)."""
        return bool(self.cache) and self.cache.get("type") == "first_block"

    def use_shard_group(self, group: Any) -> None:
        """The process group of the ranks that hold pieces of the same transformer call (ring x
        ulysses x tp of one replica and guidance branch); the cache agrees its decisions over it."""
        if self.step_cache is not None:
            self.step_cache.set_group(group)

    def use_group(self, group: Any) -> None:
        """The process group of the ranks that make the same images (one replica's cfg x ring x
        ulysses x tp ranks): text encoding and VAE decoding are split over it (``group_work``)
        unless ``split_work`` is off. ``None``: one process per replica, nothing to split."""
        if not self.split_work or self.pipeline is None or self.group_work is not None:
            return
        from lightning_diffusion import group_work

        self.group_work = group_work.install(self.pipeline, group)
        if self.group_work is not None and self.global_rank == 0:
            log.info(f"split over the group: {self.group_work.description}")

    # ----------------------------------------------------------------- Lightning hooks

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if isinstance(datamodule, PromptDataModule):
            self.batch_size = datamodule.batch_size
            if not preflight_passed():
                self.check_records(datamodule.records, datamodule.inputs_root)

    def check_records(self, records: Sequence[dict[str, Any]], inputs_root: Optional[str] = None) -> None:
        """Per-record overrides and negative prompts must be arguments this pipeline takes (and
        the cache must suit the guidance passes the records' negative prompts turn on)."""
        problems = check_records(self.info, records, call_args=self.call_args, inputs_root=inputs_root)
        if self.cache is not None:
            problems += model_cache_problems(self.info, self.cache, self.call_args, records)
        raise_problems(problems)

    def configure_model(self) -> None:
        if self.pipeline is not None:
            return
        self.fetch_weights()
        quantized = self.quantization_configs()
        self.load_pipeline(**{
            name: load(self.info, self.dtype_, **({"quantization_config": quantized[name]} if name in quantized else {}))
            for name, load in self.load_plan.components.items()
        })

    def fetch_weights(self) -> None:
        """A hub id with network: the first process of each node fetches what ``from_pretrained``
        reads while the node's other processes wait, instead of every rank downloading (and
        locking) the same tens of gigabytes at once; offline, the cache was checked before loading."""
        from lightning_diffusion import hub

        if not hub.is_hub_id(self.info.path) or hub.offline() or self.from_pretrained_kwargs.get("local_files_only"):
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is None or strategy.local_rank == 0:
            try:
                folder = hub.fetch(self.info.path, self.from_pretrained_kwargs, progress=self.global_rank == 0)
            except Exception as err:
                known = hub.message(err, self.info.path, self.from_pretrained_kwargs)
                if known is None:
                    raise
                raise ConfigError(known) from err
            if self.global_rank == 0:
                log.info(f"{self.info.path}: weights in the cache at {folder}")
        if strategy is not None and strategy.world_size > 1:
            strategy.barrier("weights_fetched")

    def quantization_configs(self) -> dict[str, Any]:
        """``model.quantization`` as each quantized component's backend config (none without it)."""
        spec = self.options["quantization"]
        return quantization.component_configs(spec, self.info.model_index, tuple(denoisers(self.info))) if spec else {}

    def load_pipeline(self, **components: Any) -> None:
        """Load the pipeline on the CPU; ``components`` are pre-built components (a strategy may
        build the transformer itself, sharded) passed through to ``from_pretrained``."""
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        if not self.show_inner_progress:
            diffusers_logging.disable_progress_bar()
            transformers_logging.disable_progress_bar()
        # safetensors only and no remote code unless the user opts in (from_pretrained_kwargs).
        options = {"use_safetensors": True, "trust_remote_code": False, **self.from_pretrained_kwargs}
        quantized = {name: c for name, c in self.quantization_configs().items() if name not in components}
        if quantized:  # a component the strategy built was quantized by its loader
            options["quantization_config"] = quantization.pipeline_config(quantized)
        compat.apply_pipeline_patches()
        pipeline = self.info.pipeline_class.from_pretrained(  # model.pipeline_class, else the folder's
            self.info.path, dtype=self.dtype_, **options, **self.load_plan.pipeline_kwargs, **components
        )
        if not self.show_inner_progress:
            pipeline.set_progress_bar_config(disable=True)
        if self.options["quantization"] is not None and self.global_rank == 0:
            spec = self.options["quantization"]
            for name, (left, total) in quantization.left_unquantized(
                    pipeline, spec, quantization.quantized(spec, tuple(denoisers(self.info)))).items():
                log.warning(f"model.quantization: {left} of {name}'s {total} linear layers loaded in full precision "
                            "(a device map offloaded them: diffusers does not quantize weights on the CPU or disk)")
        if self.adapters:  # fused before any strategy hook, cache or compile sees the weights
            from lightning_diffusion import lora

            (self.load_plan.fuse_adapters or lora.fuse)(pipeline, self.adapters)
            if self.global_rank == 0:
                log.info(f"model.lora: {', '.join(f'{a.name} x {a.scale:g}' for a in self.adapters)} fused")
        tiling = self.options["vae_tiling"]
        if tiling:
            pipeline.vae.enable_tiling(**(tiling if isinstance(tiling, dict) else {}))
        if self.options["vae_slicing"]:
            pipeline.vae.enable_slicing()
        self.pipeline = pipeline
        if self.options["attention_backend"] is not None:
            for component in self.denoiser_modules().values():
                component.set_attention_backend(self.options["attention_backend"])
        for name, component in pipeline.components.items():
            if isinstance(component, nn.Module):
                self.components[name] = component
        if self.cache is not None:
            steps = self.call_args.get("num_inference_steps") or self.info.call_default("num_inference_steps")
            self.step_cache = install(self.cache, pipeline, steps, separate_passes=self.info.spec.cfg is not None)

    def cache_summary(self) -> Optional[dict[str, Any]]:
        """What the step cache reused in this run, summed over every process (a collective: every
        rank calls it, at the end of a run; computed once, then remembered). ``None`` without a
        data-dependent cache, which has nothing to count."""
        if self.step_cache is None or self.step_cache.kind != "first_block" or self._trainer is None:
            return None
        if self.cache_totals is None:
            # Every process counted its own decisions (rank 0 of each shard group only); sum them
            # once every rank is done (an idle wait first: replicas finish at different times).
            strategy = self.trainer.strategy
            strategy.barrier("cache_stats")
            totals = strategy.reduce(self.step_cache.stats.as_tensor().to(strategy.root_device), reduce_op="sum")
            self.cache_totals = [float(v) for v in totals.cpu()]
            line = CacheStats.describe(self.step_cache.kind, self.cache_totals)
            if line and self.trainer.is_global_zero:
                log.info(line)
        image_steps, reused, calls, skipped = (int(v) for v in self.cache_totals)
        return {"type": self.step_cache.kind, "image_steps": image_steps, "reused_image_steps": reused,
                "calls": calls, "skipped_calls": skipped,
                "reused_fraction": round(reused / image_steps, 4) if image_steps else 0.0}

    def compile_denoisers(self) -> None:
        """``model.compile`` on each denoiser of the pipeline the strategy set up (after its
        context-parallel hooks, sharding and caches), once."""
        mode = self.options["compile"]
        if mode is None or self.compiled or self.pipeline is None:
            return
        modules = self.denoiser_modules()
        for component in modules.values():
            if mode == "regional":
                component.compile_repeated_blocks()
            else:
                component.compile()
        self.compiled = True
        if self.global_rank == 0:
            log.info(f"model.compile: {mode} on {', '.join(modules)}; the first batch of each shape compiles")

    def denoiser_modules(self) -> dict[str, nn.Module]:
        """The pipeline's denoisers that are loaded (Wan 2.1 lists an empty ``transformer_2``)."""
        found = {name: getattr(self.pipeline, name, None) for name in denoisers(self.info)}
        return {name: module for name, module in found.items() if isinstance(module, nn.Module)}

    def on_predict_start(self) -> None:
        self.compile_denoisers()
        if self.step_cache is not None:  # a second predict on the same module counts afresh
            self.step_cache.stats, self.cache_totals = CacheStats(), None

    def teardown(self, stage: str) -> None:
        if stage == "predict":
            self.cache_summary()
            if self.group_work is not None and self.global_rank == 0:
                log.info(self.group_work.summary())

    def negative_prompt(self, sample: dict[str, Any]) -> Optional[str]:
        """The record's own negative prompt, else ``call_kwargs.negative_prompt`` (the default)."""
        own = sample.get("negative_prompt")
        return own if own is not None else self.call_args.get("negative_prompt")

    def call_arguments(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {**self.call_args, **sample["overrides"]}

    def predict_step(self, batch: list[dict[str, Any]], batch_idx: int = 0, dataloader_idx: int = 0) -> list[dict]:
        # Samples with different per-record overrides cannot share one pipeline call.
        groups: dict[str, list[dict[str, Any]]] = {}
        spec = self.info.spec
        for sample in batch:
            key = json.dumps(self.call_arguments(sample), sort_keys=True, default=str)
            if sample.get("inputs"):  # samples with other input fields cannot share a call
                key += json.dumps(sorted(sample["inputs"]))
                if spec.shares_input_size:  # a call resizes every input to its first one's size
                    from lightning_diffusion.inputs import input_sizes

                    key += json.dumps(input_sizes(sample["inputs"]))
            groups.setdefault(key, []).append(sample)
        self.batch_size = max(self.batch_size or 0, len(batch))
        calls = [samples[i:i + (spec.call_batch or len(samples))] for samples in groups.values()
                 for i in range(0, len(samples), spec.call_batch or len(samples))]
        results = {}
        for samples in calls:
            for sample, image, params in zip(samples, *self.generate(samples)):
                results[sample["index"]] = {
                    "index": sample["index"],
                    "prompt": sample["prompt"],
                    "seed": sample["seed"],
                    "negative_prompt": self.negative_prompt(sample),
                    "image": image,
                    "params": params,
                }
        return [results[sample["index"]] for sample in batch]

    def generate(self, samples: list[dict[str, Any]]) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
        """One pipeline call for samples that share their arguments; noise from one CPU generator each.
        With ``pad_batches`` the call is padded to the batch size and the padding's outputs dropped."""
        real = len(samples)
        size = min(self.batch_size or 0, self.info.spec.call_batch or self.batch_size or 0)
        if self.pad_batches and real < size:
            samples = samples + [samples[-1]] * (size - real)
        kwargs = self.call_arguments(samples[0])
        kwargs.pop("negative_prompt", None)
        generators = [torch.Generator("cpu").manual_seed(sample["seed"]) for sample in samples]
        negatives = [self.negative_prompt(sample) for sample in samples]
        if any(n is not None for n in negatives):
            kwargs["negative_prompt"] = [n or "" for n in negatives]
        given: list[dict[str, Any]] = [{} for _ in samples]
        if samples[0].get("inputs"):
            from lightning_diffusion import inputs

            images, given = inputs.load(samples)
            if self.info.spec.call_batch == 1:  # one prompt a call: its input itself, not a list of one
                images = {name: values[0] for name, values in images.items()}
            kwargs.update(images)
        output = self.pipeline(
            prompt=[sample["prompt"] for sample in samples],
            generator=generators,
            output_type="np",
            **kwargs,
        )
        images = np.asarray(getattr(output, self.info.spec.output), dtype=np.float32)
        recorded = {k: v for k, v in kwargs.items() if k not in ("height", "width", "negative_prompt", *INPUT_FIELDS)}
        options = {k: v for k, v in self.options.items() if v not in (None, False)}
        params = {"model": self.model_path, **self.info.call_defaults, **recorded, **options}
        sizes = [{"height": int(image.shape[-3]), "width": int(image.shape[-2])} for image in images]
        if images.ndim == 5:  # videos: (batch, frames, height, width, 3)
            sizes = [{**size, "num_frames": int(video.shape[0])} for size, video in zip(sizes, images)]
        return list(images)[:real], [{**params, **size, **({"inputs": files} if files else {})}
                                     for size, files in zip(sizes, given)][:real]
