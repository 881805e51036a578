"""What a config file and the command's words must be before any parser reads them.

The parser (jsonargparse) quotes what it cannot read and imports the module a ``class_path`` names
before it finds that the class does not fit, so a wrong ``--config`` (``/etc/shadow``) would print
the file's content and a ``class_path`` would run a module's import-time code. Here, first: the
file's size, that it is YAML whose aliases expand to a bounded size, that its top level is a
mapping, and that every ``class_path``, and every dotted name a class's arguments give (which the
parser imports for an argument that takes a function: ``on_predict_start: os.system``), names a
module of this project, of Lightning or of torch (or one that ``LIGHTNING_DIFFUSION_CLASS_MODULES``
adds); ``LambdaCallback``, which calls the functions its arguments name, is refused by name. A
file is read through at most ``MAX_CONFIG_BYTES`` + 1 bytes, whatever kind of file it is
(``/dev/zero``). Messages name the file, a line and keys, never the content. Nothing heavy is
imported, and nothing a config names.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import yaml

MAX_CONFIG_BYTES = 1 << 20  # a config of this project is a few kB; a MiB leaves room for long inline lists
MAX_EXPANDED_NODES = 100_000  # YAML nodes after alias expansion (a "billion laughs" file has 10^9)
CLASS_MODULES = ("lightning_diffusion", "lightning", "pytorch_lightning", "lightning_fabric", "torch")
CLASS_MODULES_ENV = "LIGHTNING_DIFFUSION_CLASS_MODULES"


# Classes of the allowed modules that a config may not build: each runs what its arguments name.
DENIED_CLASSES = {"LambdaCallback": "calls the functions its arguments name"}
# A dotted Python name (``pkg.module.name``): the parser imports it for an argument that takes a
# function or a class.
DOTTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# The config groups: ``--trainer FILE`` reads a group from a file, as ``--config`` reads them all.
GROUPS = ("model", "data", "writer", "trainer")


def allowed_modules() -> tuple[str, ...]:
    extra = [m.strip() for m in os.environ.get(CLASS_MODULES_ENV, "").split(",") if m.strip()]
    return (*CLASS_MODULES, *extra)


def _allowed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in allowed_modules())


def not_imported_message(where: str, what: str, module: str) -> str:
    """``WHERE names WHAT of module M, which is not imported for a config: ...``."""
    return (f"{where} names {what} of module {module!r}, which is not imported for a config: classes and functions "
            f"come from {', '.join(CLASS_MODULES)} (add your own package to {CLASS_MODULES_ENV}, comma-separated, to "
            "use its classes).")


def class_path_problem(value: object, where: str) -> Optional[str]:
    """A ``class_path`` outside the allowed modules, or a class of ``DENIED_CLASSES`` (checked
    before anything imports it)."""
    if not isinstance(value, str):
        return f"{where} must be a dotted class name, not {type(value).__name__}."
    module, _, name = value.strip().rpartition(".")
    if name in DENIED_CLASSES:
        return (f"{where}: {name} {DENIED_CLASSES[name]}, which a config may not do; write a Callback class in a "
                f"package of your own and add the package to {CLASS_MODULES_ENV}.")
    if not module:
        return None  # a bare class name: the parser looks it up among the registered classes
    if _allowed(module):
        return None
    return not_imported_message(where, "a class", module)


def _importable(module: str) -> bool:
    """Whether a top-level module can be imported, found without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def dotted_name_problem(value: object, where: str) -> Optional[str]:
    """A class's argument that names a function or class of an importable module outside the
    allowed ones (``on_predict_start: os.system``): the parser would import it for an argument
    that takes one. Judged from the text; a dotted string of no importable module (a file name
    such as ``out.png``) is left to the argument's own type."""
    if not isinstance(value, str) or not DOTTED_NAME.fullmatch(value.strip()):
        return None
    module = value.strip().rpartition(".")[0]
    if _allowed(module) or not _importable(module.split(".")[0]):
        return None
    return not_imported_message(where, repr(value.strip()), module)


# Keys whose plain string value names a class (Lightning's shorthand ``callbacks: [pkg.Class]``).
CLASS_KEYS = ("callbacks", "plugins", "strategy", "logger", "profiler", "accelerator")


def _shorthand(value: object, where: str) -> list[str]:
    """Problems of class names given as the plain value of a ``CLASS_KEYS`` key (a dotted name, or
    a bare one of ``DENIED_CLASSES``)."""
    values = value if isinstance(value, list) else [value]
    found = [class_path_problem(v, where) for v in values
             if isinstance(v, str) and ("." in v.strip("./") or v.strip() in DENIED_CLASSES)]
    return [p for p in found if p]


def _class_paths(data: object, where: str, arguments: bool = False) -> list[str]:
    """Problems of the class names in ``data``, and, within a class's part of the config
    (``arguments``: a ``class_path``'s mapping, a ``CLASS_KEYS`` value), of the dotted names its
    arguments give."""
    problems = []
    if isinstance(data, dict) and "class_path" in data:
        refused = class_path_problem(data["class_path"], f"{where}.class_path" if where else "class_path")
        if refused:
            return [refused]  # its arguments are not for any class
    if isinstance(data, dict):
        arguments = arguments or "class_path" in data
        for key, value in data.items():
            name = f"{where}.{key}" if where else str(key)
            if key != "class_path":
                if key in CLASS_KEYS:
                    problems += _shorthand(value, name)
                problems += _class_paths(value, name, arguments or key in CLASS_KEYS)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            problems += _class_paths(value, f"{where}[{i}]", arguments)
    elif arguments:
        problem = dotted_name_problem(data, where)
        if problem:
            problems.append(problem)
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


def names_file(value: str) -> bool:
    """Whether ``value`` names something a config is read from (a file, a pipe, a device), not a
    folder, not nothing (then it may be YAML given in place)."""
    try:
        return Path(value).expanduser().exists() and not Path(value).expanduser().is_dir()
    except (OSError, ValueError):  # a name too long to be a path, a NUL byte: YAML given in place
        return False


def read_config_text(path: str) -> tuple[Optional[str], Optional[str]]:
    """The text of config file ``path`` and None, or None and why it cannot be a config: at most
    ``MAX_CONFIG_BYTES`` + 1 bytes are read, whatever kind of file it is (``/dev/zero`` is not
    read to its end), and a pipe or a device is refused (the parser would read it a second time)."""
    file = Path(path).expanduser()
    try:
        mode = file.stat().st_mode
        with file.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        return None, f"{path} cannot be read ({err.strerror or type(err).__name__})."
    if len(data) > MAX_CONFIG_BYTES:
        size = f"{file.stat().st_size:,} bytes" if stat.S_ISREG(mode) else f"more than {MAX_CONFIG_BYTES:,} bytes"
        return None, (f"{path} is {size}; a config is at most {MAX_CONFIG_BYTES:,} (put long prompt lists in a prompt "
                      "file: data.prompts).")
    if not stat.S_ISREG(mode):
        return None, f"{path} is not a regular file (a pipe or a device): write the config to a file."
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError:
        return None, f"{path} cannot be read as UTF-8 text (UnicodeDecodeError)."


def _config_data(path: str) -> object:
    """A config file's YAML, read within the bound; None where it cannot be read (the guard says why)."""
    import yaml

    text, _ = read_config_text(path) if names_file(path) else (None, None)
    if text is None:
        return None
    try:
        return yaml.safe_load(text)
    except (ValueError, yaml.YAMLError, RecursionError):
        return None


def config_file_problems(path: str, where: str = "") -> list[str]:
    """Why ``path`` cannot be read as a config, naming the file and a line, never its content.
    ``where``: the key that reads the file (``--trainer FILE``: ``trainer``), else a whole config."""
    import yaml

    if not names_file(path):
        return []  # the reader says the file is missing, as it does today
    text, problem = read_config_text(path)
    if text is None:
        return [problem or f"{path} cannot be read."]
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        return [f"{path} nests its values too deeply to be a config."]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "not YAML"
        return [f"{path} is not valid YAML{at}: {problem}."]
    if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"):
        return [f"{path} is empty (or only comments): a config is a mapping of keys (trainer:, model:, data:, "
                "writer:), as in configs/tiny.yaml."]
    if _expanded_size(node, {}) > MAX_EXPANDED_NODES:
        return [f"{path}: its YAML aliases expand to more than {MAX_EXPANDED_NODES:,} values; write the values out "
                "instead of nesting aliases."]
    not_keys = [] if not isinstance(node, yaml.MappingNode) else [
        key.start_mark.line + 1 for key, _ in node.value
        if not (isinstance(key, yaml.ScalarNode) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key.value)))]
    if not where and (not isinstance(node, yaml.MappingNode) or not_keys):
        at = f" (line {not_keys[0]} is not a key)" if not_keys else ""
        return [f"{path} is not a config: its top level is not a mapping of keys (trainer:, model:, data:, "
                f"writer:){at}, as in configs/tiny.yaml."]
    try:
        return _class_paths(yaml.safe_load(text), where, where.rsplit(".", 1)[-1] in CLASS_KEYS)
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
        parts = key.split(".")
        if name in ("--config", "-c"):
            problems += config_file_problems(value) if names_file(value) else _inline(value, "")
        elif name.startswith("--") and (key in GROUPS or parts[-1] in CLASS_KEYS) and names_file(value):
            problems += config_file_problems(value, key)  # a group or a class read from a file
        elif name.startswith("--") and key.endswith(".class_path"):
            problem = class_path_problem(value, key)
            if problem:
                problems.append(problem)
        elif name.startswith("--") and value.lstrip().startswith(("{", "[")):
            problems += _inline(value, key)
        elif name.startswith("--") and key.rsplit(".", 1)[-1] in CLASS_KEYS:
            problems += _shorthand(value, key)
        elif name.startswith("--") and any(part in CLASS_KEYS or part in ("init_args", "dict_kwargs")
                                           for part in parts[:-1]):
            problem = dotted_name_problem(value, key)  # --trainer.callbacks.init_args.on_predict_start=os.system
            if problem:
                problems.append(problem)
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
    problems = _class_paths(data, where, takes_class) if isinstance(data, (dict, list)) else []
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
            look(_config_data(path), "")
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


@functools.lru_cache(maxsize=1)
def declared_annotations() -> dict[str, dict[str, str]]:
    """Each config group's keys (``model.height``...) with the text of their annotations
    (``Optional[int]``), from the sources of ``GROUP_CLASSES``; a group whose class takes
    ``**kwargs`` or whose source cannot be read is left out."""
    import ast
    import importlib.util

    found: dict[str, dict[str, str]] = {}
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
        found[group] = {f"{group}.{arg.arg}": ast.unparse(arg.annotation) if arg.annotation is not None else ""
                        for arg in [*init.args.args, *init.args.kwonlyargs] if arg.arg != "self"}
    return found


def declared_keys() -> dict[str, list[str]]:
    """Each config group's keys (``model.height``...), from the sources of ``GROUP_CLASSES``
    (``declared_annotations``)."""
    return {group: list(keys) for group, keys in declared_annotations().items()}


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
    found: dict[str, Any] = {}
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        if not value and i + 1 < len(words):
            value = words[i + 1]
        if flag == f"--{group}":  # the whole group given at once: the parser reads it
            return {}
        if flag in ("--config", "-c"):
            data = _config_data(value)
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


# Scalar annotations whose values are judged from the text (``value_problems``): the type's name as
# the parser's message says it, and whether null is allowed. Any other annotation is the parser's.
SCALAR_ANNOTATIONS = {
    "int": ("int", False), "Optional[int]": ("int", True),
    "float": ("float", False), "Optional[float]": ("float", True),
    "bool": ("bool", False), "Optional[bool]": ("bool", True),
}
# The words the parser reads as a boolean (YAML 1.1's), lower case.
BOOLEAN_WORDS = ("true", "false", "yes", "no", "on", "off")
_DECIMAL = re.compile(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?|[+-]?\d+[eE][+-]?\d+")


def _refused(value: object, kind: str, nullable: bool, from_text: bool) -> bool:
    """Whether the parser surely refuses ``value`` for a key of type ``kind`` (``int``, ``float``,
    ``bool``; ``nullable``: Optional). ``from_text``: a command-line word, else a config file's YAML
    value. Only what it certainly refuses: a word for a number (``abc``, ``nan``), a decimal for an
    integer, a number or any word but a boolean one for a boolean, a list or a mapping for any;
    anything else (``0x10``, ``1_000``) is left to the parser."""
    if from_text:
        text = str(value).strip()
        if nullable and text in ("null", "~"):
            return False
        if kind == "bool":
            return bool(text) and text.lower() not in BOOLEAN_WORDS
        if text[:1].isascii() and text[:1].isalpha() or text.startswith(("[", "{")):
            return True
        return kind == "int" and bool(_DECIMAL.fullmatch(text))
    if value is None:
        return False  # a config's null leaves the default, even for a key that is not Optional
    if isinstance(value, (list, dict)):
        return True
    if kind == "bool":
        return not isinstance(value, bool) and not (isinstance(value, str) and value.strip().lower() in BOOLEAN_WORDS)
    if isinstance(value, bool):
        return True
    if isinstance(value, str):
        return _refused(value, kind, nullable, True)
    return kind == "int" and isinstance(value, float)


def value_problems(words: list[str]) -> list[str]:
    """Values of the config groups' int, float and bool keys (``--model.height abc``, ``height: abc``
    in a config file) that the parser would refuse, said in its words (``model.height: expected int
    or null, got 'abc'``), before the imports it needs. The value judged is the one the parser would
    end with: the config files and the flags in the order given, the last one winning."""
    problems = []
    for group, declared in declared_annotations().items():
        scalars = {key.split(".", 1)[1]: SCALAR_ANNOTATIONS[text] for key, text in declared.items()
                   if text in SCALAR_ANNOTATIONS}
        for name, (value, from_text) in _given_as(words, group, tuple(scalars)).items():
            kind, nullable = scalars[name]
            if _refused(value, kind, nullable, from_text):
                names = f"{kind} or null" if nullable else kind
                problems.append(f"{group}.{name}: expected {names}, got {_as_parsed(value)!r}")
    return problems


def _as_parsed(value: object) -> str:
    """A refused value as the parser's message shows it: ``null`` as None, a decimal as a float."""
    text = str(value) if not isinstance(value, str) else value.strip()
    if text in ("null", "~"):
        return "None"
    return str(float(text)) if _DECIMAL.fullmatch(text) else text


def _given_as(words: list[str], group: str, names: tuple[str, ...]) -> dict[str, tuple[Any, bool]]:
    """``_given``, each value with whether it came from the command line's text (else a config
    file's YAML)."""
    found: dict[str, tuple[Any, bool]] = {}
    for i, word in enumerate(words):
        flag, equals, value = word.partition("=")
        if not equals and i + 1 < len(words):
            value = words[i + 1]
        if flag == f"--{group}":  # the whole group given at once: the parser reads it
            return {}
        if flag in ("--config", "-c"):
            data = _config_data(value)
            section = data.get(group) if isinstance(data, dict) else None
            if isinstance(section, dict):
                found.update({name: (section[name], False) for name in names if name in section})
        elif flag.startswith(f"--{group}.") and flag[len(group) + 3:] in names:
            found[flag[len(group) + 3:]] = (value, True)
    return found


def missing_config_problem(value: str, flag: str = "--config") -> Optional[str]:
    """A ``--config`` (or ``--model``...) value that names no file and is not a config given in
    place (a YAML mapping): the file is missing, or a folder. One line naming it, with the closest
    config file of its folder."""
    if names_file(value):
        return None
    import yaml

    try:
        data = yaml.safe_load(value)
    except (yaml.YAMLError, RecursionError, ValueError):
        data = value
    if isinstance(data, dict):
        return None  # a config given in place
    path = Path(value).expanduser()
    try:
        if path.is_dir():
            return f"{flag} {value} is a folder, not a config file (configs/tiny.yaml is one)."
        siblings = [p.name for p in (path.parent if str(path.parent) else Path(".")).iterdir()
                    if p.suffix in (".yaml", ".yml", ".json")] if path.parent.is_dir() else []
    except (OSError, ValueError):
        siblings = []
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.8)
    hint = f"; did you mean {path.parent / close[0] if str(path.parent) != '.' else close[0]}?" if close else ""
    return f"{flag} {value}: no such config file{hint}"


def config_file_missing(words: list[str]) -> list[str]:
    """The ``--config`` (``-c``) values, and the group files (``--trainer FILE.yaml``), that name
    no file (``missing_config_problem``)."""
    problems = []
    for i, word in enumerate(words):
        name, equals, value = word.partition("=")
        if not equals:
            if i + 1 >= len(words):
                continue
            value = words[i + 1]
        if name in ("--config", "-c"):
            problem = missing_config_problem(value, name)
        elif name[2:] in GROUPS and value.lower().endswith((".yaml", ".yml", ".json")):
            problem = missing_config_problem(value, name)
        else:
            continue
        if problem:
            problems.append(problem)
    return problems
