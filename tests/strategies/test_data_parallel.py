"""Data-parallel replicas on CPU (gloo) against one process: every index once, same images.

Tolerance. Image i's noise comes from its own seeded CPU generator, so the only thing that may
change between runs is floating-point rounding in batched kernels: with the same batch
composition (batch size 1) results are bit-identical; across batch compositions the decoded float
images agree to ``ATOL`` (measured: at most 3e-6 on [0, 1]), which can flip a rounding to uint8 by
one level on a few pixels.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, load_arrays, load_pngs, read_manifest_lines, run_cli, run_here, tiny_args

ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, batch size 1, 7 prompts (an odd count)."""
    out = tmp_path_factory.mktemp("reference")
    run_here(*tiny_args(out, "--data.prompts", PROMPTS, "--data.batch_size", "1"))
    return out


PROMPTS = "[" + ", ".join(f"prompt number {i}" for i in range(7)) + "]"


def assert_written_once(out, count):
    indices = [line["index"] for line in read_manifest_lines(out)]  # in merge order: each once
    assert sorted(indices) == list(range(count)) and len(indices) == count
    assert len(list(out.glob("*.png"))) == count


@pytest.mark.slow
def test_two_replicas_are_bit_identical_to_one_process(reference, tmp_path):
    proc = run_cli(*tiny_args(tmp_path, "--data.prompts", PROMPTS, "--data.batch_size", "1", "--trainer.devices", "2",
                              "--trainer.enable_progress_bar", "true"))
    # Without a terminal, progress is plain lines (no carriage returns) ending with the job's count,
    # and the run's summary is in run.json (docs/progress.md).
    log = proc.stdout + proc.stderr
    assert "\r" not in log and "progress: 7 of 7 (100%) images in" in log
    assert "made 7 outputs, 0 skipped by resume; 7 of 7 in" in log
    summary = json.loads((tmp_path / "run.json").read_text())["history"][-1]
    assert summary["made"] == 7 and summary["expected"] == 7 and set(summary["images_per_s_by_rank"]) == {"0", "1"}
    assert_written_once(tmp_path, 7)
    ours, ref = load_arrays(tmp_path), load_arrays(reference)
    assert all(np.array_equal(ours[i], ref[i]) for i in range(7))
    pngs, ref_pngs = load_pngs(tmp_path), load_pngs(reference)
    assert all(np.array_equal(pngs[i], ref_pngs[i]) for i in range(7))


@pytest.mark.slow
def test_two_replicas_with_batch_size_three_match_one_process(reference, tmp_path):
    run_cli(*tiny_args(tmp_path, "--data.prompts", PROMPTS, "--data.batch_size", "3", "--trainer.devices", "2"))
    assert_written_once(tmp_path, 7)
    ours, ref = load_arrays(tmp_path), load_arrays(reference)
    for i in range(7):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL)
    pngs, ref_pngs = load_pngs(tmp_path), load_pngs(reference)
    assert max(np.abs(pngs[i].astype(int) - ref_pngs[i].astype(int)).max() for i in range(7)) <= 1


@pytest.mark.slow
def test_batch_size_three_matches_batch_size_one_in_one_process(reference, tmp_path):
    run_here(*tiny_args(tmp_path, "--data.prompts", PROMPTS, "--data.batch_size", "3"))
    assert_written_once(tmp_path, 7)
    ours, ref = load_arrays(tmp_path), load_arrays(reference)
    for i in range(7):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL)


@pytest.mark.slow
def test_more_replicas_than_prompts_is_not_an_error(reference, tmp_path):
    run_cli(*tiny_args(tmp_path, "--data.prompts", "[prompt number 0]", "--data.batch_size", "1", "--trainer.devices",
                       "2"))
    assert_written_once(tmp_path, 1)
    assert np.array_equal(load_arrays(tmp_path)[0], load_arrays(reference)[0])


# ----------------------------------------------------------------------------- bit-identical layouts

TEN = "[" + ", ".join(f"prompt number {i}" for i in range(10)) + "]"


@pytest.fixture(scope="module")
def batch4(tmp_path_factory):
    """One process, 10 prompts, batch 4: the last batch holds 2 images (padded to 4)."""
    out = tmp_path_factory.mktemp("batch4")
    run_here(*tiny_args(out, "--data.prompts", TEN, "--data.batch_size", "4"))
    return out


def assert_identical(out, reference, indices=range(10)):
    ours, ref = load_arrays(out), load_arrays(reference)
    pngs, ref_pngs = load_pngs(out), load_pngs(reference)
    for i in indices:
        assert np.array_equal(ours[i], ref[i]), f"image {i}: max diff {np.abs(ours[i] - ref[i]).max():.3g}"
        assert np.array_equal(pngs[i], ref_pngs[i]), f"image {i}"


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 3])
def test_any_number_of_replicas_is_bit_identical_to_one_process(devices, batch4, tmp_path):
    """Shards of 5 (2 replicas: batches of 4 and 1) or 4, 3 and 3 (3 replicas) images: every short
    batch is padded to 4, so every image comes out of a call of 4, as in one process."""
    run_cli(*tiny_args(tmp_path, "--data.prompts", TEN, "--data.batch_size", "4", "--trainer.devices", str(devices)))
    assert_written_once(tmp_path, 10)
    assert_identical(tmp_path, batch4)


def test_a_resume_that_splits_batches_differently_is_bit_identical(batch4, tmp_path):
    """Images 2, 3, 5, 6, 7, 9 lost: the resume makes them in calls [2, 3, 5, 6] and [7, 9] (padded),
    where one process made 7 and 9 beside other neighbours, in calls of 4 as well."""
    import shutil

    out = Path(shutil.copytree(batch4, tmp_path / "out"))
    lost = {2, 3, 5, 6, 7, 9}
    kept = [line for line in read_manifest_lines(out) if line["index"] not in lost]
    for line in read_manifest_lines(out):
        if line["index"] in lost:
            (out / line["file"]).unlink()
            (out / f"{line['index']:06d}.npy").unlink()
    (out / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in kept))
    proc = run_here(*tiny_args(out, "--data.prompts", TEN, "--data.batch_size", "4"))
    assert "made 6 outputs, 4 skipped by resume" in proc.stdout + proc.stderr
    assert_written_once(out, 10)
    assert_identical(out, batch4)


def test_without_padding_a_short_batch_rounds_differently(batch4, tmp_path):
    """The reason for pad_batches: the same two images made in a call of 2 differ (by rounding)."""
    run_here(*tiny_args(tmp_path, "--data.prompts", TEN, "--data.batch_size", "4", "--model.pad_batches", "false"))
    ours, ref = load_arrays(tmp_path), load_arrays(batch4)
    assert all(np.array_equal(ours[i], ref[i]) for i in range(8))  # same calls of 4
    if max(np.abs(ours[i] - ref[i]).max() for i in (8, 9)) == 0:  # a call of 2
        pytest.skip("this CPU's kernels round calls of 2 and 4 alike: the padding tests cannot fail here")


def test_a_replica_of_one_rank_calls_the_pipeline_in_inference_mode_on_gloo(tmp_path):
    """Lightning predicts under no_grad on gloo; the strategy takes inference mode back around the
    pipeline call of a replica of one rank (what a diffusers loop uses), with the same pictures."""
    import torch
    from lightning.pytorch import Trainer

    from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule

    class Recording(DiffusionModule):
        modes: list = []

        def generate(self, samples):
            self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
            return super().generate(samples)

    images = {}
    for inference in (True, False):
        out = tmp_path / str(inference)
        trainer = Trainer(accelerator="cpu", devices=1, strategy="data_parallel", logger=False,
                          enable_progress_bar=False, inference_mode=inference,
                          callbacks=[ImageWriter(str(out), save_arrays=True, write_workers=0)])
        Recording.modes = []
        trainer.predict(Recording("tiny:flux", height=64, width=64, num_inference_steps=2),
                        datamodule=PromptDataModule(["a fox", "a cat", "a dog"], batch_size=2))
        assert torch.distributed.get_backend() == "gloo"
        assert Recording.modes == [(inference, False)] * 2
        images[inference] = load_arrays(out)
    assert sorted(images[True]) == sorted(images[False]) == [0, 1, 2]
    assert all(np.array_equal(images[True][i], images[False][i]) for i in range(3))


@pytest.mark.slow
@pytest.mark.parametrize("given", [None, "2"])
def test_each_rank_takes_its_share_of_the_cores_unless_the_user_chose(given, tmp_path):
    """Without OMP_NUM_THREADS the node's cores are shared by its processes (here 2 processes on
    this machine's cores: each its share, said once); a value the user set is kept in every rank."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if given is not None:
        env["OMP_NUM_THREADS"] = given
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    expected = share if given is None else given
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_diffusion", "predict", "--config", "configs/tiny.yaml", "--trainer.devices",
         "2", "--writer.output_dir", str(tmp_path), "--data.prompts", "[a red circle, a blue square]",
         "--data.batch_size", "1",
         "--trainer.callbacks", "[{class_path: tests.thread_probe.ThreadProbe}]"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"threads of rank {rank}: {expected} (OMP_NUM_THREADS={expected})" in proc.stderr, proc.stderr[-3000:]
    said = proc.stderr.count("CPU threads: ")
    assert said == (1 if given is None else 0), proc.stderr[-3000:]
