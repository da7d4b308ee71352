"""autoprec/tune/_core/_credentials.py: a storage URL as it may be written or printed, its password hidden."""

import pytest

from autoprec.tune._core._credentials import hide_credentials, hide_credentials_in


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
    from autoprec.tune._core._credentials import hide_credentials

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
