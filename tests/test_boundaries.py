"""The joints between the parts of a run are declared (``boundaries``): the project's parts are what
the writer reads, and a part that is not fails when the run starts, naming what it lacks."""

import inspect
import typing

import lightning.pytorch as pl
import numpy as np
import pytest
from torch.utils.data import DataLoader

from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
from lightning_diffusion.contract import DiffusionModel, DiffusionStrategy
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.output.boundaries import ImageSource, PromptSource, RecordSource, RunPlan, run_strategy
from lightning_diffusion.output.shard import Shard
from lightning_diffusion.strategies import ContextParallelStrategy, DataParallelStrategy, DeviceMapStrategy


def test_the_projects_parts_are_what_the_writer_reads():
    data = PromptDataModule(["a", "b", "c"], num_images_per_prompt=2, seed=7, num_shards=2, shard_index=1)
    assert isinstance(data, PromptSource) and isinstance(DiffusionModule("tiny:flux"), ImageSource)
    assert run_strategy(DataParallelStrategy()) is not None and run_strategy(pl.strategies.DDPStrategy()) is None
    plan = data.run_plan()
    assert plan == RunPlan(["a", "b", "c"], 7, 2, 6, Shard(1, 2)) and plan.expected == 3
    assert data.shard_images().tolist() == [1, 3, 5]


def holds_from_python_312(part, protocol) -> bool:
    """``isinstance(part, protocol)`` as Python 3.12 and later answer it for a runtime protocol: a
    nominal subclass, else every member found by ``inspect.getattr_static`` (3.11 used ``hasattr``)."""
    if protocol in type(part).__mro__:
        return True
    members = getattr(protocol, "__protocol_attrs__", None) or typing._get_protocol_attrs(protocol)
    try:
        for name in members:
            inspect.getattr_static(part, name)
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("strategy", [DataParallelStrategy, lambda: ContextParallelStrategy(ulysses_degree=2),
                                      DeviceMapStrategy])
def test_strategies_tell_the_module_on_every_python(strategy):
    """A strategy moves, parallelises and wraps only a module that is a ``DiffusionModel``; a module
    the check misses stays on the CPU, unparallelised, and still makes the right pictures there (as
    on Python 3.12, where ``components``, an ``nn.Module`` submodule, is invisible to the static
    lookup: the CPU tests of 3.11 passed while a GPU run computed on the CPU)."""
    module, data = DiffusionModule("tiny:flux"), PromptDataModule(["a"])
    assert holds_from_python_312(module, DiffusionModel) and isinstance(module, DiffusionModel)
    assert holds_from_python_312(module, ImageSource) and holds_from_python_312(data, PromptSource)
    assert holds_from_python_312(data, RecordSource) and isinstance(data, RecordSource)  # the strategy's checks
    assert holds_from_python_312(strategy(), DiffusionStrategy)


class CaptionsOnly(pl.LightningDataModule):
    """A data module of someone's own, without the pieces the writer reads."""

    def predict_dataloader(self):
        return DataLoader([[{"index": 0, "prompt": "a", "seed": 0}]], batch_size=None)


def test_a_data_module_without_a_run_plan_is_refused_at_the_start_naming_what_it_lacks(tmp_path):
    def trainer():
        return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          callbacks=[ImageWriter(str(tmp_path / "out"), write_workers=0)])

    with pytest.raises(ConfigError, match=r"the writer needs a data module \(datamodule=\) that provides plan, "
                                          r"run_plan, skip_indices, rejected_images, rejected_lines \(PromptSource in "
                                          r"lightning_diffusion.output.boundaries\); got CaptionsOnly, which lacks "
                                          r"plan, run_plan, skip_indices, rejected_images, rejected_lines\."):
        trainer().predict(DiffusionModule("tiny:flux", height=32, width=32, num_inference_steps=1),
                        datamodule=CaptionsOnly(), return_predictions=False)
    assert not (tmp_path / "out").exists(), "nothing may be written before the parts are checked"
    with pytest.raises(ConfigError, match=r"needs a data module \(datamodule=\) .*; got nothing\."):
        trainer().predict(DiffusionModule("tiny:flux", height=32, width=32, num_inference_steps=1),
                        dataloaders=CaptionsOnly().predict_dataloader(), return_predictions=False)


def test_rejected_lines_name_each_records_images():
    data = PromptDataModule(["a", "b", "c"], num_images_per_prompt=2)
    from lightning_diffusion.input.records import RecordVerdicts

    data.reject(RecordVerdicts({1: ("p.jsonl:2", "too big")}))
    assert data.rejected_lines() == [{"record": 2, "line": "p.jsonl:2", "reason": "too big", "images": [2, 3]}]
    assert np.array_equal(data.rejected_images(), [2, 3])
