"""Records by allow-list: every bad record is named before anything loads, ``data.on_bad_record:
skip`` makes the others, ``data.on_error: skip`` turns a failing pipeline call into its records'
lines in ``failed.jsonl``, and a manifest is checked when it is read."""

import json
import subprocess
import sys
import textwrap

import diffusers
import numpy as np
import pytest
import torch

from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
from lightning_diffusion.core.errors import ConfigError, RecordFailure
from lightning_diffusion.input.formats import read_records
from lightning_diffusion.input.record_checks import check_records
from lightning_diffusion.output.recorded import finished, scan_manifest
from lightning_diffusion.pipelines.checks import CALL_ARGS, call_arg_problems, record_args, record_keys
from lightning_diffusion.pipelines.model_folder import PipelineInfo
from lightning_diffusion.pipelines.specs import SPECS
from tests.conftest import REPO, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args

NAN_RECORD = '{"prompt": "x", "guidance_scale": NaN}'


def test_every_bad_line_is_named_up_to_twenty_then_counted(tmp_path):
    lines = ['{"prompt": "fine"}'] + [f'{{"prompt": "bad {n}", "num_inference_steps": 0}}' for n in range(24)]
    lines.insert(3, "")  # a blank line: numbers stay the file's lines
    lines.insert(5, '{"prompt": ')
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        PromptDataModule(str(path))
    assert f"{path}:6: not valid JSON" in str(err.value)  # read errors: the data module refuses at once
    records = read_records(str(path))
    verdicts = check_records(DiffusionModule("tiny:flux").info, records)
    report = verdicts.report()
    assert report.startswith("25 prompt records cannot be made (data.on_bad_record: skip makes the others")
    assert f"{path}:2: num_inference_steps must be an integer from 1 to 1,000, got 0." in report
    assert f"{path}:3:" in report and f"{path}:4:" not in report and f"{path}:5:" in report
    assert report.count(f"{path}:") == 20 and report.endswith("... and 5 more")
    assert 0 not in verdicts.rejected and len(verdicts.rejected) == 25


def _info(name: str) -> PipelineInfo:
    cls = getattr(diffusers, name)
    return PipelineInfo(f"tiny:{name}", name, cls, {"_class_name": name})


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_record_may_set_only_its_specs_arguments_for_every_registered_pipeline(name):
    info = _info(name)
    allowed = record_args(info)
    assert allowed and set(allowed) <= set(CALL_ARGS) and set(allowed) <= info.call_parameters
    outside = sorted(info.call_parameters - set(allowed) - {"prompt", "negative_prompt", "image", "mask_image",
                                                            "last_image"})
    assert "latents" in outside and "output_type" in outside and "callback_on_step_end" in outside
    for key in outside:
        problems = call_arg_problems(info, {key: 1}, record=True)
        assert problems and problems[0].startswith(f"{key}: not something a record may set; a {name} record may "
                                                   f"have {', '.join(record_keys(info))}."), (key, problems)
    good = {"num_inference_steps": 8, "guidance_scale": 2.5}
    assert call_arg_problems(info, {k: v for k, v in good.items() if k in allowed}, record=True) == []


def test_records_out_of_bounds_are_named_with_what_is_allowed():
    info = DiffusionModule("tiny:flux").info
    cases = {
        "num_inference_steps": (1001, "num_inference_steps must be an integer from 1 to 1,000, got 1001."),
        "guidance_scale": (float("inf"), "guidance_scale must be a finite number, got inf."),
        "true_cfg_scale": (-1, "true_cfg_scale must be in [0, 100], got -1."),
        "max_sequence_length": (True, "max_sequence_length must be an integer from 1 to 512, got True."),
        "height": (72, "height=72 cannot be made by FluxPipeline: use a positive multiple of 16 (for example 64)."),
    }
    for key, (value, message) in cases.items():
        assert call_arg_problems(info, {key: value}, record=True) == [message]


def test_skipped_records_keep_the_others_indices_and_are_not_retried_on_resume(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(['{"prompt": "a fox"}', NAN_RECORD, '{"prompt": "a cat", "latents": 1}',
                                  '{"prompt": "a dog"}', '{"prompt": ']) + "\n")
    out = tmp_path / "out"
    args = tiny_args(out, "--data.prompts", str(prompts), "--data.on_bad_record", "skip", "--model.height", "64",
                     "--model.width", "64")
    proc = run_here(*args)
    assert "made 2 outputs, 0 skipped by resume, 3 rejected (rejected.jsonl)" in proc.stderr
    assert sorted(line["index"] for line in read_manifest_lines(out)) == [0, 3]
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["record"], r["line"], r["images"]) for r in rejected] == [
        (2, f"{prompts}:2", [1]), (3, f"{prompts}:3", [2]), (5, f"{prompts}:5", [4])]
    assert rejected[0]["reason"] == "guidance_scale is not a finite number (NaN and Infinity are refused)."
    summary = json.loads((out / "run.json").read_text())["history"][-1]
    assert summary["rejected"] == 3 and summary["made"] == 2
    # The other records' images are the ones a clean set of them makes (same indices, same seeds).
    clean = tmp_path / "clean.jsonl"
    clean.write_text("\n".join(['{"prompt": "a fox"}', '{"prompt": "x"}', '{"prompt": "x"}', '{"prompt": "a dog"}',
                                '{"prompt": "x"}']) + "\n")
    run_here(*tiny_args(tmp_path / "clean", "--data.prompts", str(clean), "--model.height", "64",
                        "--model.width", "64"))
    ours, ref = load_arrays(out), load_arrays(tmp_path / "clean")
    assert all(np.array_equal(ours[i], ref[i]) for i in (0, 3))
    status = run_here("status", str(out))
    assert "complete" in status.stdout and "rejected: 3 images of records that cannot be made" in status.stdout
    again = run_here(*args)
    assert "made 0 outputs, 2 skipped by resume, 3 rejected" in again.stderr


def test_every_record_rejected_refuses_the_run_even_with_skip(tmp_path, cli_here):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(NAN_RECORD + "\n")
    proc = cli_here(*tiny_args(tmp_path / "out", "--data.prompts", str(prompts), "--data.on_bad_record", "skip"))
    assert proc.returncode == 2 and "every prompt record is rejected: 1 prompt record cannot be made" in proc.stderr


class FailingModule(DiffusionModule):
    """Fault injection at the pipeline-call boundary: the images in ``fail`` raise while their call
    is prepared (an input that cannot be decoded, say); ``oom_above``: calls of more samples raise
    torch's out-of-memory error, as a GPU would for too large a batch."""

    fail: set = set()
    oom_above: int = 0
    calls: list = []

    def prepare_call(self, samples):
        hit = sorted(s["index"] for s in samples if s["index"] in self.fail and not s.get("padding"))
        if hit:
            raise OSError(f"image file is truncated (images {hit})")
        return super().prepare_call(samples)

    def generate(self, samples, agree=False):
        type(self).calls.append(len(samples))
        if self.oom_above and len(samples) > self.oom_above:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore text")
        return super().generate(samples, agree=agree) if agree else super().generate(samples)


def _predict(module, out, on_error, prompts, batch_size=2):
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, strategy="data_parallel", logger=False, enable_progress_bar=False,
                      callbacks=[ImageWriter(str(out), save_arrays=True, write_workers=0)])
    trainer.predict(module, datamodule=PromptDataModule(prompts, batch_size=batch_size, on_error=on_error))
    return trainer


PROMPTS = [f"prompt {n}" for n in range(6)]


def test_a_failed_call_goes_to_failed_jsonl_and_a_rerun_retries_exactly_those(tmp_path):
    FailingModule.fail = {3}
    _predict(FailingModule("tiny:flux", height=64, width=64, num_inference_steps=2), tmp_path / "out", "skip", PROMPTS)
    failed = [json.loads(line) for line in (tmp_path / "out" / "failed.jsonl").read_text().splitlines()]
    assert [(f["index"], f["record"]) for f in failed] == [(2, "inline prompts:3"), (3, "inline prompts:4")]
    assert failed[0]["error"] == "OSError: image file is truncated (images [3])"
    assert sorted(line["index"] for line in read_manifest_lines(tmp_path / "out")) == [0, 1, 4, 5]
    assert json.loads((tmp_path / "out" / "run.json").read_text())["history"][-1]["failed"] == 2
    FailingModule.fail = set()
    FailingModule.calls = []
    _predict(FailingModule("tiny:flux", height=64, width=64, num_inference_steps=2), tmp_path / "out", "skip", PROMPTS)
    assert FailingModule.calls == [2]  # one call: images 2 and 3, nothing else
    assert not (tmp_path / "out" / "failed.jsonl").read_text()
    _predict(DiffusionModule("tiny:flux", height=64, width=64, num_inference_steps=2), tmp_path / "clean", "fail",
             PROMPTS)
    ours, ref = load_arrays(tmp_path / "out"), load_arrays(tmp_path / "clean")
    assert sorted(ours) == list(range(6)) and all(np.array_equal(ours[i], ref[i]) for i in range(6))


def test_with_on_error_fail_a_failed_call_stops_the_run_naming_its_records(tmp_path):
    FailingModule.fail = {3}
    with pytest.raises(RecordFailure, match=r"images 2 \(inline prompts:3\), 3 \(inline prompts:4\) failed: OSError: "
                                            r"image file is truncated"):
        _predict(FailingModule("tiny:flux", height=64, width=64, num_inference_steps=2), tmp_path / "out", "fail",
                 PROMPTS)
    FailingModule.fail = set()


def test_out_of_memory_retries_the_batch_one_record_at_a_time(tmp_path):
    FailingModule.oom_above, FailingModule.calls = 1, []
    try:
        _predict(FailingModule("tiny:flux", height=64, width=64, num_inference_steps=2), tmp_path / "out", "skip",
                 PROMPTS[:3])
    finally:
        FailingModule.oom_above = 0
    # batch [0, 1]: out of memory, then 0 and 1 alone (unpadded); batch [2]: fits
    assert FailingModule.calls == [2, 1, 1, 1]
    assert sorted(line["index"] for line in read_manifest_lines(tmp_path / "out")) == [0, 1, 2]
    assert not (tmp_path / "out" / "failed.jsonl").exists()
    FailingModule.oom_above, FailingModule.calls = 0, []
    # A record that does not fit alone either is a failure of its own.
    FailingModule.oom_above = -1  # every call
    try:
        _predict(FailingModule("tiny:flux", height=64, width=64, num_inference_steps=2), tmp_path / "none", "skip",
                 PROMPTS[:2])
    finally:
        FailingModule.oom_above = 0
    failed = [json.loads(line) for line in (tmp_path / "none" / "failed.jsonl").read_text().splitlines()]
    assert [f["error"] for f in failed] == ["OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"] * 2


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    """tiny:flux with a NaN weight in its transformer's output layer: every image it makes is NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lightning_diffusion.pipelines import tiny

    folder = tmp_path_factory.mktemp("nan") / "flux"
    shutil.copytree(tiny.resolve("tiny:flux"), folder)
    file = next((folder / "transformer").glob("*.safetensors"))
    weights = load_file(str(file))
    weights["proj_out.weight"][0, 0] = float("nan")
    save_file(weights, str(file))
    return folder


def test_an_image_of_nan_pixels_is_a_failure_not_a_finished_image(nan_model, tmp_path):
    args = ["--model.pretrained_model_name_or_path", str(nan_model), "--data.prompts", "[a, b, c]"]
    proc = run_here(*tiny_args(tmp_path / "skip", *args, "--data.on_error", "skip"))
    assert "made 0 outputs, 0 skipped by resume, 3 failed (failed.jsonl)" in proc.stderr
    assert read_manifest_lines(tmp_path / "skip") == [] and not list((tmp_path / "skip").glob("*.png"))
    failed = [json.loads(line) for line in (tmp_path / "skip" / "failed.jsonl").read_text().splitlines()]
    assert [f["index"] for f in failed] == [0, 1, 2] and all("NaN or infinite pixels" in f["error"] for f in failed)
    with pytest.raises(RecordFailure, match=r"image 0 \(inline prompts:1\) failed: the image has NaN"):
        run_here(*tiny_args(tmp_path / "fail", *args))
    assert not list((tmp_path / "fail").glob("*.png"))


@pytest.mark.slow
def test_a_failed_record_ends_the_cli_with_one_line_and_exit_1(nan_model, tmp_path):
    proc = run_cli(*tiny_args(tmp_path / "out", "--model.pretrained_model_name_or_path", str(nan_model),
                              "--data.prompts", "[a, b]"), check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "lightning-diffusion: error: image 0 (inline prompts:1) failed: the image has NaN" in proc.stderr
    assert "Traceback" not in proc.stderr


# A script run as its own command (Lightning starts the other rank by running it again): rank 1
# fails while preparing the call of image 3, under each strategy; the replica's ranks must agree.
GROUP_SCRIPT = textwrap.dedent('''
    import sys
    from lightning.pytorch import Trainer
    from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
    from lightning_diffusion.strategies import ContextParallelStrategy, DataParallelStrategy

    class RankFails(DiffusionModule):
        def prepare_call(self, samples):
            if self.global_rank == 1 and any(s["index"] == 3 for s in samples) and sys.argv[3] == "fault":
                raise OSError("cannot decode the input on this rank")
            return super().prepare_call(samples)

    strategy = ContextParallelStrategy(ulysses_degree=2, timeout=60) if sys.argv[2] == "ulysses" else \\
        DataParallelStrategy(timeout=60)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                      callbacks=[ImageWriter(sys.argv[1], save_arrays=True, write_workers=0)])
    trainer.predict(RankFails("tiny:flux", height=64, width=64, num_inference_steps=2),
                    datamodule=PromptDataModule([f"prompt {n}" for n in range(6)], batch_size=1, on_error="skip"),
                    return_predictions=False)
''')


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ulysses", "data_parallel"])
def test_a_failure_on_one_rank_is_agreed_and_the_rerun_ends_bit_identical(layout, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(GROUP_SCRIPT)

    def run(out, fault):
        proc = subprocess.run([sys.executable, str(script), str(out), layout, fault], cwd=REPO, capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(tmp_path / "out", "fault")
    failed = [json.loads(line) for line in (tmp_path / "out" / "failed.jsonl").read_text().splitlines()]
    assert [(f["index"], f["error"]) for f in failed] == [(3, "OSError: cannot decode the input on this rank")]
    assert sorted(line["index"] for line in read_manifest_lines(tmp_path / "out")) == [0, 1, 2, 4, 5]
    run(tmp_path / "out", "none")
    assert sorted(line["index"] for line in read_manifest_lines(tmp_path / "out")) == list(range(6))
    run(tmp_path / "clean", "none")
    ours, ref = load_arrays(tmp_path / "out"), load_arrays(tmp_path / "clean")
    assert all(np.array_equal(ours[i], ref[i]) for i in range(6))


def test_a_manifest_is_checked_when_it_is_read(tmp_path):
    for name in ("000000-a.png", "000001-b.png", "000002-c.png", "000002-d.png"):
        (tmp_path / name).write_bytes(b"png")
    (tmp_path.parent / "outside.png").write_bytes(b"png")
    lines = [{"index": 0, "file": "000000-a.png", "bytes": 3},
             {"index": 1, "file": "000001-b.png", "bytes": 4},          # another size than recorded
             {"index": 2, "file": "000002-c.png", "bytes": 3},
             {"index": 2, "file": "000002-d.png", "bytes": 3},          # one index, two files
             {"index": 3, "file": "../outside.png", "bytes": 3},        # outside the folder
             {"index": 4, "file": str(tmp_path / "000000-a.png"), "bytes": 3}]  # absolute
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    entries, problems = scan_manifest(tmp_path)
    assert sorted(entries) == [0]
    assert problems == ["manifest.jsonl:2: '000001-b.png' is missing or not the size recorded",
                        "manifest.jsonl:5: '../outside.png' is outside the output folder",
                        f"manifest.jsonl:6: '{tmp_path}/000000-a.png' is outside the output folder",
                        "manifest.jsonl:4: image 2 is also '000002-c.png' (manifest.jsonl:3); neither counts"]
    found = finished(tmp_path)  # the compact reading of resume and status: the same verdicts
    assert found.indices.tolist() == [0]
    assert found.problems[:3] == problems[:3]
    assert found.problems[3] == ("manifest.jsonl:4: image 2 is also in manifest.jsonl:3 with another file; "
                                 "neither counts")
    status = run_here("status", str(tmp_path), check=False)
    assert "not counted: manifest.jsonl:4: image 2 is also in manifest.jsonl:3 with another file" in status.stdout
    assert "not counted: manifest.jsonl:5: '../outside.png' is outside the output folder" in status.stdout


def test_records_of_a_csv_and_an_inline_list_name_their_lines(tmp_path):
    csv = tmp_path / "p.csv"
    csv.write_text('prompt,seed,guidance_scale\na cat,5,\n"a ""quoted""\ndog",x,\nfine,,2\n')
    records = read_records(str(csv))
    assert records.bad == {1: (f"{csv}:4", "'seed' must be an integer from 0 to 2**64 - 1, got 'x'.")}
    assert [r["prompt"] for _, r in records.accepted()] == ["a cat", "fine"]
    inline = read_records(["a", {"prompt": "b", "seed": -1}])
    assert inline.bad == {1: ("inline prompts:2", "'seed' must be an integer from 0 to 2**64 - 1, got -1.")}


def test_a_clean_jsonl_reads_as_before(tmp_path):
    """No per-record cost where nothing is wrong: the summary counts one set per distinct override."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{n}", "guidance_scale": 2.0 + n % 2}) + "\n" for n in range(100)))
    records = read_records(str(path))
    assert len(records) == 100 and not records.bad
    assert [o for _, o in records.summary.override_sets()] == [{"guidance_scale": 2.0}, {"guidance_scale": 3.0}]
    assert not check_records(DiffusionModule("tiny:flux").info, records)


@pytest.mark.slow
def test_skipped_records_under_two_replicas_are_the_ones_rank_zero_found(tmp_path):
    """The ranks the CLI starts trust its checks; with skip, rank 0's verdicts reach every rank."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join([f'{{"prompt": "p{n}"}}' if n % 3 else NAN_RECORD for n in range(9)]) + "\n")
    out = tmp_path / "out"
    proc = run_cli(*tiny_args(out, "--data.prompts", str(prompts), "--data.on_bad_record", "skip",
                              "--trainer.devices", "2", "--model.height", "64", "--model.width", "64"))
    assert "3 rejected (rejected.jsonl)" in proc.stdout + proc.stderr
    indices = [line["index"] for line in read_manifest_lines(out)]
    assert sorted(indices) == [1, 2, 4, 5, 7, 8] and len(indices) == len(set(indices))
    assert [json.loads(line)["record"] for line in (out / "rejected.jsonl").read_text().splitlines()] == [1, 4, 7]


def test_the_reading_pass_judges_each_line_as_check_record_does(tmp_path):
    """Most lines of a large set are a prompt and a seed, and the reading pass checks those in a
    few steps of its own: every edge of those steps (Unicode whitespace, lengths at the limit, seeds
    at the bounds, of other types, near the generator's limit) gets check_record's verdict, in a
    .jsonl file and in Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_diffusion.input.records import PromptFileError, check_record

    limit = 2 ** 64 - 1
    items = [{"prompt": "a cat"}, {"prompt": "a cat", "seed": 0}, {"prompt": "a cat", "seed": limit},
             {"prompt": "a cat", "seed": limit + 1}, {"prompt": "a cat", "seed": -1}, {"prompt": "a cat", "seed": True},
             {"prompt": "a cat", "seed": 1.0}, {"prompt": "a cat", "seed": None}, {"prompt": "\u3000\u2003"},
             {"prompt": ""}, {"prompt": " \t"}, {"prompt": "x" * 12}, {"prompt": "x" * 13}, {"prompt": 7},
             {"prompt": "a cat", "seed": limit // 2 + 1}, {"prompt": "a cat", "seed": 3, "height": 64},
             {"prompt": "a cat", "negative_prompt": "x" * 13}, "a string", [1, 2]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items)
                    + '{"prompt": "a cat", "seed": ' + "9" * 5000 + "}\n" + "[" * 100_000 + "\n")
    expected = {}
    for position, item in enumerate(items):
        try:
            check_record(item, "here", max_chars=12)
        except PromptFileError as err:
            expected[position] = str(err).removeprefix("here: ")
    assert sorted(expected) == [3, 4, 5, 6, 8, 9, 10, 12, 13, 16, 18]  # what the list above is for
    records = read_records(path, max_chars=12)
    bad = {p: reason for p, (_, reason) in records.bad.items()}
    assert {p: bad.pop(p) for p in (len(items), len(items) + 1)} == {  # the decoder's own limits: one record each
        len(items): "not valid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has "
                    "5000 digits).", len(items) + 1: "not valid JSON (nested too deeply)."}
    assert bad == expected
    assert records.summary.large_seeds == {2: limit, 14: limit // 2 + 1}
    assert records.summary.count == len(items) - len(expected)
    # ... and each record's call-argument set, as the full check of every record gives them
    checked = read_records(items, max_chars=12)
    assert list(records.summary.set_of)[:len(items)] == list(checked.summary.set_of)

    def facts(summary):
        return [(s.first, s.overrides, s.count, s.without_negative, s.first_without_negative, s.first_negative,
                 s.with_inputs, s.without_inputs) for s in summary.sets]

    assert facts(records.summary) == facts(checked.summary) and len(records.summary.sets) == 2  # plain; height

    rows = [{"prompt": p, "seed": s} for p, s in [("a cat", 0), ("a cat", limit), ("\u3000", 1), ("", 2),
                                                  ("x" * 13, 3), ("a cat", None), ("a cat", limit // 2 + 1)]]
    table = pa.table({"prompt": [r["prompt"] for r in rows], "seed": pa.array([r["seed"] for r in rows], pa.uint64())})
    pq.write_table(table, tmp_path / "p.parquet")
    records = read_records(tmp_path / "p.parquet", max_chars=12)
    assert sorted(records.bad) == [2, 3, 4] and records.summary.large_seeds == {1: limit, 6: limit // 2 + 1}


def test_a_misspelt_prompt_field_is_named_with_the_field_it_should_be(tmp_path, cli_here):
    (tmp_path / "p.jsonl").write_text('{"promt": "a red circle", "seed": 3}\n{"prompt": "a blue square"}\n')
    proc = cli_here("predict", "--config", "configs/tiny-flux.yaml", "--data.prompts", str(tmp_path / "p.jsonl"),
                    "--writer.output_dir", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert (f"{tmp_path / 'p.jsonl'}:1: no 'prompt' (a non-empty string). It has 'promt' (did you mean "
            "'prompt'?), which no record may hold.") in proc.stderr, proc.stderr
