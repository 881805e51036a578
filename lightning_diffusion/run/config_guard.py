"""What a config file and the command's words must be before any parser reads them.

The parser (jsonargparse) quotes what it cannot read and imports the module a ``class_path`` names
before it finds that the class does not fit, so a wrong ``--config`` (``/etc/shadow``) would print
the file's content and a ``class_path`` would run a module's import-time code. Here, first: the
file's size, that it is YAML whose aliases expand to a bounded size, that its top level is a
mapping, and that every ``class_path`` names a module of this project, of Lightning or of torch
(or one that ``LIGHTNING_DIFFUSION_CLASS_MODULES`` adds). Messages name the file, a line and keys,
never the content. Nothing heavy is imported.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import yaml

MAX_CONFIG_BYTES = 1 << 20  # a config of this project is a few kB; a MiB leaves room for long inline lists
MAX_EXPANDED_NODES = 100_000  # YAML nodes after alias expansion (a "billion laughs" file has 10^9)
CLASS_MODULES = ("lightning_diffusion", "lightning", "pytorch_lightning", "lightning_fabric", "torch")
CLASS_MODULES_ENV = "LIGHTNING_DIFFUSION_CLASS_MODULES"


def allowed_modules() -> tuple[str, ...]:
    extra = [m.strip() for m in os.environ.get(CLASS_MODULES_ENV, "").split(",") if m.strip()]
    return (*CLASS_MODULES, *extra)


def class_path_problem(value: object, where: str) -> Optional[str]:
    """A ``class_path`` outside the allowed modules (checked before anything imports it)."""
    if not isinstance(value, str):
        return f"{where} must be a dotted class name, not {type(value).__name__}."
    module = value.rpartition(".")[0]
    if not module:
        return None  # a bare class name: the parser looks it up among the registered classes
    if any(module == m or module.startswith(m + ".") for m in allowed_modules()):
        return None
    return (f"{where} names a class of module {module!r}, which is not imported for a config: classes come from "
            f"{', '.join(CLASS_MODULES)} (add your own package to {CLASS_MODULES_ENV}, comma-separated, to use "
            "its classes).")


# Keys whose plain string value names a class (Lightning's shorthand ``callbacks: [pkg.Class]``).
CLASS_KEYS = ("callbacks", "plugins", "strategy", "logger", "profiler", "accelerator")


def _shorthand(value: object, where: str) -> list[str]:
    """Problems of dotted class names given as the plain value of a ``CLASS_KEYS`` key."""
    values = value if isinstance(value, list) else [value]
    found = [class_path_problem(v, where) for v in values if isinstance(v, str) and "." in v.strip("./")]
    return [p for p in found if p]


def _class_paths(data: object, where: str) -> list[str]:
    problems = []
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{where}.{key}" if where else str(key)
            if key == "class_path":
                problem = class_path_problem(value, name)
                if problem:
                    problems.append(problem)
            else:
                if key in CLASS_KEYS:
                    problems += _shorthand(value, name)
                problems += _class_paths(value, name)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            problems += _class_paths(value, f"{where}[{i}]")
    return problems


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes of a composed YAML document once its aliases are expanded (an alias shares its node)."""
    import yaml

    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = 1  # a recursive alias counts once
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, memo) for v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def config_file_problems(path: str) -> list[str]:
    """Why ``path`` cannot be read as a config, naming the file and a line, never its content."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        return []  # the reader says the file is missing, as it does today
    size = file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        return [f"{path} is {size:,} bytes; a config is at most {MAX_CONFIG_BYTES:,} (put long prompt lists in a "
                "prompt file: data.prompts)."]
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        return [f"{path} cannot be read as UTF-8 text ({type(err).__name__})."]
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        return [f"{path} nests its values too deeply to be a config."]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "not YAML"
        return [f"{path} is not valid YAML{at}: {problem}."]
    if node is None:
        return []
    if _expanded_size(node, {}) > MAX_EXPANDED_NODES:
        return [f"{path}: its YAML aliases expand to more than {MAX_EXPANDED_NODES:,} values; write the values out "
                "instead of nesting aliases."]
    not_keys = [] if not isinstance(node, yaml.MappingNode) else [
        key.start_mark.line + 1 for key, _ in node.value
        if not (isinstance(key, yaml.ScalarNode) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key.value)))]
    if not isinstance(node, yaml.MappingNode) or not_keys:
        at = f" (line {not_keys[0]} is not a key)" if not_keys else ""
        return [f"{path} is not a config: its top level is not a mapping of keys (trainer:, model:, data:, "
                f"writer:){at}, as in configs/tiny.yaml."]
    try:
        return _class_paths(yaml.safe_load(text), "")
    except (yaml.YAMLError, RecursionError) as err:  # a tag safe YAML cannot build (!include), nesting too deep
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        return [f"{path} cannot be read as plain YAML{at} ({type(err).__name__})."]


def words_problems(words: list[str]) -> list[str]:
    """Problems of the ``--config`` (``-c``) files and of the class names among a command's words:
    ``--X.class_path``, a class-taking key (``--trainer.callbacks+=pkg.Class``), inline YAML."""
    problems = []
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if not value and i + 1 < len(words):
            value = words[i + 1]
        key = name[2:].removesuffix("+")
        if name in ("--config", "-c"):
            problems += config_file_problems(value) if Path(value).expanduser().is_file() else _inline(value, "")
        elif name.startswith("--") and key.endswith(".class_path"):
            problem = class_path_problem(value, key)
            if problem:
                problems.append(problem)
        elif name.startswith("--") and value.lstrip().startswith(("{", "[")):
            problems += _inline(value, key)
        elif name.startswith("--") and key.rsplit(".", 1)[-1] in CLASS_KEYS:
            problems += _shorthand(value, key)
    return problems


def _inline(value: str, where: str) -> list[str]:
    """Class names inside a YAML or JSON value given on the command line (a config given inline)."""
    import yaml

    takes_class = where.rsplit(".", 1)[-1] in CLASS_KEYS
    if "class_path" not in value and not takes_class and not any(k in value for k in CLASS_KEYS):
        return []
    try:
        data = yaml.safe_load(value)
    except (yaml.YAMLError, RecursionError):
        return []  # the parser reports it
    problems = _class_paths(data, where) if isinstance(data, (dict, list)) else []
    return problems + (_shorthand(data, where) if takes_class else [])


def _closest(key: str, keys: list[str]) -> Optional[str]:
    """``model.num_inference_steps`` for ``model.num_steps``: the closest key of the same group (by
    its last part), else of all keys; None when none is close."""
    group, _, leaf = key.rpartition(".")
    same = [k for k in keys if k.rpartition(".")[0] == group]
    leaves = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in same], n=1, cutoff=0.5)
    match = f"{group}.{leaves[0]}" if leaves and group else (leaves[0] if leaves else None)
    if match is None:
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        match = close[0] if close else None
    return match


def _suggest(key: str, keys: list[str]) -> str:
    match = _closest(key, keys)
    return f"; did you mean {match}?" if match else ""


def unknown_keys_message(unknown: list[str], keys: list[str]) -> str:
    """``unknown key model.num_steps; did you mean model.num_inference_steps? (...)``, or for several
    ``N unknown keys: A (did you mean B?), C (...)``: what the parser and the check before it say."""
    tail = " (lightning-diffusion predict --help lists every key)"
    if len(unknown) == 1:
        return f"unknown key {unknown[0]}{_suggest(unknown[0], keys)}{tail}"
    named = ", ".join(key + (f" (did you mean {match}?)" if (match := _closest(key, keys)) else "") for key in unknown)
    return f"{len(unknown)} unknown keys: {named}{tail}"


def unknown_keys(words: list[str], keys: list[str]) -> list[str]:
    """Every key that ``words`` (a command line: ``--group.key`` flags and the YAML files of its
    ``--config``) sets and the parser does not know, in the order given. A key under one that takes
    a whole value (``trainer.strategy.init_args.ulysses``, ``model.cache.type``) is known."""
    import yaml

    known = {k for k in keys if not k.endswith(".help")}
    groups = {k.rpartition(".")[0] for k in known if "." in k}
    groups |= {".".join(g.split(".")[:i]) for g in list(groups) for i in range(1, g.count(".") + 1)}

    def unknown(key: str) -> bool:
        parts = key.split(".")
        return not any(".".join(parts[:i]) in known - groups for i in range(1, len(parts) + 1)) and key not in groups

    found: list[str] = []

    def look(value: object, prefix: str) -> None:
        for name, inner in (value.items() if isinstance(value, dict) else []):
            key = f"{prefix}{name}"
            if key in groups and key not in known - groups:
                look(inner, key + ".")
            elif unknown(key) and key not in found:
                found.append(key)

    for i, word in enumerate(words):
        if word == "--config" and i + 1 < len(words) or word.startswith("--config="):
            path = words[i + 1] if word == "--config" else word.split("=", 1)[1]
            try:
                look(yaml.safe_load(Path(path).read_text()), "")
            except (OSError, ValueError, yaml.YAMLError):
                continue
        elif word.startswith("--") and len(word) > 2:
            key = word[2:].split("=", 1)[0].rstrip("+")
            if key not in ("config", "help", "print_config") and unknown(key) and key not in found:
                found.append(key)
    return found


# ``predict``'s config groups and the class whose ``__init__`` declares each one's keys, read from
# its source: the keys are known before torch, Lightning or diffusers is imported.
GROUP_CLASSES = {"model": ("lightning_diffusion", "module.py", "DiffusionModule"),
                 "data": ("lightning_diffusion", "input/data.py", "PromptDataModule"),
                 "writer": ("lightning_diffusion", "output/writer.py", "ImageWriter"),
                 "trainer": ("lightning", "pytorch/trainer/trainer.py", "Trainer")}


def declared_keys() -> dict[str, list[str]]:
    """Each config group's keys (``model.height``...), from the sources of ``GROUP_CLASSES``; a
    group whose class takes ``**kwargs`` or whose source cannot be read is left out."""
    import ast
    import importlib.util

    found: dict[str, list[str]] = {}
    for group, (package, file, class_name) in GROUP_CLASSES.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        try:
            tree = ast.parse((Path(list(spec.submodule_search_locations)[0]) / file).read_text())
        except (OSError, SyntaxError):
            continue
        init = next((node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == class_name
                     for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"), None)
        if init is None or init.args.kwarg is not None:
            continue
        found[group] = [f"{group}.{arg.arg}" for arg in [*init.args.args, *init.args.kwonlyargs] if arg.arg != "self"]
    return found


def key_problems(words: list[str]) -> list[str]:
    """The unknown keys of the config groups among a command's words and config files, as the
    parser would name them, found before anything heavy is imported (a typo is refused in a
    second, not after seconds of imports)."""
    by_group = declared_keys()
    keys = [key for group_keys in by_group.values() for key in group_keys]
    unknown = [key for key in unknown_keys(words, keys) if key.split(".")[0] in by_group and "." in key]
    return [unknown_keys_message(unknown, keys)] if unknown else []


def _given(words: list[str], group: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The values of ``group``'s keys ``names`` as the parser would end with them: the config files
    and the flags in the order given, the last one winning."""
    import yaml

    found: dict[str, Any] = {}
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        if not value and i + 1 < len(words):
            value = words[i + 1]
        if flag == f"--{group}":  # the whole group given at once: the parser reads it
            return {}
        if flag in ("--config", "-c"):
            try:
                data = yaml.safe_load(Path(value).expanduser().read_text())
            except (OSError, ValueError, yaml.YAMLError):
                continue
            section = data.get(group) if isinstance(data, dict) else None
            if isinstance(section, dict):
                found.update({name: section[name] for name in names if name in section})
        elif flag.startswith(f"--{group}.") and flag[len(group) + 3:] in names:
            found[flag[len(group) + 3:]] = value
    return found


def prompt_problems(words: list[str]) -> list[str]:
    """Where ``data.prompts`` names a file, folder or glob: that it is a prompt set this can read,
    before the heavy imports (the same words as the run's own check; nothing is read yet)."""
    given = _given(words, "data", ("prompts", "split"))
    prompts, split = given.get("prompts"), given.get("split")
    if not isinstance(prompts, str) or prompts.startswith("hf://") or prompts.lstrip().startswith(("[", "{")):
        return []
    from lightning_diffusion.input.formats import PromptFileError, check_source

    try:
        check_source(prompts, split if isinstance(split, str) and split not in ("null", "None") else None)
    except PromptFileError as err:
        return [str(err)]
    return []
