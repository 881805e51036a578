"""Prompt records, per-image seeds and the data-parallel split."""

import json

import numpy as np
import pytest

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.input.data import BatchDataset, PlanSampler, PromptDataModule, PromptDataset
from lightning_diffusion.input.formats import read_records
from lightning_diffusion.input.records import PromptFileError


def test_txt_prompts_skip_blank_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a cat\n\n  a dog  \n")
    assert [r["prompt"] for r in read_records(str(path))] == ["a cat", "a dog"]


def test_jsonl_records_keep_seed_negative_prompt_and_overrides(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "a cat", "seed": 7, "negative_prompt": "blurry", "guidance_scale": 2.0}) + "\n"
        + json.dumps({"prompt": "a dog"}) + "\n"
    )
    dataset = PromptDataset(read_records(str(path)), seed=100)
    first, second = dataset[0], dataset[1]
    assert first == {
        "index": 0,
        "prompt": "a cat",
        "seed": 7,
        "negative_prompt": "blurry",
        "overrides": {"guidance_scale": 2.0},
        "source": f"{path}:1",
    }
    assert second["seed"] == 101 and second["overrides"] == {}


def test_csv_needs_a_prompt_column_and_reads_seeds(tmp_path):
    good = tmp_path / "p.csv"
    good.write_text("prompt,seed\na cat,5\na dog,\n")
    records = read_records(str(good))
    assert records == [{"prompt": "a cat", "seed": 5}, {"prompt": "a dog"}]
    bad = tmp_path / "bad.csv"
    bad.write_text("text\na cat\n")
    with pytest.raises(PromptFileError, match=r"bad.csv:1: the CSV header has no 'prompt' column"):
        read_records(str(bad))


def test_seed_formula_with_several_images_per_prompt():
    dataset = PromptDataset([{"prompt": "a"}, {"prompt": "b", "seed": 50}], seed=10, num_images_per_prompt=3)
    assert [dataset[i]["seed"] for i in range(6)] == [10, 11, 12, 50, 51, 52]
    assert [dataset[i]["prompt"] for i in range(6)] == ["a"] * 3 + ["b"] * 3


def test_inline_list_accepts_strings_and_mappings():
    records = read_records(["a cat", {"prompt": "a dog", "seed": 3}])
    assert records == [{"prompt": "a cat"}, {"prompt": "a dog", "seed": 3}]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "ok"}\n{not json}\n', r"p.jsonl:2: not valid JSON"),
        ('{"prompt": "ok"}\n\n{"text": "no prompt"}\n', r"p.jsonl:3: no 'prompt'"),
        ('{"prompt": "ok", "seed": -1}\n', r"p.jsonl:1: 'seed' must be an integer from 0 to 2\*\*64 - 1"),
        ("[1, 2]\n", r"p.jsonl:1: expected a JSON object"),
    ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        PromptDataModule(str(path))


def test_missing_empty_and_unknown_prompt_files_are_refused(tmp_path):
    with pytest.raises(PromptFileError, match="does not exist"):
        PromptDataModule(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(PromptFileError, match="No prompts found"):
        PromptDataModule(str(empty))
    other = tmp_path / "p.xlsx"
    other.write_text("x")
    with pytest.raises(PromptFileError, match="use one of .txt, .jsonl, .csv, .parquet"):
        PromptDataModule(str(other))
    with pytest.raises(PromptFileError, match="No prompts found in the inline prompt list"):
        PromptDataModule([])


@pytest.mark.parametrize("field", ["batch_size", "num_images_per_prompt"])
def test_counts_below_one_are_refused(field):
    with pytest.raises(ValueError, match=f"data.{field} must be an integer >= 1"):
        PromptDataModule(["a"], **{field: 0})


@pytest.mark.parametrize("total, replicas", [(10, 2), (7, 2), (1, 2), (5, 4), (0, 3)])
def test_replicas_get_every_batch_once(total, replicas):
    module = PromptDataModule([f"p{i}" for i in range(max(total, 1))][:total] or ["p"], batch_size=2)
    pending = np.arange(total)
    dataset = BatchDataset(PromptDataset(module.records, indices=pending), module.batch_plan(pending))
    shards = [list(PlanSampler(dataset, replicas, rank)) for rank in range(replicas)]
    assert sorted(b for shard in shards for b in shard) == list(range(len(dataset)))
    assert [len(PlanSampler(dataset, replicas, rank)) for rank in range(replicas)] == [len(s) for s in shards]


def test_a_set_smaller_than_a_batch_is_computed_at_its_own_size():
    """Padding goes to the set's image count, whatever the layout: no batch of padding for one prompt."""
    one = PromptDataModule(["a cat"], batch_size=5)
    assert one.call_size == 1
    plan = one.batch_plan(np.arange(1))
    assert (plan.batch_size, plan.padded) == (1, 0) and "1 batch of 1" in plan.describe(2)
    assert PromptDataModule(["a", "b"], batch_size=5, num_images_per_prompt=2).call_size == 4
    assert PromptDataModule(["a", "b", "c"], batch_size=2).call_size == 2
    # A resume's leftovers and a replica's short batch still pad to the set's size, not to their own.
    three = PromptDataModule(["a", "b", "c"], batch_size=8)
    three.skip_indices({0, 1})
    assert three.batch_plan(three.pending_images()).batch_size == 3


def test_skipped_indices_are_removed_before_the_split():
    module = PromptDataModule([f"p{i}" for i in range(6)], batch_size=2)
    module.skip_indices({0, 1, 2})
    loader = module.predict_dataloader()
    assert [s["index"] for batch in loader for s in batch] == [3, 4, 5]


def test_a_set_of_one_kind_is_planned_in_four_bytes_an_image(tmp_path):
    """Planning a prompt set whose records share one kind of call holds the images left to make
    (int32, in index order: the plan's order too) and a few numbers a batch; no per-image cost,
    bucket or shard-member array. 250,000 images at batch 64: 5.1 bytes an image at the peak
    (38 with int64 indices and those arrays), bound at 6."""
    import tracemalloc

    images = 250_000
    path = tmp_path / "big.txt"
    path.write_text("".join(f"prompt number {i}\n" for i in range(images)))
    next(iter(PromptDataModule(["a"], batch_size=64).predict_dataloader()))  # the loader's imports, once
    module = PromptDataModule(str(path), batch_size=64)
    tracemalloc.start()
    batch = next(iter(module.predict_dataloader()))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [s["index"] for s in batch] == list(range(64)) and module.plan.order.dtype == np.int32
    assert peak < 6 * images, f"{peak / images:.1f} bytes an image"


@pytest.mark.slow
def test_a_large_prompt_file_is_streamed(tmp_path):
    """The data module keeps 8 bytes a record (line offsets), not the records: peak traced memory
    for indexing 250,000 lines, skipping the half already done and reading a batch stays under
    12 MB (1,000,000 lines measured 28.6 MB; the records themselves would take about 100 MB as
    dicts here). A quarter of the million keeps the test fast; memory grows linearly."""
    import tracemalloc

    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(250_000):
            f.write(f'{{"prompt": "prompt number {i} with a few more words"}}\n')
    done = set(range(0, 250_000, 2))  # what the writer found in the manifest
    tracemalloc.start()
    module = PromptDataModule(str(path), batch_size=4)
    module.skip_indices(done)
    batch = next(iter(module.predict_dataloader()))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert module.num_images == 250_000
    assert [s["index"] for s in batch] == [1, 3, 5, 7]
    assert batch[1]["prompt"] == "prompt number 3 with a few more words"
    assert peak < 12 * 2**20, f"peak {peak / 2**20:.1f} MB"


def test_each_option_of_the_data_module_is_held_once_in_its_settings():
    """``PromptDataModule``'s options live in its ``DataSettings`` alone: an attribute reads it, and
    setting one replaces the settings (nothing holds a second copy that could disagree)."""
    from dataclasses import fields

    from lightning_diffusion.input.settings import DataSettings

    data = PromptDataModule([{"prompt": "a"}, {"prompt": "b"}], batch_size=2, seed=7)
    assert data.settings == DataSettings(prompts=[{"prompt": "a"}, {"prompt": "b"}], batch_size=2, seed=7)
    for option in fields(DataSettings):
        assert getattr(data, option.name) == getattr(data.settings, option.name)
        assert option.name not in vars(data), option.name  # no instance copy
    data.seed = 11
    assert data.settings.seed == 11 and data.seed == 11 and data.settings.batch_size == 2
