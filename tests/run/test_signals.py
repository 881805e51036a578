"""SIGTERM outside SLURM (Kubernetes' pod deletion, torchrun's agent, systemd, ``kill PID``) stops a
run as Ctrl-C does: the images in flight are finished, the manifest merged, exit code 143 and a
resume hint; whichever process the signal reaches, every rank stops. Real processes, real signals."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, read_manifest_lines, run_cli, tiny_args
from tests.run.test_failures import children, group_alive, wait_for_images

COUNT = 24


def start(out):
    prompts = "[" + ", ".join(f"prompt {n}" for n in range(COUNT)) + "]"
    args = tiny_args(out, "--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps", "16",
                     "--trainer.devices", "2")
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, args


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "rank-1"])
def test_sigterm_stops_every_rank_after_the_images_in_flight(target, tmp_path):
    out = tmp_path / "out"
    proc, args = start(out)
    wait_for_images(out, proc)
    victim = proc.pid if target == "launcher" else children(proc.pid)[0]
    os.kill(victim, signal.SIGTERM)
    # the images written so far: published, or under their temporary names until their batch is
    # published (renamed and recorded together, under the folder's fence)
    at_signal = len(list(out.glob("*.png"))) + len(list(out.glob(".*.png.tmp-*")))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-3000:]
    lines = read_manifest_lines(out)
    made = len(lines)
    # Both replicas stop within a few images (each finishes its batch, the writer its queue): had
    # the rank without the signal gone on, it would have made its 12.
    assert 0 < made <= at_signal + 6, (at_signal, made, output[-2000:])
    assert f"stopped on SIGTERM after {made} of {COUNT} images; run the same command to resume." in output
    assert sorted({line["index"] for line in lines}) == sorted(line["index"] for line in lines)
    assert all((out / line["file"]).stat().st_size == line["bytes"] for line in lines)
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(proc.pid), "a rank or writer process outlived the stop"
    again = run_cli(*args)
    assert f"resumed: {made} already in the manifest" in again.stdout + again.stderr
    assert sorted(line["index"] for line in read_manifest_lines(out)) == list(range(COUNT))


def test_each_run_has_its_own_context_handed_from_the_cli_to_the_strategy_and_the_sampler():
    """No module global: a strategy makes its run's context, the CLI hands its own over (so the
    SIGUSR1 handler it installed before loading and its check verdict are the run's), and the prompt
    sampler ends when that context's replica agreed to stop."""
    import warnings

    import numpy as np

    from lightning_diffusion.core.context import RunContext
    from lightning_diffusion.input.data import BatchDataset, PlanSampler, PromptDataModule, PromptDataset
    from lightning_diffusion.run.config import DiffusionCLI
    from lightning_diffusion.strategies import DataParallelStrategy

    first, second = DataParallelStrategy(), DataParallelStrategy()
    assert first.run_context is not second.run_context
    assert first.run_context.stop is not second.run_context.stop

    mine = RunContext()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli = DiffusionCLI(args=["--config", "configs/tiny-flux.yaml"], run=False, run_context=mine)
    finally:
        os.chdir(cwd)
    assert cli.trainer.strategy.run_context is mine

    data = PromptDataModule(prompts=[f"prompt {n}" for n in range(6)], batch_size=1)
    data.setup("predict")
    plan = data.batch_plan(np.arange(6))
    dataset = BatchDataset(PromptDataset(data.records, data.seed, data.num_images_per_prompt, np.arange(6)), plan)
    sampler = PlanSampler(dataset, stopping=mine.stop.stopping)
    taken = []
    for position in sampler:
        taken.append(position)
        if len(taken) == 2:
            mine.stop.stopping.set()  # the replica agreed to stop: the loader ends, no batch is skipped
    assert len(taken) == 2 and len(list(PlanSampler(dataset))) == 6


def _blocked_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def test_a_ctrl_c_while_a_rank_starts_waits_for_the_first_line_of_the_package_then_ends_it(tmp_path):
    """A rank that the launcher starts begins with SIGINT blocked, as here: a Ctrl-C during its
    interpreter's start-up waits, and the package's first line ends the process in one line with
    exit 130 (unblocked, the same SIGINT lands in some import and prints a traceback)."""
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *tiny_args(tmp_path / "out")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_blocked_sigint)
    proc.send_signal(signal.SIGINT)  # pending: the interpreter is still starting
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, STOPPED_LINES[0] + "\n")
    assert not (tmp_path / "out").exists()


def test_a_ctrl_c_during_the_launch_reaches_the_ranks_started_after_it(tmp_path):
    """The launcher holds Ctrl-C while it starts the ranks; one that came meanwhile is passed on to
    the ranks started after it (which the terminal's signal missed), then taken by the launcher:
    the rank ends at once with the line and exit 130 (without it, it made every image)."""
    script = (
        "import os, signal, subprocess, sys\n"
        "from lightning_diffusion import interrupt\n"
        "mask = interrupt.block_for_children()\n"
        "os.kill(os.getpid(), signal.SIGINT)  # waits: blocked, and this process has one thread\n"
        f"rank = subprocess.Popen([sys.executable, '-m', 'lightning_diffusion', *{tiny_args(tmp_path / 'out')!r}],\n"
        "                        stderr=subprocess.PIPE, text=True)\n"
        "signal.signal(signal.SIGINT, lambda *_: None)  # this process outlives it here, to report\n"
        "interrupt.restore(mask, [rank])\n"
        "print(rank.wait(), repr(rank.stderr.read()))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.stdout == f"130 {STOPPED_LINES[0] + chr(10)!r}\n", done.stdout + done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, orig_argv, taken", [
    (["-m", "predict"], ["python", "-m", "lightning_diffusion", "predict"], True),
    (["-m", "predict"], ["python", "-u", "-m", "lightning_diffusion.cli", "predict"], True),
    (["/venv/bin/lightning-diffusion", "predict"], ["/venv/bin/python", "/venv/bin/lightning-diffusion", "predict"],
     True),
    (["-m", "predict"], ["python", "-m", "myproj", "predict"], False),  # another module that imports the package
    (["/venv/bin/lightning-diffusion", "predict"],  # a worker spawned with its parent's argv
     ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"], False),
    (["my_script.py", "predict"], ["python", "my_script.py", "predict"], False),
], ids=["python -m", "python -u -m cli", "console script", "another -m", "spawned worker", "a script"])
def test_only_the_command_line_itself_takes_ctrl_c_as_it_starts(argv, orig_argv, taken):
    from lightning_diffusion.core import interrupt

    assert interrupt.command_line(argv, orig_argv) is taken


def test_another_module_run_with_dash_m_keeps_its_own_ctrl_c(tmp_path):
    """``python -m myproj predict``, whose package imports lightning_diffusion, keeps Python's
    handler (its own ``except KeyboardInterrupt`` runs), as a Python caller does."""
    package = tmp_path / "myproj"
    package.mkdir()
    (package / "__init__.py").write_text("import lightning_diffusion  # noqa: F401\n")
    (package / "__main__.py").write_text("import signal\nprint(signal.getsignal(signal.SIGINT) is "
                                         "signal.default_int_handler)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    assert subprocess.run([sys.executable, "-m", "myproj", "predict"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=True).stdout == "True\n"


STOPPED_LINES = ("lightning-diffusion: interrupted (Ctrl-C); the images recorded are kept, and the same command "
                 "resumes.", "lightning-diffusion: stopped after ")


@pytest.mark.slow
def test_ctrl_c_at_any_instant_of_start_up_ends_in_one_line_and_exit_130(tmp_path):
    """SIGINT to every process of a two-rank job, as a terminal sends it, at 20 instants from the
    imports to the first images: each ends with exit 130 and one documented line (or, past the
    end, exit 0), no traceback, no "Fatal Python error", and no process left behind."""
    instants = [0.25 * 1.2 ** k for k in range(20)]  # 0.25 s to 8 s, denser where start-up is busiest
    seen = []
    for number, instant in enumerate(instants):
        out = tmp_path / f"out{number}"
        proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *tiny_args(
            out, "--trainer.devices", "2", "--data.batch_size", "1", "--model.num_inference_steps", "4",
            config="configs/tiny.yaml")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        time.sleep(instant)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        _, err = proc.communicate(timeout=180)
        last = err.strip().splitlines()[-1] if err.strip() else ""
        seen.append((round(instant, 2), proc.returncode, last[:60]))
        assert "Traceback" not in err and "Fatal Python error" not in err, (instant, err[-3000:])
        assert (proc.returncode == 130 and last.startswith(STOPPED_LINES)) or (
            proc.returncode == 0 and "made 10 outputs" in err), (instant, proc.returncode, err[-3000:])
        deadline = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(proc.pid), (instant, "a process of the job outlived it")
    assert sum(code == 130 for _, code, _ in seen) >= 15, seen  # most instants fall inside start-up


@pytest.mark.slow
def test_a_peer_that_leaves_before_the_end_is_one_line_on_rank_0_and_a_rerun_completes(tmp_path):
    args = tiny_args(tmp_path, "--trainer.devices", "2", "--data.prompts", "[a, b, c, d]", "--data.batch_size", "1",
                     "--model.num_inference_steps", "2")
    proc = run_cli(*args, "--trainer.callbacks+=tests.broken_plans.LeaveBeforeTheEnd", check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "lightning-diffusion: error: rank 0: another process of this run ended before the end of the run (its "
        "connection was lost); the images recorded are kept, and the same command resumes.")
    run_cli(*args)
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == [0, 1, 2, 3]


def test_a_repeated_sigterm_while_a_run_stops_is_ignored_until_its_last_collective():
    """scancel reaches a task twice (slurmstepd's SIGTERM and srun's forward of its own): the second,
    arriving after the strategy gave SIGTERM back, must not end the task before the end-of-run
    agreement (its peers would see it lost). Once ``finish_job``'s collective is over, SIGTERM ends
    the process as before."""
    code = """if True:
        import os, signal, sys
        from lightning_diffusion.core.preemption import StopController
        stop = StopController()
        stop.enabled = True
        stop.watch_terminate()
        os.kill(os.getpid(), signal.SIGTERM)   # the run's stop
        assert stop.terminated.is_set()
        stop.release_terminate(final=False)    # the strategy's teardown
        os.kill(os.getpid(), signal.SIGTERM)   # the repeat: ignored
        print("alive after the repeat", flush=True)
        stop.release_terminate()               # after finish_job's last collective
        os.kill(os.getpid(), signal.SIGTERM)   # ends the process now
        print("still alive", flush=True)
    """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "alive after the repeat" in proc.stdout and "still alive" not in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
