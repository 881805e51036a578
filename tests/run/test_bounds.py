"""Inputs without a bound, and folders a run must not write into, refused through the real entry
point before any weight loads or any process starts: exit code 2, one line that names the rule."""

import os
import stat

import pytest

from lightning_diffusion.core.checks import MAX_BATCH_SIZE, cpu_devices_problems, system_folder_problems
from lightning_diffusion.input.settings import DataSettings, data_problems


def refused(proc, message):
    """Exit code 2 and one line, ``lightning-diffusion: error: ...`` holding ``message``."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("lightning-diffusion: error: "), proc.stderr[-3000:]
    assert message in lines[0], lines[0]
    return lines[0]


def predict(cli_here, out, *words):
    return cli_here("predict", "--config", "configs/tiny.yaml", "--trainer.enable_progress_bar", "false",
                    "--writer.output_dir", str(out), *words)


def test_a_config_of_no_end_is_read_only_to_its_bound(cli_here):
    """/dev/zero has no size to stat: the guard reads at most 1 MiB + 1 bytes of any file."""
    line = refused(cli_here("predict", "--config", "/dev/zero"),
                   "/dev/zero is more than 1,048,576 bytes; a config is at most 1,048,576")
    assert "\0" not in line


def test_a_config_that_is_a_pipe_or_a_device_is_refused(cli_here, tmp_path):
    refused(cli_here("predict", "--config", "/dev/null"), "/dev/null is not a regular file (a pipe or a device)")
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    pid = os.fork()
    if pid == 0:  # the pipe's writer: a config of a few bytes, read once
        try:
            with open(fifo, "w") as f:
                f.write("trainer:\n  devices: 1\n")
        finally:
            os._exit(0)
    try:
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
        refused(cli_here("predict", "--config", str(fifo)), f"{fifo} is not a regular file")
    finally:
        os.waitpid(pid, 0)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_an_empty_config_says_so_in_one_line(text, cli_here, tmp_path):
    config = tmp_path / "empty.yaml"
    config.write_text(text)
    line = refused(cli_here("predict", "--config", str(config)), f"{config} is empty (or only comments)")
    assert "Unexpected config" not in line and "comment" not in line.split("is empty")[0]


def test_a_cpu_run_of_more_processes_than_its_cores_run_is_refused_before_any_starts(cli_here, tmp_path):
    cores = len(os.sched_getaffinity(0))
    refused(predict(cli_here, tmp_path / "out", "--trainer.devices", "1000"),
            f"trainer.devices 1,000 on accelerator cpu would start 1,000 processes on this machine's {cores} CPU core")
    assert not (tmp_path / "out").exists()
    assert cpu_devices_problems(4 * cores, cores) == [] and cpu_devices_problems("auto", cores) == []
    assert "at most 4 a core (8)" in cpu_devices_problems(9, 2)[0]


@pytest.mark.parametrize("devices, message", [
    ("0", "trainer.devices must be a count of devices (1, 8), auto, -1 (all of them) or a list of device indices"),
    ("-1", "trainer.devices on accelerator cpu is a count of processes (1, 4), not -1 nor a list of devices"),
    ("0,1", "trainer.devices on accelerator cpu is a count of processes (1, 4), not -1 nor a list of devices"),
])
def test_devices_lightning_refuses_on_the_cpu_are_one_line(devices, message, cli_here, tmp_path):
    line = refused(predict(cli_here, tmp_path / "out", "--trainer.devices", devices), message)
    assert "Misconfiguration" not in line and "Traceback" not in line


def test_lightnings_own_refusal_of_devices_is_one_line_where_the_checks_were_trusted(tmp_path):
    """A rank trusts its launcher's checks: what Lightning's Trainer refuses then (devices this
    machine does not have) is a ConfigError, said in one line, not a traceback."""
    from lightning_diffusion.core.context import RunContext
    from lightning_diffusion.core.errors import ConfigError
    from lightning_diffusion.run.config import DiffusionCLI

    with pytest.raises(ConfigError, match=r"^trainer: `Trainer\(devices='0'\)` value is not a valid input"):
        DiffusionCLI(args=["--config", "configs/tiny.yaml", "--trainer.devices", "0", "--writer.output_dir",
                           str(tmp_path / "out")], run=False, run_context=RunContext(checked=True))


def test_a_batch_size_past_any_pipeline_call_is_refused(cli_here, tmp_path):
    """Refused from the text, before anything is read: a batch size past any device's. One that is
    allowed stands, whatever the set's size (a set of fewer images is computed at its own size:
    test_data.py's test_a_set_smaller_than_a_batch_is_computed_at_its_own_size)."""
    refused(predict(cli_here, tmp_path / "out", "--data.batch_size", "100000000", "--data.prompts",
                    '["a", "b", "c", "d"]'),
            f"data.batch_size 100,000,000 is over {MAX_BATCH_SIZE:,}, the most images one pipeline call is padded to")
    assert not (tmp_path / "out").exists()
    assert data_problems(DataSettings.of({"prompts": ["a"], "batch_size": MAX_BATCH_SIZE}), 4) == []
    assert data_problems(DataSettings.of({"prompts": ["a"], "batch_size": 8}), 4) == []


@pytest.mark.parametrize("folder, message", [
    ("/", "writer.output_dir '/' is the file system's root"),
    ("/etc", "writer.output_dir '/etc' is /etc, a folder of the system's"),
    ("/usr/local/share/images", "is in /usr, a folder of the system's"),
    ("/var", "writer.output_dir '/var' is /var itself, which holds other folders: choose a folder below it"),
    ("~", "writer.output_dir '~' is the home folder (HOME) itself"),
])
def test_a_folder_a_run_must_not_write_into_is_refused(folder, message, cli_here):
    refused(cli_here("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", folder), message)


def test_the_folders_below_a_home_or_var_are_fine(tmp_path):
    home = str(tmp_path)
    assert system_folder_problems(home, home=home)  # the home folder itself
    assert system_folder_problems(os.path.join(home, "."), home=home)
    for fine in (os.path.join(home, "out"), "/var/tmp/run", "/dev/shm/run", "/tmp/x", "relative/out"):
        assert system_folder_problems(fine, home=home) == [], fine
    for bad in ("/lib64/x", "/boot", "/dev/x", "/etc/../etc/x", "/sbin"):
        assert system_folder_problems(bad, home=home), bad
