"""Deliberately wrong parallel plans, for proving that ``verify`` catches them (used by tests only)."""

from lightning_diffusion.strategies import ContextParallelStrategy, TensorParallelStrategy


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

    def _load_sharded(self, name, cls, options, info, dtype):
        plan = dict(cls._tp_plan)
        plan["transformer_blocks.*.ff.net.0.proj"], plan["transformer_blocks.*.ff.net.2"] = "rowwise", "colwise"
        broken = type(cls.__name__, (cls,), {"_tp_plan": plan})
        return super()._load_sharded(name, broken, options, info, dtype)
