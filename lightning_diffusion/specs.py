"""Per-pipeline facts: one ``PipelineSpec`` per diffusers pipeline class, in one registry.

Everything the project knows about a pipeline before its weights load lives here: its token
geometry (for context-parallel checks and ``plan``), the call argument that fixes its text length,
its default size and output attribute, how its two classifier-free-guidance branches are fed (for
CFG parallel), how it runs as staged encode / denoise / decode (for ``DeviceMapStrategy``), the
published sizes of its well-known checkpoints (for ``plan``) and which tiny builder makes an offline
copy of it (``tiny:NAME``). Every other module asks ``spec_for(class_name)``.

Adding a pipeline is one ``register(PipelineSpec(...))`` call here, plus a tiny builder in
``tiny.py`` if the tests should run it. Nothing here imports diffusers' model code or the tiny
builders at import time: the inspection path stays light.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class CFGBranches:
    """How one pipeline feeds its two classifier-free-guidance branches (see ``strategies.cfg_split``).

    ``kwargs``: the transformer arguments that differ between the branches, in the order of
    ``encode_prompt``'s outputs. ``one_call``: ``encode_prompt`` returns (positive, negative) in one
    call (Wan) instead of being called once per prompt. ``scale_arg`` must exceed 1 for CFG to run;
    ``needs_negative_prompt``: without a negative prompt the pipeline skips the second pass.
    ``transformers``: the components called in the loop.
    """

    kwargs: tuple[str, ...]
    scale_arg: str
    needs_negative_prompt: bool = True
    one_call: bool = False
    transformers: tuple[str, ...] = ("transformer",)


@dataclass(frozen=True)
class PublishedModel:
    """Sizes of a published checkpoint, for ``plan`` when its weights are not on this machine:
    components in GB (bf16), the transformer's attention heads, hidden size and layers, and the
    text tokens it attends to."""

    components: dict[str, float]
    heads: int
    hidden: int
    layers: int
    text_tokens: int = 512


@dataclass(frozen=True)
class PipelineSpec:
    """What the project knows of one diffusers pipeline class.

    ``patch``: latent pixels packed into one token along each side. ``vae_scale``: the VAE's spatial
    downsampling when the folder's VAE config does not say (so pixels per token side are
    ``vae_scale * patch``). ``text_length_arg``: the call argument that fixes the text-token count
    the transformer splits (padded to it), if any. ``prompt_length_text``: text tokens have each
    prompt's own length instead, so no context-parallel degree is known to divide them.
    ``default_size``: (height, width) in pixels when the call gives none. ``output``: the output
    attribute (``images``, or ``frames`` for video). ``frames_arg``, ``temporal_scale``,
    ``default_frames``: the frame-count argument of a video pipeline, which must be
    ``temporal_scale * k + 1``. ``transformer_class``: the diffusers class of its denoiser (its
    ``_cp_plan`` and ``_tp_plan`` say which parallelism diffusers has for it). ``cfg``: its CFG
    branches, if CFG parallel knows them. ``stages``: dotted path of its staged encode/decode class.
    ``published``: well-known checkpoints by hub id. ``tiny``: the ``tiny:NAME`` that builds an
    offline copy, and ``tiny_builder`` the dotted path of the function that writes it. ``inputs``:
    the per-record input files it needs (``image``, ``mask_image``), read from each prompt record.
    """

    class_name: str
    patch: int = 1
    vae_scale: int = 8
    text_length_arg: Optional[str] = None
    prompt_length_text: bool = False
    default_size: Optional[tuple[int, int]] = None
    output: str = "images"
    frames_arg: Optional[str] = None
    temporal_scale: int = 1
    default_frames: Optional[int] = None
    transformer_class: Optional[str] = None
    cfg: Optional[CFGBranches] = None
    stages: Optional[str] = None
    published: dict[str, PublishedModel] = field(default_factory=dict)
    tiny: Optional[str] = None
    tiny_builder: Optional[str] = None
    inputs: tuple[str, ...] = ()

    @property
    def is_video(self) -> bool:
        return self.frames_arg is not None

    def latent_frames(self, frames: Optional[int]) -> int:
        """Frames the transformer sees for ``frames`` output frames (1 for images)."""
        if not self.is_video:
            return 1
        frames = frames or self.default_frames or 1
        return (frames - 1) // self.temporal_scale + 1

    def image_tokens(self, height: int, width: int, frames: Optional[int], pixels_per_token: int) -> int:
        """Image (or video) tokens of one sample: the only place this product is computed."""
        return (height // pixels_per_token) * (width // pixels_per_token) * self.latent_frames(frames)

    def stages_class(self) -> Optional[type]:
        return _load(self.stages) if self.stages else None

    def has_plan(self, attribute: str) -> bool:
        """Whether diffusers' denoiser class of this pipeline has ``_cp_plan`` / ``_tp_plan``."""
        if self.transformer_class is None:
            return False
        import diffusers

        return getattr(getattr(diffusers, self.transformer_class, None), attribute, None) is not None


def _load(dotted: str) -> Any:
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


SPECS: dict[str, PipelineSpec] = {}


def register(spec: PipelineSpec) -> PipelineSpec:
    SPECS[spec.class_name] = spec
    return spec


def spec_for(class_name: str) -> PipelineSpec:
    """The spec of a pipeline class; an unregistered class gets an empty spec (no known facts)."""
    return SPECS.get(class_name) or PipelineSpec(class_name)


def with_cfg() -> dict[str, PipelineSpec]:
    return {name: spec for name, spec in SPECS.items() if spec.cfg is not None}


def cfg_supported() -> str:
    """The pipelines CFG parallel can split, with the argument that turns their CFG on."""
    return ", ".join(f"{name} ({spec.cfg.scale_arg} > 1)" for name, spec in with_cfg().items())


def with_plan(attribute: str) -> list[str]:
    """Registered pipelines whose denoiser has a diffusers ``_cp_plan`` or ``_tp_plan``."""
    return [name for name, spec in SPECS.items() if spec.has_plan(attribute)]


def with_stages() -> list[str]:
    return [name for name, spec in SPECS.items() if spec.stages]


def published(hub_id: str) -> Optional[tuple[PipelineSpec, PublishedModel]]:
    for spec in SPECS.values():
        if hub_id in spec.published:
            return spec, spec.published[hub_id]
    return None


def all_published() -> list[str]:
    return [hub_id for spec in SPECS.values() for hub_id in spec.published]


def tiny_builders() -> dict[str, Callable[..., Any]]:
    """``tiny:NAME`` -> the builder function (imported only when asked)."""
    return {spec.tiny: _load(spec.tiny_builder) for spec in SPECS.values() if spec.tiny and spec.tiny_builder}


def tiny_names() -> list[str]:
    return [spec.tiny for spec in SPECS.values() if spec.tiny]


def tiny_builder(name: str) -> Optional[Callable[..., Any]]:
    for spec in SPECS.values():
        if spec.tiny == name and spec.tiny_builder:
            return _load(spec.tiny_builder)
    return None


# ----------------------------------------------------------------------------- the registry

register(PipelineSpec(
    "FluxPipeline", patch=2, text_length_arg="max_sequence_length", default_size=(1024, 1024),
    transformer_class="FluxTransformer2DModel",
    cfg=CFGBranches(("encoder_hidden_states", "pooled_projections", "txt_ids"), "true_cfg_scale"),
    stages="lightning_diffusion.staged:FluxStages",
    published={"black-forest-labs/FLUX.1-dev": PublishedModel(
        {"transformer": 23.8, "text_encoder_2": 9.5, "text_encoder": 0.25, "vae": 0.17},
        heads=24, hidden=3072, layers=57, text_tokens=512)},
    tiny="flux", tiny_builder="lightning_diffusion.tiny:build_flux",
))
# FLUX.1's task pipelines on the same weights (``model.pipeline_class``): the same tokens, plan, CFG
# branches and default size (they resize every input image to the call's height x width); no staged
# run (their VAE also encodes the input, inside the call).
for _task, _inputs in (("FluxImg2ImgPipeline", ("image",)), ("FluxInpaintPipeline", ("image", "mask_image"))):
    register(replace(SPECS["FluxPipeline"], class_name=_task, stages=None, published={}, tiny=None, tiny_builder=None,
                     inputs=_inputs))
register(PipelineSpec(
    "Flux2Pipeline", patch=2, transformer_class="Flux2Transformer2DModel",
    published={"black-forest-labs/FLUX.2-dev": PublishedModel(
        {"transformer": 64.4, "text_encoder": 48.0, "vae": 0.17}, heads=48, hidden=6144, layers=56, text_tokens=512)},
))
register(PipelineSpec(
    "QwenImagePipeline", patch=2, prompt_length_text=True, default_size=(1024, 1024),
    transformer_class="QwenImageTransformer2DModel",
    cfg=CFGBranches(("encoder_hidden_states", "encoder_hidden_states_mask"), "true_cfg_scale"),
    published={"Qwen/Qwen-Image": PublishedModel(
        {"transformer": 40.9, "text_encoder": 16.6, "vae": 0.25}, heads=24, hidden=3072, layers=60, text_tokens=256)},
    tiny="qwenimage", tiny_builder="lightning_diffusion.tiny:build_qwenimage",
))
register(PipelineSpec(
    "WanPipeline", patch=2, default_size=(480, 832), output="frames", frames_arg="num_frames", temporal_scale=4,
    default_frames=81, transformer_class="WanTransformer3DModel",
    cfg=CFGBranches(("encoder_hidden_states",), "guidance_scale", needs_negative_prompt=False, one_call=True,
                    transformers=("transformer", "transformer_2")),
    published={"Wan-AI/Wan2.1-T2V-14B-Diffusers": PublishedModel(
        {"transformer": 28.6, "text_encoder": 11.4, "vae": 0.51}, heads=40, hidden=5120, layers=40, text_tokens=512)},
    tiny="wan", tiny_builder="lightning_diffusion.tiny:build_wan",
))
