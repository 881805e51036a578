"""Context parallelism (diffusers' Ulysses / Ring / Unified and the anything-modes) against one process.

Tolerance: decoded float images (0..1) within ATOL of the single-process run with the same seeds
and batch size. Measured on the tiny FLUX pipeline: at most 1.7e-6 for every mode. A wrong plan
that runs without error (tokens split over 2 ranks, attention left local to each shard) differed
by 2.1e-2, two thousand times ATOL.
"""

import json

import numpy as np
import pytest
from lightning.pytorch import Trainer

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.strategies import ContextParallelStrategy, MeshError
from tests.conftest import FIVE_PROMPTS, check_model, load_arrays, read_manifest_lines, run_cli, tiny_args

ATOL = 1e-5
CP = "lightning_diffusion.strategies.ContextParallelStrategy"


def cp_args(out, devices, size=(64, 64), **init_args):
    extra = ["--trainer.devices", str(devices), "--trainer.strategy.class_path", CP]
    for key, value in init_args.items():
        extra += [f"--trainer.strategy.init_args.{key}", json.dumps(value)]
    return tiny_args(
        out, "--data.prompts", FIVE_PROMPTS, "--data.batch_size", "1",
        "--model.height", str(size[0]), "--model.width", str(size[1]), *extra,
    )


# 2-way Ulysses alone is run by test_verify.py, test_video.py and test_slurm.py; here it is part of dp2-ulysses2.
MODES = {
    "ring": dict(devices=2, ring_degree=2),
    "unified": dict(devices=4, ulysses_degree=2, ring_degree=2),
    # 48x80 pixels are 3x5 = 15 image tokens: odd, so no equal split over 2 ranks.
    "ulysses-anything": dict(devices=2, size=(48, 80), ulysses_degree=2, ulysses_anything=True),
    "ring-anything": dict(devices=2, size=(48, 80), ring_degree=2, ring_anything=True),
    "dp2-ulysses2": dict(devices=4, ulysses_degree=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_matches_one_process(mode, reference, tmp_path):
    settings = dict(MODES[mode])
    size = settings.get("size", (64, 64))
    proc = run_cli(*cp_args(tmp_path, **settings))
    log = proc.stdout + proc.stderr
    expected_mode = "ulysses" if mode == "dp2-ulysses2" else mode
    assert f"context parallel {expected_mode} " in log  # diffusers' parallelism really was applied
    assert "_functional_collectives" not in log  # torch's deprecation notice, once a rank, is hidden
    if mode == "dp2-ulysses2":
        assert "replica 0: ranks [0, 1]; replica 1: ranks [2, 3]" in log
    lines = read_manifest_lines(tmp_path)
    assert [line["index"] for line in lines] == list(range(5))  # each index once, one writer per group
    assert len(list(tmp_path.glob("*.png"))) == 5
    ours, ref = load_arrays(tmp_path), reference("configs/tiny-flux.yaml", *size)
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


def test_odd_token_count_without_anything_flag_fails_before_any_rank_starts(tmp_path, cli_here):
    proc = cli_here(*cp_args(tmp_path / "out", 2, size=(48, 80), ulysses_degree=2))
    assert proc.returncode == 2
    assert "48x80 gives 15 image tokens ((height/16) x (width/16)), not divisible by the context-parallel degree 2: " \
           "set ulysses_anything: true (strategy name: ulysses_anything), or choose sizes" in proc.stderr
    assert not (tmp_path / "out").exists()


def cpu_trainer(devices, **kwargs):
    return Trainer(accelerator="cpu", devices=devices, strategy=ContextParallelStrategy(**kwargs), logger=False)


@pytest.mark.parametrize(
    "devices, kwargs, error, message",
    [
        (3, dict(ulysses_degree=2), MeshError, "world size 3 is not divisible by ring 1 x ulysses 2 x tp 1 = 2"),
        (2, dict(ulysses_degree=2, ring_degree=2), MeshError, "world size 2 is not divisible by ring 2 x ulysses 2"),
        (2, dict(ulysses_degree=2, ring_anything=True), ConfigError,
         "ring_degree must be greater than 1 for ring_anything"),
        (4, dict(ulysses_degree=2, ring_degree=2, ulysses_anything=True), ConfigError,
         "ulysses_anything cannot be enabled when ring_degree > 1"),
        (1, dict(ulysses_degree=-1), ConfigError, "leaves a group of 1"),
    ],
)
def test_degrees_that_do_not_fit_are_refused_before_any_process_starts(devices, kwargs, error, message):
    with pytest.raises(error, match=message):
        cpu_trainer(devices, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ulysses_degree=2, ulysses_anything=True, ring_anything=True), "at most one of ulysses_anything"),
        (dict(ulysses_degree=1), "needs ulysses_degree > 1 or ring_degree > 1"),
        (dict(ulysses_degree=2, attention_backend="flex"), "'flex' cannot do context parallelism; choose one of"),
        (dict(ulysses_degree=2, attention_backend="nonsense"), "'nonsense' is not a diffusers attention backend"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ContextParallelStrategy(**kwargs)


def test_heads_not_divisible_by_ulysses_degree():
    """4 heads over 3 ranks: diffusers' Ulysses-anything would pad to 6 and assert that the 2 padding
    heads are fewer than the 2 per rank, so it is not suggested, and refused when asked for."""
    module = DiffusionModule("tiny:flux", height=64, width=64)
    for kwargs in (dict(ulysses_degree=3), dict(ulysses_degree=3, ulysses_anything=True)):
        with pytest.raises(ConfigError, match="4 attention heads, not divisible by ulysses_degree=3, and "
                                              r"ulysses_anything cannot split them either.*divides 4 \(2, 4\)"):
            check_model(cpu_trainer(3, **kwargs).strategy, module)


def test_ulysses_anything_is_suggested_only_where_it_can_split_the_heads(tmp_path):
    """30 heads over 8 ranks: diffusers pads to 32 (2 padding heads, fewer than the 4 per rank)."""
    import shutil

    from lightning_diffusion.pipelines import tiny

    folder = tmp_path / "heads30"
    shutil.copytree(tiny.resolve("tiny:flux"), folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 30}))
    module = DiffusionModule(str(folder), height=64, width=64)
    with pytest.raises(ConfigError, match=r"30 attention heads, not divisible by ulysses_degree=8: set "
                                          r"ulysses_anything: true \(strategy name: ulysses_anything\), or a "
                                          r"ulysses_degree that divides 30 \(2, 3, 5, 6, 10, 15, 30\)"):
        check_model(cpu_trainer(8, ulysses_degree=8).strategy, module)
    check_model(cpu_trainer(8, ulysses_degree=8, ulysses_anything=True).strategy, module)
    # the short name the message offers takes the flag with it
    short = Trainer(accelerator="cpu", devices=8, strategy="ulysses_anything", logger=False)
    assert isinstance(short.strategy, ContextParallelStrategy)
    check_model(short.strategy, module)


def test_text_length_not_divisible(tmp_path):
    trainer = cpu_trainer(2, ring_degree=2)
    module = DiffusionModule("tiny:flux", height=64, width=64, call_kwargs={"max_sequence_length": 63})
    with pytest.raises(ConfigError,
                       match="max_sequence_length=63 text tokens are not divisible .* set ring_anything: true"):
        check_model(trainer.strategy, module)


@pytest.mark.parametrize("kwargs", [dict(ulysses_degree=2), dict(ring_degree=2),
                                    dict(ring_degree=2, ring_anything=True)])
def test_prompt_length_text_needs_ulysses_anything(kwargs):
    # Qwen-Image does not pad its text to a fixed length, so most prompts would not split evenly; ring's
    # anything-mode rejects its attention mask (measured: ValueError from TemplatedRingAnythingAttention).
    module = DiffusionModule("tiny:qwenimage", height=64, width=64)
    with pytest.raises(ConfigError,
                       match="QwenImagePipeline's text tokens have each prompt's own length.*ulysses_anything: true"):
        check_model(cpu_trainer(2, **kwargs).strategy, module)
    check_model(cpu_trainer(2, ulysses_degree=2, ulysses_anything=True).strategy, module)


def test_model_without_context_parallel_plan(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
    }))
    trainer = cpu_trainer(2, ulysses_degree=2)
    with pytest.raises(ConfigError, match="StableDiffusionPipeline has no model with a context-parallel plan"):
        check_model(trainer.strategy, DiffusionModule(str(tmp_path)))


def test_ring_in_float32_on_cuda_is_refused_before_loading():
    """Ring attention on CUDA needs a backend that returns the log-sum-exp (half precision only):
    refused by the weight-free checks, on the planned device type, not after the weights load."""
    from lightning_diffusion.core.errors import raise_problems
    from lightning_diffusion.strategies import MeshStrategy

    request = DiffusionModule("tiny:flux", height=64, width=64).request()
    with pytest.raises(ConfigError, match="Ring attention on CUDA needs an attention backend"):
        raise_problems(MeshStrategy(ring=2).check_request(request, world_size=2, device_type="cuda"))
    assert MeshStrategy(ring=2).check_request(request, world_size=2, device_type="cpu") == []
