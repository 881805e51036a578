"""``DiffusionParallelStrategy``: what every multi-process strategy of this project shares.

Process group start-up with an inference-sized timeout, one named device mesh built by
``ParallelDims``, the data-parallel split for the sampler, the module contract (``contract``: checks
before the process group starts, the load plan, the pipeline set-up after placement), collectives,
the run's stop on signals (``run_context``: its ``StopController``, asked at every batch) and a
teardown that leaves (possibly sharded) models where they are. Concrete strategies choose the
degrees and implement the contract.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_diffusion.contract import DiffusionModel, LoadPlan, ModelRequest
from lightning_diffusion.core import console, interrupt
from lightning_diffusion.core.console import counted, log
from lightning_diffusion.core.context import RunContext
from lightning_diffusion.core.errors import ConfigError, raise_problems
from lightning_diffusion.input.records import Records
from lightning_diffusion.output.boundaries import RecordSource
from lightning_diffusion.pipelines import compat, quantization
from lightning_diffusion.strategies.parallel_dims import ParallelDims, mesh_coordinate
from lightning_diffusion.strategies.watchdog import Launcher, StallWatch, Watchdog

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch.distributed import ProcessGroup
    from torch.utils.hooks import RemovableHandle

    from lightning_diffusion.pipelines.staged import StagedPipeline

T = TypeVar("T")

# Lightning's (and NCCL's) 30-minute default lets a job hang half an hour after a rank dies.
DEFAULT_TIMEOUT_S = 600.0
# Barriers wait for slow loaders (tens of GB from a cold cache) and replicas still making their
# last images; they are not collectives of a model-parallel step.
IDLE_TIMEOUT = timedelta(hours=24)
RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
# The backends' own collective timeout comes this long after the strategy's, at which the stall
# watch ends a stuck rank with a message (NCCL's watchdog would abort it without a word).
BACKEND_GRACE = timedelta(seconds=60)


def cpu_threads(local_processes: int, launched_here: bool,
                environ: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """The intra-op threads of one of a node's ``local_processes`` processes, and why. Processes this
    job's launcher started (``launched_here``) share the CPUs it was given: SLURM's
    ``--cpus-per-task`` where set, else the cores it may run on. Processes started outside (``srun``
    tasks) have SLURM's CPUs a task each, or, where no binding narrowed their cores, share the
    node's. Each taking all of them would oversubscribe the node (a 2-process CPU run was 1.5x
    slower)."""
    environ = dict(os.environ) if environ is None else environ
    processes = max(1, local_processes)
    per_task = environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        sharing = processes if launched_here else 1
        return max(1, int(per_task) // sharing), (f"SLURM's {per_task} CPUs a task over "
                                                   f"{counted(sharing, 'process', 'processes')}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bound = cores < (os.cpu_count() or cores)  # a binding gave this process its own cores
    sharing = processes if launched_here or not bound else 1
    return max(1, cores // sharing), (f"{counted(cores, 'core')} over {counted(sharing, 'process', 'processes')}"
                                      " of this node")


class DiffusionParallelStrategy(ParallelStrategy):
    """Base of the project's strategies: one process per device, a ``("dp", "cfg", "ring", "ulysses",
    "tp")`` mesh (``parallel_dims.MESH_DIMS``), and prompts split over ``dp`` only.

    Args:
        process_group_backend: ``nccl`` on CUDA and ``gloo`` on CPU when left ``None``.
        timeout: seconds a collective may wait before the process group gives up.
    """

    # Lightning adds its distributed sampler logic only for strategies that say so.
    is_distributed = True

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ConfigError(f"strategy timeout must be a positive number of seconds, got {timeout!r}.")
        self._timeout = timedelta(seconds=float(seconds))
        self._backend_timeout = self._timeout + BACKEND_GRACE
        self._stall_watch: Optional[StallWatch] = None
        self._beats: list[RemovableHandle] = []  # the watch's hooks on the pipeline's models
        self._process_group_backend = process_group_backend
        self.num_nodes = 1
        self._parallel_dims: Optional[ParallelDims] = None
        self._idle_group: Optional[ProcessGroup] = None
        self._replica_group: Optional[ProcessGroup] = None
        self._shard_group: Optional[ProcessGroup] = None
        self._device_mesh: Optional[DeviceMesh] = None
        # Stop on SLURM's signals (see ``preemption``), in SLURM jobs.
        self._stop_on_signal = False
        # The run's stop, counts and checks (``run_context``); the CLI hands over its own.
        self.run_context = RunContext()
        self._watchdog: Optional[Watchdog] = None  # from setup_environment on: names a rank that died
        self._said_stopped = False  # this rank said it stopped on a signal

    # ----------------------------------------------------------------- what the strategy is

    def degrees(self) -> dict[str, int]:
        """The requested degrees (``-1``: infer); subclasses say which dimensions they use."""
        return {"dp": -1}

    def make_parallel_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size=world_size, **self.degrees())

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            self._parallel_dims = self.make_parallel_dims(self.num_nodes * self.num_processes)
        return self._parallel_dims

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have started.")
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def gpus_bound_to_tasks(self) -> bool:
        """Whether each process sees only its own GPUs (``accelerators.TaskBoundCUDAAccelerator``)."""
        from lightning_diffusion.strategies.accelerators import TaskBoundCUDAAccelerator

        return isinstance(self.accelerator, TaskBoundCUDAAccelerator)

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    def writes_outputs(self) -> bool:
        """One rank per replica writes: the one at coordinate 0 of every model-parallel dimension."""
        coordinate = mesh_coordinate(self.device_mesh)
        return all(value == 0 for name, value in coordinate.items() if name != "dp")

    # ----------------------------------------------------------------- what the strategy does

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Validate degrees against the world size here, in the launching process, so a bad mesh
        # fails before any worker starts or any weight is read.
        self._parallel_dims = self.make_parallel_dims(self.num_nodes * self.num_processes)
        if isinstance(self.cluster_environment, SLURMEnvironment):
            # Lightning's SLURM requeue saves a checkpoint with every weight (minutes and tens of GB
            # for a 12B model) to resume training; an inference job resumes from its manifest.
            self.cluster_environment.auto_requeue = False
            self._stop_on_signal = True
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = Launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    # ----------------------------------------------------------------- the contract (see ``contract``)

    def check_request(self, request: ModelRequest, world_size: Optional[int] = None,
                      device_type: Optional[str] = None) -> list:
        """Problems of the model against the strategy that need no weights (subclasses add theirs)."""
        device = torch.device(self.planned_device_type(device_type))
        return quantization.device_problems(request.quantization, device)

    def check_devices(self) -> list:
        """Problems of this rank's devices (how many GPUs the node has): known only on the rank,
        so run on every rank whatever the CLI checked before (subclasses add theirs)."""
        return []

    def planned_device_type(self, device_type: Optional[str] = None) -> str:
        """``device_type`` when given (the CLI's checks, before the Trainer exists), else this rank's."""
        if device_type is not None:
            return device_type
        return self.root_device.type if self.parallel_devices else "cpu"

    def load_plan(self, request: ModelRequest) -> LoadPlan:
        return LoadPlan()

    def setup_pipeline(self, pipeline: DiffusionPipeline) -> Union[DiffusionPipeline, StagedPipeline]:
        """Parallelise or wrap the placed pipeline (nothing for data parallel); returns what to call."""
        return pipeline

    def _request(self) -> Optional[ModelRequest]:
        module = self.lightning_module
        if not isinstance(module, DiffusionModel):
            return None  # another LightningModule: nothing is known before loading
        trainer = module._trainer
        data = getattr(trainer, "datamodule", None)  # Lightning sets it only for a run given a data module
        records = data.records if isinstance(data, RecordSource) else None
        # A prompt file's records (read lazily: indexing one would judge it, a rejected line included),
        # or a list of mappings; another data module's "records" (a table, strings) are not checked.
        if not (isinstance(records, Records) or (isinstance(records, list)
                                                  and all(isinstance(r, Mapping) for r in records))):
            records = None
        return module.request(records)

    @override
    def setup_environment(self) -> None:
        assert self.lightning_module is not None
        # the node's cores shared by its processes, not each taking all (one process keeps torch's own)
        if console.USER_THREADS is None and self.num_processes > 1:
            assert self.cluster_environment is not None
            # started by this job's launcher: the launching process, or a rank it started
            launched = not self.cluster_environment.creates_processes_externally or interrupt.LAUNCHED
            threads, why = cpu_threads(self.num_processes, launched)
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)  # for what this rank starts
            log.info(f"CPU threads: {threads} a process ({why}; OMP_NUM_THREADS sets another count)")
        request = self._request()
        # Every rank checks before the process group starts, so a problem cannot hang a rank;
        # ranks started by the CLI trust the check their launching process made on the config.
        problems = self.check_devices()
        if request is not None and not self.run_context.checked:
            problems += self.check_request(request)
        raise_problems(problems)
        super().setup_environment()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        # Before the rendezvous: a rank that dies while the others wait there is named at once.
        self._watchdog = Watchdog(
            getattr(self._launcher, "procs", None), self.global_rank, self.node_rank, self.num_processes
        )
        self._watchdog.start()
        # Ranks start seconds or minutes apart (imports, a busy node): the rendezvous gets at least
        # RENDEZVOUS_TIMEOUT, the collectives the strategy's own timeout.
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=max(self._backend_timeout, RENDEZVOUS_TIMEOUT),
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )
        if self._backend_timeout < RENDEZVOUS_TIMEOUT:
            compat.set_collective_timeout(self._backend_timeout)
        # Every rank creates it, in the same order as every other group.
        self._idle_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._parallel_dims = self.make_parallel_dims(self.world_size)
        # The replica group: the stop agreement at each batch, the split of text encoding and
        # decoding inside the call; the shard group: data-dependent decisions inside the transformer
        # (a first-block cache). All are made before any weight; their backends wait BACKEND_GRACE
        # past the strategy's timeout, at which the stall watch ends a stuck rank first.
        module = self.lightning_module
        groups = self._parallel_dims.build_groups(
            self.root_device.type, self.global_rank, self._backend_timeout,
            shard_group=isinstance(module, DiffusionModel) and module.needs_shard_group)
        self._device_mesh, self._replica_group, self._shard_group = groups.mesh, groups.replica, groups.shard
        log.info(f"{type(self).__name__}: {self._parallel_dims.describe()}")
        self._warn_groups_across_nodes()
        # Every run stops cleanly on Ctrl-C; SLURM jobs also on SLURM's signals, and requeue.
        self.run_context.stop.enable(self._replica_group, self.root_device, self.global_rank,
                                     slurm=self._stop_on_signal)
        if request is not None and isinstance(module, DiffusionModel):  # (a request comes from one only)
            module.use_load_plan(self.load_plan(request))

    def _warn_groups_across_nodes(self) -> None:
        size = self._parallel_dims.model_parallel_size if self._parallel_dims is not None else 1
        if self.num_nodes > 1 and size > 1 and self.num_processes % size:
            log.warning(
                f"Each replica's {size} model-parallel ranks do not fit within one node's {self.num_processes} "
                "processes: their collectives cross the network at every step. Prefer devices per node that "
                "are a multiple of the context x tensor parallel degrees."
            )

    @override
    def predict_step(self, *args: object, **kwargs: object) -> object:
        watch = self._stall_watch
        if watch is None:
            return self._predict_step(*args, **kwargs)
        watch.batch_started()
        try:
            return self._predict_step(*args, **kwargs)
        finally:
            watch.batch_ended()

    def _predict_step(self, *args: object, **kwargs: object) -> object:
        if self.run_context.stop.should_stop():
            if self.writes_outputs and not self._said_stopped:
                self._said_stopped = True
                why = "by the audit's drift" if self.run_context.stop.drifted.is_set() else "on the signal"
                log.info(f"[rank {self.global_rank}] stopped {why}; the remaining images are left to the next "
                         "run.", extra={"all_ranks": True})
            return []
        with self._call_context():
            outputs = super().predict_step(*args, **kwargs)
        if self.writes_outputs and isinstance(outputs, list):
            self.run_context.stop.count(len(outputs))
        return outputs

    def _call_context(self) -> AbstractContextManager[None]:
        """``torch.inference_mode`` for the pipeline call of a replica of one rank on gloo.

        Lightning predicts under ``no_grad`` whenever the process group is gloo (its loops: gloo's
        threads and inference tensors do not mix), which costs a CPU run per-op autograd
        bookkeeping a diffusers loop under ``inference_mode`` does not pay (measured on tiny:flux
        64x64: the pipeline call 5-12% slower). A replica of one rank makes no collective inside
        the call (the stop agreement is outside it), so it takes inference mode back, unless the
        loop was told not to use it (tensor parallelism: DTensors refuse inference tensors).
        """
        loop = getattr(self.lightning_module.trainer, "predict_loop", None) if self.lightning_module else None
        alone = all(value == 1 for name, value in self.parallel_dims.degrees.items() if name != "dp")
        if loop is not None and loop.inference_mode and alone and not torch.is_inference_mode_enabled():
            return torch.inference_mode()
        return nullcontext()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        # After Lightning's handler, which it registers just before the loop (see preemption).
        self.run_context.stop.watch_terminate()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning sets the attribute on its function the same way (typed without it)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        module = self.lightning_module
        if isinstance(module, DiffusionModel) and module.pipeline is not None:
            module.use_pipeline(self.setup_pipeline(module.pipeline))
            if module.needs_shard_group:
                module.use_shard_group(self._shard_group)
            module.use_group(self._replica_group)  # also agrees failures when split_work is off
            if self.parallel_dims.model_parallel_size > 1:
                self._watch_stalls(module)
        self.barrier("pipeline_placed")

    def _watch_stalls(self, module: DiffusionModel) -> None:
        """A ``StallWatch`` beaten at the start and end of every model call of the pipeline (a
        replica of several ranks waits on its peers in collectives inside those calls). The VAE's
        and text encoders' direct submodules beat too (``vae.decode`` is not a forward: a long video
        decode, tile by tile, would beat only through its decoder); the denoisers' do not, where a
        compiled model would break its graph at each of them."""
        watch = StallWatch(self._timeout.total_seconds(), self.global_rank, drain=self.run_context.drain_writers,
                           writes=self.writes_outputs)
        beat = torch.compiler.disable(watch.beat)  # a compiled model calls it outside its graphs
        denoisers = set(module.info.denoisers())
        # a pipeline of another kind (a stand-in) may have no components: nothing to watch
        for name, component in getattr(module.pipeline, "components", {}).items():
            if not isinstance(component, torch.nn.Module):
                continue
            for part in [component] + ([] if name in denoisers else list(component.children())):
                self._beats += [part.register_forward_pre_hook(beat), part.register_forward_hook(beat)]
        self._stall_watch = watch
        watch.start()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None):
        # Pipelines load their own weights with their own dtype; no default-dtype games here.
        return nullcontext()

    # ----------------------------------------------------------------- collectives

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        """Ranks wait here for others that are still loading weights or making their last images:
        an idle wait, on a gloo group of its own with ``IDLE_TIMEOUT`` instead of the collective
        timeout (NCCL's watchdog would abort a job whose images were all written). A dead rank is
        still noticed: its node's watchdog ends the node, and gloo sees the closed connections."""
        if not _distributed_is_initialized():
            return
        if self._idle_group is not None:
            dist.barrier(group=self._idle_group)
        elif dist.get_backend() == "nccl":  # set-up failed before the idle group was made
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def replica_share(self) -> Optional[Callable[[object], object]]:
        """What hands the object of a replica's first rank (its writing rank) to the replica's
        other ranks, one call on each (a pool's claims: ``pull.PullSampler``); None where a
        replica is one rank."""
        group = self._replica_group
        if group is None:
            return None
        source = dist.get_global_rank(group, 0)
        device = self.root_device if self.root_device.type != "cpu" else None  # NCCL sends tensors on the GPU

        def share(obj: object) -> object:
            holder = [obj]
            dist.broadcast_object_list(holder, src=source, group=group, device=device)
            return holder[0]

        return share

    @property
    def idle_group(self) -> Optional[ProcessGroup]:
        """The gloo group of every rank with ``IDLE_TIMEOUT``, for waits as long as another rank's
        last images (``barrier``, the writer's end-of-run gather); None before the process group."""
        return self._idle_group

    @override
    def broadcast(self, obj: T, src: int = 0) -> T:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----------------------------------------------------------------- failure and teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._stall_watch is not None:
            self._stall_watch.stop()
        if self._watchdog is not None:
            # This process ends by itself, with its own message and exit code (2 for a refused config
            # every rank raises): the watchdog stands down rather than end it when a child goes first.
            self._watchdog.stop()
            self._watchdog.report_failure()

    @override
    def teardown(self) -> None:
        # Unlike Strategy.teardown, do not move the module to the CPU: for sharded models that
        # would gather or copy every shard, and the process is about to end anyway.
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._stall_watch is not None:
            self._stall_watch.stop()
            self._stall_watch = None
        for handle in self._beats:
            handle.remove()
        self._beats = []
        self.run_context.stop.release_interrupt()
        self.run_context.stop.release_terminate(final=False)  # kept while a SIGTERM stops the run
        # The idle group stays: Lightning tears the strategy down before the callbacks, and the
        # writer's teardown still waits on it; destroy_process_group() at the end ends every group.
