"""``writer.save_latents`` and ``writer.save_text_embeddings``: the tensors that made each image,
saved beside it in every layout, equal to what the pipeline's own VAE and text encoders make."""

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load, load_file

from lightning_diffusion.output.recorded import read_output
from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args, tiny_flux_with

PROMPTS = "[a red fox in the snow, a lighthouse in a storm, a bowl of ramen]"
ARGS = ["--data.prompts", PROMPTS, "--data.batch_size", "2", "--model.height", "32", "--model.width", "32",
        "--model.num_inference_steps", "2"]
SIDES = ["--writer.save_latents", "true", "--writer.save_text_embeddings", "true"]


def side_bytes(out: Path) -> dict[tuple[int, str], bytes]:
    """Each index's side outputs' bytes, found through its manifest line (a file, a tar member or a
    Parquet column)."""
    import pyarrow.parquet as pq

    found: dict[tuple[int, str], bytes] = {}
    lines = read_manifest_lines(out)
    assert len({line["index"] for line in lines}) == len(lines), "an image recorded twice"
    for line in lines:
        for side in ("latents", "text_embeddings"):
            where = line[side]
            if "file" in where and line.get("member") is None:
                found[line["index"], side] = (out / where["file"]).read_bytes()
            elif "member" in where:
                with tarfile.open(out / line["file"]) as tar:
                    member = tar.extractfile(where["member"])
                    assert member is not None
                    found[line["index"], side] = member.read()
            else:
                table = pq.read_table(out / line["file"]).to_pylist()
                found[line["index"], side] = next(row[where["column"]] for row in table
                                                  if row["index"] == line["index"])
    return found


@pytest.fixture(scope="module")
def files_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sides")
    run_here(*tiny_args(out, *ARGS, *SIDES))
    return out


@pytest.fixture(scope="module")
def tiny_pipeline():
    from diffusers import FluxPipeline

    from lightning_diffusion.pipelines import tiny

    return FluxPipeline.from_pretrained(tiny.resolve("tiny:flux"), torch_dtype=torch.float32)


def test_a_saved_latent_decoded_by_the_pipelines_vae_gives_the_saved_image(files_run, tiny_pipeline):
    """Decoded one at a time (the run decoded batches of 2), within 1e-5 of the run's float pixels,
    and the same 8-bit PNG pixels to within one level."""
    from PIL import Image

    arrays = load_arrays(files_run)
    lines = read_manifest_lines(files_run)
    assert len(lines) == 3
    for line in lines:
        saved = load_file(files_run / line["latents"]["file"])
        latents = saved["latents"]
        assert list(latents.shape) == line["latents"]["tensors"]["latents"]["shape"] == [4, 4, 4]
        assert line["latents"]["vae_scaling_factor"] == tiny_pipeline.vae.config.scaling_factor
        assert line["latents"]["vae_shift_factor"] == tiny_pipeline.vae.config.shift_factor
        with torch.no_grad():
            decoded = tiny_pipeline.vae.decode(latents[None], return_dict=False)[0]
        pixels = tiny_pipeline.image_processor.postprocess(decoded, output_type="np")[0]
        assert np.abs(pixels - arrays[line["index"]]).max() <= 1e-5
        png = np.asarray(Image.open(files_run / line["file"])).astype(int)
        assert np.abs(png - (np.clip(pixels, 0, 1) * 255).round()).max() <= 1


def test_the_saved_prompt_embeddings_equal_the_text_encoders_output(files_run, tiny_pipeline):
    lines = read_manifest_lines(files_run)
    with torch.no_grad():
        embeds, pooled, _ = tiny_pipeline.encode_prompt(prompt=[line["prompt"] for line in lines], prompt_2=None,
                                                        max_sequence_length=64)
    for n, line in enumerate(lines):
        saved = load_file(files_run / line["text_embeddings"]["file"])
        assert sorted(saved) == ["pooled_prompt_embeds", "prompt_embeds"]
        assert torch.allclose(saved["prompt_embeds"], embeds[n], rtol=0, atol=1e-6)
        assert torch.allclose(saved["pooled_prompt_embeds"], pooled[n], rtol=0, atol=1e-6)
        assert line["text_embeddings"]["tensors"]["prompt_embeds"] == {"shape": [64, 32], "dtype": "F32"}


def test_side_outputs_do_not_change_the_pictures(files_run, tmp_path):
    run_here(*tiny_args(tmp_path, *ARGS))
    plain = {line["index"]: line["sha256"] for line in read_manifest_lines(tmp_path)}
    assert plain == {line["index"]: line["sha256"] for line in read_manifest_lines(files_run)}


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_each_layout_holds_the_same_side_outputs_once_per_index(files_run, tmp_path, fmt):
    run_here(*tiny_args(tmp_path, *ARGS, *SIDES, "--writer.format", fmt, "--writer.samples_per_shard", "2"))
    lines = read_manifest_lines(tmp_path)
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert side_bytes(tmp_path) == side_bytes(files_run)
    assert {line["index"]: read_output(tmp_path, line) for line in lines} == {
        line["index"]: read_output(files_run, line) for line in read_manifest_lines(files_run)}
    if fmt == "webdataset":
        names = [m for p in sorted(tmp_path.glob("shard-*.tar")) for m in tarfile.open(p).getnames()]
        assert sorted(n for n in names if n.endswith(".safetensors")) == [
            f"{i:09d}.{side}.safetensors" for i in range(3) for side in ("latents", "text_embeddings")]
        sample = json.loads(tarfile.open(tmp_path / "shard-000000000.tar").extractfile("000000000.json").read())
        assert sample["latents"]["tensors"]["latents"]["shape"] == [4, 4, 4]
    else:
        import datasets

        rows = datasets.load_dataset("parquet", data_files=[str(p) for p in sorted(tmp_path.glob("*.parquet"))],
                                     split="train", cache_dir=str(tmp_path / "cache"))
        assert [row["index"] for row in rows] == [0, 1, 2]
        assert load(rows[0]["latents"])["latents"].shape == (4, 4, 4)


def test_a_resume_that_changes_a_side_output_setting_is_refused(tmp_path):
    run_here(*tiny_args(tmp_path, *ARGS, "--writer.save_latents", "true"))
    proc = run_here(*tiny_args(tmp_path, *ARGS), check=False)
    assert proc.returncode == 2 and "writer.save_latents: True then, None now" in proc.stderr
    proc = run_here(*tiny_args(tmp_path, *ARGS, *SIDES), check=False)
    assert proc.returncode == 2 and "writer.save_text_embeddings: None then, True now" in proc.stderr


def test_a_pipeline_without_text_embeddings_is_refused_before_weights(tmp_path, cli_here):
    """A denoiser whose forward takes no encoder_hidden_states (an unconditional UNet) has none to save."""
    model = tiny_flux_with(tmp_path, "transformer", "UNet2DModel")
    proc = cli_here(*tiny_args(tmp_path / "out", *ARGS, "--model.pretrained_model_name_or_path", str(model),
                               "--writer.save_text_embeddings", "true"))
    assert proc.returncode == 2
    assert "writer.save_text_embeddings: FluxPipeline's denoiser (UNet2DModel) takes no encoder_hidden_states" \
        in proc.stderr


def test_a_pipeline_without_a_decoding_vae_is_refused_before_weights(tmp_path, cli_here):
    """A VAE component whose class has no ``decode`` (here a UNet) has no decoded latents to save."""
    model = tiny_flux_with(tmp_path, "vae", "UNet2DModel")
    proc = cli_here(*tiny_args(tmp_path / "out", *ARGS, "--model.pretrained_model_name_or_path", str(model),
                               "--writer.save_latents", "true"))
    assert proc.returncode == 2
    assert "writer.save_latents: FluxPipeline has no VAE component (vae, movq) with a decode method" in proc.stderr


@pytest.mark.slow
def test_two_replicas_save_the_same_side_outputs_as_one_process(files_run, tmp_path):
    run_cli(*tiny_args(tmp_path, *ARGS, *SIDES, "--trainer.devices", "2"))
    assert side_bytes(tmp_path) == side_bytes(files_run)


def test_under_guidance_in_one_batch_the_positive_prompts_embeddings_are_saved(tmp_path):
    """Stable Diffusion calls its UNet on ``cat([negative, positive])``: each image keeps its own
    prompt's rows, a padded call's included (3 images in calls of 2)."""
    from diffusers import StableDiffusionPipeline

    from lightning_diffusion.pipelines import tiny

    run_here(*tiny_args(tmp_path, *ARGS, *SIDES, "--model.pretrained_model_name_or_path", "tiny:sd15",
                        "--model.guidance_scale", "7.5", "--model.call_kwargs", "null"))
    pipe = StableDiffusionPipeline.from_pretrained(tiny.resolve("tiny:sd15"))
    lines = read_manifest_lines(tmp_path)
    with torch.no_grad():
        positive, negative = pipe.encode_prompt([line["prompt"] for line in lines], "cpu", 1, True)
    for n, line in enumerate(lines):
        saved = load_file(tmp_path / line["text_embeddings"]["file"])["prompt_embeds"]
        assert torch.equal(saved, positive[n]) and not torch.equal(saved, negative[n])
        assert line["latents"]["vae_scaling_factor"] == pipe.vae.config.scaling_factor


def same_tensors(ours: dict, one: dict, atol: float = 1e-4) -> None:
    assert sorted(ours) == sorted(one)
    for key in one:
        mine, theirs = load(ours[key]), load(one[key])
        assert sorted(mine) == sorted(theirs)
        for name in theirs:
            assert mine[name].shape == theirs[name].shape
            assert torch.allclose(mine[name], theirs[name], rtol=0, atol=atol), (key, name)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/tiny-tp.yaml", "configs/tiny-device-map.yaml"], ids=["tp_2", "device_map"])
def test_a_tensor_parallel_group_and_a_device_map_write_the_whole_tensors_once(files_run, tmp_path, config):
    """tp=2 (the group's writing rank writes the tensors the group computed together) and a staged
    device map (tensors gathered from the devices they were placed on) give one process's tensors,
    to float rounding."""
    extra = (["--trainer.strategy.init_args.max_memory", "null", "--trainer.strategy.init_args.offload_folder", "null"]
             if "device-map" in config else [])
    run_cli(*tiny_args(tmp_path, *ARGS, *SIDES, *extra, config=config))
    same_tensors(side_bytes(tmp_path), side_bytes(files_run))


@pytest.mark.slow
def test_cfg_parallel_saves_the_conditional_branchs_tensors_once(tmp_path):
    """CFG parallel over 2 ranks (tiny Qwen-Image, true CFG): each image's latents and its own
    prompt's embeddings (the conditional branch), written once, equal one process's."""
    qwen = ["--data.batch_size", "2", "--model.height", "32", "--model.width", "32", "--model.num_inference_steps",
            "2"]  # the config's prompts: each with its negative prompt, which cfg=2 needs
    run_cli(*tiny_args(tmp_path / "one", *qwen, *SIDES, "--trainer.devices", "1", "--trainer.strategy",
                       "data_parallel", config="configs/tiny-cfg.yaml"))
    run_cli(*tiny_args(tmp_path / "cfg", *qwen, *SIDES, config="configs/tiny-cfg.yaml"))
    same_tensors(side_bytes(tmp_path / "cfg"), side_bytes(tmp_path / "one"))


@pytest.mark.slow
def test_a_context_parallel_group_writes_the_whole_tensors_once(files_run, tmp_path):
    """Ulysses over 2 ranks: the latents decoded after the gather and the embeddings before the
    split, written once by the group's writing rank, equal one process's (to float rounding: the
    group splits the text encoding by sample)."""
    run_cli(*tiny_args(tmp_path, *ARGS, *SIDES, config="configs/tiny-ulysses.yaml"))
    same_tensors(side_bytes(tmp_path), side_bytes(files_run))
