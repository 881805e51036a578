"""Data-parallel replicas on CPU (gloo) against one process: every index once, same images.

Tolerance. Image i's noise comes from its own seeded CPU generator, so the only thing that may
change between runs is floating-point rounding in batched kernels: with the same batch
composition (batch size 1) results are bit-identical; across batch compositions the decoded float
images agree to ``ATOL`` (measured: at most 3e-6 on [0, 1]), which can flip a rounding to uint8 by
one level on a few pixels.
"""

import numpy as np
import pytest

from tests.conftest import load_arrays, load_pngs, read_manifest_lines, run_cli, run_here, tiny_args

ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, batch size 1, 7 prompts (an odd count)."""
    out = tmp_path_factory.mktemp("reference")
    run_here(*tiny_args(out, "--data.prompts", PROMPTS, "--data.batch_size", "1"))
    return out


PROMPTS = "[" + ", ".join(f"prompt number {i}" for i in range(7)) + "]"


def assert_written_once(out, count):
    lines = read_manifest_lines(out)
    assert [line["index"] for line in lines] == list(range(count))
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
    import json

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
    run_cli(*tiny_args(tmp_path, "--data.prompts", "[prompt number 0]", "--trainer.devices", "2"))
    assert_written_once(tmp_path, 1)
    assert np.array_equal(load_arrays(tmp_path)[0], load_arrays(reference)[0])
