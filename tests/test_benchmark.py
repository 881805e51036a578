"""``benchmark`` prints the diffusers guide's table and writes the same figures as JSON (no timing
is asserted: these machines are shared and noisy)."""

import json

import pytest

from tests.conftest import run_here


@pytest.mark.slow
def test_benchmark_prints_the_table_and_writes_json(tmp_path):
    report = tmp_path / "bench.json"
    # tiny:shapes with true CFG against the config's default negative prompt: the bare loop passes it too
    proc = run_here("benchmark", "--config", "configs/tiny.yaml", "--data.prompts", "[a, b, c, d, e, f]",
                   "--data.batch_size", "2", "--compare-diffusers", "--json", str(report))
    assert "| Strategy | Time / Iter (ms) | Steps / sec | Peak memory (GB) | Shape | Images / sec | Load (s) |" in proc.stdout
    result = json.loads(report.read_text())
    assert result["strategy"] == "DataParallelStrategy" and result["shape"] == "64x64"
    assert result["timed_batches"] == 2  # 3 batches, the first one is warm-up
    for key in ("time_per_iter_ms", "steps_per_sec", "peak_memory_gb", "images_per_sec", "load_s",
                "diffusers_images_per_sec", "time_ratio_vs_diffusers"):
        assert result[key] > 0, key
