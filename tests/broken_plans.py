"""Deliberately wrong parallel plans, for proving that ``verify`` catches them, and a rank that leaves
early (used by tests only)."""

from lightning.pytorch.callbacks import Callback

from lightning_diffusion.strategies import ContextParallelStrategy, TensorParallelStrategy
from lightning_diffusion.strategies.mesh_axes import TensorAxis


class LocalAttentionUlysses(ContextParallelStrategy):
    """Splits the tokens like Ulysses but leaves attention local to each rank's shard: it runs
    without error and gives a plausible, wrong picture."""

    def setup_pipeline(self, pipeline):
        pipeline = super().setup_pipeline(pipeline)
        for module in pipeline.transformer.modules():
            processor = getattr(module, "processor", None)
            if processor is not None and hasattr(processor, "_parallel_config"):
                processor._parallel_config = None
        return pipeline


class SwappedFeedForwardTP(TensorParallelStrategy):
    """The transformer's ``_tp_plan`` with colwise and rowwise swapped on the feed-forward layers
    of the double blocks."""

    class tensor_axis(TensorAxis):
        def load(self, name, cls, options, info, dtype):
            plan = dict(cls._tp_plan)
            plan["transformer_blocks.*.ff.net.0.proj"], plan["transformer_blocks.*.ff.net.2"] = "rowwise", "colwise"
            broken = type(cls.__name__, (cls,), {"_tp_plan": plan})
            return super().load(name, broken, options, info, dtype)


class FirstRankLoraSliceTP(TensorParallelStrategy):
    """Fuses LoRA updates into the shards with every rank adding rank 0's slice of each update
    (the right shapes, the wrong rows or columns on the other ranks)."""

    class tensor_axis(TensorAxis):
        def fuse(self, pipeline, adapters):
            from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

            from lightning_diffusion.pipelines import lora

            class RankZero:  # the tp mesh as _local_shard reads it, always answering rank 0
                def __init__(self, mesh):
                    self.mesh = mesh

                def get_local_rank(self):
                    return 0

                def size(self):
                    return self.mesh.size()

            degree = self.strategy.parallel_dims.tp
            specs = {name: resolve_tp_shard_specs(getattr(pipeline, name), type(getattr(pipeline, name))._tp_plan,
                                                  degree) for name in self.sharded}
            lora.fuse_in_place(pipeline, adapters, specs, RankZero(self.strategy.device_mesh["tp"]))


class LeaveBeforeTheEnd(Callback):
    """Rank 1 ends its process, exit code 0, once its share is predicted: a peer gone before the
    end-of-run gather that every rank's writer joins (as a rank whose node was lost)."""

    def on_predict_end(self, trainer, pl_module):
        if trainer.global_rank == 1:
            import os

            os._exit(0)
