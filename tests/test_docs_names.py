"""Docs that cannot drift: every project name the documentation writes in backticks still exists.

Read: ``README.md``, ``docs/*.md``, and the docstrings and comments of ``lightning_diffusion/**/*.py``.
In each backticked span (and, for paths, each fenced block of the Markdown files) a word is checked
when it looks like a project name:

* a path into the repository (``configs/tiny.yaml``, ``strategies/checks.py``, ``docs/tools.md``,
  ``benchmarks/scale.py``) or a bare ``name.py`` / ``.md`` / ``.yaml`` / ``.sh``: the file is there
  (a bare name anywhere in the repository);
* a dotted name whose first part is a module of the package, by its full or its last name
  (``lightning_diffusion.output.writer.ImageWriter``, ``recorded.finished``, ``checks.context_modes``), or
  a class of the package (``StopController.watch_interrupt``): each part is defined, read from the
  sources (class attributes, ``self.x`` and package base classes included; an attribute a class may
  inherit from a third-party base is looked for in that library's sources). ``module.x`` may also
  name an attribute of ``DiffusionModule`` (the contract's ``module.use_pipeline``);
* a config key, ``model.x`` / ``data.x`` / ``writer.x`` / ``trainer.x`` (``--model.x`` too): ``x``
  is a parameter of ``DiffusionModule`` / ``PromptDataModule`` / ``ImageWriter`` / ``Trainer``;
* a lowercase word then a package class (``mesh.ParallelDims``): the word is a module;
* a bare code-like word, CamelCase (``OutputLock``) or with an underscore (``_BLOCK_LINE``,
  ``check_request``), where the span is that one word or the word is called (``f(x)``): it is a
  module or a config key, or is written in the code of the repository (a definition, a use or a
  string; docstrings and comments do not count), or in the sources of diffusers, torch, Lightning...
  (``THIRD_PARTY``).
A dotted name the code itself writes (an attribute chain, ``summary.sets``, or a string) is taken
as it is. Nothing is imported: the check reads sources only (about a second).

Markdown links to files of the repository (``[Tools](docs/tools.md#eval)``) must reach a file and,
with ``#anchor``, one of its headings. The README's layout names every module and command.

A word that looks like a project name but is not one goes into ``NOT_NAMES`` with its reason, a
word of another program into ``FOREIGN``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_diffusion"

# Written in backticks, not project names: each with why.
NOT_NAMES = {
    "run.py": "README: the user's own script in an example (`python run.py`)",
    "model.num_steps": "a misspelt key in an example of the config errors' 'did you mean' message",
    "data.batchsize": "a misspelt key in the same example (every unknown key at once)",
}
# Words of other programs that look like code: SLURM's configuration and states, Kubeflow's job kind.
FOREIGN = {"JobId", "KillWait", "PreemptParameters", "send_user_signal", "BeginTime", "PyTorchJob"}
# Libraries (folders and files of them) whose sources may hold a bare name the docs write.
THIRD_PARTY = ("diffusers", "torch/distributed", "lightning/pytorch", "torch/__init__.py", "torch/nn/modules",
               "transformers/__init__.py", "torchao/quantization", "peft/tuners/lora")
REPO_DIRS = {"configs", "docs", "scripts", "benchmarks", "tests", "examples", "lightning_diffusion", ".ci"}
PACKAGE_DIRS = {"input", "pipelines", "strategies", "output", "run", "commands", "models"}
CHECKED_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh")
DATA_SUFFIXES = {"json", "jsonl", "txt", "csv", "png", "jpg", "jpeg", "webp", "mp4", "gif", "npy", "pt", "bin",
                 "safetensors", "tar", "sbatch", "out", "lock", "toml", "cfg", "yaml", "yml", "md", "py", "sh"}
CONFIG_GROUPS = {"model": ("lightning_diffusion.module", "DiffusionModule"),
                 "data": ("lightning_diffusion.input.data", "PromptDataModule"),
                 "writer": ("lightning_diffusion.output.writer", "ImageWriter"),
                 "trainer": (None, "Trainer")}
SKIP_DIRS = {".git", ".venv", ".cache", "__pycache__", "outputs", "node_modules", ".mypy_cache", ".ruff_cache",
             ".pytest_cache"}
# CamelCase: two capitals or more and a lowercase letter (``OutputLock``, ``CFGSplit``; not ``Time``).
CAMEL = re.compile(r"^_?[A-Z](?=[A-Za-z0-9]*[a-z])(?=[a-z0-9]*[A-Z])[A-Za-z0-9]*$")
IDENT = re.compile(r"^_?[A-Za-z][A-Za-z0-9_]*$")
DOTTED = re.compile(r"^_?[A-Za-z]\w*(?:\.\w+)+$")


@dataclass(frozen=True)
class Mention:
    where: str  # file:line
    name: str
    fenced: bool = False  # in a fenced code block: only paths are checked
    bare: bool = True  # a bare word is checked: the span is one word, or the word is called (``f(x)``)


# --- where names are written -------------------------------------------------------------------------------------

_SPAN = re.compile(r"(?<!`)(`{1,2})(?!`)((?:(?!\n\s*\n)[^`])+?)(?<!`)\1(?!`)")
_SPLIT = re.compile(r"[\s()\[\],;=\"'|:!?]+")


def _words(span: str) -> Iterator[tuple[int, str]]:
    """(offset, word) of the words of a backticked span."""
    position = 0
    for word in _SPLIT.split(span):
        offset = span.find(word, position) if word else position
        position = offset + len(word)
        word = word.strip(".,")
        if word:
            yield offset, word


def markdown_mentions(label: str, text: str) -> Iterator[Mention]:
    lines = text.split("\n")
    prose: list[str] = []
    fenced = False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
            continue
        if fenced:
            prose.append("")
            for word in _SPLIT.split(line):
                word = word.strip(".,`")
                if word:
                    yield Mention(f"{label}:{number}", word, fenced=True)
        else:
            prose.append(line)
    yield from _span_mentions(label, "\n".join(prose), 1)


def _span_mentions(label: str, text: str, first_line: int) -> Iterator[Mention]:
    for match in _SPAN.finditer(text):
        span = re.sub(r"<[^<>]*>", lambda m: " " * len(m.group()), match.group(2))  # placeholders
        one_word = not re.search(r"\s", span.strip())
        for offset, word in _words(span):
            line = first_line + text.count("\n", 0, match.start(2) + offset)
            called = span[offset + len(word):].startswith("(")
            yield Mention(f"{label}:{line}", word, bare=one_word or called)


def docstring_mentions(label: str, source: str, tree: Optional[ast.Module] = None) -> Iterator[Mention]:
    for node in ast.walk(tree or ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                yield from _span_mentions(label, first.value.value, first.value.lineno)


def comment_mentions(label: str, source: str) -> Iterator[Mention]:
    """The backticked names of a Python file's comments."""
    if not re.search(r"#.*`", source):
        return
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield from _span_mentions(label, token.string, token.start[0])


def link_targets(label: str, text: str) -> Iterator[tuple[str, str]]:
    """(file:line, target) of the Markdown links to relative paths."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"^[a-z]+:", target):
                yield f"{label}:{number}", target


def documents() -> list[tuple[str, Path]]:
    return [("README.md", ROOT / "README.md")] + [(f"docs/{p.name}", p) for p in sorted((ROOT / "docs").glob("*.md"))]


def all_mentions() -> Iterator[Mention]:
    for label, path in documents():
        yield from markdown_mentions(label, path.read_text())
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        yield from docstring_mentions(str(path.relative_to(ROOT)), source, index().tree(path))
        yield from comment_mentions(str(path.relative_to(ROOT)), source)


# --- what exists --------------------------------------------------------------------------------------------------


@dataclass
class ModuleInfo:
    names: dict[str, ast.AST]  # top-level name -> its ClassDef / FunctionDef / ImportFrom / other statement
    imported: dict[str, tuple[str, str]]  # name -> (module, name) of a ``from module import name``
    exports: list[str]


def _top_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for statement in body:
        yield statement
        if isinstance(statement, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_statements(getattr(statement, field, []))
            for handler in getattr(statement, "handlers", []):
                yield from _top_statements(handler.body)


def _targets(statement: ast.stmt) -> list[ast.expr]:
    if isinstance(statement, ast.Assign):
        return list(statement.targets)
    if isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        return [statement.target]
    return []


def _names_of(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _names_of(element)


Found = Union[bool, str]  # True, False, or a name to look for in the libraries (an inherited attribute)


class Index:
    """The package's modules, classes and names, the repository's files and what its code writes."""

    def __init__(self) -> None:
        self.modules: dict[str, Path] = {}
        for path in PACKAGE.rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[-1] != "__main__":
                self.modules[".".join(parts)] = path
        self.by_short: dict[str, list[str]] = {}
        for name in self.modules:
            parts = name.split(".")
            for start in range(1, len(parts)):
                self.by_short.setdefault(".".join(parts[start:]), []).append(name)
        self._info: dict[str, ModuleInfo] = {}
        self._trees: dict[Path, ast.Module] = {}
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        self.defined: set[str] = set()  # every name defined anywhere in the package
        for module in self.modules:
            info = self.info(module)
            for node in ast.walk(self.tree(self.modules[module])):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append((module, node))
                    self.defined.add(node.name)
                    self.defined |= self.class_attributes(node)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.defined.add(node.name)
            self.defined |= set(info.names)
        self.files, self.file_names = self._repo_files()
        self.vocabulary, self.chains = self._code_vocabulary()

    def tree(self, path: Path) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(path.read_text())
        return self._trees[path]

    def info(self, module: str) -> ModuleInfo:
        if module not in self._info:
            tree = self.tree(self.modules[module])
            names: dict[str, ast.AST] = {}
            imported: dict[str, tuple[str, str]] = {}
            exports: list[str] = []
            for statement in _top_statements(tree.body):
                if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names[statement.name] = statement
                elif isinstance(statement, (ast.Import, ast.ImportFrom)):
                    for alias in statement.names:
                        names[alias.asname or alias.name.split(".")[0]] = statement
                        if isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
                            imported[alias.asname or alias.name] = (statement.module, alias.name)
                for target in _targets(statement):
                    for name in _names_of(target):
                        names[name] = statement
                        if name == "__all__" and isinstance(statement, ast.Assign):
                            exports = [e.value for e in getattr(statement.value, "elts", [])
                                       if isinstance(e, ast.Constant)]
            self._info[module] = ModuleInfo(names, imported, exports)
        return self._info[module]

    @staticmethod
    def class_attributes(node: ast.ClassDef) -> set[str]:
        found: set[str] = set()
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(statement.name)
            for target in _targets(statement):
                found |= set(_names_of(target))
        for sub in ast.walk(node):  # self.x = ... in any method
            for target in _targets(sub) if isinstance(sub, ast.stmt) else []:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                    found.add(target.attr)
        return found

    @staticmethod
    def _repo_files() -> tuple[set[str], set[str]]:
        files: set[str] = set()
        names: set[str] = set()
        for folder, subfolders, filenames in os.walk(ROOT):
            subfolders[:] = [s for s in subfolders if s not in SKIP_DIRS and not s.endswith(".egg-info")]
            relative = Path(folder).relative_to(ROOT)
            for name in [*filenames, *subfolders]:
                files.add((relative / name).as_posix())
                names.add(name)
        return files, names

    def _code_vocabulary(self) -> tuple[set[str], set[str]]:
        """The words code writes (names, attributes, parameters, whole-word and dotted strings) and
        the attribute chains it writes (``summary.sets``), in every Python file of the repository,
        docstrings and comments left out."""
        words: set[str] = set()
        chains: set[str] = set()
        for name in sorted(self.files):
            if not name.endswith(".py") or ROOT / name == Path(__file__).resolve():  # not this file's lists
                continue
            tree = self.tree(ROOT / name)
            docstrings = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                    first = node.body[0]
                    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                        docstrings.add(id(first.value))
            for node in ast.walk(tree):
                if isinstance(node, ast.Name):
                    words.add(node.id)
                elif isinstance(node, ast.Attribute):
                    words.add(node.attr)
                    if isinstance(node.value, (ast.Name, ast.Attribute)):
                        chains.add(ast.unparse(node))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    words.add(node.name)
                elif isinstance(node, ast.arg):
                    words.add(node.arg)
                elif isinstance(node, ast.keyword) and node.arg:
                    words.add(node.arg)
                elif isinstance(node, ast.alias):
                    words.update(node.name.split("."))
                    if node.asname:
                        words.add(node.asname)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    value = node.value.strip()
                    if IDENT.match(value):
                        words.add(value)
                    elif DOTTED.match(value):
                        chains.add(value)
        return words, chains

    # names in modules and classes

    def module_for(self, first: str) -> list[str]:
        if first in self.modules:
            return [first]
        return self.by_short.get(first, [])

    def resolve(self, module: str, parts: list[str]) -> Found:
        """Whether ``module.parts`` is defined, read from the sources."""
        if not parts:
            return True
        head, rest = parts[0], parts[1:]
        if f"{module}.{head}" in self.modules:
            return self.resolve(f"{module}.{head}", rest)
        info = self.info(module)
        if head in info.exports and head not in info.names:  # the package's lazy public names
            return best(self.resolve(owner, parts) for owner, _ in self.classes.get(head, []))
        if head not in info.names:
            return False
        node = info.names[head]
        if rest and isinstance(node, ast.ClassDef):
            return self.resolve_in_class(node, rest)
        source = info.imported.get(head)
        if rest and source and source[0] in self.modules:
            return self.resolve(source[0], [source[1], *rest])
        return True  # deeper into a value or a third-party name: not followed

    def resolve_in_class(self, node: ast.ClassDef, rest: list[str]) -> Found:
        """Whether the class has the attribute ``rest[0]``: its own or a base's of the package; the
        attribute's name when the class has a base outside the package, which may define it."""
        if rest[0] in self.class_attributes(node):
            return True
        results: list[Found] = []
        for base in node.bases:
            base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            bases = [base_node for _, base_node in self.classes.get(base_name, []) if base_node is not node]
            results += [self.resolve_in_class(base_node, rest) for base_node in bases]
            if not bases and base_name not in ("object", "Protocol", "Generic", "NamedTuple", "Exception"):
                results.append(rest[0])
        return best(results)

    @functools.cached_property
    def config_keys(self) -> dict[str, set[str]]:
        keys = {}
        for group, (module, class_name) in CONFIG_GROUPS.items():
            if module is None:  # Lightning's Trainer, read from its source without importing it
                spec = importlib.util.find_spec("lightning")
                assert spec is not None and spec.submodule_search_locations
                path = Path(list(spec.submodule_search_locations)[0]) / "pytorch" / "trainer" / "trainer.py"
                nodes = [n for n in ast.walk(ast.parse(path.read_text()))
                         if isinstance(n, ast.ClassDef) and n.name == class_name]
            else:
                nodes = [n for owner, n in self.classes[class_name] if owner == module]
            init = next(s for s in nodes[0].body if isinstance(s, ast.FunctionDef) and s.name == "__init__")
            keys[group] = {a.arg for a in [*init.args.args, *init.args.kwonlyargs]} - {"self"}
        return keys

    def third_party(self, words: set[str]) -> set[str]:
        """Those of ``words`` written in the sources of the libraries the docs talk about (read as text:
        importing them would take seconds)."""
        found: set[str] = {word for word in words if hasattr(builtins, word)}
        if found >= words:
            return found
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(words))) + r")\b")
        for library in THIRD_PARTY:
            spec = importlib.util.find_spec(library.split("/")[0])
            if spec is None or not spec.submodule_search_locations:
                continue
            folder = Path(list(spec.submodule_search_locations)[0]).joinpath(*library.split("/")[1:])
            for path in sorted(folder.rglob("*.py")) if folder.is_dir() else [folder]:
                if found >= words:
                    return found
                found |= set(pattern.findall(path.read_text(errors="replace")))
        return found


@functools.lru_cache(maxsize=1)
def index() -> Index:
    return Index()


# --- the checks ---------------------------------------------------------------------------------------------------


def check_path(word: str) -> Optional[str]:
    files = index().files
    path = word.split("#")[0].rstrip("/")
    if path.startswith("./"):
        path = path[2:]
    if "/" in path:
        first = path.split("/")[0]
        if first in REPO_DIRS:
            return None if path in files else f"no such file or folder: {path}"
        if first in PACKAGE_DIRS:
            path = f"lightning_diffusion/{path}"
            return None if path in files else f"no such file or folder: {path}"
        return None
    if path.endswith(CHECKED_SUFFIXES) and re.match(r"^[a-z0-9_][a-z0-9_.-]*$", path):
        return None if path in index().file_names else f"no file named {path} in the repository"
    return None


def check_dotted(word: str) -> Optional[str]:
    idx = index()
    parts = word.split(".")
    if parts[-1].lower() in DATA_SUFFIXES or word in idx.chains:
        return None
    first, rest = parts[0], parts[1:]
    if first in CONFIG_GROUPS:
        if rest[0] in idx.config_keys[first]:
            return None
        if first in ("data", "writer") and idx.resolve(CONFIG_GROUPS[first][0], rest) is True:
            return None
        return f"{rest[0]!r} is no {first} config key (no parameter of {CONFIG_GROUPS[first][1]})"
    modules = idx.module_for(first) if first != "lightning_diffusion" else ["lightning_diffusion"]
    if modules:
        found = best(idx.resolve(module, rest) for module in modules)
        if first == "module" and found is not True:  # ``module``: also the DiffusionModule of the contract
            found = best([found, class_has("DiffusionModule", rest)])
        return outcome(found, f"{'.'.join(rest)} is not defined in {' or '.join(modules)}")
    if first in idx.classes:
        return outcome(class_has(first, rest), f"class {first} has no attribute {'.'.join(rest)}")
    if first.islower() and CAMEL.match(rest[0]) and rest[0] in idx.classes:
        return f"no module {first!r} in lightning_diffusion ({rest[0]} is in {idx.classes[rest[0]][0][0]})"
    return None


def best(results: Iterable[Found]) -> Found:
    results = list(results)
    return True if True in results else next((r for r in results if isinstance(r, str)), False)


def class_has(name: str, rest: list[str]) -> Found:
    return best(index().resolve_in_class(node, rest) for _, node in index().classes.get(name, []))


class Deferred(str):
    """A problem unless ``word`` is written in the sources of the libraries (``THIRD_PARTY``)."""

    word: str


def deferred(problem: str, word: str) -> Deferred:
    result = Deferred(problem)
    result.word = word
    return result


def outcome(found: Found, problem: str) -> Optional[str]:
    if found is True:
        return None
    if isinstance(found, str):
        return deferred(problem + ", nor in its third-party base classes", found)
    return problem




def check_bare(word: str) -> Optional[str]:
    if not (CAMEL.match(word) or "_" in word.strip("_")) or word.strip("_").isdigit():
        return None
    if word.isupper() and not word.startswith("_") and not word.startswith("LIGHTNING_DIFFUSION"):
        return None  # environment variables of other programs (HF_HOME, SLURM_PROCID, NCCL_...)
    idx = index()
    if word in idx.defined or word in idx.vocabulary or idx.module_for(word):
        return None
    if any(word in keys for keys in idx.config_keys.values()):
        return None
    return deferred("written nowhere in the code of the repository, nor in the sources of diffusers, torch, "
                    "Lightning...", word)


def check(mention: Mention) -> Optional[str]:
    word = mention.name
    if word in NOT_NAMES or word in FOREIGN:
        return None
    if re.search(r"[*<>{}$@%~]|\.\.", word) or word.startswith("."):
        return None  # a placeholder, a glob, an extension
    if "/" in word or word.endswith(CHECKED_SUFFIXES if not mention.fenced else ".py"):
        return check_path(word)
    if mention.fenced:
        return None
    word = word.removeprefix("--")
    if DOTTED.match(word):
        return check_dotted(word)
    if IDENT.match(word) and mention.bare:
        return check_bare(word)
    return None


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    anchors: set[str] = set()
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            candidate, n = slug, 0
            while candidate in anchors:
                n += 1
                candidate = f"{slug}-{n}"
            anchors.add(candidate)
    return anchors


def check_link(label: str, target: str) -> Optional[str]:
    page, _, anchor = target.partition("#")
    here = (ROOT / label).parent
    path = (here / page).resolve() if page else ROOT / label
    if not path.exists():
        return f"links to {target}: no such file"
    if anchor and path.suffix == ".md" and anchor not in heading_anchors(path.read_text()):
        return f"links to {target}: {path.name} has no heading with that anchor"
    return None


def problems_in(mentions: Iterator[Mention]) -> list[str]:
    checked = [(mention, check(mention)) for mention in mentions]
    elsewhere = index().third_party({why.word for _, why in checked if isinstance(why, Deferred)})
    return [f"{mention.where}: `{mention.name}`: {why}" for mention, why in checked
            if why and not (isinstance(why, Deferred) and why.word in elsewhere)]


def all_problems() -> list[str]:
    found = problems_in(all_mentions())
    for label, path in documents():
        for where, target in link_targets(label, path.read_text()):
            why = check_link(label, target)
            if why:
                found.append(f"{where}: {why}")
    return found


# --- the tests ----------------------------------------------------------------------------------------------------


def test_every_name_the_docs_write_exists():
    problems = all_problems()
    assert not problems, f"{len(problems)} names in the docs that do not exist:\n" + "\n".join(problems)


def test_the_check_reports_names_that_do_not_exist(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "THIRD_PARTY", ("lightning/pytorch/strategies",))  # fast
    text = "\n".join([
        "Written by `writer.ImageWriter` (`lightning_diffusion.output.writer.ImageWriter.setup`), read by",
        "`recorded.finished` and `checks.context_modes`; see `strategies/checks.py`, `docs/tools.md`,",
        "`configs/tiny.yaml`, `StopController.watch_interrupt`, `--data.batch_size 4`, `ModelParallelStrategy`.",
        "Gone: `writer.no_such_thing`, `lightning_diffusion.output.writer.NoWriter`, `strategies/nothing.py`,",
        "`docs/nowhere.md`, `NoSuchStrategy`, `mesh.ParallelDims`, `StopController.no_method`,",
        "`model.no_such_key`, `configs/none.yaml`, `_NO_CONSTANT` and ``no_such_function``.",
        "[Tools](docs/tools.md#eval), [gone](docs/gone.md), [no anchor](docs/tools.md#no-such-heading)",
    ])
    mentions = list(markdown_mentions("made-up.md", text))
    problems = problems_in(iter(mentions))
    problems += [f"{where}: {why}" for where, target in link_targets("README.md", text)
                 if (why := check_link("README.md", target))]
    reported = [p.split(": ")[1] for p in problems if p.startswith("made-up.md:")]
    assert reported == ["`writer.no_such_thing`", "`lightning_diffusion.output.writer.NoWriter`",
                        "`strategies/nothing.py`",
                        "`docs/nowhere.md`", "`NoSuchStrategy`", "`mesh.ParallelDims`", "`StopController.no_method`",
                        "`model.no_such_key`", "`configs/none.yaml`", "`_NO_CONSTANT`", "`no_such_function`"], problems
    assert problems[0].startswith("made-up.md:4: `writer.no_such_thing`")
    assert [p.split(": ", 1)[1] for p in problems if p.startswith("README.md:")] == [
        "links to docs/gone.md: no such file",
        "links to docs/tools.md#no-such-heading: tools.md has no heading with that anchor"]
    # The names of a docstring count from its first line.
    source = 'def f():\n    """Calls\n    ``manifest.no_such_function``."""\n'
    assert problems_in(docstring_mentions("x.py", source)) == [
        "x.py:3: `manifest.no_such_function`: no_such_function is not defined in lightning_diffusion.output.manifest"]


def test_the_readme_layout_names_every_module_and_command():
    from lightning_diffusion.commands import COMMANDS

    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    missing = [path.name for path in sorted(PACKAGE.glob("*.py"))
               if not path.name.startswith("__") and not re.search(rf"\b{re.escape(path.name)}\b", layout)]
    strategies = layout.split("strategies/", 1)[1]
    missing += [f"strategies/{path.name}" for path in sorted((PACKAGE / "strategies").glob("*.py"))
                if not path.name.startswith("__") and not re.search(rf"\b{path.stem}\b", strategies)]
    commands_line = next(line for line in layout.splitlines() if line.strip().startswith("commands/"))
    missing += [f"command {name}" for name, (module, _) in COMMANDS.items()
                if not re.search(rf"\b{module.rsplit('.', 1)[1]}\b", commands_line)]
    assert not missing, f"README.md's Layout does not name: {', '.join(missing)}"


@pytest.mark.slow
def test_docs_check_fails_a_command_that_fails_and_a_missing_config(tmp_path):
    """scripts/docs-check (run by .ci/run over README.md and docs/) reports each failing block in one
    line and exits 1: a command that exits non-zero, a parsed command whose config does not exist or
    with an option its command lacks (indented in a list, under srun), a mark it does not know, a
    shell block by another name; a block that works passes beside them."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint('fine')\n```\n\n"
        "```bash\nlightning-diffusion status no-such-folder\necho never\n```\n\n"
        "<!-- docs-check: parse (GPU) -->\n```bash\nlightning-diffusion predict --config configs/no-such.yaml\n```\n\n"
        "<!-- docs-check: gpu -->\n```bash\nls\n```\n\n"
        "- in a list:\n\n  <!-- docs-check: parse (cluster) -->\n  ```bash\n"
        "  srun lightning-diffusion slurm --config configs/tiny.yaml --arrray 4 --data.prompts p.txt\n  ```\n\n"
        "```sh\necho a shell block by another name\n```\n")
    proc = subprocess.run([sys.executable, "scripts/docs-check", str(page)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [line.split()[0] for line in lines if line.startswith(("ok", "FAIL"))] == ["ok"] + ["FAIL"] * 5
    assert any("`lightning-diffusion status no-such-folder` exits 2" in line for line in lines), proc.stdout
    assert not any("never" in line for line in lines)  # the block stops at its first failure
    assert any("--config configs/no-such.yaml does not exist" in line for line in lines), proc.stdout
    assert any("unknown docs-check mark 'gpu'" in line for line in lines), proc.stdout
    assert any("lightning-diffusion slurm: --arrray is not among its options" in line for line in lines)
    assert not any("--data.prompts is not" in line for line in lines)  # a config key slurm passes on
    assert any("a 'sh' block: name it bash" in line for line in lines)
    assert lines[-1] == "docs-check: 5 block(s) failed"
