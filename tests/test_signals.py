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
from tests.test_failures import children, group_alive, wait_for_images

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
    at_signal = len(list(out.glob("*.png")))
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

    from lightning_diffusion.config import DiffusionCLI
    from lightning_diffusion.data import BatchDataset, PlanSampler, PromptDataModule, PromptDataset
    from lightning_diffusion.run_context import RunContext
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
