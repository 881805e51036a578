"""The shadow audit (``writer.audit``): a hashed sample of the images re-made with the accelerators off,
the drift in ``audit.jsonl``, and ``on_drift: stop`` ending the run with exit code 3, resumably.

Runs are tiny:shapes at 64x64 with 4 prompts; the drifting one uses a first-block cache at its
largest threshold (1.0), which reuses most steps and changes pictures by far more than 30 dB. The
attention backend ``_native_math`` and torchao's int8 weights change them a little: their audits
must equal a comparison with the plain run's images.
"""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_diffusion.core.preemption import DRIFT_EXIT_CODE
from lightning_diffusion.output.audit import AUDIT_FILE, audit_problems, compare, hash_value, sample_of
from lightning_diffusion.output.files import to_uint8
from lightning_diffusion.pipelines.plain import Accelerators, accelerators_off, quantization_problems
from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args

PROMPTS = ["--data.prompts", "[a red circle on a blue background, a large green square on a white background, "
           "a purple triangle at the bottom on a yellow background, a white star and a pink circle on a green "
           "background]", "--model.num_inference_steps", "4"]
AGGRESSIVE = ["--model.cache", "{type: first_block, threshold: 1.0}"]
INT8WO = "{backend: torchao, quant_type: int8wo}"
NUMBERS = ("psnr", "ssim", "max_diff")


def audit_lines(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / AUDIT_FILE).read_text().splitlines()]


def shapes(folder: Path, *extra: str, check: bool = True):
    return run_here(*tiny_args(folder, *PROMPTS, *extra, config="configs/tiny.yaml"), check=check)


# ----------------------------------------------------------------------------- the sample


def test_the_sample_is_a_function_of_the_index_alone_at_about_the_fraction():
    indices = range(20_000)
    for fraction in (0.01, 0.05, 0.5):
        picked = sample_of(indices, fraction)
        assert abs(len(picked) / len(indices) - fraction) < 4 * math.sqrt(fraction / len(indices)) + 1e-9
        # any split of the indices (replicas' strides, a resume's remainder) picks the same ones
        strided = sorted(i for r in range(3) for i in sample_of(indices[r::3], fraction))
        assert strided == picked
        assert sample_of(indices[1000:], fraction) == [i for i in picked if i >= 1000]
    assert sample_of(range(50), 1.0) == list(range(50))
    assert set(sample_of(indices, 0.01)) <= set(sample_of(indices, 0.05))  # a larger fraction adds images


def test_compare_identical_and_different_images():
    rng = np.random.default_rng(0)
    image = rng.random((32, 32, 3), dtype=np.float32)
    same = compare(image, image.copy())
    assert same == {"psnr": math.inf, "ssim": 1.0, "max_diff": 0}
    other = image.copy()
    other[0, 0, 0] = 1.0 - other[0, 0, 0] if other[0, 0, 0] < 0.5 else 0.0
    changed = compare(image, other)
    assert changed["max_diff"] >= 127 and 30 < changed["psnr"] < math.inf and changed["ssim"] < 1.0
    video = np.stack([image, other])  # F x H x W x 3
    assert compare(video, video)["psnr"] == math.inf


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("audit, said", [
    ("{fraction: 0}", "writer.audit.fraction must be a number in (0, 1], got 0"),
    ("{fraction: 1.5}", "writer.audit.fraction must be a number in (0, 1], got 1.5"),
    ("{fraction: some}", "writer.audit.fraction must be a number in (0, 1], got 'some'"),
    ("{min_psnr: high}", "writer.audit.min_psnr must be a number of dB, got 'high'"),
    ("{on_drift: halt}", "writer.audit.on_drift must be one of warn, stop, got 'halt'"),
    ("{fractoin: 0.1}", "writer.audit has no option fractoin"),
    ("{keep_baseline: 3}", "writer.audit.keep_baseline must be true or false, got 3"),
    ("{clip_model: /no/such/clip}", "writer.audit.clip_model /no/such/clip is not a local CLIP model folder"),
])
def test_bad_audit_settings_are_one_line_each_before_weights(audit, said, cli_here, tmp_path):
    proc = cli_here(*tiny_args(tmp_path / "out", *PROMPTS, "--writer.audit", audit, config="configs/tiny.yaml"))
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "writer.audit" in line] == [proc.stderr.strip()]
    assert not (tmp_path / "out").exists()


def test_audit_problems_take_a_mapping_of_numbers():
    assert audit_problems(None) == []
    assert audit_problems({"fraction": 1, "min_psnr": 25, "on_drift": "stop", "window": 3}) == []
    assert audit_problems("0.1") == ["writer.audit must be a mapping such as {fraction: 0.01, min_psnr: 30, "
                                     "on_drift: warn}; got '0.1'."]
    assert audit_problems({"min_psnr": True}) and audit_problems({"window": 0})


# ----------------------------------------------------------------------------- runs


def test_a_run_without_accelerators_audits_as_identical(tmp_path):
    proc = shapes(tmp_path, "--writer.audit", "{fraction: 0.5}")
    assert "a determinism check" in proc.stderr + proc.stdout
    lines = audit_lines(tmp_path)
    assert [line["index"] for line in lines] == sample_of(range(4), 0.5) != []
    assert all(line["psnr"] == math.inf and line["ssim"] == 1.0 and line["max_diff"] == 0 for line in lines)
    summary = json.loads((tmp_path / "run.json").read_text())["history"][-1]["audit"]
    assert summary["images"] == len(lines) and summary["fraction"] == 0.5
    assert not list(tmp_path.glob("audit.part-*"))


def test_a_pool_job_audits_the_same_sample(tmp_path):
    shapes(tmp_path, "--data.schedule", "pull", "--data.batch_size", "2", "--writer.audit", "{fraction: 0.5}")
    assert [line["index"] for line in audit_lines(tmp_path)] == sample_of(range(4), 0.5)
    assert not list(tmp_path.glob("audit.*part-*"))


def test_the_audit_compares_with_the_run_made_without_the_cache(tmp_path):
    """The audit's baseline is the plain run's image: its numbers equal a comparison of the cached
    run's images with those of a run that has no cache, image by image."""
    cached, plain = tmp_path / "cached", tmp_path / "plain"
    shapes(cached, *AGGRESSIVE, "--writer.audit", "{fraction: 1.0}")
    shapes(plain)
    made, reference = load_arrays(cached), load_arrays(plain)
    lines = audit_lines(cached)
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    for line in lines:
        assert {k: line[k] for k in ("psnr", "ssim", "max_diff")} == compare(made[line["index"]],
                                                                              reference[line["index"]])
        assert line["psnr"] < 30  # the drift is there to see


def test_on_drift_stop_stops_with_its_exit_code_and_a_resume_finishes(tmp_path):
    settings = ["--data.batch_size", "2", *AGGRESSIVE]
    stopped = shapes(tmp_path, *settings, "--writer.audit", "{fraction: 1.0, on_drift: stop, window: 1}",
                     check=False)
    assert stopped.returncode == DRIFT_EXIT_CODE == 3, stopped.stderr[-3000:]
    assert "stopped by the audit" in stopped.stderr + stopped.stdout
    assert "stopped by the audit's drift; the remaining images are left" in stopped.stderr + stopped.stdout
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == [0, 1]  # the first batch only
    assert [line["index"] for line in audit_lines(tmp_path)] == [0, 1]
    status = run_here("status", str(tmp_path), check=False)
    assert "audit: 2 images re-made without accelerators, PSNR worst" in status.stdout
    resumed = shapes(tmp_path, *settings, "--writer.audit", "{fraction: 1.0, on_drift: warn, window: 1}")
    assert "under writer.audit.min_psnr 30" in resumed.stderr + resumed.stdout
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == [0, 1, 2, 3]
    assert [line["index"] for line in audit_lines(tmp_path)] == [0, 1, 2, 3]  # each audited once
    assert all(line["psnr"] < 30 for line in audit_lines(tmp_path))


class Block(torch.nn.Module):
    """A block of our own: dynamo skips torch.nn's own modules compiled alone."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2


def test_compile_is_off_inside_and_back_after():
    """A compiled block runs eagerly inside ``accelerators_off`` (dynamo traces nothing) and compiled
    after it, with the same result."""
    traced = []

    def backend(graph, inputs):
        traced.append(graph)
        return graph.forward

    layer = Block()
    layer.compile(backend=backend, dynamic=False)
    x = torch.ones(2, 4)
    pipeline = SimpleNamespace(components={"transformer": layer})
    with accelerators_off(pipeline, None, {"transformer": layer}):
        inside = layer(x)
    assert traced == []
    after = layer(x)
    assert len(traced) == 1 and torch.equal(inside, after)


@pytest.fixture(scope="module")
def plain_pair(tmp_path_factory):
    """The plain run at batch 2 (no accelerator): its images, and its folder."""
    folder = tmp_path_factory.mktemp("plain")
    shapes(folder, "--data.batch_size", "2")
    return load_arrays(folder), folder


@pytest.fixture
def attention_default():
    """diffusers' process-wide attention backend, which ``set_attention_backend`` sets, put back after."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = active


@pytest.mark.usefixtures("attention_default")
@pytest.mark.parametrize("accelerator, named", [
    (["--model.attention_backend", "_native_math"], "model.attention_backend"),
    (["--model.quantization", INT8WO], "model.quantization"),
])
def test_a_fast_attention_backend_and_quantization_are_off_in_the_re_make(accelerator, named, plain_pair, tmp_path):
    """Each audit line is the comparison of the accelerated image with the plain run's; the run's
    next batch is made with the accelerator back on (its images differ from the plain ones too)."""
    if "--model.quantization" in accelerator:
        pytest.importorskip("torchao")
    plain, _ = plain_pair
    proc = shapes(tmp_path, "--data.batch_size", "2", *accelerator, "--writer.audit", "{fraction: 1.0}")
    assert f"re-made with {named} off in the run's float32" in proc.stderr + proc.stdout
    made = load_arrays(tmp_path)
    lines = audit_lines(tmp_path)
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    for line in lines:
        assert {k: line[k] for k in NUMBERS} == compare(made[line["index"]], plain[line["index"]])
    assert any(line["max_diff"] > 0 for line in lines)  # the accelerator changed pixels, the re-make undid it
    if named == "model.quantization":  # int8 weights change every image: both batches were made quantized
        assert all(0 < line["max_diff"] and 30 < line["psnr"] < math.inf for line in lines)
    assert not (tmp_path / "audit").exists()  # no baseline kept unless asked
    # after the fact, the plain run leaves the accelerator out of run.json's settings: the same numbers
    after = json.loads(run_here("audit", str(tmp_path), "--sample", "4", "--json").stdout)
    assert after["left_out"] == [named] and after["batch_size"] == 2
    assert [{k: line[k] for k in NUMBERS} for line in after["images"]] == [{k: line[k] for k in NUMBERS}
                                                                           for line in lines]


@pytest.mark.usefixtures("attention_default")
def test_the_baseline_is_kept_in_its_own_folder_when_asked(plain_pair, tmp_path):
    from PIL import Image

    plain, plain_folder = plain_pair
    shapes(tmp_path, "--data.batch_size", "2", "--model.attention_backend", "_native_math",
           "--writer.audit.fraction", "0.5", "--writer.audit.keep_baseline", "true")
    lines = audit_lines(tmp_path)
    assert [line["index"] for line in lines] == sample_of(range(4), 0.5) != []
    assert sorted(p.name for p in (tmp_path / "audit").iterdir()) == [f"{i:06d}.png" for i in sample_of(range(4), 0.5)]
    for line in lines:
        assert line["baseline"] == f"audit/{line['index']:06d}.png"
        kept = np.asarray(Image.open(tmp_path / line["baseline"]).convert("RGB"))
        assert np.array_equal(kept, to_uint8(plain[line["index"]]))  # the plain run's picture, as written
    # the outputs are the run's own: the manifest and the folder hold its four images only
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == [0, 1, 2, 3]
    assert len(list(tmp_path.glob("*.png"))) == len(list(plain_folder.glob("*.png"))) == 4


@pytest.mark.usefixtures("attention_default")
def test_the_clip_score_and_its_difference_from_the_baseline_with_a_local_clip_model(plain_pair, tmp_path):
    """A random tiny CLIP (its numbers mean nothing): each line's score is the run's image's against
    its prompt, and its difference the run's minus the plain run's; a run without accelerators has none."""
    from lightning_diffusion.output.clip import ClipScorer
    from tests.pipelines.test_shapes import tiny_clip

    plain, _ = plain_pair
    clip = tiny_clip(tmp_path / "clip")
    same = tmp_path / "same"  # first: the run with a backend below sets diffusers' process-wide one
    shapes(same, "--data.batch_size", "2", "--writer.audit", f"{{fraction: 1.0, clip_model: {clip}}}")
    assert [line["clip_diff"] for line in audit_lines(same)] == [0.0] * 4
    out = tmp_path / "out"
    shapes(out, "--data.batch_size", "2", "--model.attention_backend", "_native_math", "--writer.audit",
           f"{{fraction: 1.0, clip_model: {clip}}}")
    made, lines = load_arrays(out), audit_lines(out)
    prompts = {line["index"]: line["prompt"] for line in read_manifest_lines(out)}
    scorer = ClipScorer(str(clip), "clip")
    for line in lines:
        i = line["index"]
        ours, theirs = scorer.scores([to_uint8(made[i]), to_uint8(plain[i])], [prompts[i]] * 2)
        assert line["clip_score"] == round(ours, 4) and line["clip_diff"] == round(ours - theirs, 4)
    assert any(line["clip_diff"] != 0 for line in lines)


def test_a_clip_model_folder_that_does_not_load_is_refused_in_one_line_before_the_pipeline(cli_here, tmp_path):
    clip = tmp_path / "clip"
    clip.mkdir()
    (clip / "config.json").write_text("{}")
    proc = cli_here(*tiny_args(tmp_path / "out", *PROMPTS, "--writer.audit", f"{{fraction: 1.0, clip_model: {clip}}}",
                               config="configs/tiny.yaml"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "writer.audit.clip_model" in line]
    assert len(said) == 1 and "does not load as a CLIP model and processor" in said[0]
    assert not list((tmp_path / "out").glob("*.png")) and "weights in" not in proc.stderr


def test_what_the_re_make_turns_off_is_back_after_it():
    """The attention processors' backend and the float32 matmul precision, set back after the call."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.processor = SimpleNamespace(_attention_backend=AttentionBackendName("_native_math"))

    denoiser = torch.nn.Sequential(Attention(), Attention())
    pipeline = SimpleNamespace(components={"transformer": denoiser})
    before = torch.get_float32_matmul_precision()
    active = _AttentionBackendRegistry._active_backend
    try:
        torch.set_float32_matmul_precision("high")
        with accelerators_off(pipeline, None, {"transformer": denoiser}):
            assert {m.processor._attention_backend for m in denoiser} == {AttentionBackendName.NATIVE}
            assert _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE
            assert torch.get_float32_matmul_precision() == "highest"
        assert {m.processor._attention_backend for m in denoiser} == {AttentionBackendName("_native_math")}
        assert torch.get_float32_matmul_precision() == "high"
        assert _AttentionBackendRegistry._active_backend == active
    finally:
        torch.set_float32_matmul_precision(before)


def test_what_the_audit_turns_off_is_said_and_the_dtype_stays():
    options = {"compile": "regional", "quantization": {"backend": "torchao"}, "attention_backend": None}
    line = Accelerators.of({"type": "first_block"}, options, "bfloat16", "flash", "high", "native").describe()
    assert line == ("re-made with model.cache, model.compile, the strategy's attention_backend, model.quantization, "
                    "torch.float32_matmul_precision off in the run's bfloat16")
    assert Accelerators.of(None, {}, "bfloat16").describe() == (
        "no accelerator to turn off: the audit re-makes the same images the same way in the run's bfloat16, a "
        "determinism check")
    assert Accelerators.of(None, {}, "float32", environment_backend="flash").off == ("DIFFUSERS_ATTN_BACKEND",)


def test_quantization_the_audit_cannot_undo_is_refused_in_one_line():
    assert quantization_problems(None, ()) == [] and quantization_problems({"backend": "torchao"}, ()) == []
    [bnb] = quantization_problems({"backend": "bitsandbytes_8bit"}, ())
    assert bnb.startswith("writer.audit with model.quantization backend 'bitsandbytes_8bit'") and "\n" not in bnb
    [lora] = quantization_problems({"backend": "torchao"}, ("an adapter",))
    assert "writer.audit with model.quantization and model.lora" in lora


@pytest.mark.slow
def test_the_sample_and_its_numbers_are_the_same_for_one_and_two_replicas(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    audit = ["--writer.audit", "{fraction: 0.5}", "--data.batch_size", "1", *AGGRESSIVE]
    shapes(one, *audit)
    run_cli(*tiny_args(two, *PROMPTS, *audit, "--trainer.devices", "2", config="configs/tiny.yaml"))
    numbers = [[(line["index"], line["psnr"], line["ssim"], line["max_diff"]) for line in audit_lines(folder)]
               for folder in (one, two)]
    assert numbers[0] == numbers[1]
    assert [line["index"] for line in audit_lines(two)] == sample_of(range(4), 0.5)
    assert not list(two.glob("audit.part-*"))


# ----------------------------------------------------------------------------- after the fact


def test_audit_after_the_fact_reports_the_in_run_numbers(tmp_path):
    shapes(tmp_path, "--data.batch_size", "2", *AGGRESSIVE, "--writer.audit", "{fraction: 1.0}")
    in_run = {line["index"]: {k: line[k] for k in ("psnr", "ssim", "max_diff")} for line in audit_lines(tmp_path)}
    proc = run_here("audit", str(tmp_path), "--sample", "3", "--json", check=False)
    assert proc.returncode == DRIFT_EXIT_CODE, proc.stderr[-3000:]  # the drift is under 30 dB
    result = json.loads(proc.stdout)
    assert result["batch_size"] == 2 and result["batch_size_recorded"] and result["left_out"] == ["model.cache"]
    after = {line["index"]: {k: line[k] for k in ("psnr", "ssim", "max_diff")} for line in result["images"]}
    assert list(after) == sorted(sorted(range(4), key=hash_value)[:3])  # the three a fraction picks first
    assert after == {index: in_run[index] for index in after}
    assert not (tmp_path / "audit.part-0.jsonl").exists() and len(audit_lines(tmp_path)) == 4  # read only


@pytest.mark.parametrize("setup, said", [
    (lambda folder: None, "has no run.json"),
    (lambda folder: (folder / "run.json").write_text('{"expected": 3}'), "names no model and dtype"),
])
def test_audit_after_the_fact_refuses_a_folder_without_a_run_of_this_version(setup, said, tmp_path, cli_here):
    folder = tmp_path / "out"
    folder.mkdir()
    setup(folder)
    proc = cli_here("audit", str(folder))
    assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_progress_bar_shows_the_drift_so_far(tmp_path):
    from tests.run.test_progress import on_a_terminal

    prompts = "[" + ", ".join(f"a red circle on a blue background {i}" for i in range(12)) + "]"
    code, output = on_a_terminal(tiny_args(tmp_path, "--data.prompts", prompts, "--data.batch_size", "1",
                                           "--model.num_inference_steps", "8", *AGGRESSIVE, "--writer.audit",
                                           "{fraction: 1.0}", "--trainer.enable_progress_bar", "true",
                                           config="configs/tiny.yaml"))
    assert code == 0, output[-3000:]
    frames = [frame for frame in output.replace("\r\n", "\r").split("\r") if frame.startswith("Images:")]
    assert any("audit PSNR worst" in frame and "median" in frame for frame in frames), frames[-5:]


ULYSSES = ["--trainer.devices", "2", "--trainer.strategy.class_path",
           "lightning_diffusion.strategies.ContextParallelStrategy", "--trainer.strategy.init_args.ulysses_degree", "2",
           "--trainer.strategy.init_args.timeout", "120"]


@pytest.mark.slow
def test_under_ulysses_the_group_audits_together_identical_without_accelerators_and_drifting_with(tmp_path):
    """The two ranks of a Ulysses group make the plain images together (a first-block cache's
    agreement is bypassed on both, so neither waits for the other) and one of them records them."""
    plain, cached = tmp_path / "plain", tmp_path / "cached"
    audit = ["--writer.audit", "{fraction: 1.0}", "--data.batch_size", "2", *ULYSSES]
    run_cli(*tiny_args(plain, *PROMPTS, *audit, config="configs/tiny.yaml"), timeout=400)
    assert [line["index"] for line in audit_lines(plain)] == [0, 1, 2, 3]
    assert all(line["psnr"] == math.inf and line["max_diff"] == 0 for line in audit_lines(plain))
    run_cli(*tiny_args(cached, *PROMPTS, *audit, *AGGRESSIVE, config="configs/tiny.yaml"), timeout=400)
    assert [line["index"] for line in audit_lines(cached)] == [0, 1, 2, 3]
    assert all(line["psnr"] < 30 for line in audit_lines(cached))


@pytest.mark.slow
def test_a_drift_under_two_replicas_stops_the_run_with_its_exit_code_and_a_resume_finishes(tmp_path):
    prompts = "[" + ", ".join(f"a red circle on a blue background {i}" for i in range(12)) + "]"
    args = tiny_args(tmp_path, "--data.prompts", prompts, "--data.batch_size", "1", "--model.num_inference_steps",
                     "4", *AGGRESSIVE, "--trainer.devices", "2", config="configs/tiny.yaml")
    stopped = run_cli(*args, "--writer.audit", "{fraction: 1.0, on_drift: stop, window: 1}", check=False)
    assert stopped.returncode == DRIFT_EXIT_CODE, stopped.stderr[-3000:]
    made = [line["index"] for line in read_manifest_lines(tmp_path)]
    assert 2 <= len(made) < 12  # each replica's first batch at least; not the whole set
    run_cli(*args, "--writer.audit", "{fraction: 1.0, on_drift: warn}")
    assert [line["index"] for line in read_manifest_lines(tmp_path)] == list(range(12))
    assert [line["index"] for line in audit_lines(tmp_path)] == list(range(12))


@pytest.mark.slow
def test_under_ulysses_a_quantized_run_is_re_made_with_its_full_precision_weights(tmp_path):
    """The full-precision parameters are swapped into the group's context-parallel transformer (its
    hooks stay): each line equals the comparison with a plain Ulysses run's image."""
    pytest.importorskip("torchao")
    plain, quantized = tmp_path / "plain", tmp_path / "quantized"
    common = ["--data.batch_size", "2", *ULYSSES]
    run_cli(*tiny_args(plain, *PROMPTS, *common, config="configs/tiny.yaml"), timeout=400)
    run_cli(*tiny_args(quantized, *PROMPTS, *common, "--model.quantization", INT8WO, "--writer.audit",
                       "{fraction: 1.0}", config="configs/tiny.yaml"), timeout=400)
    made, reference = load_arrays(quantized), load_arrays(plain)
    lines = audit_lines(quantized)
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    for line in lines:
        assert {k: line[k] for k in NUMBERS} == compare(made[line["index"]], reference[line["index"]])
    assert all(line["max_diff"] > 0 for line in lines)
