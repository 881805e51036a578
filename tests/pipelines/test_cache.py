"""Step caching (``model.cache``): the first-block cache decides per image and agrees its decisions
over the ranks that share a transformer call; the other caches run as diffusers builds them;
bad cache settings are refused before any weight loads.

Tolerances: a parallel run with the cache equals one process with the same cache within 1e-5
(measured at most 3.9e-6 for Ulysses, ring, tp and cfg at 2 processes, 8 steps, threshold 0.2);
batch 1 against batch 4 within 1e-5 (measured 2.4e-6: batched kernels round differently for a
different batch size, as without a cache). The decisions themselves are compared exactly, through
the counts of reused image steps.
"""

import re

import numpy as np
import pytest
import torch

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import raise_problems
from lightning_diffusion.input.records import summarize_records
from lightning_diffusion.pipelines.cache import check_cache
from lightning_diffusion.pipelines.checks import model_cache_problems
from lightning_diffusion.pipelines.shapes import caption, held_out_scenes
from tests.conftest import SHAPES_ARGS, load_arrays, run_cli, run_here, tiny_args

ATOL = 1e-5
FBC = ["--model.cache", "{type: first_block, threshold: 0.2}", "--model.num_inference_steps", "8"]
STATS = re.compile(r"first-block cache: \d+% of image steps reused \((\d+) of (\d+)\); "
                   r"(\d+) of (\d+) transformer calls")
STRATEGIES = {
    "ulysses": ["ContextParallelStrategy", "--trainer.strategy.init_args.ulysses_degree", "2"],
    "ring": ["ContextParallelStrategy", "--trainer.strategy.init_args.ring_degree", "2"],
    "tp": ["TensorParallelStrategy"],
    "cfg": ["CFGParallelStrategy"],
}


def stats(log: str) -> tuple[int, ...]:
    found = STATS.search(log)
    assert found, f"no cache statistics line in:\n{log[-3000:]}"
    return tuple(int(v) for v in found.groups())


@pytest.fixture(scope="module")
def cached_reference(tmp_path_factory):
    """One process, batch 1, the first-block cache on: (images, statistics)."""
    out = tmp_path_factory.mktemp("cached")
    proc = run_here(*tiny_args(out, "--data.batch_size", "1", *SHAPES_ARGS, *FBC, config="configs/tiny.yaml"))
    return load_arrays(out), stats(proc.stdout + proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_first_block_cache_agrees_under_model_parallelism(name, cached_reference, tmp_path):
    """diffusers' own first-block cache decides from each rank's shard: under Ulysses the ranks
    stall until the process-group timeout. Ours finishes (a short timeout makes a hang a failure),
    takes exactly the decisions of one process (the same counts) and makes the same images."""
    cls, *init = STRATEGIES[name]
    proc = run_cli(*tiny_args(
        tmp_path, "--data.batch_size", "1", *SHAPES_ARGS, *FBC, "--trainer.devices", "2",
        "--trainer.strategy.class_path", f"lightning_diffusion.strategies.{cls}", *init,
        "--trainer.strategy.init_args.timeout", "120", config="configs/tiny.yaml"), timeout=400)
    images, counts = cached_reference
    reused, image_steps = counts[:2]
    assert 0 < reused < image_steps, "the threshold must make the cache reuse some steps and not others"
    assert stats(proc.stdout + proc.stderr) == counts
    ours = load_arrays(tmp_path)
    assert sorted(ours) == sorted(images) == list(range(5))
    for i in images:
        np.testing.assert_allclose(ours[i], images[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


def _generate(cache, batch_size, steps=12, count=4, compile=None, **call):
    module = DiffusionModule("tiny:shapes", num_inference_steps=steps, cache=cache, compile=compile, **call)
    module.configure_model()
    module.compile_denoisers()
    module.batch_size = batch_size
    prompts = [caption(scene) for scene in held_out_scenes()[:count]]
    images = []
    for first in range(0, count, batch_size):
        batch = [{"index": i, "prompt": prompts[i], "seed": i, "overrides": {}}
                 for i in range(first, first + batch_size)]
        images += [out["image"] for out in module.predict_step(batch)]
    return np.stack(images), module.step_cache


def test_first_block_cache_decides_per_image():
    """Batch 4 and batch 1 take the same decision for every image (equal counts, some batches
    mixed), so an image does not depend on its neighbours; images within the float bound."""
    cache = {"type": "first_block", "threshold": 0.2}
    four, cache4 = _generate(cache, 4)
    one, cache1 = _generate(cache, 1)
    s4, s1 = cache4.stats, cache1.stats
    assert (s4.image_steps, s4.reused_image_steps) == (s1.image_steps, s1.reused_image_steps)
    assert 0 < s4.reused_image_steps < s4.image_steps
    # Mixed batches happened: more images reused than whole calls skipped could account for.
    assert s4.skipped_calls * 4 < s4.reused_image_steps
    np.testing.assert_allclose(four, one, rtol=0, atol=ATOL)
    uncached, _ = _generate(None, 4)
    assert np.abs(four - uncached).max() > 1e-3, "the cache reused steps but changed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regional", "full"])
def test_compiled_first_block_cache_compiles_a_bounded_number_of_graphs_and_decides_as_eager(mode):
    """The cache's decisions run outside the compiled graphs: guards on which images reuse, the
    guidance branch or the last block would make a graph per pattern until dynamo's recompile limit
    (8 per code object), after which it runs eagerly without a word (17 graphs were made here for 3
    batches when the decisions were traced). Decisions equal eager's; images within the float bound."""
    from torch._dynamo.utils import counters

    cache = {"type": "first_block", "threshold": 0.5}
    call = {"call_kwargs": {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}}
    eager, eager_cache = _generate(cache, 2, steps=8, count=6, **call)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_cache = _generate(cache, 2, steps=8, count=6, compile=mode, **call)
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= {"regional": 4, "full": 8}[mode], dict(counters["stats"])
    e, c = eager_cache.stats, compiled_cache.stats
    assert (c.image_steps, c.reused_image_steps) == (e.image_steps, e.reused_image_steps)
    assert 0 < e.reused_image_steps < e.image_steps
    np.testing.assert_allclose(compiled, eager, rtol=0, atol=ATOL)


@pytest.mark.parametrize("cache", [
    {"type": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 2, "taylor_factors_dtype": "float32"},
    {"type": "magcache", "threshold": 0.5, "retention_ratio": 0.1,
     "mag_ratios": [1.0, 1.05, 1.02, 1.01, 1.0, 1.0, 1.0, 0.99, 0.99, 0.98, 0.97, 0.95]},
    {"type": "pyramid_attention_broadcast", "spatial_attention_block_skip_range": 2,
     "spatial_attention_timestep_skip_range": [0, 1000]},
    {"type": "faster_cache", "spatial_attention_block_skip_range": 2,
     "spatial_attention_timestep_skip_range": [-1, 1000]},
], ids=lambda c: c["type"])
def test_other_caches_reuse_work(cache):
    """Each reaches the transformer through its diffusers config: the images change against no
    cache, and stay close to it (no negative pass: PAB and FasterCache refuse one)."""
    cached, _ = _generate(cache, 2, count=2, call_kwargs={"true_cfg_scale": 1.0})
    uncached, _ = _generate(None, 2, count=2, call_kwargs={"true_cfg_scale": 1.0})
    difference = np.abs(cached - uncached).max()
    psnr = 10 * np.log10(1 / np.mean((cached - uncached) ** 2))
    assert difference > 1e-4, f"{cache['type']} changed nothing"
    assert psnr > 15, f"{cache['type']}: {psnr:.1f} dB against no cache"


# ----------------------------------------------------------------------------- bad input


def test_bad_cache_settings_are_refused_together(cli_here, tmp_path):
    proc = cli_here("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(tmp_path / "o"),
                    "--model.cache", "{type: first_block, threshold: 2, treshold: 0.1}")
    assert proc.returncode == 2
    assert "model.cache: first_block takes no 'treshold' (did you mean threshold?)" in proc.stderr
    assert ("model.cache.threshold (relative change of the first block's residual) must be a number in (0, 1]"
            in proc.stderr)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cache, message", [
    ("{type: first_blok}", "model.cache.type 'first_blok' is not a cache type (did you mean first_block?); valid: "
                           "first_block, taylorseer, magcache, pyramid_attention_broadcast, faster_cache."),
    ("first_block", "model.cache: expected dict or null, got 'first_block'"),
    ("{type: magcache}", "magcache needs mag_ratios"),
    ("{type: magcache, calibrate: true, threshold: -1}", "model.cache.threshold (accumulated error) must be"),
    ("{type: faster_cache, is_guidance_distilled: false}", "would split each batch into guidance halves"),
    ("{type: pyramid_attention_broadcast, spatial_attention_block_skip_range: 2}",
     "pyramid_attention_broadcast keeps one state for both guidance passes"),
    ("{type: magcache, calibrate: true, num_inference_steps: 4}",
     "model.cache.num_inference_steps is set from the pipeline"),
    ("{type: magcache, mag_ratios: FLUX_MAG_RATIOS}", "model.cache.mag_ratios must be a list of numbers"),
    ("{type: taylorseer, cache_interval: 0}", "model.cache.cache_interval must be an integer >= 1, got 0."),
    ("{type: first_block, threshold: null}", "model.cache.threshold (relative change of the first block's residual) "
                                             "must be a number in (0, 1], got None"),
    ("{type: taylorseer, taylor_factors_dtype: float33}", "model.cache.taylor_factors_dtype:"),
    ("{type: faster_cache, spatial_attention_timestep_skip_range: [100]}",
     "model.cache.spatial_attention_timestep_skip_range must be two timesteps [low, high], got [100]."),
])
def test_bad_cache(cli_here, tmp_path, cache, message):
    proc = cli_here("predict", "--config", "configs/tiny.yaml", "--writer.output_dir", str(tmp_path),
                    "--model.cache", cache)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_shared_state_caches_are_refused_only_with_a_negative_pass():
    no_cfg = DiffusionModule("tiny:shapes", call_kwargs={"true_cfg_scale": 1.0},
                             cache={"type": "pyramid_attention_broadcast"})
    assert no_cfg.cache["type"] == "pyramid_attention_broadcast"
    raise_problems(model_cache_problems(no_cfg.info, no_cfg.cache, no_cfg.call_args,
                                        summarize_records([{"prompt": "x"}])))
    # A record's own negative prompt, or its own scale above 1, turns the negative pass on.
    module = DiffusionModule("tiny:flux", call_kwargs={"true_cfg_scale": 2.0}, cache={"type": "faster_cache"})
    with pytest.raises(Exception, match="faster_cache keeps one state for both guidance passes"):
        raise_problems(model_cache_problems(module.info, module.cache, module.call_args,
                                            summarize_records([{"prompt": "x", "negative_prompt": "blurry"}])))
    with pytest.raises(Exception, match="pyramid_attention_broadcast keeps one state for both guidance passes"):
        raise_problems(model_cache_problems(no_cfg.info, no_cfg.cache, no_cfg.call_args, summarize_records(
            [{"prompt": "x", "negative_prompt": "", "true_cfg_scale": 4.0}])))


def test_magcache_refuses_records_with_their_own_step_count():
    module = DiffusionModule("tiny:shapes", num_inference_steps=12, cache={"type": "magcache", "calibrate": True})
    raise_problems(model_cache_problems(module.info, module.cache, module.call_args,
                                        summarize_records([{"prompt": "x", "num_inference_steps": 12}])))
    with pytest.raises(Exception, match=r"prompt records set num_inference_steps \[20\]"):
        raise_problems(model_cache_problems(module.info, module.cache, module.call_args,
                                            summarize_records([{"prompt": "x", "num_inference_steps": 20}])))


def test_a_transformer_without_cache_support_is_refused():
    problems = check_cache({"type": "first_block"}, {"transformer": torch.nn.Linear}, "SomePipeline", False)
    assert problems == ["model.cache: SomePipeline's transformer (Linear) has no cache support in diffusers."]


def test_first_block_only_on_verified_transformers():
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    assert check_cache({"type": "first_block"}, {"transformer": FluxTransformer2DModel}, "FluxPipeline", False) == []
    problems = check_cache({"type": "first_block"}, {"transformer": Flux2Transformer2DModel}, "Flux2Pipeline", False)
    assert problems and "first_block is verified on FluxTransformer2DModel" in problems[0]
    # Per-step caches have no block assumptions: allowed there.
    assert check_cache({"type": "taylorseer"}, {"transformer": Flux2Transformer2DModel}, "Flux2Pipeline", False) == []
