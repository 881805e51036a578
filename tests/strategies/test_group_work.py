"""Text encoding and VAE decoding split over each replica's model-parallel group (``group_work``).

Two levels. The split itself, in two real gloo processes, against the same components on one
process: dealt tiles give exactly one device's tiled decode (bit for bit), splits by sample agree
within 1e-5 (smaller batches round differently), and a deliberately wrong gather (two tiles
swapped) fails the same comparison; the exchange under them returns every rank's bytes as they
were sent, as views into one buffer, with a bounded peak; Qwen-Image's encoder split gathers only
the hidden state its pipeline reads, with the same embeddings. Then whole runs of every strategy
with batches of two and tiling, against one process with the same batch size and tiling: decoded
float images within ATOL (measured at most 2.1e-6; Wan cfg 2 with tiles 0).
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_diffusion import DiffusionModule
from lightning_diffusion.cli import end_process
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.strategies import group_work
from lightning_diffusion.strategies.group_work import GroupWork, _one_hidden_state, exchange
from tests.conftest import FIVE_PROMPTS, load_arrays, read_manifest_lines, run_cli, run_here, tiny_args, tiny_flux_with

ATOL = 1e-5
SMALL_TILES = {"tile_sample_min_height": 32, "tile_sample_min_width": 32,
               "tile_sample_stride_height": 24, "tile_sample_stride_width": 24}
PROMPTS = ["a red fox", "a much longer prompt about a lighthouse standing in a storm at night", "ramen"]


class GatherAll(GroupWork):
    """The split without its readers: every hidden state of an encoder call is gathered."""

    def _hidden_state_readers(self, encoders):
        return {}


class SwappedTiles(GroupWork):
    """A wrong gather: the first two tiles' outputs change places."""

    def _answers(self, calls, parts):
        answers = super()._answers(calls, parts)
        first, second = calls.index(0), calls.index(1)
        answers[first], answers[second] = answers[second], answers[first]
        return answers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _latents(vae, name: str, batch: int, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if name == "flux":
        return torch.randn(batch, vae.config.latent_channels, size // 8, size // 8, generator=generator)
    frames = 3 if name == "wan" else 1
    return torch.randn(batch, vae.config.z_dim, frames, size // 8, size // 8, generator=generator)


def _decode(vae, z):
    return vae.decode(z, return_dict=False)[0]


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _split_worker(rank: int, name: str, port: int, out: str) -> None:
    from diffusers import DiffusionPipeline

    from lightning_diffusion.pipelines import tiny

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        pipeline = DiffusionPipeline.from_pretrained(tiny.resolve(f"tiny:{name}"))
        vae, results = pipeline.vae, {}
        with torch.inference_mode():
            # By sample, tiling off: 3 latents over 2 ranks (the second rank pads with a copy).
            z = _latents(vae, name, 3, 32)
            alone = _decode(vae, z)
            encoded_alone = pipeline.encode_prompt(prompt=PROMPTS)
            work = GroupWork(pipeline, dist.group.WORLD)
            results["sample"] = _max_difference(_decode(vae, z), alone)
            received = work.bytes_received
            encoded = pipeline.encode_prompt(prompt=PROMPTS)
            results["readers"] = sorted(code.co_name for code in work.readers)
            received = work.bytes_received - received
            results["encoders"] = len(work.encoders)
            results["splits"] = [work.encoder_splits, work.decode_splits]
            results["encoded"] = [None if a is None else (list(a.shape), _max_difference(a, b))
                                  for a, b in zip(encoded, encoded_alone)]
            results["encoded_none"] = [(a is None) == (b is None) for a, b in zip(encoded, encoded_alone)]
            work.remove()
            if name == "qwenimage":  # the same split gathering every hidden state
                every = GatherAll(pipeline, dist.group.WORLD)
                encoded_every = pipeline.encode_prompt(prompt=PROMPTS)
                results["encoder_bytes"] = [received, every.bytes_received,
                                            pipeline.text_encoder.config.text_config.num_hidden_layers + 1]
                results["same_as_gathering_all"] = [a is b is None or torch.equal(a, b)
                                                    for a, b in zip(encoded, encoded_every)]
                every.remove()
            # By tile: tiling on both sides.
            vae.enable_tiling(**({} if name == "flux" else SMALL_TILES))
            z = _latents(vae, name, 2, 64)
            alone = _decode(vae, z)
            for kind, cls in (("tiles", GroupWork), ("swapped", SwappedTiles)):
                work = cls(pipeline, dist.group.WORLD)
                results[kind] = _max_difference(_decode(vae, z), alone)
                results[f"{kind}_dealt"] = [work.tiles, work.tiles_seen, work.tiles_decoded]
                work.remove()
            results["removed"] = _max_difference(_decode(vae, z), alone)
            # diffusers decodes sample by sample with slicing on: each sample's tiles are dealt
            vae.enable_slicing()
            alone = _decode(vae, z)
            work = GroupWork(pipeline, dist.group.WORLD)
            results["sliced"] = [_max_difference(_decode(vae, z), alone), work.tiles_seen]
            work.remove()
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    # As the CLI does, end without the interpreter's teardown: there a gloo worker thread that
    # still holds a finished all_gather's tensors can abort the process ("terminate called
    # without an active exception", SIGABRT: about one run in fifteen here).
    end_process(0)


@pytest.fixture(scope="module")
def split_results(tmp_path_factory):
    """The split's measurements per tiny pipeline, from two gloo processes (made once per module)."""
    made = {}

    def get(name: str) -> list[dict]:
        if name not in made:
            out = tmp_path_factory.mktemp(f"split-{name}")
            torch.multiprocessing.spawn(_split_worker, args=(name, _free_port(), str(out)), nprocs=2)
            made[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        return made[name]

    return get


@pytest.mark.slow  # two gloo processes
@pytest.mark.parametrize("name", ["flux", "qwenimage", "wan"])
def test_dealt_tiles_equal_one_device_and_a_swap_does_not(name, split_results):
    for rank, results in enumerate(split_results(name)):
        tiled, seen, decoded = results["tiles_dealt"]
        assert tiled and seen >= 4, results
        assert decoded in (seen // 2, seen - seen // 2), f"rank {rank} decoded {decoded} of {seen} tiles"
        assert results["tiles"] == 0.0, f"rank {rank}: tile-parallel decode differs by {results['tiles']}"
        assert results["swapped"] > 1e-3, f"rank {rank}: swapping two tiles went unnoticed"
        assert results["removed"] == 0.0
        assert results["sliced"] == [0.0, 2 * seen], results["sliced"]  # the tiles of each of 2 samples


@pytest.mark.slow  # two gloo processes
@pytest.mark.parametrize("name", ["flux", "qwenimage", "wan"])
def test_split_by_sample_matches_one_process(name, split_results):
    for results in split_results(name):
        assert results["sample"] <= ATOL
        assert results["encoders"] == (2 if name == "flux" else 1)
        # one split call per encoder (Wan's encode_prompt also encodes the default negative "")
        assert results["splits"] == [{"flux": 2, "qwenimage": 1, "wan": 2}[name], 1], results["splits"]
        assert all(results["encoded_none"]), results["encoded_none"]
        # FLUX's and Wan's encoders are called without output_hidden_states
        assert results["readers"] == (["_get_qwen_prompt_embeds"] if name == "qwenimage" else [])
        for entry in results["encoded"]:
            if entry is not None:
                shape, difference = entry
                # every output is per prompt except FLUX's text position ids (512 x 3, shared)
                assert shape[0] == len(PROMPTS) or name == "flux" and shape == [512, 3], shape
                assert difference <= ATOL


@pytest.mark.slow
def test_qwen_encoder_split_gathers_only_the_hidden_state_it_reads(split_results):
    for results in split_results("qwenimage"):
        assert results["readers"] == ["_get_qwen_prompt_embeds"]
        assert results["same_as_gathering_all"] == [True, True], results["same_as_gathering_all"]
        one, every, states = results["encoder_bytes"]
        assert states >= 3 and one > 0 and one * states == every, results["encoder_bytes"]


# ----------------------------------------------------------------------------- the exchange

MIB = 1 << 20


def _rank_tensors(rank: int) -> list[torch.Tensor]:
    """What ``rank`` sends: dtypes, odd byte counts (padding), a NaN with a payload, -0.0, an empty
    and a 0-dim tensor, a non-contiguous one, and another number of tensors on each rank."""
    generator = torch.Generator().manual_seed(rank)
    odd = torch.randn(3, 5, 7, generator=generator)  # 420 bytes: padded to 432
    odd.view(torch.int32)[0, 0, 0] = 0x7FC00123  # a NaN with a payload
    odd[0, 0, 1] = -0.0
    tensors = [odd, torch.randn(2, 9, generator=generator).to(torch.bfloat16),
               torch.randint(-2**40, 2**40, (5,), generator=generator), torch.rand(3, 3, generator=generator) > 0.5,
               torch.empty(0, 4), torch.tensor(rank + 0.5, dtype=torch.float64),
               torch.randn(6, 4, generator=generator).t()]
    return tensors[:len(tensors) - rank]


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _peak_above(start: int) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) - start


def _exchange_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = {}
    try:
        # exchange's own path on gloo (broadcasts), then the all-gather into one tensor it takes on NCCL
        for path, backends in (("broadcast", ("gloo", "mpi")), ("all_gather_single", ())):
            group_work._BROADCAST_BACKENDS = backends
            parts = exchange(_rank_tensors(rank), dist.group.WORLD, torch.device("cpu"))
            results[path] = {
                "bytes": [[_raw(a) == _raw(b) and a.shape == b.shape and a.dtype == b.dtype
                           for a, b in zip(share, _rank_tensors(r))] + [len(share) == len(_rank_tensors(r))]
                          for r, share in enumerate(parts)],
                "storages": len({t.untyped_storage().data_ptr() for share in parts for t in share}),
                "storage_bytes": parts[0][0].untyped_storage().nbytes(),
            }
        group_work._BROADCAST_BACKENDS = ("gloo", "mpi")
        # Memory: 2 tiles of 40 MiB per rank (above glibc's largest mmap threshold, so each is its
        # own mapping, returned when freed); the list is their only reference, as in a tiled decode.
        tiles = [torch.full((40 * MIB // 4,), float(rank + i)) for i in range(2)]
        dist.barrier()
        with open("/proc/self/statm") as f:
            start = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak (VmHWM) starts again from here
        except OSError:
            results["grown"] = None
        parts = exchange(tiles, dist.group.WORLD, torch.device("cpu"))
        results.setdefault("grown", _peak_above(start))
        results["tiles"] = [[float(t[0]), float(t[-1])] for share in parts for t in share]
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    end_process(0)


@pytest.mark.slow
def test_exchange_returns_the_bytes_sent_in_one_buffer_with_a_bounded_peak(tmp_path):
    """The exchange's results are every rank's tensors byte for byte (what the list all-gather it
    replaced returned), views into one buffer of the gathered size; and its peak above the start
    stays under the gathered bytes (4 x 40 MiB; measured 80 MiB, as this rank's own tiles are freed
    once packed). Holding a second copy (per-rank buffers, or a backend's staging tensor) reaches
    2.1x (list all_gather) or 1.5x (gloo's all_gather_into_tensor): benchmarks/group_work_memory.py."""
    torch.multiprocessing.spawn(_exchange_worker, args=(_free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for path in ("broadcast", "all_gather_single"):
            assert results[path]["bytes"] == [[True] * 8, [True] * 7], (path, results[path]["bytes"])
            assert results[path]["storages"] == 1, path
            longest = sum(-(-n // 16) * 16 for n in (420, 36, 40, 9, 0, 8, 96))  # rank 0's tensors, padded
            assert results[path]["storage_bytes"] == 2 * longest, path
        assert results["tiles"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]
        if results["grown"] is None:
            pytest.skip("/proc/self/clear_refs is not writable here: no peak to measure")
        gathered = 4 * 40 * MIB
        assert results["grown"] <= gathered, f"rank {rank}: peak {results['grown'] / MIB:.0f} MiB above the start"


def _reads_last(self, prompt):
    tokens = self.tokenizer(prompt)
    output = self.text_encoder(input_ids=tokens.input_ids, output_hidden_states=True)
    return output.hidden_states[-1], self.text_encoder.dtype


def _reads_two(self, prompt):
    output = self.text_encoder(input_ids=prompt, output_hidden_states=True)
    return output.hidden_states[-1], output.hidden_states[-2]


def _reads_pooled(self, prompt):
    output = self.text_encoder(input_ids=prompt, output_hidden_states=True)
    return output.hidden_states[-2], output[0]


def _passes_it_on(self, prompt):
    output = self.text_encoder(input_ids=prompt, output_hidden_states=True)
    self.keep(output)
    return output.hidden_states[-1]


def _slices(self, prompt):
    output = self.text_encoder(input_ids=prompt, output_hidden_states=True)
    return output.hidden_states[1:]


def _computed_argument(self, prompt):
    output = self.text_encoder(input_ids=self.tokenize(prompt), output_hidden_states=True)
    return output.hidden_states[-1]


def _aliased(self, prompt):
    encoder = self.text_encoder
    output = self.text_encoder(input_ids=prompt, output_hidden_states=True)
    return output.hidden_states[-1], encoder(prompt)


def _reassigned(self, prompt):
    output = self.text_encoder(input_ids=prompt, output_hidden_states=True)
    first = output.hidden_states[-1]
    output = self.other(prompt)
    return first, output.hidden_states[-1]


def _no_hidden_states_asked(self, prompt):
    output = self.text_encoder(input_ids=prompt)
    return output.hidden_states[-1]


def test_a_reader_of_one_hidden_state_is_recognised_only_when_provably_one():
    found = _one_hidden_state(_reads_last)
    assert found is not None and found[:2] == ("text_encoder", -1)
    assert found[2] == found[3] == _reads_last.__code__.co_firstlineno + 2
    for function in (_reads_two, _reads_pooled, _passes_it_on, _slices, _computed_argument, _aliased, _reassigned,
                     _no_hidden_states_asked):
        assert _one_hidden_state(function) is None, function.__name__


# ----------------------------------------------------------------------------- whole runs

SMALL_TILES_ARG = json.dumps(SMALL_TILES)
RUNS = {
    # name: (config, flags, tiling, processes per group)
    "ulysses2": ("configs/tiny-ulysses.yaml", [], None, 2),
    "dp2-ulysses2": ("configs/tiny-ulysses.yaml", ["--trainer.devices", "4"], None, 2),
    "tp2-tiles": ("configs/tiny-tp.yaml", [], "true", 2),
    "cfg2": ("configs/tiny-cfg.yaml", [], None, 2),
    "cfg2-ulysses2-tiles": ("configs/tiny-cfg.yaml", [
        "--trainer.devices", "4", "--trainer.strategy.class_path", "lightning_diffusion.strategies.MeshStrategy",
        "--trainer.strategy.init_args.cfg", "2", "--trainer.strategy.init_args.ulysses", "2",
        "--trainer.strategy.init_args.ulysses_anything", "true"], SMALL_TILES_ARG, 4),
    "wan-cfg2-tiles": ("configs/tiny-wan.yaml", ["--trainer.devices", "2", "--trainer.strategy", "cfg_parallel"],
                       SMALL_TILES_ARG, 2),
}
# The single-process config of each, and what both runs share: the flux configs' five prompts
# (like the other parity tests); Wan at 48x48, the smallest size its tiles of 32 split.
ALONE = {"configs/tiny-ulysses.yaml": "configs/tiny-flux.yaml", "configs/tiny-tp.yaml": "configs/tiny-flux.yaml",
         "configs/tiny-cfg.yaml": "configs/tiny-qwenimage.yaml"}
SHARED_ARGS = {"configs/tiny-flux.yaml": ["--data.prompts", FIVE_PROMPTS],
               "configs/tiny-wan.yaml": ["--model.height", "48", "--model.width", "48"]}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Single-process float outputs with batch size 2 (and tiling when asked), made once per module."""
    made = {}

    def get(config: str, tiling) -> dict[int, np.ndarray]:
        key = (config, tiling)
        if key not in made:
            out = tmp_path_factory.mktemp("one-process")
            extra = ["--model.vae_tiling", tiling] if tiling else []
            run_here(*tiny_args(out, "--data.batch_size", "2", *SHARED_ARGS.get(config, []), *extra, config=config))
            made[key] = load_arrays(out)
        return made[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_strategies_with_the_split_match_one_process(name, one_process, tmp_path):
    config, flags, tiling, group = RUNS[name]
    alone = ALONE.get(config, config)
    extra = ["--model.vae_tiling", tiling] if tiling else []
    proc = run_cli(*tiny_args(tmp_path, "--data.batch_size", "2", *SHARED_ARGS.get(alone, []), *flags, *extra,
                              config=config), timeout=600)
    log = proc.stdout + proc.stderr
    assert f"by {'tile' if tiling else 'sample'}, over each group of {group} ranks" in log, log[-3000:]
    # the split happened (a run whose calls all ran whole would match too)
    done = re.search(r"group split: (\d+) text-encoder calls and (\d+) decodes split by sample"
                     r"(, (\d+) tiles dealt \(this rank decoded (\d+)\))?", log)
    assert done, log[-3000:]
    encoder_calls, decodes, tiles, mine = (int(value or 0) for value in done.group(1, 2, 4, 5))
    assert encoder_calls > 0 and (0 < mine < tiles if tiling else decodes > 0), done.group(0)
    ours, ref = load_arrays(tmp_path), one_process(alone, tiling)
    assert sorted(ours) == sorted(ref) and len(read_manifest_lines(tmp_path)) == len(ref)
    for i in ref:
        np.testing.assert_allclose(ours[i], ref[i], rtol=0, atol=ATOL, err_msg=f"{name}: output {i}")


@pytest.mark.slow
def test_split_can_be_switched_off(tmp_path):
    proc = run_cli(*tiny_args(tmp_path, "--data.prompts", "[a, b]", "--model.split_work", "false",
                              config="configs/tiny-ulysses.yaml"))
    assert "split over the group" not in proc.stdout + proc.stderr
    assert len(load_arrays(tmp_path)) == 2


# ----------------------------------------------------------------------------- bad input

def test_tiling_a_vae_without_tiles_is_refused_before_loading(tmp_path, cli_here):
    model = tiny_flux_with(tmp_path, "vae", "AutoencoderKLTemporalDecoder",
                           {"_class_name": "AutoencoderKLTemporalDecoder"})
    message = ("model.vae_tiling: FluxPipeline cannot decode by tiles: its VAE (AutoencoderKLTemporalDecoder) has no "
               "tiled decoding")
    with pytest.raises(ConfigError, match=r"model\.vae_tiling: FluxPipeline cannot decode by tiles"):
        DiffusionModule(str(model), vae_tiling=True)
    proc = cli_here(*tiny_args(tmp_path / "out", "--model.pretrained_model_name_or_path", str(model),
                               "--model.vae_tiling", "true"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, message", [
    ({"tile_size": 64}, r"AutoencoderKL.enable_tiling takes no settings \(use model.vae_tiling: true\); "
                        r"unknown: tile_size"),
    ("yes", r"model.vae_tiling is true, false or the settings of the VAE's enable_tiling"),
])
def test_bad_tiling_settings(value, message):
    with pytest.raises(ConfigError, match=message):
        DiffusionModule("tiny:flux", vae_tiling=value)


def test_tiling_settings_are_checked_against_the_vae():
    with pytest.raises(ConfigError, match=r"tile_sample_stride_width 64 is larger than tile_sample_min_width 32"):
        DiffusionModule("tiny:wan", vae_tiling={"tile_sample_min_width": 32, "tile_sample_stride_width": 64})
    with pytest.raises(ConfigError, match=r"model.vae_tiling.tile_sample_min_height must be an integer >= 1, got 0"):
        DiffusionModule("tiny:wan", vae_tiling={"tile_sample_min_height": 0})
    with pytest.raises(ConfigError, match=r"AutoencoderKLWan.enable_tiling takes tile_sample_min_height, "):
        DiffusionModule("tiny:wan", vae_tiling={"tile_height": 32})
    assert DiffusionModule("tiny:wan", vae_tiling=SMALL_TILES).options["vae_tiling"] == SMALL_TILES
