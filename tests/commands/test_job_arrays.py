"""Shards of one prompt set written into one folder (issue 27): ``data.num_shards`` /
``data.shard_index`` and ``slurm --array N``.

What is shown: the shards of a count partition the images; two shard runs write into one folder at
the same time and leave every index exactly once, each image bit-identical to one process (batch
size 1, so the calls are the same); runs that would make the same images are refused (a run of
the whole set beside shards, shards of another count); ``status`` counts per shard; ``--resubmit``
plans only incomplete shards that are not running. On the local SLURM cluster: an array of 4 over
12 prompts, and one task cancelled then resubmitted alone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_diffusion.commands import slurm as slurm_module
from lightning_diffusion.commands import status as status_module
from lightning_diffusion.output.lock import OutputLock, conflicting_runs, live_locks
from lightning_diffusion.output.shard import Shard, in_shard, shard_size
from tests.commands.test_slurm import cluster, job_log, slurm  # noqa: F401  (the cluster fixture)
from tests.conftest import FIVE_PROMPTS, REPO, load_arrays, read_manifest_lines, run_here, tiny_args

TINY = str(REPO / "configs" / "tiny-flux.yaml")
TWELVE = "[" + ", ".join(f"array prompt {i}" for i in range(12)) + "]"


def test_the_shards_of_a_count_partition_the_images():
    for total, count in [(12, 4), (10, 3), (5, 5), (7, 1)]:
        shards = [Shard(t, count).members(total) for t in range(count)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(total))
        assert all(all(i % count == t for i in shard) for t, shard in enumerate(shards))
        assert [len(shard) for shard in shards] == [shard_size(total, (t, count)) for t in range(count)]
        assert all(in_shard(int(i), (t, count)) for t, shard in enumerate(shards) for i in shard)
        assert np.array_equal(Shard(count - 1, count).select(np.arange(total)), shards[-1])


def _own_lock(folder: Path, shard) -> None:
    """A lock as a live run on this host writes it (this test process is its live pid)."""
    folder.mkdir(parents=True, exist_ok=True)
    OutputLock(folder, shard).path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def test_runs_that_would_make_the_same_images_are_refused_and_shards_of_one_count_are_not(tmp_path):
    _own_lock(tmp_path, (1, 4))
    assert set(live_locks(tmp_path)) == {(1, 4)}
    assert conflicting_runs(tmp_path, (0, 4)) == []  # another shard of the same count: side by side
    assert conflicting_runs(tmp_path, (0, 8))[0].startswith("shard 1 of 4")  # 0 of 8 shares images with 1 of 4
    assert conflicting_runs(tmp_path, None)[0].startswith("shard 1 of 4")  # the whole set shares all
    _own_lock(tmp_path, None)
    assert conflicting_runs(tmp_path, (0, 4))[0].startswith("a run of the whole prompt set")


def test_a_shard_is_refused_beside_a_run_of_the_whole_set(tmp_path):
    out = tmp_path / "out"
    _own_lock(out, None)
    proc = run_here(*tiny_args(out, "--data.prompts", FIVE_PROMPTS, "--data.num_shards", "2"), check=False)
    assert proc.returncode == 2
    assert "is being written by a run of the whole prompt set" in proc.stderr
    assert not list(out.glob("*.png"))


@pytest.mark.parametrize("flags, message", [
    (("--data.num_shards", "6"), "data.num_shards 6 exceeds the 5 images of the prompt set"),
    (("--data.num_shards", "2", "--data.shard_index", "2"), "data.shard_index must be an integer from 0 to"),
    (("--data.num_shards", "0"), "data.num_shards"),
])
def test_bad_shards_are_refused_before_loading(tmp_path, flags, message):
    proc = run_here(*tiny_args(tmp_path / "out", "--data.prompts", FIVE_PROMPTS, *flags), check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_shards_write_into_one_folder_at_once_each_image_once_and_as_one_process(tmp_path):
    """Shards 0 and 1 of 2 as two processes at the same time (a writer that takes a second an
    image keeps both runs open together), against one process over the whole set."""
    out = tmp_path / "out"
    prompts = [f"shard prompt {i}" for i in range(8)]
    script = (
        "import sys\n"
        "from lightning.pytorch import Trainer\n"
        "from lightning_diffusion import DiffusionModule, PromptDataModule\n"
        "from tests.slow_writer import SlowWriter\n"
        f"writer = SlowWriter({str(out)!r}, save_arrays=True)\n"
        "trainer = Trainer(accelerator='cpu', devices=1, strategy='data_parallel', callbacks=[writer], logger=False,\n"
        "                  enable_progress_bar=False)\n"
        "trainer.predict(DiffusionModule('tiny:flux', height=64, width=64, num_inference_steps=4, guidance_scale=3.5,\n"
        "                                call_kwargs={'max_sequence_length': 64}),\n"
        f"                datamodule=PromptDataModule({prompts!r}, batch_size=1, num_shards=2,\n"
        "                                            shard_index=int(sys.argv[1])))\n"
        "print(writer.summary)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(t)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(_free_port())})
             for t in range(2)]
    together = 0
    while any(p.poll() is None for p in procs):
        if out.is_dir():
            together = max(together, len(live_locks(out)))
        time.sleep(0.1)
    logs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert together == 2, "the two shards never wrote at the same time"
    assert all("'made': 4" in log and "'shard': [%d, 2]" % t in log for t, log in enumerate(logs)), logs
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(8))
    assert not list(out.glob("manifest.*part-*.jsonl"))  # each shard merged its own parts

    single = tmp_path / "single"
    run_here(*tiny_args(single, "--data.prompts", "[" + ", ".join(prompts) + "]", "--data.batch_size", "1"))
    ours, ref = load_arrays(out), load_arrays(single)
    assert sorted(ours) == list(range(8)) and all(np.array_equal(ours[i], ref[i]) for i in range(8))

    status = status_module.folder_status(out)
    assert status["complete"] and [(s["shard"], s["done"], s["expected"]) for s in status["shards"]] == [
        (0, 4, 4), (1, 4, 4)]


def _folder_with_shards(tmp_path: Path, done: list[int]) -> Path:
    """An output folder of a 4-shard array over FIVE_PROMPTS whose manifest lists ``done``."""
    out = tmp_path / "out"
    out.mkdir()
    lines = []
    for index in done:
        (out / f"{index:06d}-x.png").write_bytes(b"png")
        lines.append(json.dumps({"index": index, "file": f"{index:06d}-x.png", "bytes": 3}) + "\n")
    (out / "manifest.jsonl").write_text("".join(lines))
    (out / "run.json").write_text(json.dumps({"expected": 5}))
    (out / "run.shard-0-of-4.json").write_text(json.dumps({"shard": [0, 4], "history": []}))
    return out


def test_resubmit_plans_the_incomplete_shards_that_are_not_running(tmp_path, capsys):
    """Shards of 4 over 5 images: 0 holds 0 and 4, 1 holds 1, 2 holds 2, 3 holds 3. With 0 and 3
    done, 2 incomplete and 1 incomplete but still writing, only shard 2 is planned."""
    out = _folder_with_shards(tmp_path, [0, 4, 3])
    _own_lock(out, (1, 4))
    args, _ = slurm_module.parse_args(["--config", TINY, "--resubmit"])
    from lightning_diffusion.run.config import read_config

    config = read_config(TINY, ["--data.prompts", FIVE_PROMPTS, "--writer.output_dir", str(out)], check=False)
    plan = slurm_module.plan_array(args, config, slurm_module.Outputs(out), out, 5)
    assert plan["num_shards"] == 4 and plan["shards"] == [2]
    assert "shard 1: still running" in capsys.readouterr().out
    text = status_module.text(status_module.folder_status(out))
    assert "shard 0: 2 of 2, complete" in text and "shard 1: 0 of 1, running" in text
    assert "shard 2: 0 of 1, incomplete" in text


@pytest.mark.parametrize("argv, message", [
    (["--array", "0"], "--array must be at least 1"),
    (["--array", "4", "--shards", "5"], "an array of 4 has shards 0 to 3"),
    (["--array", "8"], "data.num_shards 8 exceeds the 5 images"),
    (["--max-concurrent", "2"], "need --array N"),
    (["--resubmit"], "holds no shards of a job array"),
])
def test_bad_arrays_are_refused_before_anything_is_queued(tmp_path, argv, message, capsys):
    out = tmp_path / "empty"
    try:
        code = slurm_module.main(["--config", TINY, *argv, "--", "--data.prompts", FIVE_PROMPTS,
                                  "--writer.output_dir", str(out)])
    except SystemExit as exit_info:  # argparse's own errors
        code = exit_info.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_array_script_gives_each_task_its_shard(tmp_path, capsys):
    predict = ["--data.prompts", TWELVE, "--writer.output_dir", str(tmp_path / "out"), "--data.batch_size"]
    code = slurm_module.main(["--config", TINY, "--array", "4", "--max-concurrent", "2", "--", *predict, "2"])
    script = capsys.readouterr().out
    assert code == 0
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --output=" in script and "slurm-%A_%a.out" in script
    assert '--data.num_shards 4 --data.shard_index "$SLURM_ARRAY_TASK_ID" &' in script
    # 12 images in batches of 4 are 3 batches: a fourth task would get none
    assert slurm_module.main(["--config", TINY, "--array", "4", "--", *predict, "4"]) == 2
    assert "fill only 3 shards; shards 3 would have nothing to make. Use --array 3" in capsys.readouterr().err


# ----------------------------------------------------------------------------- on the cluster


@pytest.mark.slow
def test_an_array_of_four_over_twelve_prompts_then_one_cancelled_task_resubmitted(cluster, tmp_path):
    """Shards 0-3 of 4, at most 2 at once; shard 3 is cancelled while it waits its turn. The other
    three complete; ``--resubmit`` submits shard 3 alone, and the folder then holds every index
    once, each image the same bits as one process."""
    out = tmp_path / "out"
    predict = tiny_args(out, "--data.prompts", TWELVE, "--data.batch_size", "1")[3:]
    proc = slurm("--config", TINY, "--array", "4", "--max-concurrent", "1", "--submit", "--", *predict, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    job = proc.stdout.split("submitted job ")[1].split(":")[0]
    subprocess.run(["scancel", f"{job}_3"], check=True)
    deadline = time.time() + 400
    while any(s["state"] in status_module.ACTIVE_STATES for s in status_module.array_states(job).values()):
        assert time.time() < deadline, status_module.array_states(job)
        time.sleep(1)
    status = status_module.folder_status(out)
    shards = {s["shard"]: s for s in status["shards"]}
    assert [shards[t]["done"] for t in range(4)] == [3, 3, 3, 0], [job_log(out, f"{job}_{t}")[-2000:] for t in range(3)]
    assert shards[3].get("slurm_state") in (None, "CANCELLED") and not status["complete"]  # SLURM may forget it

    again = slurm("--config", TINY, "--resubmit", "--wait", "--", *predict, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert "array of shards 3 of 4" in again.stdout
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(12))
    single = tmp_path / "single"
    run_here(*tiny_args(single, "--data.prompts", TWELVE, "--data.batch_size", "1"))
    ours, ref = load_arrays(out), load_arrays(single)
    assert sorted(ours) == list(range(12)) and all(np.array_equal(ours[i], ref[i]) for i in range(12))
    nothing = slurm("--config", TINY, "--resubmit", "--", *predict, cwd=tmp_path)
    assert nothing.returncode == 0 and "nothing to submit" in nothing.stdout


def test_a_shard_merges_parts_runs_left_behind_but_not_its_siblings(tmp_path):
    """A killed run's part (of the whole set) is folded into the manifest by the next shard that
    ends; a part of a sibling shard (of the same count, which may be writing) is left alone."""
    out = tmp_path / "out"
    out.mkdir()
    for index, part in ((3, "manifest.part-0.jsonl"), (1, "manifest.shard-1-of-2.part-0.jsonl")):
        (out / f"{index:06d}-left.png").write_bytes(b"png")
        (out / part).write_text(json.dumps({"index": index, "file": f"{index:06d}-left.png", "bytes": 3}) + "\n")
    run_here(*tiny_args(out, "--data.prompts", FIVE_PROMPTS, "--data.num_shards", "2", "--data.shard_index", "0",
                        "--data.batch_size", "1", "--writer.allow_config_change", "true"))
    # five batches of one image of equal cost, dealt in turn: shard 0 holds 0, 2 and 4
    assert [line["index"] for line in read_manifest_lines(out)] == [0, 2, 3, 4]
    assert not (out / "manifest.part-0.jsonl").exists() and (out / "manifest.shard-1-of-2.part-0.jsonl").exists()


@pytest.mark.slow
def test_the_shard_plan_is_the_same_whichever_task_starts_first(tmp_path):
    """A mixed-size set of 12 in 3 shards, the tasks run in the order 2, 0, 1 into one folder and
    0, 1, 2 into another: the same plan recorded (the one the records give), the same images, each
    once; ``status`` reads the plan from the folder. A task run with another batch size makes the
    recorded plan's shard; a task of another prompt set is refused before it makes anything."""
    from lightning_diffusion.input.data import shard_owners
    from lightning_diffusion.input.formats import read_records
    from lightning_diffusion.output.shard import plan_file, recorded_owners

    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"mixed {n}", "height": 32 if n < 8 else 64,
                                           "width": 32 if n < 8 else 64}) + "\n" for n in range(12)))
    args = ["--data.prompts", str(prompts), "--data.batch_size", "2", "--data.num_shards", "3"]
    for order, name in (("201", "late"), ("012", "early")):
        for task in order:
            run_here(*tiny_args(tmp_path / name, *args, "--data.shard_index", task))
    expected = shard_owners(read_records(str(prompts)), 1, 2, True, 3)
    # 4 batches of 32x32 (cost 1 each) and 2 of 64x64 (cost 4 each): one costly batch to each of shards 0
    # and 1, the four cheap ones to shard 2; each shard's cost is 4 (the index rule would give 12 images as 4, 4, 4)
    assert np.bincount(expected, minlength=3).tolist() == [2, 2, 8] and set(expected[8:].tolist()) == {0, 1}
    for name in ("late", "early"):
        assert np.array_equal(recorded_owners(tmp_path / name, 3), expected), name
        assert [line["index"] for line in read_manifest_lines(tmp_path / name)] == list(range(12))
    assert (tmp_path / "late" / plan_file(3)).read_bytes() == (tmp_path / "early" / plan_file(3)).read_bytes()
    late, early = load_arrays(tmp_path / "late"), load_arrays(tmp_path / "early")
    assert all(np.array_equal(late[i], early[i]) for i in range(12))
    status = status_module.folder_status(tmp_path / "late")
    assert [(s["shard"], s["done"], s["expected"]) for s in status["shards"]] == [(0, 2, 2), (1, 2, 2), (2, 8, 8)]

    # A task run with another batch size makes the recorded plan's shard (its batches cut its own way).
    # Batches of 4 alone would give shard 2 the images 4-7 (the recorded plan: 0-7).
    run_here(*tiny_args(tmp_path / "mixed", *args, "--data.shard_index", "1"))
    run_here(*tiny_args(tmp_path / "mixed", *args[:2], "--data.batch_size", "4", "--data.num_shards", "3",
                        "--data.shard_index", "2"))
    assert [line["index"] for line in read_manifest_lines(tmp_path / "mixed")] == [*range(8), 10, 11]
    run_here(*tiny_args(tmp_path / "mixed", *args, "--data.shard_index", "0"))
    assert np.array_equal(recorded_owners(tmp_path / "mixed", 3), expected)
    assert [line["index"] for line in read_manifest_lines(tmp_path / "mixed")] == list(range(12))
    other = run_here(*tiny_args(tmp_path / "mixed", "--data.prompts", "[one, two, three]", "--data.num_shards", "3",
                                "--data.shard_index", "0", "--writer.allow_config_change", "true"), check=False)
    assert other.returncode == 2 and "deals 12 images to 3 shards, but this prompt set has 3" in other.stderr


def test_shards_of_a_folder_written_before_plans_were_recorded_keep_the_index_rule(tmp_path):
    """A folder whose shard 0 of 2 ran before shard plans were recorded (its run record, no plan):
    shard 1 records the index rule it ran by, and makes the odd images, not the cost deal's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.shard-0-of-2.json").write_text(json.dumps({"shard": [0, 2], "history": []}))
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p {n}", "height": 32 if n < 4 else 64,
                                           "width": 32 if n < 4 else 64}) + "\n" for n in range(6)))
    run_here(*tiny_args(out, "--data.prompts", str(prompts), "--data.batch_size", "2", "--data.num_shards", "2",
                        "--data.shard_index", "1"))
    from lightning_diffusion.output.shard import recorded_owners

    assert recorded_owners(out, 2).tolist() == [0, 1, 0, 1, 0, 1]
    assert [line["index"] for line in read_manifest_lines(out)] == [1, 3, 5]
