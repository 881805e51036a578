"""The contract between ``DiffusionModule`` and a strategy, both ways: ``DiffusionModel`` is what
a strategy may call on the module, ``DiffusionStrategy`` what the module's run needs of a strategy.

A strategy reads a ``ModelRequest`` (what is known of the model before any weight loads) and hands
the module a ``LoadPlan`` (how to load it); after the load it gets the pipeline back once to
parallelise or wrap it (``setup_pipeline``). The module learns the parallel layout only from what
the strategy hands it (the plan, the wrapped pipeline, the groups of steps 6 and 7), never from
the strategy's degrees or mesh; otherwise it reads its strategy only as a ``RunStrategy``
(``boundaries.run_strategy``: the run's ``run_context``) and through the ranks and collectives
every Lightning strategy has (``global_rank``, ``broadcast``, ``barrier``, ``reduce``).

Order on every rank (``DiffusionParallelStrategy`` does this; a strategy of your own follows the
same steps, before the process group starts for the checks):

1. ``request = module.request(records)``: records from the data module, passed explicitly;
2. ``problems = strategy.check_request(request)``: every weight-free rule of the strategy
   (degrees against heads and token counts, plans, options); raised together;
3. ``module.use_load_plan(strategy.load_plan(request))``: components the strategy builds itself
   (a transformer sharded while it loads, one placed by a device map) and extra
   ``from_pretrained`` arguments;
4. Lightning calls ``module.configure_model()``: the module loads the pipeline with the plan;
5. ``module.use_pipeline(strategy.setup_pipeline(module.pipeline))``: context-parallel hooks, the
   CFG split, a staged wrapper... what ``predict_step`` then calls;
6. if ``module.needs_shard_group``: ``module.use_shard_group(group)``, the process group of the
   ranks that hold pieces of the same transformer call (ring x ulysses x tp of one replica and
   guidance branch; ``None`` when each process holds whole tensors), over which data-dependent
   decisions inside the transformer (a first-block cache) are agreed;
7. ``module.use_group(group)``, the process group of one replica's ranks (cfg x ring x ulysses x
   tp; ``None`` with one process per replica), over which the module agrees failed calls and, with
   ``module.split_work``, splits text encoding and VAE decoding (``group_work``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

from lightning_diffusion.core.records import CallArgs, Record
from lightning_diffusion.pipelines.settings import ComponentLoader as ComponentLoader
from lightning_diffusion.pipelines.settings import LoadPlan as LoadPlan

if TYPE_CHECKING:
    import torch
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch import nn
    from torch.distributed import ProcessGroup

    from lightning_diffusion.pipelines.lora import Adapter
    from lightning_diffusion.pipelines.model_folder import PipelineInfo


@dataclass(frozen=True)
class ModelRequest:
    """What a strategy may know of the model before its weights load.

    ``info``: the pipeline's class, configs and ``PipelineSpec`` (read from config files only).
    ``dtype``: the weights' torch dtype. ``call_args``: the pipeline-call arguments of the config
    (``height``, ``num_inference_steps``, ``call_kwargs``...). ``from_pretrained_kwargs``: the
    user's extra loading options. ``records``: the prompt records, when known (per-record overrides
    of the call arguments, negative prompts). ``attention_backend``: the denoisers' diffusers
    attention backend the model config asks for (``None``: diffusers' default). ``quantization``:
    the model's ``quantization`` setting (``None``: full-precision weights). ``lora``: the adapters
    to fuse (``lora.Adapter``: file and scale).
    """

    info: "PipelineInfo"
    dtype: "torch.dtype"
    call_args: Mapping[str, Any]
    from_pretrained_kwargs: Mapping[str, Any] = field(default_factory=dict)
    records: Optional[Sequence[Mapping[str, Any]]] = None
    attention_backend: Optional[str] = None
    quantization: Optional[Mapping[str, Any]] = None
    lora: Sequence[Adapter] = ()

    def call_arg_sets(self) -> list[CallArgs]:
        """The call arguments of every distinct kind of image: the config's, with each distinct set
        of per-record overrides applied (one set when there are no records)."""
        if not self.records:
            return [dict(self.call_args)]
        from lightning_diffusion.input.records import summarize_records

        return [{**self.call_args, **overrides} for _, overrides in summarize_records(self.records).override_sets()]


@runtime_checkable
class DiffusionStrategy(Protocol):
    """What a strategy provides to run a ``DiffusionModule`` (see the module docstring for the order)."""

    def check_request(self, request: ModelRequest, world_size: Optional[int] = None,
                      device_type: Optional[str] = None) -> list:
        """Problems (messages or ConfigErrors) of running ``request`` on ``world_size`` processes of
        ``device_type`` (``None``: the strategy's own); no weight is read and no collective runs."""
        ...

    def load_plan(self, request: ModelRequest) -> LoadPlan:
        ...

    def setup_pipeline(self, pipeline: DiffusionPipeline) -> object:
        """Parallelise or wrap the loaded, placed pipeline; returns what ``predict_step`` calls."""
        ...


@runtime_checkable
class DiffusionModel(Protocol):
    """What a strategy calls on the module it runs (``DiffusionModule``), in the order above; a
    strategy tells such a module from another LightningModule with ``isinstance`` on this.

    A module declares it by subclassing it, as ``DiffusionModule`` does: from Python 3.12 a
    structural ``isinstance`` looks members up with ``inspect.getattr_static``, which does not see
    the submodules ``nn.Module`` keeps apart (``components``), and would answer False."""

    pipeline: object  # what ``predict_step`` calls (``setup_pipeline``'s), None before the load
    split_work: bool
    # The pipeline's info (``PipelineInfo``: class, configs, spec, denoisers) and its torch modules
    # by component name, registered for Lightning's device moves (empty before the load).
    info: PipelineInfo
    components: nn.ModuleDict

    def request(self, records: Optional[Sequence[Record]] = None) -> ModelRequest:
        ...

    def use_load_plan(self, plan: LoadPlan) -> None:
        ...

    def use_pipeline(self, pipeline: object) -> None:
        ...

    @property
    def needs_shard_group(self) -> bool:
        ...

    def use_shard_group(self, group: Optional[ProcessGroup]) -> None:
        ...

    def use_group(self, group: Optional[ProcessGroup]) -> None:
        ...
