"""``model.adapters``: adapters chosen per record. Random rank-4 adapters made offline with peft for
tiny:flux; a mixed run's image of a record that chose set S is byte-identical to the image of a run
with ``model.lora: S`` (the same seed), and within ATOL of diffusers' own pipeline with those
adapters loaded and fused; under data parallel 2, Ulysses 2, tp 2 and a 2 x 2 mesh within ATOL of
one process (the tolerance ``model.lora``'s parity tests state; measured below it)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args
from tests.pipelines.test_lora import make_adapter

pytest.importorskip("peft")

ATOL = 1e-5
NAMES = ("ink", "neon", "paper", "wood")
CHOICES = [["ink"], ["neon"], ["paper"], ["wood"], {"ink": 0.5, "neon": 1.0}, None]


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter("flux", root / name, seed=n) for n, name in enumerate(NAMES)}


def declared(loras, scales=None) -> str:
    return json.dumps({name: {"path": str(path), "scale": (scales or {}).get(name, 0.8)}
                       for name, path in loras.items()})


def records(count: int = 12) -> list[dict]:
    """Records that cycle through CHOICES, each with its own seed (so a record's image is its own in
    any order of the file)."""
    found = []
    for i in range(count):
        record = {"prompt": f"a chair, take {i}", "seed": 1000 + i}
        if CHOICES[i % len(CHOICES)] is not None:
            record["adapters"] = CHOICES[i % len(CHOICES)]
        found.append(record)
    return found


def write_prompts(path, items) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return str(path)


def by_record(out) -> dict[tuple[str, int], np.ndarray]:
    arrays = load_arrays(out)
    return {(line["prompt"], line["seed"]): arrays[line["index"]] for line in read_manifest_lines(out)}


@pytest.fixture(scope="module")
def mixed(loras, tmp_path_factory):
    """One process, a 12-record set of 4 adapters (a pair of them in one record, and records without
    any), batch size 2: (output folder, prompt file)."""
    root = tmp_path_factory.mktemp("mixed")
    prompts = write_prompts(root / "prompts.jsonl", records())
    out = root / "out"
    run_here(*tiny_args(out, "--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters",
                        declared(loras)))
    return out, prompts


def test_an_image_of_a_mixed_run_is_the_image_of_a_run_with_its_adapters_alone(loras, mixed, tmp_path):
    out, _ = mixed
    made = by_record(out)
    lines = {line["prompt"]: line for line in read_manifest_lines(out)}
    assert len(made) == 12
    # Each line names its own set, with the files' hashes and the scales.
    line = lines["a chair, take 4"]
    assert [(a["name"], a["scale"]) for a in line["adapters"]] == [("ink", 0.5), ("neon", 1.0)]
    assert all(len(a["sha256"]) == 64 for a in line["adapters"]) and "lora" not in line
    assert lines["a chair, take 5"]["adapters"] == [] and lines["a chair, take 0"]["adapters"][0]["name"] == "ink"
    images = {}
    for choice in (["neon"], {"ink": 0.5, "neon": 1.0}, None):
        chosen = [r for r in records() if r.get("adapters") == choice]
        spec = [] if choice is None else [{"path": str(loras[name]), "scale": 0.8 if isinstance(choice, list) else
                                           choice[name]} for name in sorted(choice)]
        alone = tmp_path / f"alone-{len(images)}"
        plain = [{k: v for k, v in r.items() if k != "adapters"} for r in chosen]
        run_here(*tiny_args(alone, "--data.prompts", write_prompts(tmp_path / f"p{len(images)}.jsonl", plain),
                            "--data.batch_size", "2", *(["--model.lora", json.dumps(spec)] if spec else [])))
        for key, image in by_record(alone).items():
            images[key] = image
            assert np.array_equal(made[key], image), f"{key}: not the image of a run with its adapters alone"
    assert not np.array_equal(made[("a chair, take 1", 1001)], made[("a chair, take 7", 1007)])


def test_a_mixed_run_matches_diffusers_with_the_adapter_loaded_directly(loras, mixed):
    import torch
    from diffusers import DiffusionPipeline

    from lightning_diffusion.pipelines import tiny

    out, _ = mixed
    made = by_record(out)
    pipe = DiffusionPipeline.from_pretrained(tiny.resolve("tiny:flux"))
    pipe.load_lora_weights(str(loras["paper"].parent), adapter_name="paper")
    pipe.set_adapters(["paper"], adapter_weights=[0.8])
    pipe.fuse_lora(adapter_names=["paper"])
    pipe.unload_lora_weights()
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a chair, take 2", "a chair, take 8"]
    generators = [torch.Generator("cpu").manual_seed(1000 + int(p.rsplit(" ", 1)[1])) for p in prompts]
    images = pipe(prompt=prompts, generator=generators, height=64, width=64, num_inference_steps=4,
                  guidance_scale=3.5, max_sequence_length=64, output_type="np").images
    for prompt, image in zip(prompts, images):
        ours = made[(prompt, 1000 + int(prompt.rsplit(" ", 1)[1]))]
        np.testing.assert_allclose(ours, image, rtol=0, atol=ATOL, err_msg=prompt)


def test_a_shuffled_set_makes_the_images_of_the_same_set_sorted_by_adapter(loras, mixed, tmp_path):
    out, _ = mixed
    shuffled = records()
    random.Random(3).shuffle(shuffled)
    again = tmp_path / "shuffled"
    proc = run_here(*tiny_args(again, "--data.prompts", write_prompts(tmp_path / "shuffled.jsonl", shuffled),
                               "--data.batch_size", "2", "--model.adapters", declared(loras)))
    first, second = by_record(out), by_record(again)
    assert sorted(first) == sorted(second)
    for key in first:
        assert np.array_equal(first[key], second[key]), key
    assert "6 adapter sets (a batch has one)" in proc.stdout + proc.stderr


def test_plan_and_status_say_how_many_adapter_sets_a_set_has(mixed, cli_here):
    out, prompts = mixed
    status = cli_here("status", str(out))
    assert "adapter sets: 6" in status.stdout, status.stdout
    plan = cli_here("plan", "--model", "tiny:flux", "--gpus", "2", "--gpu-memory", "80GB", "--prompts", prompts)
    assert plan.returncode == 0, plan.stderr
    assert "6 adapter sets (model.adapters)" in plan.stdout


def test_a_changed_adapter_file_is_refused_on_resume_naming_it(loras, tmp_path, cli_here):
    import shutil

    folder = tmp_path / "neon"
    shutil.copytree(loras["neon"].parent, folder)
    ours = dict(loras, neon=folder / loras["neon"].name)
    prompts = write_prompts(tmp_path / "p.jsonl", records(4))
    out = tmp_path / "out"
    args = tiny_args(out, "--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters", declared(ours))
    run_here(*args)
    (out / "manifest.jsonl").unlink()  # as if stopped before the end
    make_adapter("flux", folder, seed=9)  # another adapter under the same name
    proc = cli_here(*args)
    assert proc.returncode == 2
    assert "model.adapters.neon" in proc.stderr and "other settings" in proc.stderr


def test_bad_adapters_are_refused_before_loading(loras, tmp_path, cli_here):
    import torch
    from safetensors.torch import load_file, save_file

    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "a", "adapters": ["ink", "mist"]}, {"prompt": "b"},
                                                   {"prompt": "c", "adapters": {"fog": 1.0}}])
    proc = cli_here(*tiny_args(tmp_path / "o1", "--data.prompts", prompts, "--model.adapters", declared(loras)))
    assert proc.returncode == 2
    assert "p.jsonl:1" in proc.stderr and "p.jsonl:3" in proc.stderr and "p.jsonl:2" not in proc.stderr
    assert "'mist', which model.adapters does not declare" in proc.stderr and "'fog'" in proc.stderr
    # data.on_bad_record: skip makes the others and lists these
    skipped = cli_here(*tiny_args(tmp_path / "o0", "--data.prompts", prompts, "--model.adapters", declared(loras),
                                  "--data.on_bad_record", "skip"))
    assert skipped.returncode == 0, skipped.stderr
    assert [line["prompt"] for line in read_manifest_lines(tmp_path / "o0")] == ["b"]
    rejected = [json.loads(line) for line in (tmp_path / "o0" / "rejected.jsonl").read_text().splitlines()]
    assert [r["line"].rsplit(":", 1)[1] for r in rejected] == ["1", "3"] and "'mist'" in rejected[0]["reason"]
    prompts_ok = write_prompts(tmp_path / "q.jsonl", [{"prompt": "a", "adapters": ["ink", "mist"]}, {"prompt": "b"}])
    no_model = cli_here(*tiny_args(tmp_path / "o2", "--data.prompts", prompts_ok))
    assert no_model.returncode == 2 and "model.adapters declares none" in no_model.stderr

    nan = tmp_path / "nan"
    nan.mkdir()
    state = load_file(str(loras["ink"]))
    state[next(iter(state))] = torch.full_like(state[next(iter(state))], float("nan"))
    save_file(state, str(nan / "w.safetensors"))
    pickled = tmp_path / "w.bin"
    pickled.write_bytes(b"not read")
    other = make_adapter("qwenimage", tmp_path / "qwen")
    for spec, expected in [
        ({"ghost": {"path": str(tmp_path / "none.safetensors")}}, "model.adapters.ghost: "),
        ({"nan": {"path": str(nan / "w.safetensors")}}, "NaN or infinite weights"),
        ({"pickle": {"path": str(pickled)}}, "not a .safetensors file"),
        ({"qwen": {"path": str(other)}}, "match no layer of FluxPipeline"),
        ({"bad name": {"path": str(loras["ink"])}}, "is not an adapter name"),
    ]:
        proc = cli_here(*tiny_args(tmp_path / "o3", "--data.prompts", "[a]", "--model.adapters", json.dumps(spec)))
        assert proc.returncode == 2, spec
        assert expected in proc.stderr, (expected, proc.stderr)
        assert "Traceback" not in proc.stderr
    proc = cli_here(*tiny_args(tmp_path / "o4", "--data.prompts", "[a]", "--model.adapters", declared(loras),
                               "--model.max_loaded_adapters", "0"))
    assert proc.returncode == 2 and "model.max_loaded_adapters" in proc.stderr


@pytest.mark.slow
def test_a_killed_mixed_run_resumes_exactly(loras, mixed, tmp_path):
    out, prompts = mixed
    again = tmp_path / "again"
    args = tiny_args(again, "--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters", declared(loras))
    proc = subprocess.Popen([sys.executable, "-m", "lightning_diffusion", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while len(list(again.glob("manifest.part-*.jsonl"))) == 0 or sum(
            1 for p in again.glob("manifest.part-*.jsonl") for _ in p.open()) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run_cli(*args)
    lines = read_manifest_lines(again)
    assert sorted(line["index"] for line in lines) == list(range(12))
    first, second = by_record(out), by_record(again)
    for key in first:
        assert np.array_equal(first[key], second[key]), key


def test_a_mixed_run_under_a_device_map_matches_one_process(loras, mixed, tmp_path, cli_here):
    out, prompts = mixed
    args = ["--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters", declared(loras)]
    run_here(*tiny_args(tmp_path / "out", *args, "--trainer.strategy.init_args.max_memory", "null",
                        "--trainer.strategy.init_args.offload_folder", "null", config="configs/tiny-device-map.yaml"))
    ours, ref = by_record(tmp_path / "out"), by_record(out)
    assert sorted(ours) == sorted(ref)
    for key in ref:  # our in-place fuse on the placed weights, against diffusers' fuse: rounding apart
        np.testing.assert_allclose(ours[key], ref[key], rtol=0, atol=ATOL, err_msg=str(key))
    proc = cli_here(*tiny_args(tmp_path / "refused", *args, config="configs/tiny-device-map.yaml"))
    assert proc.returncode == 2 and "an update cannot be fused into offloaded weights" in proc.stderr


STRATEGIES = {
    "data_parallel_2": ["--trainer.devices", "2"],
    "ulysses_2": ["--config", "configs/tiny-ulysses.yaml"],
    "tp_2": ["--config", "configs/tiny-tp.yaml"],
    "mesh_2x2": ["--config", "configs/tiny-tp.yaml", "--trainer.devices", "4"],
    "pool_of_2_replicas": ["--data.schedule", "pull", "--trainer.devices", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STRATEGIES))
def test_a_mixed_run_under_each_strategy_matches_one_process(case, loras, mixed, tmp_path):
    out, prompts = mixed
    extra = STRATEGIES[case]
    args = tiny_args(tmp_path, "--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters",
                     declared(loras))
    if extra[:1] == ["--config"]:
        args[args.index("--config") + 1] = extra[1]
        extra = extra[2:]
    run_cli(*args, *extra, timeout=600)
    ours, ref = by_record(tmp_path), by_record(out)
    assert sorted(ours) == sorted(ref) and ref
    for key in ref:
        np.testing.assert_allclose(ours[key], ref[key], rtol=0, atol=ATOL, err_msg=str(key))


def test_every_prompt_format_reads_a_records_adapters(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_diffusion.input.formats import read_records

    csv = tmp_path / "p.csv"
    csv.write_text('prompt,adapters\na,"ink, neon"\nb,\nc,"{""ink"": 0.5}"\n')
    found = read_records(str(csv))
    assert [found.read(i)[0].get("adapters") for i in range(3)] == [{"ink": None, "neon": None}, None, {"ink": 0.5}]
    assert found.summary.adapter_sets() == 3
    table = pa.table({"prompt": ["a", "b", "c"], "lora": [["neon", "ink"], None, []],
                      "scales": pa.array([[("ink", 0.5)], None, [("neon", 1.0)]], pa.map_(pa.string(), pa.float64()))})
    pq.write_table(table, tmp_path / "p.parquet")
    listed = read_records(str(tmp_path / "p.parquet"), columns={"adapters": "lora"})
    assert [listed.read(i)[0].get("adapters") for i in range(3)] == [{"ink": None, "neon": None}, None, {}]
    mapped = read_records(str(tmp_path / "p.parquet"), columns={"adapters": "scales"})
    assert [mapped.read(i)[0].get("adapters") for i in range(3)] == [{"ink": 0.5}, None, {"neon": 1.0}]
    bad = read_records([{"prompt": "a", "adapters": ["ink", "ink"]}, {"prompt": "b", "adapters": {"ink": "x"}},
                        {"prompt": "c", "adapters": 3}])
    reasons = [reason for _, reason in bad.bad.values()]
    assert "names an adapter twice" in reasons[0] and "the scale 'x'" in reasons[1] and "not 3" in reasons[2]


def test_the_report_page_names_each_images_adapters(mixed, cli_here, tmp_path):
    out, _ = mixed
    page = tmp_path / "report.html"
    proc = cli_here("report", str(out), "--html", str(page))
    assert proc.returncode == 0, proc.stderr
    html = page.read_text()
    assert "adapters=ink x 0.5, neon x 1" in html and "adapters=paper x 0.8" in html


@pytest.mark.slow  # torch.compile on CPU: seconds
def test_switching_adapters_recompiles_nothing_and_a_step_cache_keeps_to_its_batch(loras, mixed, tmp_path):
    import torch._dynamo

    out, prompts = mixed
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = tmp_path / "compiled"
    proc = run_here(*tiny_args(compiled, "--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters",
                               declared(loras), "--model.compile", "regional"))
    assert "adapters: 6 switches" in proc.stderr
    # FLUX.1 has two repeated block classes, compiled once each for one shape: six adapter sets add no graph
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 4, dict(torch._dynamo.utils.counters["stats"])
    torch._dynamo.reset()
    eager = by_record(out)
    for key, image in by_record(compiled).items():
        np.testing.assert_allclose(image, eager[key], rtol=0, atol=1e-4, err_msg=str(key))  # test_speed's bound
    # A first-block cache decides per call: a mixed run's image of set S is a run of S alone's.
    cache = json.dumps({"type": "first_block", "threshold": 0.3})
    cached = tmp_path / "cached"
    run_here(*tiny_args(cached, "--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters",
                        declared(loras), "--model.cache", cache))
    chosen = [{k: v for k, v in r.items() if k != "adapters"} for r in records() if r.get("adapters") == ["wood"]]
    alone = tmp_path / "alone"
    run_here(*tiny_args(alone, "--data.prompts", write_prompts(tmp_path / "wood.jsonl", chosen), "--data.batch_size",
                        "2", "--model.cache", cache, "--model.lora", json.dumps([{"path": str(loras["wood"]),
                                                                                  "scale": 0.8}])))
    mixed_images = by_record(cached)
    for key, image in by_record(alone).items():
        assert np.array_equal(mixed_images[key], image), key


@pytest.mark.slow
def test_a_switch_that_fuses_a_wrong_slice_makes_the_tensor_parallel_pictures_differ(loras, mixed, tmp_path):
    """The tp comparison above can fail: a strategy whose ranks each add rank 0's slice of every
    update, at each switch, makes pictures far from one process's."""
    out, prompts = mixed
    run_cli(*tiny_args(tmp_path, "--data.prompts", prompts, "--data.batch_size", "2", "--model.adapters",
                       declared(loras), "--trainer.strategy.class_path", "tests.broken_plans.FirstRankLoraSliceTP",
                       config="configs/tiny-tp.yaml"), timeout=600)
    ours, ref = by_record(tmp_path), by_record(out)
    assert max(float(np.abs(ours[key] - ref[key]).max()) for key in ref) > 100 * ATOL
