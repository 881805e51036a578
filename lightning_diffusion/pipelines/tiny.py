"""Tiny, randomly initialised pipelines built offline, for tests, CPU rehearsal and examples.

``tiny:flux`` as a model path builds the FLUX.1-architecture pipeline once into a cache folder
(``$LIGHTNING_DIFFUSION_CACHE``, default ``~/.cache/lightning_diffusion``) and then loads it through
the normal ``from_pretrained`` path, so the tiny model exercises exactly the code a real one does.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import string
import tempfile
from pathlib import Path

import torch

from lightning_diffusion.core.console import no_progress_bars
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.pipelines import compat

TINY_PREFIX = "tiny:"
# Bump when a builder changes, so that stale caches are not reused.
_BUILD_VERSION = "2"  # 2: the Qwen-Image tokenizer keeps the prompt in the embeddings


def _char_tokenizer(model_max_length: int):
    """A character-level tokenizer that needs no download: distinct prompts give distinct tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="</s>",
        model_max_length=model_max_length,
    )


# Qwen-Image's prompt template up to the user's text; the pipeline drops its first 34 tokens, which
# is how Qwen2.5's own tokenizer cuts it. The tiny tokenizer cuts it the same way (words with their
# leading space, punctuation, the chat markers), so that the embeddings start at the prompt.
_QWEN_TEMPLATE_START = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)


def _qwen_tokenizer(model_max_length: int):
    """Characters, except the template's 34 tokens: distinct prompts give distinct embeddings."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = re.findall(r"<\|im_start\|>|<\|im_end\|>| ?\w+|[^\w ]|\s", _QWEN_TEMPLATE_START)
    assert len(words) == 34, len(words)
    multi = sorted({w for w in words if len(w) > 1}, key=len, reverse=True)
    specials = ["<pad>", "<unk>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(specials + list(string.printable) + multi))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    pattern = "|".join(re.escape(w) for w in multi) + r"|[\s\S]"
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
        model_max_length=model_max_length,
    )


def _save(pipe, directory: str | os.PathLike) -> Path:
    pipe.save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def build_flux(directory: str | os.PathLike) -> Path:
    """Write a tiny FLUX.1-dev-architecture pipeline (about 1.5 MB, safetensors) to ``directory``.

    The transformer has 4 attention heads of 16 (divisible by 2 and 4, so that every parallel test
    can shard it), one double and one single block, and guidance embedding as in FLUX.1-dev.
    """
    return _save(flux_pipeline(), directory)


def flux_pipeline():
    """tiny:flux's pipeline, in memory (see ``build_flux``)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(1)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            projection_dim=32,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=2,
        )
    )
    torch.manual_seed(3)
    text_encoder_2 = T5EncoderModel(
        T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        shift=3.0,
        use_dynamic_shifting=True,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_char_tokenizer(77),
        text_encoder_2=text_encoder_2,
        tokenizer_2=_char_tokenizer(512),
        transformer=transformer,
    )


# tiny:shapes reads captions of at most this many words (plus the end token); configs pass it as
# ``max_sequence_length`` because FluxPipeline's default (512) would pad the prompt far beyond it.
SHAPES_TEXT_LENGTH = 32


def _word_tokenizer(model_max_length: int):
    """One token per word of the shapes captions (lower-cased; other words are ``<unk>``), and an end
    token after the prompt, which CLIP's pooled output reads."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from lightning_diffusion.pipelines.shapes import VOCABULARY

    specials = ["<pad>", "</s>", "<unk>"]  # the end token must not be id 2 (CLIP's legacy pooling)
    vocab = {tok: i for i, tok in enumerate(specials + VOCABULARY)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
        model_max_length=model_max_length,
    )


def shapes_architecture(latent_channels: int = 4, downsampling: int = 4):
    """The untrained ``tiny:shapes`` pipeline (``scripts/train_shapes.py`` trains it): FLUX.1
    architecture with a 4x VAE (64x64 images are 16x16x4 latents, 64 image tokens of 8x8 pixels;
    ``downsampling=2`` gives 32x32x4 latents, 256 tokens of 4x4 pixels, so a shape's outline runs
    across tokens rather than inside one), a transformer of two double and two single blocks with 4
    heads of 32 (Ulysses 2 and 4 and tp=2 still shard it), no guidance embedding, and word-level CLIP
    and T5 towers."""
    if downsampling not in (2, 4):
        raise ValueError(f"downsampling is 2 or 4, not {downsampling}")
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _word_tokenizer(SHAPES_TEXT_LENGTH)
    vocab_size = len(tokenizer)
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=2, num_single_layers=2, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )
    torch.manual_seed(1)
    # 2x: no attention in the VAE's middle block (1024 positions; a shape is local, the convolutions see it)
    blocks = (16, 32) if downsampling == 2 else (16, 32, 64)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(blocks), up_block_types=("UpDecoderBlock2D",) * len(blocks),
        block_out_channels=blocks, layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
        sample_size=64, scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
        mid_block_add_attention=downsampling == 4,
    )
    torch.manual_seed(2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=SHAPES_TEXT_LENGTH, projection_dim=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=1,
    ))
    torch.manual_seed(3)
    text_encoder_2 = T5EncoderModel(T5Config(  # type: ignore[call-arg]  # PretrainedConfig takes it as a kwarg
        vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    ))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=2.0, use_dynamic_shifting=False)
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=_word_tokenizer(512), transformer=transformer,
    )


def _small_causal_vae(cls: type, dim_mult: list[int], z_dim: int = 4):
    """A small Wan-family VAE (Qwen-Image's derives from Wan's): 8x spatial downsampling, z_dim
    latent channels whose mean and std must be given with that length."""
    return cls(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=dim_mult,
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )


def build_qwenimage(directory: str | os.PathLike) -> Path:
    """Write a tiny Qwen-Image-architecture pipeline (Qwen2.5-VL text encoder, 4-head transformer
    whose ``_tp_plan`` is fully unfused, Qwen-Image VAE with 4 latent channels) to ``directory``.
    It uses true classifier-free guidance: give a negative prompt and ``true_cfg_scale > 1``."""
    return _save(qwenimage_pipeline(), directory)


def qwenimage_pipeline():
    """tiny:qwenimage's pipeline, in memory (see ``build_qwenimage``)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(1)
    vae = _small_causal_vae(AutoencoderKLQwenImage, dim_mult=[1, 2, 2, 2])
    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=128,
                max_position_embeddings=1280,
                # mrope sections sum to half the head dimension (16 / 2 heads / 2).
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            ),
            vision_config=dict(
                depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            ),
        )
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        use_dynamic_shifting=True,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_qwen_tokenizer(1024),
        transformer=transformer,
    )


def build_wan(directory: str | os.PathLike) -> Path:
    """Write a tiny Wan 2.1 text-to-video-architecture pipeline (UMT5 encoder, a transformer with 4
    heads of 8, Wan VAE with 4 latent channels) to ``directory``. Frames come in groups of 4 plus
    one (``num_frames`` 5, 9, 13, ...); height and width are multiples of 16."""
    return _save(wan_pipeline(), directory)


def wan_pipeline():
    """tiny:wan's pipeline, in memory (see ``build_wan``)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    torch.manual_seed(1)
    vae = _small_causal_vae(AutoencoderKLWan, dim_mult=[1, 1, 1, 1])
    torch.manual_seed(2)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return WanPipeline(
        tokenizer=_char_tokenizer(512),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
    )


# ----------------------------------------------------------------------------- image-conditioned


def build_flux_kontext(directory: str | os.PathLike) -> Path:
    """FLUX.1 Kontext (editing): exactly tiny:flux's components; the reference image's tokens join
    the output's along the sequence."""
    from diffusers import FluxKontextPipeline

    return _save(FluxKontextPipeline(**flux_pipeline().components), directory)


def build_flux_fill(directory: str | os.PathLike) -> Path:
    """FLUX.1 Fill (inpainting): tiny:flux with a transformer whose input per packed token is the
    noise latents (4 channels x 4), the masked image's latents (16) and the mask at the 2x2 latent
    patch's pixels (8 x 8 x 4 = 256): 288 channels (FLUX.1 Fill's 384 = 64 + 64 + 256)."""
    from diffusers import FluxFillPipeline, FluxTransformer2DModel

    components = flux_pipeline().components
    vae = components["vae"]
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    packed = vae.config.latent_channels * 4
    torch.manual_seed(0)
    components["transformer"] = FluxTransformer2DModel.from_config(
        components["transformer"].config, in_channels=2 * packed + scale * scale * 4, out_channels=packed)
    for optional in ("image_encoder", "feature_extractor"):  # FluxPipeline's, which Fill does not take
        components.pop(optional, None)
    return _save(FluxFillPipeline(**components), directory)


# Qwen-Image-Edit's template up to the user's text: Qwen2.5's tokenizer cuts it into 64 tokens
# (the pipeline's prompt_template_encode_start_idx), " (", ")," and "'s" among them.
_QWEN_EDIT_TEMPLATE_START = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen_vl_tokenizer(model_max_length: int):
    """``_qwen_tokenizer``'s idea for both templates (Qwen-Image's 34 tokens, the edit's 64) plus the
    vision tokens the processor expands (an ``<|image_pad|>`` per merged patch)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words_of = r"<\|im_start\|>|<\|im_end\|>|'s|\),| \(| ?\w+|[^\w ]|\s"
    multi = set(_VISION_TOKENS)
    for text, count in ((_QWEN_TEMPLATE_START, 34), (_QWEN_EDIT_TEMPLATE_START, 64)):
        words = re.findall(words_of, text)
        assert len(words) == count, (len(words), count)
        multi |= {w for w in words if len(w) > 1}
    ordered = sorted(multi, key=len, reverse=True)
    specials = ["<pad>", "<unk>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(specials + list(string.printable) + ordered))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    pattern = "|".join(re.escape(w) for w in ordered) + r"|[\s\S]"
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   model_max_length=model_max_length)


def build_qwenimage_edit(directory: str | os.PathLike) -> Path:
    """Qwen-Image-Edit-Plus: tiny:qwenimage's VAE, transformer and scheduler; a Qwen2.5-VL text
    encoder of tiny's sizes whose vocabulary and vision-token ids match a tokenizer with the vision
    tokens; a ``Qwen2VLProcessor`` whose image processor caps the vision tower's input at 56 x 56
    (4 image tokens in the prompt per input image). Edit pipelines use true CFG (negative prompt,
    ``true_cfg_scale`` > 1)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
    )

    compat.apply_pipeline_patches()
    components = qwenimage_pipeline().components
    tokenizer = _qwen_vl_tokenizer(1024)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _VISION_TOKENS}
    old = components["text_encoder"].config
    vision = old.vision_config
    torch.manual_seed(2)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={**old.text_config.to_dict(), "vocab_size": 256, "bos_token_id": None,
                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
        vision_config=vision.to_dict(), image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"]))
    pixels = 56 * 56
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, patch_size=vision.patch_size,
                                            merge_size=vision.spatial_merge_size,
                                            temporal_patch_size=vision.temporal_patch_size)
    extra = {}
    if compat._has_torchvision():
        from transformers import Qwen2VLVideoProcessor

        extra["video_processor"] = Qwen2VLVideoProcessor(
            patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size, size={"shortest_edge": pixels, "longest_edge": pixels})
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, **extra)
    folder = _save(QwenImageEditPlusPipeline(
        scheduler=components["scheduler"], vae=components["vae"], text_encoder=text_encoder, tokenizer=tokenizer,
        processor=processor, transformer=components["transformer"]), directory)
    video = folder / "processor" / "video_preprocessor_config.json"
    if not video.exists():  # so that the folder loads unpatched where torchvision is installed
        video.write_text(json.dumps({
            "video_processor_type": "Qwen2VLVideoProcessor", "patch_size": vision.patch_size,
            "merge_size": vision.spatial_merge_size, "temporal_patch_size": vision.temporal_patch_size,
            "size": {"shortest_edge": pixels, "longest_edge": pixels}}, indent=2) + "\n")
    return folder


def build_wan_i2v(directory: str | os.PathLike) -> Path:
    """Wan 2.1 image-to-video: tiny:wan's tokenizer, UMT5, VAE and scheduler; a transformer of
    tiny:wan's sizes taking 4 noise + 4 mask + 4 image latent channels (Wan 2.1 I2V: 16 + 4 + 16)
    with an image cross-attention fed by a tiny CLIP vision tower (32 x 32, patch 8: 17 tokens)."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    components = wan_pipeline().components
    clip = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            image_size=32, patch_size=8, projection_dim=16)
    torch.manual_seed(4)
    image_encoder = CLIPVisionModel(clip)
    old, vae = components["transformer"].config, components["vae"].config
    torch.manual_seed(0)
    transformer = WanTransformer3DModel.from_config(
        old, in_channels=vae.z_dim + vae.scale_factor_temporal + vae.z_dim, out_channels=vae.z_dim,
        image_dim=clip.hidden_size, added_kv_proj_dim=old.num_attention_heads * old.attention_head_dim)
    return _save(WanImageToVideoPipeline(
        tokenizer=components["tokenizer"], text_encoder=components["text_encoder"], vae=components["vae"],
        scheduler=components["scheduler"], transformer=transformer, image_encoder=image_encoder,
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})),
        directory)


def cache_root() -> Path:
    return Path(os.environ.get("LIGHTNING_DIFFUSION_CACHE", Path.home() / ".cache" / "lightning_diffusion"))


def is_tiny(name: str) -> bool:
    return isinstance(name, str) and name.startswith(TINY_PREFIX)


# Trained tiny pipelines shipped inside the package (``scripts/train_shapes.py`` made them).
SHIPPED = {"shapes": Path(__file__).parents[1] / "models" / "shapes"}


def names() -> list[str]:
    from lightning_diffusion.pipelines import specs
    return [TINY_PREFIX + k for k in [*SHIPPED, *specs.tiny_names()]]


def resolve(name: str) -> str:
    """Map ``tiny:NAME`` to its folder: a shipped trained pipeline, or a random one built into the cache
    on first use. Other names pass through."""
    if not is_tiny(name):
        return name
    from lightning_diffusion.pipelines import specs

    kind = name[len(TINY_PREFIX) :]
    if kind in SHIPPED:
        if not (SHIPPED[kind] / "model_index.json").is_file():
            raise ConfigError(f"{name}'s weights are missing from {SHIPPED[kind]}: reinstall lightning-diffusion, or "
                              "in a source checkout train them with scripts/train_shapes.py; tiny:flux needs no "
                              "weights.")
        return str(SHIPPED[kind])
    builder = specs.tiny_builder(kind)
    if builder is None:
        known = names()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"Unknown tiny pipeline {name!r}{hint}; choose one of: {', '.join(known)}")
    target = cache_root() / f"tiny-{kind}-v{_BUILD_VERSION}"
    if (target / "model_index.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may build at once: each builds into its own temporary folder and the first
    # rename wins, so no process ever sees a half-written pipeline.
    staging = Path(tempfile.mkdtemp(prefix=f".tiny-{kind}-", dir=target.parent))
    try:
        with no_progress_bars(), compat.saving_on_every_rank():  # "Writing model shards" for 1 MB
            builder(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
