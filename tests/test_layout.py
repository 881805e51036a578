"""The package's layout: the sub-packages hold what their names say, every documented import keeps
working (old flat module names included), and one factory chooses the output store."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_diffusion
from lightning_diffusion.output.folder_store import FolderStore
from lightning_diffusion.output.object_store import ObjectStore
from lightning_diffusion.output.store import OutputStore, open_store, store_class
from tests.commands.test_cli import _imports as imported_modules

PACKAGE = Path(lightning_diffusion.__file__).parent


def test_the_top_of_the_package_holds_at_most_ten_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


# The layers, from the ground up: a package imports its own layer's modules and those below, never
# one above (docs/internals.md draws them). ``core`` imports no other part of the package.
LAYERS = ["core", "pipelines", "output", "input", "contract", "report", "strategies", "module", "run", "commands",
          "cli", "__init__", "__main__"]


def _part(module: str) -> str:
    """The layer a module of the package belongs to: its sub-package, or its own name at the top."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _modules() -> dict[str, Path]:
    files = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}
    return {name.removesuffix(".__init__"): path for name, path in files.items()}


def test_packages_import_only_their_own_layer_and_those_below():
    """Every import counts, wherever it stands (at the top, in a function, under ``TYPE_CHECKING``):
    a type named in an annotation ties the layers too (``test_cli._imports`` reads them all)."""
    modules = _modules()
    back_up, unknown = [], set()
    for name, path in sorted(modules.items()):
        source = _part(name)
        for module in sorted(imported_modules(name, ast.parse(path.read_text()), set(modules))):
            target = _part(module)
            unknown |= {part for part in (source, target) if part not in LAYERS}
            if source in LAYERS and target in LAYERS and LAYERS.index(target) > LAYERS.index(source):
                back_up.append(f"{path.relative_to(PACKAGE)} ({source}) imports {module} ({target})")
    assert not unknown, f"parts in no layer: {sorted(unknown)} (add them to LAYERS and docs/internals.md)"
    assert not back_up, back_up


def test_the_layering_check_sees_an_import_that_runs_back_up():
    """A module of ``core`` that imports the writer under ``TYPE_CHECKING`` and the module inside a
    function is read as importing both: the check above would refuse it."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..output import writer\n"
              "def f():\n    from lightning_diffusion import module\n")
    found = imported_modules("lightning_diffusion.core.bad", ast.parse(source), set(_modules()))
    assert found == {"lightning_diffusion.output.writer", "lightning_diffusion.module"}
    assert sorted(_part(m) for m in found) == ["module", "output"]


@pytest.mark.parametrize("old", sorted(lightning_diffusion.MOVED))
def test_a_modules_old_name_imports_where_it_moved_with_a_deprecation_warning(old):
    homes = [importlib.import_module(f"lightning_diffusion.{home}") for home in lightning_diffusion.MOVED[old]]
    sys.modules.pop(f"lightning_diffusion.{old}", None)  # imported afresh: the warning comes once an import
    with pytest.warns(DeprecationWarning, match=f"lightning_diffusion.{old} is now {homes[0].__name__}"):
        alias = importlib.import_module(f"lightning_diffusion.{old}")
    if len(homes) == 1:
        assert alias is homes[0]
        assert homes[0].__spec__.name == homes[0].__name__  # the alias did not take the module's own spec
        return
    for home in reversed(homes):  # a split module: each name from the first home that has it
        for name in [n for n in vars(home) if not n.startswith("_")]:
            first = next(h for h in homes if hasattr(h, name))
            assert getattr(alias, name) is getattr(first, name), name
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        alias.no_such_name


@pytest.mark.slow
def test_old_class_paths_and_the_public_names_resolve_in_a_fresh_interpreter():
    code = ("import lightning_diffusion.writer as w, lightning_diffusion.accelerators as a\n"
            "from lightning_diffusion import DiffusionModule, ImageWriter, PromptDataModule\n"
            "from lightning_diffusion.input import PromptDataModule as P\n"
            "from lightning_diffusion.output import ImageWriter as W\n"
            "assert w.ImageWriter is ImageWriter is W and P is PromptDataModule\n"
            "assert a.TaskBoundCUDAAccelerator.__module__ == 'lightning_diffusion.strategies.accelerators'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_open_store_picks_the_store_by_location_and_opening_makes_nothing(tmp_path):
    folder = open_store(tmp_path / "out")
    assert isinstance(folder, FolderStore) and folder.needs_shared_folder and not (tmp_path / "out").exists()
    assert folder.made()[0].size == 0 and folder.live_locks() == {}
    bucket = open_store("s3://bucket/prefix", options={"anon": True}, staging_dir=str(tmp_path / "staging"))
    assert isinstance(bucket, ObjectStore) and not bucket.needs_shared_folder
    assert bucket.manifest_where == "s3://bucket/prefix/manifest/" and not (tmp_path / "staging").exists()
    assert store_class("gs://b/p") is ObjectStore and store_class(tmp_path) is FolderStore
    members = [n for n, v in vars(OutputStore).items() if not n.startswith("_") and (
        callable(v) or isinstance(v, (property, staticmethod)))] + list(OutputStore.__annotations__)
    for store in (folder, bucket):  # every member of the interface, on each store
        assert not [name for name in members if not hasattr(store, name)], store
    assert (tmp_path / "staging").is_dir()  # asked for, the staging folder is made; released, it is gone
    bucket.release()
    assert not list((tmp_path / "staging").iterdir())


def test_only_the_output_package_tells_a_folder_from_a_url():
    """Nobody outside ``output/`` asks whether a location is a URL: they open a store."""
    askers = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "output":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "is_url" or (
                    isinstance(node, ast.ImportFrom) and node.module in (
                        "lightning_diffusion.output.object_store", "lightning_diffusion.output.bucket")
                    and any(alias.name in ("is_url", "ObjectStore", "access_problems") for alias in node.names)):
                askers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not askers, askers
