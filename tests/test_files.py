from pathlib import Path

import pytest

from autoprec.errors import UserError
from autoprec.files import read_json, write_atomically, write_text


def test_write_text_replaces_the_file_and_leaves_no_temporary(tmp_path: Path):
    path = tmp_path / "policy.json"
    path.write_text("old", encoding="utf-8")
    write_text(path, "new")
    assert path.read_text(encoding="utf-8") == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path):
    path = tmp_path / "trials.csv"
    path.write_text("complete", encoding="utf-8")

    def half(tmp: Path) -> None:
        tmp.write_text("half", encoding="utf-8")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, half)
    assert path.read_text(encoding="utf-8") == "complete"
    assert [p.name for p in tmp_path.iterdir()] == ["trials.csv"]


def test_a_written_file_gets_the_mode_open_would_give_it(tmp_path: Path):
    import os

    mask = os.umask(0o022)
    try:
        write_text(tmp_path / "summary.md", "x")
        (tmp_path / "plain.md").write_text("x")
    finally:
        os.umask(mask)
    assert (tmp_path / "summary.md").stat().st_mode & 0o777 == (tmp_path / "plain.md").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    "content, expected",
    [
        (b'{"a": ' + b"9" * 5000 + b"}", "a number of more than 4300 digits"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
        (b'{"a": 1,\n "b": }', "not valid JSON: Expecting value at line 2 column 7"),
        (b"\xff\xfe{}", "not UTF-8 text"),
    ],
    ids=["long-number", "deep", "malformed", "binary"],
)
def test_a_json_file_that_cannot_be_read_is_one_error_naming_the_file(tmp_path: Path, content: bytes, expected: str):
    path = tmp_path / "profile.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as info:
        read_json(path)
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value) and len(str(info.value)) < 300


def test_read_json_reads_json(tmp_path: Path):
    (tmp_path / "a.json").write_text('{"a": [1, 2.5, "x", null]}', encoding="utf-8")
    assert read_json(tmp_path / "a.json") == {"a": [1, 2.5, "x", None]}
