"""``benchmark`` prints the diffusers guide's table, named for what it measures, over enough batches,
and writes the same figures as JSON (no timing is asserted: these machines are shared and noisy)."""

import json

import pytest

from tests.conftest import run_here


@pytest.mark.slow
def test_benchmark_prints_the_table_and_writes_json(tmp_path):
    report = tmp_path / "bench.json"
    # tiny:shapes with true CFG against the config's default negative prompt: the bare loop passes it too
    proc = run_here("benchmark", "--config", "configs/tiny.yaml", "--data.prompts", "[a, b, c, d, e, f]",
                   "--data.batch_size", "2", "--compare-diffusers", "--json", str(report))
    assert ("| Strategy | Batch | Batches timed | ms / batch step | Batch steps / s | Images / s "
            "| Images / device-hour | Peak memory (GB) | Shape | Load (s) |" in proc.stdout)
    result = json.loads(report.read_text())
    assert result["strategy"] == "DataParallelStrategy" and result["shape"] == "64x64"
    # 3 batches in the set: repeated to 1 warm-up and 5 timed batches (each record twice), and no more
    assert (result["warmup_batches"], result["timed_batches"], result["diffusers_timed_batches"]) == (1, 5, 5)
    assert (result["batch_size"], result["steps"], result["copies_per_record"]) == (2, 12, 2)
    for key in ("ms_per_batch_step", "batch_steps_per_sec", "peak_memory_gb", "images_per_sec", "load_s",
                "diffusers_images_per_sec", "time_ratio_vs_diffusers"):
        assert result[key] > 0, key
    # a batch step is one step of a whole batch: images/s = batch steps/s x batch size / steps
    assert result["images_per_sec"] == pytest.approx(result["batch_steps_per_sec"] * 2 / 12)
    spread = result["batch_seconds"]
    assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert "over 5 batches of 2 images x 12 steps, after 1 warm-up batch(es)" in proc.stdout
    assert result["buckets"] == 1 and result["batches"] == 6 and result["padded_images"] == 0
    assert list(result["busy_s_by_rank"]) == ["0"] and result["busy_s_by_rank"]["0"] > 0


def test_benchmark_prints_images_per_device_hour_beside_its_rate(tmp_path):
    report = tmp_path / "bench.json"
    proc = run_here("benchmark", "--config", "configs/tiny.yaml", "--data.prompts", "[a, b]",
                    "--data.batch_size", "2", "--model.num_inference_steps", "2", "--model.height", "32",
                    "--model.width", "32", "--batches", "2", "--json", str(report))
    result = json.loads(report.read_text())
    assert result["devices"] == 1 and result["images_per_sec"] > 0
    assert result["images_per_device_hour"] == pytest.approx(result["images_per_sec"] * 3600)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| DataParallelStrategy"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[5] == f"{result['images_per_sec']:.2f}"
    assert cells[6] == f"{result['images_per_device_hour']:,.0f}"


@pytest.mark.slow
def test_benchmark_reports_the_cache_and_times_diffusers_with_its_own(tmp_path):
    report = tmp_path / "bench.json"
    proc = run_here("benchmark", "--config", "configs/tiny.yaml", "--data.prompts",
                    "[a red circle on a blue background, a green square on a white background]",
                    "--data.batch_size", "1", "--model.num_inference_steps", "8",
                    "--model.cache", "{type: first_block, threshold: 0.2}", "--compare-diffusers",
                    "--batches", "1", "--json", str(report))
    result = json.loads(report.read_text())
    cache = result["cache"]
    # 2 batches of 1 (a warm-up, 1 timed): 2 images x 8 steps x 2 guidance passes, every image step counted once
    assert cache["type"] == "first_block" and cache["image_steps"] == 32 and cache["calls"] == 32
    assert (0 < cache["reused_image_steps"] < 32
            and cache["reused_fraction"] == round(cache["reused_image_steps"] / 32, 4))
    assert result["time_ratio_vs_diffusers"] > 0, proc.stdout


@pytest.mark.slow
def test_benchmark_ignores_what_the_configs_own_output_folder_holds(tmp_path):
    """The README's order: a quickstart run fills the config's folder, then benchmark (which writes
    into a folder of its own) must neither refuse nor touch it."""
    import yaml

    config = yaml.safe_load(open("configs/tiny.yaml"))
    config["writer"]["output_dir"] = str(tmp_path / "taken")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    run_here("predict", "--config", str(path), "--data.prompts", "[a red circle]", "--model.num_inference_steps", "1")
    before = sorted(p.name for p in (tmp_path / "taken").iterdir())
    proc = run_here("benchmark", "--config", str(path), "--data.prompts", "[a, b]", "--data.batch_size", "1",
                    "--batches", "1", "--json", str(tmp_path / "b.json"))
    assert proc.returncode == 0 and json.loads((tmp_path / "b.json").read_text())["images_per_sec"] > 0
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == before


def test_the_set_is_repeated_until_every_replica_has_its_batches():
    from lightning_diffusion.commands.benchmark import processes, repeats

    assert repeats(6, 2, 6, 1) == 2  # 3 batches of 2 in the set, 6 wanted
    assert repeats(100, 4, 6, 2) == 1  # enough already
    assert repeats(1, 4, 6, 8) == 192
    assert processes({"devices": 4, "num_nodes": 2}) == 8
    assert processes({"devices": [0, 1]}) == processes({"devices": "0,1"}) == 2
    assert processes({"devices": "3"}) == 3 and processes({"devices": "auto", "accelerator": "cpu"}) == 1
