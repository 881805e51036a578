"""``lightning-diffusion slurm``: rendered scripts, bad input, and real jobs on a local two-node
SLURM cluster (``scripts/slurm-local start``, which ``.ci/run`` runs).

Cluster tests skip when no cluster answers, except where ``LIGHTNING_DIFFUSION_SLURM=required``
(set by ``.ci/run``): there a missing cluster is a failure. Nothing here fakes ``sbatch``.

Tolerance: images are compared with a one-process run as float arrays to ``ATOL`` (the parity
tolerance of every strategy test here; see test_data_parallel.py for why not bitwise).
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_diffusion.commands import slurm as slurm_module
from lightning_diffusion.commands import slurm_jobs
from tests.conftest import FIVE_PROMPTS, REPO, load_arrays, read_manifest_lines, run_here, tiny_args

ATOL = 1e-5
TINY = str(REPO / "configs" / "tiny-flux.yaml")


@pytest.fixture
def slurm_here(monkeypatch, capsys):
    """``lightning-diffusion slurm ARGS`` in this process (for what needs no cluster): the same
    ``main``, run from ``cwd`` with ``env`` added, its output captured."""

    def run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        code = slurm_module.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["slurm", *args], code, out, err)

    return run


def slurm(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_diffusion", "slurm", *args],
        cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )


def write_config(path: Path, **trainer) -> Path:
    config = yaml.safe_load(Path(TINY).read_text())
    config["trainer"].update(trainer)
    config["data"]["prompts"] = str(REPO / config["data"]["prompts"])
    path.write_text(yaml.safe_dump(config))
    return path


def cluster_nodes() -> int:
    if shutil.which("sinfo") is None:
        return 0
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    return sum(state.strip().rstrip("*") in ("idle", "mixed", "allocated") for state in proc.stdout.split())


@pytest.fixture
def cluster(tmp_path_factory):
    if cluster_nodes() < 2:
        message = "no local two-node SLURM cluster (run scripts/slurm-local start as root)"
        if os.environ.get("LIGHTNING_DIFFUSION_SLURM") == "required":
            pytest.fail(message)
        pytest.skip(message)
    # One test at a time on the cluster: pytest-xdist's workers share it (the lock file is in the
    # folder their temporary folders share), and a test may wait for idle nodes or its job's start.
    with open(tmp_path_factory.getbasetemp().parent / "slurm-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def nodes_idle() -> bool:
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
    return bool(states) and all(state.rstrip("*") == "idle" for state in states)


def job_fields(job: str) -> dict[str, str]:
    return slurm_jobs.job_fields(job) or {}


def submitted_job(proc: subprocess.CompletedProcess) -> str:
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, f"no job id:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return match.group(1)


def job_log(out: Path, job: str) -> str:
    return (out / f"slurm-{job}.out").read_text(errors="replace")


# ----------------------------------------------------------------------------- the script


def test_rendered_script_for_4_nodes_of_8_gpus(slurm_here, tmp_path):
    config = write_config(tmp_path / "big.yaml", accelerator="gpu", devices=8, num_nodes=4,
                          strategy={"class_path": "lightning_diffusion.strategies.MeshStrategy",
                                    "init_args": {"ulysses": 2}})
    out = tmp_path / "out"
    proc = slurm_here("--config", str(config), "--nodes", "4", "--gpus-per-node", "8", "--time", "04:00:00",
                 "--partition", "gpu", "--account", "proj", "--cpus-per-task", "12", "--mem", "480G",
                 "--extra-sbatch=--qos=high", "--", "--writer.output_dir", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = proc.stdout
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert [line[len("#SBATCH "):] for line in lines if line.startswith("#SBATCH")] == [
        "--job-name=lightning-diffusion-big",
        "--nodes=4",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=12",
        "--mem=480G",
        "--time=04:00:00",
        "--partition=gpu",
        "--account=proj",
        "--signal=USR1@300",
        "--requeue",
        "--open-mode=append",
        f"--chdir={tmp_path}",
        f"--output={out}/slurm-%j.out",
        "--qos=high",
    ]
    assert f"OUT={out}" in lines
    steps = [line for line in lines if line.startswith("srun ")]
    assert len(steps) == 2
    check, predict = steps
    assert check.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c ")
    words = shlex.split(predict)
    assert words[:3] == ["srun", "--kill-on-bad-exit=1", "--gpu-bind=none"] and words[-1] == "&"
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in lines
    command = words[3:-1]
    assert Path(command[0]).name == "lightning-diffusion" or command[1:3] == ["-m", "lightning_diffusion"]
    start = command.index("predict")
    assert command[start:] == ["predict", "--config", str(config), "--writer.output_dir", str(out),
                               "--trainer.num_nodes", "4", "--trainer.devices", "8"]
    assert "trap 'kill -USR1 $step 2>/dev/null' USR1" in lines
    assert lines[-1] == "exit $rc"
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not out.exists(), "printing a script writes nothing"


def test_a_time_limit_within_the_stop_signals_lead_is_warned(slurm_here, tmp_path):
    """``--time 00:02:00`` with the default ``--signal-seconds 300``: the stop signal would come as
    the job starts, so the script is still written and a warning says why and what to change; a
    time limit past the lead, or in the day form, is not warned."""
    short = slurm_here("--config", TINY, "--time", "00:02:00", "--", "--data.prompts", FIVE_PROMPTS,
                       "--writer.output_dir", str(tmp_path / "a"), cwd=tmp_path)
    assert short.returncode == 0 and "--signal=USR1@300" in short.stdout
    assert ("warning: --time 00:02:00 (120 s) is not longer than --signal-seconds 300: SLURM sends the stop signal "
            "(USR1) as the job starts") in short.stderr
    assert short.stderr.count("warning: --time") == 1
    for time_limit in ("00:06:00", "1-00", "UNLIMITED"):
        fine = slurm_here("--config", TINY, "--time", time_limit, "--", "--data.prompts", FIVE_PROMPTS,
                          "--writer.output_dir", str(tmp_path / "b"),
                          cwd=tmp_path)
        assert fine.returncode == 0 and "warning: --time" not in fine.stderr, (time_limit, fine.stderr)


@pytest.mark.parametrize(
    "trainer, flags, expected",
    [
        ({"accelerator": "gpu", "devices": 8}, ["--gpus-per-node", "4"], "trainer.devices: 8"),
        ({"accelerator": "gpu", "devices": 4, "num_nodes": 4}, ["--nodes", "2"], "trainer.num_nodes: 4"),
        ({"accelerator": "cpu", "devices": 1}, ["--gpus-per-node", "2"], "runs on CPU"),
        ({"accelerator": "gpu", "devices": "auto"}, [], "--gpus-per-node G"),
        ({"accelerator": "cpu", "devices": 1, "strategy": {
            "class_path": "lightning_diffusion.strategies.MeshStrategy", "init_args": {"ulysses": 2}}},
         ["--nodes", "3"], "The world size 3 is not divisible"),
    ],
)
def test_resources_that_disagree_with_the_config_are_refused(slurm_here, tmp_path, trainer, flags, expected):
    config = write_config(tmp_path / "c.yaml", **trainer)
    proc = slurm_here("--config", str(config), *flags, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert "lightning-diffusion slurm: error:" in proc.stderr and expected in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_device_map_job_asks_for_every_gpu_its_processes_span(slurm_here, tmp_path):
    """2 processes x devices_per_process 2: 2 tasks and 4 GPUs per node, and 8 CPUs per task by default."""
    config = write_config(tmp_path / "dm.yaml", accelerator="gpu", devices=2, strategy={
        "class_path": "lightning_diffusion.strategies.DeviceMapStrategy", "init_args": {"devices_per_process": 2}})
    proc = slurm_here("--config", str(config), "--", "--writer.output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    options = [line[len("#SBATCH "):] for line in proc.stdout.splitlines() if line.startswith("#SBATCH")]
    assert {"--ntasks-per-node=2", "--gpus-per-node=4", "--cpus-per-task=8"} <= set(options)
    proc = slurm_here("--config", str(config), "--gpus-per-node", "2", "--",
                      "--writer.output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2 and "devices_per_process 2 (4 GPUs per node)" in proc.stderr


def test_without_sbatch_the_message_says_where_to_submit(slurm_here, tmp_path):
    proc = slurm_here("--config", TINY, "--submit", "--", "--data.prompts", FIVE_PROMPTS,
                 "--writer.output_dir", str(tmp_path / "out"), cwd=tmp_path,
                 env={"PATH": str(Path(sys.executable).parent)})
    assert proc.returncode == 2
    assert "sbatch is not installed here" in proc.stderr and "--script FILE" in proc.stderr


def test_an_output_folder_that_cannot_be_created_is_refused(slurm_here, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = slurm_here("--config", TINY, "--script", str(tmp_path / "job.sbatch"), "--", "--data.prompts", FIVE_PROMPTS,
                 "--writer.output_dir", str(blocker / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert str(blocker / "out") in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "job.sbatch").exists()


def test_a_control_character_in_any_value_of_the_script_is_refused(slurm_here, tmp_path):
    """A newline would end an ``#SBATCH`` line (or the header comment) and run the rest as a command."""
    payload = "x\ntouch pwned\n#"
    proc = slurm_here("--config", TINY, "--job-name", payload, "--partition", payload, "--time", payload,
                      f"--extra-sbatch=--qos={payload}", "--script", str(tmp_path / "job.sbatch"), "--",
                      "--data.prompts", FIVE_PROMPTS, "--writer.output_dir", str(tmp_path / payload), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    for name in ("--job-name", "--partition", "--time", "--extra-sbatch 1", "writer.output_dir"):
        assert f"{name} holds a control character" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "job.sbatch").exists() and not (tmp_path / "pwned").exists()
    assert list(tmp_path.iterdir()) == []  # --script renders only: not even the output folder is made


def test_a_rendered_script_with_shell_words_in_every_value_runs_none_of_them(slurm_here, tmp_path):
    """Values full of shell syntax are allowed where they are only words, and the script, run with a
    stand-in ``srun`` on PATH, executes none of them."""
    work = tmp_path / "work"
    work.mkdir()
    config = write_config(work / "c$(touch pwned-config).yaml")
    out = work / "out$(touch pwned-out);`touch pwned-tick`"
    proc = slurm_here("--config", str(config), "--job-name", "j$(touch${IFS}pwned-name)", "--partition", "p;touch",
                      "--extra-sbatch=--comment=$(touch${IFS}pwned-extra)", "--script", str(work / "job.sbatch"),
                      "--",
                      "--data.prompts", FIVE_PROMPTS, "--writer.output_dir", str(out), cwd=work)
    assert proc.returncode == 0, proc.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "srun-calls"
    (bin_dir / "srun").write_text(  # runs the node check (bash -c ...), records the predict step
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
        f'if [ "$1" = bash ]; then exec "$@"; fi\nprintf "%s\\n" "$@" > {shlex.quote(str(calls))}\n')
    (bin_dir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    run = subprocess.run(["bash", str(work / "job.sbatch")], cwd=work, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert not list(work.glob("pwned*")) and not list(tmp_path.glob("pwned*"))
    words = calls.read_text().splitlines()
    assert str(out) in words and str(config) in words  # passed on as the very words given


def sbatch_reads(line: str, old: bool = False) -> list[str]:
    """The arguments sbatch takes from an ``#SBATCH`` line, read as its ``_get_argument``
    (src/sbatch/opt.c) reads them: words split at white space, quotes removed, a backslash escaping
    the next character, an unescaped ``#`` ending the line. ``old``: the reading of earlier Slurm,
    where only double quotes count and a ``#`` ends the line even between them."""
    rest, words, i = line[len("#SBATCH"):], [], 0
    while True:
        while i < len(rest) and rest[i].isspace():
            i += 1
        word: list[str] = []
        quote, escaped, comment = "", False, False
        while i < len(rest) and (quote or not rest[i].isspace()):
            char = rest[i]
            i += 1
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
                continue
            elif old and char == '"':
                quote = "" if quote else char
                continue
            elif old and char == "#":
                comment = True
                break
            elif not old and quote:
                if char == quote:
                    quote = ""
                    continue
            elif not old and char in "\"'":
                quote = char
                continue
            elif not old and char == "#":
                comment = True
                break
            word.append(char)
        assert old or not quote, f"sbatch: unmatched quote in {line!r}"  # the old reading does not check
        if word:
            words.append("".join(word))
        if comment or i >= len(rest):
            return words


def test_sbatch_reads_each_value_of_an_sbatch_line_back_as_given(slurm_here, tmp_path):
    """A working folder, a job folder and --extra-sbatch values with spaces, quotes, '#', a backslash,
    '$(..)' and unicode: each #SBATCH line is one argument to sbatch, the very value given, in both
    of sbatch's readings; a '%' of the log folder is written '%%' (sbatch's literal %)."""
    work = tmp_path / 'my runs #1 "q" \' \\ $(touch pwned) ü'
    work.mkdir()
    job_dir = work / "logs 50%"
    comment = "--comment=two words # not a comment \"quoted\" 'single' \\ $(touch pwned) ü"
    proc = slurm_here("--config", TINY, "--job-dir", str(job_dir), f"--extra-sbatch={comment}",
                      "--extra-sbatch=--qos=high", "--", "--data.prompts", FIVE_PROMPTS,
                      "--writer.output_dir", str(work / "out"), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("#SBATCH")]
    expected = {"--chdir": f"--chdir={work}", "--output": f"--output={work}/logs 50%%/slurm-%j.out",
                "--comment": comment, "--qos": "--qos=high", "--job-name": "--job-name=lightning-diffusion-tiny-flux"}
    for old in (False, True):
        read = [sbatch_reads(line, old) for line in lines]
        assert all(len(words) == 1 for words in read), read
        options = {words[0].partition("=")[0]: words[0] for words in read}
        assert {flag: options[flag] for flag in expected} == expected, old
    assert "#SBATCH --qos=high" in lines  # a plain value is written as it is
    assert subprocess.run(["bash", "-n"], input=proc.stdout, text=True).returncode == 0
    assert not list(tmp_path.rglob("pwned"))


def test_the_input_is_judged_before_sbatch_is_looked_for(slurm_here, tmp_path):
    """Without sbatch on PATH, --submit with a mistake says the mistake, not that sbatch is missing."""
    path = {"PATH": str(Path(sys.executable).parent)}
    proc = slurm_here("--config", TINY, "--submit", "--partition", "two words", "--", "--data.prompts", FIVE_PROMPTS,
                      "--writer.output_dir", str(tmp_path / "out"), cwd=tmp_path, env=path)
    assert proc.returncode == 2 and "--partition must be one word without spaces" in proc.stderr, proc.stderr
    assert "sbatch is not installed" not in proc.stderr
    proc = slurm_here("--config", TINY, "--resubmit", "--", "--data.prompts", FIVE_PROMPTS,
                      "--writer.output_dir", str(tmp_path / "out"), cwd=tmp_path, env=path)
    assert proc.returncode == 2 and "holds no shards of a job array" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_slurms_own_error_is_passed_through(cluster, tmp_path):
    proc = slurm("--config", TINY, "--partition", "no-such-partition", "--submit", "--", "--data.prompts", FIVE_PROMPTS,
                 "--writer.output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "sbatch refused the job" in proc.stderr and "invalid partition" in proc.stderr.lower()


# ----------------------------------------------------------------------------- jobs on the cluster
# Two nodes of data-parallel replicas are the first run of the signal test below (compared with one
# process there); here a context-parallel group across the two nodes.


@pytest.mark.slow
def test_context_parallel_group_spanning_two_nodes_matches_one_process(cluster, reference, tmp_path):
    out = tmp_path / "out"
    config = str(REPO / "configs" / "tiny-ulysses.yaml")
    proc = slurm("--config", config, "--nodes", "2", "--submit", "--wait", "--",
                 *tiny_args(out, "--data.prompts", FIVE_PROMPTS, "--trainer.devices", "1")[3:], cwd=tmp_path)
    job = submitted_job(proc)
    assert proc.returncode == 0, proc.stdout + job_log(out, job)[-4000:]
    assert "COMPLETED" in proc.stdout and "5 of 5 outputs" in proc.stdout  # what --wait reports
    log = job_log(out, job)
    assert "on n[1-2]" in log and "ulysses=2" in log and "replica 0: ranks [0, 1]" in log
    assert "do not fit within one node's 1 processes" in log  # the group's traffic crosses nodes: said
    assert [line["index"] for line in read_manifest_lines(out)] == list(range(5))
    ours, ref = load_arrays(out), reference()
    assert max(float(np.abs(ours[i] - ref[i]).max()) for i in range(5)) <= ATOL


@pytest.mark.slow
def test_signal_part_way_finishes_in_flight_requeues_and_resumes(cluster, tmp_path):
    count = 16
    prompts = "[" + ", ".join(f"preempted prompt {i}" for i in range(count)) + "]"
    slow = ("--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps", "40")
    out = tmp_path / "out"
    proc = slurm("--config", TINY, "--nodes", "2", "--submit", "--", *tiny_args(out, *slow)[3:], cwd=tmp_path)
    job = submitted_job(proc)

    # Part way: once the first images are in the manifest parts, signal the batch shell only (the
    # script passes it to the tasks), as `scancel --signal=USR1 --batch` does.
    deadline = time.time() + 240
    while sum(len(p.read_text().splitlines()) for p in out.glob("manifest.part-*.jsonl")) < 1:
        assert time.time() < deadline, job_log(out, job)[-4000:]
        assert job_fields(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), job_log(out, job)[-4000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)

    fields: dict[str, str] = {}
    requeued_at, released = None, False
    while time.time() < deadline + 240:
        fields = job_fields(job)
        if fields.get("JobState") == "PENDING" and fields.get("Restarts", "0") != "0" and not released:
            requeued_at = requeued_at or time.time()
            # SLURM holds a requeued job for ~2 min (Reason=BeginTime); start it sooner to keep the test
            # short, but not at once: slurmd refuses a launch credential issued in the same second as it
            # revoked the earlier run's ("Killing non-startable batch JobId=N: Job credential revoked" in
            # slurmctld.log, and the job ends FAILED). That hold is what normally prevents it.
            if time.time() - requeued_at >= 3 and nodes_idle():
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
                released = True
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(1)
    log = job_log(out, job)
    assert fields.get("JobState") == "COMPLETED", log[-5000:]
    assert int(fields["Restarts"]) >= 1, log[-5000:]
    assert "received SIGUSR1" in log and "requeueing job" in log and "start 2" in log, log[-5000:]
    done_before = int(re.search(r"stopped early after (\d+) images", log).group(1))
    assert 1 <= done_before < count, "the first run must stop part way"
    assert f"resumed: {done_before:,} already in the manifest of {out}" in log

    lines = read_manifest_lines(out)
    assert sorted(line["index"] for line in lines) == list(range(count))  # each exactly once
    assert len(list(out.glob("*.png"))) == count
    assert not list(tmp_path.rglob("*.ckpt")), "Lightning's full-checkpoint requeue must not run"

    single = tmp_path / "single"
    run_here(*tiny_args(single, *slow))
    ours, ref = load_arrays(out), load_arrays(single)
    # data parallel over two nodes, stopped and requeued: the same calls, so the same bits
    assert all(np.array_equal(ours[i], ref[i]) for i in range(count))


@pytest.mark.slow
def test_scancel_finishes_the_images_in_flight_and_a_new_job_resumes(cluster, tmp_path):
    # scancel sends SIGTERM, then SIGKILL after KillWait (30 s, SLURM's default). The tasks finish
    # the image in flight, merge the manifest and exit on their own, without requeueing the job.
    count = 12
    prompts = "[" + ", ".join(f"cancelled prompt {i}" for i in range(count)) + "]"
    # 200 steps an image (about 0.7 s on an idle core): with 30, an idle machine finished all 12 images
    # between two looks at the manifest parts, before the cancel.
    slow = ("--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps", "200")
    out = tmp_path / "out"
    args = ("--config", TINY, "--nodes", "2", "--submit")
    job = submitted_job(slurm(*args, "--", *tiny_args(out, *slow)[3:], cwd=tmp_path))
    deadline = time.time() + 240
    while sum(len(p.read_text().splitlines()) for p in out.glob("manifest.part-*.jsonl")) < 1:
        assert time.time() < deadline, job_log(out, job)[-4000:]
        assert job_fields(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), job_log(out, job)[-4000:]
        time.sleep(0.2)
    cancelled_at = time.time()
    subprocess.run(["scancel", job], check=True)
    while (fields := job_fields(job)) and fields.get("JobState") not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.time() < deadline, job_log(out, job)[-4000:]
        time.sleep(0.5)
    # Lightning's own handler would have swallowed SIGTERM and kept going until SIGKILL.
    while not re.search(r"stopped on SIGTERM after \d+ images", job_log(out, job)):
        assert time.time() < cancelled_at + 25, "the tasks did not stop before SIGKILL:\n" + job_log(out, job)[-4000:]
        time.sleep(0.5)
    log = job_log(out, job)
    assert "received SIGTERM" in log and "Killed" not in log and "requeueing job" not in log, log[-4000:]
    done = [line["index"] for line in read_manifest_lines(out)]  # merged by the writer at the stop
    assert 1 <= len(done) < count and len(done) == len(set(done)), log[-4000:]
    assert sorted(int(p.name[:6]) for p in out.glob("*.png")) == sorted(done)  # no image without its line
    assert not list(out.glob(".*.tmp-*")), "a half-written file was left"

    # Submitted again with the same output folder: it resumes and makes the rest, each once.
    again = slurm(*args, "--wait", "--", *tiny_args(out, *slow)[3:], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    log = job_log(out, submitted_job(again))
    assert f"resumed: {len(done):,} already in the manifest" in log, log[-4000:]
    assert sorted(line["index"] for line in read_manifest_lines(out)) == list(range(count))
    assert len(list(out.glob("*.png"))) == count


def test_a_requeued_job_takes_over_the_lock_of_its_earlier_run(tmp_path, monkeypatch):
    import json

    from lightning_diffusion.output.lock import OutputLock

    # A fresh lock from a live-looking run on another host: refused, unless it is this SLURM job's.
    (tmp_path / ".lock").write_text(json.dumps({"host": "node7", "pid": 1, "slurm_job": "41"}))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert OutputLock(tmp_path).acquire() == "pid 1 on node7"
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    lock = OutputLock(tmp_path)
    assert lock.acquire() is None
    assert json.loads((tmp_path / ".lock").read_text())["slurm_job"] == "41"
    lock.release()
