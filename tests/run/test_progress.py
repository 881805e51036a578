"""Progress you can trust: one bar for the job, plain lines without a terminal, ``status`` from the
folder alone, and a summary of every run in ``run.json``."""

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.conftest import REPO, run_here, tiny_args

COUNT = 16


def on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run the CLI with its output on a pseudo-terminal of 100 columns; its exit code and output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, stdin=slave,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    output = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        output += chunk
    os.close(master)
    return proc.wait(timeout=300), output.decode(errors="replace")


@pytest.mark.slow
def test_the_bar_of_two_replicas_ends_at_100_percent_of_the_job(tmp_path):
    code, output = on_a_terminal(tiny_args(tmp_path / "out", "--trainer.devices", "2",
                                           "--trainer.enable_progress_bar", "true"))
    assert code == 0, output[-3000:]
    frames = [frame for frame in output.replace("\r\n", "\r").split("\r") if frame.startswith("Images:")]
    assert frames, output[-3000:]
    assert "100%" in frames[-1] and "10/10" in frames[-1]
    assert not any("replica" in frame for frame in frames)  # the job's bar, not rank 0's share


def status(out) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "lightning_diffusion", "status", str(out), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}


@pytest.mark.slow
def test_status_while_running_after_a_kill_and_after_completion(tmp_path):
    out = tmp_path / "out"
    prompts = "[" + ", ".join(f"prompt {i}" for i in range(COUNT)) + "]"
    # 40 steps an image: the run must outlast the start-up of the status process below (seconds on a
    # busy machine), which at 10 steps could find it finished.
    args = tiny_args(out, "--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps", "40",
                     "--trainer.devices", "2")
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(list(out.glob("*.png"))) < 4:
        time.sleep(0.1)
    code, during = status(out)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert code == 3, during
    assert during["running"] and during["lock"]["live"] and during["expected"] == COUNT
    assert 0 < during["done"] < COUNT and set(during["by_rank"]) <= {"0", "1"}
    assert during["eta_s"] is not None and 0 < during["eta_s"] < 600
    assert 0 < during["rate_per_s"] < 20  # a few images a second at most: not a batch's milliseconds apart

    code, after_kill = status(out)
    assert code == 4, after_kill
    assert not after_kill["running"] and after_kill["lock"] and not after_kill["lock"]["live"]
    text = subprocess.run([sys.executable, "-m", "lightning_diffusion", "status", str(out)], cwd=REPO,
                          capture_output=True, text=True).stdout
    assert "incomplete, nobody is running it" in text and "(stale: its run is gone)" in text

    run_here(*args, "--trainer.devices", "1")  # the rest, in this process
    code, done = status(out)
    assert code == 0 and done["complete"] and done["done"] == COUNT and done["lock"] is None
    assert done["last_run"]["skipped"] == after_kill["done"]
    last = done["last_run"]
    assert done["rate_per_s"] == round(last["made"] / (last["wall_s"] - last["load_s"]), 3)  # the run's own rate


def test_status_refuses_what_is_not_an_output_folder(tmp_path, cli_here):
    for target, message in [(tmp_path, "is not an output folder"), (tmp_path / "nope", "is not a folder")]:
        proc = cli_here("status", str(target))
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_status_names_a_corrupt_manifest_line_and_changes_nothing(tmp_path, cli_here):
    (tmp_path / "000000-a.png").write_bytes(b"x" * 10)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text('{"index": 0, "file": "000000-a.png", "bytes": 10}\n{"index": 1, "fi\n')
    (tmp_path / "run.json").write_text(json.dumps({"model": "tiny:flux", "expected": 3, "history": []}))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    proc = cli_here("status", str(tmp_path))
    assert proc.returncode == 4
    assert "1 of 3 (33%) outputs, incomplete, nobody is running it" in proc.stdout
    assert "not counted: manifest.jsonl:2: not a manifest line" in proc.stdout
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
