"""A table of bad inputs through the real CLI entry point: each exits with code 2, names the
problem, writes no image and reads no weight file.

Weight reads are observed with a Python audit hook on file opens (nothing is replaced): a
``*.safetensors`` or ``*.bin`` file opened during the call fails the test.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_diffusion.cli import main

ROOT = Path(__file__).resolve().parents[2]

OPENED: list[str] = []


def _audit(event, args):
    if (event == "open" and args and isinstance(args[0], (str, Path))
            and str(args[0]).endswith((".safetensors", ".bin"))):
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)

CP = "lightning_diffusion.strategies.ContextParallelStrategy"
DM = "lightning_diffusion.strategies.DeviceMapStrategy"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    (tmp_path / "noprompt.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "seed.jsonl").write_text('{"prompt": "x", "seed": "seven"}\n')
    (tmp_path / "eta.jsonl").write_text('{"prompt": "x", "eta": 0.3}\n')
    (tmp_path / "typed.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y", "guidance_scale": "high"}\n')
    (tmp_path / "p.xlsx").write_text("x")
    (tmp_path / "notpipe").mkdir()
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "model_index.json").write_text(json.dumps({"_class_name": "NoSuchPipeline"}))
    (tmp_path / "afile").write_text("x")
    (tmp_path / "busy").mkdir()  # a folder a live run (this test's process) writes
    (tmp_path / "busy" / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    for name, record in {
        "nan": '{"prompt": "x", "guidance_scale": NaN}', "inf": '{"prompt": "x", "true_cfg_scale": Infinity}',
        "bigseed": '{"prompt": "x", "seed": 1000000000000000000000000000000}',
        "seed64": '{"prompt": "x", "seed": 18446744073709551616}',
        "steps0": '{"prompt": "x", "num_inference_steps": 0}', "steps-3": '{"prompt": "x", "num_inference_steps": -3}',
        "text": '{"prompt": "x", "max_sequence_length": 100000}',
        "callback": '{"prompt": "x", "callback_on_step_end": "os.system"}',
        "latents": '{"prompt": "x", "latents": [[1, 2]]}', "output": '{"prompt": "x", "output_type": "latent"}',
        "huge": '{"prompt": "x", "height": 10000, "width": 10000}',
        "hugeimage": '{"prompt": "x", "image": "huge.png"}',
    }.items():
        (tmp_path / f"{name}.jsonl").write_text(f'{{"prompt": "fine"}}\n{record}\n')
    _png_claiming(tmp_path / "huge.png", 10000, 10000)
    # Record 2 asks for 48x80 pixels: 3 x 5 = 15 image tokens, which 2-way Ulysses cannot split.
    (tmp_path / "odd-size.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "height": 48, "width": 80}\n')
    return tmp_path


def _png_claiming(path, width, height):
    """A PNG whose header says ``width`` x ``height`` (its pixels are not there): the size check
    must refuse it from the header, before anything decodes it."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


I2I = ["--model.pipeline_class", "FluxImg2ImgPipeline"]
CASES = [
    ("record guidance NaN", ["--data.prompts", "{d}/nan.jsonl"],
     "nan.jsonl:2: guidance_scale is not a finite number (NaN and Infinity are refused)"),
    ("record true_cfg_scale Infinity", ["--data.prompts", "{d}/inf.jsonl"],
     "inf.jsonl:2: true_cfg_scale is not a finite"),
    ("record seed 10**30", ["--data.prompts", "{d}/bigseed.jsonl"],
     "bigseed.jsonl:2: 'seed' must be an integer from 0 to 2**64 - 1"),
    ("record seed 2**64", ["--data.prompts", "{d}/seed64.jsonl"], "seed64.jsonl:2: 'seed' must be an integer from 0"),
    ("data.seed 10**29", ["--data.seed", str(10 ** 29)], "data.seed must be an integer from 0 to 2**64 - 1"),
    ("data.seed at the generator's end", ["--data.seed", str(2 ** 64 - 5)],
     "data.seed 18446744073709551611 + the 10 images of the prompt set passes the generator's largest seed"),
    ("config guidance NaN", ["--model.guidance_scale", "nan"],
     "model.guidance_scale: expected float or null, got 'nan'"),
    ("config true_cfg_scale NaN", ["--model.call_kwargs", '{"true_cfg_scale": .nan}'],
     "model.call_kwargs.true_cfg_scale must be a finite number, got nan"),
    ("record steps 0", ["--data.prompts", "{d}/steps0.jsonl"],
     "steps0.jsonl:2: num_inference_steps must be an integer from 1 to 1,000, got 0"),
    ("record steps -3", ["--data.prompts", "{d}/steps-3.jsonl"], "steps-3.jsonl:2: num_inference_steps must be"),
    ("record text length", ["--data.prompts", "{d}/text.jsonl"],
     "text.jsonl:2: max_sequence_length must be an integer from 1 to 512, got 100000"),
    ("record callback", ["--data.prompts", "{d}/callback.jsonl"],
     "callback.jsonl:2: callback_on_step_end: not something "
     "a record may set; a FluxPipeline record may have prompt, seed, negative_prompt, height, width"),
    ("record latents", ["--data.prompts", "{d}/latents.jsonl"],
     "latents.jsonl:2: latents: not something a record may"),
    ("record output_type", ["--data.prompts", "{d}/output.jsonl"],
     "output.jsonl:2: output_type: not something a record"),
    ("record of 10000x10000", ["--data.prompts", "{d}/huge.jsonl"],
     "huge.jsonl:2: 10000x10000 is 100,000,000 pixels, over data.max_pixels 16,777,216 (raise it if you mean it)"),
    ("input image of 10000x10000", ["--data.prompts", "{d}/hugeimage.jsonl", *I2I],
     "hugeimage.jsonl:2: image {d}/huge.png: it is 10000x10000, 100,000,000 pixels, over data.max_pixels"),
    ("unknown on_bad_record", ["--data.on_bad_record", "ignore"], "data.on_bad_record must be one of fail, skip"),
    ("unknown on_error", ["--data.on_error", "retry"], "data.on_error must be one of fail, skip"),
    ("max_pixels 0", ["--data.max_pixels", "0"], "data.max_pixels must be an integer >= 1, got 0"),
    ("strategy name misspelt", ["--trainer.strategy", "data_paralel"],
     "trainer.strategy 'data_paralel' is not a strategy; did you mean data_parallel? this project's: mesh, "
     "data_parallel"),
    ("GPUs asked for on a machine without", ["--trainer.accelerator", "gpu"],
     "trainer.accelerator gpu: torch sees no CUDA GPU on this machine"),
    ("files_per_folder 0", ["--writer.files_per_folder", "0"],
     "writer.files_per_folder must be an integer >= 1, got 0"),
    ("unknown layout", ["--writer.layout", "nested"], "writer.layout must be one of auto, flat, sharded, got 'nested'"),
    ("unknown format", ["--writer.format", "tiff"],
     "writer.format must be one of files, webdataset, parquet, litdata, got 'tiff'"),
    ("override of the wrong type", ["--data.prompts", "{d}/typed.jsonl"],
     "typed.jsonl:2: guidance_scale must be a number, got 'high'"),
    ("call_kwargs of the wrong type", ["--model.call_kwargs", '{"max_sequence_length": "long"}'],
     "model.call_kwargs.max_sequence_length must be an integer from 1 to 512, got 'long'"),
    ("missing prompt file", ["--data.prompts", "{d}/nope.txt"], "nope.txt' does not exist."),
    ("a prompt given as a file", ["--data.prompts", "a red circle"],
     "Prompt file 'a red circle' does not exist. Prompts given in place are a list: "
     """--data.prompts '["a red circle"]'."""),
    ("empty prompt file", ["--data.prompts", "{d}/empty.txt"], "No prompts found"),
    ("jsonl line not JSON", ["--data.prompts", "{d}/bad.jsonl"], "bad.jsonl:2: not valid JSON"),
    ("jsonl line without prompt", ["--data.prompts", "{d}/noprompt.jsonl"], "noprompt.jsonl:1: no 'prompt'"),
    ("seed not an integer", ["--data.prompts", "{d}/seed.jsonl"],
     "seed.jsonl:1: 'seed' must be an integer from 0 to 2**64 - 1, got 'seven'"),
    ("unknown prompt file type", ["--data.prompts", "{d}/p.xlsx"], "use one of .txt, .jsonl, .csv, .parquet"),
    ("batch size 0", ["--data.batch_size", "0"], "data.batch_size must be an integer >= 1"),
    ("images per prompt 0", ["--data.num_images_per_prompt", "0"],
     "data.num_images_per_prompt must be an integer >= 1"),
    ("negative seed", ["--data.seed", "-1"], "data.seed must be an integer from 0 to 2**64 - 1, got -1"),
    ("model path missing", ["--model.pretrained_model_name_or_path", "{d}/nothing"], "does not exist"),
    ("folder without model_index.json", ["--model.pretrained_model_name_or_path", "{d}/notpipe"],
     "is not a diffusers pipeline"),
    ("unknown pipeline class", ["--model.pretrained_model_name_or_path", "{d}/unknown"],
     "'NoSuchPipeline', which is not a pipeline class"),
    ("unknown tiny pipeline", ["--model.pretrained_model_name_or_path", "tiny:sd"], "Unknown tiny pipeline 'tiny:sd'"),
    ("height not a multiple of 16", ["--model.height", "50"], "height=50 cannot be made by FluxPipeline"),
    ("width 0", ["--model.width", "0"], "width=0 cannot be made by FluxPipeline"),
    ("steps 0", ["--model.num_inference_steps", "0"],
     "model.num_inference_steps must be an integer from 1 to 1,000, got 0"),
    ("unknown dtype", ["--model.torch_dtype", "float8"], "torch_dtype 'float8'"),
    ("call argument the pipeline lacks", ["--model.call_kwargs", '{"strength": 0.5}'],
     "FluxPipeline does not accept strength"),
    ("reserved call argument", ["--model.call_kwargs", '{"generator": 1}'],
     "sets generator, which lightning-diffusion sets"),
    ("record override the pipeline lacks", ["--data.prompts", "{d}/eta.jsonl"],
     "eta.jsonl:1: eta: not something a record may set; a FluxPipeline record may have prompt, seed"),
    ("frames for an image pipeline", ["--model.num_frames", "9"], "FluxPipeline makes images, not videos"),
    ("output folder is a file", ["--writer.output_dir", "{d}/afile"], "is a file, not a folder"),
    ("output folder below a file", ["--writer.output_dir", "{d}/afile/out"], "which is a file"),
    ("unknown video format", ["--writer.video_format", "avi"], "writer.video_format must be one of mp4, webp, gif"),
    ("fps 0", ["--writer.fps", "0"], "writer.fps must be an integer >= 1"),
    ("metrics port out of range", ["--writer.metrics_port", "70000"],
     "writer.metrics_port must be an integer from 0 to 65,535, got 70000 (0: none)."),
    ("devices not a count", ["--trainer.devices", "one"], "trainer.devices must be a count of devices (1, 8), auto"),
    ("mesh does not fit the world", ["--trainer.devices", "3", "--trainer.strategy.class_path",
                                     "lightning_diffusion.strategies.MeshStrategy",
                                     "--trainer.strategy.init_args.dp", "2"],
     "= 2 processes, but the world size is 3"),
    ("context parallel of degree 1", ["--trainer.strategy.class_path", CP,
                                      "--trainer.strategy.init_args.ulysses_degree", "1"],
     "needs ulysses_degree > 1 or ring_degree > 1"),
    ("backend without context parallelism", ["--trainer.strategy.class_path", CP,
                                             "--trainer.strategy.init_args.ulysses_degree", "2",
                                             "--trainer.strategy.init_args.attention_backend", "flex"],
     "'flex' cannot do context parallelism"),
    ("negative timeout", ["--trainer.strategy.class_path", "lightning_diffusion.strategies.DataParallelStrategy",
                          "--trainer.strategy.init_args.timeout", "-1"],
     "timeout must be a positive number of seconds"),
    ("unknown device map", ["--trainer.strategy.class_path", DM,
                            "--trainer.strategy.init_args.device_map", "sequential"],
     "device_map must be 'auto', 'balanced'"),
    ("output folder on /proc", ["--writer.output_dir", "/proc/lightning-diffusion-test/out"],
     "writer.output_dir '/proc/lightning-diffusion-test/out' is on /proc, a proc file system of the kernel that "
     "stores no files: choose a folder on a disk."),
    ("output folder in use", ["--writer.output_dir", "{d}/busy"],
     "{d}/busy is being written by another run (pid %d on %s); wait for it to end"
     % (os.getpid(), socket.gethostname())),
    ("offload folder not writable", ["--trainer.strategy.class_path", DM, "--trainer.strategy.init_args.offload_folder",
                                     "{d}/afile/offload"], "is not a writable folder"),
]


@pytest.mark.parametrize("name, argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_any_weight_is_read(name, argv, message, files, capsys):
    out = files / "images"
    argv = [a.replace("{d}", str(files)) for a in argv]
    own_folder = "--writer.output_dir" in argv
    if not own_folder:
        argv += ["--writer.output_dir", str(out)]
    OPENED.clear()
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", "configs/tiny-flux.yaml", "--trainer.enable_progress_bar", "false", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message.replace("{d}", str(files)) in err, err
    assert "Traceback" not in err
    assert OPENED == []
    if not own_folder:
        assert not out.exists(), "a refused run creates no output folder"


def test_every_problem_is_reported_at_once(files, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", "configs/tiny-flux.yaml", "--data.prompts", f"{files}/bad.jsonl",
              "--data.batch_size", "0", "--model.height", "50", "--writer.fps", "0",
              "--writer.output_dir", str(files / "images")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "4 problems:" in err
    for part in ("height=50 cannot be made", "data.batch_size must be", "bad.jsonl:2: not valid JSON",
                 "writer.fps must be"):
        assert part in err


def test_strategy_problems_join_the_others(files, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", "configs/tiny-ulysses.yaml", "--trainer.devices", "3", "--writer.fps", "0",
              "--writer.output_dir", str(files / "images")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "2 problems:" in err and "writer.fps must be" in err
    assert "world size 3 is not divisible by ring 1 x ulysses 2 x tp 1 = 2" in err


def test_a_record_whose_size_breaks_the_token_split_joins_the_other_problems(files, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", "configs/tiny-ulysses.yaml", "--data.prompts", f"{files}/odd-size.jsonl",
              "--writer.output_dir", str(files / "images")])
    assert exit_info.value.code == 2
    assert "48x80 gives 15 image tokens" in capsys.readouterr().err


def test_heads_against_ulysses_are_checked_before_any_process_starts(files, capsys):
    with pytest.raises(SystemExit):
        main(["predict", "--config", "configs/tiny-ulysses.yaml", "--trainer.devices", "3",
              "--trainer.strategy.init_args.ulysses_degree", "3", "--writer.output_dir", str(files / "images")])
    assert "4 attention heads, not divisible by ulysses_degree=3" in capsys.readouterr().err


def test_not_enough_disk_space_for_the_expected_images(files, capsys):
    with pytest.raises(SystemExit):
        main(["predict", "--config", "configs/tiny-flux.yaml", "--model.height", "65536", "--model.width", "65536",
              "--data.max_pixels", str(2 ** 33), "--data.num_images_per_prompt", "1000",
              "--writer.output_dir", str(files / "images")])
    assert "outputs of 65536x65536 need about" in capsys.readouterr().err


@pytest.mark.parametrize("procid, says", [("0", True), ("5", False)])
def test_under_srun_only_the_first_task_of_the_job_prints_the_error(files, capsys, monkeypatch, procid, says):
    """srun starts every task with the same command line: 16 tasks would print the message 16 times."""
    monkeypatch.setenv("SLURM_PROCID", procid)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first task of every node
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", "configs/tiny-flux.yaml", "--data.batch_size", "0",
              "--writer.output_dir", str(files / "images")])
    assert exit_info.value.code == 2
    assert ("data.batch_size must be" in capsys.readouterr().err) == says


SRUN_TASK = {"SLURM_PROCID": "9", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}  # the first task of node 1


@pytest.mark.parametrize("environ, config_says, node_says", [
    ({}, True, True),  # one process
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, True, True),
    (SRUN_TASK, False, True),
    ({**SRUN_TASK, "SLURM_PROCID": "10", "SLURM_LOCALID": "1"}, False, False),
    ({"NODE_RANK": "1"}, False, True),  # Lightning's launcher on node 1: the node's problems only
    ({"NODE_RANK": "0"}, True, True),  # ... on node 0: the job's first process
    ({"NODE_RANK": "1", "LOCAL_RANK": "2"}, False, False),  # a rank it started
    ({**SRUN_TASK, "LOCAL_RANK": "1"}, False, False),  # a rank started by node 1's task
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "LOCAL_RANK": "1"}, False, False),  # one started by task 0
    ({"RANK": "0", "LOCAL_RANK": "0"}, True, True),  # torchrun
    ({"RANK": "1", "LOCAL_RANK": "1"}, False, False),
])
def test_a_problem_of_one_node_is_said_by_that_nodes_first_process_naming_its_host(environ, config_says, node_says):
    """A config problem is said once, by the job's first process; a node's too few GPUs by the first
    process of each node that has too few (else a job whose node 1 lacks GPUs ends with exit code 2
    and no message: node 0's processes find nothing, and srun stops them when node 1's exit)."""
    import socket

    from lightning_diffusion.commands.predict import error_line
    from lightning_diffusion.core.errors import ConfigError, NodeConfigError

    assert error_line(ConfigError("data.batch_size must be ..."), environ) == (
        "lightning-diffusion: error: data.batch_size must be ..." if config_says else None)
    assert error_line(NodeConfigError("8 GPUs, but this node has 4."), environ) == (
        f"lightning-diffusion: error: on {socket.gethostname()}: 8 GPUs, but this node has 4." if node_says else None)


def test_problems_found_together_are_one_nodes_own_where_one_of_them_is():
    from lightning_diffusion.core.errors import ConfigError, NodeConfigError, raise_problems

    with pytest.raises(NodeConfigError, match="2 problems:\n  - too few GPUs\n  - bad size"):
        raise_problems([NodeConfigError("too few GPUs"), "bad size"])
    with pytest.raises(ConfigError) as raised:
        raise_problems(["bad size", ConfigError("bad steps")])
    assert type(raised.value) is ConfigError


@pytest.mark.parametrize("command", ["verify", "benchmark"])
def test_every_subcommand_reports_bad_input_like_predict(command, files, cli_here):
    proc = cli_here(command, "--config", "configs/tiny-flux.yaml", "--data.prompts", f"{files}/nope.txt")
    assert proc.returncode == 2
    assert f"lightning-diffusion {command}: error: Prompt file" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--model.num_steps", "4"],
     "unknown key model.num_steps; did you mean model.num_inference_steps? (lightning-diffusion predict --help "
     "lists every key)"),
    (["--trainer.devicez", "2"], "unknown key trainer.devicez; did you mean trainer.devices?"),
    (["--model.height", "abc"], "model.height: expected int or null, got 'abc'"),
    (["--data.batch_size", "x"], "data.batch_size: expected int, got 'x'"),
])
def test_parse_errors_come_first_in_one_line_with_the_closest_key(args, message, cli_here):
    proc = cli_here("predict", "--config", "configs/tiny-flux.yaml", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lightning-diffusion: error: {message}"), proc.stderr


@pytest.mark.parametrize("command", ["predict", "verify"])  # verify parses through read_config
def test_an_unknown_key_in_a_config_file_is_named_with_a_suggestion(command, tmp_path, cli_here):
    (tmp_path / "bad.yaml").write_text("data:\n  batchsize: 4\nmodel:\n  num_steps: 4\n")
    proc = cli_here(command, "--config", "configs/tiny-flux.yaml", "--config", str(tmp_path / "bad.yaml"))
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line == ("lightning-diffusion: error: 2 unknown keys: data.batchsize (did you mean data.batch_size?), "
                    "model.num_steps (did you mean model.num_inference_steps?) (lightning-diffusion predict --help "
                    "lists every key)"), line


def test_every_unknown_key_of_the_flags_and_the_files_is_named_at_once(tmp_path, cli_here):
    """Typos in flags and in a config file come in one message, each with its suggestion; keys under
    one that takes a whole value (a cache's settings, a strategy's init_args) are not unknown."""
    (tmp_path / "bad.yaml").write_text(
        "model:\n  cache: {type: first_block, threshold: 0.2}\n  num_stepz: 3\ntrainer:\n  strategy:\n"
        "    class_path: lightning_diffusion.strategies.ContextParallelStrategy\n    init_args: {ulysses_degree: 2}\n")
    proc = cli_here("predict", "--config", "configs/tiny-flux.yaml", "--config", str(tmp_path / "bad.yaml"),
                    "--data.batchsize", "2", "--model.heigth=64", "--trainer.devices", "1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "lightning-diffusion: error: 3 unknown keys: model.num_stepz (did you mean model.num_inference_steps?), "
        "data.batchsize (did you mean data.batch_size?), model.heigth (did you mean model.height?) "
        "(lightning-diffusion predict --help lists every key)"), proc.stderr


@pytest.fixture
def read_only_folder(tmp_path):
    """A read-only bind mount of an empty folder (needs CAP_SYS_ADMIN: root here and in CI)."""
    source, target = tmp_path / "rw", tmp_path / "ro"
    source.mkdir()
    target.mkdir()
    if subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield target
    finally:
        subprocess.run(["umount", str(target)], capture_output=True)


def test_an_output_folder_on_a_read_only_file_system_is_refused_in_one_line(read_only_folder, capsys):
    for folder in (read_only_folder, read_only_folder / "new" / "out"):  # an existing folder, and one to create
        with pytest.raises(SystemExit) as exit_info:
            main(["predict", "--config", "configs/tiny-flux.yaml", "--writer.output_dir", str(folder)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines() == [f"lightning-diffusion: error: writer.output_dir {str(folder)!r} is on a "
                                            f"read-only file system ({read_only_folder}): choose a writable folder."]


def test_free_space_is_said_in_a_unit_that_shows_it():
    from lightning_diffusion.output.files import size_text

    assert [size_text(n) for n in (512, 12_300, 4_500_000, 2.5e9, 3e12)] == ["512 bytes", "12.3 kB", "4.5 MB", "2.5 GB",
                                                                           "3.0 TB"]


def test_predict_without_a_config_says_so(cli_here):
    proc = cli_here("predict")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("lightning-diffusion: error: predict needs a config: lightning-diffusion predict "
                                   "--config configs/tiny.yaml (or --data.prompts or --prompt, and --model.* flags); "
                                   "predict --help lists the keys.")


@pytest.mark.parametrize("command", ["predict", "verify", "slurm"])
def test_unknown_keys_are_refused_before_torch_lightning_or_diffusers_is_imported(command, tmp_path):
    """The config groups' keys are read from the classes' sources: a typo is refused before the
    imports the parser needs (seconds), with the parser's own words."""
    code = ("import sys\nfrom lightning_diffusion import cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit as e:\n"
            "    heavy = sorted(m for m in ('torch', 'lightning', 'diffusers', 'transformers') if m in sys.modules)\n"
            "    print('exit', e.code, 'imported', heavy)\n")
    proc = subprocess.run([sys.executable, "-c", code, command, "--config", "configs/tiny-flux.yaml",
                           "--model.num_steps", "4", "--data.batchsize=2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "exit 2 imported []" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "lightning-diffusion: error: 2 unknown keys: model.num_steps (did you mean model.num_inference_steps?), "
        "data.batchsize (did you mean data.batch_size?) (lightning-diffusion predict --help lists every key)")


@pytest.mark.parametrize("command, prog", [("predict", "lightning-diffusion"),
                                           ("verify", "lightning-diffusion verify")])
def test_a_missing_prompt_file_is_refused_before_torch_is_imported(command, prog, tmp_path):
    """The prompt set's source (the last --config or flag that names it) is looked at before the
    heavy imports: a wrong path is refused at once, in the command's own words."""
    (tmp_path / "extra.yaml").write_text(f"data:\n  prompts: {tmp_path / 'nope.jsonl'}\n")
    code = ("import sys\nfrom lightning_diffusion import cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code, command, "--config", "configs/tiny-flux.yaml", "--config",
                           str(tmp_path / "extra.yaml")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "exit 2 False" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"{prog}: error: Prompt file '{tmp_path / 'nope.jsonl'}' does not exist."


LIGHT = ("import sys\nfrom lightning_diffusion import cli\ntry:\n    cli.main(sys.argv[1:])\n"
         "except SystemExit as e:\n"
         "    heavy = sorted(m for m in ('torch', 'lightning', 'diffusers') if m in sys.modules)\n"
         "    print('exit', e.code, 'imported', heavy)\n")


@pytest.mark.parametrize("words, line", [
    (["--model.height", "abc"], "model.height: expected int or null, got 'abc'"),
    (["--model.height=64.5"], "model.height: expected int or null, got '64.5'"),
    (["--writer.save_arrays", "maybe"], "writer.save_arrays: expected bool, got 'maybe'"),
    (["--trainer.num_nodes", "two"], "trainer.num_nodes: expected int, got 'two'"),
    (["--config", "{tmp}/typed.yaml"], "data.batch_size: expected int, got 'four'"),
    (["--config", "configs/tiny.yml"],
     "--config configs/tiny.yml: no such config file; did you mean configs/tiny.yaml?"),
    (["--config", "{tmp}/nope.yaml"], "--config {tmp}/nope.yaml: no such config file"),
])
def test_a_wrong_value_type_and_a_missing_config_are_refused_before_torch(words, line, tmp_path):
    """Judged from the text, in the parser's words, before torch, Lightning or diffusers is imported
    (the parser says the same: test_the_parser_says_what_the_check_before_it_says)."""
    (tmp_path / "typed.yaml").write_text("data:\n  batch_size: four\n")
    words = [w.replace("{tmp}", str(tmp_path)) for w in words]
    proc = subprocess.run([sys.executable, "-c", LIGHT, "predict", "--config", "configs/tiny.yaml", *words],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "exit 2 imported []" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "lightning-diffusion: error: " + line.replace("{tmp}", str(tmp_path))


def test_values_the_parser_takes_are_left_to_it():
    from lightning_diffusion.run.config_guard import value_problems

    taken = ["--model.height", "0x40", "--model.width", " 64", "--model.guidance_scale", ".inf", "--model.num_frames",
             "null", "--writer.save_arrays", "yes", "--data.batch_size", "1_000", "--trainer.enable_progress_bar", "~"]
    assert value_problems(["--config", "configs/tiny.yaml", *taken]) == []
    # the last value wins, as in the parser: a later flag mends an earlier one
    assert value_problems(["--model.height", "abc", "--model.height", "64"]) == []


@pytest.mark.parametrize("words", [["--model.height", "abc"], ["--data.batch_size", "1e3"],
                                   ["--trainer.num_nodes", "null"], ["--model.pad_batches", "1"],
                                   ["--model.num_inference_steps", "[4]"]])
def test_the_parser_says_what_the_check_before_it_says(words, capsys):
    from lightning_diffusion.run.config import read_config
    from lightning_diffusion.run.config_guard import value_problems

    (said,) = value_problems(["--config", "configs/tiny.yaml", *words])
    with pytest.raises(SystemExit):
        read_config("configs/tiny.yaml", words, check=False)
    assert capsys.readouterr().err.strip() == f"lightning-diffusion: error: {said}"
