"""GPUs bound to tasks: sites (and ``srun --gpus-per-task``, ``--gpu-bind=single:1``) that show each
SLURM task only its own GPU(s), numbered from 0, while ``trainer.devices`` counts the node's tasks.

Lightning reads ``devices: 8`` as GPUs 0..7 of this process and refuses it when the process sees one
("You requested gpu: [0, ..., 7] But your machine only has: [0]"), and ranks would take
``cuda:LOCAL_RANK``, which does not exist there. ``TaskBoundCUDAAccelerator`` reads ``devices`` as
the node's task count and gives every rank the first of its own visible GPUs; ``accelerator_for_job``
picks it when the environment says the GPUs are bound, so one config runs under both site policies.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional, Union

import torch
from lightning.pytorch.accelerators import CUDAAccelerator

if TYPE_CHECKING:
    from lightning.pytorch.accelerators import Accelerator


def slurm_tasks_per_node(environ: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node of an ``srun`` step: ``SLURM_NTASKS_PER_NODE``, else the first figure of
    ``SLURM_TASKS_PER_NODE`` ("8(x2)"); None outside a SLURM task."""
    if "SLURM_LOCALID" not in environ:
        return None
    for variable in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        found = re.match(r"\s*(\d+)", environ.get(variable, ""))
        if found:
            return int(found.group(1))
    return None


def allocated_gpus(environ: Mapping[str, str]) -> Optional[int]:
    """GPUs SLURM allocated to this job on this node (``SLURM_GPUS_ON_NODE``, else the count of
    ``SLURM_JOB_GPUS``); None where it does not say."""
    found = re.match(r"\s*(\d+)", environ.get("SLURM_GPUS_ON_NODE", ""))
    if found:
        return int(found.group(1))
    listed = [part for part in environ.get("SLURM_JOB_GPUS", "").split(",") if part.strip()]
    return len(listed) or None


def gpus_bound_to_tasks(visible_gpus: int, tasks_per_node: Optional[int], gpus_per_task: int = 1,
                        allocated: Optional[int] = None) -> bool:
    """Whether each task of the node sees only its own GPUs: several tasks on the node, SLURM gave
    the node enough GPUs for all of them, and this task sees exactly the ``gpus_per_task`` it uses.
    (A node that simply has too few GPUs is not bound: Lightning refuses it, as it should.)"""
    if tasks_per_node is None or tasks_per_node < 2 or visible_gpus < 1 or allocated is None:
        return False
    return visible_gpus == gpus_per_task and allocated >= tasks_per_node * gpus_per_task


def requested_count(devices: object) -> Optional[int]:
    """How many devices a ``trainer.devices`` value asks for (None for ``auto`` / ``-1``)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if text in ("auto", "-1"):
        return None
    if "," in text:
        return len([part for part in text.split(",") if part.strip()])
    return int(text) if text.isdigit() else None


class TaskBoundCUDAAccelerator(CUDAAccelerator):
    """CUDA for tasks that each see only their own GPU(s): ``devices`` counts the node's tasks and
    every rank's device is ``cuda:0``, the first of its own."""

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> list[int]:
        count = requested_count(devices)
        if count is None:
            count = TaskBoundCUDAAccelerator.auto_device_count()
        return list(range(count))

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("cuda", 0) for _ in devices]

    @staticmethod
    def auto_device_count() -> int:
        return slurm_tasks_per_node(os.environ) or 1

    @classmethod
    def register_accelerators(cls, accelerator_registry: object) -> None:
        pass  # passed as an instance (``accelerator_for_job``), never by name


def accelerator_for_job(accelerator: Union[str, Accelerator], devices: object, gpus_per_task: int = 1,
                        environ: Optional[Mapping[str, str]] = None,
                        visible_gpus: Optional[int] = None) -> Union[str, Accelerator]:
    """The accelerator to build the Trainer with: ``accelerator`` as given, or a
    ``TaskBoundCUDAAccelerator`` when this is a SLURM task that sees only its own ``gpus_per_task``
    GPUs and ``devices`` asks for the node's tasks (or ``auto``)."""
    if str(accelerator) not in ("auto", "gpu", "cuda"):
        return accelerator
    environ = os.environ if environ is None else environ
    tasks = slurm_tasks_per_node(environ)
    if visible_gpus is None:
        visible_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus_bound_to_tasks(visible_gpus, tasks, gpus_per_task, allocated_gpus(environ)):
        return accelerator
    if requested_count(devices) not in (None, tasks):
        return accelerator  # Lightning reports the mismatch with SLURM's task count itself
    return TaskBoundCUDAAccelerator()
