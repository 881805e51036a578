"""Bad input is reported before any weight loads, with a message that says what to change."""

import json

import pytest

from lightning_diffusion import DiffusionModule, ImageWriter
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.input.formats import read_records
from lightning_diffusion.input.record_checks import check_records
from lightning_diffusion.strategies import MeshError, ParallelDims
from lightning_diffusion.strategies.checks import cfg_problems


def test_missing_model_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        DiffusionModule(str(tmp_path / "nowhere"))


def test_folder_that_is_not_a_pipeline(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="is not a diffusers pipeline: it has no model_index.json"):
        DiffusionModule(str(tmp_path))


def test_model_index_naming_an_unknown_class(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NotAPipeline"}))
    with pytest.raises(ConfigError, match="'NotAPipeline', which is not a pipeline class"):
        DiffusionModule(str(tmp_path))


@pytest.mark.parametrize("size", [{"height": 50}, {"width": 8}, {"height": 0}])
def test_size_the_pipeline_cannot_take(size):
    with pytest.raises(ConfigError, match="use a positive multiple of 16"):
        DiffusionModule("tiny:flux", **size)


def test_steps_below_one():
    with pytest.raises(ValueError, match="model.num_inference_steps must be an integer from 1 to 1,000, got 0"):
        DiffusionModule("tiny:flux", num_inference_steps=0)


def test_call_kwargs_the_pipeline_does_not_take():
    with pytest.raises(ConfigError, match="FluxPipeline does not accept strength"):
        DiffusionModule("tiny:flux", call_kwargs={"strength": 0.5})
    with pytest.raises(ConfigError, match="sets generator, which lightning-diffusion sets per image"):
        DiffusionModule("tiny:flux", call_kwargs={"generator": None})


def test_unknown_dtype():
    with pytest.raises(ConfigError, match="torch_dtype 'float8'"):
        DiffusionModule("tiny:flux", torch_dtype="float8")


def test_record_override_the_pipeline_does_not_take():
    verdicts = check_records(DiffusionModule("tiny:flux").info, [{"prompt": "ok"}, {"prompt": "bad", "eta": 0.1}])
    assert list(verdicts.rejected) == [1]
    assert "inline prompts:2: eta: not something a record may set" in verdicts.report()


def test_record_checks_read_the_summary_made_while_indexing_not_the_lines(tmp_path):
    """A .jsonl is summarised while it is first indexed, so the checks before loading (pipeline
    arguments, negative prompts for cfg=2) do not parse its lines again (~10 s a walk for a million
    lines, on every rank). The file is gone before the checks: reading a line would raise."""
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a", "negative_prompt": "n"}, {"prompt": "b", "height": 64},
            {"prompt": "c", "eta": 0.1, "height": 64}, {"prompt": "d"}, {"prompt": "e", "height": 64, "seed": 3}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    records = read_records(str(path))
    path.unlink()
    assert records.summary.override_sets() == [(1, {}), (2, {"height": 64}), (3, {"eta": 0.1, "height": 64})]
    verdicts = check_records(DiffusionModule("tiny:flux").info, records)
    assert verdicts.report().endswith("p.jsonl:3: eta: not something a record may set; a FluxPipeline record may "
                                      "have prompt, seed, negative_prompt, height, width, num_inference_steps, "
                                      "guidance_scale, true_cfg_scale, max_sequence_length.")
    assert records.summary.override_sets() == [(1, {}), (2, {"height": 64})]  # what runs, for the strategies
    (problem,) = cfg_problems("QwenImagePipeline", {"true_cfg_scale": 4.0}, lambda name: None, records)
    assert "3 of 4 records have none (records 2, 4, 5)" in problem


def test_output_dir_that_is_a_file(tmp_path):
    file = tmp_path / "out"
    file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        ImageWriter(str(file))
    with pytest.raises(ValueError, match="which is a file"):
        ImageWriter(str(file / "sub"))


@pytest.mark.parametrize(
    "degrees, message",
    [
        ({"world_size": 4, "dp": 3}, r"dp 3 x ring 1 x ulysses 1 x tp 1 = 3 processes, but the world size is 4"),
        ({"world_size": 4, "dp": -1, "ulysses": 3}, r"world size 4 is not divisible by ring 1 x ulysses 3 x tp 1 = 3"),
        ({"world_size": 4, "dp": 0}, r"dp degree must be an integer >= 1"),
        ({"world_size": 4, "dp": -1, "tp": -1}, r"Only one degree may be inferred"),
    ],
)
def test_invalid_meshes(degrees, message):
    with pytest.raises(MeshError, match=message):
        ParallelDims(**degrees)


def test_inferred_degree():
    dims = ParallelDims(world_size=8, dp=-1, ulysses=2, tp=2)
    assert dims.degrees == {"dp": 2, "cfg": 1, "ring": 1, "ulysses": 2, "tp": 2}
    assert dims.replica_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
