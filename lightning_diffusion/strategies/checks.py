"""The weight-free rules of the parallel strategies, each written once.

They follow the project's one convention (``core.checks``): a rule, named ``*_problems``, returns the
problems it finds (messages, or the ``ConfigError`` of a reader it ran; empty when all is well) and
never raises for bad input. Each reports the first problem of its kind, with what to change.
``MeshStrategy.check_request`` runs the ones its degrees need and collects their problems; only the
entry points raise them, through ``errors.raise_problems``: the CLI's ``check_config`` (after
``preflight`` collects everything) and, from Python, the strategy's ``setup_environment``.

A reader computes a value and raises a ``ConfigError`` when there is none (``planned_models``,
``resolved_attention_backend``); a rule runs it through ``errors.run_check``, which turns the refusal
into a problem. The attention backend's name has one rule for the model's and the strategy's:
``pipelines.checks.attention_backend_problems``.

The rules read only a ``ModelRequest`` (configs, spec, call arguments, records) and the
``ParallelDims``: no weight is read and no collective runs, so the CLI's preflight and every rank run
them alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_diffusion.contract import ModelRequest
from lightning_diffusion.core.errors import ConfigError, run_check
from lightning_diffusion.core.records import CallArgs
from lightning_diffusion.pipelines import quantization
from lightning_diffusion.pipelines.specs import cfg_supported, spec_for
from lightning_diffusion.strategies.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from lightning_diffusion.pipelines.facts import PipelineFacts
    from lightning_diffusion.pipelines.lora import Adapter
    from lightning_diffusion.pipelines.specs import PipelineSpec

# from_pretrained options that diffusers cannot combine with a tensor-parallel load, and why.
TP_INCOMPATIBLE_OPTIONS = {
    "quantization_config": "quantized weights cannot be sharded into DTensors",
    "device_map": "tensor parallelism already places each rank's shard on its device",
    "max_memory": "it only applies with device_map",
    "offload_folder": "offloaded weights cannot be sharded",
    "offload_state_dict": "offloaded weights cannot be sharded",
}


# Backends that run on a CPU (the others need CUDA, ROCm, an NPU or XLA kernels).
CPU_ATTENTION_BACKENDS = ("native", "_native_math")


def backend_device_problems(name: str, device: torch.device) -> list[str]:
    """An attention backend that cannot run on ``device`` (a CUDA kernel in a CPU rehearsal)."""
    if device.type == "cpu" and name not in CPU_ATTENTION_BACKENDS:
        return [f"attention_backend {name!r} needs a GPU; on CPU use one of: "
                f"{', '.join(CPU_ATTENTION_BACKENDS)} (or leave it unset)."]
    return []


def cfg_problems(class_name: str, call_args: CallArgs, default: Callable[[str], object],
                 records: Optional[Sequence[object]]) -> list[str]:
    """A cfg pair would only run the same work twice unless the pipeline's spec says how its two
    guidance passes are fed and the config turns the negative branch on; refuse instead.
    ``default(name)``: the pipeline's default for a call argument (``PipelineInfo.call_default``:
    ``true_cfg_scale`` is 4.0 for Qwen-Image, 1.0 for FLUX)."""
    entry = spec_for(class_name).cfg
    if entry is None:
        return [
            f"cfg=2 needs a pipeline whose two guidance passes this project knows how to split; {class_name} "
            f"is not one. Supported: {cfg_supported()}. Use cfg=1 (data_parallel) for it."
        ]
    scale = call_args.get(entry.scale_arg, default(entry.scale_arg))
    if not isinstance(scale, (int, float)) or scale <= 1:
        where = ("model.guidance_scale" if entry.scale_arg == "guidance_scale"
                 else f"model.call_kwargs.{entry.scale_arg}")
        return [
            f"cfg=2 splits classifier-free guidance, but {class_name} runs it only with {entry.scale_arg} > 1 "
            f"(got {scale!r}): set {where} above 1, or use cfg=1."
        ]
    # the scale runs it: whether each image's negative pass runs is now up to its negative prompt
    if not entry.runs(scale, negative=False) and records is not None and call_args.get("negative_prompt") is None:
        from lightning_diffusion.input.data import summarize_records

        summary = summarize_records(records)
        if summary.without_negative:
            shown = summary.first_without_negative
            lines = ", ".join(map(str, shown)) + (" ..." if summary.without_negative > len(shown) else "")
            return [
                f"cfg=2 needs a negative prompt for every image: {class_name} skips the unconditional pass "
                f"without one, and {summary.without_negative} of {summary.count} records have none (records "
                f'{lines}). Give each record a "negative_prompt" (a .jsonl field or .csv column), or use cfg=1.'
            ]
    return []


def planned_models(request: ModelRequest, plan: str, kind: str) -> dict[str, type[Any]]:
    """A reader: the pipeline's diffusers models with ``plan`` (``_cp_plan``, ``_tp_plan``); raises a
    ConfigError that names what the pipeline can run instead and the diffusers models that have the
    plan when it has none (the rules run it through ``run_check``)."""
    from lightning_diffusion.pipelines.facts import models_with_plan

    planned = request.info.models_with(plan)
    if not planned:
        other = request.info.facts.tp_plan if plan == "_cp_plan" else request.info.facts.cp_plan
        instead = "data_parallel" + (" or " + ("tensor" if plan == "_cp_plan" else "context") + " parallelism"
                                     if other else "")
        raise ConfigError(
            f"{request.info.class_name} has no model with a {kind}-parallel plan ({plan}) in diffusers "
            f"{_diffusers_version()}: use {instead}, or a pipeline whose transformer has one "
            f"({', '.join(models_with_plan(plan))})."
        )
    return planned


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def context_parallel_problems(request: ModelRequest, dims: ParallelDims, ulysses_anything: bool,
                              ring_anything: bool) -> list:
    """The pipeline has a ``_cp_plan``, heads divide the Ulysses degree, and the token counts of
    every kind of image (per-record sizes included) divide the context-parallel degree."""
    info = request.info
    problems: list = []
    planned = run_check(problems, planned_models, request, "_cp_plan", "context")
    if planned is None:
        return problems
    refusal = context_refusal(info.spec, info.facts)
    if refusal:
        return [f"{info.class_name} cannot run under context parallelism: {refusal}. Use data_parallel."]
    for name, cls in planned.items():
        missing = plan_misses(cls, info.configs.get(name, {}))
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            return [f"{name} ({cls.__name__}) lacks modules its _cp_plan in diffusers {_diffusers_version()} names "
                    f"({shown}): the plan is written for the published model's layers, not this folder's config. "
                    "Use data_parallel."]
    split = dims.ulysses * dims.tp
    for name in planned:
        heads = info.configs.get(name, {}).get("num_attention_heads")
        if not isinstance(heads, int) or heads % split == 0:
            continue
        if dims.tp > 1:
            return [
                f"{name} has {heads} attention heads, not divisible by tp x ulysses = {dims.tp} x "
                f"{dims.ulysses}: Ulysses splits the heads each tensor-parallel rank holds; "
                "lower one of the two or use ring instead of ulysses."
            ]
        divisors = ", ".join(str(d) for d in range(2, heads + 1) if heads % d == 0)
        padding = dims.ulysses - heads % dims.ulysses
        per_rank = (heads + padding) // dims.ulysses
        if padding < per_rank:  # what diffusers' Ulysses-anything asserts (attention_dispatch._maybe_pad_qkv_head)
            if not ulysses_anything:
                return [
                    f"{name} has {heads} attention heads, not divisible by ulysses_degree={dims.ulysses}: set "
                    f"ulysses_anything: true (strategy name: ulysses_anything), or a ulysses_degree that divides "
                    f"{heads} ({divisors})."
                ]
            continue
        return [
            f"{name} has {heads} attention heads, not divisible by ulysses_degree={dims.ulysses}, and "
            f"ulysses_anything cannot split them either: it pads them to {heads + padding} and needs the {padding} "
            f"padding heads to be fewer than the {per_rank} heads per rank. Choose a ulysses_degree that divides "
            f"{heads} ({divisors})."
        ]
    if info.spec.prompt_length_text and not ulysses_anything:
        # diffusers splits the text tokens too; an odd prompt would fail after the weights load. Ring's
        # anything-mode refuses the text attention mask these pipelines pass (diffusers 0.42.1).
        return [
            f"{info.class_name}'s text tokens have each prompt's own length, which the context-parallel degree "
            f"{dims.cp} would have to divide (an odd prompt fails after the weights load): use "
            "Ulysses alone with ulysses_anything: true (ring_anything rejects its attention mask; tp with an "
            "anything-mode is not verified here)."
        ]
    mask = context_mask_problems(info.class_name, info.spec, info.facts, dims, ulysses_anything or ring_anything)
    if mask or ulysses_anything or ring_anything:
        return mask
    for call_args in request.call_arg_sets():
        problems = sequence_problems(request, dims, call_args)
        if problems:
            return problems
    if info.spec.reference_tokens:
        return reference_sequence_problems(request, dims)
    return []


def context_mask_problems(class_name: str, spec: PipelineSpec, facts: PipelineFacts, dims: ParallelDims, anything: bool
                          ) -> list[str]:
    """A transformer whose ``_cp_plan`` splits a text attention mask with the sequence gets the wrong
    mask under some of diffusers 0.42.1's context-parallel attentions: ring applies each rank's
    mask to every key/value block it receives (``TemplatedRingAttention``: plausible, wrong
    pictures), ring-anything refuses any mask after the weights load, Unified neither gathers nor
    splits it, and Ulysses-anything of degree 3 or more trims the gathered mask at the wrong places
    when the ranks' text shards differ in length. Returns why (none when the mode is right)."""
    masks = facts.split_masks()
    if not masks or dims.cp == 1:
        return []
    named = ", ".join(f"{name}.{'/'.join(args)}" for name, args in masks.items())
    mode = ("ring" if dims.ulysses == 1 else "unified") if dims.ring > 1 else "ulysses"
    mode += "_anything" if anything and dims.ring * dims.ulysses > 1 else ""
    allowed = spec.cp_mask_modes
    if mode in allowed and not (anything and dims.ulysses >= 3):
        return []
    reason = {
        "ring": "ring attention applies each rank's mask to every key/value block (wrong pictures)",
        "unified": "Unified attention neither gathers the mask nor splits it with the heads",
        "ring_anything": "ring_anything refuses an attention mask",
        "unified_anything": "Unified attention neither gathers the mask nor splits it with the heads",
        "ulysses_anything": ("Ulysses-anything trims the gathered mask at the wrong places for 3 or more ranks"
                             if dims.ulysses >= 3 else "Ulysses-anything is not verified with this transformer's mask"),
    }.get(mode, "this mode is not verified with a split text mask")
    fix = " or ".join(m.replace("_", "-") + (" of degree 2" if m.endswith("anything") else "") for m in allowed)
    return [f"{class_name}: its transformer's _cp_plan splits the text attention mask ({named}) with the sequence, "
            f"and in diffusers {_diffusers_version()} {reason}: use {fix}, or data_parallel."]


def context_refusal(spec: PipelineSpec, facts: PipelineFacts) -> Optional[str]:
    """Why context parallelism cannot run this pipeline although its transformer has a ``_cp_plan``:
    a ControlNet without one (the loop adds its residuals, made over the whole sequence, to the
    transformer's blocks, which the plan splits), a per-token argument of this pipeline's call that the
    plan leaves whole (LTX image-to-video's timestep), or what the registry says (``cp_refused``)."""
    if facts.unsplit_controls:
        return (f"its {', '.join(facts.unsplit_controls)} has no _cp_plan, and the residuals it makes over the whole "
                "sequence join the transformer's blocks, which context parallelism splits")
    if facts.unsplit_per_token:
        component, argument, mask = facts.unsplit_per_token[0]
        return (f"its call passes the {component} a {argument} per latent token (computed from {mask}), which the "
                f"{component}'s _cp_plan in diffusers {_diffusers_version()} does not split with the tokens")
    return spec.cp_refused


def plan_misses(cls: type[Any], config: dict[str, Any]) -> list[str]:
    """The module names of ``cls._cp_plan`` that the model ``config`` describes lacks (a ``*`` stands
    for each item of a ModuleList, as diffusers reads it); built on the meta device, no weight. A
    config the class cannot build reports nothing (the load reports it)."""
    from lightning_diffusion.pipelines.facts import _meta_model

    model = _meta_model(cls, config)
    if model is None:
        return []

    def found(module: object, atoms: list[str]) -> bool:
        if not atoms:
            return True
        head, rest = atoms[0], atoms[1:]
        if head == "*":
            return isinstance(module, torch.nn.ModuleList) and all(found(m, rest) for m in module)
        return isinstance(getattr(module, head, None), torch.nn.Module) and found(getattr(module, head), rest)

    return [name for name in cls._cp_plan if name and not found(model, name.split("."))]


# ``context_modes`` of a pipeline whose text has each prompt's own length (Qwen-Image): Ulysses-
# anything of degree 2 only (``context_parallel_problems`` and ``context_mask_problems``).
ULYSSES_ANYTHING_2 = "ulysses_anything_2"


def context_modes(spec: PipelineSpec, facts: Optional[PipelineFacts]) -> tuple[str, ...]:
    """The context-parallel attentions predict runs for this pipeline: ``ulysses`` and ``ring``;
    none without a ``_cp_plan``; Ulysses alone when its plan splits a text mask
    (``context_mask_problems``); ``ULYSSES_ANYTHING_2`` alone for a prompt-length text, which needs
    Ulysses-anything, verified with its mask at degree 2. ``facts``: the pipeline's
    ``PipelineFacts``, or None to read the registry's transformer class."""
    if facts is None:
        from lightning_diffusion.pipelines.facts import denoiser_facts

        facts = denoiser_facts(spec.class_name, spec.transformer_class)
    spec = spec.resolved(facts)
    if not facts.cp_plan or context_refusal(spec, facts):
        return ()
    masks = bool(facts.split_masks())
    if spec.prompt_length_text:
        return (ULYSSES_ANYTHING_2,) if not masks or "ulysses_anything" in spec.cp_mask_modes else ()
    return ("ulysses",) if masks else ("ulysses", "ring")


def reference_sequence_problems(request: ModelRequest, dims: ParallelDims, most: int = 3) -> list[str]:
    """Pipelines whose transformer sees the input image's tokens beside the output's (FLUX.1
    Kontext): each record's total, from its own image's size, must divide the degree."""
    from lightning_diffusion.input.data import record_inputs
    from lightning_diffusion.input.images import upright_size
    from lightning_diffusion.pipelines.specs import _load

    reference_tokens = request.info.spec.reference_tokens
    assert reference_tokens is not None  # called for such pipelines only (context_parallel_problems)
    tokens_of = _load(reference_tokens)
    mode = "ulysses_anything" if dims.ring == 1 else "ring_anything"
    bad = []
    for number, record in enumerate(request.records or [{}], start=1):
        image = record_inputs(record).get("image")
        path = image[0] if isinstance(image, list) else image
        try:
            size = upright_size(path) if path else None
        except OSError:
            continue  # an unreadable image is reported by the record checks
        args = {**request.call_args, **{k: v for k, v in record.items() if k in request.info.call_parameters}}
        output, reference = tokens_of(size, args)
        if (output + reference) % dims.cp:
            bad.append(f"prompt record {number}: {output} output + {reference} reference image tokens = "
                       f"{output + reference}")
            if len(bad) == most:
                break
    if bad:
        return [
            f"{request.info.class_name} joins the input image's tokens to the output's, and their sum must divide the "
            f"context-parallel degree {dims.cp}: {'; '.join(bad)}. Set {mode}: true (strategy name: {mode}), which "
            "splits any count, or give images whose token counts divide it."
        ]
    return []


def sequence_problems(request: ModelRequest, dims: ParallelDims, call_args: CallArgs) -> list[str]:
    """The image and text token counts of one set of call arguments divide the context-parallel degree."""
    info = request.info
    height, width = call_args.get("height"), call_args.get("width")
    degree = dims.cp
    if dims.ring > 1 and dims.ulysses > 1 or dims.tp > 1:
        fix = "choose sizes"
    else:
        mode = "ulysses_anything" if dims.ring == 1 else "ring_anything"
        fix = f"set {mode}: true (strategy name: {mode}), or choose sizes"
    for kind, length in info.sequence_lengths(height, width, call_args).items():
        if length % degree == 0 or (kind == "image" and info.spec.reference_tokens):
            continue  # (image tokens that depend on the input image are checked per record)
        if kind == "image":
            m = info.size_multiple
            return [
                f"{height}x{width} gives {length} image tokens ((height/{m}) x (width/{m})), not divisible by "
                f"the context-parallel degree {degree}: {fix} whose token count is divisible by {degree}."
            ]
        arg = info.spec.text_length_arg
        assert arg is not None  # a text length is known only through it (PipelineInfo.sequence_lengths)
        return [
            f"{arg}={length} text tokens are not divisible by the context-parallel degree {degree}: "
            f"{fix.replace('sizes', 'a ' + arg)} divisible by {degree}."
        ]
    return []


def shardable_problems(cls: type[Any], config: dict[str, Any], tp_degree: int, name: str) -> list[str]:
    """Heads and every (packed) block of the plan must divide by ``tp_degree``; checked on an empty
    (meta) model built from the config alone, so no weight is read."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp_degree:
        return [f"{name} has {heads} attention heads, not divisible by tp_degree={tp_degree}."]
    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    try:
        resolve_tp_shard_specs(model, cls._tp_plan, tp_degree)
    except ValueError as err:
        return [f"{name}: {err} Choose a tp_degree that divides it."]
    return []


def tensor_parallel_problems(request: ModelRequest, dims: ParallelDims) -> list:
    """A ``_tp_plan``, loading options diffusers can shard, safetensors weights, divisible blocks."""
    info = request.info
    problems: list = []
    planned = run_check(problems, planned_models, request, "_tp_plan", "tensor")
    if planned is None:
        return problems
    options = request.from_pretrained_kwargs
    for option, reason in TP_INCOMPATIBLE_OPTIONS.items():
        if options.get(option) is not None:
            return [f"model.from_pretrained_kwargs.{option} cannot be used with tensor parallelism: {reason}."]
    sharded_and_quantized = [name for name in quantization.quantized(request.quantization, tuple(info.denoisers()))
                             if name in planned]
    if sharded_and_quantized:
        return [
            f"model.quantization quantizes {', '.join(sharded_and_quantized)}, which tensor parallelism shards while "
            f"it loads, and {TP_INCOMPATIBLE_OPTIONS['quantization_config']}: leave it out of "
            "model.quantization.components, or use data_parallel or context parallelism."
        ]
    if options.get("use_safetensors") is False or options.get("low_cpu_mem_usage") is False:
        return [
            "Tensor parallelism reads each rank's slice of safetensors files while loading: "
            "drop use_safetensors=False and low_cpu_mem_usage=False."
        ]
    for adapter in request.lora:
        problems = adapter_shardable_problems(request, adapter, planned)
        if problems:
            return problems
    for name, cls in planned.items():
        folder = Path(info.path) / name
        if folder.is_dir() and not any(folder.glob("*.safetensors")):
            return [
                f"{folder} has no .safetensors weights; tensor parallelism reads each rank's slice from "
                "safetensors files. Convert the checkpoint (save_pretrained(safe_serialization=True))."
            ]
        problems = shardable_problems(cls, info.configs.get(name, {}), dims.tp, name)
        if problems:
            return problems
    return []


def adapter_shardable_problems(request: ModelRequest, adapter: Adapter, planned: dict[str, type[Any]]) -> list:
    """An adapter whose update has another shape than its layer's weight (a control LoRA that widens
    an input) cannot be cut as the weight is cut; DoRA and biased adapters are refused by ``updates``."""
    from lightning_diffusion.pipelines import lora

    problems: list = []
    updates = run_check(problems, lora.updates, request.info.pipeline_class, adapter)
    if updates is None:
        return problems
    for component, modules in updates.items():
        if component not in planned:
            continue
        with torch.device("meta"):
            model = planned[component].from_config(request.info.configs.get(component, {}))
        for module, (a, b, _) in modules.items():
            weight = model.get_submodule(module).weight
            if (b.shape[0], a.shape[1]) != tuple(weight.shape):
                return [
                    f"model.lora: {adapter.name} changes the shape of {component}.{module} ({tuple(weight.shape)} to "
                    f"{(b.shape[0], a.shape[1])}), which tensor parallelism cannot shard: use data_parallel or context "
                    "parallelism for this adapter."
                ]
    return []


def resolved_attention_backend(backend: Optional[str], device: torch.device, dims: ParallelDims,
                               dtype: torch.dtype) -> Optional[str]:
    """A reader: the attention backend context parallelism runs with: the configured one, or on CUDA
    with ring attention ``_native_cudnn`` (``native`` returns no log-sum-exp there), which needs half
    precision. Raises a ConfigError when there is none (``MeshStrategy.check_request`` runs it as a
    rule through ``run_check``; the set-up reads it once the request was checked)."""
    if device.type == "cpu" or dims.ring == 1:
        return backend
    if backend == "native":
        raise ConfigError("Ring attention on CUDA needs an attention backend that returns the log-sum-exp, and "
                          "native does not: use _native_cudnn (bfloat16 or float16), flash or sage, or leave it unset.")
    if backend is not None:  # a half-precision backend in float32: pipelines.checks.backend_dtype_problems
        return backend
    if dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(
            "Ring attention on CUDA needs an attention backend that returns the log-sum-exp; those that "
            "diffusers has need bfloat16 or float16: set model.torch_dtype to bfloat16, or attention_backend."
        )
    return "_native_cudnn"
