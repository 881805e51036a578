"""Speed settings from the config (first part): ``model.compile``, ``model.vae_slicing`` and
``model.attention_backend``.

Compiled runs are compared with the eager single-process reference (same seeds and batch size):
decoded float images within COMPILED_ATOL (inductor fuses and reorders float operations; measured
2.7e-6 for regional compile in one process, 2.6e-6 under Ulysses 2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from tests.conftest import FIVE_PROMPTS, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args, tiny_flux_with

COMPILED_ATOL = 1e-4


@pytest.mark.slow  # torch.compile on CPU: seconds, out of the quick loop
def test_regional_compile_matches_eager_and_compiles_once_per_shape(reference, tmp_path):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() leaves the counters
    proc = run_here(*tiny_args(tmp_path, "--data.batch_size", "1", "--data.prompts", FIVE_PROMPTS,
                               "--model.compile", "regional", "--model.vae_slicing", "true"))
    assert "model.compile: regional on transformer" in proc.stderr
    # FLUX.1 has two repeated block classes; five batches of one shape must not compile again
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < compiled <= 4, dict(torch._dynamo.utils.counters["stats"])
    torch._dynamo.reset()
    ours, ref = load_arrays(tmp_path), reference()
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=COMPILED_ATOL, err_msg=f"image {i}")
    lines = read_manifest_lines(tmp_path)
    assert lines[0]["compile"] == "regional" and lines[0]["vae_slicing"] is True  # metadata of each image
    settings = json.loads((tmp_path / "run.json").read_text())
    assert settings["model.compile"] == "regional" and settings["model.vae_slicing"] is True


@pytest.mark.slow
def test_regional_compile_under_ulysses_matches_one_process(reference, tmp_path):
    proc = run_cli(*tiny_args(tmp_path, "--data.batch_size", "1", "--data.prompts", FIVE_PROMPTS,
                              "--model.compile", "regional", config="configs/tiny-ulysses.yaml"), timeout=900)
    assert "model.compile: regional on transformer" in proc.stdout + proc.stderr
    ours, ref = load_arrays(tmp_path), reference()
    for i in range(5):
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=COMPILED_ATOL, err_msg=f"image {i}")


def test_bad_speed_settings_are_refused_before_loading(tmp_path, cli_here):
    with pytest.raises(ConfigError, match=r"model.compile is regional, full or null, not 'fast'"):
        DiffusionModule("tiny:flux", compile="fast")
    model = tiny_flux_with(tmp_path, "transformer", "SD3Transformer2DModel")
    with pytest.raises(ConfigError, match=r"model.compile: regional compiles a transformer's repeated blocks, and "
                                          r"FluxPipeline's transformer \(SD3Transformer2DModel\) names none; use "
                                          r"model.compile: full"):
        DiffusionModule(str(model), compile="regional")
    proc = cli_here(*tiny_args(tmp_path / "out", "--model.compile", "fast"))
    assert proc.returncode == 2 and "model.compile is regional, full or null" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_model_attention_backend_is_set_on_the_denoisers_and_matches_the_default(reference, tmp_path):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    ref = reference()  # made first: set_attention_backend also sets diffusers' process-wide default
    active = _AttentionBackendRegistry._active_backend
    try:
        module = DiffusionModule("tiny:flux", attention_backend="_native_math")
        module.configure_model()
        processors = [m.processor for m in module.pipeline.transformer.modules() if hasattr(m, "processor")]
        assert processors and {str(p._attention_backend) for p in processors} == {
            "AttentionBackendName._NATIVE_MATH"}
        run_here(*tiny_args(tmp_path, "--data.batch_size", "1", "--data.prompts", FIVE_PROMPTS,
                            "--model.attention_backend", "_native_math"))
        wan = DiffusionModule("tiny:wan", attention_backend="_native_math", compile="regional")
        wan.configure_model()  # Wan 2.1 lists an empty transformer_2: skipped, not an error
    finally:
        _AttentionBackendRegistry._active_backend = active
    ours = load_arrays(tmp_path)
    for i in range(5):  # the math kernel against SDPA's default on CPU
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=1e-5, err_msg=f"image {i}")
    assert read_manifest_lines(tmp_path)[0]["attention_backend"] == "_native_math"


@pytest.mark.parametrize("extra, message", [
    (["--model.attention_backend", "nope"], "model.attention_backend 'nope' is not a diffusers attention backend"),
    (["--model.attention_backend", "_native_cudnn"],
     "model.attention_backend '_native_cudnn' needs bfloat16 or float16 (its kernels take half precision only), but "
     "model.torch_dtype is float32"),
    (["--model.attention_backend", "_native_cudnn", "--model.torch_dtype", "bfloat16"],
     "attention_backend '_native_cudnn' needs a GPU; on CPU use one of: native, _native_math"),
    (["--model.attention_backend", "_native_math", "--trainer.devices", "2", "--trainer.strategy", "ulysses"],
     "attention_backend '_native_math' cannot do context parallelism"),
    (["--model.attention_backend", "_native_math", "--config", "configs/tiny-ulysses.yaml",
      "--trainer.strategy.init_args.attention_backend", "native"],
     "the strategy's attention_backend 'native' and model.attention_backend '_native_math' differ; set one of them."),
])
def test_bad_attention_backends_are_refused_before_loading(extra, message, tmp_path, cli_here):
    proc = cli_here(*tiny_args(tmp_path / "out", *extra))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_ring_attention_on_cuda_needs_a_backend_with_the_log_sum_exp():
    import torch

    from lightning_diffusion.strategies import ParallelDims
    from lightning_diffusion.strategies.checks import resolved_attention_backend

    ring, cuda = ParallelDims(world_size=2, ring=2), torch.device("cuda")  # a device object needs no GPU
    with pytest.raises(ConfigError, match="native does not"):
        resolved_attention_backend("native", cuda, ring, torch.bfloat16)
    assert resolved_attention_backend(None, cuda, ring, torch.bfloat16) == "_native_cudnn"
    assert resolved_attention_backend("native", torch.device("cpu"), ring, torch.float32) == "native"


@pytest.mark.parametrize("backend", ["flash", "_native_flash", "_native_cudnn", "sage"])
def test_half_precision_backends_in_float32_are_refused_before_loading(backend):
    """diffusers checks an attention kernel's dtype only under DIFFUSERS_ATTN_CHECKS: a flash or
    cuDNN backend with float32 weights (the default dtype) would fail at the first step, after every
    weight loaded. Refused from the backend's own constraints in diffusers, for the model's backend
    and for a strategy's, on the planned device type."""
    import torch

    from lightning_diffusion.pipelines.checks import backend_dtype_problems
    from lightning_diffusion.strategies import ContextParallelStrategy

    assert "needs bfloat16 or float16" in " ".join(backend_dtype_problems(backend, torch.float32))
    assert backend_dtype_problems(backend, torch.bfloat16) == backend_dtype_problems(backend, torch.float16) == []
    assert backend_dtype_problems("native", torch.float32) == []

    strategy = ContextParallelStrategy(ulysses_degree=2, attention_backend=backend)
    for dtype, refused in (("float32", True), ("bfloat16", False)):
        request = DiffusionModule("tiny:flux", height=64, width=64, torch_dtype=dtype).request()
        problems = " ".join(map(str, strategy.check_request(request, world_size=2, device_type="cuda")))
        assert (f"the strategy's attention_backend {backend!r} needs bfloat16 or float16" in problems) is refused, \
            problems


def test_a_model_backend_in_float32_is_refused_with_the_module():
    with pytest.raises(ConfigError, match=r"model.attention_backend '_native_cudnn' needs bfloat16 or float16 .*"
                                          r"model.torch_dtype is float32"):
        DiffusionModule("tiny:flux", attention_backend="_native_cudnn")
    DiffusionModule("tiny:flux", attention_backend="_native_cudnn", torch_dtype="bfloat16")
