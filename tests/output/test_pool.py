"""The elastic pool (``data.schedule: pull``): claims, joining, takeovers, a late finisher, a slower
replica; real jobs as separate processes, against one process."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.output.files import to_uint8
from lightning_diffusion.output.folder_store import FolderStore
from lightning_diffusion.output.lock import busy_message
from lightning_diffusion.output.pool import WORKERS, FolderPoolFiles, Pool, live_workers, pool_summary
from tests.commands.test_slurm import cluster  # noqa: F401  (the cluster fixture)
from tests.conftest import FIVE_PROMPTS, REPO, load_arrays, read_manifest_lines, run_here, tiny_args

PROMPTS = [p.strip() for p in FIVE_PROMPTS.strip("[]").split(",")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path: Path, out, name: str, seconds: dict, devices: int = 1, lease: float = 5.0,
         writer: str = "save_arrays=True", prompts: list = PROMPTS) -> subprocess.Popen:
    """A job of the pool in ``out``: tiny:flux over the five prompts, batches of one, each batch held
    ``seconds[rank]`` before it is written (``PacedWriter``, with the keyword arguments ``writer``)."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from lightning.pytorch import Trainer\n"
        "from lightning_diffusion import DiffusionModule, PromptDataModule\n"
        "from tests.slow_writer import PacedWriter\n"
        f"writer = PacedWriter({str(out)!r}, {writer}, seconds={seconds!r})\n"
        f"trainer = Trainer(accelerator='cpu', devices={devices}, strategy='data_parallel', callbacks=[writer],\n"
        "                  logger=False, enable_progress_bar=False)\n"
        "trainer.predict(DiffusionModule('tiny:flux', height=64, width=64, num_inference_steps=4, guidance_scale=3.5,\n"
        "                                call_kwargs={'max_sequence_length': 64}),\n"
        f"                datamodule=PromptDataModule({prompts!r}, batch_size=1, schedule='pull', lease_s={lease}))\n"
        "if writer.summary is not None:\n"
        "    print('SUMMARY', json.dumps(writer.summary))\n")
    return subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})


def _summary(log: str) -> dict:
    found = re.search(r"^SUMMARY (.*)$", log, re.M)
    assert found, log[-3000:]
    return json.loads(found.group(1))


def _wait_for(condition, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _made_once_as_one_process(out: Path, reference) -> None:
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(5))
    ours, ref = load_arrays(out), reference()
    assert sorted(ours) == list(range(5)) and all(np.array_equal(ours[i], ref[i]) for i in range(5))


# ----------------------------------------------------------------------------- claims, without a model


def test_one_worker_wins_each_claim_and_each_takeover(tmp_path):
    files = FolderPoolFiles(tmp_path)
    pools = [Pool(files, f"job{n}", 0, 5.0, "plan") for n in range(8)]
    won: list[list[str]] = [[], []]

    def race(pool: Pool) -> None:
        if pool.claim(3):
            won[0].append(pool.worker)
        if pool.take_over(3, 0)[0]:
            won[1].append(pool.worker)

    threads = [threading.Thread(target=race, args=(pool,)) for pool in pools]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won[0]) == 1 and len(won[1]) == 1
    assert pools[0].holder(3) == (1, won[1][0])
    first = next(p for p in pools if p.worker == won[0][0])
    assert first.lost(3, 0) and not next(p for p in pools if p.worker == won[1][0]).lost(3, 1)


def test_a_live_pool_refuses_a_run_that_deals_and_status_shows_its_workers(tmp_path):
    pool = Pool(FolderPoolFiles(tmp_path), "abc", 0, 60.0)
    pool.register("plan", {"batches": 4, "images": 8, "batch_size": 2})
    try:
        assert pool.claim(0) and pool.claim(1)
        message = busy_message(tmp_path, None, None)
        assert message is not None and "pool of 1 worker (job abc)" in message and "data.schedule: pull" in message
        assert busy_message(tmp_path, None, None, pull=True) is None  # a job that pulls joins it
        shown = pool_summary(FolderPoolFiles(tmp_path))
        assert shown["workers"] == [{"worker": "abc-0", "state": "working", "live": True, "host": socket.gethostname(),
                                     "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"), "claims": 2,
                                     "took_over": 0, "since": pool.since}]
        assert shown["plans"] == [{"plan": "plan", "batches": 4, "claimed": 2, "taken_over": 0}]
    finally:
        pool.leave(ended=True)
    assert not live_workers(FolderPoolFiles(tmp_path)) and busy_message(tmp_path, None, None) is None
    assert json.loads((tmp_path / WORKERS / "abc-0.json").read_text())["state"] == "ended"


def test_takeovers_are_counted_by_status_and_the_metrics_with_each_workers_eta(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from lightning_diffusion.output.metrics import OutputCollector, worker_etas

    files = FolderPoolFiles(tmp_path)
    a, b = Pool(files, "a", 0, 60.0), Pool(files, "b", 0, 60.0)
    a.register("plan", {"batches": 10, "images": 20, "batch_size": 2})
    b.register("plan", {"batches": 10, "images": 20, "batch_size": 2})
    try:
        assert a.claim(0) and a.claim(1) and b.claim(2)
        assert b.take_over(1, 0)[0] and a.take_over(1, 1)[0]  # batch 1 taken over twice, last by a
        assert b.take_over(0, 0)[0]
        shown = pool_summary(files)
        assert {w["worker"]: (w["claims"], w["took_over"]) for w in shown["workers"]} == {"a-0": (1, 1),
                                                                                           "b-0": (2, 1)}
        assert shown["plans"] == [{"plan": "plan", "batches": 10, "claimed": 3, "taken_over": 3}]
        # 7 batches unclaimed; a claims 1 a second, b 2: together 3 a second, then its own batch
        now = max(w["since"] for w in shown["workers"]) + 1.0
        paced = {**shown, "workers": [{**w, "since": now - 1.0} for w in shown["workers"]]}
        assert worker_etas(paced, now) == pytest.approx({"a-0": 7 / 3 + 1.0, "b-0": 7 / 3 + 0.5})
        (tmp_path / "run.json").write_text(json.dumps({"expected": 20}))
        registry = CollectorRegistry()
        registry.register(OutputCollector(str(tmp_path)))
        samples = {(s.name, tuple(s.labels.values())): s.value
                   for family in text_string_to_metric_families(generate_latest(registry).decode())
                   for s in family.samples}
        assert samples[("lightning_diffusion_batches_taken_over", ())] == 3
        assert samples[("lightning_diffusion_batches_taken_over_by_worker", ("b-0",))] == 1
        assert {key[1] for key in samples if key[0] == "lightning_diffusion_eta_seconds_by_worker"} == {("a-0",),
                                                                                                       ("b-0",)}
        from lightning_diffusion.commands.status import text
        from lightning_diffusion.output.status import folder_status

        said = text(folder_status(tmp_path))
        assert "3 of 10 batches claimed, 3 taken over (plan plan)" in said, said
        assert "worker a-0: working" in said and "1 claim (1 by a takeover)" in said, said
    finally:
        a.leave(ended=True)
        b.leave(ended=True)


def test_a_silent_worker_is_not_live_once_its_lease_lapses(tmp_path):
    pool = Pool(FolderPoolFiles(tmp_path), "abc", 0, 2.0, "plan")
    pool.files.put(f"{WORKERS}/abc-0.json", pool._content("working"))  # registered, never renewed
    assert live_workers(pool.files)
    old = time.time() - 3
    os.utime(tmp_path / WORKERS / "abc-0.json", (old, old))
    assert not live_workers(pool.files)


@pytest.mark.parametrize("settings, message", [
    ({"schedule": "pul"}, "data.schedule must be one of deal, pull, got 'pul'."),
    ({"schedule": "pull", "lease_s": 1}, "data.lease_s must be a number of seconds, at least 2"),
    ({"schedule": "pull", "num_shards": 2}, "data.schedule: pull makes the whole prompt set with every job"),
])
def test_bad_pool_settings_are_refused(settings, message):
    from lightning_diffusion import PromptDataModule

    with pytest.raises(ConfigError, match=re.escape(message)):
        PromptDataModule(["a", "b"], **settings)


# ----------------------------------------------------------------------------- jobs


@pytest.mark.slow
def test_two_jobs_started_together_share_the_work_each_image_once_as_one_process(tmp_path, reference):
    out = tmp_path / "out"
    jobs = [_job(tmp_path, out, f"job{n}", {0: 1.5}) for n in range(2)]
    logs = [job.communicate(timeout=300)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    made = [_summary(log)["made"] for log in logs]
    assert sum(made) == 5 and min(made) >= 1, made
    _made_once_as_one_process(out, reference)
    history = json.loads((out / "run.json").read_text())["history"]
    assert sorted(entry["made"] for entry in history) == sorted(made)  # both jobs' summaries kept
    assert not list(out.glob("manifest.*part-*.jsonl"))


@pytest.mark.slow
def test_a_job_killed_mid_batch_is_taken_over_by_a_job_that_joins(tmp_path, reference):
    out = tmp_path / "out"
    first = _job(tmp_path, out, "first", {0: 3.0})
    recorded = lambda: any(p.stat().st_size for p in out.glob("manifest.pool-*.part-0.jsonl"))  # noqa: E731
    _wait_for(lambda: recorded() or first.poll() is not None)
    os.killpg(first.pid, signal.SIGKILL)  # mid-batch: one image recorded, the next claimed and computed
    first.communicate()
    second = run_here(*tiny_args(out, "--data.prompts", FIVE_PROMPTS, "--data.batch_size", "1",
                                 "--data.schedule", "pull", "--data.lease_s", "5"))
    assert "took over batch" in second.stderr + second.stdout
    _made_once_as_one_process(out, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["files", "webdataset", "litdata"])
def test_a_frozen_worker_loses_its_batches_and_its_late_result_adds_nothing(tmp_path, reference, layout):
    """A job stopped (SIGSTOP: every process of it, its renewals too) after its third claim, past its
    lease: the other job takes its batches over, those it had finished into its still-open tar
    included; continued, it publishes nothing of them (``fence``): each index once in the manifest,
    in the files and in the tars, the bytes of one process."""
    if layout == "litdata":
        pytest.importorskip("litdata")
    out = tmp_path / "out"
    writer = "save_arrays=True" if layout == "files" else f"format={layout!r}, samples_per_shard=100"
    frozen = _job(tmp_path, out, "frozen", {0: 1.0}, lease=2.0, writer=writer)
    claims = lambda: [p for p in out.glob("pool/claims-*/*")]  # noqa: E731
    _wait_for(lambda: len(claims()) >= 3 or frozen.poll() is not None)
    time.sleep(0.3)  # inside its third batch's hold; two are in its open tar (webdataset) or written (files)
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # its lease lapses
        other = _job(tmp_path, out, "other", {}, lease=2.0, writer=writer)
        log = other.communicate(timeout=300)[0]
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    late = frozen.communicate(timeout=300)[0]
    assert other.returncode == 0 and frozen.returncode == 0, log[-3000:] + late[-3000:]
    assert "took over batch" in log
    # each says what the pool holds at its end; what each made (its parts' lines) never adds to more
    assert _summary(log)["in_manifest"] == _summary(late)["in_manifest"] == 5
    assert _summary(log)["made"] + _summary(late)["made"] <= 5
    if layout == "files":
        _made_once_as_one_process(out, reference)
        return
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(5))
    members = []
    for tar in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar) as shard:
            members += [(m.name, np.asarray(Image.open(shard.extractfile(m)))) for m in shard.getmembers()
                        if m.name.endswith(".png")]
    if layout == "litdata":  # a LitData shard written again without the batches taken over
        import io

        import litdata

        members = [(sample["image_path"], np.asarray(Image.open(io.BytesIO(sample["image"]))))
                   for shard in sorted(out.glob("shard-*.litdata")) for sample in litdata.StreamingDataset(str(shard))]
    assert sorted(name for name, _ in members) == [f"{i:09d}.png" for i in range(5)]  # each member once
    ref = reference()
    assert all(np.array_equal(pixels, to_uint8(ref[int(name[:9])])) for name, pixels in members)
    assert FolderStore(out, None).status()["complete"]


@pytest.mark.slow
def test_two_replicas_over_two_batches_end(tmp_path):
    """One replica may claim both batches (the loader fetches one ahead): the other, with nothing to
    claim, must not wait for it forever, nor it for the other."""
    out = tmp_path / "out"
    job = _job(tmp_path, out, "two", {}, devices=2, prompts=PROMPTS[:2])
    log = job.communicate(timeout=300)[0]
    assert job.returncode == 0, log[-3000:]
    assert [line["index"] for line in read_manifest_lines(out)] == [0, 1]


@pytest.mark.slow
def test_a_signal_ends_a_worker_that_waits_for_other_workers(tmp_path):
    out = tmp_path / "out"
    slow = _job(tmp_path, out, "slow", {0: 12.0}, prompts=PROMPTS[:3])
    _wait_for(lambda: bool(list(out.glob("pool/claims-*/1"))) or slow.poll() is not None)
    waiter = _job(tmp_path, out, "waiter", {}, prompts=PROMPTS[:3])
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(waiter.stdout), daemon=True)
    reader.start()
    _wait_for(lambda: any("waiting while other workers make" in line for line in lines) or waiter.poll() is not None)
    assert waiter.poll() is None, "".join(lines)[-3000:]
    os.killpg(waiter.pid, signal.SIGINT)
    signalled = time.monotonic()
    waiter.wait(timeout=120)
    assert time.monotonic() - signalled < 10, "the waiting worker did not stop on the signal"  # not 12 s a batch
    log = slow.communicate(timeout=300)[0]
    assert slow.returncode == 0, log[-3000:]
    assert [line["index"] for line in read_manifest_lines(out)] == [0, 1, 2]


@pytest.mark.slow
def test_a_slower_replica_takes_fewer_batches(tmp_path):
    out = tmp_path / "out"
    job = _job(tmp_path, out, "paced", {1: 2.0}, devices=2)
    log = job.communicate(timeout=300)[0]
    assert job.returncode == 0, log[-3000:]
    rates = _summary(log)["images_per_s_by_rank"]
    assert rates["0"] > rates.get("1", 0), rates  # the same seconds: rates are the images each made
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(5))


def test_an_array_of_a_pool_runs_jobs_that_join_it_not_shards(tmp_path, capsys):
    from lightning_diffusion.commands import slurm as slurm_module

    predict = ["--data.prompts", FIVE_PROMPTS, "--writer.output_dir", str(tmp_path / "out"), "--data.schedule", "pull"]
    assert slurm_module.main(["--config", "configs/tiny-flux.yaml", "--array", "3", "--", *predict]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-2" in script and "a job of the pool" in script and "--data.shard_index" not in script
    code = slurm_module.main(["--config", "configs/tiny-flux.yaml", "--resubmit", "--", *predict])
    assert code == 2 and "a pool (data.schedule: pull) has none" in capsys.readouterr().err


@pytest.mark.slow
def test_an_array_of_three_pool_jobs_on_the_cluster_makes_each_image_once_as_one_process(cluster, tmp_path):
    from tests.commands.test_slurm import TINY, slurm

    out = tmp_path / "out"
    twelve = "[" + ", ".join(f"pool prompt {i}" for i in range(12)) + "]"
    predict = tiny_args(out, "--data.prompts", twelve, "--data.batch_size", "1", "--data.schedule", "pull",
                        "--data.lease_s", "5")[3:]
    proc = slurm("--config", TINY, "--array", "3", "--submit", "--wait", "--", *predict, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "an array of 3 jobs of the pool" in proc.stdout and "12 of 12 outputs" in proc.stdout
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(12))
    # What the pool promises, whatever the timing: every job that joined ended cleanly and recorded
    # its run; how the work was shared depends on when each task started (the first may make all 12)
    workers = [json.loads(path.read_text()) for path in (out / WORKERS).glob("*.json")]
    jobs = {worker["job"] for worker in workers}
    assert 1 <= len(jobs) <= 3 and {worker["state"] for worker in workers} == {"ended"}
    history = json.loads((out / "run.json").read_text())["history"]
    assert len(history) == len(jobs) and sum(entry["made"] for entry in history) == 12
    assert all(entry["in_manifest"] == 12 for entry in history[-1:])
    single = tmp_path / "single"
    run_here(*tiny_args(single, "--data.prompts", twelve, "--data.batch_size", "1"))
    ours, ref = load_arrays(out), load_arrays(single)
    assert sorted(ours) == list(range(12)) and all(np.array_equal(ours[i], ref[i]) for i in range(12))


def test_a_job_whose_settings_differ_is_refused_naming_the_key_and_leaves_no_live_registration(tmp_path):
    from lightning_diffusion.output.folder_store import FolderStore

    first = FolderStore(tmp_path, None, pool="first")
    assert first.prepare({"model.height": 64, "data.seed": 0}, 5, 5)[0] is None
    second = FolderStore(tmp_path, None, pool="second")
    refusal, done = second.prepare({"model.height": 96, "data.seed": 0}, 5, 5)
    assert refusal is not None and "model.height" in refusal and not len(done)
    assert set(live_workers(FolderPoolFiles(tmp_path))) == {"first-0"}  # the refused job says it failed
    first.worker.leave(ended=True)


def test_a_job_that_joins_sweeps_the_temporaries_of_gone_workers_only(tmp_path):
    """A killed job's half-written tar is removed by the next job that joins, though another job
    works: only the temporaries of workers that are gone (theirs carry their names)."""
    from lightning_diffusion.output.manifest import temporary_name

    files = FolderPoolFiles(tmp_path)
    live, dead = Pool(files, "live", 0, 5.0, "plan"), Pool(files, "dead", 0, 5.0, "plan")
    live.start()
    dead.start()
    dead.leave(ended=False)  # failed: killed
    theirs = temporary_name(tmp_path / "shard-000000004.tar", "dead-0")
    mine = temporary_name(tmp_path / "shard-000000000.tar", "live-0")
    plain = temporary_name(tmp_path / "shard-000000008.tar")  # a run's that deals: not a pool's to judge
    for path in (theirs, mine, plain):
        path.write_bytes(b"half")
    joining = FolderStore(tmp_path, None, pool="new")
    try:
        assert joining.prepare({"data.seed": 0}, 12, 12)[0] is None
        assert not theirs.exists() and mine.exists() and plain.exists()
    finally:
        joining.worker.leave(ended=True)
        live.leave(ended=True)


def test_a_job_batching_otherwise_is_refused_when_it_joins(tmp_path):
    from lightning_diffusion.output.pool import batching_conflict

    files = FolderPoolFiles(tmp_path)
    pool = Pool(files, "abc", 0, 5.0)
    pool.register("d1", {"batches": 2, "images": 8, "batch_size": 4, "bucket": True})
    try:
        assert batching_conflict(files, 4, True) is None
        refusal = batching_conflict(files, 2, True)
        assert refusal is not None and "batches of 4 images" in refusal and "batches of 2" in refusal
        assert "data.batch_size" in refusal
        assert "without buckets" in (batching_conflict(files, 4, False) or "")
    finally:
        pool.leave(ended=True)
    assert batching_conflict(files, 2, True) is None  # the pool ended: a new plan may start
