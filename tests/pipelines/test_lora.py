"""``model.lora``: random adapters made offline with peft for tiny:flux and tiny:qwenimage, fused
with diffusers' own ``load_lora_weights`` / ``fuse_lora`` in one process, and under data parallel,
Ulysses, CFG parallel and tensor parallel (each rank fusing its slice of every update into its
shards) against that one-process run, within ATOL (measured 2.3e-6 for tp=2 on tiny:flux).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_diffusion import DiffusionModule
from lightning_diffusion.core.errors import ConfigError
from tests.conftest import load_arrays, read_manifest_lines, run_cli, run_here, tiny_args, worst_difference

pytest.importorskip("peft")

ATOL = 1e-5
TARGETS = {"flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "proj_out", "ff.net.0.proj",
                    "ff.net.2"],
           "qwenimage": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "img_mlp.net.2", "txt_mlp.net.0.proj"]}
CONFIGS = {"flux": "configs/tiny-flux.yaml", "qwenimage": "configs/tiny-cfg.yaml"}


def make_adapter(name: str, folder, seed: int = 0, rank: int = 4, alpha: int = 8, **options):
    """A LoRA for tiny:NAME's transformer with random A and B (peft initialises B to zero);
    ``options``: more ``LoraConfig`` arguments."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    from lightning_diffusion.pipelines import tiny

    pipe = DiffusionPipeline.from_pretrained(tiny.resolve(f"tiny:{name}"))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS[name], init_lora_weights=False, **options)
    torch.manual_seed(seed)
    pipe.transformer.add_adapter(config)
    with torch.no_grad():
        for key, param in pipe.transformer.named_parameters():
            if "lora_" in key:
                param.normal_(0, 0.3)
    type(pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
                                 transformer_lora_adapter_metadata=config.to_dict())
    return folder / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"flux": make_adapter("flux", root / "flux"), "flux-2": make_adapter("flux", root / "flux-2", seed=1),
            "qwenimage": make_adapter("qwenimage", root / "qwenimage")}


def lora_flag(adapters, *names_and_scales) -> list[str]:
    spec = [{"path": str(adapters[name]), "scale": scale} for name, scale in names_and_scales]
    return ["--model.lora", json.dumps(spec)]


@pytest.fixture(scope="module")
def fused_reference(adapters, tmp_path_factory):
    """One process, batch size 1, diffusers' own fuse: {model: output folder}."""
    made = {}
    for name, extra in {"flux": [("flux", 0.7), ("flux-2", 0.5)], "qwenimage": [("qwenimage", 1.0)]}.items():
        out = tmp_path_factory.mktemp(f"fused-{name}")
        run_here(*tiny_args(out, "--data.batch_size", "1", "--trainer.devices", "1", "--trainer.strategy",
                            "data_parallel", *lora_flag(adapters, *extra), config=CONFIGS[name]))
        made[name] = out
    return made


def test_adapters_are_fused_as_diffusers_fuses_them_and_recorded(adapters, fused_reference):
    from diffusers import DiffusionPipeline

    from lightning_diffusion.pipelines import tiny

    module = DiffusionModule("tiny:flux", lora=[{"path": str(adapters["flux"]), "scale": 0.7},
                                                {"path": str(adapters["flux-2"].parent), "scale": 0.5}])
    module.configure_model()
    bare = DiffusionPipeline.from_pretrained(tiny.resolve("tiny:flux"))
    plain = {k: v.clone() for k, v in bare.transformer.state_dict().items()}
    bare.load_lora_weights(str(adapters["flux"].parent), adapter_name="a")
    bare.load_lora_weights(str(adapters["flux-2"].parent), adapter_name="b")
    bare.set_adapters(["a", "b"], adapter_weights=[0.7, 0.5])
    bare.fuse_lora(adapter_names=["a", "b"])
    bare.unload_lora_weights()
    ours = module.pipeline.transformer.state_dict()
    assert set(ours) == set(plain), "the adapter layers must be unloaded after fusing"
    for key, value in bare.transformer.state_dict().items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)
    assert any(not torch.equal(ours[k], plain[k]) for k in plain), "nothing was fused"
    line = read_manifest_lines(fused_reference["flux"])[0]
    assert [(a["file"], a["scale"]) for a in line["lora"]] == [("pytorch_lora_weights.safetensors", 0.7),
                                                               ("pytorch_lora_weights.safetensors", 0.5)]
    settings = json.loads((fused_reference["flux"] / "run.json").read_text())
    assert len(settings["model.lora"][0]["sha256"]) == 64


STRATEGIES = {
    "data_parallel_2": ("flux", ["--trainer.devices", "2"]),
    "ulysses_2": ("flux", ["--config", "configs/tiny-ulysses.yaml"]),
    "tp_2": ("flux", ["--config", "configs/tiny-tp.yaml"]),
    "tp_2_x_2_replicas": ("flux", ["--config", "configs/tiny-tp.yaml", "--trainer.devices", "4"]),
    "cfg_2": ("qwenimage", []),
    "qwenimage_tp_2": ("qwenimage", ["--trainer.strategy", "tensor_parallel"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STRATEGIES))
def test_fused_adapters_under_each_strategy_match_one_process(case, adapters, fused_reference, tmp_path):
    model, extra = STRATEGIES[case]
    scales = [("flux", 0.7), ("flux-2", 0.5)] if model == "flux" else [("qwenimage", 1.0)]
    args = tiny_args(tmp_path, "--data.batch_size", "2", *lora_flag(adapters, *scales), config=CONFIGS[model])
    if extra[:1] == ["--config"]:
        args[args.index("--config") + 1] = extra[1]
        extra = extra[2:]
    proc = run_cli(*args, *extra, timeout=600)
    assert "model.lora: " in proc.stdout + proc.stderr
    ours, ref = load_arrays(tmp_path), load_arrays(fused_reference[model])
    assert sorted(ours) == sorted(ref) and ref
    for i in ref:
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")


@pytest.mark.slow
def test_a_wrong_slice_of_the_updates_makes_the_tensor_parallel_pictures_differ(adapters, fused_reference, tmp_path):
    run_cli(*tiny_args(tmp_path, "--data.batch_size", "2", *lora_flag(adapters, ("flux", 0.7), ("flux-2", 0.5)),
                       "--trainer.strategy.class_path", "tests.broken_plans.FirstRankLoraSliceTP",
                       config="configs/tiny-tp.yaml"), timeout=600)
    assert worst_difference(load_arrays(tmp_path), load_arrays(fused_reference["flux"])) > 100 * ATOL


def test_bad_adapters_are_refused_before_loading(adapters, tmp_path):
    pickle = tmp_path / "adapter.bin"
    pickle.write_bytes(b"\x80\x04")
    cases = [
        ([{"path": str(tmp_path / "missing.safetensors")}], "model.lora[0]: " + str(tmp_path / "missing.safetensors")
         + " does not exist"),
        ([{"path": str(pickle)}], "adapter.bin is not a .safetensors file; pickle files run code when they load"),
        ([{"path": str(adapters["flux"]), "scale": "strong"}], "model.lora[0].scale must be a number (negative for "
                                                                "slider adapters), not 'strong'"),
        ([{"path": str(adapters["flux"]), "weight": 1}], "model.lora[0] takes path, weight_name, scale, allow_pickle"),
        ([{"path": str(adapters["qwenimage"])}], "of pytorch_lora_weights.safetensors's layers match no layer of "
                                                 "FluxPipeline: transformer."),
    ]
    for spec, message in cases:
        with pytest.raises(ConfigError) as err:
            DiffusionModule("tiny:flux", lora=spec)
        assert message in str(err.value), (message, str(err.value))
    with pytest.raises(ConfigError, match="an adapter cannot be fused into quantized weights"):
        DiffusionModule("tiny:flux", lora=[{"path": str(adapters["flux"])}],
                        quantization={"backend": "torchao", "quant_type": "int8wo"})


def test_an_adapter_for_another_size_of_the_model_is_refused_before_loading(tmp_path, cli_here):
    from safetensors.torch import save_file

    wrong = tmp_path / "other-size.safetensors"  # x_embedder is 16 -> 64 in tiny:flux; this update makes 128 outputs
    save_file({"transformer.x_embedder.lora_A.weight": torch.randn(4, 16),
               "transformer.x_embedder.lora_B.weight": torch.randn(128, 4)}, str(wrong))
    proc = cli_here(*tiny_args(tmp_path / "out", "--model.lora", json.dumps([{"path": str(wrong)}])))
    assert proc.returncode == 2, proc.stderr
    assert ("model.lora[0]: other-size.safetensors does not fit FluxPipeline's layers: transformer.x_embedder "
            "((16, 64) in x out) gets an update of 16 x 128") in proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_adapter_that_changes_a_layer_shape_is_refused_under_tensor_parallelism(adapters, tmp_path, cli_here):
    from safetensors.torch import save_file

    widened = tmp_path / "control.safetensors"  # a control LoRA widens x_embedder's input (16 -> 32 channels)
    save_file({"transformer.x_embedder.lora_A.weight": torch.randn(4, 32),
               "transformer.x_embedder.lora_B.weight": torch.randn(64, 4)}, str(widened))
    proc = cli_here(*tiny_args(tmp_path / "out", "--model.lora", json.dumps([{"path": str(widened)}]),
                               config="configs/tiny-tp.yaml"))
    assert proc.returncode == 2 and ("model.lora: control.safetensors changes the shape of transformer.x_embedder "
                                     "((64, 16) to (64, 32)), which tensor parallelism cannot shard") in proc.stderr


def test_adapters_fused_into_a_device_map_placement_match_one_process(adapters, fused_reference, tmp_path, cli_here):
    flags = lora_flag(adapters, ("flux", 0.7), ("flux-2", 0.5))
    run_here(*tiny_args(tmp_path / "out", "--data.batch_size", "2", *flags, "--trainer.strategy.init_args.max_memory",
                        "null", "--trainer.strategy.init_args.offload_folder", "null",
                        config="configs/tiny-device-map.yaml"))
    ours, ref = load_arrays(tmp_path / "out"), load_arrays(fused_reference["flux"])
    assert sorted(ours) == sorted(ref)
    for i in ref:
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"image {i}")
    # diffusers would re-place offloaded weights; an update cannot be fused into them
    proc = cli_here(*tiny_args(tmp_path / "refused", *flags, config="configs/tiny-device-map.yaml"))
    assert proc.returncode == 2 and "an update cannot be fused into offloaded weights" in proc.stderr


@pytest.mark.parametrize("options", [
    {"rank_pattern": {"to_q": 2}, "alpha_pattern": {"ff.net.2": 3}},  # per-module ranks and alphas
    {"use_rslora": True},  # alpha / sqrt(r)
], ids=["patterns", "rslora"])
def test_our_in_place_fuse_gives_diffusers_fused_weights(options, tmp_path):
    """The fuse that tensor parallelism and device maps use (each update added to the weights where
    they are) against diffusers' own fuse, for peft's rank and alpha rules."""
    from diffusers import DiffusionPipeline

    from lightning_diffusion.pipelines import lora, tiny

    path = tiny.resolve("tiny:flux")
    adapters = lora.parse([{"path": str(make_adapter("flux", tmp_path, **options)), "scale": 0.6}])
    theirs, ours = DiffusionPipeline.from_pretrained(path), DiffusionPipeline.from_pretrained(path)
    lora.fuse(theirs, adapters)
    lora.fuse_in_place(ours, adapters)
    for key, value in theirs.transformer.state_dict().items():
        torch.testing.assert_close(ours.transformer.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)


def test_adapters_only_diffusers_can_fuse_are_refused_where_we_fuse_ourselves(tmp_path):
    from safetensors.torch import save_file

    from lightning_diffusion.pipelines import lora

    biased = tmp_path / "biased.safetensors"
    save_file({"transformer.proj_out.lora_A.weight": torch.randn(4, 64),
               "transformer.proj_out.lora_B.weight": torch.randn(64, 4),
               "transformer.proj_out.lora_B.bias": torch.randn(64)}, str(biased))
    from diffusers import FluxPipeline

    with pytest.raises(ConfigError, match="has entries that are not LoRA weight pairs"):
        lora.updates(FluxPipeline, lora.parse([{"path": str(biased)}])[0])
