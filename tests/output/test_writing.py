"""Writing off the prediction thread (bounded queue, a writer process or threads), image formats and
fsync policies: the same files and manifest as writing on the prediction thread, exactly once after
a kill that lands while the queue is full, errors of a writer fail the run, and a writer process
never outlives its rank."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from lightning_diffusion.output.files import EXIF_DESCRIPTION
from tests.conftest import REPO, read_manifest_lines, run_here, tiny_args
from tests.output.test_resume import finished_lines

SHAPES = ["--data.prompts", "configs/prompts/shapes.txt", "--model.num_inference_steps", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _output_of(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The run's output once it has ended; its whole session killed and the test failed if it hangs."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} hung:\n{output[-3000:]}")
    return output


def _start_run(writer: str, prompts: str, batch_size: int, tail: str = "", **popen) -> subprocess.Popen:
    """A tiny:flux predict in its own process (session) with ``writer`` (an expression), on a port of
    its own (another test's process group may hold Lightning's)."""
    script = (
        "from lightning.pytorch import Trainer\n"
        "from lightning_diffusion import DiffusionModule, PromptDataModule\n"
        "from tests.slow_writer import FailingWriter, SlowWriter\n"
        f"writer = {writer}\n"
        "trainer = Trainer(accelerator='cpu', devices=1, strategy='data_parallel', callbacks=[writer], logger=False,\n"
        "                  enable_progress_bar=False)\n"
        "def run():\n"
        "    trainer.predict(DiffusionModule('tiny:flux', height=64, width=64, num_inference_steps=2),\n"
        f"                    datamodule=PromptDataModule({prompts}, batch_size={batch_size}))\n"
        + (tail or "run()\n")
    )
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True,
                            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}, **popen)


def test_background_writing_gives_the_files_and_manifest_of_writing_on_the_prediction_thread(tmp_path):
    ways = {"0": ("--writer.write_workers", "0"), "process": ("--writer.write_in", "process"),
            "thread": ("--writer.write_in", "thread")}
    for name, setting in ways.items():
        run_here(*tiny_args(tmp_path / name, *SHAPES, "--data.batch_size", "3", *setting, config="configs/tiny.yaml"))
    drop = lambda lines: [{k: v for k, v in line.items() if k != "written"} for line in lines]  # noqa: E731
    sync = read_manifest_lines(tmp_path / "0")
    assert len(sync) == 10
    for name in ("process", "thread"):
        assert drop(read_manifest_lines(tmp_path / name)) == drop(sync), name
        for line in sync:
            assert (tmp_path / "0" / line["file"]).read_bytes() == (tmp_path / name / line["file"]).read_bytes()


@pytest.mark.parametrize("value", [
    {"index": 1, "image": np.arange(24, dtype=np.float32).reshape(2, 4, 3)},
    {"batch": [np.ones((3, 3), np.uint8)[:, ::2], np.zeros(0), "text", None]},  # not contiguous, empty
])
def test_the_pipe_frames_carry_arrays_exactly_and_a_cut_frame_reads_as_the_end(value):
    import io

    from lightning_diffusion.output.background import receive, send

    stream = io.BytesIO()
    send(stream, value)
    send(stream, ("done",))
    whole = stream.getvalue()
    stream.seek(0)
    got = receive(stream)
    assert receive(stream) == ("done",)
    assert repr(got) == repr(value)
    for cut in (0, 5, 12, len(whole) // 2, len(whole) - len(whole) // 3):
        with pytest.raises(EOFError):
            receive(io.BytesIO(whole[:cut]))


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(child) for child in f.read().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    return found


def _writer_processes(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline") as f:
                if "lightning_diffusion.output.background" in f.read():
                    found.append(child)
        except FileNotFoundError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_writer_process_that_dies_fails_the_run_and_a_killed_rank_leaves_no_writer_behind(tmp_path):
    """The writer process killed mid-run: the run fails naming it, every recorded image whole.
    The rank killed alone (not its process group): its writer process dies with it."""
    from lightning.pytorch import Callback, Trainer

    from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule

    class KillWriter(Callback):
        def on_predict_batch_end(self, trainer, *args):
            if trainer.predict_loop.batch_progress.current.completed == 2:
                os.kill(writer._writers.proc.pid, signal.SIGKILL)

    writer = ImageWriter(str(tmp_path / "died"))
    trainer = Trainer(accelerator="cpu", devices=1, strategy="data_parallel", callbacks=[writer, KillWriter()],
                      logger=False, enable_progress_bar=False)
    with pytest.raises(RuntimeError, match="writing images failed: WriterProcessDied: the writer process ended "
                                           "with exit code -9"):
        trainer.predict(DiffusionModule("tiny:flux", height=64, width=64, num_inference_steps=2),
                        datamodule=PromptDataModule([f"p{i}" for i in range(12)], batch_size=1))
    for line in finished_lines(tmp_path / "died"):
        assert (tmp_path / "died" / line["file"]).stat().st_size == line["bytes"]
    assert writer._writers is None and not any(_alive(pid) for pid in _writer_processes(os.getpid()))

    out = tmp_path / "killed"
    proc = _start_run(f"SlowWriter({str(out)!r}, write_workers=1, write_queue=2)", "[f'prompt {i}' for i in range(40)]",
                      2, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and len(finished_lines(out)) < 2:
        time.sleep(0.02)
    writers = _writer_processes(proc.pid)
    assert proc.poll() is None and len(writers) == 1, "the run must be writing in its writer process"
    os.kill(proc.pid, signal.SIGKILL)  # the rank only
    proc.wait()
    recorded = len(finished_lines(out))
    deadline = time.monotonic() + 10
    while _alive(writers[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(writers[0])
    if alive:
        os.kill(writers[0], signal.SIGKILL)
    time.sleep(1.5)  # a writer left behind records the images it holds (a second each in SlowFiles)
    assert len(finished_lines(out)) == recorded, "the writer process recorded images after its rank died"
    assert not alive, "the writer process outlived its rank"


def test_a_files_class_the_writer_process_cannot_import_is_refused(tmp_path):
    from lightning_diffusion import ImageWriter
    from lightning_diffusion.core.errors import ConfigError
    from lightning_diffusion.output.files import OutputFiles

    local = type("LocalFiles", (OutputFiles,), {"__module__": "__main__"})
    mine = type("MyWriter", (ImageWriter,), {"files_class": local})
    with pytest.raises(ConfigError, match="defined in the script being run.*writer.write_in: thread"):
        mine(str(tmp_path))
    assert mine(str(tmp_path), write_in="thread").settings.write_in == "thread"
    assert mine(str(tmp_path), write_workers=0).settings.write_workers == 0


@pytest.mark.parametrize("image_format, suffix", [("webp", ".webp"), ("jpeg", ".jpg")])
def test_lossy_formats_carry_the_parameters_in_exif_and_are_recorded(image_format, suffix, tmp_path, cli_here):
    out = tmp_path / "out"
    run_here(*tiny_args(out, *SHAPES, "--writer.image_format", image_format, "--writer.quality", "80",
                        config="configs/tiny.yaml"))
    line = read_manifest_lines(out)[0]
    assert line["file"].endswith(suffix) and (out / line["file"]).stat().st_size == line["bytes"]
    with Image.open(out / line["file"]) as picture:
        assert picture.format == image_format.upper()
        assert json.loads(picture.getexif()[EXIF_DESCRIPTION])["prompt"] == line["prompt"]
    settings = json.loads((out / "run.json").read_text())
    assert (settings["writer.image_format"], settings["writer.quality"]) == (image_format, 80)
    proc = cli_here(*tiny_args(out, *SHAPES, config="configs/tiny.yaml"))  # PNGs into a folder of lossy files
    assert proc.returncode == 2 and "writer.image_format" in proc.stderr


@pytest.mark.parametrize("write_in", [pytest.param("process", marks=pytest.mark.slow), "thread"])
def test_a_failing_writer_fails_the_run_and_records_no_unwritten_image(tmp_path, write_in):
    from lightning.pytorch import Trainer

    from lightning_diffusion import DiffusionModule, PromptDataModule
    from tests.slow_writer import FailingWriter

    writer = FailingWriter(str(tmp_path), write_workers=2, write_in=write_in)
    trainer = Trainer(accelerator="cpu", devices=1, strategy="data_parallel", callbacks=[writer], logger=False,
                      enable_progress_bar=False)
    with pytest.raises(RuntimeError, match=r"writing images failed: OSError: disk full \(on purpose\)"):
        trainer.predict(DiffusionModule("tiny:flux", height=64, width=64, num_inference_steps=2),
                        datamodule=PromptDataModule(["a", "b", "c", "d", "e", "f"], batch_size=1))
    lines = finished_lines(tmp_path)
    assert 2 not in {line["index"] for line in lines}
    assert all((tmp_path / line["file"]).stat().st_size == line["bytes"] for line in lines)


@pytest.mark.slow
def test_a_kill_while_the_queue_is_full_leaves_only_whole_recorded_images(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    proc = _start_run(f"SlowWriter({str(out)!r}, write_workers=1, write_queue=2)", "[f'prompt {i}' for i in range(40)]",
                      2, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    submitted = out / "submitted.txt"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and (
            len(finished_lines(out)) < 4 or not submitted.is_file()
            or 2 * len(submitted.read_text().split()) < len(finished_lines(out)) + 6):
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before the kill (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = finished_lines(out)
    handed = 2 * len(submitted.read_text().split())
    assert 4 <= len(done) and handed >= len(done) + 6, "the kill must land while images wait in the queue"
    for line in done:  # every recorded image is whole
        with Image.open(out / line["file"]) as picture:
            picture.verify()
        assert (out / line["file"]).stat().st_size == line["bytes"]
    rerun = run_here(*tiny_args(out, "--data.prompts", "[" + ", ".join(f"prompt {i}" for i in range(40)) + "]",
                                "--data.batch_size", "2", "--model.num_inference_steps", "2",
                                "--writer.allow_config_change", "true"))
    assert f"resumed: {len(done):,} already" in rerun.stdout + rerun.stderr
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(40))


def test_bad_writer_settings_are_refused_before_loading(tmp_path, cli_here):
    proc = cli_here(*tiny_args(tmp_path / "out", "--writer.image_format", "gif", "--writer.quality", "0",
                               "--writer.png_compress_level", "10", "--writer.fsync", "never",
                               "--writer.write_workers", "-1", "--writer.write_in", "gpu"))
    assert proc.returncode == 2
    for message in ["writer.image_format must be one of png, webp, jpeg, got 'gif'",
                    "writer.quality (WebP and JPEG) must be an integer from 1 to 100, got 0",
                    "writer.png_compress_level must be an integer from 0 to 9, got 10",
                    "writer.fsync must be one of file, batch, off, got 'never'",
                    "writer.write_workers must be an integer >= 0",
                    "writer.write_in must be one of process, thread, got 'gpu'"]:
        assert message in proc.stderr, message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_failing_run_with_dataloader_workers_ends_instead_of_waiting_for_its_writer(tmp_path):
    """DataLoader workers forked after the writer process started hold its pipe's write end, so the
    writer must be told the end in a frame: a failing run (its exception hooks run while the
    workers live) raises instead of waiting forever for the writer to see an EOF."""
    proc = _start_run(f"FailingWriter({str(tmp_path / 'out')!r})", "[f'p{i}' for i in range(12)], num_workers=1", 1,
                      "try:\n    run()\nexcept RuntimeError as err:\n    print('raised:', err)\n",
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = _output_of(proc, 120, "the failing run")
    assert "raised: writing images failed: OSError: disk full (on purpose)" in output, output[-3000:]


@pytest.mark.slow
def test_a_writer_that_fails_at_its_drain_on_rank_1_fails_rank_0_too(tmp_path):
    """Rank 1's last image fails in its writer, found only when rank 1 drains its queue at the end,
    after rank 0 has finished: rank 0 must not merge and end the job with exit 0 (each rank learns
    how the others' writing ended at the end-of-run barrier)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from lightning.pytorch import Trainer\n"
        "from lightning_diffusion import DiffusionModule, PromptDataModule\n"
        "from lightning_diffusion.cli import end_process\n"
        "from lightning_diffusion.strategies import DataParallelStrategy\n"
        "from tests.slow_writer import LastFailsWriter\n"
        "trainer = Trainer(accelerator='cpu', devices=2, strategy=DataParallelStrategy(),\n"
        "                  callbacks=[LastFailsWriter(sys.argv[1])], logger=False, enable_progress_bar=False)\n"
        "try:  # rank 1 gets indices 1 and 3: its last image fails\n"
        "    trainer.predict(DiffusionModule('tiny:flux', height=64, width=64, num_inference_steps=2),\n"
        "                    datamodule=PromptDataModule(['a', 'b', 'c', 'the last one fails'], batch_size=1))\n"
        "except RuntimeError as err:\n"
        "    print(f'rank {trainer.global_rank} raised: {err}', flush=True)\n"
        "    end_process(1)\n"
        "print(f'rank {trainer.global_rank} ended without an error', flush=True)\n"
        "end_process(0)\n")
    out = tmp_path / "out"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(out)], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = _output_of(proc, 240, "the run")
    assert "rank 1 raised: writing images failed: OSError: disk full (on purpose)" in output, output[-3000:]
    assert "rank 0 raised: writing images failed on rank 1: OSError: disk full (on purpose)" in output, output[-3000:]
    assert "ended without an error" not in output
    assert proc.returncode == 1
    assert not (out / "manifest.jsonl").exists()  # rank 0 did not merge
    assert sorted(line["index"] for line in finished_lines(out)) == [0, 1, 2]


@pytest.mark.parametrize("fenced", [False, True], ids=["plain", "fenced"])
@pytest.mark.parametrize("fsync", ["batch", "file", "off"])
def test_a_file_that_fails_mid_batch_leaves_the_files_before_it_recorded_and_no_temporary(tmp_path, fsync, fenced):
    """The batch's lines are appended together (one open and one sync a batch), but a failure on its
    third file still records the two written before it, each with its size, and nothing else; the
    same through a fence (a run's publication under its folder's lock, ``output.fence``)."""
    from lightning_diffusion.output.fence import FolderFence
    from lightning_diffusion.output.settings import WriterSettings
    from tests.slow_writer import FailingFiles

    files = FailingFiles(tmp_path, WriterSettings(fsync=fsync), part=tmp_path / "part.jsonl",
                         fence=FolderFence(tmp_path) if fenced else None)
    batch = [{"index": i, "prompt": f"prompt {i}", "seed": i, "params": {"height": 8},
              "image": np.full((8, 8, 3), i / 4, np.float32)} for i in range(4)]
    with pytest.raises(OSError, match="disk full"):
        files.write_batch(batch)
    lines = [json.loads(line) for line in (tmp_path / "part.jsonl").read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    assert [(tmp_path / line["file"]).stat().st_size for line in lines] == [line["bytes"] for line in lines]
    assert (sorted(path.name for path in tmp_path.iterdir() if path.name != ".manifest.merge-lock")
            == sorted([line["file"] for line in lines] + ["part.jsonl"]))


@pytest.mark.slow
@pytest.mark.parametrize("write_in", ["process", "thread"])
def test_writers_that_take_no_batch_for_long_say_so_and_still_write_every_batch(tmp_path, monkeypatch, write_in):
    """Writers held up (a second an image here, a stalled network mount on a cluster): a put that
    waits for them longer than STALL_WARNING says so, and so does the close, naming the rank."""
    import logging

    from lightning_diffusion.output import background
    from tests.slow_writer import SlowFiles

    monkeypatch.setattr(background, "STALL_WARNING", 0.4)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("lightning_diffusion").addHandler(handler)
    try:
        kind = background.WriterProcess if write_in == "process" else background.WriterThreads
        writers = kind(SlowFiles(tmp_path, part=tmp_path / "part.jsonl"), 1, 1, "rank 3's image writers")
        for index in range(3):  # one being written, one waiting: the third put waits about a second
            writers.put([{"index": index, "prompt": "p", "seed": index, "params": {},
                          "image": np.zeros((8, 8, 3), np.float32)}])
        writers.close()
    finally:
        logging.getLogger("lightning_diffusion").removeHandler(handler)
    assert writers.take_error() is None
    lines = (tmp_path / "part.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1, 2]
    assert ("rank 3's image writers have taken no batch for 0.4 s (their queue of 1 is full): prediction waits for "
            "them. A stalled file system (the output folder's network mount, say) hangs their file calls.") in said
    assert "rank 3's image writers are still writing the batches they hold after 0.4 s of waiting for them. " \
        "A stalled file system (the output folder's network mount, say) hangs their file calls." in said


@pytest.fixture
def small_file_system(tmp_path):
    """A tmpfs of 400 kB (needs CAP_SYS_ADMIN: root here and in CI); grown with ``grow()``."""
    folder = tmp_path / "small"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_ends_in_one_line_and_loses_nothing(small_file_system):
    """60 images of about 6 kB do not fit in 400 kB (the free-space check before the run passes: it
    is an estimate). The run ends with one line naming the folder and "no space left", exit 1; every
    image in the manifest is whole, and once there is room the same command makes the rest."""
    out = small_file_system / "out"
    prompts = small_file_system.parent / "p.txt"
    prompts.write_text("".join(f"a red circle number {i}\n" for i in range(60)))
    args = ["predict", "--config", "configs/tiny.yaml", "--data.prompts", str(prompts), "--writer.output_dir", str(out),
            "--trainer.enable_progress_bar", "false"]
    proc = subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"lightning-diffusion: error: writing images failed: no space left on the file system of {out} ("), proc.stderr
    lines = [json.loads(line) for part in out.glob("manifest*.jsonl") for line in part.read_text().splitlines()]
    assert 0 < len(lines) < 60  # the failed run's lines stay in its part until the next run merges them
    for line in lines:
        Image.open(out / line["file"]).verify()
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_file_system)], check=True)
    subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, check=True, capture_output=True,
                   timeout=300)
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(60))


@pytest.mark.slow
def test_ctrl_c_while_starting_up_is_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", "predict", "--config", "configs/tiny.yaml",
                             "--writer.output_dir", str(tmp_path / "out")], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # importing torch and lightning takes seconds
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("lightning-diffusion: "), err[-3000:]


@pytest.mark.slow
def test_ctrl_c_while_two_ranks_start_is_one_line(tmp_path):
    """The terminal's Ctrl-C reaches every process of the job: a rank still starting ends quietly,
    and the launching process alone says the line."""
    from lightning_diffusion.core.interrupt import INTERRUPTED_LINE

    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", "predict", "--config", "configs/tiny.yaml",
                             "--trainer.devices", "2", "--trainer.strategy", "data_parallel",
                             "--writer.output_dir", str(tmp_path / "out")], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline:  # until the launcher has started its second rank
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if children or proc.poll() is not None:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.count(INTERRUPTED_LINE) == 1 and "Traceback" not in err, err[-3000:]
