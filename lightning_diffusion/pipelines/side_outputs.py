"""The tensors that made each image, captured during the pipeline's own call (``writer.save_latents``,
``writer.save_text_embeddings``): the latents its VAE decoded and the prompt embeddings its denoiser saw.

Captured where they are used, not recomputed and not asked of the pipeline another way: the latents
are the argument of the VAE's ``decode`` (after the pipeline's own unpacking and unscaling, so they
are what any pipeline decodes, packed or not), and the embeddings are the ``encoder_hidden_states``
(and ``pooled_projections``, where the denoiser takes them) of the denoiser's first call. Asking the
pipeline for ``output_type="latent"`` would skip the decode, and the images with it; the step-end
callback gives the scheduler's latents before the pipeline-specific unpacking and scaling. The VAE's
``decode`` is a method, not ``forward``, so no module hook reaches it: it is wrapped on the instance
for the length of one call, outermost (a group's split decoding, installed once at setup, is
inside it and still sees the whole batch). The denoiser's arguments are read by a forward pre-hook
(called before diffusers' own hooks split the inputs over a context-parallel group).

Each image's tensors go out as safetensors bytes (any dtype, bfloat16 included, with the shapes, the
dtype and the VAE's scaling in its header; ``safetensors.torch.load`` reads them), the same bytes in
every layout and every run.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_diffusion.core.records import SideOutput
from lightning_diffusion.pipelines.facts import DENOISERS, VAES
from lightning_diffusion.pipelines.model_folder import PipelineInfo

LATENTS = "latents"
TEXT_EMBEDDINGS = "text_embeddings"
# The denoiser arguments that carry the prompt, as the safetensors file names them.
TEXT_ARGUMENTS = {"encoder_hidden_states": "prompt_embeds", "pooled_projections": "pooled_prompt_embeds"}
# What a VAE's config says of the scale of its latents, and the names they are recorded under (those present).
SCALING_KEYS = {"scaling_factor": "vae_scaling_factor", "shift_factor": "vae_shift_factor",
                "latents_mean": "vae_latents_mean", "latents_std": "vae_latents_std"}
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def side_output_problems(info: PipelineInfo, latents: bool, text_embeddings: bool) -> list[str]:
    """Why ``info``'s pipeline cannot give the side outputs asked for, read from its classes (no weight)."""
    problems = []
    if latents:
        vae = next((name for name in VAES if name in info.model_index), None)
        vae_class = info.component_class(vae) if vae is not None else None
        if vae_class is None or not callable(getattr(vae_class, "decode", None)):
            problems.append(f"writer.save_latents: {info.class_name} has no VAE component ({', '.join(VAES)}) with a "
                            "decode method, so there are no decoded latents to save; set writer.save_latents: false.")
    if text_embeddings:
        name = next((name for name in DENOISERS if name in info.model_index), None)
        denoiser: Any = info.component_class(name) if name is not None else None
        accepts = set(inspect.signature(denoiser.forward).parameters) if denoiser is not None else set()
        if "encoder_hidden_states" not in accepts:
            what = denoiser.__name__ if denoiser is not None else "no denoiser component"
            problems.append(f"writer.save_text_embeddings: {info.class_name}'s denoiser ({what}) takes no "
                            "encoder_hidden_states, so there are no prompt embeddings to save; set "
                            "writer.save_text_embeddings: false.")
    return problems


@dataclass
class Captured:
    """What one pipeline call gave: the VAE's inputs and the denoiser's first text arguments."""

    decoded: list[torch.Tensor] = field(default_factory=list)
    text: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class SideCapture:
    """Which side outputs a run saves; ``during`` captures them over one pipeline call."""

    latents: bool = False
    text_embeddings: bool = False

    def __bool__(self) -> bool:
        return self.latents or self.text_embeddings

    @contextmanager
    def during(self, pipeline: Any) -> Iterator[Captured]:
        captured = Captured()
        undo = []
        vae = next((getattr(pipeline, name) for name in VAES if getattr(pipeline, name, None) is not None), None)
        if self.latents and vae is not None:
            inner = vae.__dict__.get("decode")  # an instance's own wrapper (group_work), else the class's

            def decode(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                captured.decoded.append(z.detach())
                return (inner or type(vae).decode.__get__(vae))(z, *args, **kwargs)

            vae.decode = decode
            undo.append(lambda: setattr(vae, "decode", inner) if inner is not None else vars(vae).pop("decode"))
        denoiser = next((getattr(pipeline, name) for name in DENOISERS
                         if isinstance(getattr(pipeline, name, None), torch.nn.Module)), None)
        if self.text_embeddings and denoiser is not None:
            def first_call(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
                if not captured.text:
                    captured.text.update({name: kwargs[arg].detach() for arg, name in TEXT_ARGUMENTS.items()
                                          if isinstance(kwargs.get(arg), torch.Tensor)})

            undo.append(denoiser.register_forward_pre_hook(first_call, with_kwargs=True).remove)
        try:
            yield captured
        finally:
            for step in reversed(undo):
                step()

    def per_image(self, captured: Captured, pipeline: Any, batch: int, count: int) -> list[dict[str, SideOutput]]:
        """The first ``count`` images' side outputs of a call of ``batch`` images (the padding after
        them). A denoiser called on the negative and positive prompts at once (diffusers'
        ``cat([negative, positive])``) saw twice the rows: the positive half is the image's."""
        sides: list[dict[str, SideOutput]] = [{} for _ in range(count)]
        if self.latents:
            if not captured.decoded:
                raise RuntimeError("writer.save_latents: the pipeline's call did not decode through its VAE")
            latents = torch.cat(captured.decoded) if len(captured.decoded) > 1 else captured.decoded[0]
            vae = next(getattr(pipeline, name) for name in VAES if getattr(pipeline, name, None) is not None)
            scaling = {name: vae.config[key] for key, name in SCALING_KEYS.items() if vae.config.get(key) is not None}
            for n in range(count):
                sides[n][LATENTS] = _side({"latents": latents[n]}, scaling)
        if self.text_embeddings:
            if not captured.text:
                raise RuntimeError("writer.save_text_embeddings: the pipeline's call did not reach its denoiser "
                                   "with encoder_hidden_states")
            rows = {name: tensor[batch:] if tensor.shape[0] == 2 * batch else tensor
                    for name, tensor in captured.text.items()}
            for n in range(count):
                sides[n][TEXT_EMBEDDINGS] = _side({name: tensor[n] for name, tensor in rows.items()}, {})
        return sides


def _side(tensors: dict[str, torch.Tensor], about: dict[str, Any]) -> SideOutput:
    """One image's tensors as safetensors bytes (``about`` in its header) and what its manifest line says."""
    own = {name: tensor.to("cpu").contiguous() for name, tensor in tensors.items()}
    described = {name: {"shape": list(t.shape), "dtype": _DTYPES[t.dtype]} for name, t in own.items()}
    return {"data": safetensors_bytes(own, {key: json.dumps(value) for key, value in about.items()}),
            "about": {"tensors": described, **about}}


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """``tensors`` in the safetensors format (a little-endian u64 header length, a JSON header of each
    tensor's dtype, shape and byte range, then the bytes), with its keys sorted: the same tensors
    always give the same bytes, so a shard of the same samples is the same file
    (``safetensors.torch.save`` orders its header differently from call to call)."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name]
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)
