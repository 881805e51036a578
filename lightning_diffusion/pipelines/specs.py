"""What cannot be read from a pipeline itself: one ``PipelineSpec`` per diffusers pipeline class
that needs more than its class and configs say.

``facts.derive`` reads the geometry, output, frames and plans of any pipeline from its
class and saved configs; an entry here adds what cannot be read (how the two classifier-free-guidance
branches are fed, for CFG parallel; a staged encode / denoise / decode, for ``DeviceMapStrategy``;
the published sizes of well-known checkpoints, for ``plan`` without weights; a prompt-length text;
the input images its records carry; the tiny builder of ``tiny:NAME``) and may override a derived
fact. ``PipelineInfo.spec`` is the entry resolved against the derived facts; the tests hold every
fact an entry sets equal to the derived one where both exist.

Adding a pipeline that needs more than its class says is one ``register(PipelineSpec(...))`` call
here. Nothing here imports diffusers' model code or the tiny builders at import time: the
inspection path stays light.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import os
    from pathlib import Path

    from lightning_diffusion.core.records import CallArgs
    from lightning_diffusion.pipelines.facts import PipelineFacts


@dataclass(frozen=True)
class CFGBranches:
    """How one pipeline feeds its two classifier-free-guidance branches (see ``strategies.cfg_parallel_hooks``).

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

    def runs(self, scale: object, negative: bool) -> bool:
        """Whether the pipeline runs its second (negative) guidance pass: ``scale`` (the value of
        ``scale_arg``) above 1 and, where the pipeline needs one, a negative prompt (``negative``)."""
        return isinstance(scale, (int, float)) and scale > 1 and (negative or not self.needs_negative_prompt)


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


# What a record may set on any pipeline that takes it: its size, steps, guidance and text length.
# (``checks.record_args`` keeps those a pipeline's ``__call__`` takes: ``strength`` for image-to-image.)
RECORD_ARGS = ("height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale", "max_sequence_length",
               "strength")


@dataclass(frozen=True)
class PipelineSpec:
    """What the project knows of one diffusers pipeline class.

    ``patch``: latent pixels packed into one token along each side. ``vae_scale``: the VAE's spatial
    downsampling (pixels per token side are ``vae_scale * patch``). Both, like every fact below that
    ``facts`` reads, are set here only to override what the pipeline says (``None``: read).
    ``text_length_arg``: the call argument that fixes the text-token count
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
    ``call_batch``: the most prompts one call may take (Qwen-Image-Edit-Plus refuses two; Wan's
    image-to-video repeats one image over its batch; read as 1 where the call takes a single prompt or
    generator, ``PipelineFacts.single_items``), so longer batches are called in pieces.
    ``reference_tokens``: dotted path of a
    function ``(image_size, call_args) -> (output_tokens, reference_tokens)`` for pipelines whose
    transformer sees the input image's tokens beside the output's (context-parallel checks per record).
    ``input_if_config``: ``(input, key)``: records have ``input`` exactly when the transformer's
    config sets ``key`` (Wan 2.1's first-last-frame weights and ``last_image``).
    ``text_length_max``: the most text tokens its ``text_length_arg`` may ask for (the pipeline's own
    limit, which it checks only after loading). ``record_args``: the call arguments a prompt record
    may set (typed and bounded by ``checks.CALL_ARGS``; those its ``__call__`` lacks are dropped).
    ``tasks``: (input field, hint) for records that carry an input this pipeline does not take but
    a task pipeline on the same weights does (FLUX.1's image-to-image and inpainting).
    ``cp_mask_modes``: the context-parallel modes verified equal to one process when the
    transformer's ``_cp_plan`` splits a text attention mask with the sequence (plain Ulysses, with
    ``compat``'s per-head fix; Qwen-Image's broadcast mask also under Ulysses-anything of degree 2).
    ``cp_refused``: why context parallelism is refused although the transformer has a ``_cp_plan``
    (its sequence holds tokens the checks cannot count from the call's arguments).
    """

    class_name: str
    patch: Optional[int] = None
    vae_scale: Optional[int] = None
    text_length_arg: Optional[str] = None
    prompt_length_text: bool = False
    default_size: Optional[tuple[int, int]] = None
    output: Optional[str] = None
    frames_arg: Optional[str] = None
    temporal_scale: Optional[int] = None
    default_frames: Optional[int] = None
    transformer_class: Optional[str] = None
    cfg: Optional[CFGBranches] = None
    stages: Optional[str] = None
    published: dict[str, PublishedModel] = field(default_factory=dict)
    tiny: Optional[str] = None
    tiny_builder: Optional[str] = None
    inputs: tuple[str, ...] = ()
    call_batch: Optional[int] = None
    reference_tokens: Optional[str] = None
    input_if_config: Optional[tuple[str, str]] = None
    text_length_max: Optional[int] = None
    record_args: tuple[str, ...] = RECORD_ARGS
    cp_mask_modes: tuple[str, ...] = ("ulysses",)
    tasks: tuple[tuple[str, str], ...] = ()
    cp_refused: Optional[str] = None

    def resolved(self, facts: Optional["PipelineFacts"] = None) -> "PipelineSpec":
        """This entry with every fact it leaves unset read from the pipeline (``facts``),
        and the remaining unknowns at their neutral values (1 token a latent pixel, an 8x VAE, or the
        pipeline's own ``vae_scale_factor`` (else 1) where it has no VAE, ``images``)."""
        def pick(name: str, derived: Any, neutral: Any) -> Any:
            own = getattr(self, name)
            return own if own is not None else (derived if derived is not None else neutral)

        f = facts
        prompt_length = self.prompt_length_text or bool(f and f.prompt_length_text)
        text_arg = None if prompt_length else pick("text_length_arg", f and f.text_length_arg, None)
        mask_modes = CP_MASK_MODES.get(f.denoiser_class or "", ()) if f is not None else ()
        return replace(
            self,
            prompt_length_text=prompt_length,
            call_batch=1 if f is not None and f.single_items else self.call_batch,
            cp_mask_modes=tuple(dict.fromkeys((*self.cp_mask_modes, *mask_modes))),
            patch=pick("patch", f and f.patch, 1),
            vae_scale=pick("vae_scale", f and f.spatial,
                           (f.own_scale or 1) if f is not None and f.pixel_space else 8),
            output=pick("output", f and f.output, "images"),
            frames_arg=pick("frames_arg", f and f.frames_arg, None),
            temporal_scale=pick("temporal_scale", f and f.temporal, 1),
            default_frames=pick("default_frames", f and f.default_frames, None),
            default_size=pick("default_size", f and f.default_size, None),
            text_length_arg=text_arg,
            text_length_max=pick("text_length_max", f and f.text_length_max, None),
            record_args=(*self.record_args, f.frames_arg) if f is not None and f.frames_arg and self.frames_arg is None
            and f.frames_arg not in self.record_args else self.record_args,
        )

    @property
    def pixels_per_token(self) -> int:
        return (self.vae_scale or 8) * (self.patch or 1)

    @property
    def is_video(self) -> bool:
        return self.frames_arg is not None

    def latent_frames(self, frames: Optional[int]) -> int:
        """Frames the transformer sees for ``frames`` output frames (1 for images)."""
        if not self.is_video:
            return 1
        frames = frames or self.default_frames or 1
        return (frames - 1) // (self.temporal_scale or 1) + 1

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


def cfg_supported() -> str:
    """The pipelines CFG parallel can split, with the argument that turns their CFG on."""
    return ", ".join(f"{name} ({spec.cfg.scale_arg} > 1)" for name, spec in SPECS.items() if spec.cfg is not None)


def with_stages() -> list[str]:
    return [name for name, spec in SPECS.items() if spec.stages]


def published(hub_id: str) -> Optional[tuple[PipelineSpec, PublishedModel]]:
    for spec in SPECS.values():
        if hub_id in spec.published:
            return spec, spec.published[hub_id]
    return None


def all_published() -> list[str]:
    return [hub_id for spec in SPECS.values() for hub_id in spec.published]


# Tiny copies of pipelines that need no entry here (``tiny_zoo.py``): NAME -> builder path.
TINY_ZOO = {name: f"lightning_diffusion.pipelines.tiny_zoo:build_{name.replace('-', '_')}"
            for name in ("sdxl", "sdxl-controlnet", "sd3", "flux2", "ltx", "cogvideox", "sana", "pixart-sigma",
                         "pixart-alpha", "sd15", "sd15-img2img", "sd15-controlnet", "sd15-inpaint", "auraflow",
                         "lumina2", "chroma", "mochi", "hunyuanvideo", "cogview4", "latte", "hunyuandit")}


def _tiny_paths() -> dict[str, str]:
    return {**{spec.tiny: spec.tiny_builder for spec in SPECS.values() if spec.tiny and spec.tiny_builder},
            **TINY_ZOO}


def tiny_builders() -> dict[str, Callable[[str | os.PathLike[str]], Path]]:
    """``tiny:NAME`` -> the builder function (imported only when asked)."""
    return {name: _load(path) for name, path in _tiny_paths().items()}


def tiny_names() -> list[str]:
    return list(_tiny_paths())


def tiny_builder(name: str) -> Optional[Callable[[str | os.PathLike[str]], Path]]:
    path = _tiny_paths().get(name)
    return _load(path) if path else None


# ----------------------------------------------------------------------------- model families

# Transformers the per-image, agreed first-block cache (``first_block_cache``) is verified on.
FIRST_BLOCK_TRANSFORMERS = ("FluxTransformer2DModel", "QwenImageTransformer2DModel", "WanTransformer3DModel")
# Context-parallel modes verified equal to one process with the text mask a transformer's ``_cp_plan``
# splits, beyond plain Ulysses (``PipelineSpec.cp_mask_modes``): the mask is the transformer's input,
# so every pipeline that passes it gets them (Qwen-Image's image-to-image and inpainting too).
CP_MASK_MODES = {"QwenImageTransformer2DModel": ("ulysses", "ulysses_anything")}
# VAEs whose tiled decode ``group_work`` deals over a model-parallel group tile by tile (bit-identical
# to one device's tiled decode).
TILE_PARALLEL = ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLQwenImage")


# ----------------------------------------------------------------------------- the registry

register(PipelineSpec(
    "FluxPipeline", patch=2, text_length_arg="max_sequence_length", text_length_max=512, default_size=(1024, 1024),
    transformer_class="FluxTransformer2DModel",
    cfg=CFGBranches(("encoder_hidden_states", "pooled_projections", "txt_ids"), "true_cfg_scale"),
    stages="lightning_diffusion.pipelines.staged:FluxStages",
    published={"black-forest-labs/FLUX.1-dev": PublishedModel(
        {"transformer": 23.8, "text_encoder_2": 9.5, "text_encoder": 0.25, "vae": 0.17},
        heads=24, hidden=3072, layers=57, text_tokens=512)},
    tiny="flux", tiny_builder="lightning_diffusion.pipelines.tiny:build_flux",
    tasks=(("image", "image-to-image on FLUX.1 weights: model.pipeline_class: FluxImg2ImgPipeline"),
           ("mask_image", "inpainting on FLUX.1 weights: model.pipeline_class: FluxInpaintPipeline")),
))
# FLUX.1's task pipelines on the same weights (``model.pipeline_class``): the same tokens, plan, CFG
# branches and default size (they resize every input image to the call's height x width); no staged
# run (their VAE also encodes the input, inside the call).
for _task, _inputs in (("FluxImg2ImgPipeline", ("image",)), ("FluxInpaintPipeline", ("image", "mask_image"))):
    register(replace(SPECS["FluxPipeline"], class_name=_task, stages=None, published={}, tiny=None, tiny_builder=None,
                     inputs=_inputs))
register(replace(SPECS["FluxPipeline"], class_name="FluxFillPipeline", cfg=None, stages=None, published={},
                 inputs=("image", "mask_image"), tiny="flux-fill",
                 tiny_builder="lightning_diffusion.pipelines.tiny:build_flux_fill"))
# Kontext edits an optional reference image (its tokens join the sequence; every input of a call is
# resized to the first one's size); true CFG as FLUX.1's.
register(replace(SPECS["FluxPipeline"], class_name="FluxKontextPipeline", stages=None,
                 published={"black-forest-labs/FLUX.1-Kontext-dev": SPECS["FluxPipeline"].published[
                     "black-forest-labs/FLUX.1-dev"]},  # the same 12B architecture
                 reference_tokens="lightning_diffusion.pipelines.specs:kontext_tokens",
                 record_args=(*RECORD_ARGS, "max_area"),
                 tiny="flux-kontext", tiny_builder="lightning_diffusion.pipelines.tiny:build_flux_kontext"))


def kontext_tokens(image_size: Optional[tuple[int, int]], call_args: CallArgs) -> tuple[int, int]:
    """FluxKontextPipeline's token counts for one record (diffusers 0.42.1, ``__call__`` steps 0
    and 3): the output keeps ``height`` x ``width``'s aspect at ``max_area`` pixels; the reference
    image (``image_size`` = width, height) is resized to the closest of Kontext's preferred
    resolutions (``_auto_resize``) or kept; both are floored to multiples of 16, a token each."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    height, width = call_args.get("height") or 1024, call_args.get("width") or 1024
    area = call_args.get("max_area") or 1024 ** 2
    out_w, out_h = round((area * width / height) ** 0.5) // 16 * 16, round((area * height / width) ** 0.5) // 16 * 16
    if image_size is None:
        return out_w * out_h // 256, 0
    ref_w, ref_h = image_size[0] // 16 * 16, image_size[1] // 16 * 16  # as get_default_height_width floors them
    if call_args.get("_auto_resize", True):
        _, ref_w, ref_h = min((abs(ref_w / ref_h - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return out_w * out_h // 256, (ref_w // 16) * (ref_h // 16)


register(PipelineSpec(
    "Flux2Pipeline", patch=2, transformer_class="Flux2Transformer2DModel", text_length_max=512,
    published={"black-forest-labs/FLUX.2-dev": PublishedModel(
        {"transformer": 64.4, "text_encoder": 48.0, "vae": 0.17}, heads=48, hidden=6144, layers=56, text_tokens=512)},
))
register(PipelineSpec(
    "QwenImagePipeline", patch=2, prompt_length_text=True, default_size=(1024, 1024), text_length_max=1024,
    cp_mask_modes=("ulysses", "ulysses_anything"),
    transformer_class="QwenImageTransformer2DModel",
    cfg=CFGBranches(("encoder_hidden_states", "encoder_hidden_states_mask"), "true_cfg_scale"),
    published={"Qwen/Qwen-Image": PublishedModel(
        {"transformer": 40.9, "text_encoder": 16.6, "vae": 0.25}, heads=24, hidden=3072, layers=60, text_tokens=256)},
    tiny="qwenimage", tiny_builder="lightning_diffusion.pipelines.tiny:build_qwenimage",
))
# Qwen-Image's edit pipelines: the input image reaches the text encoder (vision tokens in the prompt,
# whose length therefore varies) and its latents join the sequence; true CFG as Qwen-Image's.
# Edit-Plus takes one prompt a call (a list of images is several references for it).
register(replace(SPECS["QwenImagePipeline"], class_name="QwenImageEditPlusPipeline", inputs=("image",),
                 published={"Qwen/Qwen-Image-Edit-2509": SPECS["QwenImagePipeline"].published["Qwen/Qwen-Image"]},
                 call_batch=1, tiny="qwenimage-edit",
                 tiny_builder="lightning_diffusion.pipelines.tiny:build_qwenimage_edit"))
register(replace(SPECS["QwenImagePipeline"], class_name="QwenImageEditPipeline", published={}, inputs=("image",),
                 tiny=None, tiny_builder=None))
register(PipelineSpec(
    "WanPipeline", patch=2, default_size=(480, 832), output="frames", frames_arg="num_frames", temporal_scale=4,
    default_frames=81, transformer_class="WanTransformer3DModel", text_length_max=512,
    record_args=(*RECORD_ARGS, "num_frames", "guidance_scale_2"),
    cfg=CFGBranches(("encoder_hidden_states",), "guidance_scale", needs_negative_prompt=False, one_call=True,
                    transformers=("transformer", "transformer_2")),
    published={"Wan-AI/Wan2.1-T2V-14B-Diffusers": PublishedModel(
        {"transformer": 28.6, "text_encoder": 11.4, "vae": 0.51}, heads=40, hidden=5120, layers=40, text_tokens=512)},
    tiny="wan", tiny_builder="lightning_diffusion.pipelines.tiny:build_wan",
))
# Wan 2.1 image-to-video: the still (and, with a first-last-frame transformer, last_image) becomes
# the video's first frame; one image a call (diffusers repeats it over the batch).
register(replace(SPECS["WanPipeline"], class_name="WanImageToVideoPipeline", published={}, inputs=("image",),
                 call_batch=1, input_if_config=("last_image", "pos_embed_seq_len"),
                 tiny="wan-i2v", tiny_builder="lightning_diffusion.pipelines.tiny:build_wan_i2v"))

# Transformers with a ``_cp_plan`` whose sequence the call's arguments do not give: Helios attends to
# the history latents of the chunks it made before (their count grows chunk by chunk); ChronoEdit
# makes 5 frames whatever num_frames says unless enable_temporal_reasoning is set, and then its
# temporal-reasoning frames. The image-token check would count the wrong sequence.
register(PipelineSpec("HeliosPipeline", cp_refused="its transformer attends to the history tokens of the chunks "
                      "it made before, which the token checks cannot count"))
register(PipelineSpec("ChronoEditPipeline", cp_refused="its frame count is not num_frames (5 frames, or its "
                      "temporal-reasoning frames), so the token checks cannot count its sequence"))
