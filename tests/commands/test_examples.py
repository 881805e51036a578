"""The examples run as written, with the outputs their docs promise."""

import csv
import subprocess
import sys

import pytest

from tests.conftest import REPO, read_manifest_lines


def stats_lines(out):
    rows = []
    for part in sorted(out.glob("stats.part-*.csv")):
        rows += [(int(index), int(seed)) for index, seed, _ in csv.reader(part.open())]
    return sorted(rows)


@pytest.mark.slow
@pytest.mark.parametrize("args", [[], ["--devices", "2", "--ulysses", "2"]])
def test_image_stats_callback_writes_each_image_once(args, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "examples/image_stats.py", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = [(line["index"], line["seed"]) for line in read_manifest_lines(out)]
    assert stats_lines(out) == manifest == [(i, i) for i in range(4)]  # once, though two ranks made each image
    if args:
        assert len(list(out.glob("stats.part-*.csv"))) == 1  # only the group's writing rank
