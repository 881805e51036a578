"""Writing off the prediction thread (bounded queue, writer threads), image formats and fsync
policies: the same files and manifest as writing on the prediction thread, exactly once after a
kill that lands while the queue is full, and errors of a writer thread fail the run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from PIL import Image

from lightning_diffusion.writer import EXIF_DESCRIPTION
from tests.conftest import REPO, read_manifest_lines, run_here, tiny_args
from tests.test_resume import finished_lines

SHAPES = ["--data.prompts", "configs/prompts/shapes.txt", "--model.num_inference_steps", "2"]


def test_background_writing_gives_the_files_and_manifest_of_writing_on_the_prediction_thread(tmp_path):
    for workers in ("0", "2"):
        run_here(*tiny_args(tmp_path / workers, *SHAPES, "--data.batch_size", "3", "--writer.write_workers", workers,
                            config="configs/tiny.yaml"))
    sync, background = (read_manifest_lines(tmp_path / w) for w in ("0", "2"))
    drop = lambda lines: [{k: v for k, v in line.items() if k != "written"} for line in lines]  # noqa: E731
    assert drop(sync) == drop(background) and len(sync) == 10
    for line in sync:
        assert (tmp_path / "0" / line["file"]).read_bytes() == (tmp_path / "2" / line["file"]).read_bytes()


@pytest.mark.parametrize("image_format, suffix", [("webp", ".webp"), ("jpeg", ".jpg")])
def test_lossy_formats_carry_the_parameters_in_exif_and_are_recorded(image_format, suffix, tmp_path, cli_here):
    out = tmp_path / "out"
    run_here(*tiny_args(out, *SHAPES, "--writer.image_format", image_format, "--writer.quality", "80",
                        config="configs/tiny.yaml"))
    line = read_manifest_lines(out)[0]
    assert line["file"].endswith(suffix) and (out / line["file"]).stat().st_size == line["bytes"]
    with Image.open(out / line["file"]) as picture:
        assert picture.format == image_format.upper()
        assert json.loads(picture.getexif()[EXIF_DESCRIPTION])["prompt"] == line["prompt"]
    settings = json.loads((out / "run.json").read_text())
    assert (settings["writer.image_format"], settings["writer.quality"]) == (image_format, 80)
    proc = cli_here(*tiny_args(out, *SHAPES, config="configs/tiny.yaml"))  # PNGs into a folder of lossy files
    assert proc.returncode == 2 and "writer.image_format" in proc.stderr


def test_a_failing_writer_thread_fails_the_run_and_records_no_unwritten_image(tmp_path):
    from lightning.pytorch import Trainer

    from lightning_diffusion import DiffusionModule, PromptDataModule
    from tests.slow_writer import FailingWriter

    writer = FailingWriter(str(tmp_path), write_workers=2)
    trainer = Trainer(accelerator="cpu", devices=1, strategy="data_parallel", callbacks=[writer], logger=False,
                      enable_progress_bar=False)
    with pytest.raises(RuntimeError, match=r"writing images failed: OSError: disk full \(on purpose\)"):
        trainer.predict(DiffusionModule("tiny:flux", height=64, width=64, num_inference_steps=2),
                        datamodule=PromptDataModule(["a", "b", "c", "d", "e", "f"], batch_size=1))
    lines = finished_lines(tmp_path)
    assert 2 not in {line["index"] for line in lines}
    assert all((tmp_path / line["file"]).stat().st_size == line["bytes"] for line in lines)


@pytest.mark.slow
def test_a_kill_while_the_queue_is_full_leaves_only_whole_recorded_images(tmp_path):
    out = tmp_path / "out"
    script = (
        "from lightning.pytorch import Trainer\n"
        "from lightning_diffusion import DiffusionModule, PromptDataModule\n"
        "from tests.slow_writer import SlowWriter\n"
        f"writer = SlowWriter({str(out)!r}, write_workers=1, write_queue=2)\n"
        "trainer = Trainer(accelerator='cpu', devices=1, strategy='data_parallel', callbacks=[writer], logger=False,\n"
        "                  enable_progress_bar=False)\n"
        "trainer.predict(DiffusionModule('tiny:flux', height=64, width=64, num_inference_steps=2),\n"
        "                datamodule=PromptDataModule([f'prompt {i}' for i in range(40)], batch_size=2))\n"
    )
    log = tmp_path / "run.log"
    with socket.socket() as s:  # a port of its own: another test's process group may hold Lightning's
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    submitted = out / "submitted.txt"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and (
            len(finished_lines(out)) < 4 or not submitted.is_file()
            or 2 * len(submitted.read_text().split()) < len(finished_lines(out)) + 6):
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before the kill (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = finished_lines(out)
    handed = 2 * len(submitted.read_text().split())
    assert 4 <= len(done) and handed >= len(done) + 6, "the kill must land while images wait in the queue"
    for line in done:  # every recorded image is whole
        with Image.open(out / line["file"]) as picture:
            picture.verify()
        assert (out / line["file"]).stat().st_size == line["bytes"]
    rerun = run_here(*tiny_args(out, "--data.prompts", "[" + ", ".join(f"prompt {i}" for i in range(40)) + "]",
                                "--data.batch_size", "2", "--model.num_inference_steps", "2",
                                "--writer.allow_config_change", "true"))
    assert f"resumed: {len(done):,} already" in rerun.stdout + rerun.stderr
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(40))


def test_bad_writer_settings_are_refused_before_loading(tmp_path, cli_here):
    proc = cli_here(*tiny_args(tmp_path / "out", "--writer.image_format", "gif", "--writer.quality", "0",
                               "--writer.png_compress_level", "10", "--writer.fsync", "never",
                               "--writer.write_workers", "-1"))
    assert proc.returncode == 2
    for message in ["writer.image_format must be one of png, webp, jpeg, got 'gif'",
                    "writer.quality (WebP and JPEG) must be an integer from 1 to 100, got 0",
                    "writer.png_compress_level must be an integer from 0 to 9, got 10",
                    "writer.fsync must be one of file, batch, off, got 'never'",
                    "writer.write_workers must be an integer >= 0"]:
        assert message in proc.stderr, message
    assert not (tmp_path / "out").exists()
