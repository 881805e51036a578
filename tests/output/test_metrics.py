"""The live metrics' reading of an output (``metrics.OutputCollector``), without a run; the scrape of a
real run is in ``tests/commands/test_report.py``."""

import json

from lightning_diffusion.output.metrics import OutputCollector


def test_the_metrics_keep_a_slow_read_for_ten_times_its_duration_and_read_afresh_at_the_end(tmp_path):
    now = [0.0]

    def clock() -> float:  # every look at the clock: a second later (a read takes one second)
        now[0] += 1.0
        return now[0]

    (tmp_path / "run.json").write_text(json.dumps({"expected": 4}))
    collector = OutputCollector(str(tmp_path), clock=clock)
    assert collector.status()["expected"] == 4  # read from 1 to 2: kept until 12
    (tmp_path / "run.json").write_text(json.dumps({"expected": 5}))
    seen = [collector.status()["expected"] for _ in range(9)]  # clocks 3 to 11
    assert seen == [4] * 9
    assert collector.status()["expected"] == 5  # clock 12: read again
    (tmp_path / "run.json").write_text(json.dumps({"expected": 6}))
    collector.fresh()
    assert collector.status()["expected"] == 6


def test_each_running_shard_gets_its_images_left_at_its_share_of_the_live_rate():
    from lightning_diffusion.output.metrics import shard_etas

    shards = [{"shard": 0, "done": 40, "expected": 50, "running": True},
              {"shard": 1, "done": 50, "expected": 50, "running": False},
              {"shard": 2, "done": 10, "expected": 50, "running": True}]
    status = {"shards": shards, "rate_per_s": 4.0, "rate_live": True}
    assert shard_etas(status) == {0: 10 / 2.0, 2: 40 / 2.0}  # two running shards share 4 images a second
    assert shard_etas({**status, "rate_live": False}) == {}  # the last run's rate says nothing of this one
    assert shard_etas({**status, "shards": []}) == {}
