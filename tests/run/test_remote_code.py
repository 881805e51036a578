"""Remote code the user opted into that cannot be fetched: one line, exit 2, no traceback."""

import os

import pytest

from tests.conftest import run_cli


@pytest.mark.slow  # a new interpreter: the hub reads HF_HUB_OFFLINE when it is imported
def test_a_custom_pipeline_that_cannot_be_fetched_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as a compute node without network is (read when the hub imports)
    proc = run_cli("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(tmp_path / "out"),
                    "--model.from_pretrained_kwargs", "{trust_remote_code: true, custom_pipeline: someone/pipe}",
                    check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("model.from_pretrained_kwargs.custom_pipeline 'someone/pipe' could not be fetched from the Hugging Face "
            "Hub" in proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "manifest.jsonl")
