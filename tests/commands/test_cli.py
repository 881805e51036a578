"""The CLI end to end on configs/tiny-flux.yaml, and make-tiny."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_diffusion.cli import main
from tests.conftest import REPO, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args


def test_tiny_config_writes_images_manifest_and_png_metadata(tmp_path):
    out = tmp_path / "out"
    proc = run_here(*tiny_args(out))
    # the summary's wall time counts from the writer's setup; the start-up before it is said beside it
    assert re.search(r"^start-up \d+\.\d s \(Python, imports, the config and its checks\), wall \d+\.\d s "
                     r"\(loading and the run\): \d+\.\d s from the command to its end$", proc.stderr, re.M), proc.stderr
    prompts = [line.strip() for line in (REPO / "configs/prompts/example.txt").read_text().splitlines() if line.strip()]
    lines = read_manifest_lines(out)
    assert [line["index"] for line in lines] == list(range(len(prompts))) and len(prompts) >= 8
    for line in lines:
        assert line["prompt"] == prompts[line["index"]]
        assert line["seed"] == line["index"]  # global seed 0 + index
        image = Image.open(out / line["file"])
        assert image.size == (64, 64)
        assert image.text["prompt"] == line["prompt"]
        assert image.text["seed"] == str(line["seed"])
        assert image.text["num_inference_steps"] == "4"
        assert image.text["guidance_scale"] == "3.5"
        assert (image.text["height"], image.text["width"]) == ("64", "64")
        assert image.text["model"] == "tiny:flux"
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".png") == sorted(line["file"] for line in lines)
    assert not list(out.glob(".*tmp*")) and not list(out.glob("manifest.part-*"))
    # Different prompts and seeds give different pictures.
    arrays = load_arrays(out)
    assert np.abs(arrays[0] - arrays[1]).max() > 0.05


def test_record_seed_and_overrides_reach_the_pipeline(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a cat", "seed": 42, "guidance_scale": 7.0}\n{"prompt": "a cat", "seed": 42}\n')
    out = tmp_path / "out"
    run_here(*tiny_args(out, "--data.prompts", str(prompts), "--data.batch_size", "2"))
    first, second = read_manifest_lines(out)
    assert (first["seed"], first["guidance_scale"]) == (42, 7.0)
    assert (second["seed"], second["guidance_scale"]) == (42, 3.5)
    arrays = load_arrays(out)
    assert np.abs(arrays[0] - arrays[1]).max() > 1e-3  # guidance changed the picture


def test_prompt_flags_stand_for_an_inline_prompt_list():
    from lightning_diffusion.cli import expand_prompts, process_started_at
    from lightning_diffusion.run.config import read_config

    words = expand_prompts(["predict", "--config", "configs/tiny.yaml", "--prompt", 'a "quoted" cat, on a mat',
                            "--prompt=a dog: brown"])
    assert words[:3] == ["predict", "--config", "configs/tiny.yaml"] and words[3] == "--data.prompts"
    assert read_config("configs/tiny.yaml", words[3:], check=False).data.prompts == [
        {"prompt": 'a "quoted" cat, on a mat'}, {"prompt": "a dog: brown"}]
    assert expand_prompts(["status", "--prompt", "x"]) == ["status", "--prompt", "x"]  # not a config command
    assert expand_prompts(["predict", "--config", "c.yaml"]) == ["predict", "--config", "c.yaml"]
    import time

    started = process_started_at()
    assert started is None or time.time() - 86400 * 7 < started <= time.time()


def test_make_tiny_writes_a_loadable_safetensors_pipeline(tmp_path):
    from diffusers import DiffusionPipeline

    for folder in ("a", "b"):
        with pytest.raises(SystemExit) as exit_info:
            main(["make-tiny", "flux", str(tmp_path / folder)])
        assert exit_info.value.code == 0
    assert list(Path(tmp_path / "a" / "transformer").glob("*.safetensors"))
    first = DiffusionPipeline.from_pretrained(tmp_path / "a")
    assert type(first).__name__ == "FluxPipeline"
    assert first.transformer.config.num_attention_heads % 4 == 0
    # Seeded: two builds hold the same weights.
    second = DiffusionPipeline.from_pretrained(tmp_path / "b")
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        a, b = getattr(first, name).state_dict(), getattr(second, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_help_lists_every_subcommand_with_one_line(capsys):
    from lightning_diffusion.commands import COMMANDS

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name, (_, summary) in COMMANDS.items():
        assert f"  {name}" in out and summary in out
    with pytest.raises(SystemExit) as exit_info:
        main(["predcit"])
    assert exit_info.value.code == 2 and "unknown command 'predcit'. Did you mean 'predict'?" in capsys.readouterr().err


def test_one_config_reader_takes_equals_and_nested_overrides(tmp_path):
    from lightning_diffusion.run.config import read_config

    prompts = tmp_path / "other.txt"
    prompts.write_text("a fox\n")
    config = read_config("configs/tiny-flux.yaml", [f"--data.prompts={prompts}",
                                               "--model.call_kwargs.max_sequence_length=32", "--trainer.devices", "2"])
    assert config.data.prompts == str(prompts)
    assert config.model.call_kwargs == {"max_sequence_length": 32}
    assert str(config.trainer.devices) == "2"


def _imports(module: str, tree: ast.AST, modules: set[str]) -> set[str]:
    """Package modules that ``module`` imports anywhere in its body (functions included)."""
    found = set()
    package = module if module + ".__init__" in modules else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules}


def test_the_package_has_no_import_cycle():
    root = REPO / "lightning_diffusion"
    files = {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in root.rglob("*.py")}
    modules = {name.removesuffix(".__init__") for name in files} | set(files)
    graph = {}
    for name, path in files.items():
        graph[name.removesuffix(".__init__")] = _imports(name.removesuffix(".__init__"), ast.parse(path.read_text()),
                                                         modules)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if target == node:
                continue
            assert state.get(target) != 1, "import cycle: " + " -> ".join(path[path.index(target):] + [target])
            if target not in state:
                visit(target, path + [target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_77():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "scripts/gpu-check"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 77, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == [
        "gpu-check: no CUDA GPU on this machine (torch.cuda.device_count() is 0); skipped."]


@pytest.mark.slow
def test_gpu_check_rehearsal_runs_every_one_gpu_check_on_the_cpu(tmp_path):
    """The script's plumbing (the wide random model, timed runs, image comparisons) on the CPU, so
    that the first GPU it meets does not spend its minutes on a typo."""
    report = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "scripts/gpu-check", "--rehearse", "--json", str(report)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = {row["check"]: row for row in json.loads(report.read_text())}
    assert {"data-parallel-vs-diffusers", "device-map-auto", "device-map-balanced", "staged", "compile-regional",
            "quantization-fp8", "quantization-int8", "first-block-cache", "ulysses-cuda", "ring-bf16-cuda",
            "tensor-parallel-cuda", "cfg-parallel-cuda", "mesh-cuda", "one-gpu-per-task",
            "cpu-tensor-parallel-on-a-gpu-machine",
            "device-map-own-gpus", "cuda-pipeline", "compile-ulysses-cuda", "compile-tp-cuda",
            "tile-parallel-decode-cuda", "tile-parallel-decode-cfg-cuda", "quantized-ulysses-cuda",
            "ulysses-whole-work-cuda", "tp-whole-work-cuda",
            "first-block-cache-ulysses-cuda", "first-block-cache-tp-cuda", "lora-tensor-parallel-cuda",
            "communicator-memory", "stuck-peer-nccl"} <= set(rows)
    ran = {name for name, row in rows.items() if row["result"] == "PASS"}
    assert ran == {"data-parallel-vs-diffusers", "device-map-auto", "staged", "compile-regional", "quantization-int8",
                   "first-block-cache"}, rows
    assert "| check | result | figure |" in proc.stdout


def test_call_kwargs_negative_prompt_is_the_default_of_records_without_one(tmp_path, cli_here):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a cat", "negative_prompt": "blurry"}\n{"prompt": "a cat"}\n')
    out = tmp_path / "out"
    args = tiny_args(out, "--data.prompts", str(prompts), "--data.batch_size", "2",
                     "--model.call_kwargs.true_cfg_scale", "2.0")
    run_here(*args, "--model.call_kwargs.negative_prompt", "ugly")
    first, second = read_manifest_lines(out)
    assert (first["negative_prompt"], second["negative_prompt"]) == ("blurry", "ugly")
    assert Image.open(out / second["file"]).text["negative_prompt"] == "ugly"
    proc = cli_here(*tiny_args(tmp_path / "list", "--model.call_kwargs.negative_prompt", '["a", "b"]'))
    assert proc.returncode == 2 and "model.call_kwargs.negative_prompt is the default negative prompt" in proc.stderr


def test_a_failed_run_ends_with_its_traceback_and_exit_1_without_the_interpreter_teardown():
    """The console script ends every run, failed ones too, with os._exit: at interpreter teardown
    torch's C++ threads now and then abort the process (exit -6 in place of 1)."""
    code = ("import atexit\nfrom lightning_diffusion import cli\n"
            "atexit.register(print, 'interpreter teardown')\n"
            "def fail():\n    raise RuntimeError('a failure')\n"
            "cli.main = fail\ncli.run()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 1
    assert "RuntimeError: a failure" in proc.stderr and "Traceback" in proc.stderr
    assert "interpreter teardown" not in proc.stdout



def test_predict_help_shows_this_projects_keys_first_and_help_all_everything(capsys):
    """Lightning's help lists its training options first (the project's keys started at line 482
    of 737); ours lists model, data, writer and the Trainer's inference keys, and points to
    --help-all, which keeps jsonargparse's whole help."""
    from lightning_diffusion.commands.predict import main as predict

    assert predict(["--help"]) == 0
    short = capsys.readouterr().out
    # a group's title line: its name and a colon first (a wrapped sentence may also end with a colon)
    titles = [line for line in short.splitlines() if re.match(r"[a-z]+:", line) and line.endswith(":")]
    assert [t.split(":")[0] for t in titles] == ["options", "model", "data", "writer", "trainer"], titles
    for hidden in ("--trainer.max_epochs", "--optimizer", "--lr_scheduler", "--trainer.gradient_clip_val",
                   "--ckpt_path"):
        assert hidden not in short
    for shown in ("--trainer.strategy ", "--trainer.devices, ", "--data.prompts, ", "--writer.output_dir ",
                  "default: tiny:shapes"):
        assert shown in short
    assert short.rstrip().endswith("--help-all shows every option, Lightning's training options included.")
    strategy = " ".join(short.split("--trainer.strategy ", 1)[1].split("\n  -", 1)[0].split())
    assert "ulysses" in strategy and "(default: data_parallel)" in strategy  # the project's names, not Lightning's
    assert "DeepSpeed" not in strategy and '"auto"' not in strategy
    assert predict(["--help-all"]) == 0
    every = capsys.readouterr().out
    assert "--trainer.max_epochs" in every and "--optimizer" in every and len(every) > 2 * len(short)


def test_predict_help_fits_a_screen_and_the_terminals_width(capsys, monkeypatch):
    """What a prediction run can use, wrapped to COLUMNS: no training callbacks, no Lightning seed
    beside data.seed, no reStructuredText."""
    from lightning_diffusion.commands.predict import main as predict

    monkeypatch.setenv("COLUMNS", "100")
    assert predict(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) < 260 and max(map(len, lines)) <= 100, (len(lines), max(map(len, lines)))
    text = "\n".join(lines)
    for hidden in ("EarlyStopping", "LearningRateFinder", "ModelCheckpoint", "--seed_everything", "``"):
        assert hidden not in text, hidden
    assert "--data.seed " in text and "--trainer.callbacks" in text
    monkeypatch.setenv("COLUMNS", "60")
    assert predict(["--help"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 60


def test_eval_help_is_plain_text_wrapped_to_the_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "* --fid: FID and KID" in out
    assert max(map(len, out.splitlines())) <= 100


def test_every_subcommand_takes_json_alone_for_stdout_and_json_file_for_a_file(tmp_path, cli_here):
    """One --json convention: alone, the JSON on stdout (parseable: nothing else there); with FILE,
    the file written beside the usual report."""
    out = tmp_path / "out"
    run_here(*tiny_args(out, "--data.prompts", "[a red circle, a blue star]", "--model.num_inference_steps", "2"))
    alone = cli_here("status", str(out), "--json")
    assert json.loads(alone.stdout)["complete"] is True
    to_file = cli_here("status", str(out), "--json", str(tmp_path / "status.json"))
    assert json.loads((tmp_path / "status.json").read_text())["complete"] is True
    assert "complete" in to_file.stdout and not to_file.stdout.lstrip().startswith("{")
    alone = cli_here("eval", str(out), "--json")
    assert json.loads(alone.stdout)["images"]
    before = cli_here("status", "--json", str(out))  # the folder after --json is still the folder
    assert json.loads(before.stdout)["complete"] is True and not (tmp_path / "-").exists()
    cli_here("status", "--json", str(tmp_path / "named.json"), str(out))
    assert json.loads((tmp_path / "named.json").read_text())["complete"] is True
    cli_here("eval", str(out), f"--json={tmp_path / 'eval.json'}")
    assert json.loads((tmp_path / "eval.json").read_text())["images"]


@pytest.mark.slow
def test_the_python_api_starts_quietly_in_the_readmes_import_order():
    """The README's script imports Lightning first, and Lightning imports transformers, which reads
    TRANSFORMERS_VERBOSITY at its import: the package sets transformers' level itself then. Its
    start-up notices (image processors without torchvision) show with LIGHTNING_DIFFUSION_VERBOSE=1."""
    script = ("from lightning.pytorch import Trainer\n"
              "from lightning_diffusion import DiffusionModule\n"
              "DiffusionModule('tiny:shapes')\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VERBOSITY")}

    def stderr(**extra):
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**env, **extra}, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    assert "[transformers]" not in stderr()
    if "[transformers]" not in stderr(LIGHTNING_DIFFUSION_VERBOSE="1"):
        pytest.skip("transformers says nothing at start-up here (torchvision installed): nothing to hide")


@pytest.mark.slow
def test_verbose_shows_the_libraries_messages_but_not_lightning_clis_warning_about_our_own_call(tmp_path):
    """``--verbose`` keeps third-party start-up messages; LightningCLI's warning that it was given
    args while sys.argv has words is about this package's own call (by design), so it is never shown."""
    proc = run_cli("--verbose", "predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(tmp_path),
                   "--data.prompts", '["a red circle on a white background"]')
    assert "LightningCLI's args parameter" not in proc.stderr, proc.stderr[-2000:]
    assert "made 1 output" in proc.stderr


def test_a_misspelt_tiny_pipeline_is_refused_with_the_nearest_name(cli_here):
    proc = cli_here("predict", "--config", str(REPO / "configs/tiny.yaml"),
                    "--model.pretrained_model_name_or_path", "tiny:shape")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("Unknown tiny pipeline 'tiny:shape' (did you mean 'tiny:shapes'?); choose one of: tiny:shapes, "
            "tiny:flux") in proc.stderr
