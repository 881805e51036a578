"""MeshStrategy: data x context x tensor parallelism on one mesh, including TP x CP on one transformer.

Tolerance as for the single strategies: decoded float images within 1e-5 of one process with the
same seeds and batch size (measured at most 1.8e-6 for every mesh below).
"""

import numpy as np
import pytest
from lightning.pytorch import Trainer

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.strategies import MeshError, MeshStrategy
from tests.conftest import FIVE_PROMPTS, check_model, load_arrays, read_manifest_lines, run_cli, tiny_args

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


def _groups_worker(rank: int, port: int, out: str) -> None:
    import json
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_diffusion.pipelines.compat import collective_timeout
    from lightning_diffusion.strategies.parallel_dims import ParallelDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(minutes=5))
    try:
        found = {}
        for name, degrees in {"dp2-ulysses2": dict(dp=2, ulysses=2), "cfg2-ring2": dict(cfg=2, ring=2)}.items():
            groups = ParallelDims(world_size=4, **degrees).build_groups("cpu", rank, timedelta(seconds=77),
                                                                         shard_group=True)
            found[name] = {"timeouts": [collective_timeout(g).total_seconds() for g in groups.all()],
                           "flattened": sorted(groups.mesh._get_root_mesh()._flatten_mapping),
                           "replica": dist.get_process_group_ranks(groups.replica),
                           "shard": dist.get_process_group_ranks(groups.shard)}
        with open(f"{out}/{rank}.json", "w") as f:
            json.dump(found, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_group_a_strategy_makes_waits_the_strategy_timeout(tmp_path):
    """init_device_mesh and new_group(timeout=None) give their groups torch's default (10 min on
    NCCL, 30 on gloo), not the strategy's: the context-parallel all-to-all, the CFG exchange, group
    work and the stop agreement would wait that long for a dead peer. Read back from each group's
    backend: the mesh's dimensions, the ring x ulysses group diffusers flattens (made with the
    others, before any weight), the replica and the shard group."""
    import json
    import socket

    import torch.multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_groups_worker, args=(port, str(tmp_path)), nprocs=4)
    for rank in range(4):
        found = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, groups in found.items():
            assert groups["timeouts"] and set(groups["timeouts"]) == {77.0}, (rank, name, groups)
        dp_ulysses, cfg_ring = found["dp2-ulysses2"], found["cfg2-ring2"]
        assert len(dp_ulysses["timeouts"]) == 5 + 1 + 2  # 5 dimensions, ring_ulysses, replica, shard
        assert dp_ulysses["flattened"] == cfg_ring["flattened"] == ["ring_ulysses"]
        assert dp_ulysses["replica"] == dp_ulysses["shard"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert cfg_ring["replica"] == [0, 1, 2, 3] and cfg_ring["shard"] == [rank // 2 * 2, rank // 2 * 2 + 1]
