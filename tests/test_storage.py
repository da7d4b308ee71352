"""autoprec/tune/_search/_storage.py: opening --storage. A file that is not an Optuna journal is refused with its bytes unchanged;
a journal's torn last line is the only thing ever cut, and every record Optuna wrote before it stays. A storage URL as it
may be written or printed: its password hidden."""

from __future__ import annotations

import json
import os
from pathlib import Path

import optuna
import pytest

from autoprec import UserError
from autoprec.tune._core._config import SearchConfig
from autoprec.tune._search._storage import check_storage, hide_credentials, hide_credentials_in, study_storage


def config(path: Path | str) -> SearchConfig:
    return SearchConfig(budget=0.1, storage=str(path))


def open_storage(path: Path | str, out: Path) -> str:
    """Check --storage as the pipeline does before profiling, then open it; return where the study lives."""
    check_storage(config(path))
    return study_storage(config(path), out)[1]


def real_journal(path: Path, trials: int = 3) -> None:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    study = optuna.create_study(study_name="s", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=trials)


def trials_in(path: Path) -> list[float]:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    return [t.params["x"] for t in optuna.load_study(study_name="s", storage=storage).trials if t.params]


@pytest.mark.parametrize(
    "content",
    [
        b'{"a": 1}',  # one line of JSON, no newline: once read as a journal with a torn tail and wiped
        b'{"a": 1}\n',
        b'{"a": 1}\n{"b": 2}',
        b"name,score\nresnet,0.91\nvit,0.93",  # a CSV
        bytes(range(256)) * 4,  # a binary file
        b'["op_code", "worker_id"]\n',  # JSON, but not a record
        b'{"op_code": "x", "worker_id": "w"}\n',  # a record's keys, but not Optuna's types
    ],
    ids=["json-line", "json-line-newline", "json-torn", "csv", "binary", "json-list", "wrong-types"],
)
def test_a_file_that_is_not_an_optuna_journal_is_refused_with_its_bytes_unchanged(tmp_path, content):
    path = tmp_path / "results.json"
    path.write_bytes(content)
    with pytest.raises(UserError, match="not an Optuna journal") as err:
        open_storage(path, tmp_path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message and "give a journal file's path" in message
    assert path.read_bytes() == content
    assert not Path(f"{path}.lock").exists()


def test_a_torn_last_line_is_cut_and_every_complete_record_is_kept(tmp_path, caplog):
    path = tmp_path / "study.journal"
    real_journal(path)
    whole = path.read_bytes()
    before = trials_in(path)
    last = whole.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(whole[: last + 25])  # the last record cut short, as by a kill mid-write
    with caplog.at_level("WARNING", logger="autoprec"):
        open_storage(path, tmp_path)
    assert path.read_bytes() == whole[:last]  # exactly the torn bytes are gone
    assert "its last line was cut short (25 bytes" in caplog.text
    assert trials_in(path) == before


def test_a_journal_whose_only_record_is_torn_is_emptied_and_opened(tmp_path):
    # a disk full at the study's very first write: nothing complete to keep, and the file begins as only Optuna's does
    path = tmp_path / "study.journal"
    real_journal(path, trials=1)
    path.write_bytes(path.read_bytes()[:30])
    open_storage(path, tmp_path)
    assert path.read_bytes() == b""
    for content in (b"{", b'{"op_code"'):  # too little to tell it from another file: refused, unchanged
        path.write_bytes(content)
        with pytest.raises(UserError, match="not an Optuna journal"):
            open_storage(path, tmp_path)
        assert path.read_bytes() == content


def test_an_intact_or_empty_journal_is_opened_untouched(tmp_path, caplog):
    path = tmp_path / "study.journal"
    real_journal(path)
    whole = path.read_bytes()
    empty = tmp_path / "empty.journal"
    empty.touch()
    with caplog.at_level("WARNING", logger="autoprec"):
        assert open_storage(path, tmp_path) == str(path)
        assert open_storage(empty, tmp_path) == str(empty)
    assert path.read_bytes() == whole and empty.read_bytes() == b""
    assert not [r for r in caplog.records if r.name == "autoprec"]


def test_a_torn_tail_that_does_not_begin_like_an_optuna_record_is_not_cut(tmp_path):
    path = tmp_path / "study.journal"
    real_journal(path)
    content = path.read_bytes() + b"a note typed at the end"
    path.write_bytes(content)
    with pytest.raises(UserError, match=r"line \d+ is not an Optuna journal record") as err:
        open_storage(path, tmp_path)
    assert str(path) in str(err.value)
    assert path.read_bytes() == content


def journal_with(tmp_path, bad: bytes, *, at: int):
    """A real study's journal with `bad` inserted as its line `at` + 1: (its path, its bytes)."""
    path = tmp_path / "study.journal"
    real_journal(path)
    lines = path.read_bytes().splitlines(keepends=True)
    content = b"".join(lines[:at] + [bad] + lines[at:])
    path.write_bytes(content)
    return path, content


@pytest.mark.parametrize(
    "bad",
    [b"not json at all\n", b'{"a": 1}\n', b"\n", b'{"op_code": 4}\n'],
    ids=["text", "json", "blank", "no-worker"],
)
def test_one_bad_line_inside_a_journal_names_the_file_and_the_line_and_changes_nothing(tmp_path, bad):
    path, content = journal_with(tmp_path, bad, at=3)
    with pytest.raises(UserError) as err:
        open_storage(path, tmp_path)
    message = str(err.value)
    assert f"{path}: line 4 is not an Optuna journal record" in message and "\n" not in message
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    "bad", [b'{"op_code":99,"worker_id":"w"}\n', b'{"op_code":4,"worker_id":"w"}\n'], ids=["unknown-op", "no-study-id"]
)
def test_a_record_optuna_cannot_replay_names_its_line_too(tmp_path, bad):
    # a record's shape with a hand-edited op_code or a field missing: Optuna's replay raised AssertionError/KeyError
    path, content = journal_with(tmp_path, bad, at=5)
    with pytest.raises(UserError, match="line 6 is not an Optuna journal record Optuna can replay") as err:
        open_storage(path, tmp_path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert path.read_bytes() == content


def test_a_bad_last_complete_line_is_not_cut_either(tmp_path):
    path = tmp_path / "study.journal"
    real_journal(path)
    content = path.read_bytes() + b"stray\n"
    path.write_bytes(content)
    lines = content.count(b"\n")
    with pytest.raises(UserError, match=f"line {lines} is not an Optuna journal record"):
        open_storage(path, tmp_path)
    assert path.read_bytes() == content


def test_non_regular_files_are_refused_in_one_line_before_anything_is_opened(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening a FIFO to read it would wait for a writer forever
    for path, what in ((folder, "a folder"), (Path(os.devnull), "not a regular file"), (fifo, "not a regular file")):
        with pytest.raises(UserError, match=what) as err:
            check_storage(config(path))
        assert str(path) in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(UserError, match=what):
            study_storage(config(path), tmp_path)


def test_a_journal_whose_folder_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "study.journal"
    with pytest.raises(UserError, match="cannot") as err:
        open_storage(path, tmp_path)
    assert str(path) in str(err.value)
    assert (tmp_path / "file").read_text() == "x"


def test_a_journal_that_cannot_be_written_is_refused_by_the_check_before_profiling(tmp_path):
    # the check the pipeline makes before the profile, not only the study's opening after it
    (tmp_path / "afile").write_text("x")
    for path in (tmp_path / "afile" / "study.journal", tmp_path / "afile" / "deeper" / "study.journal"):
        with pytest.raises(UserError, match="cannot make it") as err:
            check_storage(config(path))
        assert str(path) in str(err.value) and f"{tmp_path / 'afile'} is a file" in str(err.value)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="is a file"):  # the default journal in --out, too
        check_storage(SearchConfig(budget=0.1), tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "x"
    # a journal that can be written passes, and the check leaves nothing behind (opening the study makes the file)
    check_storage(config(tmp_path / "new" / "study.journal"))
    real_journal(tmp_path / "study.journal", trials=1)
    before = (tmp_path / "study.journal").read_bytes()
    check_storage(config(tmp_path / "study.journal"))
    assert (tmp_path / "study.journal").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "study.journal"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
@pytest.mark.parametrize("exists", [False, True])
def test_a_journal_in_a_read_only_folder_is_refused_by_the_check_before_profiling(tmp_path, exists):
    folder = tmp_path / "ro"
    folder.mkdir()
    if exists:
        real_journal(folder / "study.journal", trials=1)  # writable itself, but Optuna's lock goes beside it
    before = sorted(folder.iterdir())
    folder.chmod(0o555)
    try:
        with pytest.raises(UserError, match="cannot write there"):
            check_storage(config(folder / "study.journal"))
    finally:
        folder.chmod(0o755)
    assert sorted(folder.iterdir()) == before


def test_a_valid_record_line_is_accepted_as_optuna_writes_it(tmp_path):
    # the format checked is the installed Optuna's: json.dumps with an int op_code and a str worker_id first
    path = tmp_path / "study.journal"
    real_journal(path, trials=1)
    first = json.loads(path.read_bytes().splitlines()[0])
    assert isinstance(first["op_code"], int) and isinstance(first["worker_id"], str)
    assert path.read_bytes().startswith(b'{"op_code":')


def test_a_journal_nested_deeper_than_python_reads_is_refused_in_one_line_unchanged(tmp_path):
    from autoprec.tune import SearchConfig
    from autoprec.tune._search._storage import check_storage

    path = tmp_path / "study.journal"
    path.write_text("[" * 5000 + "\n", encoding="utf-8")
    before = path.read_bytes()
    with pytest.raises(UserError, match="not an Optuna journal"):
        check_storage(SearchConfig(budget=0.1, storage=str(path)))
    assert path.read_bytes() == before


# ---- a study another autoprec version made ---------------------------------------------------------------------------


def open_overflow_study(out: Path, sharding=None, choices=None, **settings):
    """open_study on a tiny model (no profile needed: the choices are given), as the pipeline calls it."""
    from autoprec.tune import load_task, prepare
    from autoprec.tune._core._space import space_from_dict
    from autoprec.tune._measure._choices import Choices
    from autoprec.tune._search._storage import open_study

    workload = prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), "cpu")
    workload.sharding = sharding
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}})
    choices = choices or Choices(default=("fp32",), layers={"fc1": ("fp32", "bf16")}, excluded={})
    return open_study(workload, space, choices, SearchConfig(budget=0.1, **settings), out, budget=0.1)


def test_a_study_from_before_the_weights_digest_is_refused_as_an_older_autoprecs(tmp_path, monkeypatch):
    """It recorded no weights: "a different model weights (None, now ...)" would tell a user who changed nothing
    that they had."""
    from autoprec.tune._search import _storage as study

    real = study._study_key
    with monkeypatch.context() as older:
        older.setattr(study, "_study_key", lambda *a, **kw: {k: v for k, v in real(*a, **kw).items() if k != "model weights"})
        open_overflow_study(tmp_path)
    with pytest.raises(UserError, match=r"made by an older autoprec that did not record the model's weights.*--study NEW_NAME"):
        open_overflow_study(tmp_path)


class Layout:
    """A sharded workload's layout as the study key reads it (_ranks.Ranks.layout); nothing else is asked of it."""

    def __init__(self, world_size):
        self.world_size = world_size

    def layout(self):
        return {"world_size": self.world_size, "mesh": [self.world_size], "parallelize": "model.py:parallelize"}


def test_a_sharded_study_is_resumed_on_its_own_layout_and_refused_on_another_or_unsharded(tmp_path):
    open_overflow_study(tmp_path, sharding=Layout(2))
    assert open_overflow_study(tmp_path, sharding=Layout(2))[0].study_name == "overflow_mlp"  # resumed
    with pytest.raises(
        UserError, match=r"different sharding \(sharding over 2 ranks, mesh \[2\], model.py:parallelize, now over 4 ranks"
    ):
        open_overflow_study(tmp_path, sharding=Layout(4))  # its trials were timed on 2 ranks
    with pytest.raises(UserError, match=r"different sharding \(sharding over 2 ranks.*, now none\)"):
        open_overflow_study(tmp_path)


def test_a_study_whose_trials_hold_the_fp8_all_gather_is_refused_where_they_could_not_and_a_study_from_before_by_name(tmp_path):
    import dataclasses

    from autoprec.tune._measure._choices import Choices

    fp8 = Choices(default=("fp32",), layers={"fc1": ("fp32", "fp8")}, excluded={})
    gathering = dataclasses.replace(fp8, fp8_all_gather=True)  # a sharded search offering it
    open_overflow_study(tmp_path / "a", sharding=Layout(2), choices=gathering)
    assert open_overflow_study(tmp_path / "a", sharding=Layout(2), choices=gathering)[1] == gathering  # resumed
    with pytest.raises(UserError, match=r"different fp8 all-gather \(fp8 all-gather searched, now none\)"):
        open_overflow_study(tmp_path / "a", sharding=Layout(2), choices=fp8)  # its trials hold it: not read without
    open_overflow_study(tmp_path / "b", sharding=Layout(2), choices=fp8)  # as an autoprec before the setting made it
    with pytest.raises(UserError, match=r"made by an autoprec that did not search FSDP2's fp8 all-gather.*--study NEW_NAME"):
        open_overflow_study(tmp_path / "b", sharding=Layout(2), choices=gathering)


def test_a_study_another_version_made_is_refused_in_one_line_naming_the_journal_and_what_to_do(tmp_path, monkeypatch):
    from autoprec.tune._search import _storage as study

    with monkeypatch.context() as other:
        other.setattr(study, "STUDY_VERSION", study.STUDY_VERSION + 1)
        open_overflow_study(tmp_path)
    journal = tmp_path / "study.journal"
    with pytest.raises(UserError) as err:
        open_overflow_study(tmp_path)
    assert str(err.value) == (
        f"study 'overflow_mlp' in {journal} was made by another autoprec version (study format version "
        f"{study.STUDY_VERSION + 1}; this version makes {study.STUDY_VERSION}): pass --study NEW_NAME to start another, "
        f"or delete {journal} to start over"
    )
    assert open_overflow_study(tmp_path, study_name="fresh")[0].study_name == "fresh"  # the same journal, a new name


def test_a_study_whose_trials_carry_no_key_is_another_versions_and_refused_in_a_database_too(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    made = optuna.create_study(study_name="overflow_mlp", storage=url)  # as an autoprec without the key on trial 0
    made.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    with pytest.raises(
        UserError, match=rf"made by another autoprec version \(study format version none; .*delete the study from {url} "
    ):
        open_overflow_study(tmp_path, storage=url)


def _no_module(name: str):
    def import_dbapi(cls):
        raise ImportError(f"No module named {name!r}", name=name)

    return classmethod(import_dbapi)


def test_a_database_url_whose_driver_is_missing_names_the_driver_sqlalchemy_resolved_and_the_fix(tmp_path, monkeypatch):
    """postgresql:// is psycopg2's in SQLAlchemy 2.0 and psycopg's in 2.1: the line said "install psycopg2-binary"
    where that was installed. No server is reached: the driver's import fails first."""
    from sqlalchemy.dialects.postgresql import psycopg, psycopg2
    from sqlalchemy.engine import make_url

    default = make_url("postgresql://").get_dialect()  # what this SQLAlchemy reads a URL without +driver as
    other = psycopg.dialect if default.driver == "psycopg2" else psycopg2.dialect
    monkeypatch.setattr(default, "import_dbapi", _no_module(default.driver))
    monkeypatch.setattr(other, "import_dbapi", classmethod(lambda cls: object()))  # installed, as far as it can tell
    with pytest.raises(UserError) as info:
        study_storage(config("postgresql://alice:s3cret@127.0.0.1:1/db"), tmp_path)
    line = str(info.value)
    assert line.startswith("--storage postgresql://alice:***@127.0.0.1:1/db: SQLAlchemy ")
    assert f"reads postgresql:// as postgresql+{default.driver} and needs the {default.driver} driver, which is not " in line
    assert f"(no module {default.driver!r})" in line and "s3cret" not in line
    assert f"name an installed one in the URL (postgresql+{other.driver}://..." in line and line.endswith(
        f"install {default.driver}"
    )


def test_a_url_naming_a_missing_driver_with_none_other_installed_says_to_install_it(tmp_path, monkeypatch):
    import importlib

    storage_module = importlib.import_module("autoprec.tune._search._storage")
    from sqlalchemy.dialects.postgresql import pg8000

    monkeypatch.setattr(pg8000.dialect, "import_dbapi", _no_module("pg8000"))
    monkeypatch.setattr(storage_module, "_installed_drivers", lambda backend: [])
    with pytest.raises(UserError) as info:
        study_storage(config("postgresql+pg8000://u@127.0.0.1:1/db"), tmp_path)
    assert str(info.value) == (
        f"--storage postgresql+pg8000://u@127.0.0.1:1/db: SQLAlchemy {__import__('sqlalchemy').__version__} needs the "
        "pg8000 driver, which is not installed (no module 'pg8000'); install pg8000, or name another driver you have "
        "installed in the URL (postgresql+DRIVER://...)"
    )


@pytest.mark.parametrize(
    "url, shown",
    [
        ("postgresql+psycopg2://user:pw@host/db", "postgresql+psycopg2://user:***@host/db"),
        ("postgresql://u:p%40ss@h:5432/db?sslmode=require", "postgresql://u:***@h:5432/db?sslmode=require"),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),  # an unencoded @: all of it up to the host
        ("mysql://u:pa/ss:w@h/db", "mysql://u:***@h/db"),
        # as SQLAlchemy renders it: the query's keys sorted
        ("postgresql://h/db?user=u&password=sec&sslpassword=key2", "postgresql://h/db?password=***&sslpassword=***&user=u"),
        ("postgresql://u:@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),  # no password to hide
        ("sqlite:////tmp/a:b@c/study.db", "sqlite:////tmp/a:b@c/study.db"),  # a path: its ':' and '@' are no credentials
        ("sqlite:///study.db", "sqlite:///study.db"),
        ("runs/study.journal", "runs/study.journal"),
        ("/tmp/us:er@x/study.journal", "/tmp/us:er@x/study.journal"),  # a file path is kept as given
    ],
)
def test_a_storage_url_is_shown_without_its_password(url, shown):
    assert hide_credentials(url) == shown


def test_a_message_quoting_the_url_or_its_password_is_scrubbed():
    url = "postgresql+psycopg2://alice:p%40ss-word@db:5432/a?password=q-secret"
    text = f"could not parse {url!r}; auth failed for alice with p@ss-word (p%40ss-word), q-secret"
    scrubbed = hide_credentials_in(text, url)
    assert not any(secret in scrubbed for secret in ("p@ss-word", "p%40ss-word", "q-secret"))
    assert "postgresql+psycopg2://alice:***@db:5432/a?password=***" in scrubbed


def test_an_at_sign_in_the_path_or_query_is_not_taken_for_the_users():
    from autoprec.tune._search._storage import hide_credentials

    assert hide_credentials("postgresql://u:pw@h/db?x=a@b") == "postgresql://u:***@h/db?x=a%40b"  # SQLAlchemy's quoting
    assert hide_credentials("sqlite:////tmp/a:b@c/db") == "sqlite:////tmp/a:b@c/db"
    assert hide_credentials("postgresql://u:p@ss@h:5432/db") == "postgresql://u:***@h:5432/db"


@pytest.mark.parametrize("password", ["Hash#Pw", "Q?uery", "a#b?c", "x?y#z@w"])
def test_a_password_with_an_unencoded_hash_or_question_mark_is_hidden(password):
    # SQLAlchemy (and so psycopg2) connects with all of it: '#' and '?' do not end a password in its URLs
    from sqlalchemy.engine import make_url

    url = f"postgresql+psycopg2://alice:{password}@host:5432/db"
    assert make_url(url).password == password.partition("@")[0]
    assert hide_credentials(url) == "postgresql+psycopg2://alice:***@host:5432/db"
    scrubbed = hide_credentials_in(f"auth failed for {url}: password {password!r}", url)
    assert password not in scrubbed and password.partition("@")[0] not in scrubbed


@pytest.mark.parametrize("pwd", ["PWD", "Password", "pwd", "PASSWORD"])
def test_a_secret_inside_a_percent_encoded_connection_string_is_hidden(pwd):
    import urllib.parse

    odbc = f"DRIVER={{ODBC Driver 18}};SERVER=h;UID=u;{pwd}=s3cret-odbc;Encrypt=yes"
    url = "mssql+pyodbc:///?odbc_connect=" + urllib.parse.quote_plus(odbc)
    shown = hide_credentials(url)
    assert "s3cret" not in urllib.parse.unquote_plus(shown)
    assert urllib.parse.unquote_plus(shown).endswith(f"UID=u;{pwd}=***;Encrypt=yes")
    scrubbed = hide_credentials_in(f"cannot connect: {odbc!r} ({url})", url)
    assert "s3cret" not in scrubbed


def test_a_braced_odbc_password_is_hidden_whole():
    import urllib.parse

    url = "mssql+pyodbc://?odbc_connect=" + urllib.parse.quote_plus("SERVER=h;PWD={se;cr}}et};UID=u")
    assert urllib.parse.unquote_plus(hide_credentials(url)).endswith("?odbc_connect=SERVER=h;PWD=***;UID=u")


@pytest.mark.parametrize(
    "url, shown",
    [
        ("my-db://alice:pw#1@h/db", "my-db://alice:***@h/db"),  # not a scheme SQLAlchemy reads ('-')
        ("postgresql://alice:p#w@h:port/db", "postgresql://alice:***@h:port/db"),  # a port that is not a number
        ("my-db://h/db?sslmode=x&password=pw", "my-db://h/db?***"),
        ("my-db://alice:pw@h/db?x=a@b", "my-db://alice:***@b"),  # up to the last '@': more than the password, not less
    ],
)
def test_a_url_sqlalchemy_cannot_parse_shows_no_password(url, shown):
    assert hide_credentials(url) == shown
