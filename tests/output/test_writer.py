"""File names from prompts stay inside the output folder and never collide."""

import pytest

from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.input.data import PromptDataModule
from lightning_diffusion.output.files import image_filename


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


def test_a_writers_bug_keeps_its_traceback_and_a_file_system_error_is_one_line(tmp_path):
    """A full disk or a lost mount is said in one line (the message is all); anything else that a
    writer raises is a bug, and the CLI prints its traceback above that line for the report."""
    from lightning_diffusion.output.background import WriteFailed
    from lightning_diffusion.output.writer import writing_failed

    bug = writing_failed("TypeError: bad operand", tmp_path,
                         cause=WriteFailed("TypeError", "bad operand", "Traceback (most recent call last):\n  ...\n"))
    assert bug.details.startswith("Traceback") and "bad operand" in str(bug)
    for kind in ("PermissionError", "OSError", "FileNotFoundError"):
        assert writing_failed(f"{kind}: x", tmp_path, cause=WriteFailed(kind, "x", "Traceback ...")).details == ""
    try:
        raise ValueError("made here")
    except ValueError as err:
        here = writing_failed("ValueError: made here", tmp_path, cause=err)
    assert "raise ValueError" in here.details
    assert writing_failed("something", tmp_path).details == ""  # another rank's: only its text came
