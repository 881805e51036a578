"""The CLI end to end on configs/tiny.yaml, and make-tiny."""

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lightning_diffusion.cli import main
from tests.conftest import REPO, load_arrays, read_manifest_lines, run_cli, tiny_args


def test_tiny_config_writes_images_manifest_and_png_metadata(tmp_path):
    out = tmp_path / "out"
    run_cli(*tiny_args(out))
    prompts = [line.strip() for line in (REPO / "configs/prompts/example.txt").read_text().splitlines() if line.strip()]
    lines = read_manifest_lines(out)
    assert [line["index"] for line in lines] == list(range(len(prompts))) and len(prompts) >= 8
    for line in lines:
        assert line["prompt"] == prompts[line["index"]]
        assert line["seed"] == line["index"]  # global seed 0 + index
        image = Image.open(out / line["file"])
        assert image.size == (64, 64)
        assert image.text["prompt"] == line["prompt"]
        assert image.text["seed"] == str(line["seed"])
        assert image.text["num_inference_steps"] == "4"
        assert image.text["guidance_scale"] == "3.5"
        assert (image.text["height"], image.text["width"]) == ("64", "64")
        assert image.text["model"] == "tiny:flux"
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".png") == sorted(line["file"] for line in lines)
    assert not list(out.glob(".*tmp*")) and not list(out.glob("manifest.part-*"))
    # Different prompts and seeds give different pictures.
    arrays = load_arrays(out)
    assert np.abs(arrays[0] - arrays[1]).max() > 0.05


def test_record_seed_and_overrides_reach_the_pipeline(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a cat", "seed": 42, "guidance_scale": 7.0}\n{"prompt": "a cat", "seed": 42}\n')
    out = tmp_path / "out"
    run_cli(*tiny_args(out, "--data.prompts", str(prompts), "--data.batch_size", "2"))
    first, second = read_manifest_lines(out)
    assert (first["seed"], first["guidance_scale"]) == (42, 7.0)
    assert (second["seed"], second["guidance_scale"]) == (42, 3.5)
    arrays = load_arrays(out)
    assert np.abs(arrays[0] - arrays[1]).max() > 1e-3  # guidance changed the picture


def test_make_tiny_writes_a_loadable_safetensors_pipeline(tmp_path):
    from diffusers import DiffusionPipeline

    main(["make-tiny", "flux", str(tmp_path / "a")])
    main(["make-tiny", "flux", str(tmp_path / "b")])
    assert list(Path(tmp_path / "a" / "transformer").glob("*.safetensors"))
    first = DiffusionPipeline.from_pretrained(tmp_path / "a")
    assert type(first).__name__ == "FluxPipeline"
    assert first.transformer.config.num_attention_heads % 4 == 0
    # Seeded: two builds hold the same weights.
    second = DiffusionPipeline.from_pretrained(tmp_path / "b")
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        a, b = getattr(first, name).state_dict(), getattr(second, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
