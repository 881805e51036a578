"""Editing and image-to-video pipelines on image records (issue 20, second part): FLUX.1 Kontext,
FLUX.1 Fill, Qwen-Image-Edit-Plus and Wan 2.1 image-to-video, each a real diffusers pipeline built
offline (``tiny:flux-kontext``, ``tiny:flux-fill``, ``tiny:qwenimage-edit``, ``tiny:wan-i2v``).

Parity: each against one process with batch size 1, within ATOL = 1e-5 (measured at most 2.6e-6),
under data parallel 2 and model-parallel modes: Kontext under Ulysses 2 with the anything-mode on
images of mixed sizes (one record's tokens odd), tp 2 and cfg 2 (true CFG); Fill under tp 2;
Qwen-Image-Edit under cfg 2; Wan image-to-video under Ulysses 2 and cfg 2. Kontext resizes every
input of a call to its first one's size, so a batch of mixed sizes must equal batch size 1 too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args, worst_difference

ATOL = 1e-5
KONTEXT = ["--model.pretrained_model_name_or_path", "tiny:flux-kontext", "--model.call_kwargs.max_area", "4096",
           "--model.call_kwargs._auto_resize", "false"]
FILL = ["--model.pretrained_model_name_or_path", "tiny:flux-fill"]
QWEN_EDIT = ["--model.pretrained_model_name_or_path", "tiny:qwenimage-edit", "--model.call_kwargs.negative_prompt",
             "blurry"]
WAN_I2V = ["--model.pretrained_model_name_or_path", "tiny:wan-i2v", "--model.num_frames", "5"]
PIPELINES = {"kontext": KONTEXT, "fill": FILL, "qwen-edit": QWEN_EDIT, "wan-i2v": WAN_I2V,
             "kontext-true-cfg": [*KONTEXT, "--model.call_kwargs.true_cfg_scale", "2.0",
                                  "--model.call_kwargs.negative_prompt", "blurry"]}
# Each pipeline's base config (sizes, steps, guidance); the strategy's flags come after it.
CONFIGS = {"kontext": "configs/tiny-flux.yaml", "fill": "configs/tiny-flux.yaml",
           "qwen-edit": "configs/tiny-qwenimage.yaml", "wan-i2v": "configs/tiny-wan.yaml",
           "kontext-true-cfg": "configs/tiny-flux.yaml"}


def edit_args(out: Path, name: str, prompts: Path, *extra: str) -> list[str]:
    return tiny_args(out, "--data.prompts", str(prompts), "--data.batch_size", "1", *PIPELINES[name], *extra,
                     config=CONFIGS[name])


def write_inputs(folder: Path) -> dict[str, Path]:
    """Images of three sizes (64x64 twice, 96x80, 80x48: Kontext's 16 + 15 tokens are odd), a mask
    of 64x64, and a prompt file a pipeline: records' paths relative to their file."""
    rng = np.random.default_rng(0)
    (folder / "in").mkdir(parents=True, exist_ok=True)
    for name, (w, h) in {"a": (64, 64), "b": (64, 64), "c": (96, 80), "d": (80, 48)}.items():
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(folder / "in" / f"{name}.png")
    Image.fromarray(((rng.random((64, 64)) > 0.5) * 255).astype("uint8")).save(folder / "in" / "mask.png")
    edits = [{"prompt": "a red fox", "image": "in/a.png", "seed": 7},
             {"prompt": "a red fox", "image": "in/c.png", "seed": 7},
             {"prompt": "a lighthouse", "image": "in/d.png"}, {"prompt": "a bowl of ramen", "image": "in/b.png"}]
    fills = [{"prompt": "a red fox", "image": "in/a.png", "mask_image": "in/mask.png"},
             {"prompt": "a lighthouse", "image": "in/b.png", "mask_image": "in/mask.png", "strength": 0.9}]
    files = {"kontext": edits, "fill": fills, "qwen-edit": edits[:2], "wan-i2v": edits, "kontext-true-cfg": edits[:2]}
    paths = {}
    for name, records in files.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    """Prompt files and one-process references (batch size 1) per pipeline, made once."""
    folder = tmp_path_factory.mktemp("edits")
    prompts = write_inputs(folder)
    made: dict[str, dict[int, np.ndarray]] = {}

    def reference(name: str) -> dict[int, np.ndarray]:
        if name not in made:
            out = folder / f"reference-{name}"
            run_here(*edit_args(out, name, prompts[name]))
            made[name] = load_arrays(out)
        return made[name]

    return prompts, reference


@pytest.mark.slow  # four pipelines' references: out of the quick loop
def test_each_pipeline_makes_pictures_from_its_records_inputs(edits, tmp_path):
    """One process: every record gives an output of the configured size, named with its input files,
    and another input image gives another picture (records 0 and 1: same prompt and seed), by far
    more than the parity tolerance."""
    prompts, reference = edits
    for name in ("kontext", "fill", "qwen-edit", "wan-i2v"):
        images = reference(name)
        expected = (5, 32, 32, 3) if name == "wan-i2v" else (64, 64, 3)
        assert all(image.shape == expected for image in images.values()), (name, [i.shape for i in images.values()])
        # (random tiny weights: Qwen-Image-Edit's reference moves pixels by about 5e-4)
        if name not in ("fill", "kontext-true-cfg"):
            change = float(np.abs(images[0] - images[1]).max())
            assert change > 10 * ATOL, f"{name}: another input image changed the picture by only {change:.2g}"
    lines = read_manifest_lines(prompts["kontext"].parent / "reference-kontext")
    assert lines[1]["inputs"]["image"]["file"].endswith("in/c.png") and lines[1]["height"] == 64


@pytest.mark.slow
def test_kontext_batches_of_mixed_image_sizes_equal_batch_size_one(edits, tmp_path):
    """Kontext resizes a call's inputs to its first one's size: calls are made per input size, so a
    batch of 4 over 3 sizes gives the pictures of batch size 1."""
    prompts, reference = edits
    out = tmp_path / "batched"
    run_here(*edit_args(out, "kontext", prompts["kontext"], "--data.batch_size", "4"))
    assert worst_difference(load_arrays(out), reference("kontext")) <= ATOL


@pytest.mark.slow
@pytest.mark.parametrize("name, strategy", [
    ("kontext", ["--trainer.devices", "2"]),
    ("kontext", ["--trainer.devices", "2", "--trainer.strategy", "ulysses_anything"]),
    ("kontext", ["--trainer.devices", "2", "--trainer.strategy", "tensor_parallel"]),
    ("kontext-true-cfg", ["--trainer.devices", "2", "--trainer.strategy", "cfg_parallel"]),
    ("fill", ["--trainer.devices", "2"]),
    ("fill", ["--trainer.devices", "2", "--trainer.strategy", "tensor_parallel"]),
    ("qwen-edit", ["--trainer.devices", "2", "--trainer.strategy", "data_parallel"]),
    ("qwen-edit", ["--trainer.devices", "2", "--trainer.strategy", "cfg_parallel"]),
    ("wan-i2v", ["--trainer.devices", "2"]),
    ("wan-i2v", ["--trainer.devices", "2", "--trainer.strategy", "ulysses"]),
    ("wan-i2v", ["--trainer.devices", "2", "--trainer.strategy", "cfg_parallel"]),
], ids=["kontext-dp2", "kontext-ulysses-anything2", "kontext-tp2", "kontext-cfg2", "fill-dp2", "fill-tp2",
        "qwen-edit-dp2", "qwen-edit-cfg2", "wan-i2v-dp2", "wan-i2v-ulysses2", "wan-i2v-cfg2"])
def test_edit_pipelines_under_every_strategy_match_one_process(name, strategy, edits, tmp_path):
    prompts, reference = edits
    out = tmp_path / "out"
    proc = run_cli(*edit_args(out, name, prompts[name], *strategy))
    assert worst_difference(load_arrays(out), reference(name)) <= ATOL
    assert [line["index"] for line in read_manifest_lines(out)] == sorted(reference(name))
    if "cfg_parallel" in strategy:
        assert "0 run whole on both ranks" in proc.stdout + proc.stderr  # every transformer call was split


def test_context_parallel_without_the_anything_mode_names_the_records_whose_tokens_do_not_divide(edits, cli_here):
    prompts, _ = edits
    proc = cli_here(*tiny_args(Path(prompts["kontext"]).parent / "refused", "--trainer.devices", "2",
                               "--trainer.strategy", "ulysses", "--data.prompts", str(prompts["kontext"]), *KONTEXT))
    assert proc.returncode == 2
    assert ("prompt record 3: 16 output + 15 reference image tokens = 31" in proc.stderr
            and "ulysses_anything: true" in proc.stderr), proc.stderr
    assert "prompt record 1" not in proc.stderr  # 16 + 16


def test_bad_edit_records_are_refused_together_before_loading(tmp_path, cli_here):
    prompts = write_inputs(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "no mask", "image": "in/a.png"}) + "\n"
                   + json.dumps({"prompt": "another size", "image": "in/c.png", "mask_image": "in/mask.png"}) + "\n")
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(bad), *FILL))
    assert proc.returncode == 2
    assert "bad.jsonl:1: it has no mask_image, which FluxFillPipeline needs" in proc.stderr
    assert "bad.jsonl:2: mask_image is 64x64 and image 96x80" in proc.stderr

    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"prompt": "no image"}) + "\n")
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(text_only), *WAN_I2V, config=CONFIGS["wan-i2v"]))
    assert proc.returncode == 2 and "text.jsonl:1: it has no image, which WanImageToVideoPipeline needs" in proc.stderr

    last = tmp_path / "last.jsonl"
    last.write_text(json.dumps({"prompt": "a clip", "image": "in/a.png", "last_image": "in/b.png"}) + "\n")
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(last), *WAN_I2V, config=CONFIGS["wan-i2v"]))
    assert proc.returncode == 2
    assert "has last_image, which these WanImageToVideoPipeline weights cannot take" in proc.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.mp4"))
    del prompts


@pytest.mark.slow
def test_verify_passes_kontext_under_ulysses_anything(edits):
    prompts, _ = edits
    proc = run_cli("verify", "--config", "configs/tiny-kontext.yaml", "--data.prompts", str(prompts["kontext"]),
                   "--num-prompts", "4")
    assert "PASS" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.slow
def test_a_killed_edit_run_resumes_with_each_record_once_and_the_same_pictures(edits, tmp_path):
    """Kontext over the mixed-size records, killed (SIGKILL) once the first picture is recorded,
    then rerun: the rest is made, each index once, each picture one process's."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    prompts, reference = edits
    out = tmp_path / "out"
    script = (
        "import sys, time\n"
        "from lightning_diffusion.cli import main\n"
        "from lightning_diffusion.output.files import OutputFiles\n"
        "encode = OutputFiles.encode\n"
        "def slow(self, *args):  # a second a picture: the kill lands mid-run\n"
        "    time.sleep(1.0)\n"
        "    encode(self, *args)\n"
        "OutputFiles.encode = slow  # in this process: the writer's threads run here\n"
        "main([*sys.argv[1:], '--writer.write_in', 'thread'])\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", script, *edit_args(out, "kontext", prompts["kontext"])], cwd=REPO,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not any(
            p.read_text().count("\n") for p in out.glob("manifest.*part-*.jsonl")):
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before the kill:\n{proc.stderr.read()[-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rerun = run_here(*edit_args(out, "kontext", prompts["kontext"]))
    assert "resumed: 1 already" in rerun.stdout + rerun.stderr or "resumed: 2 already" in rerun.stdout + rerun.stderr
    assert [line["index"] for line in read_manifest_lines(out)] == [0, 1, 2, 3]
    assert worst_difference(load_arrays(out), reference("kontext")) <= ATOL
