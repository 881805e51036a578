"""Text encoding and VAE decoding split over the ranks of one replica's model-parallel group.

Without this, every rank of a group (the cfg, ring, ulysses and tp ranks that make the same images)
runs the text encoders and the VAE decoder on the whole batch: work that gets no faster with more
GPUs. ``GroupWork`` installs three things on a loaded pipeline, on every rank of the group:

* **Text encoders by sample.** A diffusers hook on each ``text_encoder*`` component splits a call's
  batch (its tensor arguments, ids and masks, all batch-first) into equal slices, one per rank (the
  last padded with copies of its last row), and all-gathers the tensors of the outputs, so every
  rank gets what one device computes for the whole batch. A call whose tensor arguments are not all
  batch-first (an image encoder's flattened patches) runs whole. The tokenizer padded the batch to
  one length before the call, so the slices have equal shapes. Output fields no diffusion pipeline
  reads (``NOT_GATHERED``: logits, the KV cache) come back as ``None``.
* **VAE decoding by sample.** ``vae.decode`` on a batch of two or more latents decodes one slice per
  rank and all-gathers the images.
* **VAE decoding by tile** (``model.vae_tiling``, for the VAEs in ``TILE_PARALLEL``). The tiles of
  diffusers' own tiled decode are dealt round-robin over the ranks. Pass one runs the VAE's decode
  with its decoder computing only this rank's tiles (the others get a placeholder) and stops where
  the blending starts; the tiles are exchanged; pass two runs the decode again with the decoder
  answering every tile from the exchange, so blending, cropping and clamping are diffusers' own on
  exactly the tiles one device makes: the result is bit-identical to one device's tiled decode.
  A tile is one decoder call (``AutoencoderKL``) or the decoder calls between two ``clear_cache``
  calls (the causal video VAEs decode a tile frame by frame with a temporal cache, so each rank
  decodes its tiles over all frames).

Every rank of the group calls the pipeline with the same inputs, so the collectives here meet in the
same order everywhere. Exactness: tiles are bit-identical; the by-sample splits run the encoders and
the decoder on a smaller batch than one device does, which changes float rounding (within 1e-5 of
one process on the tiny pipelines, see tests/test_group_work.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook

from lightning_diffusion.console import log

HOOK_NAME = "lightning_diffusion.group_split"
# VAE classes whose tiled decode the tile deal is tested on (tests/test_group_work.py).
TILE_PARALLEL = ("AutoencoderKL", "AutoencoderKLWan", "AutoencoderKLQwenImage")
NOT_GATHERED = ("logits", "past_key_values", "cache", "loss")  # transformers 4 and 5 names
_ALIGN = 16  # bytes: every tensor starts at an offset any dtype can be viewed from


class _TilesDecoded(Exception):
    """Raised by pass one where the blending starts: this rank's tiles are done."""


def exchange(tensors: list[torch.Tensor], group: Any, device: torch.device) -> list[list[torch.Tensor]]:
    """Every rank's ``tensors`` (any number, shapes and dtypes) on every rank of ``group``, by rank:
    one all-gather of their shapes and one of their bytes (padded to the longest rank's). The list
    is emptied once packed, so that its tensors can be freed before the others arrive."""
    size = dist.get_world_size(group)
    metas: list[Any] = [None] * size
    dist.all_gather_object(metas, [(tuple(t.shape), t.dtype) for t in tensors], group=group)
    pieces = []
    for tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        pieces += [data, data.new_zeros((-data.numel()) % _ALIGN)]
    lengths = [sum(_padded_bytes(shape, dtype) for shape, dtype in meta) for meta in metas]
    longest = max(lengths)
    mine = torch.cat(pieces + [torch.zeros(longest - sum(p.numel() for p in pieces), dtype=torch.uint8,
                                            device=device)])
    pieces.clear()
    tensors.clear()
    buffers = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(buffers, mine, group=group)
    result = []
    for buffer, meta in zip(buffers, metas):
        offset, unpacked = 0, []
        for shape, dtype in meta:
            count = math.prod(shape) * dtype.itemsize
            unpacked.append(buffer[offset:offset + count].view(dtype).reshape(shape))
            offset += _padded_bytes(shape, dtype)
        result.append(unpacked)
    return result


def _padded_bytes(shape: tuple, dtype: torch.dtype) -> int:
    count = math.prod(shape) * dtype.itemsize
    return count + (-count) % _ALIGN


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (model outputs, tuples, lists); the
    fields of ``NOT_GATHERED`` become ``None``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):  # transformers' ModelOutput and diffusers' BaseOutput are dicts
        fields = {k: None if k in NOT_GATHERED else _map_tensors(v, fn) for k, v in value.items()}
        return type(value)(**fields)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


class _Hook(ModelHook):
    """A module's forward handed to ``route(original_forward, args, kwargs)``."""

    def __init__(self, route: Callable[[Callable, tuple, dict], Any]) -> None:
        super().__init__()
        self.route = route

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.route(self.fn_ref.original_forward, args, kwargs)


class GroupWork:
    """Installed on a loaded pipeline on each rank of a group (see the module docstring);
    ``remove()`` takes it off. ``tiles``: deal the tiles of a tiled decode (the VAE has tiling on)."""

    def __init__(self, pipeline: Any, group: Any) -> None:
        self.pipeline = pipeline
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.encoders = [module for name, module in pipeline.components.items()
                         if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)]
        for module in self.encoders:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(_Hook(self.encode), HOOK_NAME)
        self.vae = getattr(pipeline, "vae", None)
        self.tiles = False
        self.mode = "off"  # decoder calls: "off" (pass through), "collect" (pass one), "replay" (pass two)
        self.calls: list[int] = []  # tile of each decoder call of the current pass
        self.new_tile = True
        self.mine: dict[int, torch.Tensor] = {}
        self.answers: list[torch.Tensor] = []
        # Over the run: calls split by sample, tiles of tiled decodes and this rank's share of them.
        self.encoder_splits = self.decode_splits = self.tiles_seen = self.tiles_decoded = 0
        if isinstance(self.vae, torch.nn.Module) and callable(getattr(self.vae, "decode", None)):
            self._original_decode = self.vae.decode
            self.vae.decode = self.decode
            if type(self.vae).__name__ in TILE_PARALLEL and getattr(self.vae, "use_tiling", False):
                self.tiles = True
                self._wrap_tiling(self.vae)

    @property
    def description(self) -> str:
        parts = [f"text encoding ({len(self.encoders)} encoder{'s' if len(self.encoders) != 1 else ''}) by sample"]
        if self.vae is not None:
            parts.append("VAE decoding by tile" if self.tiles else "VAE decoding by sample")
        return f"{' and '.join(parts)}, over each group of {self.size} ranks"

    def summary(self) -> str:
        """What this rank split so far (every rank of a group splits the same calls)."""
        tiles = f", {self.tiles_seen} tiles dealt (this rank decoded {self.tiles_decoded})" if self.tiles else ""
        return (f"group split: {self.encoder_splits} text-encoder calls and {self.decode_splits} decodes split by "
                f"sample{tiles}")

    def remove(self) -> None:
        for module in self.encoders:
            HookRegistry.check_if_exists_or_initialize(module).remove_hook(HOOK_NAME, recurse=False)
        if self.vae is not None:
            for name in ("decode", "clear_cache", "blend_v", "blend_h"):
                self.vae.__dict__.pop(name, None)
            if self.tiles:
                HookRegistry.check_if_exists_or_initialize(self.vae.decoder).remove_hook(HOOK_NAME, recurse=False)

    # ----------------------------------------------------------------- slices of a batch

    def _chunk(self, batch: int) -> int:
        return -(-batch // self.size)

    def _take(self, value: Any, batch: int) -> Any:
        """This rank's slice of a batch tensor, padded to the chunk with copies of its last row."""
        if not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch):
            return value
        chunk = self._chunk(batch)
        start = min(self.rank * chunk, batch - 1)
        part = value[start:min(start + chunk, batch)]
        if part.shape[0] < chunk:
            part = torch.cat([part, part[-1:].expand(chunk - part.shape[0], *part.shape[1:])])
        return part

    def _gather(self, output: Any, batch: int) -> Any:
        """``output`` of a slice -> the whole batch's: every tensor whose first dimension is the
        chunk is all-gathered and concatenated, the padding rows dropped."""
        chunk = self._chunk(batch)
        local: list[torch.Tensor] = []

        def collect(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() >= 1 and tensor.shape[0] == chunk:
                local.append(tensor)
            return tensor

        _map_tensors(output, collect)
        if not local:
            return output
        count = len(local)
        parts = exchange(local, self.group, local[0].device)
        whole = iter([torch.cat([rank_parts[i] for rank_parts in parts])[:batch] for i in range(count)])

        def replace(tensor: torch.Tensor) -> torch.Tensor:
            return next(whole) if tensor.dim() >= 1 and tensor.shape[0] == chunk else tensor

        return _map_tensors(output, replace)

    # ----------------------------------------------------------------- text encoders

    def encode(self, forward: Callable, args: tuple, kwargs: dict) -> Any:
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 1]
        batch = tensors[0].shape[0] if tensors else 0
        if batch < 2 or any(t.shape[0] != batch for t in tensors):
            # One prompt, or inputs that are not all batch-first (an image encoder's flattened
            # patches): the call runs whole, as on one device.
            return forward(*args, **kwargs)
        output = forward(*(self._take(v, batch) for v in args), **{k: self._take(v, batch) for k, v in kwargs.items()})
        self.encoder_splits += 1
        return self._gather(output, batch)

    # ----------------------------------------------------------------- VAE decoding

    def decode(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.tiles and self._will_tile(z):
            if getattr(self.vae, "use_slicing", False) and z.shape[0] > 1:
                # diffusers decodes sample by sample then; so do we, each one's tiles dealt out.
                outputs = [self._decode_tiles(z[i:i + 1], args, kwargs) for i in range(z.shape[0])]
                return _with_sample(outputs[0], torch.cat([_sample(out) for out in outputs]))
            return self._decode_tiles(z, args, kwargs)
        if z.shape[0] < 2:
            return self._original_decode(z, *args, **kwargs)
        batch = z.shape[0]
        output = self._original_decode(self._take(z, batch), *args, **kwargs)
        self.decode_splits += 1
        return _with_sample(output, self._gather(_sample(output), batch))

    def _will_tile(self, z: torch.Tensor) -> bool:
        """Whether the VAE's decode of ``z`` takes its tiled path (each class's own condition) with
        at least two tiles, so that its blending starts (where pass one stops)."""
        vae = self.vae
        if not vae.use_tiling:
            return False
        if hasattr(vae, "tile_latent_min_size"):  # AutoencoderKL
            limit_h = limit_w = vae.tile_latent_min_size
            stride_h = stride_w = int(vae.tile_latent_min_size * (1 - vae.tile_overlap_factor))
        else:  # the causal video VAEs
            ratio = vae.spatial_compression_ratio
            limit_h, limit_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
            stride_h, stride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
        height, width = z.shape[-2], z.shape[-1]
        tiles = len(range(0, height, max(stride_h, 1))) * len(range(0, width, max(stride_w, 1)))
        return (width > limit_w or height > limit_h) and tiles >= 2

    def _wrap_tiling(self, vae: torch.nn.Module) -> None:
        HookRegistry.check_if_exists_or_initialize(vae.decoder).register_hook(_Hook(self.decoder_call), HOOK_NAME)
        self.counts_tiles_by_cache = callable(getattr(vae, "clear_cache", None))
        if self.counts_tiles_by_cache:
            clear_cache = vae.clear_cache

            def cleared() -> None:
                self.new_tile = True
                clear_cache()

            vae.clear_cache = cleared
        for name in ("blend_v", "blend_h"):
            blend = getattr(vae, name)

            def blended(*args: Any, _blend: Callable = blend, **kwargs: Any) -> Any:
                if self.mode == "collect":
                    raise _TilesDecoded
                return _blend(*args, **kwargs)

            setattr(vae, name, blended)

    def decoder_call(self, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if self.mode == "off":
            return forward(*args, **kwargs)
        if self.new_tile:
            self.calls.append((self.calls[-1] + 1) if self.calls else 0)
            self.new_tile = not self.counts_tiles_by_cache  # AutoencoderKL: every call is a tile
        else:
            self.calls.append(self.calls[-1])
        call = len(self.calls) - 1
        if self.mode == "replay":
            return self.answers[call]
        if self.calls[call] % self.size == self.rank:
            self.mine[call] = forward(*args, **kwargs)
            return self.mine[call]
        x = args[0] if args else next(iter(kwargs.values()))
        return x.new_zeros((x.shape[0], 1, *(1,) * (x.dim() - 2)))  # cat along frames still works

    def _decode_tiles(self, z: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        self.mode, self.calls, self.new_tile, self.mine = "collect", [], True, {}
        try:
            self._original_decode(z, *args, **kwargs)
        except _TilesDecoded:
            pass
        finally:
            self.mode = "off"
        calls = self.calls
        self.tiles_seen += calls[-1] + 1 if calls else 0
        self.tiles_decoded += len({calls[c] for c in self.mine})
        owned = [self.mine[c] for c in sorted(self.mine)]
        self.mine = {}
        parts = exchange(owned, self.group, z.device)
        self.answers = self._answers(calls, parts)
        self.mode, self.calls, self.new_tile = "replay", [], True
        try:
            output = self._original_decode(z, *args, **kwargs)
        finally:
            self.mode, self.answers = "off", []
        if self.calls != calls:
            raise RuntimeError("tile-parallel decoding: the second pass made other decoder calls than the first; "
                               "this VAE's tiled decode is not one the tile deal knows (set model.vae_tiling: false).")
        return output

    def _answers(self, calls: list[int], parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Each decoder call's output, from its owner's share of the exchange (call order)."""
        taken = [iter(share) for share in parts]
        return [next(taken[tile % self.size]) for tile in calls]


def _sample(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _with_sample(output: Any, sample: torch.Tensor) -> Any:
    if isinstance(output, tuple):
        return (sample, *output[1:])
    return type(output)(**{**output, "sample": sample})


def install(pipeline: Any, group: Any) -> Optional[GroupWork]:
    """Split ``pipeline``'s text encoding and decoding over ``group`` (``None``: nothing to split)."""
    if group is None or dist.get_world_size(group) < 2:
        return None
    work = GroupWork(pipeline, group)
    vae = getattr(pipeline, "vae", None)
    if getattr(vae, "use_tiling", False) and not work.tiles:
        log.warning(f"model.vae_tiling: {type(vae).__name__} has no tile-parallel decoding here (known: "
                    f"{', '.join(TILE_PARALLEL)}); each rank of a group decodes all tiles, by sample when the batch "
                    "allows.")
    return work
