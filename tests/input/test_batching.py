"""Mixed prompt sets: batches of like records (buckets), dealt to replicas by cost, the same
pictures whatever the layout."""

import json

import numpy as np
import pytest

from lightning_diffusion import PromptDataModule
from lightning_diffusion.input.batching import plan_batches
from lightning_diffusion.output.shard import Shard
from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args

SIZES = [(32, 32), (48, 64), (64, 48)]


def mixed_records(count: int, steps=(2, 3)) -> list[dict]:
    """Three sizes and two step counts, interleaved."""
    return [{"prompt": f"shape {n}", "height": SIZES[n % 3][0], "width": SIZES[n % 3][1],
             "num_inference_steps": steps[(n // 3) % len(steps)]} for n in range(count)]


def write(tmp_path, records, name="mixed.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_batches_do_not_depend_on_the_replica_count():
    rng = np.random.default_rng(0)
    indices = np.arange(1000)
    buckets = rng.integers(0, 7, size=1000)
    costs = np.asarray([1.0, 4.0, 2.25, 9.0, 1.0, 16.0, 0.5])[buckets]
    plan = plan_batches(indices, buckets, costs, 4)
    again = plan_batches(indices, buckets, costs, 4)
    batches = [plan.batch(b) for b in range(len(plan))]
    assert [b.tolist() for b in batches] == [again.batch(b).tolist() for b in range(len(again))]
    for batch in batches:  # one bucket a batch, index order inside
        assert len(set(buckets[batch].tolist())) == 1 and batch.tolist() == sorted(batch.tolist())
    assert sorted(np.concatenate(batches).tolist()) == list(range(1000))
    assert plan.padded <= 3 * 7  # a bucket's last batch at most
    for replicas in (1, 2, 3, 8):
        dealt = plan.deal(replicas)
        assert sorted(b for positions in dealt for b in positions.tolist()) == list(range(len(plan)))
        shares = plan.shares(replicas)
        assert max(shares) - min(shares) <= replicas * plan.costs.max() / plan.costs.sum(), shares


def test_index_order_batches_mix_kinds_and_are_dealt_whole():
    buckets = np.asarray([0, 1, 2] * 4)
    plan = plan_batches(np.arange(12), buckets, np.ones(12), 4, bucket=False)
    assert [plan.batch(b).tolist() for b in range(len(plan))] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_the_plan_of_a_data_module_groups_records_by_their_call_arguments(tmp_path):
    data = PromptDataModule(str(write(tmp_path, mixed_records(48))), batch_size=4)
    plan = data.batch_plan(np.arange(48))
    assert plan.num_buckets == 6 and len(plan) == 12 and plan.padded == 0
    loose = PromptDataModule(str(write(tmp_path, mixed_records(48))), batch_size=4, bucket=False)
    assert len(loose.batch_plan(np.arange(48))) == 12


def _summary(out):
    return json.loads((out / "run.json").read_text())["history"][-1]


def test_buckets_compute_at_most_a_short_batch_a_bucket_and_the_same_pictures(tmp_path):
    prompts = write(tmp_path, mixed_records(50))
    args = ["--data.prompts", str(prompts), "--data.batch_size", "4", "--model.num_inference_steps", "2"]
    run_here(*tiny_args(tmp_path / "buckets", *args))
    run_here(*tiny_args(tmp_path / "order", *args, "--data.bucket", "false"))
    buckets, order = _summary(tmp_path / "buckets"), _summary(tmp_path / "order")
    assert buckets["made"] == order["made"] == 50
    assert buckets["buckets"] == 6 and buckets["padded"] <= 3 * 6, buckets
    assert buckets["computed"] == 50 + buckets["padded"]
    assert order["padded"] > 3 * buckets["padded"], (order["padded"], buckets["padded"])
    ours, ref = load_arrays(tmp_path / "buckets"), load_arrays(tmp_path / "order")
    assert sorted(ours) == list(range(50)) and all(np.array_equal(ours[i], ref[i]) for i in range(50))


@pytest.mark.slow
def test_a_mixed_set_gives_the_same_bytes_for_every_layout(tmp_path):
    """1 process, 2 and 3 replicas, a resume, and 2 shards of a job array (equal thread counts)."""
    prompts = write(tmp_path, mixed_records(18))
    args = ["--data.prompts", str(prompts), "--data.batch_size", "2"]
    run_here(*tiny_args(tmp_path / "one", *args))
    reference = load_arrays(tmp_path / "one")
    assert sorted(reference) == list(range(18))
    for devices in ("2", "3"):
        run_cli(*tiny_args(tmp_path / devices, *args, "--trainer.devices", devices))
        ours = load_arrays(tmp_path / devices)
        assert all(np.array_equal(ours[i], reference[i]) for i in range(18)), devices
        lines = read_manifest_lines(tmp_path / devices)
        assert sorted(line["index"] for line in lines) == list(range(18))
    # A resume: some images lost (their files gone), made again by 2 replicas in other batches.
    resumed = tmp_path / "2"
    for line in read_manifest_lines(resumed):
        if line["index"] in (1, 5, 6, 11, 17):
            (resumed / line["file"]).unlink()
            (resumed / f"{line['index']:06d}.npy").unlink()
    proc = run_cli(*tiny_args(resumed, *args, "--trainer.devices", "2"))
    assert "resumed: 13 already in the manifest" in proc.stdout + proc.stderr
    ours = load_arrays(resumed)
    assert all(np.array_equal(ours[i], reference[i]) for i in range(18))
    for shard in ("0", "1"):
        run_here(*tiny_args(tmp_path / "shards", *args, "--data.num_shards", "2", "--data.shard_index", shard))
    ours = load_arrays(tmp_path / "shards")
    assert sorted(ours) == list(range(18)) and all(np.array_equal(ours[i], reference[i]) for i in range(18))


# ----------------------------------------------------------------------------- job-array shards


def _shard_costs(data, owners):
    """Each shard's computed cost: its images' batches of the whole set's plan (``shard_owners``'s
    own plan, from the records alone), and the costliest batch."""
    from lightning_diffusion.input.batching import SetFacts, image_facts

    total = data.num_images
    indices = np.arange(total)
    buckets, costs = image_facts(SetFacts.from_summary(data.records.summary), data.records.summary.set_array(), indices,
                                 data.num_images_per_prompt)
    plan = plan_batches(indices, buckets, costs, data.batch_size)
    loads = np.zeros(int(owners.max()) + 1)
    for b in range(len(plan)):
        batch = plan.batch(b)
        assert len(set(owners[batch].tolist())) == 1, "a batch of the plan is dealt whole"
        loads[owners[batch[0]]] += plan.costs[b]
    return loads, plan.costs.max()


@pytest.mark.parametrize("count", [2, 3, 8])
def test_a_mixed_sets_array_shards_are_within_one_batch_of_each_other_in_computed_cost(tmp_path, count):
    """Sizes that cost 1x to 16x and step counts 2 and 30, in runs of like records (as a set sorted
    by source often is): the cost deal leaves the shards within one batch's cost of each other; the
    index rule (image i to shard i % N) leaves them far apart on the same set."""
    from lightning_diffusion.input.data import shard_owners

    sizes, steps = [(32, 32), (64, 64), (128, 128)], [2, 30]
    records = [{"prompt": f"p {n}", "height": sizes[(n // 7) % 3][0], "width": sizes[(n // 7) % 3][1],
                "num_inference_steps": steps[(n // 5) % 2]} for n in range(600)]
    data = PromptDataModule(str(write(tmp_path, records)), batch_size=4, num_shards=count)
    owners = shard_owners(data.records, 1, 4, True, count)
    assert np.array_equal(data.shard.owners, owners) and sorted(set(owners.tolist())) == list(range(count))
    loads, costliest = _shard_costs(data, owners)
    assert loads.max() - loads.min() <= costliest, (loads, costliest)
    modulo = np.zeros(count)
    cost_of = np.asarray([r["height"] * r["width"] * r["num_inference_steps"] for r in records], dtype=float)
    np.add.at(modulo, np.arange(600) % count, cost_of)
    dealt = np.zeros(count)
    np.add.at(dealt, owners.astype(np.int64), cost_of)
    assert dealt.max() - dealt.min() < modulo.max() - modulo.min(), (dealt, modulo)
    members = [Shard(t, count).with_owners(owners).members(600) for t in range(count)]
    assert sorted(np.concatenate(members).tolist()) == list(range(600)), "the shards partition the set"


def test_a_shard_plan_deals_lines_rejected_while_read(tmp_path):
    """A line that is not JSON is rejected while read (``on_bad_record: skip``); among records of
    two kinds it is dealt as any image (never made) and the shards still partition the set."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "negative_prompt": "b"}\n{"prompt": "c"}\nnot json\n{"prompt": "d"}\n')
    data = PromptDataModule(str(path), batch_size=1, num_shards=2, on_bad_record="skip")
    owners = data.shard.owners
    assert len(owners) == 4 and set(owners.tolist()) == {0, 1}


def test_counts_of_one_read_in_the_singular():
    """The start-up lines count in words a reader would write: 1 image, 1 batch, 1 bucket, 1
    process, 1 output; the plural from 2 on."""
    import numpy as np

    from lightning_diffusion.core.console import counted
    from lightning_diffusion.input.batching import BatchPlan
    from lightning_diffusion.strategies.parallel_dims import ParallelDims

    one = BatchPlan(np.array([0]), np.array([0, 1]), np.array([0]), np.array([1.0]), batch_size=1)
    assert one.describe(1).startswith("batch plan: 1 image in 1 batch of 1 from 1 bucket, 0 padded")
    two = BatchPlan(np.array([0, 1]), np.array([0, 1, 2]), np.array([0, 1]), np.array([1.0, 1.0]), batch_size=1)
    assert two.describe(1).startswith("batch plan: 2 images in 2 batches of 1 from 2 buckets")
    assert " over 1 process: " in ParallelDims(world_size=1).describe()
    assert [counted(n, "output") for n in (0, 1, 2, 1000)] == ["0 outputs", "1 output", "2 outputs", "1,000 outputs"]
