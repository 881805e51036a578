"""DeviceMapStrategy: device_map placement with disk offload, staged encode/denoise/decode, replicas.

CPU rehearsal: with device_map="auto" and a CPU budget smaller than the tiny transformer (1.1 MB),
accelerate puts part of it on the CPU and the rest on disk. Images are compared with the plain
single-process run as decoded floats within ATOL (measured 1.6e-6).
"""

import json

import numpy as np
import pytest
from lightning.pytorch import Trainer

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.strategies import DeviceMapStrategy, TensorParallelStrategy
from tests.conftest import FIVE_PROMPTS, check_model, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args

ATOL = 1e-5
DM = "lightning_diffusion.strategies.DeviceMapStrategy"


def dm_args(out, offload, devices=1, staged=False):
    return tiny_args(
        out, "--data.prompts", FIVE_PROMPTS, "--data.batch_size", "1", "--trainer.devices", str(devices),
        "--trainer.strategy.class_path", DM,
        "--trainer.strategy.init_args.max_memory", json.dumps({"cpu": "700KB"}),
        "--trainer.strategy.init_args.offload_folder", str(offload),
        "--trainer.strategy.init_args.staged", json.dumps(staged),
    )


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["device-map", "staged"])
def test_device_map_with_disk_offload_matches_plain_run(staged, reference, tmp_path):
    proc = run_here(*dm_args(tmp_path / "out", tmp_path / "offload", staged=staged))
    log = proc.stdout + proc.stderr
    transformer_map = log.split("transformer: ", 1)[1].splitlines()[0]
    assert "'cpu'" in transformer_map and "'disk'" in transformer_map  # split over CPU and disk
    assert list((tmp_path / "offload").rglob("*.dat"))
    if staged:
        assert "staged: encode, denoise, decode per batch" in log
    ours, ref = load_arrays(tmp_path / "out"), reference()
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


@pytest.mark.slow
def test_two_device_map_replicas_split_the_prompts(reference, tmp_path):
    proc = run_cli(*dm_args(tmp_path / "out", tmp_path / "offload", devices=2, staged=True))
    log = proc.stdout + proc.stderr
    assert "rank 0 device map" in log and "rank 1 device map" in log
    assert [line["index"] for line in read_manifest_lines(tmp_path / "out")] == list(range(5))
    assert len(list((tmp_path / "out").glob("*.png"))) == 5
    ours, ref = load_arrays(tmp_path / "out"), reference()
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL)


def check(strategy, module=None):
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    check_model(trainer.strategy, module or DiffusionModule("tiny:flux"))


def test_budget_that_holds_no_component():
    with pytest.raises(ConfigError, match="cannot hold even the smallest component"):
        check(DeviceMapStrategy(max_memory={"cpu": "10KB"}))


def test_budget_too_small_for_the_transformer_without_offload_folder():
    with pytest.raises(ConfigError, match="cannot hold the transformer .* no offload_folder"):
        check(DeviceMapStrategy(max_memory={"cpu": "700KB"}))


def test_gpu_that_does_not_exist():
    with pytest.raises(ConfigError, match="max_memory names GPU 0, but this process spans 0 GPU"):
        check(DeviceMapStrategy(max_memory={0: "16GB", "cpu": "64GB"}))


def test_offload_folder_that_is_not_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a writable folder"):
        DeviceMapStrategy(offload_folder=str(tmp_path / "file" / "offload"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(device_map="sequential"), "device_map must be 'auto', 'balanced' or a"),
        (dict(device_map="balanced"), "on a CPU use 'auto'"),
        (dict(device_map={"unet": "cpu"}), "names unet, which FluxPipeline does not have"),
        (dict(max_memory={"cpu": "lots"}), "'lots' is not a size"),
    ],
)
def test_bad_device_maps(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        check(DeviceMapStrategy(**kwargs))


def test_device_map_cannot_be_combined_with_tensor_parallelism():
    trainer = Trainer(accelerator="cpu", devices=2, strategy=TensorParallelStrategy(), logger=False)
    with pytest.raises(ConfigError, match="device_map cannot be used with tensor parallelism"):
        check_model(trainer.strategy, DiffusionModule("tiny:flux", from_pretrained_kwargs={"device_map": "auto"}))


def test_each_process_budgets_its_own_gpus_and_the_cpu_only():
    """Process 1 of a node with devices_per_process 2 owns GPUs 2 and 3: the budget lists them (the
    user's 10 GB for its first one, the free memory of the other) and the CPU, never GPUs 0 and 1."""
    from lightning_diffusion.strategies.device_map import process_max_memory

    budget = process_max_memory({0: 10 * 2**30}, [2, 3], {2: 70 * 2**30, 3: 60 * 2**30}, 100 * 2**30)
    assert budget == {2: 10 * 2**30, 3: 60 * 2**30, "cpu": 100 * 2**30}
    assert process_max_memory({"cpu": 5, "disk": 9}, [0], {0: 7}, 100) == {0: 7, "cpu": 5, "disk": 9}


def test_device_rules_run_on_the_rank_even_after_the_command_line_checks_passed(tmp_path, cli_here):
    """How many GPUs a node has is known only on the rank: 'balanced' on a CPU is refused there,
    with the same message, although the launching process's checks could not see it."""
    proc = cli_here("predict", "--config", "configs/tiny-device-map.yaml", "--trainer.strategy.init_args.device_map",
                    "balanced", "--writer.output_dir", str(tmp_path / "out"), "--trainer.enable_progress_bar", "false")
    assert proc.returncode == 2
    assert "device_map 'balanced' spreads components over GPUs" in proc.stderr


def test_checks_that_need_the_world_size_are_left_to_the_ranks_when_devices_is_auto():
    from lightning_diffusion.run.config import read_config
    from lightning_diffusion.run.preflight import preflight

    verdict = preflight(read_config("configs/tiny-ulysses.yaml", check=False))
    assert (verdict.problems, verdict.complete) == ([], True)
    verdict = preflight(read_config("configs/tiny-ulysses.yaml", ["--trainer.devices", "auto"], check=False))
    problems, complete = verdict.problems, verdict.complete
    assert problems == [] and complete is False  # the ranks run the strategy's rules themselves
