"""A prompt file saved with a UTF-8 byte-order mark (as Windows editors save it) reads exactly as
the same file without one: the mark is not part of a CSV header, a first prompt or a JSON line."""

import pytest

from lightning_diffusion.input.formats import read_records

BOM = b"\xef\xbb\xbf"

FILES = {
    "prompts.csv": b"prompt,seed\na red circle,3\n\"a blue, square\",\n",
    "prompts.txt": b"a red circle\n\na blue square\n",
    "prompts.jsonl": b'{"prompt": "a red circle", "seed": 3}\n{"prompt": "a blue square"}\n',
}


def _read(path):
    records = read_records(str(path))
    return [records[i] for i in range(len(records))], dict(records.bad)


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_byte_order_mark_reads_as_the_same_file_without_one(name, tmp_path):
    plain, marked = tmp_path / "plain" / name, tmp_path / "marked" / name
    for folder in (plain.parent, marked.parent):
        folder.mkdir()
    plain.write_bytes(FILES[name])
    marked.write_bytes(BOM + FILES[name])
    records, bad = _read(marked)
    assert (records, bad) == _read(plain)
    assert not bad and records[0]["prompt"] == "a red circle"
    assert len(records) == 2 and records[1]["prompt"] in ("a blue square", "a blue, square")


def test_a_marked_jsonl_file_names_its_lines_as_the_file_does(tmp_path):
    """Line numbers (and offsets read later, on demand) count from the file's first line."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(BOM + b'{"prompt": "fine"}\n{"prompt": \n{"prompt": "last"}\n')
    records = read_records(str(path))
    assert records[0]["prompt"] == "fine" and records[2]["prompt"] == "last"
    assert records.bad[1][0] == f"{path}:2"
