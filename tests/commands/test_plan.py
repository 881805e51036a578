"""``plan`` recommends the documented strategy for real model sizes and GPU sizes."""

from pathlib import Path

import pytest
import yaml

from lightning_diffusion.cli import main
from lightning_diffusion.commands.plan import ModelFacts, choose, facts_for, runner_up
from lightning_diffusion.pipelines.model_folder import safetensors_bytes
from lightning_diffusion.pipelines.specs import all_published

FLUX1, FLUX2 = "black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.2-dev"
QWEN, WAN = "Qwen/Qwen-Image", "Wan-AI/Wan2.1-T2V-14B-Diffusers"

SITUATIONS = [
    # model, gpus, GB each, interconnect, height, width, frames -> strategy, init args (--goal latency)
    (FLUX1, 8, 80, "nvlink", 1024, 1024, None, "data_parallel", {}),
    (QWEN, 1, 80, "nvlink", 1024, 1024, None, "data_parallel", {}),
    (FLUX1, 2, 24, "pcie", 1024, 1024, None, "DeviceMapStrategy", {"device_map": "auto"}),
    (FLUX1, 4, 80, "nvlink", 4096, 4096, None, "ContextParallelStrategy", {"ulysses_degree": 4, "ring_degree": 1}),
    (FLUX1, 16, 80, "nvlink", 4096, 4096, None, "ContextParallelStrategy", {"ulysses_degree": 8, "ring_degree": 2}),
    (FLUX2, 4, 80, "nvlink", 1024, 1024, None, "DeviceMapStrategy", {"device_map": "balanced"}),
    (FLUX2, 4, 48, "nvlink", 1024, 1024, None, "TensorParallelStrategy", {"tp_degree": 2}),
    (FLUX2, 4, 48, "pcie", 1024, 1024, None, "DeviceMapStrategy", {"device_map": "auto"}),
    (QWEN, 8, 24, "nvlink", 1328, 1328, None, "TensorParallelStrategy", {"tp_degree": 2}),
    # Qwen-Image's prompt-length text and its mask: Ulysses-anything over 2 GPUs, nothing wider
    (QWEN, 2, 80, "nvlink", 2048, 2048, None, "ContextParallelStrategy",
     {"ulysses_degree": 2, "ulysses_anything": True}),
    (QWEN, 4, 80, "nvlink", 2048, 2048, None, "data_parallel", {}),
    (WAN, 8, 80, "nvlink", 720, 1280, 81, "ContextParallelStrategy", {"ulysses_degree": 8, "ring_degree": 1}),
    # Wan's transformer has no _tp_plan (predict refuses tensor parallelism for it): a device map instead
    (WAN, 8, 24, "nvlink", 720, 1280, 81, "DeviceMapStrategy", {"device_map": "auto", "staged": False}),
]


@pytest.mark.parametrize("model, gpus, gb, link, height, width, frames, strategy, args", SITUATIONS)
def test_plan_recommends_the_documented_strategy(model, gpus, gb, link, height, width, frames, strategy, args):
    plan = choose(facts_for(model), gpus, gb, link, height, width, frames, prompts=1000, goal="latency")
    assert plan.strategy == strategy, plan.reasons
    assert {k: plan.init_args[k] for k in args} == args, plan.init_args
    assert plan.reasons and "GB" in plan.reasons[0]


THROUGHPUT = [
    # many prompts: replicas whenever the pipeline fits, however long the sequence; the smallest group otherwise
    (FLUX1, 8, 80, "pcie", 2048, 2048, None, 100_000, "data_parallel", {}, 8),
    (FLUX1, 4, 80, "nvlink", 4096, 4096, None, 1000, "data_parallel", {}, 4),
    (WAN, 8, 80, "nvlink", 720, 1280, 81, 1000, "data_parallel", {}, 8),
    (FLUX1, 4, 24, "pcie", 1024, 1024, None, 1000, "DeviceMapStrategy", {"devices_per_process": 2}, 2),
    (FLUX2, 4, 48, "nvlink", 1024, 1024, None, 1000, "TensorParallelStrategy", {"tp_degree": 2}, 4),
    # fewer prompts than GPUs: each image gets the GPUs
    (FLUX1, 4, 80, "nvlink", 4096, 4096, None, 1, "ContextParallelStrategy", {"ulysses_degree": 4}, 4),
]


@pytest.mark.parametrize("model, gpus, gb, link, height, width, frames, prompts, strategy, args, devices", THROUGHPUT)
def test_plan_prefers_replicas_for_throughput(model, gpus, gb, link, height, width, frames, prompts, strategy, args,
                                              devices):
    plan = choose(facts_for(model), gpus, gb, link, height, width, frames, prompts=prompts)
    assert plan.strategy == strategy, plan.reasons
    assert {k: plan.init_args[k] for k in args} == args and plan.devices == devices, (plan.init_args, plan.devices)


def test_plan_gives_expected_throughput_of_its_choice_and_why_the_runner_up_lost(capsys):
    facts = facts_for(FLUX1)
    chosen = choose(facts, 8, 80, "nvlink", 2048, 2048, None, prompts=100_000)
    other, why = runner_up(facts, 8, 80, "nvlink", 2048, 2048, None, 100_000, "throughput", chosen)
    assert chosen.rate("nvlink") == 8.0 and other.strategy == "ContextParallelStrategy"
    assert 1 < other.rate("nvlink") < 8 and other.rate("pcie") < other.rate("nvlink")
    assert why.startswith("fewer images per hour: it spends 8 GPUs on each image")
    # the latency goal flips them, and says what the replicas would have bought
    latency = choose(facts, 8, 80, "nvlink", 2048, 2048, None, prompts=100_000, goal="latency")
    other, why = runner_up(facts, 8, 80, "nvlink", 2048, 2048, None, 100_000, "latency", latency)
    assert other.strategy == "data_parallel" and why.startswith("more images per hour, but --goal latency")
    # fewer prompts than GPUs: the choice is the latency one, and the replicas are the runner-up
    few = choose(facts, 8, 80, "nvlink", 2048, 2048, None, prompts=3)
    other, why = runner_up(facts, 8, 80, "nvlink", 2048, 2048, None, 3, "throughput", few)
    assert few.strategy == "ContextParallelStrategy" and other.strategy == "data_parallel"
    assert why == "3 prompts cannot keep 8 replicas busy"
    # one GPU: one plan, whatever the goal and the sequence
    one = choose(facts, 1, 80, "nvlink", 2048, 2048, None, prompts=1000, goal="latency")
    assert one.strategy == "data_parallel" and runner_up(facts, 1, 80, "nvlink", 2048, 2048, None, 1000,
                                                          "latency", one) is None
    # a device map runs one GPU at a time: its group makes one GPU's images, its replicas add up
    device_map = choose(facts_for(FLUX1), 4, 24, "pcie", 1024, 1024, None, prompts=1000)
    assert (device_map.group, device_map.replicas, device_map.rate("pcie")) == (2, 2, 2.0)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", FLUX1, "--gpus", "8", "--gpu-memory", "80GB", "--height", "2048", "--width", "2048",
              "--prompts", "100000"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "  1. data_parallel (8 replicas): 8.0x\n  2. ContextParallelStrategy (ulysses_degree 8): 4.9x, " \
           "not chosen: fewer images per hour" in out, out


def test_plan_writes_a_config_the_cli_accepts(tmp_path, capsys):
    written = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", FLUX1, "--gpus", "4", "--gpu-memory", "80GB", "--height", "4096", "--width", "4096",
              "--goal", "latency", "--write", str(written)])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "recommended: ContextParallelStrategy" in out
    assert "prompt set: none given; planned for 1,000 prompts (--prompts N, or a prompt file, plans for yours)" in out
    config = yaml.safe_load(written.read_text())
    assert config["trainer"]["strategy"]["init_args"]["ulysses_degree"] == 4
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", str(written), "--print_config"])
    assert exit_info.value.code in (0, None)


def test_local_pipeline_sizes_come_from_safetensors_headers(tiny_cache):
    facts = facts_for(tiny_cache)
    weights = sorted(Path(tiny_cache).glob("transformer/*.safetensors"))
    assert facts.components["transformer"] == pytest.approx(safetensors_bytes(weights[0]) / 1e9)
    assert 0.001 < facts.components["transformer"] < 0.0012  # 1.09 MB of float32 weights, header not counted
    assert facts.heads == 4 and isinstance(facts, ModelFacts)
    assert set(all_published()) >= {FLUX1, FLUX2, QWEN, WAN}


@pytest.mark.parametrize(
    "model, expected",
    [
        ("Qwen/Qwen-Image",
         "cfg parallel: QwenImagePipeline runs two transformer passes per step with true_cfg_scale > 1"),
        ("black-forest-labs/FLUX.1-dev", "cfg parallel: FluxPipeline runs two transformer passes"),
        ("black-forest-labs/FLUX.2-dev", "cfg parallel: not available for Flux2Pipeline (supported: FluxPipeline"),
        ("tiny:wan", "cfg parallel: WanPipeline runs two transformer passes per step with guidance_scale > 1;"),
    ],
)
def test_plan_says_whether_cfg_parallel_applies(model, expected):
    from lightning_diffusion.commands.plan import cfg_note

    assert cfg_note(facts_for(model)).startswith(expected)


def test_plan_reads_a_prompt_file_and_plans_for_its_largest_image(tmp_path, capsys):
    from lightning_diffusion.commands.plan import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "p{n}", "height": {h}, "width": {h}}}\n'
                               for n, h in enumerate([512, 2048, 512, 1024] * 5)))
    assert main(["--model", "black-forest-labs/FLUX.1-dev", "--gpus", "8", "--gpu-memory", "80GB",
                 "--prompts", str(prompts)]) == 0
    out = capsys.readouterr().out
    assert "prompt set: 20 records by size (512x512: 10, 2048x2048: 5, 1024x1024: 5); planned for the largest, " \
           "2048x2048" in out
    assert "height: 2048" in out


@pytest.mark.parametrize("model, pipeline_class", [
    ("tiny:flux", None), ("tiny:wan", None), ("tiny:sdxl", None),
    ("tiny:sdxl", "StableDiffusionXLImg2ImgPipeline"),  # its call takes its input's size: no height, width
])
def test_every_config_plan_writes_passes_predicts_checks(model, pipeline_class, tmp_path, capsys):
    """What ``plan --write`` writes is a config ``predict`` accepts: parsed and checked as the job
    would check it (on its GPUs: this machine's are not asked), with a prompt set given."""
    import json
    import shutil

    from lightning_diffusion.pipelines import tiny
    from lightning_diffusion.run.config import read_config
    from lightning_diffusion.run.preflight import preflight

    folder = tiny.resolve(model)
    if pipeline_class is not None:  # the same weights saved as a task pipeline
        folder = shutil.copytree(folder, tmp_path / "model")
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": pipeline_class}))
    written = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", str(folder), "--gpus", "2", "--gpu-memory", "24GB", "--height", "64", "--width",
              "64", *(["--frames", "5"] if model == "tiny:wan" else []), "--write", str(written)])
    assert exit_info.value.code == 0, capsys.readouterr()
    (tmp_path / "prompts.jsonl").write_text(json.dumps(
        {"prompt": "a red circle", **({"image": str(tmp_path / "in.png")} if pipeline_class else {})}) + "\n")
    if pipeline_class:
        from PIL import Image

        Image.new("RGB", (64, 64), "red").save(tmp_path / "in.png")
    config = read_config(str(written), ["--data.prompts", str(tmp_path / "prompts.jsonl"), "--model.torch_dtype",
                                        "float32", "--writer.output_dir", str(tmp_path / "out")], check=False)
    assert ("height" in yaml.safe_load(written.read_text())["model"]) == (pipeline_class is None)
    assert preflight(config, here=False).problems == []
