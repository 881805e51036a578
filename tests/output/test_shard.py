"""A job array's shard: immutable, so a plan one part adopts never changes what another part holds."""

import pickle

import numpy as np
import pytest

from lightning_diffusion import PromptDataModule
from lightning_diffusion.output.shard import Shard, adopt


def test_adopting_a_recorded_plan_makes_a_new_shard_and_leaves_the_one_held_unchanged():
    data = PromptDataModule(prompts=[{"prompt": f"p{i}"} for i in range(6)], num_shards=2, shard_index=0)
    held = data.shard
    assert held is not None and held.owners is not None
    computed = held.owners.copy()
    recorded = (1 - computed).astype(np.uint16)  # the first task's plan: the other half of the images
    adopted, problem = adopt(held, recorded, 6, "out/shards-of-2.u16")
    assert problem is None and adopted is not held
    assert np.array_equal(adopted.owners, recorded) and np.array_equal(held.owners, computed)
    assert list(adopted) == [0, 2] and adopted == held  # the tuple run.json records is the same
    with pytest.raises(AttributeError, match="immutable"):
        held.owners = recorded
    assert data.run_plan().shard is held
    data.use_shard(adopted)
    assert data.shard is adopted and data.run_plan().expected == adopted.size(6) == 3
    assert set(data.shard_images().tolist()) == set(np.flatnonzero(recorded == 0).tolist())
    with pytest.raises(ValueError, match="not this data module's"):
        data.use_shard(Shard(1, 2).with_owners(recorded))
    assert np.array_equal(pickle.loads(pickle.dumps(adopted)).owners, recorded)  # as ranks broadcast it


def test_a_plan_of_another_prompt_set_is_refused_and_the_shard_kept():
    shard = Shard(1, 3).with_owners(np.zeros(9, dtype=np.uint16))
    kept, problem = adopt(shard, np.zeros(4, dtype=np.uint16), 9, "out/shards-of-3.u16")
    assert kept is shard and problem is not None
    assert problem.startswith("out/shards-of-3.u16 deals 4 images to 3 shards, but this prompt set has 9")
    none, nothing = adopt(shard, None, 9, "out/shards-of-3.u16")
    assert none is shard and nothing is None
