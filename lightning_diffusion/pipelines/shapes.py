"""Captioned shapes: the procedural data set ``tiny:shapes`` is trained on, and the analytic detector
that ``lightning-diffusion eval`` uses to tell whether an image shows what its caption asks.

A scene is one or two flat shapes (circle, square, triangle, star) in named colours on a plain
background of another named colour, optionally with a size ("small", "large") and a position
("in the top left corner", "at the bottom", ...). ``sample_scenes(seed, n)`` draws scenes from a seed,
``caption(scene)`` writes them in words, ``parse_caption`` reads a caption back, ``render`` draws
them (64x64 by default) and ``detect`` finds the background colour, the shape colour, the shape and
its position in an image without any learned model. Needs only torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

# Named colours (sRGB 0-255), far enough apart that the nearest name of a rendered colour is its own.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (250, 140, 0),
    "yellow": (245, 225, 30),
    "green": (30, 170, 50),
    "cyan": (30, 210, 220),
    "blue": (30, 60, 220),
    "purple": (130, 40, 180),
    "pink": (250, 130, 200),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle", "star")
SIZES = {"small": 0.12, "large": 0.30}  # radius as a share of the image side; no word: medium
MEDIUM = 0.2
POSITIONS = {  # phrase -> centre (x, y) as a share of the image side
    "in the top left corner": (0.27, 0.27),
    "at the top": (0.5, 0.27),
    "in the top right corner": (0.73, 0.27),
    "on the left": (0.27, 0.5),
    "in the center": (0.5, 0.5),
    "on the right": (0.73, 0.5),
    "in the bottom left corner": (0.27, 0.73),
    "at the bottom": (0.5, 0.73),
    "in the bottom right corner": (0.73, 0.73),
}
# Every word a caption can hold: the tokenizers of tiny:shapes have one token per word.
VOCABULARY = sorted(
    {"a", "an", "and", "on", "background"}
    | set(COLOURS)
    | set(SHAPES)
    | set(SIZES)
    | {word for phrase in POSITIONS for word in phrase.split()}
)


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    size: Optional[str] = None  # "small", "large" or None (medium)
    position: Optional[str] = None  # a key of POSITIONS, or None (anywhere)


@dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[Shape, ...] = field(default_factory=tuple)


def caption(scene: Scene) -> str:
    parts = []
    for shape in scene.shapes:
        words = ([shape.size] if shape.size else []) + [shape.colour, shape.kind]
        words.insert(0, "an" if words[0][0] in "aeiou" else "a")
        if shape.position:
            words.append(shape.position)
        parts.append(" ".join(words))
    article = "an" if scene.background[0] in "aeiou" else "a"
    return " and ".join(parts) + f" on {article} {scene.background} background"


_SHAPE_RE = re.compile(
    r"an? (?:(?P<size>{sizes}) )?(?P<colour>{colours}) (?P<kind>{shapes})(?: (?P<position>{positions}))?".format(
        sizes="|".join(SIZES), colours="|".join(COLOURS), shapes="|".join(SHAPES),
        positions="|".join(re.escape(p) for p in POSITIONS),
    )
)
_CAPTION_RE = re.compile(
    r"^(?P<shapes>.+) on an? (?P<background>{colours}) background$".format(colours="|".join(COLOURS))
)


def parse_caption(text: str) -> Optional[Scene]:
    """The scene a caption describes, or None when it is not a shapes caption."""
    match = _CAPTION_RE.match(text.strip().lower().rstrip("."))
    if not match:
        return None
    shapes = []
    for part in match["shapes"].split(" and "):
        found = _SHAPE_RE.fullmatch(part)
        if not found:
            return None
        shapes.append(Shape(found["kind"], found["colour"], found["size"], found["position"]))
    return Scene(match["background"], tuple(shapes))


def sample_scenes(seed: int, n: int, two_shapes: float = 0.2) -> list[Scene]:
    """``n`` scenes drawn from ``seed``: a size word half the time, a position word two times in
    three (each shape of two: one time in three, never the same one), a second shape with
    probability ``two_shapes``. Over 10 million distinct captions are possible."""
    g = torch.Generator().manual_seed(seed)

    def pick(options, p_none: float = 0.0):
        if p_none and torch.rand((), generator=g).item() < p_none:
            return None
        return options[int(torch.randint(len(options), (), generator=g))]

    colours, sizes, positions = list(COLOURS), list(SIZES), list(POSITIONS)
    scenes = []
    shapes: tuple[Shape, ...]
    for _ in range(n):
        background = pick(colours)
        others = [c for c in colours if c != background]
        if torch.rand((), generator=g).item() < two_shapes:
            first = Shape(pick(SHAPES), pick(others), pick(sizes, 0.5), pick(positions, 2 / 3))
            free = [p for p in positions if p != first.position]
            shapes = (first, Shape(pick(SHAPES), pick(others), pick(sizes, 0.5), pick(free, 2 / 3)))
        else:
            shapes = (Shape(pick(SHAPES), pick(others), pick(sizes, 0.5), pick(positions, 1 / 3)),)
        scenes.append(Scene(background, shapes))
    return scenes


def _layout(scene: Scene, g: torch.Generator) -> list[tuple[Shape, float, float, float]]:
    """(shape, centre x, centre y, radius) in shares of the side, with a little jitter."""

    def jitter(scale: float) -> float:
        return (torch.rand((), generator=g).item() * 2 - 1) * scale

    placed = []
    two = len(scene.shapes) == 2
    for i, shape in enumerate(scene.shapes):
        radius = SIZES.get(shape.size, MEDIUM) if shape.size else MEDIUM
        radius *= 1 + jitter(0.12)
        if two:
            radius = min(radius, 0.18)
        if two and not shape.position:  # the side away from the other shape
            other = scene.shapes[1 - i]
            other_x = POSITIONS[other.position][0] if other.position else (0.5 if i == 0 else 0.28)
            x, y = (0.28 if other_x >= 0.5 else 0.72) + jitter(0.03), 0.5 + jitter(0.15)
        elif shape.position:
            x, y = POSITIONS[shape.position]
            x, y = x + jitter(0.04), y + jitter(0.04)
        else:
            x, y = 0.5 + jitter(0.2), 0.5 + jitter(0.2)
        x = min(max(x, radius), 1 - radius)
        y = min(max(y, radius), 1 - radius)
        placed.append((shape, x, y, radius))
    return placed


def _mask(kind: str, x: torch.Tensor, y: torch.Tensor, cx: float, cy: float, r: float) -> torch.Tensor:
    dx, dy = x - cx, y - cy
    if kind == "circle":
        return dx * dx + dy * dy <= r * r
    if kind == "square":
        s = r * 0.85
        return (dx.abs() <= s) & (dy.abs() <= s)
    if kind == "triangle":  # pointing up, base at the bottom
        h = r * 1.7
        top, bottom = cy - h / 2, cy + h / 2
        half = (y - top) / h * r
        return (y >= top) & (y <= bottom) & (dx.abs() <= half)
    if kind == "star":  # five points; inside if the radius at this angle is inside the star's outline
        angle = torch.atan2(dx, -dy)  # 0 at the top
        dist = torch.sqrt(dx * dx + dy * dy)
        sector = 2 * math.pi / 5
        phi = (torch.remainder(angle, sector) - sector / 2).abs()  # 0 at a point, 36 deg at a valley
        # the outline is the straight edge from a point (radius r, angle 0) to a valley (radius
        # 0.45 r, angle 36 deg); the ray at angle phi meets it at radius r * v * sin(36) / (...)
        inner, valley = r * 0.45, sector / 2
        edge = r * inner * math.sin(valley) / (inner * torch.sin(valley - phi) + r * torch.sin(phi))
        return dist <= edge
    raise ValueError(f"unknown shape {kind!r}")


def render(scene: Scene, size: int = 64, seed: int = 0, supersample: int = 2) -> torch.Tensor:
    """The scene as a float image (3, size, size) in [0, 1], edges anti-aliased by supersampling."""
    g = torch.Generator().manual_seed(seed)
    n = size * supersample
    coords = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    image = torch.tensor(COLOURS[scene.background], dtype=torch.float32).view(3, 1, 1).expand(3, n, n).clone()
    for shape, cx, cy, r in _layout(scene, g):
        mask = _mask(shape.kind, x, y, cx, cy, r)
        colour = torch.tensor(COLOURS[shape.colour], dtype=torch.float32).view(3, 1)
        image[:, mask] = colour.expand(3, int(mask.sum()))
    image = image / 255.0
    if supersample > 1:
        image = torch.nn.functional.avg_pool2d(image[None], supersample)[0]
    return image


# ----------------------------------------------------------------------------- the detector

_PALETTE = torch.tensor(list(COLOURS.values()), dtype=torch.float32) / 255.0
_NAMES = list(COLOURS)


def nearest_colour(rgb: torch.Tensor) -> str:
    return _NAMES[int(((_PALETTE - rgb.view(1, 3)) ** 2).sum(1).argmin())]


@dataclass(frozen=True)
class Detection:
    background: Optional[str]
    colour: Optional[str]  # the main shape's colour, None when no shape stands out
    kind: Optional[str]
    position: Optional[str]  # the nearest POSITIONS phrase of the shape's centre
    fill: float  # share of the bounding box the shape covers (1 square, 0.79 circle, 0.5 triangle)


def detect(image: torch.Tensor, threshold: float = 0.2) -> Detection:
    """Read a (3, H, W) image in [0, 1] without a learned model.

    Background: the median of the border. Shape colour: the median of the pixels farthest from it
    (the upper half of those more than ``threshold`` away in RGB), so soft edges do not mix in. The
    shape: the pixels more than 60% of the way from the background to that colour; it is a triangle
    when its bottom third is twice as wide as its top third, else a square, circle or star by how
    much of its bounding box it fills (1, 0.79, 0.42 on exact drawings)."""
    image = image.float().clamp(0, 1)
    _, h, w = image.shape
    border = torch.cat([image[:, 0], image[:, -1], image[:, :, 0], image[:, :, -1]], dim=1)
    bg_rgb = border.median(dim=1).values
    distance = ((image - bg_rgb.view(3, 1, 1)) ** 2).sum(0).sqrt()
    candidate = distance > threshold
    background = nearest_colour(bg_rgb)
    if int(candidate.sum()) < max(4, h * w // 400):
        return Detection(background, None, None, None, 0.0)
    core = distance >= torch.quantile(distance[candidate], 0.5)
    shape_rgb = image[:, core].median(dim=1).values
    mask = candidate & (distance > 0.6 * float(((shape_rgb - bg_rgb) ** 2).sum().sqrt()))
    ys, xs = torch.nonzero(mask, as_tuple=True)
    y0, y1, x0, x1 = int(ys.min()), int(ys.max()), int(xs.min()), int(xs.max())
    box = mask[y0 : y1 + 1, x0 : x1 + 1]
    fill = float(box.sum()) / box.numel()
    rows = box.sum(1).float()
    third = max(1, len(rows) // 3)
    widening = float(rows[-third:].mean() / rows[:third].mean().clamp(min=1))
    if widening >= 2:
        kind = "triangle"
    elif fill >= 0.88:
        kind = "square"
    elif fill >= 0.68:
        kind = "circle"
    else:
        kind = "star"
    cx, cy = float(xs.float().mean()) / w, float(ys.float().mean()) / h
    position = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cx) ** 2 + (POSITIONS[p][1] - cy) ** 2)
    return Detection(background, nearest_colour(shape_rgb), kind, position, fill)


def colour_areas(image: torch.Tensor, tolerance: float = 0.15) -> dict[str, int]:
    """Pixels of each named colour in a (3, H, W) image in [0, 1]: pixels within ``tolerance`` (RGB
    distance; the closest two names are 0.35 apart) of the colour, counted where their 3x3
    neighbourhood is all that colour, so the blended pixels along an edge between two colours (which
    can fall near a third name, red and yellow near orange) do not count."""
    image = image.float().clamp(0, 1)
    distance = ((image.unsqueeze(0) - _PALETTE.view(-1, 3, 1, 1)) ** 2).sum(1).sqrt()  # (colours, H, W)
    nearest, which = distance.min(0)
    masks = ((which == torch.arange(len(_NAMES)).view(-1, 1, 1)) & (nearest < tolerance)).float()  # (colours, H, W)
    core = -torch.nn.functional.max_pool2d(-masks[:, None], 3, stride=1, padding=1)
    return {name: int(count) for name, count in zip(_NAMES, core.sum((1, 2, 3)).tolist())}


MIN_AREA = 8  # pixels of a shape's colour, past the erosion, for it to count as drawn (a small star keeps ~20)


def adherence(image: torch.Tensor, scene: Scene) -> dict[str, bool]:
    """Whether the image shows the caption's colours, shape and position. Single-shape scenes: colour
    (background and shape), shape, position where named. Two-shape scenes: colour (the background and
    one of the shapes' colours, as the detector reads the main shape) and ``both_colours`` (the
    background and each shape's colour drawn, ``colour_areas`` of at least ``MIN_AREA``)."""
    found = detect(image)
    colours_ok = found.background == scene.background and found.colour in {s.colour for s in scene.shapes}
    result = {"colour": colours_ok}
    if len(scene.shapes) == 1:
        shape = scene.shapes[0]
        result["shape"] = found.kind == shape.kind
        if shape.position:
            result["position"] = found.position == shape.position
    else:
        areas = colour_areas(image)
        result["both_colours"] = (found.background == scene.background
                                  and all(areas[s.colour] >= MIN_AREA for s in scene.shapes))
    return result


HELD_OUT_SEED = 20_261_201
PAIRS_SEED = 20_261_202


def _distinct_scenes(seed: int, n: int, two_shapes: float) -> list[Scene]:
    """The first ``n`` scenes of distinct captions drawn from ``seed`` on."""
    seen: dict[str, Scene] = {}
    while len(seen) < n:
        for scene in sample_scenes(seed, n, two_shapes=two_shapes):
            seen.setdefault(caption(scene), scene)
        seed += 1
    return list(seen.values())[:n]


def held_out_scenes(n: int = 200) -> list[Scene]:
    """The ``n`` single-shape scenes (distinct captions) that ``tiny:shapes`` never saw in training:
    the adherence numbers are measured on them."""
    return _distinct_scenes(HELD_OUT_SEED, n, two_shapes=0.0)


def held_out_pairs(n: int = 200) -> list[Scene]:
    """``n`` two-shape scenes (distinct captions) for the two-shape measure, drawn from their own seed.
    Training does not exclude them by name, but two-shape captions are drawn from over 10^7, so a
    training run sees few of them (docs/shapes.md says how many the shipped weights saw)."""
    return _distinct_scenes(PAIRS_SEED, n, two_shapes=1.0)
