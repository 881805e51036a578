"""Decoding and size rules read from the pipeline before weights, where the registry says nothing.

A video VAE that decodes only by tiles (Allegro's ``AutoencoderKLAllegro``, whose ``_decode``
raises "Decoding without tiling has not been implemented yet") gets ``model.vae_tiling`` turned on
when it is unset, with a logged line, and is refused before weights when it is set to ``false``. A
pipeline without a VAE follows the size rule its own ``check_inputs`` states (PRX's pixel pipeline:
``vae_scale_factor x transformer.config.patch_size``, its ``vae_scale_factor`` being 1), not a fixed
multiple of 8; one whose rule cannot be read (DeepFloyd IF's pixel UNet checks no size) is called
with the size given, the run says so, and each image's metadata records the size made. Tiny copies
built in the tests; outcomes go to ``$LIGHTNING_DIFFUSION_PIPELINE_RESULTS`` as in
``test_any_pipeline``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import load_arrays, read_manifest_lines, run_here
from tests.pipelines.test_any_pipeline import _model_folder, record

STEPS = ["--model.num_inference_steps", "2", "--writer.save_arrays", "true", "--trainer.accelerator", "cpu",
         "--trainer.enable_progress_bar", "false"]
# Allegro's tiled decode cuts 24-frame tiles of sample_size pixels overlapping by 120 x 80 pixels
# (fixed in its class): the smallest video it decodes is 128 x 128 pixels, 25 frames here.
ALLEGRO_SIZE = {"height": 128, "width": 128, "num_frames": 25}


def build_allegro(folder: Path) -> Path:
    """AllegroPipeline: a one-layer transformer over a two-block Allegro VAE (2x in space and time,
    tiles of 128 pixels), a one-layer T5 and a character tokenizer."""
    import torch
    from diffusers import AllegroPipeline, AllegroTransformer3DModel, AutoencoderKLAllegro, EulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from lightning_diffusion.pipelines.tiny import _char_tokenizer

    torch.manual_seed(0)
    vae = AutoencoderKLAllegro(
        block_out_channels=(8, 8), down_block_types=("AllegroDownBlock3D",) * 2,
        up_block_types=("AllegroUpBlock3D",) * 2, temporal_downsample_blocks=(True, False),
        temporal_upsample_blocks=(True, False), latent_channels=4, layers_per_block=1, norm_num_groups=4,
        temporal_compression_ratio=2, sample_size=128)
    transformer = AllegroTransformer3DModel(
        patch_size=4, num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, num_layers=1,
        cross_attention_dim=24, caption_channels=32, sample_height=16, sample_width=16, sample_frames=8)
    text_encoder = T5EncoderModel(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                           decoder_start_token_id=0))
    AllegroPipeline(tokenizer=_char_tokenizer(64), text_encoder=text_encoder, vae=vae, transformer=transformer,
                    scheduler=EulerDiscreteScheduler()).save_pretrained(folder)
    return folder


def test_a_vae_that_decodes_only_by_tiles_is_read_from_its_class():
    """Of diffusers' models, Allegro's VAE alone returns its tiled decode under ``if self.use_tiling``
    and raises otherwise; a VAE that tiles only when asked (LTX's, Mochi's, the image KL) is not one."""
    import diffusers
    from diffusers import ModelMixin

    from lightning_diffusion.pipelines.facts import decodes_only_by_tiles, derive

    models = [m for m in (getattr(diffusers, name, None) for name in dir(diffusers))
              if isinstance(m, type) and issubclass(m, ModelMixin)]
    found = [m.__name__ for m in models if decodes_only_by_tiles(m)]
    assert found == ["AutoencoderKLAllegro"]
    facts = derive(diffusers.AllegroPipeline, {"vae": ["diffusers", "AutoencoderKLAllegro"]},
                   {"vae": {"_class_name": "AutoencoderKLAllegro"}})
    assert facts.tiled_only == "AutoencoderKLAllegro"
    assert derive(diffusers.LTXPipeline, {"vae": ["diffusers", "AutoencoderKLLTXVideo"]},
                  {"vae": {"_class_name": "AutoencoderKLLTXVideo"}}).tiled_only is None


def test_allegro_decodes_by_tiles_unasked_and_equals_diffusers_called_directly(tmp_path):
    """Called directly without tiling, Allegro fails after its weights load; run with
    ``model.vae_tiling`` unset (two prompts, batch size 2), tiling and slicing are turned on with a
    logged line and recorded in run.json, and each video equals diffusers called directly with its
    VAE tiled and sliced, bit for bit."""
    from lightning_diffusion.pipelines import bare

    model = build_allegro(tmp_path / "allegro")
    pipe = bare.load(str(model))
    with pytest.raises(NotImplementedError, match="Decoding without tiling"):
        bare.call(pipe, ["a cat"], [0], num_inference_steps=1, output_type="np", **ALLEGRO_SIZE)
    size = [f"--model.{k}={v}" for k, v in ALLEGRO_SIZE.items()]
    run = run_here("predict", "--model.pretrained_model_name_or_path", str(model), *size, "--data.prompts",
                   "[a cat, a lighthouse in a storm]", "--data.batch_size", "2", "--writer.output_dir",
                   str(tmp_path / "out"), *STEPS)
    assert ("model.vae_tiling: on and model.vae_slicing (its tiled decode takes one sample), as AllegroPipeline's "
            "VAE (AutoencoderKLAllegro) decodes only by tiles" in run.stdout + run.stderr), run.stderr[-3000:]
    settings = json.loads((tmp_path / "out" / "run.json").read_text())
    assert _holds(settings, "model.vae_tiling", True) and _holds(settings, "model.vae_slicing", True), settings
    again = run_here(*run.args[1:], check=False)  # run.json's settings found again before weights: all made
    assert again.returncode == 0 and "nothing to make" in again.stdout + again.stderr, again.stderr[-3000:]
    pipe.vae.enable_tiling()
    pipe.vae.enable_slicing()
    lines, arrays = read_manifest_lines(tmp_path / "out"), load_arrays(tmp_path / "out")
    direct = np.asarray(bare.call(pipe, [line["prompt"] for line in lines], [line["seed"] for line in lines],
                                  num_inference_steps=2, output_type="np", **ALLEGRO_SIZE).frames, dtype=np.float32)
    assert len(lines) == 2 and direct.shape == (2, 25, 128, 128, 3)
    for n, line in enumerate(lines):
        assert np.array_equal(direct[n], arrays[line["index"]]), line["index"]
    record("AllegroPipeline", "one process", "equal", "byte-identical to diffusers called directly with its VAE "
           "tiled and sliced (turned on unasked: it decodes only by tiles)", copy="built in the test")


def _holds(settings: object, key: str, value: object) -> bool:
    """Whether ``key: value`` is somewhere in the nested mapping ``settings``."""
    if isinstance(settings, dict):
        return settings.get(key) == value or any(_holds(v, key, value) for v in settings.values())
    return isinstance(settings, list) and any(_holds(v, key, value) for v in settings)


def test_vae_tiling_false_for_a_vae_that_decodes_only_by_tiles_is_refused_before_weights(tmp_path, cli_here):
    folder = _model_folder(tmp_path / "model", "AllegroPipeline",
                           {"vae": ["diffusers", "AutoencoderKLAllegro"],
                            "transformer": ["diffusers", "AllegroTransformer3DModel"]})
    proc = cli_here("predict", "--model.pretrained_model_name_or_path", str(folder), "--model.height", "128",
                    "--model.width", "128", "--model.num_frames", "25", "--model.vae_tiling", "false",
                    "--data.prompts", "[a fox]", "--writer.output_dir", str(tmp_path / "out"), *STEPS)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert ("model.vae_tiling: false, but AllegroPipeline's VAE (AutoencoderKLAllegro) decodes only by tiles (its "
            "decode raises without tiling): set model.vae_tiling: true" in proc.stderr), proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text and not (tmp_path / "out").exists(), text[-3000:]
    record("AllegroPipeline", "one process", "refused", "model.vae_tiling: false (its VAE decodes only by tiles)",
           copy="configs only")


def test_a_pipeline_without_a_vae_follows_the_size_rule_its_check_inputs_states(tmp_path):
    """PRX's pixel pipeline checks ``height % (self.vae_scale_factor * self.transformer.config.patch_size)``
    with a ``vae_scale_factor`` of 1: with a patch of 4, 36 is made and 34 refused naming 4 (not 32,
    the fixed 8 of a VAE it lacks times the patch). IF states no rule: its sizes are not checked,
    and the run says so. Pipelines with a VAE keep their VAE's rule."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive
    from lightning_diffusion.pipelines.model_folder import inspect_pipeline

    prx = derive(diffusers.PRXPixelPipeline, {"transformer": ["diffusers", "PRXTransformer2DModel"]},
                 {"transformer": {"patch_size": 4}})
    assert (prx.pixel_space, prx.own_scale, prx.checked_multiple) == (True, 1, 4)
    folder = _model_folder(tmp_path / "prx", "PRXPixelPipeline",
                           {"transformer": ["diffusers", "PRXTransformer2DModel"]})
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "patch_size": 4}))
    info = inspect_pipeline(str(folder))
    assert info.size_problems(36, 40) == [] and info.size_note() is None
    assert info.size_problems(34, 40) == ["height=34 cannot be made by PRXPixelPipeline: use a positive multiple of 4 "
                                          "(for example 32)."]
    assert info.spec.pixels_per_token == 4  # a token is a 4 x 4 patch of pixels
    sd = derive(diffusers.StableDiffusionPipeline, {"vae": ["diffusers", "AutoencoderKL"]},
                {"vae": {"block_out_channels": [8, 8, 8, 8]}})
    assert not sd.pixel_space and sd.spatial == 8
    assert derive(diffusers.IFPipeline, {}, {}).pixel_space and derive(diffusers.IFPipeline, {}, {}).checked_multiple \
        is None


def build_if(folder: Path) -> Path:
    """DeepFloyd IF's first stage: a pixel UNet of two levels with a learned variance, a one-layer T5
    and a character tokenizer; no safety checker, no watermarker."""
    import torch
    from diffusers import DDPMScheduler, IFPipeline, UNet2DConditionModel
    from transformers import T5Config, T5EncoderModel

    from lightning_diffusion.pipelines.tiny import _char_tokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16, in_channels=3, out_channels=6, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, encoder_hid_dim=32, attention_head_dim=4, norm_num_groups=4)
    text_encoder = T5EncoderModel(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                           decoder_start_token_id=0))
    IFPipeline(tokenizer=_char_tokenizer(77), text_encoder=text_encoder, unet=unet,
               scheduler=DDPMScheduler(variance_type="learned_range"), safety_checker=None, feature_extractor=None,
               watermarker=None, requires_safety_checker=False).save_pretrained(folder)
    return folder


def test_a_size_a_pipeline_without_a_vae_states_no_rule_for_is_made_and_recorded(tmp_path):
    """IF at 20 x 36 (no multiple of 8): called with that size, the run's line says the size is
    unchecked, each image's metadata records the size made, and it equals diffusers called
    directly, bit for bit."""
    from lightning_diffusion.pipelines import bare

    model = build_if(tmp_path / "if")
    run = run_here("predict", "--model.pretrained_model_name_or_path", str(model), "--model.height", "20",
                   "--model.width", "36", "--data.prompts", "[a cat, a lighthouse in a storm]", "--data.batch_size",
                   "2", "--writer.output_dir", str(tmp_path / "out"), *STEPS)
    assert ("IFPipeline has no VAE, and its check_inputs states no size rule that can be read: height and width are "
            "passed as given, unchecked" in run.stdout + run.stderr), run.stderr[-3000:]
    lines, arrays = read_manifest_lines(tmp_path / "out"), load_arrays(tmp_path / "out")
    assert [(line["height"], line["width"]) for line in lines] == [(20, 36), (20, 36)], lines
    direct = np.asarray(bare.call(bare.load(str(model)), [line["prompt"] for line in lines],
                                  [line["seed"] for line in lines], height=20, width=36, num_inference_steps=2,
                                  output_type="np").images, dtype=np.float32)
    for n, line in enumerate(lines):
        assert np.array_equal(direct[n], arrays[line["index"]]), line["index"]
    record("IFPipeline", "one process", "equal", "byte-identical to diffusers called directly at a size no rule "
           "checks (recorded as made)", copy="built in the test")
