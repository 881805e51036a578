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


def _gemma2(seed: int, hidden: int = 32):
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    return Gemma2Model(Gemma2Config(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, pad_token_id=0, eos_token_id=2,
        bos_token_id=2,
    ))


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


def _controlnet(unet, seed: int):
    """A ControlNet made from ``unet`` whose conditioning embedding takes the control image down 4x,
    as the tiny VAEs do; its own convolutions random rather than zero (``from_unet``'s start, no
    effect until trained), so that a record's control image shows in its picture."""
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(4, 8, 16))
    for module in (controlnet.controlnet_cond_embedding.conv_out, controlnet.controlnet_down_blocks,
                   controlnet.controlnet_mid_block):
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    return controlnet


def build_sdxl_controlnet(directory: str | os.PathLike) -> Path:
    """StableDiffusionXLControlNetPipeline: tiny:sdxl's parts and a ControlNet made from its UNet."""
    from diffusers import StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline

    from lightning_diffusion.pipelines.tiny import resolve

    sdxl = StableDiffusionXLPipeline.from_pretrained(resolve("tiny:sdxl"))
    pipe = StableDiffusionXLControlNetPipeline(**sdxl.components, controlnet=_controlnet(sdxl.unet, 1))
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


def build_sana(directory: str | os.PathLike) -> Path:
    """SanaPipeline: a linear-attention transformer over a 4x deep-compression VAE (32x in Sana),
    and a two-layer Gemma 2 text encoder."""
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=_HEADS, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=_HEADS, cross_attention_head_dim=8, cross_attention_dim=32, caption_channels=32,
        sample_size=16, patch_size=1,
    )
    torch.manual_seed(1)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=4,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8, 16), decoder_block_out_channels=(8, 8, 16),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
        downsample_block_type="conv", upsample_block_type="interpolate", scaling_factor=0.41407,
    )
    pipe = SanaPipeline(tokenizer=_char_tokenizer(2048), text_encoder=_gemma2(2), vae=vae, transformer=transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    return _save(pipe, directory)


def _pixart(directory: str | os.PathLike, pipeline: str, text_tokens: int) -> Path:
    """A PixArt pipeline (``pipeline``, a diffusers class name): a one-block DiT with 2x2 patches and
    learned variance over a 4x VAE, a T5 whose prompts pad to ``text_tokens``."""
    import diffusers
    from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel

    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        num_attention_heads=_HEADS, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        norm_num_groups=4, cross_attention_dim=32, sample_size=32, patch_size=2, caption_channels=32,
    )
    pipe = getattr(diffusers, pipeline)(tokenizer=_char_tokenizer(text_tokens), text_encoder=_t5(2),
                                        vae=_kl_vae(1, 4, (8, 16, 16)), transformer=transformer,
                                        scheduler=DPMSolverMultistepScheduler())
    return _save(pipe, directory)


def build_pixart_sigma(directory: str | os.PathLike) -> Path:
    """PixArtSigmaPipeline: PixArt-sigma's 300-token prompts."""
    return _pixart(directory, "PixArtSigmaPipeline", 300)


def _sd15_unet(seed: int, in_channels: int = 4):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16, in_channels=in_channels, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=_HEADS, cross_attention_dim=32, norm_num_groups=8,
    )


def _sd15_scheduler():
    from diffusers import PNDMScheduler

    return PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                         steps_offset=1)


def build_sd15(directory: str | os.PathLike) -> Path:
    """StableDiffusionPipeline: a two-level UNet over a 4x VAE (8x in SD 1.5), one CLIP, no safety checker."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        vae=_kl_vae(1, 4, (8, 16, 16)), text_encoder=_clip(2), tokenizer=_char_tokenizer(77), unet=_sd15_unet(0),
        scheduler=_sd15_scheduler(), safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    return _save(pipe, directory)


def build_sd15_img2img(directory: str | os.PathLike) -> Path:
    """StableDiffusionImg2ImgPipeline: tiny:sd15's parts, which also encode the input image."""
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

    from lightning_diffusion.pipelines.tiny import resolve

    sd15 = StableDiffusionPipeline.from_pretrained(resolve("tiny:sd15"))
    pipe = StableDiffusionImg2ImgPipeline(**sd15.components, requires_safety_checker=False)
    return _save(pipe, directory)


def build_sd15_controlnet(directory: str | os.PathLike) -> Path:
    """StableDiffusionControlNetPipeline: tiny:sd15's parts and a ControlNet made from its UNet."""
    from diffusers import StableDiffusionControlNetPipeline, StableDiffusionPipeline

    from lightning_diffusion.pipelines.tiny import resolve

    sd15 = StableDiffusionPipeline.from_pretrained(resolve("tiny:sd15"))
    pipe = StableDiffusionControlNetPipeline(**sd15.components, controlnet=_controlnet(sd15.unet, 1),
                                             requires_safety_checker=False)
    return _save(pipe, directory)


def build_sd15_inpaint(directory: str | os.PathLike) -> Path:
    """StableDiffusionInpaintPipeline: tiny:sd15's VAE and CLIP, and a UNet of its own that reads the
    masked image's latents and the mask beside the noise (9 input channels)."""
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline

    from lightning_diffusion.pipelines.tiny import resolve

    sd15 = StableDiffusionPipeline.from_pretrained(resolve("tiny:sd15"))
    pipe = StableDiffusionInpaintPipeline(**{**sd15.components, "unet": _sd15_unet(3, in_channels=9)},
                                          requires_safety_checker=False)
    return _save(pipe, directory)


def build_auraflow(directory: str | os.PathLike) -> Path:
    """AuraFlowPipeline: one MMDiT and one single-stream block with 2x2 patches over a 4x VAE, a UMT5."""
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    transformer = AuraFlowTransformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=_HEADS, joint_attention_dim=32, caption_projection_dim=32,
        out_channels=4, pos_embed_max_size=256,
    )
    torch.manual_seed(2)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0))
    pipe = AuraFlowPipeline(tokenizer=_char_tokenizer(256), text_encoder=text_encoder,
                            vae=_kl_vae(1, 4, (8, 16, 16)), transformer=transformer,
                            scheduler=FlowMatchEulerDiscreteScheduler())
    return _save(pipe, directory)


def build_lumina2(directory: str | os.PathLike) -> Path:
    """Lumina2Pipeline: one refiner and one main block (2x2 patches, 4 query and 4 key-value heads)
    over an 8x VAE, as the pipeline assumes, and a two-layer Gemma 2 text encoder."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    torch.manual_seed(0)
    transformer = Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=1, num_refiner_layers=1,
        num_attention_heads=_HEADS, num_kv_heads=_HEADS, multiple_of=16, axes_dim_rope=(4, 2, 2),
        axes_lens=(256, 64, 64), cap_feat_dim=32,
    )
    pipe = Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(),
                           vae=_kl_vae(1, 4, shift_factor=0.0, scaling_factor=1.0), text_encoder=_gemma2(2),
                           tokenizer=_char_tokenizer(256))
    return _save(pipe, directory)


def build_chroma(directory: str | os.PathLike) -> Path:
    """ChromaPipeline: FLUX.1-schnell's shape with a small modulation approximator in place of
    per-block modulation, on 2x2-packed latents of an 8x VAE, and a T5 alone."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=_HEADS, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
        approximator_hidden_dim=32, approximator_layers=1,
    )
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                          vae=_kl_vae(1, 4, shift_factor=0.0, scaling_factor=1.0), text_encoder=_t5(2),
                          tokenizer=_char_tokenizer(512), transformer=transformer)
    return _save(pipe, directory)


def build_mochi(directory: str | os.PathLike) -> Path:
    """MochiPipeline: a one-block asymmetric video transformer with 2x2 patches, over Mochi's VAE
    (8x in space, 6x in time, 12 latent channels, as the pipeline assumes) at 32 channels, and a T5."""
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel

    torch.manual_seed(0)
    transformer = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=_HEADS, attention_head_dim=8, num_layers=1, pooled_projection_dim=16,
        in_channels=12, text_embed_dim=32, time_embed_dim=4, max_sequence_length=256,
    )
    torch.manual_seed(1)
    vae = AutoencoderKLMochi(
        latent_channels=12, out_channels=3, encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
        layers_per_block=(1,) * 5, add_attention_block=(False,) * 5,
    )
    pipe = MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=_t5(2),
                         tokenizer=_char_tokenizer(256), transformer=transformer)
    return _save(pipe, directory)


def _template_tokenizer(template_start: str, model_max_length: int):
    """Characters, except the words and markers of a pipeline's fixed prompt template, which are one
    token each (as a real tokenizer cuts them), so that a pipeline that drops the template's first
    tokens by count keeps the prompt's."""
    import re
    import string

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = re.findall(r"<\|\w+\|>| ?\w+|[^\w ]|\s", template_start)
    multi = sorted({w for w in words if len(w) > 1}, key=len, reverse=True)
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(["<pad>", "<unk>", "</s>", *string.printable, *multi]))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(re.escape(w) for w in multi) + r"|[\s\S]"),
                                                 behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   model_max_length=model_max_length)


def build_hunyuanvideo(directory: str | os.PathLike) -> Path:
    """HunyuanVideoPipeline: one dual- and one single-stream block over a VAE that compresses 8x in
    space and 4x in time, a three-layer Llama (whose third-last hidden state the pipeline reads)
    and a CLIP; the Llama tokenizer cuts the pipeline's template into its 95 tokens."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
    from transformers import LlamaConfig, LlamaModel

    tokenizer = _template_tokenizer(str(DEFAULT_PROMPT_TEMPLATE["template"]).split("{}")[0], 512)
    torch.manual_seed(0)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=_HEADS, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=32,
        pooled_projection_dim=32, rope_axes_dim=(2, 2, 4),
    )
    torch.manual_seed(1)
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        mid_block_add_attention=False,
    )
    torch.manual_seed(2)
    text_encoder = LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0,
    ))
    pipe = HunyuanVideoPipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                                scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=_clip(3),
                                tokenizer_2=_char_tokenizer(77))
    return _save(pipe, directory)


def build_cogview4(directory: str | os.PathLike) -> Path:
    """CogView4Pipeline: a one-block transformer with 2x2 patches over a 4x VAE, and a two-layer GLM
    (whose second-last hidden state the pipeline reads) with a left-padding tokenizer, as GLM-4's."""
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from tokenizers import processors
    from transformers import GlmConfig, GlmModel

    torch.manual_seed(0)
    transformer = CogView4Transformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=_HEADS,
        text_embed_dim=32, time_embed_dim=16, condition_dim=8, sample_size=16, rope_axes_dim=(64, 64),
    )
    torch.manual_seed(2)
    text_encoder = GlmModel(GlmConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, pad_token_id=0,
    ))
    tokenizer = _char_tokenizer(1024)
    tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # the latter is what is saved
    # GLM-4's tokenizer starts every text with its own tokens: an empty negative prompt is not empty
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="</s> $A", special_tokens=[("</s>", tokenizer.eos_token_id)])
    pipe = CogView4Pipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=_kl_vae(1, 4, (8, 16, 16)),
                            transformer=transformer,
                            scheduler=FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75,
                                                                      base_image_seq_len=256,
                                                                      use_dynamic_shifting=True,
                                                                      time_shift_type="linear"))
    return _save(pipe, directory)


def build_pixart_alpha(directory: str | os.PathLike) -> Path:
    """PixArtAlphaPipeline: tiny:pixart-sigma's shape with PixArt-alpha's 120-token prompts."""
    return _pixart(directory, "PixArtAlphaPipeline", 120)


def build_latte(directory: str | os.PathLike) -> Path:
    """LattePipeline: one spatial and one temporal block with 2x2 patches over an image VAE (4x) that
    decodes frame by frame, and a T5."""
    from diffusers import DDIMScheduler, LattePipeline, LatteTransformer3DModel

    torch.manual_seed(0)
    transformer = LatteTransformer3DModel(
        num_attention_heads=_HEADS, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        cross_attention_dim=32, attention_bias=True, sample_size=8, patch_size=2, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        caption_channels=32, video_length=16,
    )
    pipe = LattePipeline(tokenizer=_char_tokenizer(120), text_encoder=_t5(2), vae=_kl_vae(1, 4, (8, 16, 16)),
                         transformer=transformer, scheduler=DDIMScheduler(beta_schedule="linear"))
    return _save(pipe, directory)


def build_hunyuandit(directory: str | os.PathLike) -> Path:
    """HunyuanDiTPipeline: a two-block DiT with 2x2 patches and learned variance over an 8x VAE (the
    pipeline's rotary grid assumes 8x), a two-layer BERT and a T5, no safety checker."""
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    transformer = HunyuanDiT2DModel(
        num_attention_heads=_HEADS, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=16, hidden_size=32,
        num_layers=2, cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=16,
    )
    torch.manual_seed(2)
    text_encoder = BertModel(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=128, pad_token_id=0))
    pipe = HunyuanDiTPipeline(
        vae=_kl_vae(1, 4), text_encoder=text_encoder, tokenizer=_char_tokenizer(77),
        transformer=transformer, scheduler=DDPMScheduler(beta_start=0.00085, beta_end=0.012,
                                                         beta_schedule="scaled_linear"),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False, text_encoder_2=_t5(3),
        tokenizer_2=_char_tokenizer(256),
    )
    return _save(pipe, directory)
