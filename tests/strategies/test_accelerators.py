"""GPUs bound to SLURM tasks (issue 23.6): where a site shows each task only its own GPU, ``devices: 8``
counts the node's tasks and every rank uses the first GPU it sees; where all GPUs are visible, nothing
changes. The decision is a function of the environment and the visible GPU count, tested here; the
two-task run on real GPUs is ``scripts/gpu-check --only one-gpu-per-task``."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_diffusion.core.errors import NodeConfigError
from lightning_diffusion.strategies import DeviceMapStrategy
from lightning_diffusion.strategies.accelerators import (
    TaskBoundCUDAAccelerator,
    accelerator_for_job,
    gpus_bound_to_tasks,
    slurm_tasks_per_node,
)

TASK = {"SLURM_LOCALID": "3", "SLURM_PROCID": "3", "SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "8"}


def test_tasks_per_node_come_from_slurm_only_inside_a_task():
    assert slurm_tasks_per_node(TASK) == 8
    assert slurm_tasks_per_node({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4(x2)"}) == 4
    assert slurm_tasks_per_node({"SLURM_NTASKS_PER_NODE": "8"}) is None  # the batch script, not a task


@pytest.mark.parametrize("visible, tasks, per_task, allocated, bound", [
    (1, 8, 1, 8, True),     # --gpus-per-task=1 / --gpu-bind=single:1
    (2, 4, 2, 8, True),     # device maps of 2 GPUs a process, bound per task
    (8, 8, 1, 8, False),    # every GPU of the node visible (our own scripts: --gpu-bind=none)
    (1, 1, 1, 1, False),    # one task, one GPU: nothing to reinterpret
    (0, 8, 1, 8, False),    # no GPU: a CPU rehearsal
    (4, 8, 1, 8, False),    # a partial view is not a binding we understand: Lightning reports it
    (1, 2, 1, 1, False),    # a node with one GPU for two tasks: too few, not bound (Lightning refuses it)
    (1, 8, 1, None, False),  # SLURM says nothing of the allocation: not assumed
])
def test_gpus_are_bound_when_a_task_sees_exactly_its_own(visible, tasks, per_task, allocated, bound):
    assert gpus_bound_to_tasks(visible, tasks, per_task, allocated) is bound


def test_the_job_gets_the_task_bound_accelerator_only_when_bound():
    assert isinstance(accelerator_for_job("gpu", 8, 1, TASK, visible_gpus=1), TaskBoundCUDAAccelerator)
    assert isinstance(accelerator_for_job("auto", "auto", 1, TASK, visible_gpus=1), TaskBoundCUDAAccelerator)
    assert accelerator_for_job("gpu", 8, 1, TASK, visible_gpus=8) == "gpu"
    assert accelerator_for_job("cpu", 8, 1, TASK, visible_gpus=1) == "cpu"
    assert accelerator_for_job("gpu", 8, 1, {}, visible_gpus=1) == "gpu"  # not a SLURM task
    assert accelerator_for_job("gpu", 4, 1, TASK, visible_gpus=1) == "gpu"  # disagrees with SLURM: Lightning says so
    job_gpus = {**{k: v for k, v in TASK.items() if k != "SLURM_GPUS_ON_NODE"}, "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}
    assert isinstance(accelerator_for_job("gpu", 8, 1, job_gpus, visible_gpus=1), TaskBoundCUDAAccelerator)
    assert accelerator_for_job("gpu", 8, 1, {**TASK, "SLURM_GPUS_ON_NODE": "1"}, visible_gpus=1) == "gpu"


def test_devices_count_the_tasks_and_every_rank_takes_its_first_visible_gpu(monkeypatch):
    assert TaskBoundCUDAAccelerator.parse_devices(8) == list(range(8))
    assert TaskBoundCUDAAccelerator.parse_devices("0,1,2,3") == [0, 1, 2, 3]
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert TaskBoundCUDAAccelerator.parse_devices("auto") == [0, 1, 2, 3]
    assert TaskBoundCUDAAccelerator.get_parallel_devices([0, 1, 2, 3]) == [torch.device("cuda", 0)] * 4


def _device_map(local_rank: int, bound: bool, monkeypatch) -> DeviceMapStrategy:
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    strategy = DeviceMapStrategy(devices_per_process=2)
    strategy.cluster_environment = LightningEnvironment()
    strategy.parallel_devices = [torch.device("cuda", 0 if bound else 2 * i) for i in range(4)]
    if bound:
        strategy.accelerator = TaskBoundCUDAAccelerator()
    return strategy


def test_a_device_map_process_owns_the_gpus_it_sees_when_bound(monkeypatch):
    bound = _device_map(3, True, monkeypatch)
    assert bound.gpus_bound_to_tasks
    assert bound.root_device == torch.device("cuda", 0) and bound.gpu_indices() == [0, 1]
    visible = _device_map(3, False, monkeypatch)
    assert not visible.gpus_bound_to_tasks
    assert visible.root_device == torch.device("cuda", 6) and visible.gpu_indices() == [6, 7]


def test_a_bound_device_map_counts_the_gpus_of_its_own_task(monkeypatch):
    """4 tasks x 2 GPUs, each task seeing its own 2: no '8 GPUs but this node has 2' refusal; a
    task that sees fewer than devices_per_process is refused with what it sees."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _device_map(3, True, monkeypatch).check_devices() == []
    visible = _device_map(0, False, monkeypatch)
    # A problem of this node's hardware, which other nodes may not share (see predict.error_line).
    with pytest.raises(NodeConfigError, match="4 processes x devices_per_process 2 = 8 GPUs, but this node has 2"):
        raise visible.check_devices()[0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(NodeConfigError, match="devices_per_process 2 GPUs, but this task sees 1"):
        raise _device_map(0, True, monkeypatch).check_devices()[0]
