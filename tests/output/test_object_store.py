"""Outputs into an S3-compatible bucket (``writer.output_dir: s3://...``): a real S3 server (moto's
server mode, on 127.0.0.1, started here) spoken to over HTTP by s3fs, the client a user's run uses.
Every index is recorded exactly once, the tar shards are the bytes a folder run writes, and a run
that is killed, or whose store goes away, resumes."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from lightning_diffusion.output.object_store import ObjectStore
from tests.commands.test_slurm import cluster, slurm  # noqa: F401  (the cluster fixture)
from tests.conftest import REPO, run_cli, run_here

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

PROMPTS = "[" + ", ".join(f"bucket prompt {i}" for i in range(6)) + "]"
SECRET = "not-a-real-secret-6c1f"


class Store:
    """moto's S3 server on 127.0.0.1, its state kept in this process across a stop and a start."""

    def __init__(self) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.fixture(scope="module")
def s3():
    saved = dict(os.environ)
    store = Store()
    os.environ.update(AWS_ENDPOINT_URL=store.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    try:
        store.fs().mkdir("runs")
    except FileExistsError:  # moto keeps its buckets in the process: made by another file's server
        pass
    yield store
    store.stop()
    os.environ.clear()
    os.environ.update(saved)


def _args(out: str, *extra: str) -> list[str]:
    return ["predict", "--config", "configs/tiny-flux.yaml", "--writer.output_dir", out, "--writer.format",
            "webdataset", "--writer.samples_per_shard", "2", "--data.prompts", PROMPTS, "--data.batch_size", "2",
            "--model.num_inference_steps", "2", "--trainer.enable_progress_bar", "false", *extra]


def _bucket_lines(fs, prefix: str) -> list[dict]:
    fs.invalidate_cache()
    names = fs.find(f"{prefix}/manifest")
    blobs = fs.cat(names, on_error="omit") if names else {}
    return [json.loads(raw) for blob in blobs.values() for raw in blob.splitlines()]


def _members(blobs: dict[str, bytes]) -> dict[str, bytes]:
    """Every member of the tar shards given by name: its bytes."""
    found = {}
    for blob in blobs.values():
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            for member in tar.getmembers():
                found[member.name] = tar.extractfile(member).read()
    return found


def _bucket_tars(fs, prefix: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {Path(name).name: fs.cat_file(name) for name in fs.glob(f"{prefix}/shard-*.tar")}


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """The same images into a folder: the bytes every bucket run must match."""
    out = tmp_path_factory.mktemp("folder")
    run_here(*_args(str(out)))
    return {path.name: path.read_bytes() for path in sorted(out.glob("shard-*.tar"))}


@pytest.mark.slow
def test_one_process_writes_each_image_once_as_the_folder_does_and_reruns_make_nothing(s3, folder_run):
    fs = s3.fs()
    proc = run_here(*_args("s3://runs/one"))
    lines = _bucket_lines(fs, "runs/one")
    assert sorted(line["index"] for line in lines) == list(range(6))
    assert _bucket_tars(fs, "runs/one") == folder_run, "the shards in the bucket are the folder's bytes"
    record = json.loads(fs.cat_file("runs/one/run.json"))
    assert record["writer.format"] == "webdataset" and record["history"][-1]["made"] == 6
    assert "s3://runs/one/manifest/" in proc.stderr
    assert not fs.exists("runs/one/.lock"), "the lock is given back at the end"
    text = json.dumps(record) + proc.stdout + proc.stderr
    assert SECRET not in text and s3.endpoint not in json.dumps(record)

    again = run_here(*_args("s3://runs/one"))  # a complete prefix: said before any weight loads, as a folder's
    assert "nothing to make: the 6 images of this prompt set are all recorded in s3://runs/one" in again.stderr
    assert "batch plan" not in again.stderr
    assert json.loads(fs.cat_file("runs/one/run.json"))["history"][-1]["made"] == 6
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/one")) == list(range(6))

    # A manifest object replaced by one whose line names a tar the prefix lacks: it does not count,
    # and the rerun makes what it named (and the object's other image), each counted once.
    name = next(n for n in fs.find("runs/one/manifest") if any(line["index"] == 3 for line in
                                                                 map(json.loads, fs.cat_file(n).splitlines())))
    fs.pipe_file(name, b'{"index":3,"file":"shard-999999999.tar","member":"000000003.png","bytes":10}\n')
    assert ObjectStore.open("s3://runs/one", None).status()["done"] == 4
    rerun = run_here(*_args("s3://runs/one"))
    assert "resumed: 4 already in the manifest of s3://runs/one" in rerun.stderr
    store = ObjectStore.open("s3://runs/one", None)
    assert sorted(line["index"] for _, line in store._recorded_lines()) == list(range(6))
    assert store.status()["complete"]


@pytest.mark.slow
def test_status_of_a_bucket_counts_its_recorded_images_and_its_lock(s3):
    fs = s3.fs()
    if not fs.exists("runs/one/run.json"):
        run_here(*_args("s3://runs/one"))
    proc = run_here("status", "s3://runs/one", check=False)
    assert proc.returncode == 0 and "s3://runs/one: 6 of 6 (100%) outputs, complete" in proc.stdout
    fs.rm("runs/one/manifest/shard-000000002.tar.rank-0.jsonl")  # as if that shard's upload never ended
    proc = run_here("status", "s3://runs/one", "--json", check=False)
    status = json.loads(proc.stdout)
    assert proc.returncode == 4 and status["done"] == 4 and not status["running"]
    run_here(*_args("s3://runs/one"))  # the resume makes the two again
    assert run_here("status", "s3://runs/one", check=False).returncode == 0
    missing = run_here("status", "s3://runs/nothing-here", check=False)
    assert missing.returncode == 2
    assert "s3://runs/nothing-here is not an output of lightning-diffusion" in missing.stderr


@pytest.mark.slow
def test_the_shards_read_back_with_the_webdataset_package_from_the_bucket(s3, folder_run):
    import webdataset as wds

    fs = s3.fs()
    if not fs.exists("runs/one/run.json"):
        run_here(*_args("s3://runs/one"))
    urls = [fs.sign(f"runs/one/{name}") for name in sorted(folder_run)]  # presigned GETs, over HTTP (curl)
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert [sample["__key__"] for sample in samples] == [f"{i:09d}" for i in range(6)]
    assert all(json.loads(sample["json"])["index"] == i for i, sample in enumerate(samples))


@pytest.mark.slow
def test_a_second_run_into_a_prefix_that_a_live_run_holds_is_refused(s3, cli_here):
    fs = s3.fs()
    fs.pipe_file("runs/held/.lock", json.dumps({"host": "gpu-node-7", "pid": 4242, "run": "x",
                                                "heartbeat": time.time()}).encode())
    proc = cli_here(*_args("s3://runs/held"))
    assert proc.returncode == 2
    assert "s3://runs/held is being written by another run (host gpu-node-7, pid 4242)" in proc.stderr
    assert not fs.exists("runs/held/manifest")
    fs.pipe_file("runs/held/.lock", json.dumps({"host": "gpu-node-7", "pid": 4242, "run": "x",
                                                "heartbeat": time.time() - 3600}).encode())
    run_here(*_args("s3://runs/held"))  # a lock whose run stopped beating an hour ago is taken over
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/held")) == list(range(6))


@pytest.mark.parametrize("case", ["no bucket", "files format", "no credentials", "unreachable", "unset variable"])
def test_a_store_that_cannot_take_the_run_is_refused_in_one_line_before_weights(s3, cli_here, case, monkeypatch):
    url, extra = "s3://runs/refused", []
    if case == "no bucket":
        url = "s3://no-such-bucket/x"
    elif case == "files format":
        extra = ["--writer.format", "files"]  # the last value given wins
    elif case == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    elif case == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    else:
        extra = ["--writer.storage_options", '{"key": "env:NO_SUCH_VARIABLE_SET"}']
    proc = cli_here(*_args(url, *extra))
    assert proc.returncode == 2, proc.stderr
    line = [text for text in proc.stderr.splitlines() if text.startswith("lightning-diffusion: error")]
    assert len(line) == 1 and url in line[0], proc.stderr
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr
    expected = {"no bucket": "the bucket no-such-bucket does not exist",
                "files format": "set writer.format: webdataset",
                "no credentials": "NoCredentialsError",
                "unreachable": "EndpointConnectionError",
                "unset variable": "NO_SUCH_VARIABLE_SET, which is not set"}[case]
    assert expected in line[0]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_lines(fs, prefix: str, count: int, proc: subprocess.Popen, limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if fs.exists(f"{prefix}/manifest") and len(_bucket_lines(fs, prefix)) >= count:
            return
        time.sleep(0.2)
    output = proc.stdout.read() if proc.poll() is not None else ""
    raise AssertionError(f"no {count} images recorded in time:\n{output}")


TWELVE = "[" + ", ".join(f"bucket prompt {i}" for i in range(12)) + "]"
MANY = "[" + ", ".join(f"bucket prompt {i}" for i in range(60)) + "]"  # a run long enough to stop in its middle


def _folder_members(out: Path, prompts: str) -> dict[str, bytes]:
    run_here(*_args(str(out), "--data.prompts", prompts))
    return _members({path.name: path.read_bytes() for path in out.glob("shard-*.tar")})


@pytest.fixture(scope="module")
def twelve_folder(tmp_path_factory):
    return _folder_members(tmp_path_factory.mktemp("twelve"), TWELVE)


@pytest.fixture(scope="module")
def many_folder(tmp_path_factory):
    return _folder_members(tmp_path_factory.mktemp("many"), MANY)


@pytest.mark.slow
def test_killed_mid_run_then_resumed_every_image_once_with_the_folders_bytes(s3, many_folder, tmp_path):
    fs = s3.fs()
    staging = ["--writer.staging_dir", str(tmp_path / "staging")]
    proc = _start(_args("s3://runs/killed", "--data.prompts", MANY, *staging))
    _wait_for_lines(fs, "runs/killed", 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_bucket_lines(fs, "runs/killed")) < 60
    left = list((tmp_path / "staging").iterdir())
    assert len(left) == 1 and f"-{proc.pid}-" in left[0].name, "the killed run's staging folder stays"
    run_cli(*_args("s3://runs/killed", "--data.prompts", MANY, *staging))
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/killed")) == list(range(60))
    assert _members(_bucket_tars(fs, "runs/killed")).items() >= many_folder.items()
    assert not list((tmp_path / "staging").iterdir()), "the resume removed the dead run's staging folder"


@pytest.mark.slow
def test_two_replicas_and_a_three_task_array_into_one_prefix(s3, twelve_folder):
    fs = s3.fs()
    run_cli(*_args("s3://runs/two", "--data.prompts", TWELVE, "--trainer.devices", "2"))
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/two")) == list(range(12))
    assert _members(_bucket_tars(fs, "runs/two")) == twelve_folder
    for task in range(3):
        run_cli(*_args("s3://runs/array", "--data.prompts", TWELVE, "--data.num_shards", "3",
                       "--data.shard_index", str(task)))
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/array")) == list(range(12))
    assert _members(_bucket_tars(fs, "runs/array")) == twelve_folder
    assert {json.loads(fs.cat_file(f"runs/array/run.shard-{t}-of-3.json"))["shard"][0] for t in range(3)} == {0, 1, 2}


@pytest.mark.slow
def test_a_store_that_goes_away_stops_the_run_in_one_line_and_the_same_command_resumes(s3, many_folder):
    fs = s3.fs()
    args = _args("s3://runs/outage", "--data.prompts", MANY)
    proc = _start(args)
    _wait_for_lines(fs, "runs/outage", 2, proc)
    s3.stop()
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        s3.start()
    assert proc.returncode == 1, output
    # the tar or, when the store went away between the two, its manifest object
    assert re.search(r"uploading (manifest/)?shard-\d+\.tar\S* to s3://runs/outage failed 5 times", output), output
    assert SECRET not in output and "Traceback" not in output.split("lightning-diffusion: error")[-1]
    recorded = _bucket_lines(fs, "runs/outage")
    assert 2 <= len(recorded) < 60
    run_cli(*args)  # its lock names a process of this machine that is gone: taken over
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/outage")) == list(range(60))
    assert _members(_bucket_tars(fs, "runs/outage")).items() >= many_folder.items()


def test_a_run_whose_lock_was_taken_over_stops_renewing_it_and_leaves_it(s3, caplog):
    """A run judged stale (its store unreachable past the stale time) may find its lock taken over:
    its heartbeat then says so once and stops, and its end does not remove the other run's lock; a
    lock removed meanwhile is made again. A stale lock is removed only as it was judged: one renewed
    or replaced meanwhile stays."""
    fs = s3.fs()
    store = ObjectStore("s3://runs/taken", None)
    assert store._take_lock() is None
    try:
        before = json.loads(fs.cat_file("runs/taken/.lock"))
        assert store.beat() and json.loads(fs.cat_file("runs/taken/.lock"))["run"] == store.run == before["run"]
        fs.rm("runs/taken/.lock")  # removed by hand: the next beat makes it again, the run keeps it
        assert store.beat() and json.loads(fs.cat_file("runs/taken/.lock"))["run"] == store.run
        other = json.dumps({"host": "gpu-node-7", "pid": 4242, "run": "other", "heartbeat": 1.0}).encode()
        fs.pipe_file("runs/taken/.lock", other)
        assert not store.beat()
        assert "this run's lock was taken over by another run (host gpu-node-7, pid 4242)" in caplog.text
        assert fs.cat_file("runs/taken/.lock") == other
    finally:
        store.release()
    assert fs.cat_file("runs/taken/.lock") == other, "the other run's lock stays"

    assert not store._remove_if_unchanged(".lock", b"what was judged stale")
    assert fs.exists("runs/taken/.lock")
    assert store._remove_if_unchanged(".lock", other) and not fs.exists("runs/taken/.lock")


@pytest.mark.slow
def test_eval_reads_a_bucket_as_it_reads_the_folder(s3, folder_run, tmp_path, cli_here, monkeypatch):
    """``eval s3://...`` downloads the recorded shards and their manifest lines and reads them as a
    folder: the same per-image rows as the folder of the same run, the URL named; a bucket of no
    records and a prefix of no bucket are refused in one line. A successful run into the bucket,
    ``status`` and ``eval`` leave nothing in the temporary folder."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    folder = tmp_path / "folder"
    run_here(*_args(str(folder)))
    run_here(*_args("s3://runs/evaluated"))
    bucket = cli_here("eval", "s3://runs/evaluated", "--reference", str(folder), "--json")
    assert bucket.returncode == 0, bucket.stderr
    result = json.loads(bucket.stdout)
    assert result["summary"]["folder"] == "s3://runs/evaluated" and result["summary"]["images"] == 6
    assert result["summary"]["reference"]["max_abs"] == 0  # the same bytes as the folder's images
    alone = json.loads(cli_here("eval", str(folder), "--json").stdout)
    assert [row["index"] for row in result["images"]] == [row["index"] for row in alone["images"]]
    s3.fs().pipe_file("runs/started/run.json", b"{}")  # a run that recorded nothing yet
    empty = cli_here("eval", "s3://runs/started")
    assert empty.returncode == 2 and "output s3://runs/started records no finished image." in empty.stderr
    for url in ("s3://runs/nothing-here", "s3://no-such-bucket/run"):
        missing = cli_here("eval", url)
        assert missing.returncode == 2 and f"output {url}: nothing there" in missing.stderr, missing.stderr
    assert cli_here("status", "s3://runs/evaluated").returncode == 0
    assert not list(temporary.iterdir()), "no staging or download folder is left behind"



# ----------------------------------------------------------------------------- SLURM without a shared folder


def _slurm_predict(url: str, *extra: str) -> list[str]:
    """``predict``'s flags for a SLURM job into ``url`` (the config is given to ``slurm`` itself)."""
    return _args(url, *extra)[3:]


def test_a_slurm_script_into_a_bucket_checks_no_shared_folder_and_keeps_its_logs_in_the_job_folder(s3, cli_here,
                                                                                                    tmp_path):
    config = str(REPO / "configs" / "tiny-flux.yaml")
    proc = cli_here("slurm", "--config", config, "--job-dir", str(tmp_path / "jobs"), "--array", "3", "--",
                    *_slurm_predict("s3://runs/slurm-script", "--data.prompts", TWELVE))
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    assert f"#SBATCH --output={tmp_path / 'jobs'}/slurm-%A_%a.out" in script.splitlines()
    assert ".node-check" not in script and "OUT=" not in script, "no folder for the nodes to share"
    assert "# The images go to s3://runs/slurm-script: the nodes need no shared folder." in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not (tmp_path / "jobs").exists(), "printing a script writes nothing"

    missing = cli_here("slurm", "--config", config, "--array", "3", "--",
                       *_slurm_predict("s3://no-such-bucket/x", "--data.prompts", TWELVE))
    assert missing.returncode == 2 and "the bucket no-such-bucket does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr and SECRET not in missing.stderr
    written = cli_here("slurm", "--config", config, "--", *_slurm_predict("s3://runs/slurm-script", "--data.prompts",
                       TWELVE, "--writer.storage_options", json.dumps({"key": "env:MY_KEY", "secret": SECRET})))
    assert written.returncode == 2 and SECRET not in written.stdout + written.stderr
    assert "--writer.storage_options on the command line would be written into the job's script" in written.stderr
    named = cli_here("slurm", "--config", config, "--", *_slurm_predict("s3://runs/slurm-script", "--data.prompts",
                     TWELVE, "--writer.storage_options", json.dumps({"key": "env:MY_KEY", "secret": "env:MY_SECRET"})))
    assert named.returncode == 0 and "env:MY_SECRET" in named.stdout, named.stderr
    nothing = cli_here("slurm", "--config", config, "--resubmit", "--job-dir", str(tmp_path), "--",
                       *_slurm_predict("s3://runs/slurm-script", "--data.prompts", TWELVE))
    assert nothing.returncode == 2 and f"the job folder {tmp_path} holds no record of a job array" in nothing.stderr


@pytest.mark.slow
def test_a_slurm_job_array_writes_into_a_bucket_every_image_once_with_the_folders_bytes(s3, twelve_folder, cluster,
                                                                                         tmp_path):
    """Three array tasks on the local SLURM cluster write into one prefix; the nodes share no output
    folder (the job folder holds only the script, logs and the array's record); every index once,
    the folder run's bytes; ``--resubmit`` then reads the bucket and finds nothing to submit."""
    fs = s3.fs()
    config = str(REPO / "configs" / "tiny-flux.yaml")
    predict = _slurm_predict("s3://runs/slurm", "--data.prompts", TWELVE)
    proc = slurm("--config", config, "--array", "3", "--submit", "--wait", "--", *predict, cwd=tmp_path)
    jobs = next((tmp_path / "lightning-diffusion-jobs").glob("lightning-diffusion-tiny-flux-*"))  # + the URL's tag
    logs = "".join(path.read_text(errors="replace")[-2000:] for path in sorted(jobs.glob("slurm-*.out")))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:] + logs
    assert "12 of 12 outputs in s3://runs/slurm/manifest/" in proc.stdout
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/slurm")) == list(range(12))
    assert _members(_bucket_tars(fs, "runs/slurm")) == twelve_folder
    assert sorted(path.name for path in jobs.iterdir()) == sorted(
        ["array.json", "lightning-diffusion.sbatch", *(f"slurm-{path.stem[6:]}.out" for path in jobs.glob("slurm-*"))])
    assert len(list(jobs.glob("slurm-*_*.out"))) == 3 and SECRET not in logs
    again = slurm("--config", config, "--resubmit", "--", *predict, cwd=tmp_path)
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stdout + again.stderr


@pytest.mark.slow
def test_two_jobs_pull_from_one_pool_in_a_bucket_each_image_once_as_one_job(s3, tmp_path):
    """``data.schedule: pull`` into a bucket: claims by conditional PUTs; two jobs at once share the
    five batches, and the samples are those one job writes into a folder."""
    from tests.output.test_pool import _job, _summary

    fs = s3.fs()
    webdataset = "format='webdataset', samples_per_shard=1"
    jobs = [_job(tmp_path, "s3://runs/pool", f"job{n}", {0: 1.5}, writer=webdataset) for n in range(2)]
    logs = [job.communicate(timeout=300)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    made = [_summary(log)["made"] for log in logs]
    assert sum(made) == 5 and min(made) >= 1, made
    assert sorted(line["index"] for line in _bucket_lines(fs, "runs/pool")) == list(range(5))
    workers = [json.loads(fs.cat_file(name)) for name in fs.glob("runs/pool/pool/workers/*.json")]
    assert sorted(worker["state"] for worker in workers) == ["ended", "ended"]
    one = _job(tmp_path, tmp_path / "folder", "one", {}, writer=webdataset)
    assert one.communicate(timeout=300)[0] and one.returncode == 0
    folder = {path.name: path.read_bytes() for path in (tmp_path / "folder").glob("shard-*.tar")}
    assert _members(_bucket_tars(fs, "runs/pool")) == _members(folder)


@pytest.mark.parametrize("given, message", [
    ({"layout": "sharded"}, "writer.layout sharded puts loose files in numbered subfolders"),
    ({"output_dir": "s3://runs/../../x"}, "has '.' or '..' in its path"),
])
def test_bucket_settings_that_would_be_ignored_or_misread_are_refused(given, message):
    from lightning_diffusion.output.settings import WriterSettings

    settings = WriterSettings(**{"output_dir": "s3://runs/ok", "format": "webdataset", **given})
    problems = ObjectStore.settings_problems(settings)
    assert any(message in problem for problem in problems), problems
    assert ObjectStore.settings_problems(WriterSettings(output_dir="s3://runs/ok", format="webdataset")) == []


def test_a_manifest_object_edited_long_after_its_lines_counts_only_members_its_shards_hold(s3, tmp_path):  # noqa: F811
    """A line naming a member its tar lacks (the tar's name and size right) counts for nothing once
    its manifest object was written long after its lines: each member it names is looked for."""
    import numpy as np

    from lightning_diffusion.output.bucket import Uploader
    from lightning_diffusion.output.files import OutputFiles
    from lightning_diffusion.output.settings import WriterSettings

    url, fs = "s3://runs/edited", s3.fs()
    settings = WriterSettings(format="webdataset", samples_per_shard=2, fsync="off", write_workers=0)
    files = OutputFiles(tmp_path, settings, tmp_path / "part.jsonl", "flat", Uploader(url, None, 0, "run"))
    files.write_batch([{"index": i, "prompt": f"p {i}", "seed": i, "params": {},
                        "image": np.full((8, 8, 3), i / 4, dtype=np.float32)} for i in range(4)])
    files.finish()
    assert ObjectStore.open(url, None).recorded()[0].tolist() == [0, 1, 2, 3]
    name = next(n for n in fs.find("runs/edited/manifest") if "shard-000000002" in n)
    lines = [json.loads(raw) for raw in fs.cat_file(name).splitlines()]
    first = next(json.loads(raw) for n in fs.find("runs/edited/manifest") if "shard-000000000" in n
                 for raw in fs.cat_file(n).splitlines())
    # image 3's line moved to the first shard, whose name and size it copies; the edit is an hour late
    forged = {**lines[1], "file": first["file"], "shard_bytes": first["shard_bytes"],
              "written": first["written"] - 3600}
    fs.pipe_file(name, (json.dumps(lines[0]) + "\n" + json.dumps(forged) + "\n").encode())
    assert ObjectStore.open(url, None).recorded()[0].tolist() == [0, 1, 2]
