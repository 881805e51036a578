"""Tiny random-weight copies of pipelines the registry (``specs.py``) does not describe, built offline.

Everything the project knows of these comes from the pipeline classes and their configs
(``facts``): they are how the tests hold "any diffusers pipeline" to the same promises
as the registered ones (one process equal to diffusers called directly, replicas equal to one
process, each plan the transformer has run with parity or refused before weights). ``tiny:NAME``
builds one into the cache on first use (``specs.TINY_ZOO`` names them), as ``tiny.py`` does for the
registered ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lightning_diffusion.pipelines.tiny import _char_tokenizer, _save

# Heads of every tiny denoiser: 4, so that Ulysses 2 and 4 and tp 2 divide them.
_HEADS = 4


def _clip(seed: int, projection: bool = False, hidden: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=77, projection_dim=hidden,
                            pad_token_id=0, bos_token_id=2, eos_token_id=2)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _t5(seed: int, d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(  # type: ignore[call-arg]  # PretrainedConfig takes it as a kwarg
        vocab_size=128, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4, decoder_start_token_id=0))


def _kl_vae(seed: int, latent: int, blocks: tuple[int, ...] = (8, 8, 16, 16), **extra):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(blocks),
                         up_block_types=("UpDecoderBlock2D",) * len(blocks), block_out_channels=blocks,
                         layers_per_block=1, latent_channels=latent, norm_num_groups=4, sample_size=32, **extra)


def build_sdxl(directory: str | os.PathLike) -> Path:
    """StableDiffusionXLPipeline: a two-level UNet (4x VAE, no patches), two CLIP towers."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, transformer_layers_per_block=(1, 1), projection_class_embeddings_input_dim=80,
        cross_attention_dim=64, norm_num_groups=8,
    )
    pipe = StableDiffusionXLPipeline(
        vae=_kl_vae(1, 4, (8, 16, 16)), text_encoder=_clip(2), text_encoder_2=_clip(3, projection=True),
        tokenizer=_char_tokenizer(77), tokenizer_2=_char_tokenizer(77), unet=unet,
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                         timestep_spacing="leading", steps_offset=1),
        force_zeros_for_empty_prompt=True,
    )
    return _save(pipe, directory)


def build_sdxl_controlnet(directory: str | os.PathLike) -> Path:
    """StableDiffusionXLControlNetPipeline: tiny:sdxl's parts and a ControlNet made from its UNet,
    whose conditioning embedding takes the control image down 4x, as the VAE does."""
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline

    from lightning_diffusion.pipelines.tiny import resolve

    sdxl = StableDiffusionXLPipeline.from_pretrained(resolve("tiny:sdxl"))
    torch.manual_seed(1)
    controlnet = ControlNetModel.from_unet(sdxl.unet, conditioning_embedding_out_channels=(4, 8, 16))
    # from_unet starts the control's own convolutions at zero (no effect until trained): random here,
    # so that a record's control image shows in its picture
    for module in (controlnet.controlnet_cond_embedding.conv_out, controlnet.controlnet_down_blocks,
                   controlnet.controlnet_mid_block):
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    pipe = StableDiffusionXLControlNetPipeline(**sdxl.components, controlnet=controlnet)
    return _save(pipe, directory)


def build_sd3(directory: str | os.PathLike) -> Path:
    """StableDiffusion3Pipeline: an MMDiT with 2x2 patches over an 8x VAE, two CLIPs and a T5."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=_HEADS,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=64,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_kl_vae(1, 4, shift_factor=0.0, scaling_factor=1.0),
        text_encoder=_clip(2, projection=True), tokenizer=_char_tokenizer(77),
        text_encoder_2=_clip(3, projection=True), tokenizer_2=_char_tokenizer(77),
        text_encoder_3=_t5(4), tokenizer_3=_char_tokenizer(256),
    )
    return _save(pipe, directory)


def build_flux2(directory: str | os.PathLike) -> Path:
    """Flux2Pipeline: FLUX.2's transformer on 2x2-packed latents of a patching VAE, and a Mistral 3
    text encoder whose hidden states 10, 20 and 30 FLUX.2 reads (so 30 tiny layers)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=_HEADS, joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
    )
    torch.manual_seed(1)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=32,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    torch.manual_seed(2)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", hidden_size=16, intermediate_size=32, num_hidden_layers=30,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=128,
                         max_position_embeddings=1024),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=16),
    ))
    tokenizer = _char_tokenizer(512)
    # FLUX.2 formats each prompt as a chat; the tiny template keeps the user's text only, so that the
    # 512 tokens hold the prompt rather than the system message.
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{% for c in m['content'] %}"
                               "{{ c['text'] }}{% endfor %}{% endif %}{% endfor %}")
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=transformer)
    return _save(pipe, directory)


def build_ltx(directory: str | os.PathLike) -> Path:
    """LTXPipeline: a video transformer with a T5 text mask (prompts padded to max_sequence_length),
    over a VAE that compresses 4x in space and time here (32x and 8x in LTX-Video)."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=_HEADS,
        attention_head_dim=8, cross_attention_dim=32, num_layers=1, caption_channels=32,
    )
    torch.manual_seed(1)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False,
    )
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=_t5(2),
                       tokenizer=_char_tokenizer(128), transformer=transformer)
    return _save(pipe, directory)


def build_cogvideox(directory: str | os.PathLike) -> Path:
    """CogVideoXPipeline: a video transformer with 2x2 patches and no diffusers parallel plan."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=_HEADS, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=1, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=16,
    )
    torch.manual_seed(1)
    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
    )
    pipe = CogVideoXPipeline(tokenizer=_char_tokenizer(16), text_encoder=_t5(2), vae=vae, transformer=transformer,
                             scheduler=CogVideoXDDIMScheduler())
    return _save(pipe, directory)
