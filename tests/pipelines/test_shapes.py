"""tiny:shapes, the trained default model: its data set and detector, the quickstart config drawing
what it is asked (read by ``eval``), ``eval``'s reports and refusals, and parity of the strategies
on it against one process (the same tolerances as on tiny:flux)."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lightning_diffusion.pipelines import shapes, tiny
from tests.conftest import REPO, SHAPES_ARGS, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args

QUICKSTART_PROMPTS = [line for line in (REPO / "configs/prompts/shapes.txt").read_text().splitlines() if line]


# ----------------------------------------------------------------------------- data set and detector

def test_captions_read_back_and_scenes_follow_their_seed():
    scenes = shapes.sample_scenes(3, 500)
    assert all(shapes.parse_caption(shapes.caption(s)) == s for s in scenes)
    assert shapes.sample_scenes(3, 500) == scenes and shapes.sample_scenes(4, 500) != scenes
    assert any(len(s.shapes) == 2 for s in scenes) and any(s.shapes[0].position for s in scenes)
    assert shapes.parse_caption("a red fox in the snow") is None
    assert shapes.parse_caption("A small yellow star in the top left corner on a black background.") == shapes.Scene(
        "black", (shapes.Shape("star", "yellow", "small", "in the top left corner"),))
    assert all(shapes.parse_caption(p) for p in QUICKSTART_PROMPTS)
    held_out = shapes.held_out_scenes()
    assert len({shapes.caption(s) for s in held_out}) == 200 and all(len(s.shapes) == 1 for s in held_out)
    # render is a pure function of the scene and the seed
    scene = scenes[0]
    assert (shapes.render(scene, seed=1) == shapes.render(scene, seed=1)).all()
    assert not (shapes.render(scene, seed=1) == shapes.render(scene, seed=2)).all()


def test_detector_reads_drawn_scenes():
    """On exact drawings the analytic detector gets colours always and shapes nearly always: the
    adherence numbers of generated images measure the model, not the detector."""
    scenes = [s for s in shapes.sample_scenes(11, 600, two_shapes=0.0)]
    hits = {"colour": 0, "shape": 0, "position": 0}
    positioned = 0
    for i, scene in enumerate(scenes):
        result = shapes.adherence(shapes.render(scene, seed=i), scene)
        for key in hits:
            hits[key] += result.get(key, False)
        positioned += "position" in result
    assert hits["colour"] == len(scenes)
    assert hits["shape"] >= 0.98 * len(scenes)
    assert hits["position"] >= 0.97 * positioned
    blank = shapes.render(shapes.Scene("blue", ()))
    assert shapes.detect(blank).colour is None and shapes.detect(blank).background == "blue"


def test_shipped_pipeline_loads_offline_with_shardable_heads():
    from diffusers import FluxPipeline

    folder = Path(tiny.resolve("tiny:shapes"))
    assert folder.parent.parent == Path(shapes.__file__).parents[1]  # inside the package, no cache, no build
    weights = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    assert weights < 8e6
    pipe = FluxPipeline.from_pretrained(folder)
    assert pipe.transformer.config.num_attention_heads % 4 == 0
    assert pipe.tokenizer("a red circle on a blue background").input_ids[-1] == pipe.tokenizer.eos_token_id
    with pytest.raises(Exception, match="choose one of: tiny:shapes, tiny:flux"):
        tiny.resolve("tiny:nope")


def test_the_model_folder_recommends_its_settings():
    """lightning_diffusion.json in a model folder fills what the config leaves unset, nothing more."""
    from lightning_diffusion import DiffusionModule

    recommended = json.loads((Path(tiny.resolve("tiny:shapes")) / "lightning_diffusion.json").read_text())
    assert DiffusionModule("tiny:shapes").call_args == recommended["call_defaults"] == {
        "height": 64, "width": 64, "num_inference_steps": 12, "max_sequence_length": 32, "true_cfg_scale": 3.0,
        "negative_prompt": ""}
    module = DiffusionModule("tiny:shapes", num_inference_steps=8, call_kwargs={"true_cfg_scale": 1.0})
    assert module.call_args == {"height": 64, "width": 64, "num_inference_steps": 8, "max_sequence_length": 32,
                                "true_cfg_scale": 1.0, "negative_prompt": ""}
    assert "max_sequence_length" not in DiffusionModule("tiny:flux").call_args


# ----------------------------------------------------------------------------- quickstart and eval

@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """configs/tiny.yaml exactly as the README runs it (10 captions, its steps, batches of 5), into a
    temporary folder, its float arrays saved beside the PNGs."""
    out = tmp_path_factory.mktemp("quickstart")
    run_here("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(out),
             "--trainer.enable_progress_bar", "false", "--writer.save_arrays", "true")
    return out


def test_the_quickstart_records_the_arguments_its_calls_received(quickstart):
    """No pipeline default the call was not given: FluxPipeline's guidance_scale (3.5) reaches no
    transformer of tiny:shapes and the config does not set it."""
    from PIL import Image

    lines = read_manifest_lines(quickstart)
    assert len(lines) == 10
    received = {"model": "tiny:shapes", "num_inference_steps": 12, "max_sequence_length": 32, "true_cfg_scale": 3.0,
                "height": 64, "width": 64, "negative_prompt": ""}
    for line in lines:
        assert "guidance_scale" not in line
        assert {key: line[key] for key in received} == received
        text = Image.open(quickstart / line["file"]).text
        assert "guidance_scale" not in text and text["true_cfg_scale"] == "3.0"


# Measured at most 2.6e-6 over the 10 quickstart captions (docs/config.md, Seeds and determinism).
ALONE_VS_BATCH = 1e-5


def test_one_prompt_computes_one_image_and_draws_its_full_batch_picture(quickstart, tmp_path):
    """The quickstart's first caption alone (seed 0, as image 0 of the quickstart): one image computed
    and none padded, where a batch of 5 would pad 4; its picture is the full batch's to ALONE_VS_BATCH."""
    run_here(*tiny_args(tmp_path, "--data.prompts", json.dumps([QUICKSTART_PROMPTS[0]]), config="configs/tiny.yaml"))
    (summary,) = json.loads((tmp_path / "run.json").read_text())["history"]
    assert (summary["made"], summary["computed"], summary["padded"]) == (1, 1, 0)
    ours, batched = load_arrays(tmp_path)[0], load_arrays(quickstart)[0]
    np.testing.assert_allclose(ours, batched, rtol=0, atol=ALONE_VS_BATCH)


def eval_json(cli_here, *args):
    proc = cli_here("eval", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_quickstart_draws_what_it_is_asked(quickstart, cli_here):
    result = eval_json(cli_here, str(quickstart))
    assert result["summary"]["images"] == 10
    adherence = result["summary"]["adherence"]
    assert adherence["colour"]["images"] == 10 and adherence["colour"]["share"] >= 0.8
    rows = {row["index"]: row for row in result["images"]}
    assert rows[0]["prompt"] == QUICKSTART_PROMPTS[0] and "detected" in rows[0]
    table = cli_here("eval", str(quickstart)).stdout
    assert ("| Image | Detected | Colours | Shape | Prompt |" in table
            and "prompt adherence (shapes captions): colour" in table)


@pytest.mark.slow
def test_eval_against_a_reference_and_fid(quickstart, cli_here, tmp_path):
    same = eval_json(cli_here, str(quickstart), "--reference", str(quickstart))["summary"]["reference"]
    assert same["compared"] == 10 and same["max_abs"] == 0 and same["ssim_min"] == 1.0 and same["psnr_min"] == "inf"
    fid = eval_json(cli_here, str(quickstart), "--fid")["summary"]["fid"]
    assert fid["fid_images"] == 10 and fid["fid"] >= 0 and np.isfinite(fid["kid"])
    assert fid["against"] == "the captions drawn by shapes.render"
    assert fid["warning"].startswith("FID and KID from 10 images are noisy estimates (KID can come out below 0")


def tiny_clip(folder: Path) -> Path:
    """A random CLIP model and processor saved offline (character tokens), for the CLIP score path."""
    import string

    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    folder.mkdir(parents=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase + string.digits + ".,'-":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2),
        projection_dim=16))
    model.save_pretrained(folder)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_eval_clip_score_with_a_local_model(quickstart, cli_here, tmp_path):
    clip = tiny_clip(tmp_path / "clip")
    summary = eval_json(cli_here, str(quickstart), "--clip", str(clip))["summary"]
    assert np.isfinite(summary["clip_score"])  # a random CLIP: the number means nothing, the path works


def copy_run(source: Path, target: Path, edit=None) -> Path:
    shutil.copytree(source, target)
    if edit:
        lines = [json.loads(line) for line in (target / "manifest.jsonl").read_text().splitlines()]
        for line in lines:
            edit(line)
        (target / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return target


@pytest.mark.slow
def test_eval_refuses_bad_input_in_one_line(quickstart, cli_here, tmp_path):
    def refused(*args):
        proc = cli_here("eval", *args)
        assert proc.returncode == 2 and proc.stdout == ""
        message = proc.stderr.strip()
        assert "\n" not in message and message.startswith("lightning-diffusion eval: error: ")
        return message

    before = sorted(p.name for p in quickstart.iterdir())
    assert "has no manifest.jsonl" in refused(str(tmp_path))
    reseeded = copy_run(quickstart, tmp_path / "reseeded",
                        lambda line: line.update(seed=line["seed"] + 100) if line["index"] in (3, 7) else None)
    assert "other prompts or seeds: indices 3, 7 differ" in refused(str(quickstart), "--reference", str(reseeded))
    from PIL import Image

    resized = copy_run(quickstart, tmp_path / "resized")
    name = read_manifest_lines(resized)[2]["file"]
    Image.open(resized / name).resize((32, 32)).save(resized / name)
    lines = read_manifest_lines(resized)
    lines[2]["bytes"] = (resized / name).stat().st_size  # the manifest describes the file as it is now
    lines[2]["sha256"] = hashlib.sha256((resized / name).read_bytes()).hexdigest()
    (resized / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert "image 2 is 64x64 in the output and 32x32 in the reference" in refused(str(quickstart), "--reference",
                                                                                     str(resized))
    # without torch-fidelity (as here) or without its weights file: nothing is downloaded
    message = refused(str(quickstart), "--fid", "--features", "inception")
    assert "needs the torch-fidelity package" in message or "needs --inception-weights FILE" in message
    assert "is not a local CLIP model folder" in refused(str(quickstart), "--clip", str(tmp_path / "no-clip"))
    assert sorted(p.name for p in quickstart.iterdir()) == before  # eval writes nothing


# ----------------------------------------------------------------------------- parity on tiny:shapes

TP = "lightning_diffusion.strategies.TensorParallelStrategy"
CP = "lightning_diffusion.strategies.ContextParallelStrategy"
PARITY = {
    "dp2": ["--trainer.devices", "2"],
    "ulysses2": ["--trainer.devices", "2", "--trainer.strategy.class_path", CP,
                 "--trainer.strategy.init_args.ulysses_degree", "2"],
    "tp2": ["--trainer.devices", "2", "--trainer.strategy.class_path", TP,
            "--trainer.strategy.init_args.tp_degree", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(PARITY))
def test_strategies_on_tiny_shapes_match_one_process(mode, reference, tmp_path):
    """Data parallel is bit-identical (same batch composition); Ulysses and tensor parallel agree to
    1e-5 on [0, 1], as on tiny:flux."""
    run_cli(*tiny_args(tmp_path, "--data.batch_size", "1", *SHAPES_ARGS, *PARITY[mode], config="configs/tiny.yaml"))
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == list(range(5))
    ours, ref = load_arrays(tmp_path), reference("configs/tiny.yaml")
    for i in range(5):
        if mode == "dp2":
            assert np.array_equal(ours[i], ref[i]), f"image {i}"
        else:
            np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=1e-5, err_msg=f"image {i}")


def test_both_colours_of_a_two_shape_caption_are_read_from_exact_drawings():
    """The two-shape measure: each shape's colour drawn (eroded, so blended edge pixels between two
    colours do not pass as a third name), and a caption naming a colour the picture lacks fails."""
    import dataclasses

    scenes = shapes.held_out_pairs(60)
    assert all(len(s.shapes) == 2 for s in scenes) and len({shapes.caption(s) for s in scenes}) == 60
    drawn = [shapes.render(s, seed=i) for i, s in enumerate(scenes)]
    assert all(shapes.adherence(image, s)["both_colours"] for image, s in zip(drawn, scenes))
    for image, scene in zip(drawn, scenes):
        used = {scene.background} | {s.colour for s in scene.shapes}
        absent = next(c for c in shapes.COLOURS if c not in used)
        second = dataclasses.replace(scene.shapes[1], colour=absent)
        wrong = dataclasses.replace(scene, shapes=(scene.shapes[0], second))
        assert not shapes.adherence(image, wrong)["both_colours"], shapes.caption(wrong)


# ----------------------------------------------------------------------------- the training script


def test_training_script_decoder_pass_keeps_the_latents(tmp_path):
    """scripts/train_shapes.py's last stage trains the VAE's decoder alone, after the flow model has
    learned the encoder's latents: the encoder stays bit for bit, the decoder moves. The 2x
    architecture it can train packs a 64x64 picture into 256 image tokens (32x32 latents)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("train_shapes", REPO / "scripts" / "train_shapes.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    pipe = tiny.shapes_architecture(downsampling=2)
    assert pipe.vae_scale_factor == 2
    assert pipe.vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist.mean.shape == (1, 4, 32, 32)
    encoder = {k: v.clone() for k, v in pipe.vae.encoder.state_dict().items()}
    decoder = {k: v.clone() for k, v in pipe.vae.decoder.state_dict().items()}
    ckpt = train.Checkpoint(tmp_path, 1000, lambda line: None)
    train.train_vae(pipe, "decoder", 2, 2, 0, set(), lambda line: None, ckpt, [], shape_weight=train.SHAPE_WEIGHT,
                    edge_weight=train.EDGE_WEIGHT, decoder_only=True)
    assert all(torch.equal(v, pipe.vae.encoder.state_dict()[k]) for k, v in encoder.items())
    assert any(not torch.equal(v, pipe.vae.decoder.state_dict()[k]) for k, v in decoder.items())
    with pytest.raises(ValueError, match="downsampling is 2 or 4, not 8"):
        tiny.shapes_architecture(downsampling=8)


def test_training_batches_are_the_same_for_any_number_of_workers():
    """``--data-workers`` draws the batches in processes ahead of the device: the same batches in the
    same order as without (a run's weights depend on its seed, not on how its batches were drawn),
    and the global random state, which the text encoders' dropout draws from, untouched."""
    import importlib.util
    from itertools import islice

    import torch

    spec = importlib.util.spec_from_file_location("train_shapes", REPO / "scripts" / "train_shapes.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    plain = list(islice(train.batches(3, 4, set(), start=5), 5))
    train.WORKERS = 2
    torch.manual_seed(0)
    drawn = list(islice(train.batches(3, 4, set(), start=5), 5))
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(0).get_state())
    assert [c for c, _ in drawn] == [c for c, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(drawn, plain))
    assert plain[0][0] != plain[1][0]  # consecutive batches differ


def test_a_kid_estimate_below_zero_reads_as_no_measurable_difference():
    """KID's unbiased estimate comes out below 0 for sets that do not differ measurably (common at
    10 images): the report shows 0 and says why; the JSON keeps the estimate."""
    from lightning_diffusion.commands.eval import report

    fid = {"fid": 12.5, "kid": -0.0012, "kid_std": 0.004, "fid_images": 10, "features": "tiny:shapes",
           "against": "x"}
    text = report({"summary": {"folder": "out", "images": 10, "fid": fid}, "images": []}, per_image=False)
    assert ("FID 12.500, KID 0.0000 +- 0.0040 (10 images, tiny:shapes features, against x; KID's unbiased "
            "estimate, -0.0012, is below 0: no measurable difference)") in text
    fid["kid"] = 0.02
    text = report({"summary": {"folder": "out", "images": 10, "fid": fid}, "images": []}, per_image=False)
    assert "KID 0.0200 +- 0.0040 (10 images, tiny:shapes features, against x)" in text
