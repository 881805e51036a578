"""Every shipped config parses against the CLI (real-model configs cannot run here: no GPU, no hub)."""

from pathlib import Path

import pytest

from lightning_diffusion.cli import main

CONFIGS = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["predict", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "pretrained_model_name_or_path" in printed and "output_dir" in printed


REAL = [c for c in CONFIGS if not c.stem.startswith("tiny")]


@pytest.mark.parametrize("config", REAL, ids=[c.stem for c in REAL])
def test_real_model_config_degrees_fit_its_devices_and_model(config):
    """The weights of these models are not here, so their sizes come from the published table:
    the degrees must multiply to devices x nodes, the heads must divide tp x ulysses, and the
    image and text tokens must divide the context-parallel degree (unless an anything-mode)."""
    from lightning_diffusion.pipelines.specs import published
    from lightning_diffusion.run.config import read_config
    from lightning_diffusion.run.preflight import build_strategy, world_size

    cfg = read_config(str(config), check=False)
    known = published(cfg.model.pretrained_model_name_or_path)
    assert known is not None, f"{cfg.model.pretrained_model_name_or_path} is not in the published table"
    spec, sizes = known
    strategy = build_strategy(cfg.trainer.strategy)
    size = world_size(cfg.trainer)
    assert strategy is not None and size is not None, "a real-model config names our strategy and its devices"
    dims = strategy.make_parallel_dims(size)  # raises when the degrees do not fit
    anything = getattr(strategy, "ulysses_anything", False) or getattr(strategy, "ring_anything", False)
    if dims.tp * dims.ulysses > 1 and not getattr(strategy, "ulysses_anything", False):
        assert sizes.heads % (dims.tp * dims.ulysses) == 0, (sizes.heads, dims)
    if dims.cp > 1 and not anything:
        pixels = spec.pixels_per_token
        height, width = cfg.model.height or spec.default_size[0], cfg.model.width or spec.default_size[1]
        assert spec.image_tokens(height, width, cfg.model.num_frames, pixels) % dims.cp == 0
        assert sizes.text_tokens % dims.cp == 0 or spec.prompt_length_text
    if dims.cfg > 1:
        assert spec.cfg is not None


def test_groups_given_as_their_own_files_pass_the_checks_before_loading(tmp_path):
    """``--model m.yaml --data d.yaml --writer w.yaml``: each group read from its file (jsonargparse
    marks it with ``__path__``) is checked as the same group written inline."""
    from lightning_diffusion.run.config import read_config
    from lightning_diffusion.run.preflight import preflight

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    (tmp_path / "m.yaml").write_text("pretrained_model_name_or_path: tiny:shapes\nnum_inference_steps: 2\n")
    (tmp_path / "d.yaml").write_text(f"prompts: {prompts}\nbatch_size: 1\n")
    (tmp_path / "w.yaml").write_text(f"output_dir: {tmp_path / 'out'}\nimage_format: webp\n")
    config = read_config("configs/tiny.yaml", ["--model", str(tmp_path / "m.yaml"), "--data", str(tmp_path / "d.yaml"),
                                               "--writer", str(tmp_path / "w.yaml"), "--trainer.devices", "1"])
    assert "__path__" in config.model and "__path__" in config.writer
    verdict = preflight(config)
    assert verdict.problems == [] and verdict.complete
