import errno
import os
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


@pytest.mark.parametrize("old", ["complete", None])
def test_a_full_disk_is_one_line_naming_the_file_which_is_left_as_it_was(tmp_path: Path, old):
    path = tmp_path / "trials.csv"
    if old is not None:
        path.write_text(old, encoding="utf-8")

    def half(tmp: Path) -> None:
        tmp.write_text("half", encoding="utf-8")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UserError) as err:  # was the raw OSError: a traceback from the CLI
        write_atomically(path, half)
    message = str(err.value)
    assert message.startswith(f"{path}: cannot write it (No space left on device)") and "\n" not in message
    assert isinstance(err.value.__cause__, OSError)
    assert [p.name for p in tmp_path.iterdir()] == (["trials.csv"] if old else [])  # no half-written file
    assert old is None or path.read_text(encoding="utf-8") == old


def test_a_write_interrupted_by_ctrl_c_leaves_no_temporary_and_stays_an_interrupt(tmp_path: Path):
    def interrupted(tmp: Path) -> None:
        tmp.write_text("half", encoding="utf-8")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "policy.json", interrupted)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_is_gone_is_one_line_too(tmp_path: Path):
    with pytest.raises(UserError, match="cannot write it"):
        write_text(tmp_path / "gone" / "summary.md", "x")


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


# ---- claim_folder: one owner's live runs at a time ---------------------------------------------------------------


def test_a_live_claim_refuses_another_owner_and_admits_the_same_one(tmp_path: Path):
    from autoprec.files import Taken, claim_folder

    a, b = {"model": "a", "fingerprint": "1"}, {"model": "b", "fingerprint": "2"}
    with claim_folder(tmp_path, a, key="fingerprint"):
        with pytest.raises(Taken) as taken:
            with claim_folder(tmp_path, b, key="fingerprint"):
                pytest.fail("a second owner got the folder while the first held it")
        assert taken.value.owner["model"] == "a" and taken.value.owner["pid"] == os.getpid()
        with claim_folder(tmp_path, dict(a), key="fingerprint"):  # another worker (or a resume) of the same owner
            pass
    with claim_folder(tmp_path, b, key="fingerprint"):  # released: the folder is free again
        pass


def test_the_check_runs_under_the_claim_and_only_when_no_one_holds_the_folder(tmp_path: Path):
    from autoprec.files import claim_folder

    calls = []
    with claim_folder(tmp_path, {"k": "1"}, key="k", check=lambda: calls.append("first")):
        with claim_folder(tmp_path, {"k": "1"}, key="k", check=lambda: calls.append("joined")):
            pass
    assert calls == ["first"]

    def refuse() -> None:
        raise ValueError("results of another model")

    with pytest.raises(ValueError, match="another model"):
        with claim_folder(tmp_path, {"k": "2"}, key="k", check=refuse):
            pass
    with claim_folder(tmp_path, {"k": "3"}, key="k"):  # the refused one holds nothing
        pass


def test_a_claim_of_a_killed_process_does_not_block(tmp_path: Path):
    import signal
    import subprocess
    import sys

    from autoprec.files import claim_folder

    code = (
        "import sys; from autoprec.files import claim_folder\n"
        f"with claim_folder({str(tmp_path)!r}, {{'k': 'other'}}, key='k'):\n"
        "    print('held', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        from autoprec.files import Taken

        with pytest.raises(Taken):
            with claim_folder(tmp_path, {"k": "mine"}, key="k"):
                pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with claim_folder(tmp_path, {"k": "mine"}, key="k"):  # the OS dropped the dead process's lock
        pass
