"""Context parallelism follows what this pipeline's own call passes its transformer, not its family.

Task pipelines built in the tests from the components of a tiny copy (``tiny:ltx``, ``tiny:qwenimage``),
as a user's folder of the real model would hold them: LTX-Video's image-to-video pipeline passes the
transformer a timestep per latent token (``timestep * (1 - conditioning_mask)``), which LTX's
``_cp_plan`` does not split; Qwen-Image's image-to-image and inpainting pipelines pad the text to each
batch's longest prompt, as the registered Qwen-Image does. Each runs under one process byte-identical to
diffusers called directly, and is refused before weights (exit 2, one line, nothing written) where
its call cannot be split, or runs where it can (Ulysses-anything of degree 2, tolerance 1e-5 on float
pixels as the other context-parallel tests). Two replicas give one process's bytes (slow tier).

What else a call says before weights: a single prompt or generator (aMUSEd, built here, is then
called one record at a time), the multiple it rounds sizes up to (Kandinsky 3), the input picture
it uses without a test for None (LTX image-to-video), and component classes it names (a class this
transformers lacks). Outcomes go to ``$LIGHTNING_DIFFUSION_PIPELINE_RESULTS`` as in
``test_any_pipeline``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, worst_difference
from tests.pipelines.test_any_pipeline import _model_folder, record

ATOL = 1e-5
# Qwen-Image's task pipelines make 1024x1024 unless told (the image's size is not theirs).
SIZE = ["--model.height", "32", "--model.width", "32"]
STEPS = ["--model.num_inference_steps", "2", "--data.batch_size", "1", "--writer.save_arrays", "true",
         "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"]


def build(class_name: str, base: str, folder: Path) -> Path:
    """``class_name`` made of the components of the tiny copy ``base``, saved to ``folder``."""
    import diffusers

    from lightning_diffusion.pipelines import tiny

    pipe = diffusers.DiffusionPipeline.from_pretrained(tiny.resolve(base))
    cls = getattr(diffusers, class_name)
    wanted = inspect.signature(cls.__init__).parameters
    cls(**{k: v for k, v in pipe.components.items() if k in wanted}).save_pretrained(folder)
    return folder


def records(folder: Path, *fields: str) -> Path:
    """Two records, a 32x32 input image (and a mask) each, of prompts of unequal length."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, prompt in enumerate(["a cat", "a lighthouse in a storm at night"]):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")).save(folder / f"image{i}.png")
        Image.fromarray(((rng.random((32, 32)) > 0.5) * 255).astype("uint8")).save(folder / f"mask{i}.png")
        lines.append({"prompt": prompt, **{f: f"{f.split('_')[0]}{i}.png" for f in fields}})
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def equals_diffusers(model: Path, out: Path, prompts: Path, call: dict, fields: tuple[str, ...]) -> None:
    """Each image of ``out`` equals the pipeline called directly on its record's inputs and seed."""
    from PIL import Image

    from lightning_diffusion.pipelines import bare

    arrays, pipe = load_arrays(out), bare.load(str(model))
    for line in read_manifest_lines(out):
        given = {key: Image.open(prompts.parent / Path(line["inputs"][key]["file"]).name).convert(
            "L" if key == "mask_image" else "RGB") for key in fields}
        output = bare.call(pipe, [line["prompt"]], [line["seed"]], num_inference_steps=2, output_type="np",
                           **call, **given)
        direct = np.asarray(getattr(output, "frames" if "num_frames" in call else "images"), dtype=np.float32)[0]
        assert np.array_equal(direct, arrays[line["index"]]), f"{model.name} image {line['index']}"


def against_one_process(common: list[str], out: Path, strategy: str) -> float:
    """``common`` run by one process and by two under ``strategy``: the largest difference between
    their images (``worst_difference``), which must be the same ones."""
    run_here(*common, "--writer.output_dir", str(out / "one"))
    run_cli(*common, "--writer.output_dir", str(out / "two"), "--trainer.devices", "2", "--trainer.strategy", strategy)
    return worst_difference(load_arrays(out / "two"), load_arrays(out / "one"))


def test_a_per_token_timestep_the_plan_does_not_split_is_read_from_the_call():
    """LTX image-to-video multiplies the timestep by its conditioning mask in the denoising loop: a
    timestep per token, which LTX's ``_cp_plan`` leaves whole. LTX text-to-video passes one per
    sample; Wan's plan splits its per-token timestep (Wan 2.2); FLUX inpainting's mask reaches only
    the latents, which the plan splits."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive
    from lightning_diffusion.pipelines.specs import spec_for
    from lightning_diffusion.strategies.checks import context_modes

    def facts(pipeline: str, transformer: str):
        return derive(getattr(diffusers, pipeline), {"transformer": ["diffusers", transformer]}, {})

    i2v = facts("LTXImageToVideoPipeline", "LTXVideoTransformer3DModel")
    assert i2v.unsplit_per_token == (("transformer", "timestep", "conditioning_mask"),)
    assert context_modes(spec_for("LTXImageToVideoPipeline"), i2v) == ()
    assert facts("LTXConditionPipeline", "LTXVideoTransformer3DModel").unsplit_per_token
    for pipeline, transformer in [("LTXPipeline", "LTXVideoTransformer3DModel"),
                                  ("WanPipeline", "WanTransformer3DModel"),
                                  ("FluxInpaintPipeline", "FluxTransformer2DModel")]:
        found = facts(pipeline, transformer)
        assert found.unsplit_per_token == () and context_modes(spec_for(pipeline), found), pipeline


def test_a_text_padded_to_each_batchs_longest_prompt_is_read_from_the_pipeline():
    """Qwen-Image's task pipelines tokenize with ``padding=True`` as the registered Qwen-Image does:
    their context parallelism is the registered one's (Ulysses-anything of degree 2 only), whatever
    the registry says of them. FLUX.1, Wan and LTX pad to a fixed ``max_sequence_length``."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive
    from lightning_diffusion.pipelines.specs import spec_for
    from lightning_diffusion.strategies.checks import ULYSSES_ANYTHING_2, context_modes

    qwen = {"transformer": ["diffusers", "QwenImageTransformer2DModel"]}
    for pipeline in ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"):
        found = derive(getattr(diffusers, pipeline), qwen, {})
        assert found.prompt_length_text and context_modes(spec_for(pipeline), found) == (ULYSSES_ANYTHING_2,)
    for pipeline in ("FluxPipeline", "WanPipeline", "LTXPipeline"):
        assert not derive(getattr(diffusers, pipeline), {}, {}).prompt_length_text, pipeline


@pytest.mark.parametrize("class_name, transformer, mode, reason", [
    ("LTXImageToVideoPipeline", "LTXVideoTransformer3DModel", "ulysses",
     "LTXImageToVideoPipeline cannot run under context parallelism: its call passes the transformer a timestep per "
     "latent token (computed from conditioning_mask), which the transformer's _cp_plan in diffusers"),
    ("LTXImageToVideoPipeline", "LTXVideoTransformer3DModel", "ring",
     "LTXImageToVideoPipeline cannot run under context parallelism: its call passes the transformer a timestep"),
    ("QwenImageImg2ImgPipeline", "QwenImageTransformer2DModel", "ulysses",
     "QwenImageImg2ImgPipeline's text tokens have each prompt's own length"),
    ("QwenImageInpaintPipeline", "QwenImageTransformer2DModel", "ulysses",
     "QwenImageInpaintPipeline's text tokens have each prompt's own length"),
    ("LTXPipeline", "LTXVideoTransformer3DModel", "ulysses_anything",
     "LTXPipeline: its transformer's _cp_plan splits the text attention mask (transformer.encoder_attention_mask) "
     "with the sequence, and in diffusers"),
])
def test_context_parallelism_this_call_cannot_follow_is_refused_before_weights(class_name, transformer, mode, reason,
                                                                               tmp_path, cli_here):
    """Configs-only folders (no weight: each refusal must come first), a record with an image (and
    a mask) each, on 2 ranks."""
    fields = {"LTXPipeline": (), "QwenImageInpaintPipeline": ("image", "mask_image")}.get(class_name, ("image",))
    scheduler = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    folder = _model_folder(tmp_path / "model", class_name, {"transformer": ["diffusers", transformer],
                                                            "scheduler": scheduler})
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4}))
    prompts = records(tmp_path / "inputs", *fields)
    video = ["--model.num_frames", "9"] if "LTX" in class_name else []
    proc = cli_here("predict", "--model.pretrained_model_name_or_path", str(folder), *video, "--model.height", "64",
                    "--model.width", "64", "--data.prompts", str(prompts), "--writer.output_dir", str(tmp_path / "out"),
                    *STEPS, "--trainer.devices", "2", "--trainer.strategy", mode)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and reason in proc.stderr, text[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text and not (tmp_path / "out").exists(), text[-3000:]
    if mode == "ulysses_anything":  # degree 2: not verified with LTX's mask (not the 3-or-more-ranks reason)
        assert "Ulysses-anything is not verified with this transformer's mask" in lines[0], lines[0]
    record(class_name, f"{mode} 2", "refused", lines[0][lines[0].index(class_name) + len(class_name):].lstrip(":' "),
           copy="configs only")


def test_ltx_image_to_video_equals_diffusers_called_directly(tmp_path):
    """LTXImageToVideoPipeline on tiny:ltx's components: each record's image conditions its video,
    byte-identical to diffusers called directly with it."""
    model = build("LTXImageToVideoPipeline", "tiny:ltx", tmp_path / "ltx-i2v")
    prompts = records(tmp_path / "inputs", "image")
    size = ["--model.height", "32", "--model.width", "32", "--model.num_frames", "5"]
    run_here("predict", "--model.pretrained_model_name_or_path", str(model), *size, "--data.prompts", str(prompts),
             "--writer.output_dir", str(tmp_path / "out"), *STEPS)
    equals_diffusers(model, tmp_path / "out", prompts, {"height": 32, "width": 32, "num_frames": 5}, ("image",))
    record("LTXImageToVideoPipeline", "one process", "equal", "byte-identical to diffusers called directly",
           copy="built from tiny:ltx")


@pytest.mark.parametrize("class_name, fields", [("QwenImageImg2ImgPipeline", ("image",)),
                                                ("QwenImageInpaintPipeline", ("image", "mask_image"))])
def test_qwen_image_task_pipelines_equal_diffusers_called_directly(class_name, fields, tmp_path):
    model = build(class_name, "tiny:qwenimage", tmp_path / "model")
    prompts = records(tmp_path / "inputs", *fields)
    run_here("predict", "--model.pretrained_model_name_or_path", str(model), *SIZE, "--data.prompts", str(prompts),
             "--writer.output_dir", str(tmp_path / "out"), *STEPS)
    equals_diffusers(model, tmp_path / "out", prompts, {"height": 32, "width": 32}, fields)
    record(class_name, "one process", "equal", "byte-identical to diffusers called directly",
           copy="built from tiny:qwenimage")


@pytest.mark.slow
def test_qwen_image_img2img_under_ulysses_anything_2_equals_one_process(tmp_path):
    """The prompts' text lengths differ (5 and 32 characters): Ulysses-anything splits each on 2 ranks."""
    model = build("QwenImageImg2ImgPipeline", "tiny:qwenimage", tmp_path / "model")
    prompts = records(tmp_path / "inputs", "image")
    common = ["predict", "--model.pretrained_model_name_or_path", str(model), *SIZE, "--data.prompts", str(prompts),
              *STEPS]
    worst = against_one_process(common, tmp_path, "ulysses_anything")
    assert worst <= ATOL, worst
    record("QwenImageImg2ImgPipeline", "ulysses_anything 2", "equal",
           f"max difference {worst:.1e} (tolerance {ATOL:.0e})", copy="built from tiny:qwenimage")


def build_amused(folder: Path) -> Path:
    """AmusedPipeline (a masked-token pipeline): a one-layer UVit2D over an 8-code VQ-VAE, a CLIP with
    projection; its scheduler draws from ``generator.device``, so its call takes one generator."""
    import torch
    from diffusers import AmusedPipeline, AmusedScheduler, UVit2DModel, VQModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from lightning_diffusion.pipelines.tiny import _char_tokenizer

    torch.manual_seed(0)
    transformer = UVit2DModel(
        hidden_size=8, use_bias=False, hidden_dropout=0.0, cond_embed_dim=8, micro_cond_encode_dim=2,
        micro_cond_embed_dim=10, encoder_hidden_size=8, vocab_size=32, codebook_size=8, in_channels=8,
        block_out_channels=8, num_res_blocks=1, downsample=True, upsample=True, block_num_heads=1, num_hidden_layers=1,
        num_attention_heads=1, attention_dropout=0.0, intermediate_size=8, layer_norm_eps=1e-06,
        ln_elementwise_affine=True)
    vqvae = VQModel(act_fn="silu", block_out_channels=[8], down_block_types=["DownEncoderBlock2D"], in_channels=3,
                    latent_channels=8, layers_per_block=1, norm_num_groups=8, num_vq_embeddings=8, out_channels=3,
                    sample_size=8, up_block_types=["UpDecoderBlock2D"], mid_block_add_attention=False,
                    lookup_from_codebook=True)
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=8, intermediate_size=8, num_attention_heads=1, num_hidden_layers=1,
        pad_token_id=1, vocab_size=128, projection_dim=8))
    AmusedPipeline(vqvae=vqvae, tokenizer=_char_tokenizer(77), text_encoder=text_encoder, transformer=transformer,
                   scheduler=AmusedScheduler(mask_token_id=31)).save_pretrained(folder)
    return folder


def test_a_call_that_takes_one_prompt_or_one_generator_is_read_from_its_signature():
    """Wan VACE refuses a list of prompts in its ``__call__``; aMUSEd's generator annotation admits no
    list (its scheduler reads ``generator.device``). Both are called one record a time; FLUX.1 and
    Qwen-Image take lists."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive
    from lightning_diffusion.pipelines.specs import spec_for

    for pipeline, single in [("WanVACEPipeline", ("prompt",)), ("AmusedPipeline", ("generator",)),
                             ("FluxPipeline", ()), ("QwenImagePipeline", ())]:
        facts = derive(getattr(diffusers, pipeline), {}, {})
        assert facts.single_items == single, pipeline
        assert spec_for(pipeline).resolved(facts).call_batch == (1 if single else spec_for(pipeline).call_batch)


def test_a_pipeline_that_takes_one_generator_is_called_one_record_at_a_time_and_equals_diffusers(tmp_path):
    """aMUSEd with batch size 2 over 3 prompts: each image byte-identical to the pipeline called
    directly with its prompt and one generator seeded with its seed (a list of generators fails in
    its scheduler after the weights load)."""
    import torch
    from diffusers import AmusedPipeline

    model = build_amused(tmp_path / "amused")
    run = run_here("predict", "--model.pretrained_model_name_or_path", str(model), "--model.height", "32",
                   "--model.width", "32", "--data.prompts", "[a cat, a lighthouse in a storm, a fox]",
                   "--writer.output_dir", str(tmp_path / "out"), *STEPS, "--data.batch_size", "2")
    assert "0 padded" in run.stdout + run.stderr  # one record a call: the plan counts no padding it never computes
    arrays, pipe = load_arrays(tmp_path / "out"), AmusedPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    lines = read_manifest_lines(tmp_path / "out")
    assert len(lines) == 3
    for line in lines:
        with torch.inference_mode():
            direct = pipe(prompt=line["prompt"], generator=torch.Generator("cpu").manual_seed(line["seed"]), height=32,
                          width=32, num_inference_steps=2, output_type="np").images[0]
        assert np.array_equal(np.asarray(direct, dtype=np.float32), arrays[line["index"]]), line["index"]
    record("AmusedPipeline", "one process", "equal", "byte-identical to diffusers called directly (one record a call)",
           copy="built in the test")


def test_a_size_the_pipeline_would_round_to_its_own_multiple_is_refused_before_weights(tmp_path, cli_here):
    """Kandinsky 3 rounds height and width up to multiples of 64 (``downscale_height_and_width(height,
    width, 8)``), though its MoVQ compresses 8x: 72 would make 128; refused before weights naming 64."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive

    assert derive(diffusers.Kandinsky3Pipeline, {}, {}).rounds_to == 64
    assert derive(diffusers.StableDiffusionPipeline, {}, {}).rounds_to is None
    folder = _model_folder(tmp_path / "model", "Kandinsky3Pipeline", {"unet": ["diffusers", "Kandinsky3UNet"],
                                                                      "movq": ["diffusers", "VQModel"]})
    (folder / "movq" / "config.json").write_text(json.dumps({"_class_name": "VQModel",
                                                             "block_out_channels": [128, 256, 256, 512]}))
    proc = cli_here("predict", "--model.pretrained_model_name_or_path", str(folder), "--model.height", "72",
                    "--model.width", "64", "--data.prompts", "[a red circle]", "--writer.output_dir",
                    str(tmp_path / "out"), *STEPS)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().endswith("height=72 cannot be made by Kandinsky3Pipeline: use a positive multiple of 64 "
                                        "(for example 64)."), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    record("Kandinsky3Pipeline", "one process", "refused", "a size off the multiple of 64 its call rounds sizes up to",
           copy="configs only")


def test_a_record_without_the_picture_the_call_uses_unasked_is_refused_before_weights(tmp_path, cli_here):
    """LTX image-to-video's ``image`` defaults to None, but its call encodes it without a test for
    None (it would fail after the weights load): a record without one is refused, by its line."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive

    assert derive(diffusers.LTXImageToVideoPipeline, {}, {}).needed_inputs == ("image",)
    assert derive(diffusers.FluxKontextPipeline, {}, {}).needed_inputs == ()  # it tests for None: optional
    folder = _model_folder(tmp_path / "model", "LTXImageToVideoPipeline",
                           {"transformer": ["diffusers", "LTXVideoTransformer3DModel"]})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fox"}) + "\n")
    proc = cli_here("predict", "--model.pretrained_model_name_or_path", str(folder), "--model.height", "64",
                    "--model.width", "64", "--model.num_frames", "9", "--data.prompts", str(prompts),
                    "--writer.output_dir", str(tmp_path / "out"), *STEPS)
    assert proc.returncode == 2, proc.stderr
    assert "p.jsonl:1: it has no image, which LTXImageToVideoPipeline needs" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_component_class_this_environment_lacks_is_refused_before_weights(tmp_path, cli_here):
    """A folder saved by another transformers names a text encoder class this one lacks: refused
    before any weight in one line naming it (the load would end in a traceback)."""
    folder = _model_folder(tmp_path / "model", "StableDiffusionPipeline",
                           {"unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
                            "text_encoder": ["transformers", "CLIPTextModelFromTheFuture"],
                            "tokenizer": ["transformers", "CLIPTokenizer"],
                            "scheduler": ["diffusers", "PNDMScheduler"], "safety_checker": [None, None],
                            "feature_extractor": [None, None]})
    proc = cli_here("predict", "--model.pretrained_model_name_or_path", str(folder), "--model.height", "64",
                    "--model.width", "64", "--data.prompts", "[a red circle]", "--writer.output_dir",
                    str(tmp_path / "out"), *STEPS)
    assert proc.returncode == 2, proc.stderr
    assert ("StableDiffusionPipeline's text_encoder is transformers.CLIPTextModelFromTheFuture, which transformers "
            in proc.stderr), proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr and not (tmp_path / "out").exists(), proc.stderr


@pytest.mark.slow
def test_a_pipeline_called_one_record_at_a_time_gives_the_same_bytes_over_two_replicas(tmp_path):
    """aMUSEd over data_parallel 2 (each replica calls it one record at a time, batch size 2): the
    bytes of one process."""
    model = build_amused(tmp_path / "amused")
    common = ["predict", "--model.pretrained_model_name_or_path", str(model), "--model.height", "32", "--model.width",
              "32", "--data.prompts", "[a cat, a lighthouse in a storm, a fox]", *STEPS, "--data.batch_size", "2"]
    assert against_one_process(common, tmp_path, "data_parallel") == 0
    assert sorted(load_arrays(tmp_path / "two")) == [0, 1, 2]
    record("AmusedPipeline", "data_parallel 2", "equal", "byte-identical to one process", copy="built in the test")


@pytest.mark.slow
@pytest.mark.parametrize("class_name, base, extra", [
    ("LTXImageToVideoPipeline", "tiny:ltx", ["--model.height", "32", "--model.width", "32", "--model.num_frames", "5"]),
    ("QwenImageImg2ImgPipeline", "tiny:qwenimage", ["--model.height", "32", "--model.width", "32"]),
])
def test_task_pipelines_built_from_tiny_copies_give_the_same_bytes_over_two_replicas(class_name, base, extra, tmp_path):
    model = build(class_name, base, tmp_path / "model")
    prompts = records(tmp_path / "inputs", "image")
    common = ["predict", "--model.pretrained_model_name_or_path", str(model), *extra, "--data.prompts", str(prompts),
              *STEPS]
    assert against_one_process(common, tmp_path, "data_parallel") == 0
    assert sorted(load_arrays(tmp_path / "two")) == [0, 1]
    record(class_name, "data_parallel 2", "equal", "byte-identical to one process", copy=f"built from {base}")


@pytest.mark.slow
def test_flux_inpainting_under_ulysses_2_equals_one_process(tmp_path):
    """FLUX.1's inpainting (tiny:flux, ``model.pipeline_class``): its mask and masked image blend the
    latents between steps and reach the transformer only inside its hidden states, which the plan
    splits; two records of unequal prompts in one call, on 2 ranks (tolerance 1e-5 on float pixels)."""
    prompts = records(tmp_path / "inputs", "image", "mask_image")
    common = ["predict", "--config", "configs/tiny-flux.yaml", "--model.pipeline_class", "FluxInpaintPipeline",
              "--data.prompts", str(prompts), *STEPS, "--data.batch_size", "2"]
    worst = against_one_process(common, tmp_path, "ulysses")
    assert worst <= ATOL, worst
    assert sorted(load_arrays(tmp_path / "two")) == [0, 1]
    record("FluxInpaintPipeline", "ulysses 2", "equal", f"max difference {worst:.1e} (tolerance {ATOL:.0e})",
           copy="tiny:flux")
