"""The model group's options (``DiffusionModule``'s arguments), each declared once: the defaults
here are the ones ``DiffusionModule``'s signature, ``checks.model_problems``, ``preflight``
and run.json use.

Kept free of torch and Lightning: the CLI's checks import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from lightning_diffusion.core.groups import group_options
from lightning_diffusion.core.records import CallArgs

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch import nn

    from lightning_diffusion.pipelines.lora import Adapter

# The call arguments the model group names (the rest go in ``call_kwargs``); records may set them.
MODEL_CALL_ARGS = ("height", "width", "num_inference_steps", "guidance_scale", "num_frames")
# The options that change pictures (float rounding, seams): recorded in run.json and in each image's
# metadata, so that a folder is not resumed with other values.
OPTIONS = ("pipeline_class", "lora", "adapters", "vae_tiling", "compile", "vae_slicing", "attention_backend",
           "quantization")


@dataclass(frozen=True)
class ModelSettings:
    """``DiffusionModule``'s options (the ``model`` group). Values are as given:
    ``checks.model_problems`` says what is wrong with them.

    Options:
        pretrained_model_name_or_path: hub id, local folder written by ``save_pretrained``, or a
            tiny pipeline that needs no download: ``tiny:shapes`` (the quickstart's: a small FLUX.1
            trained to draw coloured shapes) or ``tiny:flux`` and the others (random weights, for
            rehearsal and tests).
        torch_dtype: ``float32``, ``bfloat16`` or ``float16``.
        height: image height in pixels for every image (``None``: the pipeline's default); a prompt
            record may override it, as it may the three below.
        width: image width in pixels (``None``: the pipeline's default).
        num_inference_steps: denoising steps (``None``: the pipeline's default).
        guidance_scale: the guidance scale (``None``: the pipeline's default).
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
        pad_batches: run every pipeline call with the configured ``data.batch_size`` (a prompt
            set of fewer images: its own size): a short batch (a replica's last, or a group of
            records with their own overrides) is padded with copies of its last sample, whose
            outputs are dropped. Batched kernels round differently for different batch sizes, so
            this is what makes image i bit-identical for any number of replicas and nodes, and
            across resumes (docs/config.md).
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
        lora: LoRA adapters fused into the weights before inference, under every strategy
            (``[{path, weight_name, scale}]``).
        adapters: LoRA adapters by name (``{style: {path, scale}}``) that each record chooses
            (``"adapters": ["style"]``; docs/lora.md).
        max_loaded_adapters: adapters a replica holds read at once (least recently used dropped).
        pipeline_class: run the weights with another diffusers pipeline class, such as
            ``FluxImg2ImgPipeline`` or ``FluxInpaintPipeline`` on FLUX.1 weights (the records then
            carry ``image`` and ``mask_image`` paths).
    """

    pretrained_model_name_or_path: str = "tiny:shapes"
    torch_dtype: str = "float32"
    height: Optional[int] = None
    width: Optional[int] = None
    num_inference_steps: Optional[int] = None
    guidance_scale: Optional[float] = None
    num_frames: Optional[int] = None
    call_kwargs: Optional[dict[str, Any]] = None
    from_pretrained_kwargs: Optional[dict[str, Any]] = None
    show_inner_progress: bool = False
    pad_batches: bool = True
    cache: Optional[dict[str, Any]] = None
    vae_tiling: Optional[Union[bool, dict[str, int]]] = None
    split_work: bool = True
    compile: Optional[str] = None
    vae_slicing: bool = False
    attention_backend: Optional[str] = None
    quantization: Optional[dict[str, Any]] = None
    pipeline_class: Optional[str] = None
    lora: Optional[list[dict[str, Any]]] = None
    adapters: Optional[dict[str, Any]] = None
    max_loaded_adapters: int = 8

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> ModelSettings:
        """The group's values: ``given`` (a parsed config's ``model`` section, ``DiffusionModule``'s
        hyperparameters, or keyword arguments), every absent option at its default."""
        return cls(**group_options(cls, given, "the model"))

    @classmethod
    def among(cls, given: Mapping[str, Any]) -> ModelSettings:
        """The group's values among ``given``, which may hold more (the hyperparameters of a
        subclass of ``DiffusionModule`` hold its own arguments too)."""
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})

    def named_call_args(self) -> CallArgs:
        """The call arguments the group names (``MODEL_CALL_ARGS``), None where not given."""
        return {key: getattr(self, key) for key in MODEL_CALL_ARGS}

    def options(self) -> dict[str, Any]:
        """The options that change pictures (``OPTIONS``), as given."""
        return {key: getattr(self, key) for key in OPTIONS}


# Called as ``load(info, dtype)``, plus ``quantization_config=`` (the backend config for the
# component's ``from_pretrained``) for a component ``model.quantization`` names; a strategy whose
# loader cannot quantize refuses that in ``check_request``.
ComponentLoader = Callable[..., "nn.Module"]


@dataclass
class LoadPlan:
    """How the module loads its pipeline: ``components`` are built by the strategy (called with the
    pipeline info and dtype) and passed to ``from_pretrained`` by name; ``pipeline_kwargs`` are
    extra ``from_pretrained`` arguments (a pipeline-level ``device_map``). ``fuse_adapters``: how to
    fuse the LoRA adapters into the loaded pipeline, ``(pipeline, adapters)``, where diffusers' own
    fuse cannot (tensor-parallel shards); ``None``: ``lora.fuse``."""

    components: dict[str, ComponentLoader] = field(default_factory=dict)
    pipeline_kwargs: dict[str, Any] = field(default_factory=dict)
    fuse_adapters: Optional[Callable[[DiffusionPipeline, Sequence[Adapter]], None]] = None
