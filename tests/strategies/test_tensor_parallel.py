"""Tensor parallelism (diffusers' _tp_plan, shard-by-shard loading) against one process.

Tolerance: decoded float images (0..1) within ATOL of the single-process run with the same seeds
and batch size; measured at most 1.4e-6 (tiny:flux) and 3.6e-7 (tiny:qwenimage, true CFG).
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from safetensors.torch import load_file

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.pipelines import tiny
from lightning_diffusion.strategies import TensorParallelStrategy
from tests.conftest import FIVE_PROMPTS, check_model, load_arrays, read_manifest_lines, run_cli, tiny_args

ATOL = 1e-5
PIPELINES = {
    "flux": ("configs/tiny-flux.yaml", ["--data.prompts", FIVE_PROMPTS]),
    "qwenimage": ("configs/tiny-qwenimage.yaml", []),  # 5 records with negative prompts, true CFG
}


def args(pipeline, out, *extra):
    config, prompts = PIPELINES[pipeline]
    return tiny_args(out, "--data.batch_size", "1", *prompts, *extra, config=config)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline, devices", [("flux", 2), ("qwenimage", 2), ("flux", 4)])
def test_tensor_parallel_matches_one_process(pipeline, devices, reference, tmp_path):
    extra = ["--trainer.devices", str(devices), "--trainer.strategy.class_path",
             "lightning_diffusion.strategies.TensorParallelStrategy", "--trainer.strategy.init_args.tp_degree", "2"]
    proc = run_cli(*args(pipeline, tmp_path, *extra))
    log = proc.stdout + proc.stderr
    local, total = map(lambda s: int(s.replace(",", "")),
                       re.search(r"loaded shard by shard, ([\d,]+) of ([\d,]+) parameters", log).groups())
    assert local < 0.75 * total  # each rank holds about half of the planned weights
    if devices == 4:
        assert "(dp=2, ring=1, ulysses=1, tp=2)" in log
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == list(range(5))
    assert len(list(tmp_path.glob("*.png"))) == 5
    ours, ref = load_arrays(tmp_path), reference(PIPELINES[pipeline][0])
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


def tp_trainer(devices, **kwargs):
    return Trainer(accelerator="cpu", devices=devices, strategy=TensorParallelStrategy(**kwargs), logger=False)


def test_heads_not_divisible_by_tp_degree():
    trainer = tp_trainer(3)
    with pytest.raises(ConfigError, match="transformer has 4 attention heads, not divisible by tp_degree=3"):
        check_model(trainer.strategy, DiffusionModule("tiny:flux"))


def test_degree_that_does_not_divide_the_world():
    with pytest.raises(ConfigError, match="world size 3 is not divisible by ring 1 x ulysses 1 x tp 2 = 2"):
        tp_trainer(3, tp_degree=2)
    with pytest.raises(ConfigError, match="leaves a group of 1"):
        tp_trainer(1)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"quantization_config": {"load_in_8bit": True}}, "quantization_config cannot be used with tensor parallelism"),
        ({"device_map": "balanced"}, "device_map cannot be used with tensor parallelism"),
        ({"use_safetensors": False}, "drop use_safetensors=False"),
    ],
)
def test_options_diffusers_cannot_combine_with_tp(option, message):
    trainer = tp_trainer(2)
    with pytest.raises(ConfigError, match=message):
        check_model(trainer.strategy, DiffusionModule("tiny:flux", from_pretrained_kwargs=option))


def test_pipeline_without_tp_plan(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
    }))
    with pytest.raises(ConfigError, match="StableDiffusionPipeline has no model with a tensor-parallel plan"):
        check_model(tp_trainer(2).strategy, DiffusionModule(str(tmp_path)))


def test_weights_that_are_not_safetensors(tmp_path):
    folder = Path(shutil.copytree(tiny.resolve("tiny:flux"), tmp_path / "bin"))
    for file in (folder / "transformer").glob("*.safetensors"):
        torch.save(load_file(file), file.with_suffix(".bin"))
        file.unlink()
    with pytest.raises(ConfigError, match="has no .safetensors weights"):
        check_model(tp_trainer(2).strategy, DiffusionModule(str(folder)))


def test_parallel_models_live_on_the_meshs_device_type_and_the_ranks_own_gpu():
    """diffusers 0.42.1 would place a rank's shards on cuda:(rank % device count) whenever a GPU
    exists: wrong for a CPU mesh on a GPU machine and for ranks that own GPUs 4..7."""
    from lightning_diffusion.pipelines.compat import parallel_device

    assert parallel_device("cpu", None) == torch.device("cpu")
    assert parallel_device("cpu", 3) == torch.device("cpu")
    assert parallel_device("cuda", 5) == torch.device("cuda", 5)
