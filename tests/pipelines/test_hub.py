"""Hub ids without the hub (issue 25): ``download``, offline runs from the cache, the messages for each
way a hub id fails, and ``slurm --submit`` fetching first. Nothing reaches the network: a real HTTP
server on 127.0.0.1 serves tiny pipelines in the hub's URL layout (``tests/hub_server.py``), and the
commands run as subprocesses with ``HF_ENDPOINT`` pointing at it (huggingface_hub reads it once, when
imported) and ``HF_HOME`` in a folder of the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.pipelines import tiny
from tests.commands.test_slurm import cluster, job_log, submitted_job  # noqa: F401  (the cluster fixture)
from tests.conftest import FIVE_PROMPTS, REPO, load_arrays, tiny_args
from tests.hub_server import HubServer

REPO_ID = "test/tiny-flux"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The hub: tiny:flux as test/tiny-flux (and as a gated copy), a repository that is no
    diffusers pipeline."""
    plain = tmp_path_factory.mktemp("not-a-pipeline")
    (plain / "README.md").write_text("no model_index.json here\n")
    with HubServer({REPO_ID: tiny.resolve("tiny:flux"), "test/gated": tiny.resolve("tiny:flux"), "test/plain": plain},
                   gated={"test/gated"}) as server:
        yield server


def cli(hub: HubServer, home: Path, *args: str, offline: bool = False, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "lightning_diffusion", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def cached_files(home: Path) -> list[str]:
    """The files of the repository's snapshot in the cache at ``home`` (what a run fetched: the
    server's log would miss files whose bytes the cache already had under another name)."""
    (snapshot,) = (home / "hub").glob("models--test--tiny-flux/snapshots/*")
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def predict_args(out: Path, *extra: str) -> list[str]:
    return tiny_args(out, "--model.pretrained_model_name_or_path", REPO_ID, "--data.prompts", FIVE_PROMPTS,
                     "--data.batch_size", "1", *extra)


@pytest.mark.slow
def test_download_dry_run_lists_what_a_run_fetches_and_the_run_then_goes_offline(hub, tmp_path, reference):
    # A run with network and an empty cache fetches what from_pretrained reads: the reference list.
    online = cli(hub, tmp_path / "run-home", *predict_args(tmp_path / "online"))
    assert online.returncode == 0, online.stderr[-3000:]
    read_by_a_run = cached_files(tmp_path / "run-home")
    assert "transformer/diffusion_pytorch_model.safetensors" in read_by_a_run

    home = tmp_path / "home"
    dry = cli(hub, home, "download", "--config", "configs/tiny-flux.yaml", "--model.pretrained_model_name_or_path",
              REPO_ID, "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    listed = sorted(line.split()[-1] for line in dry.stdout.splitlines() if re.match(r"\s*[\d.,]+ \w?B ", line))
    assert listed == read_by_a_run
    assert re.search(rf"{REPO_ID} at \w+: {len(listed)} files, [\d.]+ MB; {len(listed) - 1} to fetch", dry.stdout)
    assert not list((home / "hub").rglob("*.safetensors")), "a dry run fetched weights"

    fetch = cli(hub, home, "download", "--config", "configs/tiny-flux.yaml", "--model.pretrained_model_name_or_path",
                REPO_ID)
    assert fetch.returncode == 0 and f"{len(listed)} files" in fetch.stdout and "snapshots" in fetch.stdout

    # Offline from that cache: not one request, the pictures of the local folder.
    before = len(hub.requests)
    offline = cli(hub, home, *predict_args(tmp_path / "offline"), offline=True)
    assert offline.returncode == 0, offline.stderr[-3000:]
    assert hub.requests[before:] == []
    ours, ref = load_arrays(tmp_path / "offline"), reference()
    assert sorted(ours) == list(range(5)) and all(np.array_equal(ours[i], ref[i]) for i in range(5))


@pytest.mark.slow
def test_two_processes_with_network_fetch_each_file_once(hub, tmp_path):
    """The first process of the node fetches while the other waits, then finds everything cached:
    each weight file is asked for (HEAD, then GET) by one process only. (Both ranks fetching at
    once would also GET each file once, the hub's file locks see to that, but both ask for it.)"""
    before = len(hub.requests)
    proc = cli(hub, tmp_path / "home", *predict_args(tmp_path / "out", "--trainer.devices", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    asked = [(m, p) for m, p in hub.requests[before:] if p.endswith(".safetensors")]
    assert len(asked) == 8 and len(set(asked)) == 8, asked  # 4 weight files, a HEAD and a GET each


@pytest.mark.slow
def test_offline_messages_name_what_is_missing_and_how_to_fetch_it(hub, tmp_path):
    home = tmp_path / "home"
    nothing = cli(hub, home, *predict_args(tmp_path / "out"), offline=True)
    assert nothing.returncode == 2
    assert (f"{REPO_ID} is not in the Hugging Face cache ({home / 'hub'}) and HF_HUB_OFFLINE=1 is set" in nothing.stderr
            and "lightning-diffusion download --config" in nothing.stderr), nothing.stderr
    assert "has no model_index.json" not in nothing.stderr  # the old, false message
    assert "Fetch it where there is network: lightning-diffusion download --config" in nothing.stderr
    assert "nodes share" not in nothing.stderr  # no cluster is assumed
    # Rendering a SLURM script needs no weights: written, with a warning (the job checks the model)
    script = tmp_path / "job.sbatch"
    rendered = cli(hub, home, "slurm", "--config", "configs/tiny-flux.yaml", "--script", str(script), "--",
                   "--model.pretrained_model_name_or_path", REPO_ID, "--writer.output_dir", str(tmp_path / "out"),
                   offline=True)
    assert rendered.returncode == 0 and script.is_file(), rendered.stderr
    assert "warning: the model was not checked here" in rendered.stderr

    assert cli(hub, home, "download", "--config", "configs/tiny-flux.yaml", "--model.pretrained_model_name_or_path",
               REPO_ID).returncode == 0
    (vae,) = (home / "hub").glob("models--test--tiny-flux/snapshots/*/vae/diffusion_pytorch_model.safetensors")
    vae.unlink()
    partial = cli(hub, home, *predict_args(tmp_path / "out"), offline=True)
    assert partial.returncode == 2
    assert ("1 file(s) its from_pretrained reads are missing from the Hugging Face cache" in partial.stderr
            and "vae/diffusion_pytorch_model.safetensors" in partial.stderr), partial.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.png"))


@pytest.mark.slow
@pytest.mark.parametrize("model, extra, message", [
    ("test/gated", [], "test/gated is a gated repository: accept its licence on https://huggingface.co/test/gated"),
    (REPO_ID, ["--model.from_pretrained_kwargs.revision", "v9"], "test/tiny-flux has no revision 'v9'"),
    ("test/nope", [], "test/nope is not a repository on the hub"),
    ("test/plain", [], "'test/plain' is not a diffusers pipeline: it has no model_index.json"),
    (REPO_ID, ["--model.from_pretrained_kwargs.variant", "fp16"], "test/tiny-flux has no weights of variant 'fp16'"),
])
def test_each_hub_failure_has_its_own_message(hub, tmp_path, model, extra, message):
    """predict's checks before loading, and download (the same messages: asked once)."""
    commands = [tiny_args(tmp_path / "out", "--model.pretrained_model_name_or_path", model, *extra)]
    if model == "test/gated":
        commands.append(["download", "--config", "configs/tiny-flux.yaml", "--model.pretrained_model_name_or_path",
                         model, *extra])
    for command in commands:
        proc = cli(hub, tmp_path / "home", *command)
        assert proc.returncode == 2 and message in proc.stderr, (command[0], proc.stderr[-2000:])


def test_a_download_larger_than_the_free_disk_is_refused_before_it_starts(tmp_path):
    from lightning_diffusion.pipelines import hub as hub_module

    planned = hub_module.Plan(REPO_ID, "0" * 40, [hub_module.HubFile("transformer/huge.safetensors", 10**18, False),
                                                  hub_module.HubFile("model_index.json", 600, True)])
    with pytest.raises(ConfigError, match=r"needs 1,000,000,000.00 GB more in .*, but its file system has"):
        hub_module.check_space(planned, {"cache_dir": str(tmp_path)})


@pytest.mark.slow
def test_slurm_fetches_before_submitting_and_the_job_runs_offline(cluster, hub, tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    args = ["slurm", "--config", str(REPO / "configs" / "tiny-flux.yaml"), "--submit", "--wait", "--",
            *predict_args(out)[3:]]
    refused = cli(hub, home, *args, offline=True, cwd=tmp_path)
    assert refused.returncode == 2 and "is not in the Hugging Face cache" in refused.stderr, refused.stderr[-2000:]
    assert "submitted job" not in refused.stdout

    proc = cli(hub, home, *args, cwd=tmp_path)
    job = submitted_job(proc)
    assert proc.returncode == 0, proc.stdout + job_log(out, job)[-3000:]
    script = (out / "lightning-diffusion.sbatch").read_text()
    assert "export HF_HUB_OFFLINE=1" in script and f"export HF_HUB_CACHE={home / 'hub'}" in script
    assert "5 of 5 outputs" in proc.stdout


def test_the_hub_probe_goes_through_a_proxy_where_one_applies(monkeypatch):
    """A network that reaches the hub only through HTTPS_PROXY is online: the probe connects to the
    proxy (a name that resolves nowhere is unreachable without one); NO_PROXY sends it direct."""
    import socket

    from huggingface_hub import constants

    from lightning_diffusion.pipelines import hub

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    listening = socket.create_server(("127.0.0.1", 0))
    try:
        cases = [({}, False),
                 ({"HTTPS_PROXY": f"http://127.0.0.1:{listening.getsockname()[1]}"}, True),
                 ({"HTTPS_PROXY": f"127.0.0.1:{listening.getsockname()[1]}"}, True),
                 ({"HTTPS_PROXY": f"http://127.0.0.1:{listening.getsockname()[1]}", "NO_PROXY": "hub.invalid"}, False)]
        closed = socket.create_server(("127.0.0.1", 0))
        cases.append(({"HTTPS_PROXY": f"http://127.0.0.1:{closed.getsockname()[1]}"}, False))
        closed.close()
        for env, expected in cases:
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            hub.reachable.cache_clear()
            assert hub.reachable(timeout_s=2.0) is expected, env
            for name in env:
                monkeypatch.delenv(name)
    finally:
        listening.close()
        hub.reachable.cache_clear()
