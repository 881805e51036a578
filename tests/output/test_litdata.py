"""``writer.format: litdata``: shards that LitData's ``StreamingDataset`` reads, each published whole
(a folder of LitData's chunk and index renamed into place, then its manifest lines), a resume that
adds only what is missing, and the refusals before the weights load."""

import os
from pathlib import Path

import pytest

from lightning_diffusion.output.recorded import finished
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
    # a chunk modified after its lines is read back through LitData: its samples count while they
    # are the bytes recorded, and none does once the chunk is another of the same size
    chunk = tmp_path / "shard-000000004.litdata" / "chunk-0-0.bin"
    later = chunk.stat().st_mtime + 3600
    os.utime(chunk, (later, later))
    assert sorted(finished(tmp_path).indices) == list(range(10))
    chunk.write_bytes(bytes(chunk.stat().st_size))
    os.utime(chunk, (later + 1, later + 1))
    assert sorted(finished(tmp_path).indices) == [0, 1, 2, 3, 8, 9]


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


def test_litdata_without_the_package_names_its_install_and_a_bucket_is_refused_before_the_weights(tmp_path):
    assert litdata_problems("litdata", installed=lambda name: False) == [
        "writer.format: litdata needs the litdata package, which is not installed: "
        "pip install 'lightning-diffusion[litdata]' (or pip install litdata)."]
    assert litdata_problems("litdata", installed=lambda name: True) == []
    assert litdata_problems("parquet", installed=lambda name: False) == []
    proc = run_here(*tiny_args("s3://bucket/out", *ARGS, "--writer.format", "litdata"), check=False)
    assert proc.returncode == 2 and "writer.format: litdata writes its shards into a folder, not an object store " \
        "(s3://bucket/out) yet" in proc.stderr


def test_a_pools_shard_keeps_only_the_batches_it_still_holds(tmp_path):
    """A pool's shard whose first batch was taken over while it was open is written again by LitData
    without that batch's samples, named by the first sample it keeps; only those have lines."""
    litdata = pytest.importorskip("litdata")
    from tests.output.test_fencing import Clock, Worker, _prepare

    out, clock = tmp_path / "out", Clock()
    _prepare(str(out), tmp_path)
    a = Worker(str(out), "aaaa0000", "litdata", clock, tmp_path)
    b = Worker(str(out), "bbbb1111", "litdata", clock, tmp_path)
    assert a.pool.claim(0)
    a.write((0, 0, ()))  # two samples in A's open shard (it closes after a whole batch, at 3 or more)
    assert b.pool.take_over(0, 0)[0]  # batch 0 is B's now
    assert a.pool.claim(1)
    a.write((1, 0, ()))  # the shard closes: batch 0's samples are left out of it
    a.files.finish()
    shards = sorted(out.glob("shard-*.litdata"))
    assert [p.name for p in shards] == ["shard-000000002.litdata"] and not list(out.glob(".shard-*"))
    assert [s["index"] for s in litdata.StreamingDataset(str(shards[0]))] == [2, 3]
    lines = [line for part in out.glob("manifest.pool-*.jsonl") for line in read_manifest_lines_of(part)]
    assert sorted(line["index"] for line in lines) == [2, 3]
    assert {line["file"] for line in lines} == {"shard-000000002.litdata/chunk-0-0.bin"}
    assert all(line["shard_bytes"] == (out / line["file"]).stat().st_size for line in lines)


def read_manifest_lines_of(part: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in part.read_text().splitlines()]
