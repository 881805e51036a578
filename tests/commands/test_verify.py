"""``verify`` passes every strategy on the tiny pipelines and fails deliberately wrong plans."""

import json

import pytest

from tests.conftest import run_here


@pytest.mark.slow
def test_verify_passes_a_correct_plan_and_reads_overrides_given_with_equals(tmp_path):
    """One passing plan here (every strategy's parity with one device is tested in its own file);
    ``--data.prompts=FILE`` must reach verify itself: 2 prompts, not the config's 10."""
    prompts = tmp_path / "two.txt"
    prompts.write_text("a red fox\na lighthouse\n")
    report = tmp_path / "report.json"
    proc = run_here("verify", "--config", "configs/tiny-ulysses.yaml", f"--data.prompts={prompts}",
                   "--num-prompts", "4", "--json", str(report))
    assert "PASS" in proc.stdout
    result = json.loads(report.read_text())
    assert result["pass"] and result["dtype"] == "float32"
    assert len(result["images"]) == 2
    assert all(image["max_abs"] < 1e-4 for image in result["images"])


@pytest.mark.slow
def test_verify_fails_a_plan_that_runs_but_is_wrong():
    """Tokens split over 2 ranks with attention left local to each shard: a plausible picture."""
    proc = run_here("verify", "--config", "configs/tiny-ulysses.yaml", "--num-prompts", "2",
                   "--trainer.strategy.class_path", "tests.broken_plans.LocalAttentionUlysses", check=False)
    assert proc.returncode == 1
    assert proc.stdout.count("| FAIL |") == 2 and "FAIL: the plan does not reproduce" in proc.stdout


@pytest.mark.slow
def test_verify_fails_a_tp_plan_with_colwise_and_rowwise_swapped():
    proc = run_here("verify", "--config", "configs/tiny-tp.yaml", "--num-prompts", "1",
                   "--trainer.strategy.class_path", "tests.broken_plans.SwappedFeedForwardTP", check=False)
    assert proc.returncode == 2
    assert "the plan run failed" in proc.stderr


def test_the_reference_run_takes_the_attention_backend_the_plan_runs_with():
    """A strategy's attention_backend (and ring's own choice on CUDA) reaches the one-device run as
    model.attention_backend; a model-level backend is already in the config both runs read."""
    from lightning_diffusion.commands.verify import plan_attention_backend
    from lightning_diffusion.run.config import read_config

    strategy = ["--trainer.strategy.init_args.attention_backend", "native"]
    assert plan_attention_backend(read_config("configs/tiny-ulysses.yaml", strategy)) == "native"
    assert plan_attention_backend(read_config("configs/tiny-ulysses.yaml")) is None
    assert plan_attention_backend(read_config("configs/tiny-tp.yaml")) is None
    model = ["--model.attention_backend", "native"]
    assert plan_attention_backend(read_config("configs/tiny-ulysses.yaml", model)) is None
    ring_on_cuda = ["--trainer.accelerator", "gpu", "--model.torch_dtype", "bfloat16"]
    assert plan_attention_backend(read_config("configs/tiny-ring.yaml", ring_on_cuda, check=False)) == "_native_cudnn"
