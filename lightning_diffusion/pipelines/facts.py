"""What a diffusers pipeline is, read from its class and its saved configs (no weight is read).

Any pipeline a user brings is described here the way diffusers' own ``from_pretrained`` reads
``model_index.json``: the output attribute from the class its ``__call__`` returns, a video's frame
argument from ``__call__``'s signature, the VAE's spatial and temporal compression from the VAE
class built on the meta device from its config, the transformer's token packing from its config,
the text-length argument and the limit the pipeline itself checks, and which components have a
diffusers ``_cp_plan`` / ``_tp_plan``. ``specs.py`` keeps only what cannot be read this way and may
override a derived fact (``PipelineSpec.resolved``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

# Output attributes the writer can encode: still images, or videos of frames.
OUTPUT_ATTRIBUTES = ("images", "frames", "image")
FRAMES_ARG = "num_frames"
TEXT_LENGTH_ARG = "max_sequence_length"
# Arguments of a denoiser's ``forward`` that carry the text's attention mask (padding of the prompt).
TEXT_MASK_ARGS = ("encoder_attention_mask", "encoder_hidden_states_mask")
# The denoiser components a pipeline calls in its loop, in the order they are looked for.
DENOISERS = ("transformer", "transformer_2", "unet", "prior", "decoder")
# The components that decode latents to pictures, in the order they are looked for (Kandinsky's ``movq``).
VAES = ("vae", "movq")
# Other components that decode latents (aMUSEd's and LDM's ``vqvae``, Würstchen's ``vqgan``).
OTHER_DECODERS = ("vqvae", "vqgan")


@dataclass(frozen=True)
class PipelineFacts:
    """Facts of one pipeline class read from the class and its configs (``derive``).

    ``output``: the attribute of the call's output that holds the pictures (``images``, ``frames``),
    or ``None`` with ``why_not`` when it makes something else (audio, embeddings). ``frames_arg`` and
    ``default_frames``: a video pipeline's frame-count argument and its default. ``spatial`` /
    ``temporal``: the VAE's compression (pixels per latent pixel, frames per latent frame).
    ``patch`` / ``patch_t``: latent pixels (frames) packed into one token. ``text_length_arg``:
    the call argument that pads the text to a fixed token count; ``text_length_max``: the most it
    may ask for, as the pipeline checks it. ``default_size``: (height, width) when the call gives
    none, where the class or a config says. ``cp_plan`` / ``tp_plan``: components with a diffusers
    context-/tensor-parallel plan. ``text_masks``: per denoiser, the text-mask arguments its
    ``forward`` takes; ``cp_splits``: per component with a ``_cp_plan``, the ``forward`` inputs it
    splits over the context-parallel ranks (the text too when ``encoder_hidden_states`` is one).
    ``max_side``: the most pixels per side its denoiser's position table reaches, where it has one
    (SD3's ``pos_embed_max_size``). ``unsplit_controls``: ControlNet components without a
    ``_cp_plan``: the loop runs them on the whole latent sequence and adds their residuals to the
    denoiser's blocks, which context parallelism splits (so it cannot run them).
    ``prompt_length_text``: its text encoding pads each batch to its longest prompt
    (``padding=True``), not to a fixed length. ``denoiser_class``: the class name of its denoiser.
    ``needed_inputs``: input pictures (``image``, ``mask_image``, ``control_image``, ``video``) whose
    argument defaults to None but which its call and ``check_inputs`` use without ever testing for
    None (LTX image-to-video's ``image``): every record must carry them. ``rounds_to``: the multiple
    the call itself rounds height and width up to, where it calls a size helper that does
    (Kandinsky's ``downscale_height_and_width(height, width, 8)``: 64, not its VAE's 8).
    ``single_items``: the call arguments that take one item, not a list (``prompt`` where the call
    refuses a list, as Wan VACE's; ``generator`` where its annotation admits no list, as aMUSEd's,
    whose scheduler reads ``generator.device``): such a pipeline is called one record at a time.
    ``unsplit_per_token``: (component, argument, mask) for each argument its ``__call__`` passes a
    component with a ``_cp_plan`` that holds a value per latent token (computed from a latent mask,
    as LTX image-to-video's timestep from its conditioning mask) and that the plan does not split:
    each rank would get the whole sequence's values beside its shard of the tokens.
    ``tiled_only``: the VAE's class name where its decode raises unless tiling is on (Allegro's
    ``AutoencoderKLAllegro``: "Decoding without tiling has not been implemented yet").
    ``pixel_space``: it has no VAE (no ``vae``, ``movq``, ``vqvae`` or ``vqgan``): its denoiser makes
    the pixels. ``checked_multiple``: the multiple its ``check_inputs`` holds height and width to
    (``height % (self.vae_scale_factor * self.transformer.config.patch_size) != 0``), where every
    name in it can be read from the class and the configs; ``own_scale``: the ``vae_scale_factor``
    its class states without a VAE (PRX's pixel pipeline: 1)."""

    @property
    def text_split(self) -> bool:
        """Context parallelism splits the text tokens, so their count must divide the degree."""
        return any("encoder_hidden_states" in inputs for inputs in self.cp_splits.values())

    def split_masks(self) -> dict[str, tuple[str, ...]]:
        """Per denoiser, the text masks its ``_cp_plan`` splits with the sequence."""
        found = {name: tuple(a for a in self.text_masks.get(name, ()) if a in inputs)
                 for name, inputs in self.cp_splits.items()}
        return {name: masks for name, masks in found.items() if masks}

    class_name: str
    output: Optional[str] = None
    frames_arg: Optional[str] = None
    default_frames: Optional[int] = None
    spatial: Optional[int] = None
    temporal: int = 1
    patch: Optional[int] = None
    patch_t: int = 1
    text_length_arg: Optional[str] = None
    text_length_max: Optional[int] = None
    default_size: Optional[tuple[int, int]] = None
    cp_plan: tuple[str, ...] = ()
    tp_plan: tuple[str, ...] = ()
    text_masks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cp_splits: dict[str, tuple[str, ...]] = field(default_factory=dict)
    max_side: Optional[int] = None
    unsplit_controls: tuple[str, ...] = ()
    why_not: Optional[str] = None
    prompt_length_text: bool = False
    denoiser_class: Optional[str] = None
    single_items: tuple[str, ...] = ()
    rounds_to: Optional[int] = None
    needed_inputs: tuple[str, ...] = ()
    unsplit_per_token: tuple[tuple[str, str, str], ...] = ()
    tiled_only: Optional[str] = None
    pixel_space: bool = False
    checked_multiple: Optional[int] = None
    own_scale: Optional[int] = None

    @property
    def size_multiple(self) -> Optional[int]:
        """Height and width must be multiples of this: VAE compression times token packing."""
        return self.spatial * (self.patch or 1) if self.spatial else None


def output_attribute(pipeline_class: type) -> tuple[Optional[str], Optional[str]]:
    """(attribute, None), or (None, why) for a pipeline whose output holds no pictures: read from the
    dataclass its ``__call__`` returns (``return FluxPipelineOutput(images=...)``)."""
    try:
        source = inspect.getsource(pipeline_class.__call__)
    except (OSError, TypeError):
        return None, "its __call__ has no readable source"
    names, fields = _output_fields(pipeline_class, source)
    if not names:
        return None, "its __call__ returns no diffusers output class (a combined pipeline calls others)"
    found = next((name for name in OUTPUT_ATTRIBUTES if name in fields), None)
    if found is None:
        held = ", ".join(fields) or "nothing known"
        return None, f"its output ({', '.join(names)}) holds {held}, not images or frames"
    return found, None


def no_pictures(pipeline_class: type) -> Optional[str]:
    """Why ``pipeline_class`` makes no pictures, where its ``__call__`` returns output classes whose
    fields are known and none holds pictures (a prior's embeddings, audio); None otherwise (a
    combined pipeline, which returns what the pipelines it calls return, is not judged here)."""
    try:
        names, fields = _output_fields(pipeline_class, inspect.getsource(pipeline_class.__call__))
    except (OSError, TypeError):
        return None
    if not fields or any(name in fields for name in OUTPUT_ATTRIBUTES):
        return None
    return f"its output ({', '.join(names)}) holds {', '.join(fields)}, not images or frames"


def _output_fields(pipeline_class: type, source: str) -> tuple[list[str], list[str]]:
    """The output classes ``__call__``'s source returns, and their dataclass fields."""
    names = sorted(set(re.findall(r"return\s+(\w+Output)\(", source)))
    module = sys.modules.get(pipeline_class.__call__.__module__)
    fields: list[str] = []
    for name in names:
        output_class = getattr(module, name, None)
        if dataclasses.is_dataclass(output_class):
            fields += [f.name for f in dataclasses.fields(output_class)]
    return names, fields


def _meta_model(cls: Any, config: dict[str, Any]) -> Any:
    """The model a config describes, built on the meta device (no memory, no weight), or None."""
    import torch

    quiet = logging.getLogger("diffusers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.device("meta"):
            return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    except Exception:  # a config this class cannot build: the facts are then read from the config alone
        return None
    finally:
        quiet.setLevel(level)


def vae_compression(cls: Optional[type], config: dict[str, Any]) -> tuple[Optional[int], int]:
    """(spatial, temporal) compression of a VAE: the config's own factors where it states them, else
    the attributes the VAE class computes in ``__init__`` (``spatial_compression_ratio``,
    ``temporal_compression_ratio``: LTX's from its patch and scaling blocks, ``AutoencoderDC``'s from
    its encoder blocks, Mochi's from its expansions), read from the class built on the meta device,
    else its down blocks."""
    spatial = config.get("scale_factor_spatial") or config.get("spatial_compression_ratio")
    temporal = config.get("scale_factor_temporal") or config.get("temporal_compression_ratio")
    # Whether the class's ``__init__`` (unwrapped from diffusers' ``register_to_config``) sets the ratio.
    init = vars(cls).get("__init__") if cls is not None else None
    code = getattr(inspect.unwrap(init), "__code__", None) if callable(init) else None
    computes = code is not None and "spatial_compression_ratio" in code.co_names
    if (spatial is None or temporal is None) and computes:
        model = _meta_model(cls, config)
        spatial = spatial or getattr(model, "spatial_compression_ratio", None)
        temporal = temporal or getattr(model, "temporal_compression_ratio", None)
    if "temperal_downsample" in config:  # Wan-family VAEs
        spatial = spatial or 2 ** len(config["temperal_downsample"])
        temporal = temporal or 2 ** sum(bool(t) for t in config["temperal_downsample"])
    if spatial is None and isinstance(config.get("block_out_channels"), list):
        spatial = 2 ** (len(config["block_out_channels"]) - 1)
    return (int(spatial) if isinstance(spatial, (int, float)) else None,
            int(temporal) if isinstance(temporal, (int, float)) else 1)


def latent_channels(config: dict[str, Any]) -> Optional[int]:
    for key in ("latent_channels", "z_dim", "out_channels_latent"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def token_patch(denoiser: dict[str, Any], latent: Optional[int]) -> tuple[int, int]:
    """(spatial, temporal) latent pixels per token of a denoiser config. A patch embedding declares
    its ``patch_size`` (2, or (t, h, w)); a transformer that takes pre-packed latents through a linear
    layer (FLUX.1, Chroma, FLUX.2) declares 1 and takes ``p x p x latent channels`` inputs instead."""
    size, size_t = denoiser.get("patch_size"), denoiser.get("patch_size_t")
    if isinstance(size, (list, tuple)):
        size_t, size = (size[0], size[-1]) if len(size) == 3 else (size_t, size[-1])
    spatial = size if isinstance(size, int) and size > 0 else 1
    temporal = size_t if isinstance(size_t, int) and size_t > 0 else 1
    if spatial == 1 and latent:
        packed = denoiser.get("out_channels") or denoiser.get("in_channels")
        if isinstance(packed, int) and packed % latent == 0:
            root = math.isqrt(packed // latent)
            if root > 1 and root * root == packed // latent:
                spatial = root
    return spatial, temporal


def text_length_limit(pipeline_class: type) -> Optional[int]:
    """The most text tokens the pipeline's own ``check_inputs`` allows for ``max_sequence_length``
    (``if max_sequence_length > 512: raise``), which it checks only after its weights load."""
    check = getattr(pipeline_class, "check_inputs", None)
    try:
        source = inspect.getsource(check) if check is not None else ""
    except (OSError, TypeError):
        return None
    found = re.findall(rf"{TEXT_LENGTH_ARG}\s*>\s*(\d+)", source)
    return int(found[0]) if len(set(found)) == 1 else None


def plan_inputs(plan: dict[str, Any]) -> tuple[str, ...]:
    """The named ``forward`` inputs a diffusers ``_cp_plan`` splits (its dict entries' keys)."""
    names: list[str] = []
    for entry in plan.values():
        if isinstance(entry, dict):
            names += [key for key in entry if isinstance(key, str)]
    return tuple(dict.fromkeys(names))


def models_with_plan(attribute: str) -> list[str]:
    """The diffusers model classes whose ``attribute`` (``_cp_plan``, ``_tp_plan``) is set."""
    import diffusers
    from diffusers import ModelMixin

    found = []
    for name in dir(diffusers):
        try:
            cls = getattr(diffusers, name)
        except Exception:  # an optional backend that cannot import here
            continue
        if isinstance(cls, type) and issubclass(cls, ModelMixin) and getattr(cls, attribute, None):
            found.append(name)
    return sorted(found)


def _call_default(parameters: Mapping[str, inspect.Parameter], name: str) -> Any:
    parameter = parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _component_class(model_index: dict[str, Any], name: str) -> Optional[type]:
    import importlib

    entry = model_index.get(name)
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] and entry[1]):
        return None
    try:
        found = getattr(importlib.import_module(entry[0]), entry[1], None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def denoiser_facts(class_name: str, transformer_class: Optional[str]) -> PipelineFacts:
    """The plans and split text masks of a pipeline known only by its denoiser's diffusers class
    name (``plan`` on a published model without its configs)."""
    import diffusers

    cls: Any = getattr(diffusers, transformer_class, None) if transformer_class else None
    if not isinstance(cls, type) or not hasattr(cls, "forward"):
        return PipelineFacts(class_name)
    cp = getattr(cls, "_cp_plan", None)
    forward = inspect.signature(cls.forward).parameters
    pipeline: Any = getattr(diffusers, class_name, None)
    readable = isinstance(pipeline, type) and hasattr(pipeline, "__call__")
    per_token = per_token_arguments(pipeline, "transformer") if readable and cp else {}
    return PipelineFacts(
        class_name, cp_plan=("transformer",) if cp else (),
        tp_plan=("transformer",) if getattr(cls, "_tp_plan", None) else (),
        text_masks={"transformer": tuple(a for a in TEXT_MASK_ARGS if a in forward)},
        cp_splits={"transformer": plan_inputs(cp)} if cp else {},
        prompt_length_text=readable and pads_to_prompt_length(pipeline),
        denoiser_class=transformer_class,
        unsplit_per_token=tuple(("transformer", arg, mask) for arg, mask in per_token.items()
                                if arg not in plan_inputs(cp or {})),
    )


# Input pictures a record may carry, whose absence a call may not cope with.
_INPUT_PICTURES = ("image", "mask_image", "control_image", "video")


def untested_inputs(pipeline_class: type) -> tuple[str, ...]:
    """The input pictures whose ``__call__`` argument defaults to None and that neither ``__call__``
    nor ``check_inputs`` ever compares with None or tests for truth (``if image is not None``,
    ``image or ...``): the call would fail on a missing one after the weights load."""
    parameters = inspect.signature(pipeline_class.__call__).parameters
    try:
        source = "\n".join(inspect.getsource(method) for method in (pipeline_class.__call__,
                                                                  getattr(pipeline_class, "check_inputs", None))
                          if method is not None)
    except (OSError, TypeError):
        return ()
    needed = []
    for name in _INPUT_PICTURES:
        parameter = parameters.get(name)
        if parameter is None or parameter.default is not None:
            continue
        tested = rf"\b{name}\s+is\s+(not\s+)?None|\bif\s+(not\s+)?{name}\b|\b{name}\s+or\b|\b{name}\s*[!=]=\s*None"
        if not re.search(tested, source):
            needed.append(name)
    return tuple(needed)


def size_rounding(pipeline_class: type) -> Optional[int]:
    """The multiple a pipeline's ``__call__`` rounds ``height`` and ``width`` up to through a helper
    of its module (``downscale_height_and_width(height, width, 8)`` divides by ``scale_factor**2``
    and rounds up: multiples of 64), or None where its call uses no such helper."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(pipeline_class.__call__)))
    except (OSError, TypeError, SyntaxError):
        return None
    module = inspect.getmodule(pipeline_class.__call__)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "height"):
            continue
        helper = getattr(module, node.func.id, None)
        if not inspect.isfunction(helper):
            continue
        try:
            source = inspect.getsource(helper)
        except (OSError, TypeError):
            continue
        squared = re.search(r"//\s*(\w+)\s*\*\*\s*2", source)
        if not squared:
            continue
        parameters = list(inspect.signature(helper).parameters.values())
        names = [p.name for p in parameters]
        if squared[1] not in names:
            continue
        position = names.index(squared[1])
        given = node.args[position] if position < len(node.args) else None
        value = given.value if isinstance(given, ast.Constant) else parameters[position].default
        if isinstance(value, int) and not isinstance(value, bool):
            return value * value
    return None


def single_items(pipeline_class: type) -> tuple[str, ...]:
    """``prompt`` and ``generator`` where the call takes one, not a list: a prompt whose annotation
    admits no list or that ``__call__`` refuses unless it is a string (``if ... not isinstance(prompt,
    str): raise``), a generator whose annotation admits no list."""
    parameters = inspect.signature(pipeline_class.__call__).parameters
    try:
        source = inspect.getsource(pipeline_class.__call__)
    except (OSError, TypeError):
        source = ""
    found = []
    for name in ("prompt", "generator"):
        parameter = parameters.get(name)
        if parameter is None:
            continue
        annotation = str(parameter.annotation)
        listed = parameter.annotation is inspect.Parameter.empty or re.search(r"(?i)list|sequence", annotation)
        refused = re.search(rf"not isinstance\({name}, str\)\s*:\s*raise", source)
        if not listed or refused:
            found.append(name)
    return tuple(found)


def pads_to_prompt_length(pipeline_class: type) -> bool:
    """Whether the pipeline's text encoding pads a batch to its longest prompt: its prompt methods
    (``encode_prompt``, ``_get_*_prompt_embeds``) tokenize with ``padding=True`` and never to a fixed
    ``max_length`` (Qwen-Image's family), so the text token count is each batch's own."""
    sources = []
    for name in dir(pipeline_class):
        method = getattr(pipeline_class, name, None)
        if "prompt" in name and callable(method):
            try:
                sources.append(inspect.getsource(method))
            except (OSError, TypeError):
                continue
    text = "\n".join(sources)
    return bool(re.search(r"padding\s*=\s*True", text)) and not re.search(r"padding\s*=\s*[\"']max_length", text)


# Attributes read for a tensor's layout, not its values (a batch size taken from the latents).
_LAYOUT = ("shape", "dtype", "device", "ndim")
# Masks over the text, not over the latent tokens.
_TEXT_MASK_WORDS = ("attention", "attn", "prompt", "text", "txt", "padding")


def _names(node: Any) -> set[str]:
    """The variable names an expression reads, leaving out ``self`` and those read only for their
    layout (``latents.shape[0]``, ``latents.dtype``)."""
    import ast

    if isinstance(node, ast.Attribute) and node.attr in _LAYOUT:
        return set()
    if isinstance(node, ast.Name):
        return {node.id} - {"self"}
    return set().union(*(_names(child) for child in ast.iter_child_nodes(node))) if node is not None else set()


def per_token_arguments(pipeline_class: type, component: str) -> dict[str, str]:
    """The keyword arguments that ``__call__``'s denoising loop passes ``self.<component>(...)`` and
    computes in the loop, directly or through other variables of the loop, from a latent mask (a
    variable named ``*mask*`` that is not a text or padding mask): argument -> that mask. LTX
    image-to-video's ``timestep * (1 - conditioning_mask)`` is one (a timestep per token); Wan 2.2's
    ``mask * t`` another. Read from the source; none when unreadable."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(pipeline_class.__call__)))
    except (OSError, TypeError, SyntaxError):
        return {}

    def calls(node: Any) -> list[Any]:
        return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == component and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]

    found: dict[str, str] = {}
    for loop in [n for n in ast.walk(tree) if isinstance(n, ast.For) and calls(n)]:
        reads: dict[str, set[str]] = {}
        for node in ast.walk(loop):
            targets: list[Any] = []
            value: Any = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets, value = [node.target], node.value
            for target in targets:
                for name in _names(target) if not isinstance(target, ast.Attribute) else ():
                    reads.setdefault(name, set()).update(_names(value))
        for call in calls(loop):
            for keyword in call.keywords:
                seen: set[str] = set()
                todo = list(_names(keyword.value))
                while todo:
                    name = todo.pop()
                    if name not in seen:
                        seen.add(name)
                        todo += reads.get(name, ())
                masks = sorted(n for n in seen if "mask" in n and not any(w in n for w in _TEXT_MASK_WORDS))
                if keyword.arg and masks:
                    found.setdefault(keyword.arg, masks[0])
    return found


def derive(pipeline_class: type, model_index: dict[str, Any], configs: dict[str, dict[str, Any]]) -> PipelineFacts:
    """Every fact of ``PipelineFacts`` that the class and its configs say."""
    from diffusers import ModelMixin

    parameters = inspect.signature(pipeline_class.__call__).parameters
    output, why_not = output_attribute(pipeline_class)
    frames_arg = FRAMES_ARG if FRAMES_ARG in parameters and output == "frames" else None
    vae = next((name for name in VAES if name in configs), "vae")
    vae_config = configs.get(vae, {})
    vae_class = _component_class(model_index, vae)
    spatial, temporal = vae_compression(vae_class, vae_config) if vae_config else (None, 1)
    init = inspect.signature(vars(pipeline_class).get("__init__") or pipeline_class).parameters
    denoiser = next((name for name in DENOISERS if name in configs), None)
    patch, patch_t = token_patch(configs[denoiser], latent_channels(vae_config)) if denoiser else (None, 1)
    height, width = _call_default(parameters, "height"), _call_default(parameters, "width")
    default_size: Optional[tuple[int, int]] = None
    if isinstance(height, int) and isinstance(width, int):
        default_size = (height, width)
    elif denoiser and spatial and isinstance(configs[denoiser].get("sample_size"), int):
        side = configs[denoiser]["sample_size"] * spatial  # SDXL's, SD3's and PixArt's default_sample_size
        default_size = (side, side)
    elif denoiser and spatial and isinstance(configs[denoiser].get("sample_height"), int):  # CogVideoX
        config = configs[denoiser]
        width = config.get("sample_width", config["sample_height"])
        default_size = (config["sample_height"] * spatial, width * spatial)
    plans: dict[str, list[str]] = {"_cp_plan": [], "_tp_plan": []}
    masks: dict[str, tuple[str, ...]] = {}
    splits: dict[str, tuple[str, ...]] = {}
    controls: list[str] = []
    per_token: list[tuple[str, str, str]] = []
    for name in model_index:
        cls = None if name.startswith("_") else _component_class(model_index, name)
        if not (cls is not None and issubclass(cls, ModelMixin)):
            continue
        for attribute, found in plans.items():
            if getattr(cls, attribute, None) is not None:
                found.append(name)
        if getattr(cls, "_cp_plan", None):
            splits[name] = plan_inputs(cls._cp_plan)
            per_token += [(name, arg, mask) for arg, mask in per_token_arguments(pipeline_class, name).items()
                          if arg not in splits[name]]
        elif "ControlNet" in cls.__name__:
            controls.append(name)
        if name in DENOISERS:
            forward = inspect.signature(cls.forward).parameters
            taken = tuple(arg for arg in TEXT_MASK_ARGS if arg in forward)
            if taken:
                masks[name] = taken
    frames = _call_default(parameters, FRAMES_ARG) if frames_arg else None
    positions = configs[denoiser].get("pos_embed_max_size") if denoiser else None
    max_side = positions * (patch or 1) * spatial if isinstance(positions, int) and spatial else None
    return PipelineFacts(
        class_name=pipeline_class.__name__,
        output=output,
        frames_arg=frames_arg,
        default_frames=frames if isinstance(frames, int) else None,
        spatial=spatial,
        temporal=temporal if frames_arg else 1,
        patch=patch,
        patch_t=patch_t,
        text_length_arg=TEXT_LENGTH_ARG if TEXT_LENGTH_ARG in parameters else None,
        text_length_max=text_length_limit(pipeline_class) if TEXT_LENGTH_ARG in parameters else None,
        default_size=default_size,
        cp_plan=tuple(plans["_cp_plan"]),
        tp_plan=tuple(plans["_tp_plan"]),
        text_masks=masks,
        cp_splits=splits,
        max_side=max_side,
        unsplit_controls=tuple(controls),
        why_not=why_not,
        prompt_length_text=pads_to_prompt_length(pipeline_class),
        single_items=single_items(pipeline_class),
        rounds_to=size_rounding(pipeline_class),
        needed_inputs=untested_inputs(pipeline_class),
        denoiser_class=_class_name(model_index.get(next((n for n in DENOISERS if n in model_index), ""))),
        unsplit_per_token=tuple(per_token),
        tiled_only=vae_class.__name__ if vae_class is not None and decodes_only_by_tiles(vae_class) else None,
        pixel_space=not any(name in model_index or name in init for name in (*VAES, *OTHER_DECODERS)),
        checked_multiple=checked_multiple(pipeline_class, configs),
        own_scale=own_scale(pipeline_class),
    )


def _class_name(entry: Any) -> Optional[str]:
    return entry[1] if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str) else None


def _function(method: Any) -> Any:
    """The ``def`` node of ``method``'s source, or None where it has none readable."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError, SyntaxError):
        return None
    return next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)


def decodes_only_by_tiles(vae_class: type) -> bool:
    """Whether the VAE's ``_decode`` returns its tiled decode under ``if self.use_tiling`` and
    otherwise raises, at the top of its body (``AutoencoderKLAllegro``), read from its source."""
    import ast

    found = _function(getattr(vae_class, "_decode", None)) if hasattr(vae_class, "_decode") else None
    if found is None:
        return False

    def tiling(test: Any) -> bool:
        return "use_tiling" in ast.unparse(test)

    tiled = any(isinstance(s, ast.If) and tiling(s.test) and not isinstance(s.test, ast.UnaryOp)
                and any(isinstance(b, ast.Return) for b in s.body) for s in found.body)
    raises = any(isinstance(s, ast.Raise) for s in found.body)
    refused = any(isinstance(s, ast.If) and isinstance(s.test, ast.UnaryOp) and tiling(s.test)
                  and any(isinstance(b, ast.Raise) for b in s.body) for s in found.body)
    return (tiled and raises) or refused


def own_scale(pipeline_class: type) -> Optional[int]:
    """The ``vae_scale_factor`` a pipeline class states without a VAE: a class attribute, or a
    property whose body returns a constant (PRX's pixel pipeline: ``return 1``)."""
    import ast

    value = inspect.getattr_static(pipeline_class, "vae_scale_factor", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, property):
        return None
    found = _function(value.fget)
    returns = [n for n in ast.walk(found) if isinstance(n, ast.Return)] if found is not None else []
    if len(returns) == 1 and isinstance(returns[0].value, ast.Constant) and type(returns[0].value.value) is int:
        return returns[0].value.value
    return None


def checked_multiple(pipeline_class: type, configs: dict[str, dict[str, Any]]) -> Optional[int]:
    """The multiple ``check_inputs`` holds height to (``if height % X != 0 ... raise``), where ``X``
    reads only constants, names assigned before it in ``check_inputs``, the class's own
    ``vae_scale_factor`` (``own_scale``) and components' configs (``self.transformer.config.patch_size``);
    None where any part of it cannot be read (a VAE's factor set in ``__init__`` from the loaded VAE)."""
    import ast

    found = _function(getattr(pipeline_class, "check_inputs", None)) if hasattr(pipeline_class, "check_inputs") \
        else None
    if found is None:
        return None
    assigned: dict[str, Any] = {}

    def value(node: Any) -> Optional[int]:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in assigned:
            return value(assigned[node.id])
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add, ast.Pow, ast.FloorDiv)):
            left, right = value(node.left), value(node.right)
            if left is None or right is None:
                return None
            return {ast.Mult: left * right, ast.Add: left + right, ast.Pow: left ** right,
                    ast.FloorDiv: left // right if right else 0}[type(node.op)]
        text = ast.unparse(node)
        if text == "self.vae_scale_factor":
            return own_scale(pipeline_class)
        parts = text.split(".")
        if len(parts) == 4 and parts[0] == "self" and parts[2] == "config":
            read = configs.get(parts[1], {}).get(parts[3])
            return read if type(read) is int else None
        return None

    for node in ast.walk(found):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned.setdefault(node.targets[0].id, node.value)
    multiples: set[Optional[int]] = set()
    for node in ast.walk(found):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Mod)
                and isinstance(node.left.left, ast.Name) and node.left.left.id == "height"):
            multiples.add(value(node.left.right))
    multiple = multiples.pop() if len(multiples) == 1 else None
    return multiple if multiple is not None and multiple > 0 else None
