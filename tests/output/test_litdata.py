"""``writer.format: litdata``: shards that LitData's ``StreamingDataset`` reads, each published whole
(a folder of LitData's chunk and index renamed into place, then its manifest lines), a resume that
adds only what is missing, and the refusals before the weights load."""

from pathlib import Path

import pytest

from lightning_diffusion.output.recorded import finished
from lightning_diffusion.output.settings import LITDATA_POOL_REFUSED
from lightning_diffusion.output.store import litdata_problems
from tests.conftest import REPO, read_manifest_lines, run_here, tiny_args
from tests.output.test_layouts import ARGS, flat, outputs  # noqa: F401 (the loose files' run, a fixture)

LITDATA = ["--writer.format", "litdata", "--writer.samples_per_shard", "4"]
KEYS = {"image", "image_path", "index", "prompt", "seed", "negative_prompt", "width", "height",
        "num_inference_steps", "guidance_scale", "parameters"}


def streamed(out: Path) -> dict[int, dict]:
    """Every sample of the folder's LitData shards, as ``StreamingDataset`` reads each shard."""
    litdata = pytest.importorskip("litdata")
    samples: dict[int, dict] = {}
    for shard in sorted(out.glob("shard-*.litdata")):
        for sample in litdata.StreamingDataset(str(shard)):
            assert sample["index"] not in samples, f"{sample['index']} in two shards"
            samples[sample["index"]] = sample
    return samples


def test_litdata_shards_hold_the_loose_files_bytes_and_streaming_dataset_reads_them(flat, tmp_path):  # noqa: F811
    pytest.importorskip("litdata")
    run_here(*tiny_args(tmp_path, *ARGS, *LITDATA))
    shards = sorted(p.name for p in tmp_path.glob("shard-*.litdata"))
    assert shards == ["shard-000000000.litdata", "shard-000000004.litdata", "shard-000000008.litdata"]
    assert all(sorted(p.name for p in (tmp_path / name).iterdir()) == ["chunk-0-0.bin", "index.json"]
               for name in shards)
    assert not list(tmp_path.glob(".shard-*"))  # no temporary left
    assert outputs(tmp_path) == flat  # through the manifest (eval's and the report's reading)
    samples = streamed(tmp_path)
    assert sorted(samples) == list(range(10))
    assert all(set(sample) == KEYS for sample in samples.values())
    assert all(sample["image"] == flat[index] for index, sample in samples.items())
    assert [samples[n]["prompt"] for n in range(10)] == [f"prompt {n}" for n in range(10)]
    assert {(s["width"], s["height"], s["num_inference_steps"]) for s in samples.values()} == {(32, 32, 2)}
    assert samples[3]["image_path"] == "000000003.png" and samples[3]["negative_prompt"] == ""
    first = read_manifest_lines(tmp_path)[0]
    assert first["file"] == "shard-000000000.litdata/chunk-0-0.bin" and first["member"] == "000000000.png"
    assert first["shard_bytes"] == (tmp_path / first["file"]).stat().st_size
    # docs/writing.md's reading example, as printed there, on these shards
    page = (REPO / "docs" / "writing.md").read_text()
    blocks = [block.split("```")[0] for block in page.split("```python\n")[1:]]
    snippet = next(block for block in blocks if "StreamingDataset" in block)
    scope: dict = {}
    exec(snippet.replace('"outputs/run-litdata"', f'"{tmp_path}"') + "\nread = (image.size, sample['prompt'])\n", scope)
    assert scope["read"] == ((32, 32), "prompt 9")  # the last sample: a PIL image and its row
    assert "10 of 10 (100%) outputs, complete" in run_here("status", str(tmp_path)).stdout
    proc = run_here(*tiny_args(tmp_path, *ARGS, "--writer.format", "parquet"), check=False)
    assert proc.returncode == 2 and "writer.format: 'litdata' then, 'parquet' now" in proc.stderr


def test_a_resume_after_a_partial_run_adds_only_the_missing_images(flat, tmp_path):  # noqa: F811
    pytest.importorskip("litdata")
    run_here(*tiny_args(tmp_path, *ARGS, *LITDATA, "--trainer.limit_predict_batches", "3"))  # 6 of 10 images
    assert sorted(finished(tmp_path).indices) == list(range(6))
    assert sorted(p.name for p in tmp_path.glob("shard-*.litdata")) == ["shard-000000000.litdata",
                                                                        "shard-000000004.litdata"]
    before = {name: (tmp_path / name / "chunk-0-0.bin").read_bytes()
              for name in ("shard-000000000.litdata", "shard-000000004.litdata")}
    # what a kill leaves: a shard's temporary folder, and a shard renamed into place before its lines
    # were appended (none of its samples count): the resume sweeps the one and replaces the other
    left = tmp_path / ".shard-000000006.litdata.tmp-1-0123456789ab"
    left.mkdir()
    (left / "chunk-0-0.bin").write_bytes(b"cut")
    orphan = tmp_path / "shard-000000006.litdata"
    orphan.mkdir()
    (orphan / "index.json").write_text("{}")
    run_here(*tiny_args(tmp_path, *ARGS, *LITDATA))
    lines = read_manifest_lines(tmp_path)
    assert [line["index"] for line in lines] == list(range(10))  # each image once
    assert sorted(p.name for p in tmp_path.glob("shard-*.litdata")) == [
        "shard-000000000.litdata", "shard-000000004.litdata", "shard-000000006.litdata"]
    assert all((tmp_path / name / "chunk-0-0.bin").read_bytes() == data for name, data in before.items())
    assert not left.exists() and not list(tmp_path.glob(".shard-*"))
    assert outputs(tmp_path) == flat
    samples = streamed(tmp_path)
    assert sorted(samples) == list(range(10))
    assert all(sample["image"] == flat[index] for index, sample in samples.items())
    # docs/writing.md's ways to one dataset: the shards streamed together, or merged by LitData
    import litdata

    shards = [str(p) for p in sorted(tmp_path.glob("shard-*.litdata"))]
    together = litdata.CombinedStreamingDataset([litdata.StreamingDataset(p) for p in shards], iterate_over_all=True)
    assert sorted(sample["index"] for sample in together) == list(range(10))
    litdata.merge_datasets(shards, str(tmp_path / "merged"))
    merged = {sample["index"]: sample["image"] for sample in litdata.StreamingDataset(str(tmp_path / "merged"))}
    assert merged == flat


def test_litdata_without_the_package_names_its_install_and_a_pool_is_refused_before_the_weights(tmp_path):
    assert litdata_problems("litdata", installed=lambda name: False) == [
        "writer.format: litdata needs the litdata package, which is not installed: "
        "pip install 'lightning-diffusion[litdata]' (or pip install litdata)."]
    assert litdata_problems("litdata", installed=lambda name: True) == []
    assert litdata_problems("parquet", installed=lambda name: False) == []
    proc = run_here(*tiny_args(tmp_path / "out", *ARGS, "--writer.format", "litdata", "--data.schedule", "pull"),
                    check=False)
    assert proc.returncode == 2 and LITDATA_POOL_REFUSED in proc.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was made
    proc = run_here(*tiny_args("s3://bucket/out", *ARGS, "--writer.format", "litdata"), check=False)
    assert proc.returncode == 2 and "set writer.format: webdataset (or parquet)" in proc.stderr
