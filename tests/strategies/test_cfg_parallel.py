"""CFG parallel: the two guidance passes on the two ranks of a pair, against one process.

Tolerance as for every strategy here: decoded float images within ATOL = 1e-5 of a one-process
run with the same seeds (measured at most 1.1e-6: Qwen 5.4e-7, FLUX.1 1.0e-6, Wan 1.1e-6). A split that ran the
same branch on both ranks, or swapped the branches, changes the pictures by far more than that
(see the README's CFG section for the measured size of such a mistake).
"""

import numpy as np
import pytest

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.strategies import CFGParallelStrategy, MeshStrategy
from lightning_diffusion.strategies.checks import cfg_problems
from tests.conftest import FIVE_PROMPTS, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args

ATOL = 1e-5
QWEN = "configs/tiny-qwenimage.yaml"
MESH = ["--trainer.strategy.class_path", "lightning_diffusion.strategies.MeshStrategy"]
NO_SPLIT = "without a negative branch"


def assert_matches(out, ref, count=5):
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(count))
    ours = load_arrays(out)
    for i in range(count):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


@pytest.mark.slow
def test_cfg2_matches_one_process(reference, tmp_path):
    proc = run_cli(*tiny_args(tmp_path, "--data.batch_size", "1", "--trainer.devices", "2",
                              "--trainer.strategy", "cfg_parallel", config=QWEN))
    log = proc.stdout + proc.stderr
    assert "device mesh (dp=1, cfg=2, ring=1, ulysses=1, tp=1) over 2 processes" in log
    assert "QwenImagePipeline's cond and uncond passes on the two ranks" in log
    assert NO_SPLIT not in log
    # Every step of every image was split (rank 0 made all 5 images, 4 steps each), not run twice.
    assert "cfg parallel: 20 transformer calls split over the pair, 0 run whole on both ranks" in log
    assert_matches(tmp_path, reference(QWEN))


# Qwen-Image's text tokens (split by context parallelism) have the prompt's length, which is rarely
# even: Ulysses runs in its anything-mode for it.
@pytest.mark.slow
@pytest.mark.parametrize("degrees", [dict(ulysses=2), dict(tp=2)], ids=["cfg2-ulysses2", "cfg2-tp2"])
def test_cfg2_composes_with_context_and_tensor_parallel(degrees, reference, tmp_path):
    extra = ["--trainer.devices", "4", *MESH, "--trainer.strategy.init_args.cfg", "2"]
    for key, value in degrees.items():
        extra += [f"--trainer.strategy.init_args.{key}", str(value)]
    if "ulysses" in degrees:
        extra += ["--trainer.strategy.init_args.ulysses_anything", "true"]
    proc = run_cli(*tiny_args(tmp_path, "--data.batch_size", "1", *extra, config=QWEN))
    log = proc.stdout + proc.stderr
    shape = {"dp": 1, "cfg": 2, "ring": 1, "ulysses": 1, "tp": 1, **degrees}
    assert "device mesh ({}) over 4 processes".format(", ".join(f"{k}={v}" for k, v in shape.items())) in log
    assert NO_SPLIT not in log
    assert_matches(tmp_path, reference(QWEN))


@pytest.mark.slow
def test_flux_true_cfg_and_two_replicas_of_a_pair(tmp_path):
    # FLUX.1 with true CFG: a negative prompt for every image and true_cfg_scale > 1; 4 processes
    # are 2 replicas of a pair, so this also checks that only one rank of each pair writes.
    cfg = ("--data.prompts", "configs/prompts/example-negative.jsonl", "--data.batch_size", "1",
           "--model.call_kwargs.true_cfg_scale", "2.5")
    single = tmp_path / "single"
    run_here(*tiny_args(single, *cfg))
    out = tmp_path / "cfg"
    proc = run_cli(*tiny_args(out, *cfg, "--trainer.devices", "4", "--trainer.strategy", "cfg_parallel"))
    log = proc.stdout + proc.stderr
    assert "device mesh (dp=2, cfg=2, ring=1, ulysses=1, tp=1) over 4 processes" in log
    assert NO_SPLIT not in log
    assert len(list(out.glob("*.png"))) == 5
    assert_matches(out, load_arrays(single))


@pytest.mark.slow
def test_wan_video_cfg2_matches_one_process(tmp_path):
    video = ("--data.batch_size", "1", "--data.prompts", "[a fox running, waves at night]")
    config = "configs/tiny-wan.yaml"
    single = tmp_path / "single"
    run_here(*tiny_args(single, *video, config=config))
    out = tmp_path / "cfg"
    proc = run_cli(*tiny_args(out, *video, "--trainer.devices", "2", "--trainer.strategy", "cfg_parallel",
                              config=config))
    assert "WanPipeline's cond and uncond passes" in proc.stderr + proc.stdout
    assert NO_SPLIT not in proc.stdout + proc.stderr
    assert_matches(out, load_arrays(single), count=2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data.prompts", FIVE_PROMPTS], "cfg=2 needs a negative prompt for every image"),
        (["--model.call_kwargs.true_cfg_scale", "1.0"], "runs it only with true_cfg_scale > 1 (got 1.0)"),
        (["--trainer.devices", "1"], "world size 1 is not divisible by cfg 2 x ring 1 x ulysses 1 x tp 1 = 2"),
    ],
    ids=["no-negative-prompts", "cfg-scale-1", "one-process"],
)
def test_configs_without_a_negative_branch_are_refused(extra, message, tmp_path, cli_here):
    proc = cli_here(*tiny_args(tmp_path, "--trainer.devices", "2", "--trainer.strategy", "cfg_parallel", *extra,
                               config=QWEN))
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir()), "nothing written"


def test_flux_without_true_cfg_is_refused(tmp_path, cli_here):
    proc = cli_here(*tiny_args(tmp_path, "--data.prompts", FIVE_PROMPTS, "--trainer.devices", "2",
                               "--trainer.strategy", "cfg_parallel"))
    assert proc.returncode == 2
    assert "FluxPipeline runs it only with true_cfg_scale > 1 (got 1.0)" in proc.stderr


def test_pipelines_without_a_table_entry_are_refused():
    (problem,) = cfg_problems("StableDiffusion3Pipeline", {"guidance_scale": 7.0}, lambda name: None, None)
    assert "StableDiffusion3Pipeline is not one. Supported: FluxPipeline" in problem


def test_cfg_degree_is_one_or_two():
    with pytest.raises(ConfigError, match="cfg degree must be 1 or 2"):
        MeshStrategy(cfg=3)
    assert CFGParallelStrategy().degrees() == {"dp": -1, "cfg": 2, "ring": 1, "ulysses": 1, "tp": 1}


def test_the_split_is_a_named_removable_hook_outside_the_context_parallel_ones(tmp_path):
    """Installed on a real tiny Qwen-Image pipeline (no process group is needed to install it):
    the hook sits last in the transformer's registry, so it wraps hooks registered before it, and
    ``remove`` restores diffusers' own forward and ``encode_prompt``."""
    from diffusers import DiffusionPipeline
    from diffusers.hooks import HookRegistry, ModelHook

    from lightning_diffusion.pipelines import tiny
    from lightning_diffusion.pipelines.specs import spec_for
    from lightning_diffusion.strategies.cfg_parallel_hooks import HOOK_NAME, CFGSplit

    pipe = DiffusionPipeline.from_pretrained(tiny.resolve("tiny:qwenimage"))
    registry = HookRegistry.check_if_exists_or_initialize(pipe.transformer)
    registry.register_hook(ModelHook(), "stands_for_context_parallel")
    forward, encode = pipe.transformer.forward, pipe.encode_prompt
    split = CFGSplit(pipe, spec_for("QwenImagePipeline").cfg, group=None, branch=0)
    assert registry._hook_order == ["stands_for_context_parallel", HOOK_NAME]
    assert pipe.transformer.forward is not forward and pipe.encode_prompt != encode
    split.remove()
    assert registry._hook_order == ["stands_for_context_parallel"]
    assert pipe.transformer.forward == forward and pipe.encode_prompt == encode
