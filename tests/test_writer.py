"""File names from prompts stay inside the output folder and never collide."""

import pytest

from lightning_diffusion.data import PromptDataModule
from lightning_diffusion.errors import ConfigError
from lightning_diffusion.files import image_filename


@pytest.mark.parametrize(
    "prompt",
    ["../../etc/passwd", "/absolute/path", "nul\x00byte", "x" * 5000, "ünïcödé ☃ 雪", "", "...", "a/b\\c:d*e?f"],
)
def test_names_from_hostile_prompts_are_plain_and_short(prompt):
    name = image_filename(12, prompt)
    assert name.startswith("000012-") and name.endswith(".png")
    assert len(name) <= 6 + 1 + 40 + 4
    assert set(name[7:-4]) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert "/" not in name and "\\" not in name and "\x00" not in name and ".." not in name


def test_identical_prompts_get_distinct_names():
    assert len({image_filename(i, "the same prompt") for i in range(100)}) == 100


def test_prompt_file_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(ConfigError, match=r"p.txt:2: not valid UTF-8"):
        PromptDataModule(str(path))
