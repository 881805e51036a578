"""``ParallelDims``: the one place that knows the parallel degrees and builds the device mesh.

The mesh has the dimensions ``("dp", "cfg", "ring", "ulysses", "tp")`` in that order, heaviest
traffic innermost: tensor-parallel ranks are adjacent global ranks (same node), a CFG pair
exchanges one noise prediction per step, data-parallel replicas are outermost (the only dimension
that may span nodes at no cost). Everything else asks this object
for sizes, ranks and sub-meshes; nothing else multiplies degrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_diffusion.core.console import counted
from lightning_diffusion.core.errors import ConfigError, is_int, raise_problems
from lightning_diffusion.pipelines import compat

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

MESH_DIMS = ("dp", "cfg", "ring", "ulysses", "tp")


class MeshError(ConfigError):
    """Parallel degrees that do not fit the world size or the model."""


@dataclass
class ParallelDims:
    """Parallel degrees for ``world_size`` processes; ``-1`` for one degree means "infer it".

    ``dp`` is the number of replicas; in each replica ``cfg`` ranks share the guidance passes,
    ``ring`` and ``ulysses`` form the context-parallel group and ``tp`` the tensor-parallel group.
    """

    world_size: int
    dp: int = -1
    cfg: int = 1
    ring: int = 1
    ulysses: int = 1
    tp: int = 1

    @staticmethod
    def degree_problems(degrees: dict[str, int]) -> list[ConfigError]:
        """Each degree is an integer >= 1, or -1 for at most one of them (the first problem, a ``MeshError``)."""
        for name, value in degrees.items():
            if not is_int(value) or (value < 1 and value != -1):
                return [MeshError(f"{name} degree must be an integer >= 1 (or -1 to infer it), got {value!r}.")]
        inferred = [name for name, value in degrees.items() if value == -1]
        if len(inferred) > 1:
            return [MeshError(f"Only one degree may be inferred (-1); got {', '.join(inferred)}.")]
        return []

    def __post_init__(self) -> None:
        degrees = self.degrees
        raise_problems(self.degree_problems(degrees))
        inferred = [name for name, value in degrees.items() if value == -1]
        known = 1
        for value in degrees.values():
            if value != -1:
                known *= value
        if inferred:
            if self.world_size % known:
                raise MeshError(
                    f"The world size {self.world_size} is not divisible by {self._describe(skip=inferred[0])} = "
                    f"{known}; "
                    f"launch a multiple of {known} processes (devices x num_nodes) or lower the degrees."
                )
            setattr(self, inferred[0], self.world_size // known)
        elif known != self.world_size:
            raise MeshError(
                f"{self._describe()} = {known} processes, but the world size is {self.world_size} "
                "(devices x num_nodes); make the product equal the world size."
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}

    def _shown(self) -> dict[str, int]:
        """The degrees as messages show them: ``cfg`` only when it is used."""
        return {name: value for name, value in self.degrees.items() if name != "cfg" or value != 1}

    def _describe(self, skip: Optional[str] = None) -> str:
        return " x ".join(f"{name} {value}" for name, value in self._shown().items() if name != skip)

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    def context_degree_problems(self, ulysses_anything: bool = False, ring_anything: bool = False
                                ) -> list[ConfigError]:
        """diffusers' own rules for the context-parallel degrees and anything-modes (its
        ``ContextParallelConfig`` validation, run here without a mesh), plus the TP pairings this
        project has not verified against one device (the first problem, a ``MeshError``)."""
        if self.cp == 1:
            if ulysses_anything or ring_anything:
                which = "ulysses_anything" if ulysses_anything else "ring_anything"
                return [MeshError(f"{which} needs a context-parallel degree > 1 (ulysses or ring).")]
            return []
        from diffusers import ContextParallelConfig

        try:
            ContextParallelConfig(ring_degree=self.ring, ulysses_degree=self.ulysses,
                                  ulysses_anything=ulysses_anything, ring_anything=ring_anything)
        except (ValueError, NotImplementedError) as err:
            return [MeshError(f"context parallelism (ring {self.ring} x ulysses {self.ulysses}): {err}")]
        if self.tp > 1:
            if self.ring > 1 and self.ulysses > 1:
                return [MeshError(
                    "tp with both ring and ulysses > 1 is refused: that pairing is not verified against one "
                    "device; use tp with ulysses or with ring."
                )]
            if ulysses_anything or ring_anything:
                return [MeshError(
                    "tp with an anything-mode is refused: that pairing is not verified against one device; "
                    "choose sizes whose token count divides the context-parallel degree."
                )]
        return []

    @property
    def model_parallel_size(self) -> int:
        """Processes that work together on the same images (one replica)."""
        return self.cfg * self.cp * self.tp

    @property
    def shard_size(self) -> int:
        """Processes that hold pieces of the same transformer call (ring x ulysses x tp)."""
        return self.cp * self.tp

    def shard_groups(self) -> list[list[int]]:
        """Global ranks of each shard group: ranks with the same ``dp`` and ``cfg`` coordinates,
        which are ``shard_size`` adjacent ranks (the mesh's innermost dimensions)."""
        return self._adjacent(self.shard_size)

    def _adjacent(self, size: int) -> list[list[int]]:
        """The world's ranks in runs of ``size`` adjacent ranks (the mesh is row-major, so the
        innermost dimensions of one outer coordinate are adjacent)."""
        return [list(range(start, start + size)) for start in range(0, self.world_size, size)]

    def build_mesh(self, device_type: str, timeout: Optional[timedelta] = None) -> DeviceMesh:
        """The named mesh; with ``timeout``, every group it holds waits that long in a collective
        (``init_device_mesh`` takes no timeout: its groups would wait torch's default, 10 min on
        NCCL and 30 on gloo). Under context parallelism the ``ring_ulysses`` group diffusers
        flattens is made here too, with the others, before any weight loads."""
        mesh = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS)
        if self.cp > 1:
            mesh["ring", "ulysses"]._flatten()  # diffusers' ContextParallelConfig.setup finds it made
        if timeout is not None:
            for group in mesh_groups(mesh):
                compat.set_collective_timeout(timeout, group)
        return mesh

    def build_groups(self, device_type: str, rank: int, timeout: timedelta, shard_group: bool) -> "ProcessGroups":
        """Every process group a strategy uses inside a step, made at once by every rank in the same
        order (before any weight loads: with a bound device, each is an NCCL communicator split over
        all ranks, which would block ranks that finished loading first), each with ``timeout``."""
        mesh = self.build_mesh(device_type, timeout)
        replica = new_groups(self.replica_groups(), rank, timeout)
        shard = new_groups(self.shard_groups(), rank, timeout) if shard_group else None
        return ProcessGroups(mesh, replica, shard)

    def replica_groups(self) -> list[list[int]]:
        """Global ranks of each replica, in order: ranks ``r`` with the same ``r // model_parallel_size``."""
        return self._adjacent(self.model_parallel_size)

    def describe(self) -> str:
        shape = ", ".join(f"{name}={value}" for name, value in self._shown().items())
        groups = "; ".join(f"replica {i}: ranks {group}" for i, group in enumerate(self.replica_groups()))
        return f"device mesh ({shape}) over {counted(self.world_size, 'process', 'processes')}: {groups}"


def mesh_coordinate(mesh: DeviceMesh) -> dict[str, int]:
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not part of the mesh"
    return dict(zip(mesh.mesh_dim_names or MESH_DIMS, coordinate))


@dataclass
class ProcessGroups:
    """A rank's groups: the mesh, its replica's group and its shard group (``None`` where the
    group would be the rank alone, or is not needed)."""

    mesh: DeviceMesh
    replica: Optional[ProcessGroup]
    shard: Optional[ProcessGroup]

    def all(self) -> list[ProcessGroup]:
        """Every group made for this rank (the mesh's dimensions and flattened groups included)."""
        return mesh_groups(self.mesh) + [group for group in (self.replica, self.shard) if group is not None]


def mesh_groups(mesh: DeviceMesh) -> list[ProcessGroup]:
    """The process groups of this rank in ``mesh``: one per dimension, and the flattened ones."""
    flattened = mesh._get_root_mesh()._flatten_mapping  # not sliced by name: deprecated for flattened dims
    return [mesh[name].get_group() for name in mesh.mesh_dim_names or ()] + [m.get_group() for m in flattened.values()]


def new_groups(groups: list[list[int]], rank: int, timeout: timedelta) -> Optional[ProcessGroup]:
    """Create every group of ``groups`` (every rank creates every group, in the same order) and
    return ``rank``'s; ``None`` when the groups are single ranks."""
    if len(groups[0]) == 1:
        return None
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine
