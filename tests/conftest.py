"""Shared fixtures: one tiny FLUX pipeline cache for the whole session, and a CLI runner.

Multi-process runs go through the CLI in a subprocess: Lightning re-launches ``sys.argv`` for the
other ranks, which under pytest would re-run pytest.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]

# Every process stands for a GPU: one thread each, in this process (in-process references) and in
# the ranks it starts (they inherit it; Lightning otherwise gives a lone process all the cores and
# each of two ranks half). CPU kernels split their sums by thread count, so a reference made with 2
# threads differs from 1-thread ranks by about 1e-6, and bit-identity tests need equal threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The deliberately broken strategies of tests/broken_plans.py are named by class_path in configs;
# a config may name classes of the packages this variable lists (config_guard).
os.environ.setdefault("LIGHTNING_DIFFUSION_CLASS_MODULES", "tests")


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_process():
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_DISTRIBUTED_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A Trainer made in this process sets MASTER_PORT and friends and leaves its process group
    (and the store listening on that port) open; a later test's ranks would inherit the port and
    fail with EADDRINUSE. Each test leaves neither behind."""
    saved = {key: os.environ.get(key) for key in _DISTRIBUTED_VARIABLES}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory):
    cache = os.environ.get("LIGHTNING_DIFFUSION_CACHE") or str(tmp_path_factory.mktemp("tiny-cache"))
    os.environ["LIGHTNING_DIFFUSION_CACHE"] = cache
    from lightning_diffusion.pipelines import tiny

    return tiny.resolve("tiny:flux")


def run_cli(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m lightning_diffusion ARGS`` from the repository root."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_diffusion", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"CLI failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def call_main(args) -> int:
    """The CLI's ``main`` in this process; its exit code. The environment is restored afterwards:
    Lightning sets MASTER_PORT and friends for the ranks it starts, and a later run that inherits
    them waits for ranks that never come."""
    from lightning_diffusion.cli import main

    saved = dict(os.environ)
    try:
        main(list(args))
        return 0
    except SystemExit as exit_info:
        return exit_info.code if isinstance(exit_info.code, int) else 0
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_here(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``lightning-diffusion ARGS`` in this process, for single-process runs: the same entry point
    as ``run_cli`` without a new interpreter (about 9 s of imports saved a run). Output, warnings and
    the package's log are captured."""
    import contextlib
    import io
    import logging

    import yaml

    from lightning_diffusion.core.console import log

    words = list(args)
    config = yaml.safe_load((REPO / words[words.index("--config") + 1]).read_text()) if "--config" in words else {}
    devices = (config.get("trainer") or {}).get("devices", 1)
    for flag, value in zip(words, words[1:]):
        if flag == "--trainer.devices":
            devices = value
    # Lightning starts the other ranks by re-running sys.argv: here, that would be pytest. (verify
    # and benchmark start their runs as processes of their own.)
    assert words[0] != "predict" or str(devices) == "1", "run_here is for single-process runs; use run_cli"
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    log.addHandler(handler)
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = call_main(args)
    finally:
        log.removeHandler(handler)
        os.chdir(cwd)
    proc = subprocess.CompletedProcess(["lightning-diffusion", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"CLI failed ({code}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def cli_here(capsys):
    """``lightning-diffusion ARGS`` in this process, for runs that end before any rank starts
    (refused configs): the same entry point as ``run_cli``, without a new interpreter."""

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        code = call_main(args)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["lightning-diffusion", *args], code, out, err)

    return run


def tiny_args(output_dir: Path, *extra: str, config: str = "configs/tiny-flux.yaml") -> list[str]:
    """``predict`` on a tiny config into ``output_dir``, saving float arrays for comparisons."""
    return [
        "predict",
        "--config",
        config,
        "--writer.output_dir",
        str(output_dir),
        "--writer.save_arrays",
        "true",
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]


def check_model(strategy, module, records=None) -> None:
    """Run a strategy's weight-free rules on a module's request, raising as every rank would."""
    from lightning_diffusion.core.errors import raise_problems

    raise_problems(strategy.check_devices() + strategy.check_request(module.request(records)))


# tiny:shapes (configs/tiny.yaml) in parity tests: five captions, 4 steps (parity does not need 12).
SHAPES_ARGS = ["--data.prompts", "[a red circle on a blue background, a small yellow star in the top left corner on a "
               "black background, a large green square on a white background, a purple triangle at the bottom on a "
               "yellow background, a white star and a pink circle on a green background]",
               "--model.num_inference_steps", "4"]
FIVE_PROMPTS = "[a red fox in the snow, a lighthouse in a storm, a bowl of ramen, an astronaut, a watercolor map]"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Single-process float images (batch size 1) of a tiny config, made once per session and size:
    ``reference(config, height, width)`` -> {index: array}. The prompts are FIVE_PROMPTS for
    tiny-flux.yaml, SHAPES_ARGS for tiny.yaml (tiny:shapes) and the config's own (5 records) for
    tiny-qwenimage.yaml."""
    made: dict[tuple, dict[int, np.ndarray]] = {}

    def get(config: str = "configs/tiny-flux.yaml", height: int = 64, width: int = 64) -> dict[int, np.ndarray]:
        key = (config, height, width)
        if key not in made:
            out = tmp_path_factory.mktemp("reference")
            prompts = {"configs/tiny-flux.yaml": ["--data.prompts", FIVE_PROMPTS],
                       "configs/tiny.yaml": SHAPES_ARGS}.get(config, [])
            run_here(*tiny_args(out, "--data.batch_size", "1", "--model.height", str(height),
                               "--model.width", str(width), *prompts, config=config))
            made[key] = load_arrays(out)
        return made[key]

    return get


def read_manifest_lines(output_dir: Path) -> list[dict]:
    """The manifest's lines by index (it holds them in the order they were merged: sorted within a
    run, runs and shards appended one after the other); an image written twice shows twice."""
    with open(output_dir / "manifest.jsonl", encoding="utf-8") as f:
        return sorted((json.loads(line) for line in f), key=lambda line: line["index"])


def load_arrays(output_dir: Path) -> dict[int, np.ndarray]:
    return {int(Path(f).stem): np.load(f) for f in glob.glob(str(output_dir / "*.npy"))}


def worst_difference(ours: dict[int, np.ndarray], ref: dict[int, np.ndarray]) -> float:
    """The largest absolute difference between two runs' arrays, which must hold the same images."""
    assert sorted(ours) == sorted(ref) and ours, (sorted(ours), sorted(ref))
    return max(float(np.abs(ours[i] - ref[i]).max()) for i in ref)


def load_pngs(output_dir: Path) -> dict[int, np.ndarray]:
    return {int(Path(f).name[:6]): np.asarray(Image.open(f)) for f in glob.glob(str(output_dir / "*.png"))}


def tiny_flux_with(folder: Path, component: str, cls: str, config: Optional[dict] = None) -> Path:
    """tiny:flux's configs, without weights (the checks before loading read configs only), with
    ``component`` naming diffusers' class ``cls`` (and ``config`` as its config.json, if given)."""
    from lightning_diffusion.pipelines import tiny

    source, target = Path(tiny.resolve("tiny:flux")), folder / "model"
    for file in source.rglob("*.json"):
        (target / file.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        (target / file.relative_to(source)).write_text(file.read_text())
    index = json.loads((target / "model_index.json").read_text())
    index[component] = ["diffusers", cls]
    (target / "model_index.json").write_text(json.dumps(index))
    if config is not None:
        (target / component / "config.json").write_text(json.dumps(config))
    return target
