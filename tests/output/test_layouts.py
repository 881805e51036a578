"""A million images in one job: outputs in numbered subfolders or tar shards, a manifest that is
only appended to, and a resume that reads it compactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_diffusion.output.manifest import MANIFEST, PART_GLOB, count_lines
from lightning_diffusion.output.recorded import finished, merge_manifest, read_output, repair_manifest
from tests.conftest import REPO, read_manifest_lines, run_cli, run_here, tiny_args

PROMPTS = "[" + ", ".join(f"prompt {n}" for n in range(10)) + "]"
ARGS = ["--data.prompts", PROMPTS, "--data.batch_size", "2", "--model.height", "32", "--model.width", "32",
        "--model.num_inference_steps", "2"]


def outputs(out: Path) -> dict[int, bytes]:
    """Each image's bytes, through the manifest, from its file or its tar member."""
    lines = read_manifest_lines(out)
    assert len({line["index"] for line in lines}) == len(lines), "an image recorded twice"
    return {line["index"]: read_output(out, line) for line in lines}


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    out = tmp_path_factory.mktemp("flat")
    run_here(*tiny_args(out, *ARGS))
    return outputs(out)


def test_the_sharded_layout_puts_files_per_folder_images_in_each_subfolder(flat, tmp_path):
    run_here(*tiny_args(tmp_path, *ARGS, "--writer.files_per_folder", "4"))
    lines = read_manifest_lines(tmp_path)
    assert [line["file"].partition("/")[0] for line in lines] == ["00000"] * 4 + ["00001"] * 4 + ["00002"] * 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["00000", "00001", "00002"]
    assert outputs(tmp_path) == flat
    settings = json.loads((tmp_path / "run.json").read_text())
    assert settings["writer.layout"] == "sharded" and settings["writer.files_per_folder"] == 4
    # Another layout on resume is refused like other settings.
    proc = run_here(*tiny_args(tmp_path, *ARGS, "--writer.layout", "flat"), check=False)
    assert proc.returncode == 2 and "writer.layout: 'sharded' then, None now" in proc.stderr


def test_tar_shards_hold_the_same_bytes_and_a_webdataset_reader_reads_them(flat, tmp_path):
    import webdataset

    run_here(*tiny_args(tmp_path, *ARGS, "--writer.format", "webdataset", "--writer.samples_per_shard", "4"))
    shards = sorted(tmp_path.glob("shard-*.tar"))
    assert [p.name for p in shards] == ["shard-000000000.tar", "shard-000000004.tar", "shard-000000008.tar"]
    assert outputs(tmp_path) == flat
    samples = list(webdataset.WebDataset([str(p) for p in shards], shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(10)]
    # docs/writing.md's reading example, as printed there, on these shards
    page = (REPO / "docs" / "writing.md").read_text()
    snippet = next(block for block in page.split("```python\n")[1:] if "wds.WebDataset" in block).split("```")[0]
    scope: dict = {}
    exec(snippet.replace('"outputs/run1/', f'"{tmp_path}/') + "\nread = (image.size, metadata['prompt'])\n", scope)
    assert scope["read"] == ((32, 32), "prompt 9")  # the last sample: a PIL image and its metadata as a dict
    assert all(s["png"] == flat[int(s["__key__"])] for s in samples)
    assert [json.loads(s["json"])["prompt"] for s in samples] == [f"prompt {n}" for n in range(10)]
    first = read_manifest_lines(tmp_path)[0]
    assert first["file"] == "shard-000000000.tar" and first["member"] == "000000000.png"
    assert first["shard_bytes"] == shards[0].stat().st_size
    # The shards' bytes do not depend on when they were made.
    again = tmp_path / "again"
    run_here(*tiny_args(again, *ARGS, "--writer.format", "webdataset", "--writer.samples_per_shard", "4"))
    assert all((again / p.name).read_bytes() == p.read_bytes() for p in shards)
    proc = run_here(*tiny_args(tmp_path, *ARGS), check=False)  # files now: refused
    assert proc.returncode == 2 and "writer.format: 'webdataset' then, None now" in proc.stderr
    status = run_here("status", str(tmp_path))
    assert "10 of 10 (100%) outputs, complete" in status.stdout


def test_parquet_shards_hold_the_same_bytes_and_datasets_reads_them_as_images(flat, tmp_path):
    """``writer.format: parquet``: the images a Hugging Face ``datasets`` reader gets as PIL images
    with typed columns, no conversion; the bytes are the loose files'."""
    datasets = pytest.importorskip("datasets")

    run_here(*tiny_args(tmp_path, *ARGS, "--writer.format", "parquet", "--writer.samples_per_shard", "4"))
    shards = sorted(tmp_path.glob("shard-*.parquet"))
    assert [p.name for p in shards] == ["shard-000000000.parquet", "shard-000000004.parquet",
                                        "shard-000000008.parquet"]
    assert outputs(tmp_path) == flat
    # docs/writing.md's reading example, as printed there, on these shards
    page = (REPO / "docs" / "writing.md").read_text()
    snippet = next(block for block in page.split("```python\n")[1:] if "load_dataset" in block).split("```")[0]
    scope: dict = {}
    snippet = snippet.replace('"outputs/run2/', f'"{tmp_path}/').replace(
        'split="train")', f'split="train", cache_dir={str(tmp_path / "hf")!r})')
    exec(snippet + "\nread = (image.size, row['prompt'], row['index'])\n", scope)
    assert scope["read"] == ((32, 32), "prompt 0", 0)
    rows = datasets.load_dataset("parquet", data_files=[str(p) for p in shards], split="train",
                                 cache_dir=str(tmp_path / "hf"))
    assert rows.features["image"] == datasets.Image() and rows.features["seed"].dtype == "int64"
    raw = rows.cast_column("image", datasets.Image(decode=False))
    assert [row["index"] for row in raw] == list(range(10))
    assert all(row["image"]["bytes"] == flat[row["index"]] for row in raw)
    assert [row["prompt"] for row in raw] == [f"prompt {n}" for n in range(10)]
    assert {(row["width"], row["height"]) for row in raw} == {(32, 32)}
    first = read_manifest_lines(tmp_path)[0]
    assert first["file"] == "shard-000000000.parquet" and first["member"] == "000000000.png"
    assert "10 of 10 (100%) outputs, complete" in run_here("status", str(tmp_path)).stdout
    proc = run_here(*tiny_args(tmp_path, *ARGS, "--writer.format", "webdataset"), check=False)
    assert proc.returncode == 2 and "writer.format: 'parquet' then, 'webdataset' now" in proc.stderr


def test_a_merge_only_appends_the_new_lines(tmp_path):
    """The 16 shards of an array merge into one manifest: each merge must cost its own lines, not
    the manifest's. Every file a merge opens is watched (a Python audit hook: nothing replaced)."""
    for n in range(3):
        (tmp_path / f"{n:06d}-x.png").write_bytes(b"png")
    (tmp_path / MANIFEST).write_text("".join(json.dumps({"index": i, "file": f"{i:06d}-x.png", "bytes": 3}) + "\n"
                                             for i in range(2)))
    before = (tmp_path / MANIFEST).read_bytes()
    part = tmp_path / "manifest.shard-1-of-16.part-0.jsonl"
    line = json.dumps({"index": 2, "file": "000002-x.png", "bytes": 3}) + "\n"
    part.write_text(line)
    opened = []

    def audit(event, args):  # audit hooks stay for the process: this one records this folder only
        if event == "open" and isinstance(args[0], (str, Path)) and str(tmp_path) in str(args[0]):
            opened.append((Path(args[0]).name, args[1]))

    sys.addaudithook(audit)
    merged = merge_manifest(tmp_path, (1, 16))
    assert merged.tolist() == [2]
    modes = [mode for name, mode in opened if name == MANIFEST]
    assert len(modes) == 1 and modes[0].startswith("a")  # appended to, never read whole nor rewritten
    assert (tmp_path / MANIFEST).read_bytes() == before + line.encode() and not part.exists()
    assert finished(tmp_path).indices.tolist() == [0, 1, 2]


def test_a_merge_ends_a_line_a_kill_cut_before_it_appends(tmp_path):
    (tmp_path / "000000-x.png").write_bytes(b"png")
    (tmp_path / MANIFEST).write_text('{"index": 7, "file": "gone.p')
    (tmp_path / "manifest.part-0.jsonl").write_text(json.dumps({"index": 0, "file": "000000-x.png", "bytes": 3}) + "\n")
    merge_manifest(tmp_path)
    found = finished(tmp_path)
    assert found.indices.tolist() == [0] and found.problems == ["manifest.jsonl:1: not a manifest line"]


def test_a_repair_drops_only_the_lines_that_do_not_count(tmp_path):
    """Merges only append, so a resume rewrites the manifest once when it holds a line whose file
    is gone, a repeat or a cut end; a line a sibling shard appends after the folder was read stays."""
    def line(i):
        return json.dumps({"index": i, "file": f"{i:06d}-x.png", "bytes": 3}) + "\n"

    for i in (0, 2, 9):
        (tmp_path / f"{i:06d}-x.png").write_bytes(b"png")
    (tmp_path / MANIFEST).write_text(line(0) + line(1) + line(0) + line(2) + '{"index": 5, "fi')
    found = finished(tmp_path)
    assert found.untidy and found.indices.tolist() == [0, 2]
    with (tmp_path / MANIFEST).open("a") as f:  # a sibling's merge ends the cut line and appends
        f.write("\n" + line(9))
    assert repair_manifest(tmp_path, found) == 3  # image 1's line, the repeat of 0, the cut line
    assert (tmp_path / MANIFEST).read_text() == line(0) + line(2) + line(9)
    again = finished(tmp_path)
    assert not again.untidy and again.indices.tolist() == [0, 2, 9] and repair_manifest(tmp_path, again) == 0


@pytest.mark.slow
@pytest.mark.parametrize("storage", [["--writer.files_per_folder", "3"],
                                     ["--writer.format", "webdataset", "--writer.samples_per_shard", "3"],
                                     ["--writer.format", "litdata", "--writer.samples_per_shard", "3"]],
                         ids=["sharded", "webdataset", "litdata"])
def test_two_replicas_and_a_job_array_write_every_image_once(flat, storage, tmp_path):
    if "litdata" in storage:
        pytest.importorskip("litdata")
    run_cli(*tiny_args(tmp_path / "replicas", *ARGS, *storage, "--trainer.devices", "2"))
    assert outputs(tmp_path / "replicas") == flat
    for shard in ("0", "1", "2"):
        run_here(*tiny_args(tmp_path / "array", *ARGS, *storage, "--data.num_shards", "3", "--data.shard_index", shard))
    assert outputs(tmp_path / "array") == flat
    status = run_here("status", str(tmp_path / "array"), "--json")
    shards = json.loads(status.stdout)["shards"]  # each shard's runs summed, as img2dataset's _stats.json
    # five batches of two of one cost, dealt in turn to the least loaded shard: 4, 4 and 2 images
    assert [s["stats"]["made"] for s in shards] == [4, 4, 2] and all(s["stats"]["images_per_s"] for s in shards)
    assert "shards together: 10 made in 3 runs, 0 failed" in run_here("status", str(tmp_path / "array")).stdout


@pytest.mark.slow
@pytest.mark.parametrize("fmt, suffix", [("webdataset", "tar"), ("parquet", "parquet"), ("litdata", "litdata")])
def test_a_kill_in_the_middle_of_a_shard_loses_only_that_shard(tmp_path, fmt, suffix):
    if fmt == "litdata":
        pytest.importorskip("litdata")
    slow = ["--data.prompts", "[" + ", ".join(f"prompt {n}" for n in range(24)) + "]", "--data.batch_size", "2",
            "--model.height", "64", "--model.width", "64", "--model.num_inference_steps", "16",
            "--writer.format", fmt, "--writer.samples_per_shard", "4"]
    out = tmp_path / "out"
    args = tiny_args(out, *slow)
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        # a tar shard is open under its temporary name; a Parquet or LitData shard's rows are in memory
        # (it has no file until it closes): killed once the first shard's lines are in, mid the second shard
        if list(out.glob(f"shard-*.{suffix}")) and (list(out.glob(".shard-*.tmp-*")) if fmt == "webdataset"
                                                    else sum(count_lines(p) for p in out.glob(PART_GLOB)) >= 4):
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = finished(out)
    assert proc.returncode == -signal.SIGKILL  # killed mid-run, not ended before the kill
    assert 0 < len(killed) < 24 and len(killed) % 4 == 0, killed.indices  # whole shards only
    assert not killed.problems  # the open shard was never renamed: nothing half-read
    run_here(*args)
    run_here(*tiny_args(tmp_path / "clean", *slow))
    assert outputs(out) == outputs(tmp_path / "clean")
