"""Pipelines the registry does not describe run on what is read from their classes and configs.

Tiny random copies of 20 pipelines (``tiny_zoo``: StableDiffusionXL, StableDiffusion3, FLUX.2,
LTX-Video, CogVideoX, and in the slow tier SD 1.5 with its image-to-image, inpainting and ControlNet
pipelines, Sana, PixArt-alpha and -sigma, HunyuanDiT, AuraFlow, Lumina2, Chroma, CogView4, Mochi,
HunyuanVideo, Latte): one process byte-identical to diffusers called directly with the manifest's
seeds (and each record's input images); 2 replicas byte-identical to one process (the first five);
each context- or tensor-parallel mode that the transformer's diffusers plans allow equal to one
process within ATOL, or refused before any weight loads with the reason. Every pipeline class
diffusers exports is derived without weights.

Each outcome is appended to ``$LIGHTNING_DIFFUSION_PIPELINE_RESULTS`` (a JSON-lines file) when it
is set; ``scripts/pipeline-table`` turns that file into the table of docs/pipelines.md.

Tolerance: ATOL 1e-5 on decoded float images (0..1), as the other context-parallel tests (their
measured differences are about 1e-6).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, worst_difference

ATOL = 1e-5
PROMPTS = "[a cat on a mat, a lighthouse in a storm]"
SIZE = ["--model.height", "32", "--model.width", "32"]
NO_PLANS = {"ulysses": "has no model with a context-parallel plan",
            "tensor_parallel": "has no model with a tensor-parallel plan"}
# The copies added after the first five: no replicas (data parallelism does not look inside the
# pipeline), and their runs in the slow tier (the developer loop keeps the first five).
LATER = {"replicas": False, "slow": True, "refused": NO_PLANS}
# Sana's, PixArt's and HunyuanDiT's calls resize to their trained aspect ratios unless told not to.
NO_BINNING = ["--model.call_kwargs.use_resolution_binning", "false"]
# Per tiny pipeline: its size (and frames), a shorter text where the default pads far, the
# model-parallel modes its transformer's plans allow ("parity") or that are refused ("refused"),
# and the input files each record carries ("inputs").
PIPELINES = {
    "sdxl": {"args": SIZE, "class": "StableDiffusionXLPipeline", "refused": NO_PLANS},
    "sd3": {"args": SIZE, "class": "StableDiffusion3Pipeline", "refused": NO_PLANS},
    "flux2": {"args": [*SIZE, "--model.call_kwargs.max_sequence_length", "32"], "class": "Flux2Pipeline",
              "parity": ["ulysses", "ring", "tensor_parallel"]},
    "ltx": {"args": [*SIZE, "--model.num_frames", "5"], "class": "LTXPipeline", "parity": ["ulysses"],
            "refused": {"ring": "ring attention applies each rank's mask to every key/value block",
                        "tensor_parallel": "has no model with a tensor-parallel plan"}},
    "cogvideox": {"args": [*SIZE, "--model.num_frames", "5", "--model.call_kwargs.max_sequence_length", "16"],
                  "class": "CogVideoXPipeline", "refused": NO_PLANS},
    "sd15": {"args": SIZE, "class": "StableDiffusionPipeline", **LATER},
    "sd15-img2img": {"args": [], "class": "StableDiffusionImg2ImgPipeline", "inputs": ("image",), **LATER},
    "sd15-inpaint": {"args": SIZE, "class": "StableDiffusionInpaintPipeline", "inputs": ("image", "mask_image"),
                     **LATER},
    "sd15-controlnet": {"args": SIZE, "class": "StableDiffusionControlNetPipeline", "inputs": ("image",), **LATER},
    "sana": {"args": [*SIZE, *NO_BINNING], "class": "SanaPipeline", **LATER},
    "pixart-alpha": {"args": [*SIZE, *NO_BINNING], "class": "PixArtAlphaPipeline", **LATER},
    "pixart-sigma": {"args": [*SIZE, *NO_BINNING], "class": "PixArtSigmaPipeline", **LATER},
    "hunyuandit": {"args": [*SIZE, *NO_BINNING], "class": "HunyuanDiTPipeline", **LATER},
    "auraflow": {"args": SIZE, "class": "AuraFlowPipeline", **LATER},
    "lumina2": {"args": SIZE, "class": "Lumina2Pipeline", **LATER},
    "chroma": {"args": SIZE, "class": "ChromaPipeline", **LATER},
    "cogview4": {"args": SIZE, "class": "CogView4Pipeline", **LATER},
    "mochi": {"args": [*SIZE, "--model.num_frames", "7"], "class": "MochiPipeline", **LATER},
    "hunyuanvideo": {"args": [*SIZE, "--model.num_frames", "5"], "class": "HunyuanVideoPipeline", **LATER},
    # Latte's frame argument is video_length (16 frames in its tiny copy): a video to the writer
    "latte": {"args": SIZE, "class": "LattePipeline", "frames": True, **LATER},
}
# A size each pipeline cannot take, and the multiple its refusal names (an image-to-image call takes
# its input's size: none).
BAD_SIZES = {"sdxl": ("34", "4"), "sd3": ("40", "16"), "flux2": ("40", "16"), "ltx": ("34", "4"),
             "cogvideox": ("40", "16"), "sd15": ("34", "4"), "sd15-inpaint": ("34", "4"),
             "sd15-controlnet": ("34", "4"), "sana": ("34", "4"), "pixart-alpha": ("34", "8"),
             "pixart-sigma": ("34", "8"), "hunyuandit": ("40", "16"), "auraflow": ("34", "8"),
             "lumina2": ("40", "16"), "chroma": ("40", "16"), "cogview4": ("34", "8"), "mochi": ("40", "16"),
             "hunyuanvideo": ("34", "8"), "latte": ("34", "8")}


def tiers(names: list[str]) -> list:
    """``names`` as parameters, the later copies' in the slow tier."""
    return [pytest.param(name, marks=pytest.mark.slow) if PIPELINES[name].get("slow") else name for name in names]


def call_args(name: str) -> dict:
    """The call ``predict_args`` makes, as diffusers called directly takes it."""
    import yaml

    args = PIPELINES[name]["args"]
    call = {"num_inference_steps": 2, "output_type": "np"}
    for flag, value in zip(args, args[1:]):
        if flag in ("--model.height", "--model.width", "--model.num_frames"):
            call[flag.rsplit(".", 1)[1]] = int(value)
        elif flag.startswith("--model.call_kwargs."):
            call[flag.rsplit(".", 1)[1]] = yaml.safe_load(value)
    return call


def write_inputs(folder: Path) -> dict[str, Path]:
    """32x32 input images and masks of two records, and the records of each kind of input."""
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")).save(folder / f"image{i}.png")
        Image.fromarray(((rng.random((32, 32)) > 0.5) * 255).astype("uint8")).save(folder / f"mask{i}.png")
    files = {}
    for inputs in {spec["inputs"] for spec in PIPELINES.values() if "inputs" in spec}:
        path = folder / f"{'-'.join(inputs)}.jsonl"
        path.write_text("".join(json.dumps({"prompt": prompt, **{name: f"{name.split('_')[0]}{i}.png"
                                                                 for name in inputs}}) + "\n"
                                for i, prompt in enumerate(["a cat on a mat", "a lighthouse in a storm"])))
        files["-".join(inputs)] = path
    return files


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("inputs"))


def record(pipeline: str, strategy: str, outcome: str, detail: str = "", copy: str = "") -> None:
    """Append one tested outcome for ``scripts/pipeline_table.py``: ``pipeline`` is a tiny copy's name
    in ``PIPELINES``, or a pipeline class tested from its configs alone (``copy`` says so)."""
    target = os.environ.get("LIGHTNING_DIFFUSION_PIPELINE_RESULTS")
    if target:
        known = PIPELINES.get(pipeline)
        with open(target, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pipeline": known["class"] if known else pipeline,
                                "tiny": f"tiny:{pipeline}" if known else copy,
                                "strategy": strategy, "outcome": outcome, "detail": detail}) + "\n")


def predict_args(name: str, out: Path, *extra: str, inputs: Optional[dict[str, Path]] = None) -> list[str]:
    """``predict`` of tiny:NAME into ``out``; ``inputs``: the records files of ``write_inputs`` (for a
    pipeline whose records carry input images)."""
    needed = PIPELINES[name].get("inputs")
    prompts = str(inputs["-".join(needed)]) if needed and inputs else PROMPTS
    return ["predict", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--model.pretrained_model_name_or_path", f"tiny:{name}", "--model.num_inference_steps", "2",
            *PIPELINES[name]["args"], "--data.prompts", prompts,
            "--data.batch_size", "1", "--writer.output_dir", str(out), "--writer.save_arrays", "true",
            "--trainer.enable_progress_bar", "false", *extra]


@pytest.fixture(scope="module")
def references(tmp_path_factory, inputs):
    """One-process runs of every tiny pipeline, made once for the module."""
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(f"{name}-one-process")
            run_here(*predict_args(name, out, inputs=inputs))
            made[name] = out
        return made[name]

    return get


@pytest.mark.parametrize("name", tiers(list(PIPELINES)))
def test_one_process_equals_diffusers_called_directly(name, references, inputs):
    from PIL import Image

    from lightning_diffusion.pipelines import bare

    out = references(name)
    lines = read_manifest_lines(out)
    arrays = load_arrays(out)
    pipe = bare.load(f"tiny:{name}")
    call = call_args(name)
    video = "num_frames" in call or PIPELINES[name].get("frames", False)
    folder = next(iter(inputs.values())).parent
    for line in lines:
        given = {key: Image.open(folder / Path(line["inputs"][key]["file"]).name).convert(
            "L" if key == "mask_image" else "RGB") for key in PIPELINES[name].get("inputs", ())}
        output = bare.call(pipe, [line["prompt"]], [line["seed"]], **call, **given)
        direct = np.asarray(output.frames if video else output.images, dtype=np.float32)[0]
        assert np.array_equal(direct, arrays[line["index"]]), f"{name} image {line['index']}"
    assert all(line["file"].endswith(".mp4" if video else ".png") for line in lines)
    if video:  # the frames the pipeline made (CogVideoX's VAE makes its own count), recorded as made
        assert all(line["num_frames"] == arrays[line["index"]].shape[0] > 1 for line in lines)
    record(name, "one process", "equal", "byte-identical to diffusers called directly")


@pytest.mark.parametrize("name", tiers(list(BAD_SIZES)))
def test_a_size_the_pipeline_cannot_take_is_refused_before_weights(name, tmp_path, inputs):
    size, multiple = BAD_SIZES[name]
    proc = run_here(*predict_args(name, tmp_path / "out", "--model.height", size, inputs=inputs), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"height={size} cannot be made by {PIPELINES[name]['class']}: use a positive multiple of {multiple}" in (
        proc.stdout + proc.stderr)
    assert not (tmp_path / "out" / "manifest.jsonl").exists()


# Data parallelism does not look inside the pipeline (each replica calls it on its own images with
# their own seeds): held to one process on the first five copies (``replicas``), not on each new one.
REPLICATED = [name for name, spec in PIPELINES.items() if spec.get("replicas", True)]


@pytest.mark.slow
@pytest.mark.parametrize("name", REPLICATED)
def test_two_replicas_equal_one_process(name, references, tmp_path):
    reference = load_arrays(references(name))
    run_cli(*predict_args(name, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "data_parallel"))
    arrays = load_arrays(tmp_path)
    assert arrays.keys() == reference.keys()
    for index in reference:
        assert np.array_equal(arrays[index], reference[index]), f"{name} image {index}"
    record(name, "data_parallel 2", "equal", "byte-identical to one process")


PARITY = [(name, mode) for name, spec in PIPELINES.items() for mode in spec.get("parity", [])]
REFUSED = [(name, mode) for name, spec in PIPELINES.items() for mode in spec.get("refused", {})]


@pytest.mark.parametrize("name, mode", [pytest.param(name, mode, marks=[pytest.mark.slow] * bool(
    PIPELINES[name].get("slow")), id=f"{name}-{mode}") for name, mode in REFUSED])
def test_a_plan_the_pipeline_cannot_follow_is_refused_before_weights(name, mode, tmp_path, cli_here, inputs):
    """Refused in the launching process, before any rank starts or any weight loads."""
    proc = cli_here(*predict_args(name, tmp_path, "--trainer.devices", "2", "--trainer.strategy", mode,
                                  inputs=inputs))
    text = proc.stdout + proc.stderr
    reason = PIPELINES[name]["refused"][mode]
    assert proc.returncode == 2 and reason in text, text[-3000:]
    assert "Loading" not in text and not (tmp_path / "manifest.jsonl").exists()  # before any weight
    line = next(line for line in text.splitlines() if reason in line)
    record(name, f"{mode} 2", "refused", line.split(": ", 2)[-1].strip())


@pytest.mark.slow
@pytest.mark.parametrize("name, mode", PARITY, ids=[f"{name}-{mode}" for name, mode in PARITY])
def test_each_plan_the_transformer_has_runs_with_parity(name, mode, references, tmp_path):
    reference = load_arrays(references(name))
    run_cli(*predict_args(name, tmp_path, "--trainer.devices", "2", "--trainer.strategy", mode))
    worst = worst_difference(load_arrays(tmp_path), reference)
    assert worst <= ATOL, f"{name} under {mode}: {worst}"
    record(name, f"{mode} 2", "equal", f"max difference {worst:.1e} (tolerance {ATOL:.0e})")


def test_every_diffusers_pipeline_class_is_derived_without_weights():
    """Each pipeline class diffusers exports says what it outputs (pictures or frames), or why it is
    not a pipeline of pictures (audio, embeddings, a combined pipeline that calls others)."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive

    classes = sorted({cls for name in dir(diffusers) if "Pipeline" in name
                      for cls in [getattr(diffusers, name)]
                      if isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)
                      and cls is not diffusers.DiffusionPipeline}, key=lambda c: c.__name__)
    assert len(classes) > 200
    outputs = {}
    for cls in classes:
        facts = derive(cls, {}, {})
        assert (facts.output in ("images", "frames", "image")) != (facts.why_not is not None), cls.__name__
        outputs[cls.__name__] = facts
    assert outputs["LTXPipeline"].output == "frames" and outputs["LTXPipeline"].frames_arg == "num_frames"
    assert outputs["StableDiffusion3Pipeline"].output == "images"
    assert outputs["FluxPipeline"].text_length_max == 512 and outputs["QwenImagePipeline"].text_length_max == 1024
    assert "audios" in outputs["AudioLDMPipeline"].why_not
    assert sum(f.output is not None for f in outputs.values()) > 0.85 * len(classes)  # 260 of 293 in 0.42.1


def test_derived_facts_agree_with_the_registry():
    """A fact a registry entry sets must be the one the pipeline itself says, where it says one."""
    from lightning_diffusion.pipelines import specs, tiny
    from lightning_diffusion.pipelines.model_folder import inspect_pipeline

    checked = 0
    for name in [n for n in tiny.names() if n != "tiny:shapes"]:
        info = inspect_pipeline(name)
        entry, facts = specs.spec_for(info.class_name), info.facts
        pairs = {"patch": (entry.patch, facts.patch), "vae_scale": (entry.vae_scale, facts.spatial),
                 "output": (entry.output, facts.output), "frames_arg": (entry.frames_arg, facts.frames_arg),
                 "temporal_scale": (entry.temporal_scale, facts.temporal if facts.frames_arg else None),
                 "default_frames": (entry.default_frames, facts.default_frames),
                 "text_length_max": (entry.text_length_max, facts.text_length_max)}
        for fact, (registered, derived) in pairs.items():
            if registered is not None and derived is not None:
                assert registered == derived, f"{info.class_name}.{fact}: registry {registered}, derived {derived}"
                checked += 1
    assert checked >= 20


def test_plan_counts_tokens_from_the_derived_geometry_and_recommends_what_predict_runs(tiny_cache):
    from lightning_diffusion.commands.plan import choose, facts_for, tokens
    from lightning_diffusion.pipelines import tiny

    sd3 = facts_for(tiny.resolve("tiny:sd3"))
    assert tokens(sd3, 1024, 1024, None) - sd3.text_tokens == 64 * 64  # 8x VAE, 2x2 patches: 4,096 tokens
    ltx = facts_for(tiny.resolve("tiny:ltx"))
    assert ltx.context == ("ulysses",) and not ltx.tensor
    assert sd3.context == () and not sd3.tensor
    # A long sequence with the latency goal: context parallelism only where predict runs it.
    for facts in (sd3, ltx):
        plan = choose(facts, 4, 80, "nvlink", 4096, 4096, None, 1, "latency")
        if facts is sd3:
            assert plan.strategy == "data_parallel", plan
        else:
            assert plan.strategy == "ContextParallelStrategy" and plan.init_args["ring_degree"] == 1, plan
    # Over 8 GPUs LTX's 4 heads would need ring for the rest, which its text mask rules out.
    assert choose(ltx, 8, 80, "nvlink", 4096, 4096, None, 1, "latency").strategy == "data_parallel"


@pytest.mark.slow
def test_a_failed_pipeline_call_is_one_line_and_its_traceback_with_verbose(tmp_path):
    """tiny:cogvideox's positional table holds 16 text tokens; CogVideoX pads the text to 226 by
    default, which fails inside the transformer after the weights load."""
    args = [a for a in predict_args("cogvideox", tmp_path / "a") if a not in ("--model.call_kwargs.max_sequence_length",
                                                                              "16")]
    proc = run_cli(*args, check=False)
    assert proc.returncode == 1
    assert "lightning-diffusion: error: image 0 (inline prompts:1) failed: RuntimeError: The size of tensor a" in (
        proc.stderr)
    assert "Traceback" not in proc.stderr and "run again with --verbose" in proc.stderr
    args[args.index(str(tmp_path / "a"))] = str(tmp_path / "b")
    proc = run_cli("--verbose", *args, check=False)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "cogvideox_transformer_3d.py" in proc.stderr
    assert "lightning-diffusion: error: image 0 (inline prompts:1) failed: RuntimeError" in proc.stderr


def _model_folder(folder: Path, class_name: str, components: dict) -> Path:
    """A model folder of ``class_name`` as far as the checks before loading read it: its
    ``model_index.json`` and the components' configs (no weight: each refusal must come first)."""
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name, "_diffusers_version": "0.42.1",
                                                         **components}))
    for name, (library, cls) in components.items():
        if library == "diffusers":
            (folder / name).mkdir()
            (folder / name / "config.json").write_text(json.dumps({"_class_name": cls}))
    return folder


@pytest.mark.parametrize("class_name, components, message", [
    ("KandinskyV22PriorPipeline", {"prior": ["diffusers", "PriorTransformer"]},
     "KandinskyV22PriorPipeline makes no pictures: its output (KandinskyPriorPipelineOutput) holds image_embeds, "
     "negative_image_embeds, not images or frames."),
    ("KandinskyV22Pipeline", {"unet": ["diffusers", "UNet2DConditionModel"]},
     "KandinskyV22Pipeline takes no prompt (its __call__ has no prompt argument): it is a stage of a larger "
     "pipeline; run the pipeline that makes pictures from prompts."),
    ("KandinskyV22Pipeline", {"unet": ["diffusers", "UNet2DConditionModel"]},
     "KandinskyV22Pipeline needs image_embeds, negative_image_embeds (no default), which neither the config nor "
     "a prompt record can give."),
    ("HeliosPipeline", {"transformer": ["diffusers", "HeliosTransformer3DModel"]},
     "HeliosPipeline needs the package ftfy, which is not installed: pip install ftfy."),
    ("DDPMPipeline", {"unet": ["diffusers", "UNet2DModel"]},
     "DDPMPipeline takes no prompt (its __call__ has no prompt argument): it makes pictures without a prompt "
     "(unconditional), and a run makes one picture per prompt."),
    ("AudioLDMPipeline", {"unet": ["diffusers", "UNet2DConditionModel"]},
     "AudioLDMPipeline makes no pictures: its output (AudioPipelineOutput) holds audios, not images or frames."),
    ("StableCascadePriorPipeline", {"prior": ["diffusers", "StableCascadeUNet"]},
     "StableCascadePriorPipeline makes no pictures"),
    # A class diffusers exports as a placeholder without its package: the package and its install line.
    ("KolorsPipeline", {"unet": ["diffusers", "UNet2DConditionModel"]},
     "KolorsPipeline is a pipeline class of diffusers {version} that needs the package sentencepiece, which is not "
     "installed: pip install sentencepiece."),
    ("ConsisIDPipeline", {"transformer": ["diffusers", "ConsisIDTransformer3DModel"]},
     "ConsisIDPipeline is a pipeline class of diffusers {version} that needs the package opencv-python, which is not "
     "installed: pip install opencv-python."),
    # Without a prompt argument: what the call takes instead, not "a stage" or "unconditional".
    ("PaintByExamplePipeline", {"unet": ["diffusers", "UNet2DConditionModel"]},
     "PaintByExamplePipeline takes no prompt (its __call__ has no prompt argument): it makes its output from input "
     "pictures (example_image, image, mask_image), not from a prompt"),
    ("MarigoldDepthPipeline", {"unet": ["diffusers", "UNet2DConditionModel"]},
     "MarigoldDepthPipeline takes no prompt (its __call__ has no prompt argument): it makes its output from input "
     "pictures (image), not from a prompt"),
    ("LDMSuperResolutionPipeline", {"unet": ["diffusers", "UNet2DModel"]},
     "LDMSuperResolutionPipeline takes no prompt (its __call__ has no prompt argument): it makes its output from "
     "input pictures (image), not from a prompt"),
    ("VisualClozePipeline", {"transformer": ["diffusers", "FluxTransformer2DModel"]},
     "VisualClozePipeline takes no prompt (its __call__ has no prompt argument): it takes its text as task_prompt, "
     "content_prompt and input pictures (image)"),
    ("DiTPipeline", {"transformer": ["diffusers", "DiTTransformer2DModel"]},
     "DiTPipeline takes no prompt (its __call__ has no prompt argument): it is conditioned on class_labels, not on a "
     "prompt."),
])
def test_a_pipeline_a_run_cannot_drive_is_refused_before_weights(class_name, components, message, tmp_path,
                                                                 cli_here):
    """Read from the class alone, before any weight: a stage without a prompt, an output without
    pictures, an argument no config or record can give, an optional package the pipeline's module
    uses but that is missing (the call would end in a NameError after loading)."""
    import importlib.util

    import diffusers

    package = {"HeliosPipeline": "ftfy", "KolorsPipeline": "sentencepiece", "ConsisIDPipeline": "cv2"}.get(class_name)
    if package and importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    message = message.format(version=diffusers.__version__)
    folder = _model_folder(tmp_path / "model", class_name, components)
    (tmp_path / "run.yaml").write_text(f"model:\n  pretrained_model_name_or_path: {folder}\n"
                                       "  num_inference_steps: 2\ndata:\n  prompts: '[a red circle]'\n"
                                       f"writer:\n  output_dir: {tmp_path / 'out'}\n")
    proc = cli_here("predict", "--config", str(tmp_path / "run.yaml"), "--trainer.accelerator", "cpu")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    line = next(line for line in proc.stderr.splitlines() if message in line)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [line] or lines[0].endswith(f"{len(lines) - 1} problems:"), proc.stderr  # one line a problem
    record(class_name, "one process", "refused", line[line.index(message) + len(class_name) + 1:], copy="configs only")


@pytest.mark.parametrize("vae, expected", [
    ("AutoencoderDC", (32, 1)),  # Sana's: 2 ** (encoder blocks - 1), not the usual 8
    ("AutoencoderKLMochi", (8, 6)),  # Mochi's: the product of its spatial and temporal expansions
    ("AutoencoderKLLTXVideo", (32, 8)),
    ("AutoencoderKLWan", (8, 4)),
])
def test_a_vaes_compression_is_read_from_its_class_where_its_config_states_none(vae, expected):
    """Sana's and Mochi's VAE configs hold no compression factor: the class computes it in its
    ``__init__`` (read on the meta device, no weight), so sizes, frames and token counts are right."""
    import inspect

    import diffusers

    from lightning_diffusion.pipelines.facts import vae_compression

    cls = getattr(diffusers, vae)
    config = {name: list(p.default) if isinstance(p.default, tuple) else p.default
              for name, p in inspect.signature(cls.__init__).parameters.items()
              if name != "self" and p.default is not p.empty}
    assert vae_compression(cls, config) == expected


@pytest.mark.slow
def test_a_controlnet_pipeline_takes_each_records_control_image_and_equals_diffusers(tmp_path):
    """SDXL ControlNet (tiny): each record's control image (its ``image`` field, the name the
    pipeline's call gives it) conditions its picture, byte-identical to diffusers called directly
    with that image; a record without one is refused before any weight loads."""
    from PIL import Image

    from lightning_diffusion.pipelines import bare

    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")).save(tmp_path / f"control{i}.png")
    records = [{"prompt": "a fox", "image": "control0.png", "seed": 3},
               {"prompt": "a fox", "image": "control1.png", "seed": 3}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["predict", "--config", "configs/tiny-flux.yaml", "--model.pretrained_model_name_or_path",
              "tiny:sdxl-controlnet", "--model.height", "32", "--model.width", "32", "--model.call_kwargs", "{}",
              "--model.num_inference_steps", "2", "--data.batch_size", "1", "--writer.save_arrays", "true"]
    run_here(*common, "--data.prompts", str(tmp_path / "p.jsonl"), "--writer.output_dir", str(tmp_path / "out"))
    arrays = load_arrays(tmp_path / "out")
    pipe = bare.load("tiny:sdxl-controlnet")
    for i, line in enumerate(records):
        control = Image.open(tmp_path / line["image"]).convert("RGB")
        direct = bare.call(pipe, [line["prompt"]], [line["seed"]], image=control, height=32, width=32,
                           num_inference_steps=2, guidance_scale=3.5, output_type="np").images[0]
        assert np.array_equal(np.asarray(direct, dtype=np.float32), arrays[i]), f"image {i}"
    assert not np.array_equal(arrays[0], arrays[1]), "another control image must give another picture"
    record("StableDiffusionXLControlNetPipeline", "one process", "equal", "byte-identical to diffusers called directly",
           copy="tiny:sdxl-controlnet")
    (tmp_path / "bare.jsonl").write_text(json.dumps({"prompt": "no control"}) + "\n")
    proc = run_here(*common, "--data.prompts", str(tmp_path / "bare.jsonl"), "--writer.output_dir",
                    str(tmp_path / "refused"), check=False)
    assert proc.returncode == 2 and ("bare.jsonl:1: it has no image, which StableDiffusionXLControlNetPipeline "
                                     "needs") in proc.stderr, proc.stderr
    assert not (tmp_path / "refused").exists()


def test_a_controlnet_without_a_cp_plan_rules_out_context_parallelism_and_plan_recommends_none():
    """FluxControlNetPipeline: the transformer has a ``_cp_plan``, its ControlNet none; the ControlNet's
    residuals cover the whole sequence, so context parallelism is refused before weights (and
    ``plan`` counts no context-parallel mode for it). FLUX.1 alone keeps Ulysses and ring."""
    import diffusers

    from lightning_diffusion.pipelines.facts import derive
    from lightning_diffusion.pipelines.specs import spec_for
    from lightning_diffusion.strategies.checks import context_modes, context_refusal

    index = {"transformer": ["diffusers", "FluxTransformer2DModel"], "controlnet": ["diffusers", "FluxControlNetModel"],
             "vae": ["diffusers", "AutoencoderKL"]}
    facts = derive(diffusers.FluxControlNetPipeline, index, {})
    spec = spec_for("FluxControlNetPipeline")
    assert facts.cp_plan == ("transformer",) and facts.unsplit_controls == ("controlnet",)
    assert context_modes(spec, facts) == ()
    assert "its controlnet has no _cp_plan" in context_refusal(spec, facts)
    plain = derive(diffusers.FluxPipeline, {k: v for k, v in index.items() if k != "controlnet"}, {})
    assert context_modes(spec_for("FluxPipeline"), plain) == ("ulysses", "ring")


def test_a_cp_plan_naming_layers_the_configured_model_lacks_is_found_without_weights():
    """diffusers' Helios ``_cp_plan`` names blocks 0-39 one by one: a 2-layer model lacks 38 x 3 of
    them (diffusers fails on the first after the weights load). Wildcards (``blocks.*``) and Wan's
    ``blocks.0`` fit any depth."""
    import diffusers

    from lightning_diffusion.strategies.checks import plan_misses

    helios = {"num_layers": 2, "num_attention_heads": 4, "attention_head_dim": 8, "ffn_dim": 32, "text_dim": 32,
              "freq_dim": 32, "rope_dim": (4, 2, 2)}
    missing = plan_misses(diffusers.HeliosTransformer3DModel, helios)
    assert len(missing) == 38 * 3 and "blocks.2.attn1" in missing and "blocks.1.attn1" not in missing
    assert plan_misses(diffusers.HeliosTransformer3DModel, {**helios, "num_layers": 40}) == []
    wan = {"num_layers": 1, "num_attention_heads": 4, "attention_head_dim": 8, "ffn_dim": 32, "text_dim": 32,
           "freq_dim": 32}
    assert plan_misses(diffusers.WanTransformer3DModel, wan) == []


@pytest.mark.parametrize("class_name", ["HeliosPipeline", "ChronoEditPipeline"])
def test_transformers_whose_sequence_the_call_does_not_give_are_refused_context_parallelism(class_name):
    from lightning_diffusion.pipelines.facts import denoiser_facts
    from lightning_diffusion.pipelines.specs import spec_for
    from lightning_diffusion.strategies.checks import context_modes

    spec = spec_for(class_name)
    transformer = class_name.replace("Pipeline", "Transformer3DModel")
    facts = denoiser_facts(class_name, transformer)
    assert facts.cp_plan and spec.cp_refused and context_modes(spec, facts) == ()


def test_flux_controlnet_under_ulysses_is_refused_before_weights_in_one_line(tmp_path, cli_here):
    """Through the CLI: a FluxControlNetPipeline folder (configs only: a refusal must come before
    any weight) with a control image per record, under Ulysses 2."""
    from PIL import Image

    folder = _model_folder(tmp_path / "model", "FluxControlNetPipeline",
                           {"transformer": ["diffusers", "FluxTransformer2DModel"],
                            "controlnet": ["diffusers", "FluxControlNetModel"], "vae": ["diffusers", "AutoencoderKL"],
                            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]})
    Image.new("RGB", (64, 64)).save(tmp_path / "edges.png")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a fox", "control_image": "edges.png"}) + "\n")
    proc = cli_here("predict", "--model.pretrained_model_name_or_path", str(folder), "--model.height", "64",
                    "--model.width", "64", "--model.num_inference_steps", "2", "--data.prompts",
                    str(tmp_path / "p.jsonl"), "--writer.output_dir", str(tmp_path / "out"),
                    "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ulysses")
    assert proc.returncode == 2, proc.stderr
    assert ("FluxControlNetPipeline cannot run under context parallelism: its controlnet has no _cp_plan, and the "
            "residuals it makes over the whole sequence join the transformer's blocks") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    record("FluxControlNetPipeline", "ulysses 2", "refused", "its controlnet has no `_cp_plan`", copy="configs only")


def test_a_video_pipelines_own_default_frame_count_is_accepted_whatever_its_rule():
    """HeliosPipeline's default is 132 frames, made in chunks of 33 (not 4 x k + 1): its own default
    runs; another count off its VAE's 4 x k + 1 rule is refused, naming the default."""
    import diffusers

    from lightning_diffusion.pipelines.model_folder import PipelineInfo

    info = PipelineInfo("helios", "HeliosPipeline", diffusers.HeliosPipeline,
                        {"_class_name": "HeliosPipeline", "vae": ["diffusers", "AutoencoderKLWan"]},
                        configs={"vae": {"temperal_downsample": [False, True, True]}})
    assert info.spec.temporal_scale == 4 and info.spec.default_frames == 132
    assert info.frames_problems(132) == [] and info.frames_problems(33) == []
    assert info.frames_problems(130) == ["num_frames=130 cannot be made by HeliosPipeline: use 4 x k + 1 frames (for "
                                         "example 129, or its default 132)."]


def _helios_request(tmp_path: Path):
    """A ModelRequest for a configs-only 2-layer Helios folder (no weight, no ftfy needed to read it)."""
    import torch

    from lightning_diffusion.contract import ModelRequest
    from lightning_diffusion.pipelines.model_folder import inspect_pipeline

    folder = _model_folder(tmp_path / "helios", "HeliosPipeline",
                           {"transformer": ["diffusers", "HeliosTransformer3DModel"],
                            "vae": ["diffusers", "AutoencoderKLWan"]})
    (folder / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "HeliosTransformer3DModel", "num_layers": 2, "num_attention_heads": 4, "attention_head_dim": 8,
         "ffn_dim": 32, "text_dim": 32, "freq_dim": 32, "rope_dim": [4, 2, 2]}))
    return ModelRequest(inspect_pipeline(str(folder)), torch.float32, {"height": 64, "width": 64})


def test_the_strategy_refuses_context_parallelism_the_registry_or_the_folders_layers_rule_out(tmp_path, monkeypatch):
    """Through the strategy's checks before loading: Helios' ``cp_refused`` in one line; with that
    entry gone, the same 2-layer folder is refused because its plan names blocks 2-39."""
    from lightning_diffusion.pipelines import specs
    from lightning_diffusion.strategies import ContextParallelStrategy

    def problems() -> list[str]:
        return [str(p) for p in ContextParallelStrategy(ulysses_degree=2).check_request(
            _helios_request(tmp_path / str(len(list(tmp_path.iterdir())))), world_size=2, device_type="cpu")]

    assert problems() == ["HeliosPipeline cannot run under context parallelism: its transformer attends to the "
                          "history tokens of the chunks it made before, which the token checks cannot count. Use "
                          "data_parallel."]
    monkeypatch.delitem(specs.SPECS, "HeliosPipeline")
    found = problems()
    assert len(found) == 1 and found[0].startswith(
        "transformer (HeliosTransformer3DModel) lacks modules its _cp_plan in diffusers") and (
        "(blocks.2.attn1, blocks.3.attn1, blocks.4.attn1 and 111 more)" in found[0]), found
