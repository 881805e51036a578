"""A run killed half way and run again ends with every index exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO, read_manifest_lines, run_cli, tiny_args

COUNT = 40


def finished_lines(out):
    lines = []
    for part in out.glob("manifest.part-*.jsonl"):
        lines += [json.loads(line) for line in part.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return lines


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
    assert f"{len(kept)} images already done are skipped" in rerun.stdout + rerun.stderr

    lines = read_manifest_lines(out)
    assert [line["index"] for line in lines] == list(range(COUNT))
    assert len(list(out.glob("*.png"))) == COUNT
    assert not list(out.glob("manifest.part-*")) and not list(out.glob(".*tmp*"))
    for index, mtime in kept.items():  # finished images were not redone
        assert (out / lines[index]["file"]).stat().st_mtime_ns == mtime
    assert (out / lost["file"]).is_file()
    assert (out / "000038-prompt-38.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
