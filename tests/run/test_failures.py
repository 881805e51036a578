"""A dead rank never hangs the job: the others stop, the launcher names the rank, no process is left,
and a rerun finishes every index exactly once."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from PIL import Image

from lightning_diffusion.strategies import DataParallelStrategy
from lightning_diffusion.strategies.watchdog import LAUNCHER_PID, Launcher
from tests.conftest import REPO, read_manifest_lines, run_cli, run_here, tiny_args

COUNT = 24
TIMEOUT_S = 20  # the strategies' process-group timeout in these runs
CP = "lightning_diffusion.strategies.ContextParallelStrategy"


def children(pid):
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def start(out, strategy_args):
    prompts = "[" + ", ".join(f"prompt {i}" for i in range(COUNT)) + "]"
    args = tiny_args(out, "--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps", "12",
                     "--trainer.devices", "2", *strategy_args)
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, args


def wait_for_images(out, proc, count=2, limit=180):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(out.glob("*.png"))) >= count:
            return
        time.sleep(0.05)
    raise AssertionError("the run never got going")


@pytest.mark.slow
@pytest.mark.parametrize(
    "victim, strategy_args",
    [
        ("child", ["--trainer.strategy.class_path", "lightning_diffusion.strategies.DataParallelStrategy",
                   "--trainer.strategy.init_args.timeout", str(TIMEOUT_S)]),
        ("child", ["--trainer.strategy.class_path", CP, "--trainer.strategy.init_args.ulysses_degree", "2",
                   "--trainer.strategy.init_args.timeout", str(TIMEOUT_S)]),
        ("launcher", ["--trainer.strategy.class_path", CP, "--trainer.strategy.init_args.ulysses_degree", "2",
                      "--trainer.strategy.init_args.timeout", str(TIMEOUT_S)]),
    ],
    ids=["data-parallel-rank-1", "ulysses-rank-1", "ulysses-rank-0"],
)
def test_killed_rank_stops_the_job_and_a_rerun_completes(victim, strategy_args, tmp_path):
    out = tmp_path / "out"
    proc, args = start(out, strategy_args)
    wait_for_images(out, proc)
    target = children(proc.pid)[0] if victim == "child" else proc.pid
    killed_at = time.monotonic()
    os.kill(target, signal.SIGKILL)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the job hung after a rank died")
    assert proc.returncode != 0
    if victim == "child":  # the watchdog's exit, not a kill by Lightning's own observer
        assert "rank 1 (pid" in output and "killed by SIGKILL" in output, output
        assert proc.returncode == 1
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(proc.pid), "a rank was left running"
    assert time.monotonic() - killed_at < TIMEOUT_S + 30

    # The rerun may use another strategy and process count: one process, in this one.
    run_here(*args, "--trainer.devices", "1", "--trainer.strategy", "data_parallel")
    lines = read_manifest_lines(out)
    assert [line["index"] for line in lines] == list(range(COUNT))
    for line in lines:
        Image.open(out / line["file"]).verify()


@pytest.mark.slow
def test_a_replica_that_finishes_early_waits_longer_than_the_collective_timeout(tmp_path):
    """Replica 1 makes its one image and then waits at the writer's barrier while replica 0's last
    image takes far longer (about 10 s) than the 3 s collective timeout: the run must still end with exit 0."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "slow", "num_inference_steps": 700}\n')
    proc = run_cli(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts), "--data.batch_size", "1",
                              "--trainer.devices", "2", "--trainer.strategy.class_path",
                              "lightning_diffusion.strategies.DataParallelStrategy",
                              "--trainer.strategy.init_args.timeout", "3"), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line["index"] for line in read_manifest_lines(tmp_path / "out")] == [0, 1, 2]


def test_the_launcher_tells_only_its_children_its_pid():
    """The children's environment carries the launcher's pid (a child compares its parent with it),
    the launching process's own environment does not keep it (its writer process, say)."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DataParallelStrategy(), logger=False)
    launcher = trainer.strategy.launcher
    seen = []
    launcher._call_children_scripts = lambda: seen.append(os.environ.get(LAUNCHER_PID))  # starts no processes
    launcher.launch(lambda: None)
    assert seen == [str(os.getpid())]
    assert LAUNCHER_PID not in os.environ


def test_a_child_rank_watches_its_launcher_only_where_that_is_its_parent_or_gone(monkeypatch):
    """The pid from the environment is taken (and dropped, for the rank's own children) where it is
    the parent or a process that is gone; a launcher alive but not the parent (a wrapper that forks,
    a value inherited from elsewhere) leaves the parent watched."""
    from lightning_diffusion.strategies.watchdog import launching_process

    gone = subprocess.Popen(["true"])
    gone.wait()
    for value, watched in [(None, os.getppid()), (str(os.getppid()), os.getppid()), (str(gone.pid), gone.pid),
                           (str(os.getpid()), os.getppid()), ("not a pid", os.getppid())]:
        if value is None:
            monkeypatch.delenv(LAUNCHER_PID, raising=False)
        else:
            monkeypatch.setenv(LAUNCHER_PID, value)
        assert launching_process() == watched, value
        assert LAUNCHER_PID not in os.environ


@pytest.mark.slow
def test_a_rank_whose_launcher_died_before_its_watchdog_started_exits_at_once(tmp_path):
    """The launching process is killed as soon as its child exists, while the child still imports:
    the child's parent is then init, alive, so only the launcher's pid (from the environment) shows
    the child it is orphaned; without it the child waited at the rendezvous for 5 minutes."""
    proc, _ = start(tmp_path / "out",
                    ["--trainer.strategy.class_path", "lightning_diffusion.strategies.DataParallelStrategy"])
    deadline = time.monotonic() + 120
    while not children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert children(proc.pid), "the launcher started no child"
    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait()  # reaped: the group's leader is not left as a zombie
    while group_alive(proc.pid) and time.monotonic() < killed_at + 90:
        time.sleep(0.1)
    alive = group_alive(proc.pid)
    if alive:
        os.killpg(proc.pid, signal.SIGKILL)
    output, _ = proc.communicate()
    assert not alive, f"the orphaned rank was still running 90 s after its launcher died:\n{output[-3000:]}"
    assert "rank 1: the launching process is gone; exiting." in output, output[-3000:]


def test_the_launcher_leaves_the_watching_to_the_watchdog():
    """Lightning's own child-process observer, polling every 5 s, SIGKILLs the launching process
    when a child has died, with only an INFO line; left running, it now and then beat the watchdog
    (0.5 s) and the job ended without naming the dead rank (seen in CI)."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DataParallelStrategy(), logger=False)
    launcher = trainer.strategy.launcher
    assert isinstance(launcher, Launcher)
    launcher._call_children_scripts = lambda: None  # this test starts no rank processes
    threads = launcher.launch(threading.enumerate)
    assert "child-process-observer" not in [thread.name for thread in threads]


def test_the_stall_watch_watches_only_batches_after_the_first_and_any_beat_resets_it():
    from lightning_diffusion.strategies.watchdog import StallWatch

    watch = StallWatch(timeout_s=0.05, rank=0, drain=lambda: None)
    watch.batch_started()
    time.sleep(0.08)
    assert watch.stalled_for() is None  # the first batch compiles and warms up: not watched
    watch.batch_ended()
    time.sleep(0.08)
    assert watch.stalled_for() is None  # between batches: idle, not stalled
    watch.batch_started()
    assert watch.stalled_for() is None
    time.sleep(0.08)
    assert watch.stalled_for() >= 0.05
    watch.beat()
    assert watch.stalled_for() is None


@pytest.mark.slow
def test_a_stuck_peer_ends_the_replica_with_a_message_before_the_backend_timeout(tmp_path):
    """A rank that stops answering (SIGSTOP: its connections stay open, so gloo sees nothing) leaves
    its peer waiting in a collective. The stall watch ends the peer at the strategy's timeout with
    one line, before the backend's own timeout (60 s later; on NCCL its watchdog would abort the
    process without a word or a drain); the images written are kept and a rerun makes the rest."""
    out = tmp_path / "out"
    proc, args = start(out, ["--trainer.strategy.class_path", CP, "--trainer.strategy.init_args.ulysses_degree",
                             "2", "--trainer.strategy.init_args.timeout", "10"])
    wait_for_images(out, proc)
    os.kill(children(proc.pid)[0], signal.SIGSTOP)
    try:
        output, _ = proc.communicate(timeout=10 + 55)  # the backends' own timeout is 10 + 60 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the stall watch did not end the waiting rank before the backend's timeout")
    assert proc.returncode == 1, output[-3000:]
    assert "rank 0 made no progress for 10 s inside a batch (the strategy's timeout)" in output, output[-3000:]
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the stopped rank was left behind")
    run_here(*args, "--trainer.devices", "1", "--trainer.strategy", "data_parallel")
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(COUNT))


def test_the_stall_watch_drains_the_writer_the_run_context_names_while_it_is_set_up(tmp_path):
    """The strategy reaches the writer only through its run context: the writer adds its drain at
    setup and takes it away when the run ends; the strategy's stall watch calls what is there."""
    from lightning.pytorch.callbacks import Callback

    from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule

    writer = ImageWriter(str(tmp_path / "out"), write_workers=1, write_in="thread")
    seen, written = [], []

    class Look(Callback):
        def on_predict_batch_end(self, trainer, *args, **kwargs):
            # After the writer's own batch end: the image is queued to its thread. The stall watch's
            # call writes it now (as a rank stuck in a collective would, before it ends).
            seen.append(list(trainer.strategy.run_context.drains))
            trainer.strategy.run_context.drain_writers()
            written.append((writer._writers, sorted(p.name for p in (tmp_path / "out").glob("*.png"))))

    strategy = DataParallelStrategy()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                      callbacks=[writer, Look()])
    trainer.predict(DiffusionModule("tiny:flux", height=64, width=64, num_inference_steps=1),
                    datamodule=PromptDataModule(["a fox"], batch_size=1))
    assert seen == [[writer.drain_on_stall]]
    assert written == [(None, ["000000-a-fox.png"])]  # its writers drained and stopped, the image on disk
    assert strategy.run_context.drains == []
    assert len(read_manifest_lines(tmp_path / "out")) == 1
