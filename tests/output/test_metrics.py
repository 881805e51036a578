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
