"""``verify`` passes every strategy on the tiny pipelines and fails deliberately wrong plans."""

import json

import pytest

from tests.conftest import run_cli

CONFIGS = {
    "data_parallel": ["--config", "configs/tiny.yaml", "--trainer.devices", "2"],
    "ulysses": ["--config", "configs/tiny-ulysses.yaml"],
    "ring": ["--config", "configs/tiny-ring.yaml"],
    "unified": ["--config", "configs/tiny-unified.yaml"],
    "ring-anything": ["--config", "configs/tiny-ring-anything.yaml"],
    "tensor_parallel": ["--config", "configs/tiny-tp.yaml"],
    "mesh tp2 x ulysses2": ["--config", "configs/tiny-mesh.yaml"],
    "device_map staged": ["--config", "configs/tiny-device-map.yaml"],
    "tensor_parallel qwenimage": ["--config", "configs/tiny-qwenimage.yaml", "--trainer.devices", "2",
                                  "--trainer.strategy", "tensor_parallel"],
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_passes(name, tmp_path):
    report = tmp_path / "report.json"
    proc = run_cli("verify", *CONFIGS[name], "--num-prompts", "1", "--json", str(report), timeout=600)
    assert "PASS" in proc.stdout
    result = json.loads(report.read_text())
    assert result["pass"] and result["dtype"] == "float32"
    assert result["images"][0]["max_abs"] < 1e-4


def test_verify_fails_a_plan_that_runs_but_is_wrong():
    """Tokens split over 2 ranks with attention left local to each shard: a plausible picture."""
    proc = run_cli("verify", "--config", "configs/tiny-ulysses.yaml", "--num-prompts", "2",
                   "--trainer.strategy.class_path", "tests.broken_plans.LocalAttentionUlysses", check=False)
    assert proc.returncode == 1
    assert proc.stdout.count("| FAIL |") == 2 and "FAIL: the plan does not reproduce" in proc.stdout


def test_verify_fails_a_tp_plan_with_colwise_and_rowwise_swapped():
    proc = run_cli("verify", "--config", "configs/tiny-tp.yaml", "--num-prompts", "1",
                   "--trainer.strategy.class_path", "tests.broken_plans.SwappedFeedForwardTP", check=False)
    assert proc.returncode == 2
    assert "the plan run failed" in proc.stderr
