"""Prompt sets in Parquet and Hugging Face datasets: the same records give the same images whatever
the format; column maps, kept columns, resume, rejected rows named by file and row; bad sources
refused in one line before any weight; a million rows in a few megabytes.

The files are real: Parquet written by pyarrow, datasets written by ``datasets``' ``save_to_disk``.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from lightning_diffusion import PromptDataModule
from lightning_diffusion.input.formats import read_records, split_names
from lightning_diffusion.input.tables import TableRecords
from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args
from tests.run.test_bad_input import OPENED  # its audit hook records every weight file opened

# Small and quick: 32x32 pixels, 2 steps, one image a call.
FAST = ["--model.height", "32", "--model.width", "32", "--model.num_inference_steps", "2", "--data.batch_size", "2"]

# Records every format can hold (a .csv holds text and seeds): some with a seed, some with a
# negative prompt; the others take data.seed + their index.
RECORDS = [
    {"prompt": "a red fox in the snow", "seed": 11},
    {"prompt": "a lighthouse in a storm"},
    {"prompt": "a bowl of ramen", "seed": 5, "negative_prompt": "blurry"},
    {"prompt": "an astronaut on a horse"},
    {"prompt": "a watercolor map", "seed": 2 ** 40},
    {"prompt": "a paper boat", "negative_prompt": "dark"},
]
# Records with their own call arguments, kept in a table under other column names.
ARGUMENT_RECORDS = [
    {"prompt": "a cat", "guidance_scale": 2.0, "num_inference_steps": 3},
    {"prompt": "a dog", "seed": 3},
    {"prompt": "a fish", "guidance_scale": 5.0},
    {"prompt": "a bird", "num_inference_steps": 3, "seed": 9},
]
RENAMED = {"prompt": "caption", "seed": "id", "guidance_scale": "cfg", "num_inference_steps": "steps"}


def _table(records: list[dict], rename: dict[str, str] | None = None, extra: bool = True) -> pa.Table:
    """``records`` as a table: every field a column (empty where a record lacks it), named by
    ``rename`` (field -> column), and (``extra``) columns a record does not read."""
    names = list(dict.fromkeys(k for r in records for k in r))
    types = {"seed": pa.uint64(), "num_inference_steps": pa.int64(), "guidance_scale": pa.float64()}
    columns = {(rename or {}).get(n, n): pa.array([r.get(n) for r in records], types.get(n, pa.string()))
               for n in names}
    if extra:
        columns["url"] = pa.array([f"https://example.org/{i}.jpg" for i in range(len(records))])
        columns["aesthetic"] = pa.array([0.5 + i for i in range(len(records))])
    return pa.table(columns)


def _save_to_disk(table: pa.Table, folder: Path, shards: int = 2) -> Path:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset(datasets.table.InMemoryTable(table)).save_to_disk(str(folder), num_shards=shards)
    return folder


def _write_sources(root: Path) -> dict[str, list[str]]:
    """Each format of RECORDS, as the data.* flags that name it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    with open(root / "p.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["prompt", "seed", "negative_prompt"])
        writer.writeheader()
        writer.writerows(RECORDS)
    table = _table(RECORDS, {"prompt": "caption"})
    pq.write_table(table, root / "one.parquet", row_group_size=4)  # two row groups
    (root / "three").mkdir()
    for n, (start, stop) in enumerate([(0, 2), (2, 3), (3, 6)]):
        pq.write_table(table.slice(start, stop - start), root / "three" / f"part-{n:05d}.parquet")
    _save_to_disk(table, root / "saved")
    caption = ["--data.columns", "{prompt: caption}"]
    return {"jsonl": ["--data.prompts", str(root / "p.jsonl")],
            "csv": ["--data.prompts", str(root / "p.csv")],
            "parquet": ["--data.prompts", str(root / "one.parquet"), *caption],
            "parquet folder": ["--data.prompts", str(root / "three"), *caption],
            "parquet glob": ["--data.prompts", str(root / "three" / "part-*.parquet"), *caption],
            "save_to_disk": ["--data.prompts", str(root / "saved"), *caption]}


def _manifest(out: Path) -> list[dict]:
    """The manifest's lines without when each was written."""
    return [{k: v for k, v in line.items() if k != "written"} for line in read_manifest_lines(out)]


def _pictures(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.png"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run of RECORDS from each format: {format: output folder}."""
    root = tmp_path_factory.mktemp("formats")
    made = {}
    for name, flags in _write_sources(root / "in").items():
        made[name] = root / name.replace(" ", "-")
        run_here(*tiny_args(made[name], *flags, *FAST))
    return made


@pytest.mark.parametrize("name", ["csv", "parquet", "parquet folder", "parquet glob", "save_to_disk"])
def test_every_format_gives_the_images_and_manifest_of_the_jsonl(runs, name):
    reference, out = runs["jsonl"], runs[name]
    assert len(_pictures(reference)) == len(RECORDS)
    assert _pictures(out) == _pictures(reference)  # byte for byte: pixels and metadata
    assert _manifest(out) == _manifest(reference)
    arrays, expected = load_arrays(out), load_arrays(reference)
    assert sorted(arrays) == sorted(expected) and all(np.array_equal(arrays[i], expected[i]) for i in expected)


def test_seeds_and_negative_prompts_come_from_the_renamed_table(runs):
    lines = _manifest(runs["parquet folder"])
    assert [line["seed"] for line in lines] == [11, 1, 5, 3, 2 ** 40, 5]  # data.seed 0 + index where none
    assert [line.get("negative_prompt") for line in lines] == [None, None, "blurry", None, None, "dark"]


def test_per_record_call_arguments_from_renamed_columns(tmp_path):
    """A table's own column names (caption, id, cfg, steps) mapped to record fields give the
    images of the .jsonl that names them as fields; columns named like nothing are not read."""
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ARGUMENT_RECORDS))
    table = _table(ARGUMENT_RECORDS, RENAMED)
    (tmp_path / "t").mkdir()
    pq.write_table(table.slice(0, 2), tmp_path / "t" / "a.parquet")
    pq.write_table(table.slice(2), tmp_path / "t" / "b.parquet")
    mapping = "{prompt: caption, seed: id, guidance_scale: cfg, num_inference_steps: steps}"
    run_here(*tiny_args(tmp_path / "jsonl", "--data.prompts", str(jsonl), *FAST))
    run_here(*tiny_args(tmp_path / "table", "--data.prompts", str(tmp_path / "t"), "--data.columns", mapping, *FAST))
    assert _pictures(tmp_path / "table") == _pictures(tmp_path / "jsonl")
    lines = _manifest(tmp_path / "table")
    assert lines == _manifest(tmp_path / "jsonl")
    assert [(line["guidance_scale"], line["num_inference_steps"]) for line in lines] == [
        (2.0, 3), (3.5, 2), (5.0, 2), (3.5, 3)]  # the config's 3.5 and 2 where a record sets none


def test_a_resume_over_parquet_remakes_only_what_is_missing(runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs["parquet"], out)
    lines = (out / "manifest.jsonl").read_text().splitlines()
    dropped = next(line for line in lines if json.loads(line)["index"] == 3)
    (out / "manifest.jsonl").write_text("".join(line + "\n" for line in lines if line != dropped))
    (out / json.loads(dropped)["file"]).unlink()
    before = _pictures(runs["parquet"])
    flags = ["--data.prompts", str(runs["jsonl"].parent / "in" / "one.parquet"), "--data.columns", "{prompt: caption}"]
    proc = run_here(*tiny_args(out, *flags, *FAST))
    assert "made 1 output, 5 skipped by resume" in proc.stderr
    assert _pictures(out) == before
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(len(RECORDS)))


def test_skip_names_a_bad_row_by_its_file_and_row(tmp_path):
    (tmp_path / "t").mkdir()
    pq.write_table(pa.table({"caption": ["one", "two"]}), tmp_path / "t" / "a.parquet")
    pq.write_table(pa.table({"caption": ["three", "", "five"]}), tmp_path / "t" / "b.parquet")
    out = tmp_path / "out"
    proc = run_here(*tiny_args(out, "--data.prompts", str(tmp_path / "t"), "--data.columns", "{prompt: caption}",
                               "--data.on_bad_record", "skip", *FAST))
    assert "made 4 outputs, 0 skipped by resume, 1 rejected (rejected.jsonl)" in proc.stderr
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert rejected == [{"record": 4, "line": f"{tmp_path / 't' / 'b.parquet'}:row 1",
                         "reason": "no 'prompt' (a non-empty string).", "images": [3]}]
    assert [line["prompt"] for line in read_manifest_lines(out)] == ["one", "two", "three", "five"]


def test_a_dataset_of_splits_reads_the_split_asked_for(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    train = datasets.Dataset.from_list([{"text": f"train {i}"} for i in range(3)])
    test = datasets.Dataset.from_list([{"text": f"test {i}"} for i in range(2)])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    records = read_records(str(tmp_path / "dd"), columns={"prompt": "text"}, split="test")
    assert [r["prompt"] for r in records] == ["test 0", "test 1"]
    assert records.source(1) == f"{tmp_path / 'dd' / 'test'}:row 1"
    with pytest.raises(ValueError, match="is a dataset of splits train, test: choose one with data.split"):
        read_records(str(tmp_path / "dd"), columns={"prompt": "text"})


def test_kept_columns_reach_each_sample_and_are_no_call_arguments(tmp_path):
    """``data.keep_columns`` hands each sample the row's columns, JSON-ready, apart from its call
    arguments (a column the records do not read would otherwise refuse nothing and reach nothing)."""
    table = _table(ARGUMENT_RECORDS, RENAMED).append_column(
        "taken", pa.array(np.array([0, 1, 2, 3], dtype="datetime64[s]")))
    pq.write_table(table, tmp_path / "p.parquet")
    data = PromptDataModule(str(tmp_path / "p.parquet"), batch_size=4, columns=dict(RENAMED),
                            keep_columns=["url", "taken", "id"])
    loader = data.predict_dataloader()
    samples = sorted((sample for batch in loader for sample in batch), key=lambda sample: sample["index"])
    assert [s["index"] for s in samples] == [0, 1, 2, 3]
    assert [s["columns"] for s in samples[:2]] == [
        {"url": "https://example.org/0.jpg", "taken": "1970-01-01T00:00:00", "id": None},
        {"url": "https://example.org/1.jpg", "taken": "1970-01-01T00:00:01", "id": 3}]
    assert [s["overrides"] for s in samples] == [{"guidance_scale": 2.0, "num_inference_steps": 3}, {},
                                                 {"guidance_scale": 5.0}, {"num_inference_steps": 3}]
    assert "columns" not in PromptDataModule(str(tmp_path / "p.parquet"), columns=dict(RENAMED)).predict_dataloader(
    ).dataset.samples[0]
    # a .jsonl keeps its own fields the same way: refused as call arguments otherwise
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "x", "source": "crawl-7"}) + "\n")
    sample = PromptDataModule(str(jsonl), keep_columns=["source"]).predict_dataloader().dataset.samples[0]
    assert sample["columns"] == {"source": "crawl-7"} and sample["overrides"] == {}


@pytest.fixture
def bad_sources(tmp_path):
    (tmp_path / "fake.parquet").write_text("prompt\na fox\n")
    pq.write_table(pa.table({"caption": ["a fox"], "id": [1]}), tmp_path / "p.parquet")
    return tmp_path


BAD = [
    ("a .parquet that is not Parquet", ["--data.prompts", "{d}/fake.parquet"],
     "{d}/fake.parquet: not a Parquet file ("),
    ("a column map naming a missing column", ["--data.prompts", "{d}/p.parquet", "--data.columns", "{prompt: text}"],
     "{d}/p.parquet: data.columns maps prompt to 'text', which is not a column of it (its columns: caption, id)."),
    ("a kept column that is missing", ["--data.prompts", "{d}/p.parquet", "--data.columns", "{prompt: caption}",
                                       "--data.keep_columns", "[url]"],
     "{d}/p.parquet: data.keep_columns names 'url', which is not a column of it (its columns: caption, id)."),
    ("a prompt column that is not text", ["--data.prompts", "{d}/p.parquet", "--data.columns", "{prompt: id}"],
     "{d}/p.parquet: column 'id' (data.columns prompt) holds int64, not text (a prompt is a string)."),
    ("no prompt column", ["--data.prompts", "{d}/p.parquet"],
     "{d}/p.parquet: no 'prompt' column (its columns: caption, id); name the prompt's column with data.columns"),
    ("a glob that matches nothing", ["--data.prompts", "{d}/shards/*.parquet"],
     "data.prompts '{d}/shards/*.parquet' matches no file."),
    ("a hub dataset not in the cache", ["--data.prompts", "hf://datasets/lightning-diffusion-tests/absent"],
     "hf://datasets/lightning-diffusion-tests/absent is not in the local Hugging Face cache ("),
    ("a field that is no record field", ["--data.prompts", "{d}/p.parquet", "--data.columns", "{caption: prompt}"],
     "data.columns maps record fields to a source's columns ({prompt: caption}); 'caption' is not a record field"),
]


@pytest.mark.parametrize("argv, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_table_is_refused_in_one_line_before_any_weight(bad_sources, cli_here, argv, message):
    out = bad_sources / "images"
    OPENED.clear()
    proc = cli_here(*tiny_args(out, *[a.replace("{d}", str(bad_sources)) for a in argv]))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [errors[0]] and errors[0].startswith("lightning-diffusion: error: "), proc.stderr
    assert message.replace("{d}", str(bad_sources)) in errors[0]
    assert OPENED == [] and not out.exists()


def test_a_hub_dataset_missing_from_the_cache_names_the_download_command(bad_sources, cli_here):
    proc = cli_here(*tiny_args(bad_sources / "images", "--data.prompts", "hf://datasets/lightning-diffusion-tests/absent",
                               "--data.split", "test"))
    assert proc.returncode == 2 and "`lightning-diffusion download --config CONFIG`" in proc.stderr


def _resident(value, seen: set) -> int:
    """Bytes a Python object holds, with what it refers to (arrays with their buffers)."""
    if id(value) in seen or isinstance(value, type) or type(value).__module__.startswith("pyarrow"):
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(_resident(k, seen) + _resident(v, seen) for k, v in value.items())
    elif isinstance(value, (list, tuple, set, frozenset)):
        size += sum(_resident(v, seen) for v in value)
    elif hasattr(value, "__dict__"):
        size += _resident(vars(value), seen)
    return size


@pytest.mark.slow
def test_a_million_rows_cost_a_few_bytes_each(tmp_path):
    """The bound: 1 byte a record (1 MB here). Records that all share one call-argument set hold it
    once (``RecordSummary.set_of``: 4 bytes a record once two differ); the index is a few numbers a
    row group and a file; the rows stay in the file. (A ``.jsonl`` costs 4 bytes a record: its byte
    offset; holding the rows as dicts would cost a few hundred.) Arrow's memory after the checking
    pass is what the decoded row groups kept for reading hold: at most ``TableRecords.KEEP`` of them.
    Measured in a process of its own: Arrow's allocation count is the process's, which other test
    files of the same worker share."""
    import subprocess

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                           "from tests.input.test_parquet import _million_rows; _million_rows(Path(sys.argv[1]))",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _million_rows(tmp_path: Path) -> None:
    rows, group = 10 ** 6, 2 ** 16
    numbers = pa.array(np.arange(rows, dtype=np.int64))
    captions = pc.binary_join_element_wise("a photo of thing number ", pc.cast(numbers, pa.string()), "")
    pq.write_table(pa.table({"caption": captions, "id": numbers, "url": captions}), tmp_path / "big.parquet",
                   row_group_size=group)
    del numbers, captions
    arrow_before = pa.total_allocated_bytes()
    records = read_records(str(tmp_path / "big.parquet"), columns={"prompt": "caption", "seed": "id"})
    assert isinstance(records, TableRecords) and len(records) == rows and not records.bad
    assert len(records.chunk_start) == -(-rows // group)
    resident = _resident(records, set())
    assert resident < rows, f"{resident:,} bytes for {rows:,} records"
    assert pa.total_allocated_bytes() - arrow_before < 1 << 20  # nothing decoded is held after the checks
    assert records[999_999] == {"prompt": "a photo of thing number 999999", "seed": 999_999}
    for position in range(0, rows, rows // 10):
        assert records[position]["seed"] == position
    held = pa.total_allocated_bytes() - arrow_before
    # What one decoded row group holds: the larger of its buffers' size and what Arrow's pool counted
    # while decoding it (its rounding varies, and other threads of Arrow may free memory meanwhile).
    # The group of the last position read: a full group of the longest captions, as the kept ones.
    start = pa.total_allocated_bytes()
    one_group = pq.ParquetFile(tmp_path / "big.parquet").read_row_group(900_000 // group, columns=["caption", "id"])
    group_bytes = max(pa.total_allocated_bytes() - start, one_group.nbytes)
    del one_group
    # the row groups kept decoded, and at most one more being read
    assert 0 < held <= (TableRecords.KEEP + 1) * group_bytes, (held, group_bytes)


@pytest.mark.slow
def test_two_replicas_over_parquet_make_the_images_of_one_process(runs, tmp_path):
    flags = ["--data.prompts", str(runs["jsonl"].parent / "in" / "three"), "--data.columns", "{prompt: caption}"]
    run_cli(*tiny_args(tmp_path / "two", *flags, *FAST, "--trainer.devices", "2"))
    assert _pictures(tmp_path / "two") == _pictures(runs["parquet folder"])
    assert _manifest(tmp_path / "two") == _manifest(runs["parquet folder"])


@pytest.mark.slow
def test_a_three_task_array_over_parquet_makes_the_images_of_one_process(runs, tmp_path):
    """Three shards of a job array over a folder of Parquet files, one after another into one
    folder: together the images, bytes and manifest lines of one process over the same files."""
    flags = ["--data.prompts", str(runs["jsonl"].parent / "in" / "three"), "--data.columns", "{prompt: caption}"]
    for task in range(3):
        run_here(*tiny_args(tmp_path / "array", *flags, *FAST, "--data.num_shards", "3", "--data.shard_index",
                            str(task)))
    assert _pictures(tmp_path / "array") == _pictures(runs["parquet folder"])
    def by_index(out: Path) -> list[dict]:  # the tasks append in their own order
        return sorted(_manifest(out), key=lambda line: line["index"])

    assert by_index(tmp_path / "array") == by_index(runs["parquet folder"])


def test_a_hub_datasets_split_is_its_files_named_by_it():
    names = ["README.md", "data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
             "data/test-00000-of-00001.parquet", "validation/part.parquet", "data/latest-train.parquet"]
    assert split_names(names, "train") == ["data/latest-train.parquet", "data/train-00000-of-00002.parquet",
                                           "data/train-00001-of-00002.parquet"]
    assert split_names(names, "test") == ["data/test-00000-of-00001.parquet"]
    assert split_names(names, "validation") == ["validation/part.parquet"]
    assert split_names(["captions.parquet", "more/captions-2.parquet"], "train") == [
        "captions.parquet", "more/captions-2.parquet"]  # no split named: all of it is train
    assert split_names(["captions.parquet"], "test") == []


@pytest.mark.slow
def test_download_fetches_a_hub_datasets_split_and_the_run_reads_it_offline(runs, tmp_path):
    """``download`` with network fetches the split's Parquet files (only those) into HF_HOME; the
    run, offline, reads them and makes the images of the .jsonl of the same records."""
    import os
    import subprocess

    from tests.conftest import REPO
    from tests.hub_server import HubServer

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    pq.write_table(_table(RECORDS, {"prompt": "caption"}), repo / "data" / "test-00000-of-00001.parquet")
    pq.write_table(_table(RECORDS[:2], {"prompt": "caption"}), repo / "data" / "train-00000-of-00001.parquet")
    (repo / "README.md").write_text("captions\n")
    home, out = tmp_path / "home", tmp_path / "out"
    flags = ["--data.prompts", "hf://datasets/test/captions", "--data.split", "test", "--data.columns",
             "{prompt: caption}"]
    with HubServer({"test/captions": repo}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        fetched = subprocess.run([sys.executable, "-m", "lightning_diffusion", "download", "--config",
                                  "configs/tiny-flux.yaml", *flags], cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=300)
    assert fetched.returncode == 0, fetched.stderr
    assert "hf://datasets/test/captions (split test): 1 Parquet files" in fetched.stdout
    (snapshot,) = (home / "hub").glob("datasets--test--captions/snapshots/*")
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*.parquet")) == [
        "data/test-00000-of-00001.parquet"]
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    made = subprocess.run([sys.executable, "-m", "lightning_diffusion", *tiny_args(out, *flags, *FAST)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    assert _pictures(out) == _pictures(runs["jsonl"])
    other = subprocess.run([sys.executable, "-m", "lightning_diffusion", *tiny_args(tmp_path / "x", *flags[:2],
                            "--data.split", "validation", *flags[4:])], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert other.returncode == 2
    assert "has no Parquet file of split 'validation' in the local cache" in other.stderr
    assert "lightning-diffusion download --config CONFIG" in other.stderr


def test_kept_columns_reach_the_files_metadata_and_the_reading_is_part_of_the_folders_settings(tmp_path):
    """A kept column is in each image's PNG parameters and manifest line; run.json records the
    column map, and a folder of Parquet files whose content changes is not resumed into."""
    from PIL import Image

    (tmp_path / "t").mkdir()
    pq.write_table(pa.table({"caption": ["one", "two"], "url": ["u0", "u1"]}), tmp_path / "t" / "a.parquet")
    pq.write_table(pa.table({"caption": ["three"], "url": ["u2"]}), tmp_path / "t" / "b.parquet")
    out = tmp_path / "out"
    flags = ["--data.prompts", str(tmp_path / "t"), "--data.columns", "{prompt: caption}",
             "--data.keep_columns", "[url]", *FAST]
    run_here(*tiny_args(out, *flags))
    lines = read_manifest_lines(out)
    assert [line["columns"] for line in lines] == [{"url": "u0"}, {"url": "u1"}, {"url": "u2"}]
    with Image.open(out / lines[2]["file"]) as png:
        assert json.loads(png.text["parameters"])["columns"] == {"url": "u2"}
        assert json.loads(png.text["columns"]) == {"url": "u2"}
    recorded = json.loads((out / "run.json").read_text())
    assert recorded["data.columns"] == {"prompt": "caption"} and recorded["data.keep_columns"] == ["url"]
    pq.write_table(pa.table({"caption": ["three, changed"], "url": ["u2"]}), tmp_path / "t" / "b.parquet")
    proc = run_here(*tiny_args(out, *flags), check=False)
    assert proc.returncode == 2 and "the prompt file's content changed" in proc.stderr


@pytest.mark.slow
def test_a_million_jsonl_lines_cost_four_bytes_each(tmp_path):
    """A ``.jsonl`` record is read by its byte offset, kept in 4 bytes (``formats.Offsets``); a set
    of one kind of call holds no per-record set. Bound: 5 bytes a record."""
    rows = 10 ** 6
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for first in range(0, rows, 100_000):
            f.write("".join(f'{{"prompt": "thing {n}", "seed": {n}}}\n' for n in range(first, first + 100_000)))
    records = read_records(str(path))
    assert len(records) == rows and not records.bad
    resident = _resident(records, set())
    assert resident < 5 * rows, f"{resident:,} bytes for {rows:,} records"
    for position in (0, 4095, 4096, 777_777, rows - 1):
        assert records[position] == {"prompt": f"thing {position}", "seed": position}


def test_line_offsets_past_four_gib_read_back():
    """Offsets of lines far apart (a block would span 4 GiB: a new block starts) and many lines."""
    from lightning_diffusion.input.formats import Offsets

    offsets = Offsets()
    wanted = [n * 10 for n in range(10_000)] + [2**32 + 5, 2**33, 2**33 + 1, 3 * 2**40]
    for offset in wanted:
        offsets.append(offset)
    assert [offsets[i] for i in range(len(wanted))] == wanted
    assert offsets.relative.itemsize == 4 and len(offsets.bases) == 5  # 3 blocks of 4096 lines, 2 past 4 GiB
