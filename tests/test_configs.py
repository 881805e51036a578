"""Every shipped config parses against the CLI (real-model configs cannot run here: no GPU, no hub)."""

from pathlib import Path

import pytest

from lightning_diffusion.cli import main

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "pretrained_model_name_or_path" in printed and "output_dir" in printed
