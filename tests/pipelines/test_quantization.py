"""``model.quantization``: diffusers' quantization while loading (torchao int8 weight-only on CPU).

Quantized images are compared with the unquantized single-process reference (they must differ, by
a bounded amount: PSNR_FLOOR), and quantized runs with a first-block cache under Ulysses 2 with the
quantized single-process run of the same settings: the same cache decisions, images within
PARITY_ATOL (the same int8 weights, only the attention split differs; measured 2.9e-6). All on
tiny:shapes (configs/tiny.yaml), the trained model, whose pictures quantization can spoil.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from tests.conftest import SHAPES_ARGS, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args
from tests.pipelines.test_cache import FBC, stats

INT8WO = "{backend: torchao, quant_type: int8wo}"
PSNR_FLOOR = 40.0  # dB against full precision; measured 51.4-55.1 dB on tiny:shapes (4 steps)
PARITY_ATOL = 1e-4

pytest.importorskip("torchao")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(1.0 / max(float(np.mean((a - b) ** 2)), 1e-20)))


@pytest.fixture(scope="module")
def quantized_run(tmp_path_factory):
    """One process, batch 1, int8 weights and a first-block cache: (images, cache statistics)."""
    out = tmp_path_factory.mktemp("int8wo")
    proc = run_here(*tiny_args(out, "--data.batch_size", "1", *SHAPES_ARGS, "--model.quantization", INT8WO, *FBC,
                               config="configs/tiny.yaml"))
    return load_arrays(out), stats(proc.stdout + proc.stderr)


def test_int8_weights_load_quantized_and_change_the_pictures_by_a_bounded_amount(reference, tmp_path):
    from torchao.utils import TorchAOBaseTensor

    module = DiffusionModule("tiny:flux", quantization={"backend": "torchao", "quant_type": "int8wo",
                                                        "components": ["transformer", "text_encoder_2"]})
    module.configure_model()
    quantized = {name: any(isinstance(p, TorchAOBaseTensor) for p in component.parameters())
                 for name, component in module.components.items()}
    assert quantized == {"transformer": True, "text_encoder_2": True, "text_encoder": False, "vae": False}

    shapes = ["--data.batch_size", "1", *SHAPES_ARGS]
    run_here(*tiny_args(tmp_path, *shapes, "--model.quantization", INT8WO, config="configs/tiny.yaml"))
    ours, ref = load_arrays(tmp_path), reference("configs/tiny.yaml")
    for i in range(5):
        assert not np.array_equal(ours[i], ref[i]), f"image {i} equals the full-precision one: nothing quantized"
        assert psnr(ours[i], ref[i]) > PSNR_FLOOR, (i, psnr(ours[i], ref[i]))
    assert read_manifest_lines(tmp_path)[0]["quantization"] == {"backend": "torchao", "quant_type": "int8wo"}
    settings = json.loads((tmp_path / "run.json").read_text())
    assert settings["model.quantization"] == {"backend": "torchao", "quant_type": "int8wo"}
    # a resume with other weights would mix pictures: refused before loading
    proc = run_here(*tiny_args(tmp_path, *shapes, config="configs/tiny.yaml"), check=False)
    assert proc.returncode != 0 and "model.quantization" in proc.stderr


@pytest.mark.slow
def test_int8_weights_with_a_step_cache_under_ulysses_match_one_process(quantized_run, tmp_path):
    proc = run_cli(*tiny_args(tmp_path, "--data.batch_size", "1", *SHAPES_ARGS, "--model.quantization", INT8WO, *FBC,
                              "--trainer.devices", "2", "--trainer.strategy", "ulysses", config="configs/tiny.yaml"),
                   timeout=900)
    ref, counts = quantized_run
    assert 0 < counts[0] < counts[1], "the threshold must make the cache reuse some steps and not others"
    assert stats(proc.stdout + proc.stderr) == counts
    ours = load_arrays(tmp_path)
    assert sorted(ours) == sorted(ref) == list(range(5))
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=PARITY_ATOL, err_msg=f"image {i}")


@pytest.mark.parametrize("spec, message", [
    ({"backend": "torchao"}, "model.quantization with torchao needs quant_type: one of int8wo"),
    ({"backend": "torchao", "quant_type": "int3"},
     "model.quantization.quant_type 'int3' is not a torchao quantization"),
    ({"backend": "torchao", "quant_type": "int8wo", "group_sz": 32},
     "torchao's Int8WeightOnlyConfig takes group_size, granularity"),
    ({"backend": "gguf"}, "model.quantization.backend 'gguf' loads checkpoints that are already quantized"),
    ({"backend": "fp4"}, "model.quantization.backend must be one of torchao, bitsandbytes_4bit"),
    ({"backend": "torchao", "quant_type": "int8wo", "components": ["unet", "tokenizer"]},
     "model.quantization.components ['unet', 'tokenizer']: this pipeline's models are text_encoder, "
     "text_encoder_2, transformer, vae."),
    ("int8", "model.quantization is a mapping such as"),
])
def test_bad_quantization_settings_are_refused_before_loading(spec, message):
    with pytest.raises(ConfigError, match=None) as err:
        DiffusionModule("tiny:flux", quantization=spec)
    assert message in str(err.value)


def test_a_backend_that_is_not_installed_is_named_with_its_package():
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    with pytest.raises(ConfigError, match=r"'bitsandbytes_4bit' needs the bitsandbytes package, which is not "
                                          r"installed: pip install bitsandbytes"):
        DiffusionModule("tiny:flux", quantization={"backend": "bitsandbytes_4bit"})


@pytest.mark.parametrize("extra, message", [
    # tensor parallelism shards the transformer while it loads: int8 weights cannot be sharded
    (["--config", "configs/tiny-tp.yaml"], "model.quantization quantizes transformer, which tensor parallelism "
                                            "shards while it loads"),
    # float8 activations need CUDA compute capability 8.9+
    (["--model.quantization", "{backend: torchao, quant_type: float8dq}"],
     "model.quantization: torchao float8dq needs a GPU; on CPU use torchao with quant_type int8wo, int8dq, float8wo"),
    # diffusers leaves weights a device map puts on the CPU unquantized: in a CPU rehearsal, all of them
    (["--config", "configs/tiny-device-map.yaml"], "model.quantization: transformer would load unquantized"),
])
def test_quantization_a_strategy_or_device_cannot_run_is_refused_before_loading(extra, message, tmp_path, cli_here):
    args = tiny_args(tmp_path / "out", "--model.quantization", INT8WO)
    if "--config" in extra:
        args[args.index("--config") + 1] = extra[1]
        extra = extra[2:]
    proc = cli_here(*args, *extra)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_quantization_twice_is_refused():
    with pytest.raises(ConfigError, match="model.quantization and model.from_pretrained_kwargs.quantization_config"):
        DiffusionModule("tiny:flux", quantization={"backend": "torchao", "quant_type": "int8wo"},
                        from_pretrained_kwargs={"quantization_config": {}})


def test_a_device_map_that_offloads_a_quantized_component_is_refused_on_gpus_too():
    from lightning_diffusion.strategies import DeviceMapStrategy

    module = DiffusionModule("tiny:flux", quantization={"backend": "torchao", "quant_type": "int8wo"})
    strategy = DeviceMapStrategy(device_map={"transformer": "cpu"})
    problems = strategy.check_request(module.request(), world_size=1, device_type="cuda")
    assert any("device_map puts transformer on the CPU or disk, where diffusers does not quantize" in str(p)
               for p in problems), problems
