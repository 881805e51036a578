"""What the project knows about a pipeline before its weights load.

``inspect_pipeline`` reads only ``model_index.json`` and component ``config.json`` files, so a wrong
path, a folder that is not a diffusers pipeline or a size the pipeline cannot take is reported in
seconds, not after minutes of loading. Per-pipeline knowledge lives in ``specs``.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_diffusion.core.errors import ConfigError, is_int
from lightning_diffusion.core.records import CallArgs
from lightning_diffusion.pipelines.facts import PipelineFacts, derive, no_pictures
from lightning_diffusion.pipelines.specs import PipelineSpec, spec_for

if TYPE_CHECKING:
    import ast

# Arguments the project sets itself for every call; users must not pass them in call_kwargs. (A
# ``negative_prompt`` there is the default of the records that have none of their own.)
RESERVED_CALL_ARGS = (
    "prompt", "generator", "output_type", "num_images_per_prompt", "num_videos_per_prompt", "return_dict",
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class PipelineError(ConfigError):
    """A model path or pipeline argument that cannot work; raised before weights load."""


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise PipelineError(f"torch_dtype {name!r} is not one of {', '.join(DTYPES)}.") from None


def dtype_name(name: str) -> str:
    """The canonical name (``float32``, ``bfloat16``, ``float16``) of a dtype name or alias."""
    return str(resolve_dtype(name)).removeprefix("torch.")


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_bytes(file: Path) -> int:
    """Bytes of the tensors in a safetensors file, from its header alone (no weight is read)."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        count = 1
        for dim in entry["shape"]:
            count *= dim
        total += count * _SAFETENSORS_BYTES.get(entry["dtype"], 4)
    return total


def component_bytes(path: str | Path) -> dict[str, int]:
    """Bytes of weights per component folder of a local pipeline (empty for hub ids): tensor bytes
    from safetensors headers, file sizes for other weight files."""
    sizes = {}
    folder = Path(path)
    for sub in sorted(folder.iterdir()) if folder.is_dir() else []:
        files = [f for f in sub.glob("*") if f.suffix in (".safetensors", ".bin")] if sub.is_dir() else []
        if files:
            sizes[sub.name] = sum(safetensors_bytes(f) if f.suffix == ".safetensors" else f.stat().st_size
                                  for f in files)
    return sizes


@dataclass
class PipelineInfo:
    """The pipeline class and configs of a model folder or hub repository, read without weights."""

    path: str
    class_name: str
    pipeline_class: type[Any]
    model_index: dict[str, Any]
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Call arguments the model folder recommends (its ``lightning_diffusion.json``, "call_defaults"):
    # used where the config sets nothing, e.g. tiny:shapes' size, steps and text length.
    recommended: dict[str, Any] = field(default_factory=dict)
    _facts: Optional[PipelineFacts] = field(default=None, init=False, repr=False, compare=False)
    _spec: Optional[PipelineSpec] = field(default=None, init=False, repr=False, compare=False)

    @property
    def facts(self) -> PipelineFacts:
        """What the pipeline class and its configs say of it (``facts.derive``)."""
        if self._facts is None:
            self._facts = derive(self.pipeline_class, self.model_index, self.configs)
        return self._facts

    @property
    def spec(self) -> PipelineSpec:
        """The registry's entry for this class, its unset facts read from the pipeline itself."""
        if self._spec is None:
            self._spec = spec_for(self.class_name).resolved(self.facts)
        return self._spec

    @property
    def call_parameters(self) -> set[str]:
        return set(inspect.signature(self.pipeline_class.__call__).parameters) - {"self", "kwargs"}

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE downsampling times token packing)."""
        return self.spec.pixels_per_token

    def component_class(self, name: str) -> Optional[type]:
        """The class a component of ``model_index.json`` names, if diffusers or transformers has it."""
        spec = self.model_index.get(name)
        if not (isinstance(spec, list) and len(spec) == 2 and spec[1]):
            return None
        import importlib

        try:
            return getattr(importlib.import_module(spec[0]), spec[1], None)
        except ImportError:
            return None

    def models_with(self, attribute: str) -> dict[str, type]:
        """diffusers model components whose class sets ``attribute`` (``_cp_plan``, ``_tp_plan``).
        transformers models have plans of their own with other meanings, so they are not counted."""
        from diffusers import ModelMixin

        found = {}
        for name in self.model_index:
            cls = None if name.startswith("_") else self.component_class(name)
            if isinstance(cls, type) and issubclass(cls, ModelMixin) and getattr(cls, attribute, None) is not None:
                found[name] = cls
        return found

    def sequence_lengths(self, height: Optional[int], width: Optional[int],
                         call_args: CallArgs) -> dict[str, int]:
        """Token counts context parallelism splits: ``image``, and ``text`` when it has a fixed length
        and the ``_cp_plan`` splits it (Wan's cross-attention keeps the whole text on every rank)."""
        spec, lengths = self.spec, {}
        default = spec.default_size or (None, None)
        height, width = height or default[0], width or default[1]
        if height and width:
            frames = call_args.get(spec.frames_arg) if spec.frames_arg else None
            lengths["image"] = spec.image_tokens(height, width, frames, self.size_multiple)
        if spec.text_length_arg and self.facts.text_split:
            text = call_args.get(spec.text_length_arg, self.call_default(spec.text_length_arg))
            if isinstance(text, int):
                lengths["text"] = text
        return lengths

    def call_default(self, name: str) -> Any:
        parameter = inspect.signature(self.pipeline_class.__call__).parameters.get(name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default

    def effective_call_args(self, named: CallArgs, call_kwargs: Optional[CallArgs]) -> tuple[CallArgs, CallArgs]:
        """(named arguments, other call arguments) as the pipeline is called: the config's, with the
        model folder's recommended values (``recommended``) where the config sets nothing."""
        recommended = {k: v for k, v in self.recommended.items() if k in self.call_parameters}
        base = {k: v if v is not None else recommended.get(k) for k, v in named.items()}
        extra = {**{k: v for k, v in recommended.items() if k not in named}, **dict(call_kwargs or {})}
        return {k: v for k, v in base.items() if v is not None}, extra

    def denoisers(self) -> dict[str, Optional[type]]:
        """The pipeline's transformer components (those its guidance loop calls) and their classes."""
        names = self.spec.cfg.transformers if self.spec.cfg is not None else ("transformer",)
        return {name: self.component_class(name) for name in names if name in self.model_index}

    @property
    def optional_parameters(self) -> set[str]:
        """Call arguments whose default is None (a null value leaves the pipeline's choice)."""
        parameters = inspect.signature(self.pipeline_class.__call__).parameters
        return {name for name, p in parameters.items() if p.default is None}

    def size_problems(self, height: Optional[int], width: Optional[int]) -> list[str]:
        """Sizes the pipeline makes as asked: multiples of its pixels per token, or of the multiple its
        own call rounds sizes up to (``PipelineFacts.rounds_to``), whichever is larger. A pipeline
        without a VAE follows the rule its ``check_inputs`` states (``PipelineFacts.checked_multiple``),
        and none where it states none it can be read from (``size_note``)."""
        multiple = math.lcm(self.size_multiple, self.facts.rounds_to or 1)
        if self.facts.pixel_space:
            multiple = math.lcm(self.facts.checked_multiple or 1, self.facts.rounds_to or 1)
        problems = []
        for name, value in (("height", height), ("width", width)):
            if value is None:
                continue
            if not is_int(value, multiple) or value % multiple:
                hint = f" (for example {max(multiple, round(value / multiple) * multiple)})" if is_int(value) else ""
                problems.append(f"{name}={value!r} cannot be made by {self.class_name}: use a positive multiple of "
                                f"{multiple}{hint}.")
        return problems

    def size_note(self) -> Optional[str]:
        """What a run says of the size of a pipeline without a VAE whose size rule cannot be read:
        the size is not checked, and each image's metadata records the size made."""
        facts = self.facts
        sized = {"height", "width"} & self.call_parameters
        if not facts.pixel_space or facts.checked_multiple is not None or not sized:
            return None
        return (f"{self.class_name} has no VAE, and its check_inputs states no size rule that can be read: height "
                "and width are passed as given, unchecked; each image's metadata records the size made")

    def frames_problems(self, frames: Optional[int]) -> list[str]:
        spec = self.spec
        if frames is None:
            return []
        if spec.frames_arg is None:
            return [f"{self.class_name} makes images, not videos; drop num_frames."]
        scale = spec.temporal_scale or 1
        if frames == spec.default_frames and is_int(frames, 1):
            return []  # its own default, whatever its rule (Helios' 132 frames are made in chunks of 33)
        if not is_int(frames, 1) or (frames - 1) % scale:
            example = max(1, round(((frames if is_int(frames) else 1) - 1) / scale)) * scale + 1
            default = (f", or its default {spec.default_frames}" if spec.default_frames
                       and spec.default_frames != example else "")
            return [f"num_frames={frames!r} cannot be made by {self.class_name}: use {scale} x k + 1 frames "
                    f"(for example {example}{default})."]
        return []

    def call_value_problems(self, values: CallArgs) -> list[str]:
        """Each value fits the type the pipeline's ``__call__`` declares for it (numbers, booleans,
        strings, lists), so that ``"guidance_scale": "high"`` is refused before loading, not deep in
        the first denoising step."""
        parameters = inspect.signature(self.pipeline_class.__call__).parameters
        wrong = []
        for name, value in values.items():
            parameter = parameters.get(name)
            if parameter is None:
                continue
            verdict = matches_annotation(parameter.annotation, value)
            if verdict is False:
                wrong.append(f"{name}={value!r} is not {describe_annotation(parameter.annotation)} "
                             f"({self.class_name}).")
            code_only = _NOT_FROM_A_CONFIG.search(str(parameter.annotation)) if verdict is None else None
            if code_only is not None and value is not None:
                wrong.append(f"{name} takes {code_only[0]} objects, which a config cannot give ({self.class_name}); "
                             "leave it out.")
        return wrong

    @property
    def needed_inputs(self) -> tuple[str, ...]:
        """The input files every record must carry: the registry's (an edit pipeline's image), and a
        ControlNet pipeline's control image (``control_image`` where its call has one, else
        ``image``), read from its ``controlnet`` component, and the input pictures its call uses
        without a test for None (``PipelineFacts.needed_inputs``: LTX image-to-video's ``image``)."""
        needed = list(dict.fromkeys((*self.spec.inputs, *self.facts.needed_inputs)))
        if "controlnet" in self.model_index:
            control = "control_image" if "control_image" in self.call_parameters else "image"
            needed += [control] if control not in needed else []
        return tuple(needed)

    def run_problems(self, given: set[str], record_fields: set[str]) -> list[str]:
        """Why a run of prompts to pictures cannot drive this pipeline, read from its class before any
        weight loads: no ``prompt`` argument (one stage of a larger pipeline), an output that holds no
        pictures, an argument without a default that neither the config (``given``) nor the prompt
        records (``record_fields``: what a record may carry) give, an optional package its module
        uses but that is not installed."""
        name = self.class_name
        parameters = inspect.signature(self.pipeline_class.__call__).parameters
        problems = []
        needed = [arg for arg, p in parameters.items() if arg not in ("self", "prompt") and p.default is p.empty
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if "prompt" not in parameters:
            problems.append(f"{name} takes no prompt (its __call__ has no prompt argument): "
                            f"{without_prompt(parameters, needed)}.")
        why = no_pictures(self.pipeline_class)
        if why is not None:
            problems.append(f"{name} makes no pictures: {why}.")
        needed = [arg for arg in needed if arg not in given | record_fields]
        if needed:
            problems.append(f"{name} needs {', '.join(needed)} (no default), which neither the config nor a prompt "
                            "record can give.")
        problems += [f"{name} needs the package {package}, which is not installed: pip install {package}."
                     for package in missing_packages(self.pipeline_class)]
        return problems + self.component_problems()

    def component_problems(self) -> list[str]:
        """Components of ``model_index.json`` whose class this environment cannot give, as
        ``from_pretrained`` would resolve them (``diffusers``, ``transformers``, or a module of
        ``diffusers.pipelines`` such as Kolors' ``kolors``): a class the library lacks (a folder saved
        by a newer version) or a placeholder for a missing package. Other libraries (a folder's own
        code) are left to the load."""
        import importlib

        problems = []
        for name, entry in self.model_index.items():
            if name.startswith("_") or not (isinstance(entry, list) and len(entry) == 2):
                continue
            library, class_name = entry
            if not (isinstance(library, str) and isinstance(class_name, str)):
                continue  # [null, null]: a component the folder leaves out
            module_name = library if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}"
            if not _has_module(module_name):
                continue  # another library's or the folder's own code: the load resolves it
            module = importlib.import_module(module_name)
            found = getattr(module, class_name, None)
            version = getattr(importlib.import_module(library if module_name == library else "diffusers"),
                              "__version__", "")
            if found is None:
                problems.append(f"{self.class_name}'s {name} is {library}.{class_name}, which {module_name} {version} "
                                f"does not have (a folder saved by another version?): install the version its "
                                f"model_index.json names ({self.model_index.get('_diffusers_version', 'unknown')} of "
                                "diffusers), or re-save the folder with this one.")
                continue
            needs = missing_backends(found)
            if needs:
                problems.append(f"{self.class_name}'s {name} is {library}.{class_name}, which needs {needs}.")
        return problems

    def call_argument_problems(self, names: set[str], where: str) -> list[str]:
        problems = []
        reserved = names & set(RESERVED_CALL_ARGS)
        if reserved:
            problems.append(f"{where} sets {', '.join(sorted(reserved))}, which lightning-diffusion sets per image "
                            "itself; put prompts and seeds in the prompt file instead.")
        from lightning_diffusion.core.records import INPUT_FIELDS

        inputs = names & set(INPUT_FIELDS)
        if inputs:
            problems.append(f"{where} sets {', '.join(sorted(inputs))}: input files belong to each prompt record "
                            f"(a .jsonl line such as {{\"prompt\": \"...\", \"image\": \"in/0001.png\"}}).")
        if "num_frames" in names and self.spec.frames_arg is None:
            problems += [f"{where}: {p}" for p in self.frames_problems(1)]
            names = names - {"num_frames"}
        unknown = names - self.call_parameters - set(RESERVED_CALL_ARGS) - inputs
        if unknown:
            problems.append(
                f"{where}: {self.class_name} does not accept {', '.join(sorted(unknown))}. "
                f"It accepts: {', '.join(sorted(self.call_parameters - set(RESERVED_CALL_ARGS)))}."
            )
        return problems


# Call arguments that carry input pictures (``image``, ``mask_image``, ``example_image``, ``video``,
# Kandinsky's ``hint``), not embeddings of them or adapter images.
_MEDIA_ARG = re.compile(r"(?!ip_adapter_)(?:\w+_)?(?:image|images|video|hint)")


def without_prompt(parameters: Any, needed: list[str]) -> str:
    """What a pipeline whose call has no ``prompt`` argument is, read from what its call takes: text
    under other names (VisualCloze's ``task_prompt``), embeddings or latents another pipeline makes
    (a stage), input pictures (an image-to-depth or image-variation pipeline, an upscaler), another
    condition (DiT's ``class_labels``), or nothing (unconditional)."""
    texts = [a for a in parameters if a.endswith("prompt") and not a.startswith(("negative", "num_"))]
    media = [a for a in parameters if _MEDIA_ARG.fullmatch(a)]
    made_elsewhere = [a for a in needed if "embed" in a or a.endswith("latents")]
    pictures = f" and input pictures ({', '.join(media)})" if media else ""
    if texts:
        return (f"it takes its text as {', '.join(texts)}{pictures}, which a run of prompt records does not "
                "fill; call it directly")
    if made_elsewhere:
        return "it is a stage of a larger pipeline; run the pipeline that makes pictures from prompts"
    if media:
        return (f"it makes its output from input pictures ({', '.join(media)}), not from a prompt, and a run makes "
                "pictures from prompts; call it directly")
    if needed:
        return f"it is conditioned on {', '.join(needed)}, not on a prompt"
    return "it makes pictures without a prompt (unconditional), and a run makes one picture per prompt"


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def missing_backends(cls: object) -> str:
    """What a class diffusers exports only as a placeholder needs (``KolorsPipeline`` without
    sentencepiece, ``ConsisIDPipeline`` without OpenCV): each package that is not installed and the
    install line diffusers' own message gives for it (``pip install opencv-python``), or ""."""
    from diffusers.utils import import_utils
    from transformers.utils import import_utils as transformers_imports

    backends = getattr(cls, "_backends", None) if isinstance(cls, type) else None
    missing = []
    for backend in backends or ():
        available, message = import_utils.BACKENDS_MAPPING.get(
            backend, transformers_imports.BACKENDS_MAPPING.get(backend, (None, "")))
        if available is None or available():
            continue
        line = re.search(r"`(pip\s+install\s+[^`]+)`", message)  # wrapped over two lines in diffusers' text
        install = " ".join(line[1].split()) if line else f"pip install {backend}"
        missing.append(f"the package {install.split()[-1]}, which is not installed: {install}")
    return "; ".join(missing)


def missing_packages(pipeline_class: type) -> list[str]:
    """The optional packages the module of ``pipeline_class`` imports only when they are installed
    (diffusers' ``if is_ftfy_available(): import ftfy``) and then uses without asking again, that
    are not installed here: its call would end in a ``NameError`` after the weights load."""
    import ast
    import importlib

    from lightning_diffusion.pipelines import compat

    compat.apply_pipeline_patches()
    module = inspect.getmodule(pipeline_class)
    try:
        tree = ast.parse(inspect.getsource(module)) if module is not None else None
    except (OSError, TypeError):
        return []
    if tree is None:
        return []
    utils = importlib.import_module("diffusers.utils")
    missing = []
    for node in tree.body:
        if not isinstance(node, ast.If) or node.orelse:
            continue
        check = _availability_check(node.test)
        imports = [statement for statement in node.body if isinstance(statement, (ast.Import, ast.ImportFrom))]
        if check is None or len(imports) != len(node.body):
            continue  # not a bare guarded import (one that also sets a flag lets its uses check the flag)
        names = {(alias.asname or alias.name).split(".")[0] for statement in imports for alias in statement.names}
        asked = sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and _availability_check(n) == check)
        # asked again elsewhere: the module copes without the package (Sana cleans no captions then)
        present = all(hasattr(module, name) for name in names)  # a workaround of ``compat`` stands in
        available = getattr(utils, check, None)
        if not callable(available) or available() or present:
            continue  # a check diffusers does not have (another library's) is not judged here
        if asked == 1 and _used_unguarded(tree, names, check):
            missing.append(check[len("is_"):-len("_available")])
    return missing


def _availability_check(test: ast.expr) -> Optional[str]:
    """``is_ftfy_available`` for ``if is_ftfy_available():``; None for any other test."""
    import ast

    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name):
        return test.func.id if re.fullmatch(r"is_\w+_available", test.func.id) else None
    return None


def _used_unguarded(node: ast.AST, names: set[str], check: str) -> bool:
    """Whether one of ``names`` is read somewhere under ``node`` but not under ``if check():``."""
    import ast

    if isinstance(node, ast.If) and _availability_check(node.test) == check:
        return any(_used_unguarded(child, names, check) for child in node.orelse)
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
        return True
    return any(_used_unguarded(child, names, check) for child in ast.iter_child_nodes(node))


# Argument types that only Python code can pass (tensors, callables, images, generators): a config
# value for one would fail in the first denoising step, after the weights load.
_NOT_FROM_A_CONFIG = re.compile(r"Tensor|Callable|PipelineCallback|Generator|PIL|ndarray|Image")

_TYPE_WORDS = {float: "a number", int: "an integer", bool: "true or false", str: "a string", list: "a list",
               tuple: "a list", dict: "a mapping", type(None): "null"}
_PLURALS = {float: "numbers", int: "integers", bool: "booleans", str: "strings"}


def matches_annotation(annotation: Any, value: object) -> Optional[bool]:
    """Whether a config value fits a pipeline argument's annotation: True, False, or None when the
    annotation says nothing checkable (tensors, images, callables: left to the pipeline)."""
    import types
    import typing

    if annotation is inspect.Parameter.empty or annotation is typing.Any:
        return None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        verdicts = [matches_annotation(member, value) for member in typing.get_args(annotation)]
        return True if True in verdicts else (None if None in verdicts else False)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (bool, str):
        return isinstance(value, annotation)
    if annotation in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, list):
            return False
        inner = typing.get_args(annotation)[:1]
        verdicts = [matches_annotation(inner[0], item) for item in value] if inner else []
        return False if False in verdicts else True
    if annotation is dict or origin is dict:
        return isinstance(value, dict)
    return None


def describe_annotation(annotation: Any) -> str:
    import types
    import typing

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        words = [describe_annotation(a) for a in typing.get_args(annotation) if a is not type(None)]
        return " or ".join(dict.fromkeys(words))
    base = typing.get_origin(annotation) or annotation
    inner = typing.get_args(annotation)[:1]
    if base in (list, tuple) and inner and inner[0] in _PLURALS:
        return f"a list of {_PLURALS[inner[0]]}"
    return _TYPE_WORDS.get(base, getattr(annotation, "__name__", str(annotation)))


def _looks_local(path: str) -> bool:
    """Hub ids are ``owner/name``; anything else that does not exist is a missing local folder."""
    return path.startswith((".", "/", "~")) or path.count("/") != 1


def _read_json(path: str, filename: str, local: bool, hub_options: Optional[dict[str, Any]] = None,
               ) -> Optional[dict[str, Any]]:
    if local:
        file = Path(path) / filename
        return json.loads(file.read_text()) if file.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    try:
        from lightning_diffusion.pipelines.hub import file_options

        return json.loads(Path(hf_hub_download(path, filename, **file_options(hub_options))).read_text())
    except RemoteEntryNotFoundError:  # the repository has no such file (not: it is not cached)
        return None
    except LocalEntryNotFoundError:
        if filename == "model_index.json":
            raise
        return None  # a component's config the cache lacks: missing_from_cache names it


def inspect_pipeline(pretrained_model_name_or_path: str, pipeline_class: Optional[str] = None,
                     from_pretrained_kwargs: Optional[dict[str, Any]] = None) -> PipelineInfo:
    """Resolve ``tiny:`` names, check that the path holds a diffusers pipeline and read its configs.
    ``pipeline_class``: run the weights with another diffusers pipeline class (a task pipeline such
    as ``FluxImg2ImgPipeline`` on FLUX.1 weights), which must need no component the folder lacks.
    A hub id is read at the revision ``from_pretrained_kwargs`` asks for; offline, every file its
    ``from_pretrained`` would read must be in the cache."""
    import diffusers

    from lightning_diffusion.pipelines import hub

    path = pretrained_model_name_or_path
    if isinstance(path, str) and path.startswith("tiny:"):
        from lightning_diffusion.pipelines import tiny  # builds the offline pipeline on first use

        path = tiny.resolve(path)
    local = Path(path).expanduser().exists()
    if local:
        path = str(Path(path).expanduser())
        if not Path(path).is_dir():
            raise PipelineError(f"Model path {path!r} is a file; pass the folder that holds model_index.json.")
    elif _looks_local(path):
        raise PipelineError(f"Model path {path!r} does not exist.")
    options = {} if local else hub.hub_options(from_pretrained_kwargs)
    if not local:
        hub.offline_unless_reachable()
    try:
        model_index = _read_json(path, "model_index.json", local, options)
    except Exception as err:  # network, authentication or repository errors from the hub
        known = hub.message(err, path, options)
        raise PipelineError(known or f"Could not read model_index.json of {path!r}: {err}") from err
    if model_index is None:
        raise PipelineError(
            f"{path!r} is not a diffusers pipeline: it has no model_index.json. "
            "Pass a folder written by DiffusionPipeline.save_pretrained or a hub id of a diffusers pipeline."
        )
    class_name = model_index.get("_class_name")
    diffusers_pipeline = getattr(diffusers, str(class_name), None)
    needs = missing_backends(diffusers_pipeline)
    if needs:
        raise PipelineError(f"{path!r}: {class_name} is a pipeline class of diffusers {diffusers.__version__} that "
                            f"needs {needs}.")
    if not (isinstance(diffusers_pipeline, type) and issubclass(diffusers_pipeline, diffusers.DiffusionPipeline)):
        raise PipelineError(
            f"{path!r}: model_index.json names {class_name!r}, which is not a pipeline class of "
            f"diffusers {diffusers.__version__}."
        )
    class_name = str(class_name)  # it named a pipeline class of diffusers
    configs = {}
    for name, spec in model_index.items():
        if name.startswith("_") or not isinstance(spec, list):
            continue
        config = _read_json(path, f"{name}/config.json", local, options)
        if config is not None:
            configs[name] = config
    if not local and hub.offline():
        missing = hub.missing_from_cache(path, options)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise PipelineError(f"{path}: {len(missing)} file(s) its from_pretrained reads are missing from the "
                                f"Hugging Face cache ({hub.cache_folder(options)}) and {hub.offline_reason()}: "
                                f"{shown}. Fetch them on a machine with network: {hub.download_command(None)}.")
    recommended = (_read_json(path, RECOMMENDED_FILE, local) or {}).get("call_defaults", {}) if local else {}
    cls = diffusers_pipeline
    if pipeline_class is not None and pipeline_class != class_name:
        cls = task_pipeline(pipeline_class, class_name, model_index)
        class_name = pipeline_class
    return PipelineInfo(path, class_name, cls, model_index, configs, dict(recommended))


def task_pipeline(name: object, weights_class: str, model_index: dict[str, Any]) -> type[Any]:
    """``model.pipeline_class``: a diffusers pipeline class that the folder's components can build."""
    import diffusers

    cls = getattr(diffusers, str(name), None)
    needs = missing_backends(cls)
    if needs:
        raise PipelineError(f"model.pipeline_class {name} is a pipeline class of diffusers {diffusers.__version__} "
                            f"that needs {needs}.")
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise PipelineError(f"model.pipeline_class {name!r} is not a pipeline class of diffusers "
                            f"{diffusers.__version__}.")
    optional = set(getattr(cls, "_optional_components", []) or [])
    needed = [p.name for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.default is inspect.Parameter.empty and p.name not in optional
              and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    missing = [n for n in needed if n not in model_index]
    if missing:
        raise PipelineError(f"model.pipeline_class {name} needs {', '.join(missing)}, which these {weights_class} "
                            f"weights do not have.")
    return cls


RECOMMENDED_FILE = "lightning_diffusion.json"
