"""Image-conditioned records (first part of the image-conditioned datasets issue): ``image`` and
``mask_image`` paths in prompt records, ``model.pipeline_class`` (FLUX.1's image-to-image and
inpainting pipelines on tiny:flux's weights), input files named with their SHA-256, bad input.

Parity: data parallel 2 and Ulysses 2 against one process with batch size 1, within 1e-5
(measured 1.2e-6 under Ulysses 2), on records whose images have mixed sizes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args
from tests.pipelines.test_any_pipeline import record as record_outcome

ATOL = 1e-5
IMG2IMG = ["--model.pipeline_class", "FluxImg2ImgPipeline"]


def write_inputs(folder: Path) -> Path:
    """Four records over three images (64x64, 64x64, 96x80) and a mask; paths relative to the file."""
    rng = np.random.default_rng(0)
    (folder / "in").mkdir(parents=True, exist_ok=True)
    for name, (w, h) in {"a": (64, 64), "b": (64, 64), "c": (96, 80)}.items():
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(folder / "in" / f"{name}.png")
    Image.fromarray(((rng.random((64, 64)) > 0.5) * 255).astype("uint8")).save(folder / "in" / "mask.png")
    records = [
        {"prompt": "a red fox", "image": "in/a.png", "seed": 7},
        {"prompt": "a red fox", "image": "in/b.png", "seed": 7},  # the same prompt and seed, another image
        {"prompt": "a lighthouse", "image": "in/c.png", "strength": 0.8},
        {"prompt": "a bowl of ramen", "image": "in/b.png"},
    ]
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return prompts


@pytest.fixture(scope="module")
def img2img_reference(tmp_path_factory):
    """One process, batch size 1: (prompt file, output folder)."""
    folder = tmp_path_factory.mktemp("img2img")
    prompts = write_inputs(folder)
    out = folder / "out"
    run_here(*tiny_args(out, "--data.prompts", str(prompts), "--data.batch_size", "1", *IMG2IMG))
    return prompts, out


def test_image_records_condition_each_picture_and_are_named_with_their_sha256(img2img_reference):
    prompts, out = img2img_reference
    images, lines = load_arrays(out), read_manifest_lines(out)
    assert sorted(images) == [0, 1, 2, 3] and all(im.shape == (64, 64, 3) for im in images.values())
    assert not np.allclose(images[0], images[1], atol=1e-3), "another input image must give another picture"
    by_index = {line["index"]: line for line in lines}
    for index, name in [(0, "a"), (1, "b"), (2, "c")]:
        path = prompts.parent / "in" / f"{name}.png"
        assert by_index[index]["inputs"] == {"image": {
            "file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "bytes": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns}}
    assert by_index[2]["strength"] == 0.8 and by_index[0]["pipeline_class"] == "FluxImg2ImgPipeline"
    png = Image.open(out / by_index[0]["file"])
    assert json.loads(png.text["parameters"])["inputs"]["image"]["file"].endswith("in/a.png")
    assert json.loads((out / "run.json").read_text())["model.pipeline_class"] == "FluxImg2ImgPipeline"


def test_inpainting_records_carry_an_image_and_its_mask(tmp_path):
    prompts = write_inputs(tmp_path)
    prompts.write_text(json.dumps({"prompt": "a red fox", "image": "in/a.png", "mask_image": "in/mask.png"}) + "\n")
    run_here(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts), "--model.pipeline_class",
                        "FluxInpaintPipeline"))
    (line,) = read_manifest_lines(tmp_path / "out")
    assert set(line["inputs"]) == {"image", "mask_image"} and line["inputs"]["mask_image"]["file"].endswith("mask.png")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["--trainer.devices", "2"], ["--config", "configs/tiny-ulysses.yaml"]],
                         ids=["data_parallel_2", "ulysses_2"])
def test_image_records_under_data_and_context_parallel_match_one_process(strategy, img2img_reference, tmp_path):
    prompts, reference = img2img_reference
    args = tiny_args(tmp_path, "--data.prompts", str(prompts), "--data.batch_size", "2", *IMG2IMG)
    if strategy[0] == "--config":
        args[args.index("--config") + 1] = strategy[1]
    else:
        args += strategy
    run_cli(*args, timeout=600)
    ours, ref = load_arrays(tmp_path), load_arrays(reference)
    assert sorted(ours) == sorted(ref) == [0, 1, 2, 3]
    for i in ref:
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


def test_bad_image_records_are_refused_together_before_loading(tmp_path, cli_here):
    write_inputs(tmp_path)
    (tmp_path / "in" / "text.png").write_text("not an image")
    Image.open(tmp_path / "in" / "a.png").save(tmp_path / "in" / "whole.png")
    (tmp_path / "in" / "cut.png").write_bytes((tmp_path / "in" / "whole.png").read_bytes()[:200])
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "x", "image": "in/missing.png", "mask_image": "in/mask.png"},
        {"prompt": "x", "image": "in/text.png", "mask_image": "in/mask.png", "strength": 1.5},
        {"prompt": "x", "image": "in/c.png", "mask_image": "in/mask.png"},
        {"prompt": "x", "image": "in/cut.png", "mask_image": "in/mask.png"},
        {"prompt": "x", "mask_image": "in/mask.png"},
    ]) + "\n")
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts), "--model.pipeline_class",
                               "FluxInpaintPipeline"))
    assert proc.returncode == 2, proc.stderr
    for message in ["bad.jsonl:5: it has no image, which FluxInpaintPipeline needs",
                    f"bad.jsonl:1: image {tmp_path}/in/missing.png does not exist",
                    f"bad.jsonl:2: strength must be in (0, 1], got 1.5. image {tmp_path}/in/text.png is not a "
                    "readable image",
                    "bad.jsonl:3: mask_image is 64x64 and image 96x80; a mask must have its image's size",
                    f"bad.jsonl:4: image {tmp_path}/in/cut.png is not a readable image"]:
        assert message in proc.stderr, (message, proc.stderr)
    assert not (tmp_path / "out").exists()


def test_images_for_a_text_only_pipeline_and_text_only_records_for_an_image_pipeline_are_refused(tmp_path, cli_here):
    prompts = write_inputs(tmp_path)
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts)))
    assert proc.returncode == 2 and ("prompts.jsonl:1: it has image, which FluxPipeline does not take (image-to-image "
                                     "on FLUX.1 weights: model.pipeline_class: FluxImg2ImgPipeline)") in proc.stderr
    proc = cli_here(*tiny_args(tmp_path / "out", *IMG2IMG))
    assert proc.returncode == 2 and ".txt:1: it has no image, which FluxImg2ImgPipeline needs" in proc.stderr
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts), *IMG2IMG,
                               "--model.call_kwargs.image", "in/a.png"))
    assert proc.returncode == 2 and "input files belong to each prompt record" in proc.stderr
    with pytest.raises(ConfigError, match="model.pipeline_class QwenImageEditPipeline needs processor, which these "
                                          "FluxPipeline weights do not have"):
        DiffusionModule("tiny:flux", pipeline_class="QwenImageEditPipeline")
    with pytest.raises(ConfigError, match="model.pipeline_class 'FluxImageMagic' is not a pipeline class"):
        DiffusionModule("tiny:flux", pipeline_class="FluxImageMagic")


def test_a_strength_that_runs_no_step_is_refused(tmp_path, cli_here):
    prompts = write_inputs(tmp_path)
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts), *IMG2IMG,
                               "--model.call_kwargs.strength", "0.2"))
    assert proc.returncode == 2 and ("model.call_kwargs: strength 0.2 of num_inference_steps 4 runs no step (the "
                                     "pipeline runs int(steps x strength) = 0 of them)") in proc.stderr


def test_a_resume_whose_input_file_changed_is_refused_naming_the_output(tmp_path):
    prompts = write_inputs(tmp_path)
    out = tmp_path / "out"
    args = tiny_args(out, "--data.prompts", str(prompts), *IMG2IMG)
    run_here(*args)
    run_here(*args)  # unchanged inputs: a resume with nothing to make
    Image.new("RGB", (64, 64), "red").save(tmp_path / "in" / "c.png")
    proc = run_here(*args, check=False)
    assert proc.returncode != 0
    assert (f"holds pictures made from input files that changed: output 2 (000002-a-lighthouse.png): its image "
            f"{tmp_path}/in/c.png changed since it was made") in proc.stderr, proc.stderr[-2000:]
    run_here(*args, "--writer.allow_config_change", "true")


def test_inputs_that_leave_data_inputs_root_are_refused(tmp_path, cli_here):
    root = tmp_path / "data"
    prompts = write_inputs(root)
    outside = tmp_path / "secret.png"
    Image.new("RGB", (64, 64)).save(outside)
    (root / "in" / "link.png").symlink_to(outside)
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "x", "image": "in/a.png"}, {"prompt": "x", "image": "../secret.png"},
        {"prompt": "x", "image": "in/link.png"}]))
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts), *IMG2IMG,
                               "--data.inputs_root", str(root)))
    assert proc.returncode == 2, proc.stderr
    assert f"prompts.jsonl:2: image {root}/../secret.png leaves data.inputs_root {root}" in proc.stderr
    assert f"prompts.jsonl:3: image {root}/in/link.png leaves data.inputs_root {root} (it resolves to {outside})" \
        in proc.stderr
    assert "prompts.jsonl:1:" not in proc.stderr


@pytest.mark.slow
def test_records_whose_images_differ_in_size_are_not_resized_to_a_batch_neighbours(tmp_path):
    """A pipeline outside the registry (SDXL image-to-image, whose output takes its input's size)
    with a 64x64 and a 96x64 input in one batch: each picture is the one its record makes alone
    (same seed), at its own input's size, not resized to its neighbour's."""
    rng = np.random.default_rng(0)
    (tmp_path / "in").mkdir()
    records = []
    for i, (w, h) in enumerate([(64, 64), (96, 64)]):
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(tmp_path / "in" / f"{i}.png")
        records.append({"prompt": f"picture {i}", "image": f"in/{i}.png", "seed": 11})
    common = ["--config", "configs/tiny-flux.yaml", "--model.pretrained_model_name_or_path", "tiny:sdxl",
              "--model.pipeline_class", "StableDiffusionXLImg2ImgPipeline", "--model.height", "null",
              "--model.width", "null", "--model.call_kwargs", "{}", "--model.num_inference_steps", "4",
              "--data.batch_size", "2", "--writer.save_arrays", "true"]
    (tmp_path / "both.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_here("predict", *common, "--data.prompts", str(tmp_path / "both.jsonl"), "--writer.output_dir",
             str(tmp_path / "both"))
    together = load_arrays(tmp_path / "both")
    for i, record in enumerate(records):
        (tmp_path / f"alone{i}.jsonl").write_text(json.dumps(record) + "\n")
        run_here("predict", *common, "--data.prompts", str(tmp_path / f"alone{i}.jsonl"), "--writer.output_dir",
                 str(tmp_path / f"alone{i}"))
        alone = load_arrays(tmp_path / f"alone{i}")[0]
        assert together[i].shape == alone.shape == (64, 64 + 32 * i, 3)
        # a set of one record is computed at its own size (batch 1): docs/config.md's 1e-5 between sizes
        assert np.abs(together[i] - alone).max() <= 1e-5, f"record {i} depends on its batch neighbour"


def test_strength_is_set_per_record_for_a_pipeline_outside_the_registry(tmp_path):
    """SDXL image-to-image (no registry entry): two records of one image at strengths 0.5 and 1.0,
    each byte-identical to diffusers called directly with its own strength; a strength the call
    cannot run (0 steps) is refused before weights, naming the record."""
    from lightning_diffusion.pipelines import bare

    Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype("uint8")).save(tmp_path / "in.png")
    records = [{"prompt": "a fox", "image": "in.png", "seed": 5, "strength": 0.5},
               {"prompt": "a fox", "image": "in.png", "seed": 5, "strength": 1.0}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["predict", "--config", "configs/tiny-flux.yaml", "--model.pretrained_model_name_or_path", "tiny:sdxl",
              "--model.pipeline_class", "StableDiffusionXLImg2ImgPipeline", "--model.height", "null",
              "--model.width", "null", "--model.call_kwargs", "{}", "--model.num_inference_steps", "4",
              "--data.batch_size", "1", "--writer.save_arrays", "true"]
    run_here(*common, "--data.prompts", str(tmp_path / "p.jsonl"), "--writer.output_dir", str(tmp_path / "out"))
    arrays = load_arrays(tmp_path / "out")
    assert {line["index"]: line["strength"] for line in read_manifest_lines(tmp_path / "out")} == {0: 0.5, 1: 1.0}
    pipe = bare.load("tiny:sdxl", pipeline_class="StableDiffusionXLImg2ImgPipeline")
    image = Image.open(tmp_path / "in.png").convert("RGB")
    for i, record in enumerate(records):
        direct = bare.call(pipe, [record["prompt"]], [record["seed"]], image=image, strength=record["strength"],
                           num_inference_steps=4, guidance_scale=3.5, output_type="np").images[0]
        assert np.array_equal(np.asarray(direct, dtype=np.float32), arrays[i]), f"record {i}"
    assert not np.array_equal(arrays[0], arrays[1])
    record_outcome("StableDiffusionXLImg2ImgPipeline", "one process", "equal",
                   "byte-identical to diffusers called directly", copy="tiny:sdxl")
    (tmp_path / "none.jsonl").write_text(json.dumps({**records[0], "strength": 0.1}) + "\n")
    proc = run_here(*common, "--data.prompts", str(tmp_path / "none.jsonl"), "--writer.output_dir",
                    str(tmp_path / "refused"), check=False)
    assert proc.returncode == 2 and "none.jsonl:1: strength 0.1 of num_inference_steps 4 runs no step" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "refused").exists()
