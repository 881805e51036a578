"""Video pipelines: tiny:wan written as MP4 with the manifest, context parallelism, resume.

Tolerance: decoded float frames (0..1) within ATOL of one process (measured 1.2e-6 for Ulysses
and Ring on 2 processes).
"""

import json

import av
import numpy as np
import pytest
from PIL import Image

from lightning_diffusion import DiffusionModule, ImageWriter
from lightning_diffusion.core.errors import ConfigError
from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args

ATOL = 1e-5
PROMPTS = "[a red fox running, a lighthouse in a storm, a bowl of ramen]"


def wan_args(out, *extra):
    return tiny_args(out, "--data.prompts", PROMPTS, "--data.batch_size", "1", *extra, config="configs/tiny-wan.yaml")


@pytest.fixture(scope="module")
def video_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("wan-reference")
    run_here(*wan_args(out))
    return out


@pytest.mark.slow
def test_videos_are_mp4_with_the_requested_frames_and_metadata(video_reference):
    lines = read_manifest_lines(video_reference)
    assert [line["index"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert line["file"].endswith(".mp4") and line["num_frames"] == 9 and line["fps"] == 8
        with av.open(str(video_reference / line["file"])) as container:
            stream = container.streams.video[0]
            assert (stream.width, stream.height) == (32, 32)
            assert sum(1 for _ in container.decode(video=0)) == 9
            assert json.loads(container.metadata["comment"])["seed"] == line["seed"]
    arrays = load_arrays(video_reference)
    assert arrays[0].shape == (9, 32, 32, 3)
    assert np.abs(arrays[0][0] - arrays[0][-1]).max() > 1e-3  # frames differ: it is a clip


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, extra",
    [
        ("ulysses", ["--trainer.devices", "2", "--trainer.strategy", "ulysses"]),
        ("ring", ["--trainer.devices", "2", "--trainer.strategy", "ring"]),
    ],
    ids=["ulysses2", "ring2"],  # replicas of a context-parallel group: test_context_parallel.py
)
def test_context_parallel_video_matches_one_process(strategy, extra, video_reference, tmp_path):
    proc = run_cli(*wan_args(tmp_path, *extra))
    assert f"context parallel {strategy} " in proc.stdout + proc.stderr
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == [0, 1, 2]
    ours, ref = load_arrays(tmp_path), load_arrays(video_reference)
    for i in range(3):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"video {i}")


@pytest.mark.slow
def test_resume_redoes_only_missing_videos(tmp_path):
    run_here(*wan_args(tmp_path))
    first = read_manifest_lines(tmp_path)
    kept = (tmp_path / first[0]["file"]).stat().st_mtime_ns
    (tmp_path / first[1]["file"]).unlink()
    proc = run_here(*wan_args(tmp_path))
    assert "resumed: 2 already in the manifest" in proc.stdout + proc.stderr
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == [0, 1, 2]
    assert (tmp_path / first[1]["file"]).is_file()
    assert (tmp_path / first[0]["file"]).stat().st_mtime_ns == kept


@pytest.mark.parametrize("fmt", ["gif", "webp"])
def test_animated_formats(fmt, tmp_path):
    writer = ImageWriter(str(tmp_path), video_format=fmt, fps=4)
    frames = np.linspace(0, 1, 5 * 16 * 16 * 3, dtype=np.float32).reshape(5, 16, 16, 3)
    line = writer.files.write_output({"index": 3, "prompt": "a clip", "seed": 7, "image": frames, "params": {}})
    assert line["file"] == f"000003-a-clip.{fmt}" and line["fps"] == 4
    with Image.open(tmp_path / line["file"]) as animation:
        assert animation.n_frames == 5


def test_frame_counts_the_pipeline_cannot_make():
    with pytest.raises(ConfigError, match=r"num_frames=8 cannot be made by WanPipeline: use 4 x k \+ 1 frames "
                                          r"\(for example 9, or its default 81\)"):
        DiffusionModule("tiny:wan", num_frames=8)
    with pytest.raises(ConfigError, match="FluxPipeline makes images, not videos"):
        DiffusionModule("tiny:flux", num_frames=9)
