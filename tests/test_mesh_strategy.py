"""MeshStrategy: data x context x tensor parallelism on one mesh, including TP x CP on one transformer.

Tolerance as for the single strategies: decoded float images within 1e-5 of one process with the
same seeds and batch size (measured at most 1.8e-6 for every mesh below).
"""

import numpy as np
import pytest
from lightning.pytorch import Trainer

from lightning_diffusion import DiffusionModule
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.strategies import MeshError, MeshStrategy
from tests.conftest import check_model, FIVE_PROMPTS, load_arrays, read_manifest_lines, run_cli, tiny_args

ATOL = 1e-5
# dp x ulysses and dp x tp are run by test_context_parallel.py (dp2-ulysses2) and
# test_tensor_parallel.py (flux-4); here the meshes that only MeshStrategy makes.
MESHES = {
    "tp2-ulysses2": dict(tp=2, ulysses=2, dp=1),
    "tp2-ring2": dict(tp=2, ring=2, dp=1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_matches_one_process(name, reference, tmp_path):
    degrees = MESHES[name]
    extra = ["--trainer.devices", "4", "--trainer.strategy.class_path", "lightning_diffusion.strategies.MeshStrategy"]
    for key, value in degrees.items():
        extra += [f"--trainer.strategy.init_args.{key}", str(value)]
    proc = run_cli(*tiny_args(tmp_path, "--data.prompts", FIVE_PROMPTS, "--data.batch_size", "1", *extra))
    log = proc.stdout + proc.stderr
    shape = {"dp": 1, "ring": 1, "ulysses": 1, "tp": 1, **degrees}
    assert "device mesh ({}) over 4 processes".format(", ".join(f"{k}={v}" for k, v in shape.items())) in log
    if shape["tp"] > 1:
        assert "loaded shard by shard" in log
    if shape["ring"] * shape["ulysses"] > 1:
        mode = "ring" if shape["ring"] > 1 else "ulysses"
        assert f"context parallel {mode} " in log
        if shape["tp"] > 1:
            assert "on tp=2 shards" in log  # CP composed onto the TP-sharded transformer
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == list(range(5))
    assert len(list(tmp_path.glob("*.png"))) == 5
    ours, ref = load_arrays(tmp_path), reference()
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


def mesh_trainer(devices, **degrees):
    return Trainer(accelerator="cpu", devices=devices, strategy=MeshStrategy(**degrees), logger=False)


@pytest.mark.parametrize(
    "devices, degrees, message",
    [
        (4, dict(dp=2, tp=1), r"dp 2 x ring 1 x ulysses 1 x tp 1 = 2 processes, but the world size is 4"),
        (4, dict(dp=-1, tp=3), r"world size 4 is not divisible by ring 1 x ulysses 1 x tp 3 = 3"),
        (4, dict(dp=-1, ulysses=-1), r"Only one degree may be inferred"),
    ],
)
def test_meshes_that_do_not_fit_the_world(devices, degrees, message):
    with pytest.raises(MeshError, match=message):
        mesh_trainer(devices, **degrees)


def test_degree_of_zero():
    with pytest.raises(MeshError, match="tp degree must be an integer >= 1"):
        MeshStrategy(tp=0)


def test_tp_times_ulysses_must_divide_heads():
    trainer = mesh_trainer(8, dp=1, tp=2, ulysses=4)
    with pytest.raises(ConfigError, match="4 attention heads, not divisible by tp x ulysses = 2 x 4"):
        check_model(trainer.strategy, DiffusionModule("tiny:flux", height=64, width=64))


@pytest.mark.parametrize(
    "degrees, message",
    [
        (dict(dp=1, tp=2, ring=2, ulysses=2), "tp with both ring and ulysses > 1 is refused"),
        (dict(dp=1, tp=2, ulysses=2, ulysses_anything=True), "tp with an anything-mode is refused"),
    ],
)
def test_unverified_pairings_are_refused(degrees, message):
    devices = degrees["tp"] * degrees.get("ring", 1) * degrees.get("ulysses", 1)
    with pytest.raises(ConfigError, match=message):
        mesh_trainer(devices, **degrees)
