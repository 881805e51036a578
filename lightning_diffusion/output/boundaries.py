"""What the parts of a run hand each other, declared once (``contract`` holds the strategy <-> module
joint: ``ModelRequest``, ``LoadPlan``, ``DiffusionStrategy``, ``DiffusionModel``).

- data -> writer: a ``PromptSource`` (``PromptDataModule``) hands the writer a ``RunPlan`` at setup
  (the prompt set, seeds, image count and shard), takes back the indices already made, and says
  which images its rejected records leave out and what the batch plan was;
- module -> writer: an ``ImageSource`` (``DiffusionModule``) says what decides its pictures
  (``image_settings``) and what this rank computed (``stats``);
- strategy -> module, data and writer: a ``RunStrategy`` (``DiffusionParallelStrategy`` and its
  subclasses) carries the run's ``RunContext``, names the ranks that write and gives a process
  group without a collective timeout. Lightning's own strategies may run a ``DiffusionModule``
  too: ``run_strategy`` answers None for them, and each reader says what it does then.

The writer checks its data module and module with ``require`` when the run starts, so that a
replaced part that lacks a piece fails at the start, naming what it lacks, not with a ``None``
mid-run.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Callable,
    Literal,
    Optional,
    Protocol,
    TypedDict,
    TypeVar,
    Union,
    cast,
    runtime_checkable,
)

from lightning_diffusion.core.checks import LEASE_S
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.core.records import Record, RejectedLine, RunSettings
from lightning_diffusion.output.shard import Batches, Shard, shard_size

if TYPE_CHECKING:
    import os

    import numpy as np
    from torch.distributed import ProcessGroup

    from lightning_diffusion.core.context import RunContext
    from lightning_diffusion.output.fence import Claim
    from lightning_diffusion.output.pool import Pool, PoolFiles


@dataclass(frozen=True)
class RunPlan:
    """The prompt set a run is for, as the data module hands it to the writer.

    ``prompts``: the set as configured (a path, recorded in run.json with its content hash, or an
    inline list); ``num_images``: every shard's images; ``shard``: the one this run makes, or None;
    ``files``: the files of a set read from several (a folder or glob of Parquet files, a dataset),
    whose contents are its hash; ``reading``: the settings that shape its records (``data.columns``,
    ``data.keep_columns``, ``data.split``), where set; ``pull``: the job joins a pool of workers
    that pull batches (``data.schedule: pull``); ``adapter_sets``: the sets of adapters its records
    choose (recorded in run.json; ``status`` says it).
    """

    prompts: Union[str, os.PathLike[str], Sequence[object]]
    seed: int
    num_images_per_prompt: int
    num_images: int
    shard: Optional[Shard] = None
    files: tuple[str, ...] = ()
    reading: Optional[RunSettings] = None  # how the prompt set is read, as run.json records it
    pull: bool = False  # ``data.schedule: pull``: the run's workers pull batches from a pool in the output
    lease_s: float = LEASE_S  # ``data.lease_s``, with ``pull``
    batch_size: int = 1  # ``data.batch_size`` and ``data.bucket``: a pool's jobs must plan the same batches
    bucket: bool = True
    adapter_sets: int = 0  # how many sets of adapters its records choose (``model.adapters``; 0: none chooses)

    @property
    def expected(self) -> int:
        """The images this run is for (its shard's)."""
        return shard_size(self.num_images, self.shard)


@runtime_checkable
class PromptSource(Protocol):
    """A data module as the writer reads it (``PromptDataModule``)."""

    # The batch plan of this rank's last ``predict_dataloader`` (None before it): its buckets go into
    # the run's summary.
    plan: Optional[Batches]

    def run_plan(self) -> RunPlan:
        ...

    def skip_indices(self, indices: np.ndarray) -> None:
        """Leave out the images already made (the writer calls it before the work is split)."""
        ...

    def rejected_images(self) -> "np.ndarray":
        """This run's images of the records ``data.on_bad_record: skip`` leaves out."""
        ...

    def rejected_lines(self) -> list[RejectedLine]:
        """``rejected.jsonl``'s lines: each rejected record, its file:line, reason and images."""
        ...


@runtime_checkable
class RecordSource(Protocol):
    """A data module whose prompt records the strategy's checks read before loading (their sizes
    and input images: ``PromptDataModule``); any other runs without those checks."""

    records: Sequence[Record]


@runtime_checkable
class PoolSource(Protocol):
    """A data module whose workers pull batches from a pool (``PromptDataModule`` with
    ``data.schedule: pull``), as the writer drives it."""

    def use_pool(self, files: PoolFiles, job: str, worker: Optional[Pool] = None) -> None:
        """Pull batches from the pool kept in ``files`` (``pool.PoolFiles``), as job ``job``
        (``data.schedule: pull``; the writer calls it at setup); ``worker``: the registration the
        store made when the job joined (``pool.Pool``, on global rank 0)."""
        ...

    def claim_of(self, batch_indices: Optional[Sequence[object]]) -> Union[Claim, None, Literal[False]]:
        """The claim this worker holds the batch of ``batch_indices`` under (``fence.Claim``: its
        images are published under it), False once another worker took the batch over, None for a
        batch that is not a pool's."""
        ...

    def leave_pool(self, ended: bool) -> None:
        """Stop working in the pool: ``ended`` once every image this worker made is recorded,
        else failed (its batches are taken over at once)."""
        ...


@runtime_checkable
class ShardSource(Protocol):
    """A data module that makes one shard of a job array (``PromptDataModule`` with
    ``data.num_shards`` over 1), as the writer drives it."""

    def use_shard(self, shard: Shard) -> None:
        """Make ``shard``'s images, as its plan deals them: the plan the output location recorded
        for the array, which its first task made (``shard.adopt``; the writer calls it at setup)."""
        ...


class WorkStats(TypedDict):
    """What a rank computed: images ``computed`` (padding included), those ``kept`` (returned) and
    its seconds in pipeline calls (``busy_s``); the writer gathers them into run.json's summary."""

    computed: int
    kept: int
    busy_s: float


@runtime_checkable
class ImageSource(Protocol):
    """A LightningModule as the writer reads it (``DiffusionModule``)."""

    stats: WorkStats  # what this rank computed

    def image_settings(self) -> RunSettings:
        """The settings that decide the pictures, as run.json records them."""
        ...


@runtime_checkable
class SideOutputSource(Protocol):
    """A LightningModule that hands each image's latents and prompt embeddings to the writer
    (``writer.save_latents``, ``writer.save_text_embeddings``; ``DiffusionModule``)."""

    def save_side_outputs(self, latents: bool, text_embeddings: bool) -> None:
        """Capture the side outputs asked for in each result's ``sides``; a ConfigError, before any
        weight loads, where the pipeline has none."""
        ...


class RunStrategy(Protocol):
    """A strategy as the module, the data module and the writer read it."""

    run_context: "RunContext"
    # Whether this rank writes the images it returns (one rank of each model-parallel group does).
    writes_outputs: bool
    # A gloo group without the collective timeout, for gathers that wait on the slowest rank.
    idle_group: Optional[ProcessGroup]

    def replica_share(self) -> Optional[Callable[[object], object]]:
        """Hands the replica's writing rank's object to its other ranks; None for a replica of one."""
        ...


def run_strategy(strategy: object) -> Optional[RunStrategy]:
    """``strategy`` where it is one of this project's, else None (a Lightning strategy of another
    kind: every rank writes, gathers use the default group, no run context)."""
    # Looked up statically: a strategy's properties (``writes_outputs``) are only answered once its
    # processes have started.
    found = all(_static(strategy, name) for name in _members(RunStrategy))
    return cast(RunStrategy, strategy) if found else None


_P = TypeVar("_P")


def require(part: object, protocol: Callable[..., _P], role: str) -> _P:
    """``part`` (a data module, a LightningModule) as a ``protocol``; refused, naming what it lacks,
    where it is not one."""
    # ``protocol`` is a runtime-checkable Protocol class, typed as what makes a ``_P``: mypy takes
    # no Protocol class where ``type[_P]`` is expected.
    if isinstance(part, cast(type, protocol)):
        return cast(_P, part)
    members = _members(cast(type, protocol))
    missing = [name for name in members if not hasattr(part, name)]
    what = "nothing" if part is None else type(part).__name__
    raise ConfigError(f"the writer needs {role} that provides {', '.join(members)} ({protocol.__name__} in "
                      f"lightning_diffusion.output.boundaries); got {what}"
                      + (f", which lacks {', '.join(missing)}" if part is not None and missing else "") + ".")


def _members(protocol: type) -> list[str]:
    """A protocol's attributes and methods, in the order it declares them."""
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    return [*vars(protocol).get("__annotations__", {}), *methods]


def _static(part: object, name: str) -> bool:
    try:
        inspect.getattr_static(part, name)
    except AttributeError:
        return False
    return True
