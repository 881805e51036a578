"""A run killed half way and run again ends with every index exactly once."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from PIL import Image

from tests.conftest import REPO, read_manifest_lines, run_cli, run_here, tiny_args

COUNT = 40


def finished_lines(out):
    lines = []
    for part in out.glob("manifest.part-*.jsonl"):
        lines += [json.loads(line) for line in part.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return lines


@pytest.mark.slow
def test_killed_run_resumes_and_writes_every_index_once(tmp_path):
    out = tmp_path / "out"
    prompts = "[" + ", ".join(f"prompt {i}" for i in range(COUNT)) + "]"
    args = tiny_args(out, "--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps", "12")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_diffusion", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while len(finished_lines(out)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    done = finished_lines(out)
    assert 4 <= len(done) < COUNT, "the run should have been killed half way"
    assert not (out / "manifest.jsonl").exists()
    # What a crash can leave: a cut manifest line, a PNG without a line, a line whose PNG is gone.
    next(out.glob("manifest.part-*.jsonl")).open("a").write('{"index": 39, "prompt": "prompt 39", "fi')
    (out / "000038-prompt-38.png").write_bytes(b"not a finished png")
    lost = done[0]
    (out / lost["file"]).unlink()
    kept = {line["index"]: (out / line["file"]).stat().st_mtime_ns for line in done[1:]}

    rerun = run_cli(*args, "--trainer.devices", "2")  # a different number of replicas is fine
    assert f"resumed: {len(kept):,} already in the manifest" in rerun.stdout + rerun.stderr

    lines = read_manifest_lines(out)
    assert [line["index"] for line in lines] == list(range(COUNT))
    assert len(list(out.glob("*.png"))) == COUNT
    assert not list(out.glob("manifest.part-*")) and not list(out.glob(".*tmp*"))
    for index, mtime in kept.items():  # finished images were not redone
        assert (out / lines[index]["file"]).stat().st_mtime_ns == mtime
    assert (out / lost["file"]).is_file()
    assert (out / "000038-prompt-38.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def three_prompt_args(out, *extra):
    return tiny_args(out, "--data.prompts", "[a cat, a dog, a bird]", "--data.batch_size", "1", *extra)


@pytest.mark.slow
def test_truncated_image_and_cut_manifest_line_are_repaired(tmp_path):
    run_here(*three_prompt_args(tmp_path))
    lines = read_manifest_lines(tmp_path)
    truncated = tmp_path / lines[0]["file"]
    truncated.write_bytes(truncated.read_bytes()[:100])
    manifest = tmp_path / "manifest.jsonl"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # last line cut in half

    rerun = run_here(*three_prompt_args(tmp_path))
    assert "resumed: 1 already in the manifest" in rerun.stdout + rerun.stderr  # only image 1 was intact
    repaired = read_manifest_lines(tmp_path)
    assert [line["index"] for line in repaired] == [0, 1, 2]
    for line in repaired:
        assert (tmp_path / line["file"]).stat().st_size == line["bytes"]
        Image.open(tmp_path / line["file"]).verify()


@pytest.mark.slow
def test_resuming_with_settings_that_change_images_is_refused(tmp_path):
    run_here(*three_prompt_args(tmp_path))
    proc = run_here(*three_prompt_args(tmp_path, "--model.num_inference_steps", "5"), check=False)
    assert proc.returncode == 2
    assert "holds images made with other settings (model.num_inference_steps: 4 then, 5 now)" in proc.stderr
    assert not (tmp_path / ".lock").exists()
    run_here(*three_prompt_args(tmp_path, "--model.num_inference_steps", "5", "--writer.allow_config_change", "true"))


@pytest.mark.slow
def test_a_folder_in_use_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))  # a live process
    proc = run_here(*three_prompt_args(tmp_path), check=False)
    assert proc.returncode == 2
    assert f"is being written by another run (pid {os.getpid()} on {socket.gethostname()})" in proc.stderr
    assert not list(tmp_path.glob("*.png"))

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    run_here(*three_prompt_args(tmp_path))
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == [0, 1, 2]
    assert not lock.exists()


@pytest.mark.slow
def test_ctrl_c_stops_after_the_batch_in_flight_and_the_rerun_completes(tmp_path):
    """SIGINT to the job's process group, as a terminal's Ctrl-C sends it to every rank: the batch
    in flight is finished, the manifest merged, the stop said in one line, exit 130; the same command
    then makes the rest, each index once."""
    import re

    out = tmp_path / "out"
    prompts = "[" + ", ".join(f"prompt {i}" for i in range(COUNT)) + "]"
    args = tiny_args(out, "--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps", "12",
                     "--trainer.devices", "2")
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while len(finished_lines(out)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 130, output[-3000:]
    stopped = re.search(r"stopped after (\d+) of 40 images; run the same command to resume\.", output)
    assert stopped, output[-3000:]
    done = int(stopped.group(1))
    assert 4 <= done < COUNT and "Detected KeyboardInterrupt" not in output and "Traceback" not in output
    assert [line["index"] for line in read_manifest_lines(out)] == sorted(line["index"] for line in
                                                                          read_manifest_lines(out))
    assert len(read_manifest_lines(out)) == done and not list(out.glob("manifest.part-*"))
    assert not list(out.glob(".*tmp*")) and len(list(out.glob("*.png"))) == done

    rerun = run_cli(*args)
    assert f"resumed: {done:,} already in the manifest" in rerun.stdout + rerun.stderr
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(COUNT))


def test_other_settings_are_refused_before_any_process_starts_and_prompts_compare_by_content(tmp_path, cli_here):
    prompts, copy, other = tmp_path / "p.txt", tmp_path / "copy.txt", tmp_path / "other.txt"
    prompts.write_text("a cat\na dog\n")
    copy.write_bytes(prompts.read_bytes())
    other.write_text("a cat\na bird\n")
    out = tmp_path / "out"
    run_here(*tiny_args(out, "--data.prompts", str(prompts), "--data.batch_size", "1"))
    # preflight refuses it: exit 2 from the launching process, no rank, no lock taken
    proc = cli_here(*tiny_args(out, "--data.prompts", str(copy), "--model.num_inference_steps", "5"))
    assert proc.returncode == 2
    assert "holds images made with other settings (model.num_inference_steps: 4 then, 5 now)" in proc.stderr
    assert "data.prompts" not in proc.stderr  # a byte-identical copy elsewhere is the same prompt set
    assert not (out / ".lock").exists()
    proc = cli_here(*tiny_args(out, "--data.prompts", str(other)))
    assert proc.returncode == 2 and "(the prompt file's content changed)" in proc.stderr
    # a dtype's alias is the same dtype: bf16 resumes a folder made with bfloat16, and the other way
    proc = cli_here(*tiny_args(out, "--data.prompts", str(copy), "--model.torch_dtype", "fp32"))
    assert "torch_dtype" not in proc.stderr
    proc = cli_here(*tiny_args(out, "--data.prompts", str(copy), "--model.vae_tiling", "true"))
    assert proc.returncode == 2 and "(model.vae_tiling: None then, True now)" in proc.stderr, proc.stderr[-2000:]
    resumed = run_here(*tiny_args(out, "--data.prompts", str(copy), "--data.batch_size", "1"))
    assert "nothing to make: the 2 images of this prompt set are all in" in resumed.stderr


def test_a_complete_folder_says_so_before_anything_loads(tmp_path, cli_here):
    """A rerun of a finished job (a scheduler's retry, a script run twice) ends at once with one
    line, before weights or processes (Lightning would load the model and run an empty loop)."""
    args = tiny_args(tmp_path, "--data.prompts", "[a red circle, a blue star]", "--model.num_inference_steps", "2")
    run_here(*args)
    manifest = (tmp_path / "manifest.jsonl").read_text()
    again = cli_here(*args)
    assert again.returncode == 0
    assert (f"lightning-diffusion: nothing to make: the 2 images of this prompt set are all in "
            f"{tmp_path}/manifest.jsonl" in again.stderr), again.stderr
    assert "Loading" not in again.stderr and "batch plan" not in again.stderr
    assert (tmp_path / "manifest.jsonl").read_text() == manifest
    # An audit part a killed run left (writer.audit) is work to merge: not "nothing to make".
    part = tmp_path / "audit.part-0.jsonl"
    part.write_text('{"index": 0, "psnr": Infinity}\n')
    assert "nothing to make" not in run_here(*args).stderr
    part.unlink()
    # A program that calls DiffusionCLI itself is not ended: it returns after an empty loop.
    from lightning_diffusion.run.config import DiffusionCLI

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        DiffusionCLI(args=["predict", *args[1:]])
    finally:
        os.chdir(cwd)
    assert (tmp_path / "manifest.jsonl").read_text() == manifest
    # One image gone: the rerun makes it (and only it).
    line = read_manifest_lines(tmp_path)[1]
    (tmp_path / line["file"]).unlink()
    assert "nothing to make" not in run_here(*args).stderr
    assert sorted(line["index"] for line in read_manifest_lines(tmp_path)) == [0, 1]


def _written_folder(out, layout: str = "sharded"):
    """Six synthetic images written as a run writes them (``OutputFiles``, then the merge)."""
    import numpy as np

    from lightning_diffusion.output.files import OutputFiles
    from lightning_diffusion.output.recorded import merge_manifest
    from lightning_diffusion.output.settings import WriterSettings

    out.mkdir()
    settings = WriterSettings(layout=layout, files_per_folder=2, fsync="off", write_workers=0)
    files = OutputFiles(out, settings, out / "manifest.part-0.jsonl", layout)
    files.write_batch([{"index": i, "prompt": f"p {i}", "seed": i, "params": {},
                        "image": np.full((8, 8, 3), i / 6, dtype=np.float32)} for i in range(6)])
    merge_manifest(out)
    return out


def test_a_linked_subfolder_of_the_sharded_layout_counts_for_nothing(tmp_path):
    """A numbered subfolder replaced by a link to a copy elsewhere: its images are made again."""
    import shutil

    from lightning_diffusion.output.folder_store import FolderStore
    from lightning_diffusion.output.recorded import finished

    out = _written_folder(tmp_path / "out")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "00001", elsewhere)
    (out / "00001").symlink_to(elsewhere, target_is_directory=True)
    found = finished(out)
    assert found.indices.tolist() == [0, 1, 4, 5]
    assert any("'00001', which is not a folder of the output" in p
               for p in found.problems), found.problems
    store = FolderStore(out, None)
    refusal, done = store.prepare({"data.seed": 0}, 6, 6)
    store.release()
    assert refusal is None and done.tolist() == [0, 1, 4, 5]  # 2 and 3 are made again


def test_a_folder_where_an_image_goes_is_refused_before_anything_loads(tmp_path, cli_here):
    from lightning_diffusion.output.folder_store import FolderStore

    out = _written_folder(tmp_path / "out", layout="flat")
    line = read_manifest_lines(out)[2]
    (out / line["file"]).unlink()
    (out / line["file"]).mkdir()  # a folder where image 2 goes
    store = FolderStore(out, None)
    refusal, _ = store.prepare({"data.seed": 0}, 6, 6)
    assert refusal is not None and "a folder stands where an output goes" in refusal and line["file"] in refusal
    args = tiny_args(tmp_path / "run", "--data.prompts", "[a red circle, a blue star]", "--model.num_inference_steps",
                     "2")
    run_here(*args)
    first = read_manifest_lines(tmp_path / "run")[0]["file"]
    (tmp_path / "run" / first).unlink()
    (tmp_path / "run" / first).mkdir()
    again = cli_here(*args)
    assert again.returncode == 2 and "a folder stands where an output goes" in again.stderr, again.stderr[-2000:]
    assert "Loading" not in again.stderr and "Traceback" not in again.stderr


def _later(path, line) -> None:
    """``path`` modified after its line was written (as an edit or a bad disk leaves it)."""
    moment = float(line["written"]) + 60
    os.utime(path, (moment, moment))


def test_a_same_size_file_that_changed_after_its_line_is_made_again(tmp_path):
    """Only sizes are compared for a file untouched since its line; one modified after it is read and
    its SHA-256 compared with the line's: same-size garbage and a same-size foreign image don't count."""
    from lightning_diffusion.output.folder_store import FolderStore
    from lightning_diffusion.output.recorded import NOT_THE_BYTES, finished

    out = _written_folder(tmp_path / "out", layout="flat")
    lines = read_manifest_lines(out)
    corrupt, foreign = out / lines[2]["file"], out / lines[4]["file"]
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the same size
    corrupt.write_bytes(bytes(data))
    _later(corrupt, lines[2])
    other = (out / lines[5]["file"]).read_bytes()
    if len(other) == lines[4]["bytes"]:  # a foreign image of the same size (same-size synthetic images)
        foreign.write_bytes(other)
        _later(foreign, lines[4])
    touched = out / lines[1]["file"]
    _later(touched, lines[1])  # modified time only: the bytes are the recorded ones, it counts
    found = finished(out)
    gone = [2] + ([4] if len(other) == lines[4]["bytes"] else [])
    assert found.indices.tolist() == [i for i in range(6) if i not in gone]
    assert sum(NOT_THE_BYTES in problem for problem in found.problems) == len(gone), found.problems
    store = FolderStore(out, None)
    refusal, done = store.prepare({"data.seed": 0}, 6, 6)
    store.release()
    assert refusal is None and sorted(set(range(6)) - set(done.tolist())) == gone  # made again


def test_a_tar_shard_whose_bytes_changed_loses_only_the_changed_members(tmp_path):
    import tarfile

    import numpy as np

    from lightning_diffusion.output.files import OutputFiles
    from lightning_diffusion.output.recorded import NOT_THE_BYTES, finished, merge_manifest
    from lightning_diffusion.output.settings import WriterSettings

    out = tmp_path / "out"
    out.mkdir()
    settings = WriterSettings(format="webdataset", samples_per_shard=6, fsync="off", write_workers=0)
    files = OutputFiles(out, settings, out / "manifest.part-0.jsonl", "flat")
    files.write_batch([{"index": i, "prompt": f"p {i}", "seed": i, "params": {},
                        "image": np.full((8, 8, 3), i / 6, dtype=np.float32)} for i in range(6)])
    files.finish()
    merge_manifest(out)
    tar = out / "shard-000000000.tar"
    with tarfile.open(tar) as shard:
        member = shard.getmember("000000003.png")
    data = bytearray(tar.read_bytes())
    data[member.offset_data + member.size // 2] ^= 0xFF  # a flipped byte inside member 3
    tar.write_bytes(bytes(data))
    _later(tar, read_manifest_lines(out)[0])
    found = finished(out)
    assert found.indices.tolist() == [0, 1, 2, 4, 5]
    assert any("member 000000003.png" in p and NOT_THE_BYTES in p for p in found.problems), found.problems

