"""``lightning-diffusion report``: the page of one small real run (tiny:shapes, 32 px, 2 steps),
opened in headless Chromium (Debian's ``chromium``, started here; ``.ci/run`` installs it): every
image has its thumbnail, the search box filters, a caption holding ``<script>`` stays text, no
console message, a screenshot that is not blank. Then the other layouts (webdataset shards, sharded
folders, a bucket), bad input, paging and the cost against the recorded history."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_diffusion.commands.report_page import build
from lightning_diffusion.output.lock import OutputLock
from tests.conftest import run_here

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install -y chromium; .ci/run does)")

HOSTILE = "a <script>document.title='pwned'</script> star"
PROMPTS = f"[a red circle, a blue square, \"{HOSTILE}\", a green <img src=x onerror=alert(1)> triangle]"
COPIES = 2


def _predict(out: object, *extra: str) -> None:
    run_here("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(out), "--data.prompts", PROMPTS,
             "--data.num_images_per_prompt", str(COPIES), "--model.height", "32", "--model.width", "32",
             "--model.num_inference_steps", "2", "--data.batch_size", "4", "--trainer.enable_progress_bar", "false",
             *extra)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """One small run of loose files, shared by the tests (copied where a test changes it)."""
    out = tmp_path_factory.mktemp("report") / "run"
    _predict(out)
    return out


def _copy(small_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(small_run, out, ignore=shutil.ignore_patterns(".thumbs", "report*"))
    return out


def _chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None
    flags = [CHROMIUM, "--headless", "--disable-gpu", "--no-first-run", "--hide-scrollbars", "--mute-audio",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0"]
    if os.geteuid() == 0:  # Chromium's sandbox refuses root
        flags.append("--no-sandbox")
    return subprocess.run([*flags, *args, url], capture_output=True, text=True, timeout=120)


def _console(stderr: str) -> list[str]:
    """The page's console messages (Chromium logs each as ``INFO:CONSOLE``), errors among them."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def _figures(page: str) -> dict[int, str]:
    """Each figure's index and the start of its thumbnail's source."""
    return {int(index): source for index, source in
            re.findall(r'<figure id="i(\d+)"[^>]*>\s*<img src="(data:image/jpeg;base64,[A-Za-z0-9+/]{8})', page)}


@needs_chromium
def test_the_page_in_chromium_shows_every_image_filters_and_runs_no_caption(small_run, tmp_path):
    out = _copy(small_run, tmp_path)
    result = build(str(out), price=2.5)
    page = Path(result["html"])
    assert page == out / "report.html" and result["images"] == 4 * COPIES and result["pages"] == 1
    url = page.as_uri()

    proc = _chromium(tmp_path, url + "#q=red", "--dump-dom")  # the search box filled from the link
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert not _console(proc.stderr), _console(proc.stderr)
    figures = _figures(dom)
    assert sorted(figures) == list(range(4 * COPIES)), "every image has its thumbnail"
    groups = re.findall(r'<section class="group" data-caption="([^"]*)"( hidden="")?>', dom)
    assert len(groups) == 4
    shown = [caption for caption, hidden in groups if not hidden]
    assert shown == ["a red circle"], groups
    assert "1 of 4 prompts on this page" in dom
    # the hostile captions are text: no script of theirs ran, no element of theirs exists
    assert "<title>lightning-diffusion report" in dom and "pwned</title>" not in dom
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom
    assert "&lt;img src=x onerror=alert(1)&gt;" in dom
    assert len(re.findall(r"<script\b", dom)) == 2, "only the page's own config and script"
    assert 'src="x"' not in dom

    shot = tmp_path / "page.png"
    proc = _chromium(tmp_path, url, f"--screenshot={shot}", "--window-size=1100,1300")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    assert not _console(proc.stderr), _console(proc.stderr)
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.std() > 20 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 200, "the screenshot is not blank"
    if os.environ.get("LIGHTNING_DIFFUSION_REPORT_SCREENSHOT"):  # the README's picture, made by this browser
        picture = Image.open(shot).convert("RGB").crop((0, 0, 1100, 1040))
        picture.quantize(colors=96).save(os.environ["LIGHTNING_DIFFUSION_REPORT_SCREENSHOT"], optimize=True)


@needs_chromium
def test_pages_of_a_larger_set_link_each_other_and_search_across_them(small_run, tmp_path):
    out = _copy(small_run, tmp_path)
    result = build(str(out), page_size=2)
    assert result["pages"] == 4 and result["thumbs_made"] == 4 * COPIES
    pages_dir = out / "report.pages"
    assert (pages_dir / "search.js").is_file() and (pages_dir / "page-00004.html").is_file()
    first = (out / "report.html").read_text()
    assert "Sample of the whole set" in first and 'href="report.pages/page-00002.html' in first
    proc = _chromium(tmp_path, (pages_dir / "page-00003.html").as_uri() + "#q=square", "--dump-dom")
    assert not _console(proc.stderr), _console(proc.stderr)
    assert "0 of 1 prompts on this page" in proc.stdout
    found = r'<a href="page-00002.html">a blue square</a> \(page 2, 2 images\)'
    assert re.search(found, proc.stdout), proc.stdout[-3000:]
    again = build(str(out), page_size=2)
    assert again["thumbs_made"] == 0, "thumbnails are made once and kept"


def test_cost_is_the_recorded_wall_time_times_the_devices(small_run, tmp_path):
    out = _copy(small_run, tmp_path)
    history = json.loads((out / "run.json").read_text())["history"]
    result = build(str(out), price=3.0)
    device_s = sum(run["wall_s"] * len(run["images_per_s_by_rank"]) for run in history)
    assert result["device_h"] == pytest.approx(device_s / 3600)
    assert result["images_per_device_h"] == pytest.approx(4 * COPIES / (device_s / 3600))
    assert result["money_per_image"] == pytest.approx(3.0 * device_s / 3600 / (4 * COPIES))
    assert build(str(out), devices=4)["device_h"] == pytest.approx(4 * sum(run["wall_s"] for run in history) / 3600)


def test_a_resume_is_a_worker_of_its_own_a_stall_and_the_last_worker_are_marked():
    from lightning_diffusion.report.collect import Record
    from lightning_diffusion.report.pace import cost, spans, workers

    def record(index: int, worker: str, written: float) -> Record:
        return Record(index, "p", index, f"{index:06d}-p.png", None, 1, written, worker, "32x32", "")

    t0 = 1_700_000_000.0
    first = [record(i, "stretch 1", t0 + i) for i in range(10)] + [record(10, "stretch 1", t0 + 700)]  # a stall
    first += [record(20 + i, "stretch 2", t0 + i) for i in range(5)]  # a second writer of run 1, done early
    resumed = [record(40 + i, "stretch 1", t0 + 5000 + i) for i in range(5)]
    history = {"run.json": [{"finished": t0 + 701, "wall_s": 702, "made": 16, "images_per_s_by_rank": {"0": 1, "1": 1}},
                            {"finished": t0 + 5005, "wall_s": 10, "made": 5, "images_per_s_by_rank": {"0": 1}}]}
    found = spans(history)
    shown = {worker.name: worker for worker in workers(first + resumed, found)}
    assert sorted(shown) == ["run 1 · writer 1", "run 1 · writer 2", "run 2 · writer 1"]
    assert [round(s) for _, s in shown["run 1 · writer 1"].stalls] == [691] and not shown["run 2 · writer 1"].stalls
    assert shown["run 1 · writer 1"].last_to_finish and not shown["run 1 · writer 2"].last_to_finish
    total = cost(found, price=2.0).total
    assert total["device_h"] == pytest.approx((702 * 2 + 10) / 3600) and total["made"] == 21
    assert total["money_per_image"] == pytest.approx(2.0 * (702 * 2 + 10) / 3600 / 21)


def test_failed_rejected_truncated_and_garbled_outputs_are_marked_not_a_crash(small_run, tmp_path, cli_here):
    out = _copy(small_run, tmp_path)
    (out / "failed.jsonl").write_text(json.dumps({"index": 99, "record": "prompts:9", "prompt": "a <b>bold</b> fail",
                                                  "seed": 99, "error": "RuntimeError: out of memory"}) + "\n")
    (out / "rejected.jsonl").write_text(json.dumps({"record": 12, "line": "prompts.txt:12", "reason": "an empty prompt",
                                                    "images": [100, 101]}) + "\n")
    files = sorted(out.glob("0*.png"))
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated: not the size recorded
    files[1].write_bytes(b"\0" * files[1].stat().st_size)  # garbled at its size: undecodable
    proc = cli_here("report", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # the truncated file does not count; the garbled one is not counted (where the store checks more
    # than sizes) or, counted, marked unreadable on the page
    assert (result["failed"], result["rejected"]) == (1, 1)
    assert result["not_counted"] + result["unreadable"] == 2 and result["images"] == 4 * COPIES - result["not_counted"]
    page = (out / "report.html").read_text()
    assert "RuntimeError: out of memory" in page and "a &lt;b&gt;bold&lt;/b&gt; fail" in page
    assert "an empty prompt" in page and "is missing or not the size recorded" in page
    if result["unreadable"]:
        assert '<figure id="i1" class="broken"' in page


def _verdicts(page: str) -> dict[int, tuple[str, str]]:
    """Each figure's eval verdict: (ok or bad, its words)."""
    found = {}
    for index, body in re.findall(r'<figure id="i(\d+)".*?>(.*?)</figure>', page, re.S):
        verdict = re.search(r'<span class="verdict (ok|bad)">eval: (.*?)</span>', body)
        if verdict:
            found[int(index)] = (verdict.group(1), verdict.group(2))
    return found


def test_the_page_shows_an_evals_verdicts_beside_each_image_it_judged(small_run, tmp_path, cli_here):
    out = _copy(small_run, tmp_path)
    # against the run's own folder: every image identical to its reference
    proc = cli_here("eval", str(out), "--reference", str(small_run), "--json", str(out / "eval.json"))
    assert proc.returncode == 0, proc.stderr
    rows = {row["index"]: row for row in json.loads((out / "eval.json").read_text())["images"]}
    assert len(rows) == 4 * COPIES
    result = build(str(out))  # OUTPUT/eval.json, found without being named
    page = (out / "report.html").read_text()
    verdicts = _verdicts(page)
    assert result["judged"] == len(verdicts) == 4 * COPIES
    for index, (kind, words) in verdicts.items():
        adherence = rows[index].get("adherence", {})
        assert words.endswith("PSNR inf, SSIM 1.000"), words
        assert all(f"{key} {'✓' if passed else '✗'}" in words for key, passed in adherence.items()), words
        assert kind == ("ok" if all(adherence.values()) else "bad")
    assert '<h2 id="eval">Eval</h2>' in page and "8 images judged" in page

    # a result of other images (another prompt at an index) judges nothing there; a shapes caption's
    # adherence is shown check by check; a file that is no result is refused
    other = json.loads((out / "eval.json").read_text())
    other["images"][0]["prompt"] = "a yellow star"
    other["images"][1]["adherence"] = {"colour": True, "shape": False}
    other["summary"]["adherence"] = {"colour": {"share": 0.75, "images": 4}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    build(str(out), eval_result=str(tmp_path / "other.json"))
    page = (out / "report.html").read_text()
    verdicts = _verdicts(page)
    assert set(verdicts) == set(range(1, 4 * COPIES))
    assert verdicts[1] == ("bad", "colour ✓ · shape ✗ · PSNR inf, SSIM 1.000")
    assert "colour right in 75% of 4" in page
    (tmp_path / "bad.json").write_text("[1, 2]")
    proc = cli_here("report", str(out), "--eval", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "is not the result of lightning-diffusion eval" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_status_prints_images_per_device_hour_beside_its_rate(small_run, cli_here):
    last = json.loads((small_run / "run.json").read_text())["history"][-1]
    expected = last["made"] * 3600 / (last["wall_s"] * len(last["images_per_s_by_rank"]))
    proc = cli_here("status", str(small_run))
    assert proc.returncode == 0, proc.stderr
    assert f"{expected:,.0f} images per device-hour" in proc.stdout, proc.stdout
    assert json.loads(cli_here("status", "--json", str(small_run)).stdout)["images_per_device_h"] == pytest.approx(
        expected)


def test_a_folder_that_is_no_output_is_refused_in_one_line(tmp_path, cli_here):
    (tmp_path / "photos").mkdir()
    for folder in (tmp_path / "photos", tmp_path / "missing"):
        proc = cli_here("report", str(folder))
        assert proc.returncode == 2 and not proc.stdout
        assert len(proc.stderr.strip().splitlines()) == 1 and "lightning-diffusion report: error:" in proc.stderr


def test_a_run_still_writing_is_said_and_its_parts_shown_by_rank(small_run, tmp_path):
    out = _copy(small_run, tmp_path)
    (out / "manifest.jsonl").rename(out / "manifest.part-0.jsonl")  # a live run's rank 0 part, not merged yet
    lock = OutputLock(out)
    assert lock.acquire() is None
    try:
        result = build(str(out))
    finally:
        lock.release()
    assert result["running"] and result["images"] == 4 * COPIES
    page = (out / "report.html").read_text()
    assert "A run is writing into it now: this page shows the 8 of 8 outputs done so far." in page
    assert "part-0" in page


def test_webdataset_and_parquet_shards_and_sharded_folders_have_every_thumbnail(tmp_path):
    pytest.importorskip("pyarrow")
    for name, extra in (("tars", ("--writer.format", "webdataset", "--writer.samples_per_shard", "3")),
                        ("parquet", ("--writer.format", "parquet", "--writer.samples_per_shard", "3")),
                        ("sharded", ("--writer.layout", "sharded", "--writer.files_per_folder", "3"))):
        out = tmp_path / name
        _predict(out, *extra)
        result = build(str(out))
        assert result["images"] == result["thumbs_made"] == 4 * COPIES and not result["unreadable"]
        assert sorted(_figures((out / "report.html").read_text())) == list(range(4 * COPIES)), name
    # a Parquet row's thumbnail is its own picture: the row's image, scaled
    import io

    from lightning_diffusion.output.recorded import read_output, scan_manifest
    from lightning_diffusion.report.collect import read_records
    from lightning_diffusion.report.thumbs import thumb_path

    entries, _ = scan_manifest(tmp_path / "parquet")
    for record in read_records(tmp_path / "parquet")[0]:
        assert record.file.endswith(".parquet") and record.member
        source = Image.open(io.BytesIO(read_output(tmp_path / "parquet", entries[record.index])))
        thumb = Image.open(thumb_path(tmp_path / "parquet" / ".thumbs", record)).convert("RGB")
        expected = source.convert("RGB")
        expected.thumbnail(thumb.size)
        assert thumb.size == expected.size and np.abs(np.asarray(thumb, float) - np.asarray(expected, float)).mean() < 8


@contextlib.contextmanager
def _bucket(monkeypatch, name: str):
    """A local S3 server (moto) for the ``with`` block, its bucket ``name`` made, the environment
    pointing at it."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in dict(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="testing",
                               AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                               AWS_EC2_METADATA_DISABLED="true").items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
        yield
    finally:
        server.stop()


@pytest.mark.slow
def test_a_bucket_is_read_through_its_store(tmp_path, monkeypatch):
    with _bucket(monkeypatch, "reports"):
        _predict("s3://reports/run", "--writer.format", "webdataset")
        result = build("s3://reports/run", html=str(tmp_path / "run.html"))
    assert result["images"] == result["thumbs_made"] == 4 * COPIES
    assert (tmp_path / "run.thumbs").is_dir(), "a bucket's thumbnails are kept beside the page"
    assert sorted(_figures((tmp_path / "run.html").read_text())) == list(range(4 * COPIES))


def test_a_buckets_run_keeps_its_metrics_file_at_the_buckets_counts(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    with _bucket(monkeypatch, "metrics"):
        _predict("s3://metrics/run", "--writer.format", "webdataset", "--writer.metrics_file",
                 str(tmp_path / "run.prom"))
    final = {sample.name: sample.value
             for family in text_string_to_metric_families((tmp_path / "run.prom").read_text())
             for sample in family.samples if not sample.labels}
    assert final["lightning_diffusion_images_written"] == final["lightning_diffusion_images_expected"] == 4 * COPIES
    assert final["lightning_diffusion_seconds_per_batch_count"] == 2 and final["lightning_diffusion_running"] == 0


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _metrics_config(tmp_path: Path, port: int, file: Path, via: str = "callback") -> Path:
    """tiny.yaml with live metrics on ``port`` and in ``file``: kept by the ``writer`` (its
    metrics keys) or by the ``callback`` (``PrometheusMetrics``)."""
    import yaml

    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    if via == "writer":
        config["writer"] = {**(config.get("writer") or {}), "metrics_port": port, "metrics_file": str(file)}
    else:
        config["trainer"]["callbacks"] = [{"class_path": "lightning_diffusion.output.metrics.PrometheusMetrics",
                                           "init_args": {"port": port, "file": str(file), "interval_s": 0.05,
                                                         "host": "127.0.0.1"}}]
    path = tmp_path / "metrics.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("via", ["writer", "callback"])
def test_metrics_scraped_during_a_real_run_end_at_the_manifests_counts(tmp_path, via):
    import threading
    import urllib.request

    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    port, file, out = _free_port(), tmp_path / "run.prom", tmp_path / "run"
    scraped: list[dict[str, float]] = []
    stop = threading.Event()
    from lightning_diffusion.output.metrics import port_problem

    def scrape() -> None:
        while not stop.is_set():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                stop.wait(0.02)
                continue
            scraped.append({sample.name: sample.value for family in text_string_to_metric_families(text)
                            for sample in family.samples if not sample.labels})

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        run_here("predict", "--config", str(_metrics_config(tmp_path, port, file, via)),
                 "--writer.output_dir", str(out),
                 "--data.prompts", "[a red circle, a blue square]", "--data.num_images_per_prompt", "12",
                 "--model.height", "32", "--model.width", "32", "--model.num_inference_steps", "2",
                 "--data.batch_size", "2", "--trainer.enable_progress_bar", "false")
    finally:
        stop.set()
        thread.join()
    assert prometheus_client is not None and scraped, "the endpoint answered during the run"
    written = [sample["lightning_diffusion_images_written"] for sample in scraped
               if "lightning_diffusion_images_written" in sample]
    assert written and written == sorted(written) and written[-1] <= 24, scraped[-3:]
    assert {sample.get("lightning_diffusion_images_expected") for sample in scraped if written} <= {24.0, None}
    manifest = (out / "manifest.jsonl").read_text().splitlines()
    final = {sample.name: sample.value for family in text_string_to_metric_families(file.read_text())
             for sample in family.samples if not sample.labels}
    assert final["lightning_diffusion_images_written"] == len(manifest) == 24
    assert final["lightning_diffusion_images_failed"] == final["lightning_diffusion_images_rejected"] == 0
    assert final["lightning_diffusion_seconds_per_batch_count"] == 12
    assert final["lightning_diffusion_running"] == 0, "the last counts are read once the run gave the folder back"
    assert port_problem(port, "127.0.0.1") is None, "the port is given back at the run's end"
    if via == "writer":  # rank 0's write queue (writer.write_queue: 2 in tiny.yaml's defaults), empty at the end
        depths = [sample["lightning_diffusion_write_queue_depth"] for sample in scraped
                  if "lightning_diffusion_write_queue_depth" in sample]
        assert depths and all(0 <= depth <= 2 for depth in depths), depths
        assert final["lightning_diffusion_write_queue_depth"] == 0
        run = json.loads((out / "run.json").read_text())
        assert "model" in run and not any("metrics" in key for key in run), "the metrics keys decide no picture"


@pytest.mark.parametrize("via", ["writer", "callback"])
def test_metrics_on_a_port_in_use_are_refused_naming_it_before_any_image(tmp_path, via):
    import socket

    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = tmp_path / "run"
        proc = run_here("predict", "--config", str(_metrics_config(tmp_path, port, tmp_path / "x.prom", via)),
                        "--writer.output_dir", str(out), "--data.prompts", "[a red circle]", "--model.height", "32",
                        "--model.width", "32", "--model.num_inference_steps", "2",
                        "--trainer.enable_progress_bar", "false", check=False)
    assert proc.returncode != 0
    assert f"port {port} cannot be served" in proc.stderr, proc.stderr[-2000:]
    assert not list(out.glob("*.png"))
    if via == "writer":  # refused by the CLI's checks: no process started, the folder not made
        assert not out.exists()


def test_a_writer_in_python_refuses_a_metrics_port_in_use_before_the_folder_and_the_weights(tmp_path):
    import socket

    from lightning.pytorch import Trainer

    from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule
    from lightning_diffusion.core.errors import ConfigError

    pytest.importorskip("prometheus_client")
    module = DiffusionModule("tiny:flux", height=32, width=32, num_inference_steps=1)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        writer = ImageWriter(str(tmp_path / "out"), metrics_port=port)
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[writer])
        with pytest.raises(ConfigError, match=f"port {port} cannot be served"):
            trainer.predict(module, datamodule=PromptDataModule(["a fox"], batch_size=1))
    assert module.pipeline is None, "no weights loaded"
    assert not (tmp_path / "out" / "run.json").exists() and not (tmp_path / "out" / ".lock").exists()


def test_a_metrics_port_outside_0_to_65535_is_refused():
    from lightning_diffusion.core.errors import ConfigError
    from lightning_diffusion.output.writer import ImageWriter

    with pytest.raises(ConfigError, match="writer.metrics_port"):
        ImageWriter("out", metrics_port=70000)
