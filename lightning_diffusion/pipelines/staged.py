"""Staged pipeline calls: encode, denoise and decode as three stages, each with only its models
resident on the device, as the diffusers guide does for pipelines too large for the devices.

``StagedPipeline`` wraps a loaded pipeline and is called like it. For each call (one batch):
the text encoders come to the device, encode every prompt of the batch and go back to the CPU;
the transformer (placed by ``device_map``, it stays where it is) denoises to latents; the VAE comes
to the device, decodes and goes back. Per-pipeline knowledge (how to encode, how to decode) is one
small class per pipeline, named by its ``PipelineSpec.stages``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline


@contextlib.contextmanager
def resident(modules: list[Optional[torch.nn.Module]], device: torch.device) -> Iterator[None]:
    """Move ``modules`` to ``device`` for the block, then back to the CPU and free the cache."""
    present = [m for m in modules if m is not None]
    for module in present:
        module.to(device)
    try:
        yield
    finally:
        if device.type != "cpu":
            for module in present:
                module.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()


class FluxStages:
    """FLUX.1: CLIP + T5 encode; transformer to packed latents; unpack, unscale and VAE-decode."""

    encoders = ("text_encoder", "text_encoder_2")

    @staticmethod
    def encode(pipe: FluxPipeline, prompts: list[str], negatives: Optional[list[str]], device, kwargs: dict) -> dict:
        length = kwargs.get("max_sequence_length", 512)
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device, max_sequence_length=length)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if negatives is not None:
            neg, neg_pooled, _ = pipe.encode_prompt(
                prompt=negatives, prompt_2=None, device=device, max_sequence_length=length
            )
            out.update(negative_prompt_embeds=neg, negative_pooled_prompt_embeds=neg_pooled)
        return out

    @staticmethod
    def decode(pipe: FluxPipeline, latents: torch.Tensor, kwargs: dict) -> np.ndarray:
        height = kwargs.get("height") or pipe.default_sample_size * pipe.vae_scale_factor
        width = kwargs.get("width") or pipe.default_sample_size * pipe.vae_scale_factor
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        latents = latents.to(device=pipe.vae.device, dtype=pipe.vae.dtype)
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")



def stages_for(class_name: str) -> type[Any]:
    """The staged encode/decode class of a pipeline (``PipelineSpec.stages``), or a ConfigError."""
    from lightning_diffusion.pipelines.specs import spec_for, with_stages

    stages = spec_for(class_name).stages_class()
    if stages is None:
        raise ConfigError(f"staged=True knows no stages for {class_name}; it supports {', '.join(with_stages())}.")
    return stages


class _Output:
    def __init__(self, images: np.ndarray) -> None:
        self.images = images


class StagedPipeline:
    """Callable like the pipeline it wraps (``prompt``, ``negative_prompt``, ``generator``,
    ``output_type="np"`` and the call arguments), running the three stages."""

    def __init__(self, pipeline: Any, device: torch.device) -> None:
        stages = stages_for(type(pipeline).__name__)
        self.pipeline = pipeline
        self.stages = stages
        self.device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipeline, name)

    @torch.no_grad()
    def __call__(self, prompt: list[str], negative_prompt: Optional[list[str]] = None, output_type: str = "np",
                 **kwargs: object) -> _Output:
        pipe = self.pipeline
        encoders = [getattr(pipe, name, None) for name in self.stages.encoders]
        with resident(encoders, self.device):
            embeds = self.stages.encode(pipe, prompt, negative_prompt, self.device, kwargs)
        latents = pipe(**embeds, output_type="latent", **kwargs).images
        with resident([pipe.vae], self.device):
            images = self.stages.decode(pipe, latents, kwargs)
        return _Output(images)
