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
  reads (``NOT_GATHERED``: logits, the KV cache) come back as ``None``. Where the pipeline method
  making the call provably reads one hidden state of it and nothing else (``_one_hidden_state``:
  Qwen-Image's ``hidden_states[-1]``), only that state is gathered and the rest is ``None``.
* **VAE decoding by sample.** ``vae.decode`` on a batch of two or more latents decodes one slice per
  rank and all-gathers the images.
* **VAE decoding by tile** (``model.vae_tiling``, for the VAEs in ``specs.TILE_PARALLEL``). The tiles of
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
one process on the tiny pipelines, see tests/strategies/test_group_work.py).
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import sys
import textwrap
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union, cast

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook

from lightning_diffusion.core.console import log
from lightning_diffusion.pipelines.specs import TILE_PARALLEL

if TYPE_CHECKING:
    from diffusers.models.autoencoders.vae import DecoderOutput
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from torch.distributed import ProcessGroup

    # What a diffusers VAE's ``decode`` returns: its output class, or a tuple with ``return_dict=False``.
    _Decoded = Union[DecoderOutput, tuple[torch.Tensor, ...]]

T = TypeVar("T")

HOOK_NAME = "lightning_diffusion.group_split"
# VAE classes whose tiled decode the tile deal is tested on (tests/strategies/test_group_work.py).
NOT_GATHERED = ("logits", "past_key_values", "cache", "loss")  # transformers 4 and 5 names
_ALIGN = 16  # bytes: every tensor starts at an offset any dtype can be viewed from
# Backends whose all-gather into one tensor is not copy-free: gloo's (torch 2.13) cuts the output
# into per-rank chunks and runs its list all-gather, which gathers into a flat staging tensor of the
# whole output and copies out of it; MPI has none. ``exchange`` broadcasts each rank's slot there.
_BROADCAST_BACKENDS = ("gloo", "mpi")
# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _TilesDecoded(Exception):
    """Raised by pass one where the blending starts: this rank's tiles are done."""


def exchange(tensors: list[torch.Tensor], group: ProcessGroup, device: torch.device) -> list[list[torch.Tensor]]:
    """Every rank's ``tensors`` (any number, shapes and dtypes) on every rank of ``group``, by rank:
    one all-gather of their shapes and one of their bytes, each rank's padded to the longest rank's.

    The bytes land in one flat buffer of ``group size x longest`` and the results are views into it:
    nothing else of that size is held. Each rank packs its tensors straight into its own slot of
    the buffer, popping them off ``tensors`` one by one (so that a tensor nobody else holds is freed
    as soon as it is packed), and that slot is the input of an in-place all-gather into one tensor
    (on gloo and MPI: a broadcast from each rank's slot, see ``_BROADCAST_BACKENDS``). A list
    all-gather into per-rank buffers held about twice the gathered bytes (the buffers, and the
    backend's flat staging tensor it copies them out of)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    metas: list[Any] = [None] * size
    dist.all_gather_object(metas, [(tuple(t.shape), t.dtype) for t in tensors], group=group)
    longest = max(sum(_padded_bytes(shape, dtype) for shape, dtype in meta) for meta in metas)
    flat = torch.empty(size * longest, dtype=torch.uint8, device=device)
    mine = flat[rank * longest:(rank + 1) * longest]
    offset = 0
    tensors.reverse()
    while tensors:
        tensor = tensors.pop()
        count, padded = tensor.numel() * tensor.element_size(), _padded_bytes(tuple(tensor.shape), tensor.dtype)
        mine[offset:offset + count].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        mine[offset + count:offset + padded].zero_()
        offset += padded
        del tensor
    mine[offset:].zero_()
    if _backend(group, device) in _BROADCAST_BACKENDS:
        # One in-place broadcast per rank, from its slot (gloo and MPI broadcast into the tensor
        # itself): the same bytes as an all-gather, without the backend's staging copy.
        for source in range(size):
            slot = flat[source * longest:(source + 1) * longest]
            dist.broadcast(slot, src=dist.get_global_rank(group, source), group=group)
    else:
        _all_gather_single(flat, mine, group=group)  # NCCL: in place (the input is the output's slot)
    result = []
    for r, meta in enumerate(metas):
        offset, unpacked = r * longest, []
        for shape, dtype in meta:
            count = math.prod(shape) * dtype.itemsize
            unpacked.append(flat[offset:offset + count].view(dtype).view(shape))
            offset += _padded_bytes(shape, dtype)
        result.append(unpacked)
    return result


def _backend(group: ProcessGroup, device: torch.device) -> str:
    """The backend that carries ``device``'s tensors in ``group`` (``cpu:gloo,cuda:nccl`` -> one)."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        backend = dict(part.split(":", 1) for part in backend.split(",")).get(device.type, backend)
    return backend


def _padded_bytes(shape: tuple, dtype: torch.dtype) -> int:
    count = math.prod(shape) * dtype.itemsize
    return count + (-count) % _ALIGN


def _map_tensors(value: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
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

    fn_ref: Any  # diffusers' HookFunctionReference, whose original_forward it types as None (its initial value)

    def __init__(self, route: Callable[[Callable, tuple, dict], object]) -> None:
        super().__init__()
        self.route = route

    def new_forward(self, module: torch.nn.Module, *args: object, **kwargs: object) -> object:
        return self.route(self.fn_ref.original_forward, args, kwargs)


class GroupWork:
    """Installed on a loaded pipeline on each rank of a group (see the module docstring);
    ``remove()`` takes it off. ``tiles``: deal the tiles of a tiled decode (the VAE has tiling on)."""

    def __init__(self, pipeline: DiffusionPipeline, group: ProcessGroup) -> None:
        self.pipeline = pipeline
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        named = [(name, module) for name, module in pipeline.components.items()
                 if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)]
        self.encoders = [module for _, module in named]
        for name, module in named:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(
                _Hook(functools.partial(self.encode, encoder=name)), HOOK_NAME)
        # The pipeline's methods whose encoder call is read for one hidden state only (code -> what
        # ``_one_hidden_state`` found): such a call gathers only that state.
        self.readers = self._hidden_state_readers({name for name, _ in named})
        self.vae: Any = getattr(pipeline, "vae", None)
        self.tiles = False
        self.mode = "off"  # decoder calls: "off" (pass through), "collect" (pass one), "replay" (pass two)
        self.calls: list[int] = []  # tile of each decoder call of the current pass
        self.new_tile = True
        self.mine: dict[int, torch.Tensor] = {}
        self.answers: list[torch.Tensor] = []
        # Over the run: calls split by sample, tiles of tiled decodes and this rank's share of them.
        self.encoder_splits = self.decode_splits = self.tiles_seen = self.tiles_decoded = 0
        self.bytes_received = 0  # by this rank's exchanges, its own share included
        if isinstance(self.vae, torch.nn.Module) and callable(getattr(self.vae, "decode", None)):
            vae: Any = self.vae  # a diffusers VAE: its methods are not nn.Module's attributes
            self._original_decode: Callable[..., _Decoded] = vae.decode
            vae.decode = self.decode
            if type(vae).__name__ in TILE_PARALLEL and getattr(vae, "use_tiling", False):
                self.tiles = True
                self._wrap_tiling(vae)

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

    def _take(self, value: object, batch: int) -> object:
        """This rank's slice of a batch tensor, padded to the chunk with copies of its last row."""
        if not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch):
            return value
        chunk = self._chunk(batch)
        start = min(self.rank * chunk, batch - 1)
        part = value[start:min(start + chunk, batch)]
        if part.shape[0] < chunk:
            part = torch.cat([part, part[-1:].expand(chunk - part.shape[0], *part.shape[1:])])
        return part

    def _gather(self, output: T, batch: int) -> T:
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
        parts = self._exchange(local, local[0].device)
        whole = iter([_joined([rank_parts[i] for rank_parts in parts])[:batch] for i in range(count)])

        def replace(tensor: torch.Tensor) -> torch.Tensor:
            return next(whole) if tensor.dim() >= 1 and tensor.shape[0] == chunk else tensor

        return cast(T, _map_tensors(output, replace))  # the same structure, its tensors replaced

    def _exchange(self, tensors: list[torch.Tensor], device: torch.device) -> list[list[torch.Tensor]]:
        parts = exchange(tensors, self.group, device)
        self.bytes_received += sum(t.nbytes for share in parts for t in share)
        return parts

    # ----------------------------------------------------------------- text encoders

    def encode(self, forward: Callable, args: tuple, kwargs: dict, encoder: str = "") -> object:
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 1]
        batch = tensors[0].shape[0] if tensors else 0
        if batch < 2 or any(t.shape[0] != batch for t in tensors):
            # One prompt, or inputs that are not all batch-first (an image encoder's flattened
            # patches): the call runs whole, as on one device.
            return forward(*args, **kwargs)
        output = forward(*(self._take(v, batch) for v in args), **{k: self._take(v, batch) for k, v in kwargs.items()})
        self.encoder_splits += 1
        index = self._read_index(encoder) if self.readers and kwargs.get("output_hidden_states") is True else None
        if index is not None:
            output = _only_hidden_state(output, index)
        return self._gather(output, batch)

    def _read_index(self, encoder: str) -> Optional[int]:
        """The one hidden state that the caller of this ``encoder`` call reads, where it is a reader
        (``self.readers``) of this pipeline calling it from the call site that was checked, else None."""
        frame: Optional[FrameType] = sys._getframe(1)
        while frame is not None and str(frame.f_globals.get("__name__")).startswith(_CALL_MACHINERY):
            frame = frame.f_back  # nn.Module.__call__, the hooks' forwards, this module
        if frame is None:
            return None
        found = self.readers.get(frame.f_code)
        if found is None or found[0] != encoder or not found[2] <= frame.f_lineno <= found[3] \
                or frame.f_locals.get("self") is not self.pipeline:
            return None
        return found[1]

    def _hidden_state_readers(self, encoders: set[str]) -> dict[CodeType, tuple[str, int, int, int]]:
        """The methods of the pipeline's class that read one hidden state of an encoder's output and
        nothing else of it (their code -> encoder, index, lines of the call): ``_one_hidden_state``."""
        readers = {}
        for cls in type(self.pipeline).__mro__:
            if cls.__module__.startswith(("diffusers.pipelines.pipeline_utils", "diffusers.configuration_utils",
                                          "builtins")):
                continue
            for function in vars(cls).values():
                if inspect.isfunction(function) and "hidden_states" in _names(function.__code__):
                    found = _one_hidden_state(function)
                    if found is not None and found[0] in encoders:
                        readers[function.__code__] = found
        return readers

    # ----------------------------------------------------------------- VAE decoding

    def decode(self, z: torch.Tensor, *args: object, **kwargs: object) -> _Decoded:
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

    def _wrap_tiling(self, vae: Any) -> None:
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

            def blended(*args: object, _blend: Callable = blend, **kwargs: object) -> torch.Tensor:
                if self.mode == "collect":
                    raise _TilesDecoded
                return _blend(*args, **kwargs)

            setattr(vae, name, blended)

    def decoder_call(self, forward: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
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

    def _decode_tiles(self, z: torch.Tensor, args: tuple, kwargs: dict) -> _Decoded:
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
        parts = self._exchange(owned, z.device)
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


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; a view, not a copy, where the parts lie back to back in one buffer (an
    exchange of one tensor per rank whose bytes need no padding: a decode or one hidden state)."""
    first = parts[0]
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    if all(p.shape == first.shape and p.dtype == first.dtype and p.is_contiguous()
           and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and p.data_ptr() == first.data_ptr() + i * first.nbytes for i, p in enumerate(parts)):
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        return first.as_strided(shape, strides)
    return torch.cat(parts)


def _only_hidden_state(output: Any, index: int) -> Any:
    """An encoder's ``output`` with only ``hidden_states[index]`` left (the rest ``None``, the tuple's
    length kept): all that its caller reads (``_one_hidden_state``). Anything else: as it is."""
    states = output.get("hidden_states") if isinstance(output, dict) else None
    if not isinstance(states, tuple) or not -len(states) <= index < len(states):
        return output
    keep = index % len(states)
    try:
        return type(output)(hidden_states=tuple(s if i == keep else None for i, s in enumerate(states)))
    except TypeError:  # an output class with required fields
        return output


# Modules whose frames lie between a pipeline method and an encoder's hook: nn.Module.__call__,
# diffusers' and accelerate's hooks, this module.
_CALL_MACHINERY = ("torch.nn.modules.", "diffusers.hooks.", "accelerate.hooks", __name__)


def _names(code: CodeType) -> set[str]:
    """The attribute and global names a code object and the code nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if inspect.iscode(constant):
            names |= _names(constant)
    return names


@functools.lru_cache(maxsize=None)
def _one_hidden_state(function: Callable) -> Optional[tuple[str, int, int, int]]:
    """``(encoder, index, first line, last line)`` where ``function`` (a pipeline method) makes a
    call ``out = self.<encoder>(..., output_hidden_states=True)`` on those lines and provably reads
    nothing of its result but ``out.hidden_states[index]``, else ``None``. From its source: that is
    the method's only call of ``self.text_encoder*``, with no call in its arguments; ``out`` is
    assigned nowhere else and read only as ``out.hidden_states[<int>]``, one index throughout (no
    ``locals()``, ``vars()``, ``eval``); the encoder is otherwise only the base of an attribute
    (``self.text_encoder.dtype``). ``GroupWork._read_index`` then takes only a call made from that
    method's frame on those lines as that call. Qwen-Image's ``_get_qwen_prompt_embeds`` is one
    (``hidden_states[-1]``, of 29 with Qwen2.5-VL 7B); SDXL's ``encode_prompt`` is not (it reads
    ``hidden_states[-2]`` and the pooled output)."""
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None
    source = "".join(lines)
    if "output_hidden_states" not in source:
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    definition = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(definition, ast.FunctionDef) or not definition.args.args or definition.args.args[0].arg != "self":
        return None
    nodes = list(ast.walk(definition))
    parents = {child: node for node in nodes for child in ast.iter_child_nodes(node)}

    def self_attribute(node: ast.AST) -> Optional[str]:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        return None

    calls = [node for node in nodes if isinstance(node, ast.Call)
             and (self_attribute(node.func) or "").startswith("text_encoder")]
    if len(calls) != 1:
        return None
    call = calls[0]
    encoder = self_attribute(call.func)
    call_end = call.end_lineno
    assert encoder is not None and call_end is not None  # a text_encoder* call, parsed (with its end line)
    if not any(k.arg == "output_hidden_states" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords):
        return None
    if any(isinstance(node, ast.Call) and node is not call and node.lineno <= call_end
           and (node.end_lineno or node.lineno) >= call.lineno for node in nodes):
        return None  # another call on the encoder call's lines (in its arguments or beside it)
    assignment = parents.get(call)
    if not (isinstance(assignment, ast.Assign) and assignment.value is call and len(assignment.targets) == 1
            and isinstance(assignment.targets[0], ast.Name)):
        return None
    out = assignment.targets[0]
    indices = set()
    for node in nodes:
        if isinstance(node, ast.Name) and node.id in ("locals", "vars", "eval", "exec"):
            return None
        if self_attribute(node) == encoder and node is not call.func and \
                not isinstance(parents.get(node), ast.Attribute):
            return None  # the encoder passed on or aliased
        if isinstance(node, (ast.Global, ast.Nonlocal)) and out.id in node.names or \
                isinstance(node, ast.arg) and node.arg == out.id:
            return None
        if not isinstance(node, ast.Name) or node.id != out.id or node is out:
            continue
        attribute = parents.get(node)
        subscript = parents.get(attribute) if attribute is not None else None
        if not (isinstance(node.ctx, ast.Load) and isinstance(attribute, ast.Attribute)
                and attribute.attr == "hidden_states" and isinstance(subscript, ast.Subscript)
                and subscript.value is attribute and isinstance(subscript.ctx, ast.Load)):
            return None
        try:
            index = ast.literal_eval(subscript.slice)
        except (ValueError, TypeError, SyntaxError):
            return None
        if type(index) is not int:
            return None
        indices.add(index)
    if len(indices) != 1:
        return None
    return encoder, indices.pop(), first + call.lineno - 1, first + call_end - 1


def _sample(output: _Decoded) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _with_sample(output: _Decoded, sample: torch.Tensor) -> _Decoded:
    if isinstance(output, tuple):
        return (sample, *output[1:])
    return type(output)(**{**output, "sample": sample})


def install(pipeline: DiffusionPipeline, group: Optional[ProcessGroup]) -> Optional[GroupWork]:
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
