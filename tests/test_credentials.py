"""autoprec/tune/credentials.py: a storage URL as it may be written or printed, its password hidden."""

import pytest

from autoprec.tune.credentials import hide_credentials, hide_credentials_in


@pytest.mark.parametrize(
    "url, shown",
    [
        ("postgresql+psycopg2://user:pw@host/db", "postgresql+psycopg2://user:***@host/db"),
        ("postgresql://u:p%40ss@h:5432/db?sslmode=require", "postgresql://u:***@h:5432/db?sslmode=require"),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),  # an unencoded @: all of it up to the host
        ("mysql://u:pa/ss:w@h/db", "mysql://u:***@h/db"),
        ("postgresql://h/db?user=u&password=sec&sslpassword=key2", "postgresql://h/db?user=u&password=***&sslpassword=***"),
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
    from autoprec.tune.credentials import hide_credentials

    assert hide_credentials("postgresql://u:pw@h/db?x=a@b") == "postgresql://u:***@h/db?x=a@b"
    assert hide_credentials("sqlite:////tmp/a:b@c/db") == "sqlite:////tmp/a:b@c/db"
    assert hide_credentials("postgresql://u:p@ss@h:5432/db") == "postgresql://u:***@h:5432/db"
