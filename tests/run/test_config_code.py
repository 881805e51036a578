"""A config names classes and functions of the allowed modules only, judged from its text before
anything it names is imported: a class's arguments (``init_args``, given in a file, inline or as
flags) may not name a function elsewhere (``on_predict_start: os.system``), LambdaCallback is
refused by name, and a group read from a file (``--trainer FILE``) is checked as a config is."""

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_diffusion.run.config_guard import words_problems

ROOT = Path(__file__).resolve().parents[2]
LAMBDA = "lightning.pytorch.callbacks.LambdaCallback"
MONITOR = "lightning.pytorch.callbacks.ThroughputMonitor"

# The command in a fresh interpreter; what it printed, its exit code and whether module ``this``
# (which prints the Zen of Python when imported) was imported.
CODE = ("import sys\nfrom lightning_diffusion import cli\ntry:\n    cli.main(sys.argv[1:])\n"
        "except SystemExit as e:\n    print('exit', e.code, 'this imported:', 'this' in sys.modules)\n")


def run_command(*words):
    return subprocess.run([sys.executable, "-c", CODE, *words], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def one_line(proc, message):
    assert "exit 2 this imported: False" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "The Zen of Python" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-diffusion: error: "), proc.stderr[-3000:]
    assert message in lines[0], lines[0]


@pytest.mark.parametrize("argument", ["os.system", "this.s"])
def test_lambda_callback_is_refused_before_anything_it_names_is_imported(argument, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"trainer:\n  callbacks:\n    - class_path: {LAMBDA}\n      init_args:\n"
                      f"        on_predict_start: {argument}\n")
    one_line(run_command("predict", "--config", "configs/tiny.yaml", "--config", str(config)),
             "trainer.callbacks[0].class_path: LambdaCallback calls the functions its arguments name, which a "
             "config may not do")


def test_a_function_outside_the_allowed_modules_is_refused_in_any_classs_arguments(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"trainer:\n  callbacks:\n    - class_path: {MONITOR}\n      init_args:\n"
                      "        batch_size_fn: this.s\n")
    one_line(run_command("predict", "--config", "configs/tiny.yaml", "--config", str(config)),
             "trainer.callbacks[0].init_args.batch_size_fn names 'this.s' of module 'this', which is not imported "
             "for a config")


def test_a_group_read_from_a_file_is_checked_as_a_config_is(tmp_path):
    group = tmp_path / "trainer.yaml"
    group.write_text("callbacks:\n  - class_path: this.s\n")
    one_line(run_command("predict", "--config", "configs/tiny.yaml", "--trainer", str(group)),
             "trainer.callbacks[0].class_path names a class of module 'this', which is not imported for a config")


@pytest.mark.parametrize("words, message", [
    (["--trainer.callbacks+=LambdaCallback"], "trainer.callbacks: LambdaCallback calls the functions"),
    (["--trainer.callbacks", f"[{{class_path: {LAMBDA}}}]"], "trainer.callbacks[0].class_path: LambdaCallback"),
    ([f"--trainer.callbacks+={MONITOR}", "--trainer.callbacks.batch_size_fn=os.system"],
     "trainer.callbacks.batch_size_fn names 'os.system' of module 'os'"),
    ([f"--trainer.callbacks+={MONITOR}", "--trainer.callbacks.init_args.batch_size_fn", "builtins.exec"],
     "trainer.callbacks.init_args.batch_size_fn names 'builtins.exec' of module 'builtins'"),
    (["--trainer.callbacks", f'{{"class_path": "{MONITOR}", "init_args": {{"batch_size_fn": "this.s"}}}}'],
     "trainer.callbacks.init_args.batch_size_fn names 'this.s'"),
])
def test_flags_are_held_to_the_same_rule(words, message):
    problems = words_problems(["--config", "configs/tiny.yaml", *words])
    assert len(problems) == 1 and message in problems[0], problems
    assert "this" not in sys.modules


def test_what_the_allowed_modules_define_and_plain_values_pass():
    assert words_problems(["--config", "configs/tiny.yaml", f"--trainer.callbacks+={MONITOR}",
                           "--trainer.callbacks.batch_size_fn=torch.numel", "--trainer.strategy.init_args.x",
                           "out.png", "--trainer.callbacks.init_args.path", "/tmp/a.b"]) == []


def test_a_name_the_text_check_passes_is_checked_again_by_the_parser_where_it_is_defined(tmp_path, cli_here):
    """``torch.os.system`` starts with an allowed module's name; the parser's own import check
    (jsonargparse's allowlist) finds where it is defined: os, refused in one line."""
    config = tmp_path / "c.yaml"
    config.write_text(f"trainer:\n  callbacks:\n    - class_path: {MONITOR}\n      init_args:\n"
                      "        batch_size_fn: torch.os.system\n")
    proc = cli_here("predict", "--config", "configs/tiny.yaml", "--config", str(config), "--writer.output_dir",
                    str(tmp_path / "out"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "trainer.callbacks names 'torch.os.system' of module 'posix', which is not imported for a config" in lines[0]
