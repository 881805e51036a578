"""Per-record input files (``image``, ``mask_image``...): checked before loading, read on the rank
that needs them, and named with their SHA-256 in each output's metadata."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from lightning_diffusion.core.records import INPUT_FIELDS, InputFiles, Record, Sample
from lightning_diffusion.core.system import file_stat, sha256


def record_inputs(record: Mapping[str, Any]) -> InputFiles:
    """The record's input files by field (``image``: a path or a list of paths)."""
    return {name: record[name] for name in INPUT_FIELDS if record.get(name) is not None}


def _paths(value: Union[str, list[str]]) -> list[str]:
    return value if isinstance(value, list) else [value]


class TooLarge(Exception):
    """An input image over ``data.max_pixels``, found from its header."""


def _image_size(path: str, max_pixels: Optional[int] = None) -> tuple[int, int]:
    """The image's (width, height), after reading the whole file (a truncated PNG fails here);
    an image over ``max_pixels`` is refused from its header, before its pixels are read."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # Pillow's own warning for large images: ours is the refusal
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)
        with image:
            size = image.size
            if max_pixels is not None and size[0] * size[1] > max_pixels:
                raise TooLarge(f"it is {size[0]}x{size[1]}, {size[0] * size[1]:,} pixels, over data.max_pixels "
                                 f"{max_pixels:,}")
            image.verify()
    except Image.DecompressionBombError as err:  # Pillow's own limit, far above ours
        raise TooLarge(f"over data.max_pixels ({err})") from None
    return size


def file_problems(records: Sequence[Record], positions: Iterable[int], root: Optional[str] = None,
                  max_pixels: Optional[int] = None) -> dict[int, list[str]]:
    """The records at ``positions`` whose input files are missing, unreadable, not images, over
    ``max_pixels``, or masks of another size than their image, and (with ``root``,
    ``data.inputs_root``) files outside ``root`` once links and ``..`` are resolved: position ->
    problems."""
    found: dict[int, list[str]] = {}
    base = Path(root).expanduser().resolve() if root else None
    if base is not None and not base.is_dir():
        base = None  # data_problems says so
    for position in positions:
        record = records[position]
        problems: list[str] = []
        sizes: dict[str, list[Optional[tuple[int, int]]]] = {}
        for name, value in record_inputs(record).items():
            sizes[name] = []
            for path in _paths(value):
                size = None
                if base is not None and not Path(path).resolve().is_relative_to(base):
                    problems.append(f"{name} {path} leaves data.inputs_root {root} (it resolves to "
                                    f"{Path(path).resolve()}).")
                elif not Path(path).is_file():
                    problems.append(f"{name} {path} does not exist.")
                else:
                    try:
                        size = _image_size(path, max_pixels)
                    except TooLarge as err:
                        problems.append(f"{name} {path}: {err}.")
                    except Exception as err:  # PIL raises several kinds for a file it cannot read
                        problems.append(f"{name} {path} is not a readable image ({type(err).__name__}: {err}).")
                sizes[name].append(size)
        image, mask = sizes.get("image", [None])[0], sizes.get("mask_image", [None])[0]
        if image is not None and mask is not None and image != mask:
            problems.append(f"mask_image is {mask[0]}x{mask[1]} and image {image[0]}x{image[1]}; a mask must have its "
                            "image's size.")
        if problems:
            found[position] = problems
    return found


def upright_size(path: str) -> tuple[int, int]:
    """The (width, height) the pipeline gets (``load`` turns camera JPEGs upright), from the header."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
        turned = image.getexif().get(0x0112) in (5, 6, 7, 8)  # EXIF orientations a quarter turn away
    return (height, width) if turned else (width, height)


def input_sizes(inputs: InputFiles) -> dict[str, list[tuple[int, int]]]:
    """Each input file's upright (width, height)."""
    return {name: [upright_size(path) for path in _paths(value)] for name, value in sorted(inputs.items())}


def load(samples: Sequence[Sample]) -> tuple[dict[str, list], list[InputFiles]]:
    """The call arguments of a batch's input files (``image=[...]``, one entry a sample) and, per
    sample, what its metadata records of them (file name and SHA-256)."""
    from PIL import Image, ImageOps

    names = sorted({name for sample in samples for name in sample.get("inputs", {})})
    digests: dict[str, str] = {}  # a padded batch repeats its last sample
    kwargs: dict[str, list] = {name: [] for name in names}
    recorded: list[InputFiles] = []
    for sample in samples:
        inputs = sample.get("inputs", {})
        record: InputFiles = {}
        for name in names:
            value = inputs[name]
            mode = "L" if name == "mask_image" else "RGB"
            images = []
            for path in _paths(value):
                with Image.open(path) as image:  # camera JPEGs: upright, as viewers show them
                    images.append(ImageOps.exif_transpose(image).convert(mode))
            kwargs[name].append(images if isinstance(value, list) else images[0])
            for p in _paths(value):
                if p not in digests:
                    digests[p] = sha256(p)
            files = [{"file": p, "sha256": digests[p], **file_stat(p)} for p in _paths(value)]
            record[name] = files if isinstance(value, list) else files[0]
        recorded.append(record)
    return kwargs, recorded
