"""What an output folder is trusted for: a manifest line counts only for a regular file (not a
link) or a tar member inside the folder, named as the writer names that output, with the size it
recorded; a line cut anywhere does not count; ``eval`` names what it cannot read instead of dying;
a rerun removes the temporary files a killed run left (its own names only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import read_manifest_lines, run_here, tiny_args

PROMPTS = ["--data.prompts", "[a red circle, a blue square, a green star]", "--model.num_inference_steps", "2",
           "--model.height", "32", "--model.width", "32", "--data.batch_size", "1"]


def made(out: Path, *extra: str):
    return run_here(*tiny_args(out, *PROMPTS, *extra))


def rewrite_manifest(out: Path, change) -> None:
    manifest = out / "manifest.jsonl"
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in change(lines)))


def test_a_link_in_place_of_an_image_does_not_count_even_with_the_recorded_size(tmp_path):
    made(tmp_path)
    first = read_manifest_lines(tmp_path)[0]
    target = tmp_path.parent / "elsewhere.bin"
    target.write_bytes(b"x" * first["bytes"])
    image = tmp_path / first["file"]
    image.unlink()
    image.symlink_to(target)
    status = run_here("status", str(tmp_path), check=False)
    assert "2 of 3" in status.stdout and "not the size recorded" in status.stdout, status.stdout
    rerun = made(tmp_path)
    assert "resumed: 2 already in the manifest" in rerun.stdout + rerun.stderr
    assert not image.is_symlink() and image.stat().st_size == read_manifest_lines(tmp_path)[0]["bytes"]


def test_a_line_naming_another_file_or_a_member_outside_the_shard_does_not_count(tmp_path):
    made(tmp_path)

    def point_elsewhere(lines):
        run_json = tmp_path / "run.json"
        lines[0] = {**lines[0], "file": "run.json", "bytes": run_json.stat().st_size}
        lines[1] = {"index": 1, "prompt": lines[1]["prompt"], "seed": lines[1]["seed"], "file": "shard-000000000.tar",
                    "member": "../../etc/passwd", "bytes": 10, "shard_bytes": 10, "written": lines[1]["written"]}
        return lines

    rewrite_manifest(tmp_path, point_elsewhere)
    (tmp_path / "shard-000000000.tar").write_bytes(b"x" * 10)
    status = run_here("status", str(tmp_path), check=False)
    assert "1 of 3" in status.stdout, status.stdout
    assert "'run.json' is not what the writer names output" in status.stdout
    assert "'shard-000000000.tar member ../../etc/passwd' is not what the writer names output" in status.stdout
    rerun = made(tmp_path)
    assert "resumed: 1 already in the manifest" in rerun.stdout + rerun.stderr


def test_a_line_cut_in_the_middle_of_the_manifest_does_not_count_and_eval_names_no_traceback(tmp_path):
    made(tmp_path)
    manifest = tmp_path / "manifest.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    cut = lines[1].rsplit(", ", 1)[0] + "}\n"  # its fields up to the size, the rest cut, the newline kept
    manifest.write_text(lines[0] + lines[1][:len(lines[1]) // 2] + "\n" + lines[2])
    status = run_here("status", str(tmp_path), check=False)
    assert "2 of 3" in status.stdout and "manifest.jsonl:2: not a manifest line" in status.stdout, status.stdout
    manifest.write_text(lines[0] + cut.replace('"written"', '"written') + lines[2])  # ends in a brace, not JSON
    status = run_here("status", str(tmp_path), check=False)
    assert "2 of 3" in status.stdout or "3 of 3" in status.stdout  # status reads sizes, eval reads the line:
    evaluated = run_here("eval", str(tmp_path), check=False)
    assert "Traceback" not in evaluated.stdout + evaluated.stderr and "JSONDecodeError" not in evaluated.stderr


def test_eval_names_a_recorded_file_that_is_not_an_image(tmp_path):
    made(tmp_path)
    first = read_manifest_lines(tmp_path)[0]
    (tmp_path / first["file"]).write_bytes(b"n" * first["bytes"])  # the size recorded, not a PNG
    os.utime(tmp_path / first["file"], (first["written"], first["written"]))  # and its time kept (a bad disk):
    # what a resume's size and time cannot tell, eval reads
    evaluated = run_here("eval", str(tmp_path), check=False)
    assert evaluated.returncode == 2, evaluated.stderr[-2000:]
    assert f"{first['file']} (image 0) is not a readable image" in evaluated.stderr
    assert "Traceback" not in evaluated.stderr


def test_a_rerun_removes_the_temporary_files_of_a_killed_run_and_nothing_else(tmp_path):
    made(tmp_path)
    left = [tmp_path / ".000001-a-blue-square.png.tmp-4242-0123456789ab",
            tmp_path / ".shard-000000000.tar.tmp-4242-0123456789ab", tmp_path / ".run.json.tmp-4242-00000000ffff"]
    kept = [tmp_path / ".my-notes.tmp", tmp_path / "notes.tmp-4242-0123456789ab", tmp_path.parent / "keep.txt"]
    for path in left + kept:
        path.write_bytes(b"half")
    (tmp_path / read_manifest_lines(tmp_path)[2]["file"]).unlink()  # something left to make: the run starts
    rerun = made(tmp_path)
    assert "removed 3 half-written temporary files of an earlier run" in rerun.stdout + rerun.stderr
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept)


def test_a_job_array_task_removes_only_its_own_shards_temporary_files(tmp_path):
    mine = tmp_path / ".000001-b.png.tmp-1-0123456789ab"  # image 1: shard 1 of 2
    theirs = tmp_path / ".000000-a.png.tmp-1-0123456789ab"  # image 0: shard 0, maybe being written now
    shared = tmp_path / ".run.json.tmp-1-0123456789ab"
    tmp_path.mkdir(exist_ok=True)
    for path in (mine, theirs, shared):
        path.write_bytes(b"half")
    made(tmp_path, "--data.num_shards", "2", "--data.shard_index", "1")
    assert not mine.exists() and theirs.exists() and shared.exists()
    assert os.path.isdir(tmp_path)


def test_a_config_that_is_not_one_is_refused_without_quoting_its_content(tmp_path, cli_here):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$very-secret-hash:20228:0:99999:7:::\n")
    for flag in ("--config", "-c"):
        proc = cli_here("predict", flag, str(secret))
        assert proc.returncode == 2
        assert f"{secret} is not a config: its top level is not a mapping" in proc.stderr
        assert "very-secret" not in proc.stdout + proc.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  height: 64\n   width: [oops\n")
    proc = cli_here("predict", "--config", str(broken))
    assert proc.returncode == 2 and "is not valid YAML at line 3" in proc.stderr and "oops" not in proc.stderr


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, cli_here):
    levels = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for name, previous in zip("bcdefghi", "abcdefgh"):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\nmodel:\n  call_kwargs: {x: *i}\n")  # 9^9 values once expanded
    proc = cli_here("predict", "--config", str(bomb))
    assert proc.returncode == 2 and "aliases expand to more than 100,000 values" in proc.stderr


def test_a_class_path_outside_the_known_packages_is_refused_before_it_is_imported(tmp_path, cli_here, monkeypatch):
    import sys

    (tmp_path / "payload_module.py").write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for words in (["--trainer.strategy.class_path", "payload_module.S"],
                  ["--trainer.strategy", '{"class_path": "payload_module.S"}'],
                  ["--trainer.callbacks+=payload_module.C"], ["--trainer.callbacks", "[payload_module.C]"]):
        proc = cli_here("predict", "--config", "configs/tiny.yaml", *words)
        assert proc.returncode == 2 and "names a class of module 'payload_module'" in proc.stderr, proc.stderr
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: payload_module.C\n    - payload_module.D\n")
    proc = cli_here("predict", "-c", str(config))
    assert proc.returncode == 2 and "trainer.callbacks[0].class_path" in proc.stderr
    assert "trainer.callbacks names a class of module 'payload_module'" in proc.stderr  # the shorthand too
    assert not (tmp_path / "ran").exists() and "payload_module" not in sys.modules


def test_bounds_on_what_a_user_controls_are_checked_before_loading(tmp_path, cli_here):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red circle"}) + "\n" + json.dumps({"prompt": "x" * 10_000_000}) + "\n")
    cases = [
        (["--data.prompts", str(prompts)], f"{prompts}:2: 'prompt' has 10,000,000 characters, over "
                                           "data.max_prompt_chars 20,000"),
        (["--model.height", "100000"], "a side of 100,000 pixels is over 16,384"),
        (["--model.pretrained_model_name_or_path", "tiny:sd3", "--model.call_kwargs", "{}", "--model.height", "2048"],
         "StableDiffusion3Pipeline's transformer places at most 1,024 pixels per side"),
        (["--model.call_kwargs", '{"latents": "x", "callback_on_step_end": "os.system"}'],
         "callback_on_step_end takes Callable objects, which a config cannot give"),
        (["--writer.output_dir", ""], "writer.output_dir must name a folder, got ''"),
    ]
    for words, message in cases:
        proc = cli_here("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(tmp_path / "out"),
                        *words)
        assert proc.returncode == 2 and message in proc.stderr, (words, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    skipped = cli_here("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(tmp_path / "skip"),
                       "--data.prompts", str(prompts), "--data.on_bad_record", "skip", "--model.num_inference_steps",
                       "1")
    assert skipped.returncode == 0  # the long record costs one record
    assert "max_prompt_chars" in (tmp_path / "skip" / "rejected.jsonl").read_text()
