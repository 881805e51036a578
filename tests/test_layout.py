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

PACKAGE = Path(lightning_diffusion.__file__).parent


def test_the_top_of_the_package_holds_at_most_ten_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


@pytest.mark.parametrize("old", sorted(lightning_diffusion.MOVED))
def test_a_modules_old_flat_name_imports_the_module_it_moved_to(old):
    moved = importlib.import_module(f"lightning_diffusion.{lightning_diffusion.MOVED[old]}")
    assert importlib.import_module(f"lightning_diffusion.{old}") is moved
    assert moved.__spec__.name == moved.__name__  # the alias did not take the module's own spec


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
