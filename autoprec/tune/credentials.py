"""A storage URL as it may be written (the policy's measured.study.storage, summary.md) or printed (the last line
of a search, a storage error): a database password never leaves the process. The one place that says how."""

from __future__ import annotations

import re
import urllib.parse

HIDDEN = "***"
# a query parameter a driver takes a secret from: password=, sslpassword=, passwd=, pwd=, a token or a secret
_SECRET_PARAM = re.compile(r"(?P<key>[?&][^=&#]*(?:pass|pwd|secret|token)[^=&#]*=)(?P<value>[^&#]*)", re.IGNORECASE)


def _secrets(url: str) -> tuple[str, list[str]]:
    """(`url` with its secrets hidden, the secrets). A file path (no ://) is kept as it is. The password is all
    from the user's ':' to the last '@' (SQLAlchemy stops at the first '@', so a password with an unencoded '@'
    would show its tail), unless that '@' is in the query (?x=a@b); a user part with a '/' is a path
    (sqlite:////tmp/a:b@c/db), no credentials."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, []
    secrets = []
    user_info, at, host = rest.rpartition("@")
    if any(c in user_info for c in "?#"):  # that '@' is in the query or fragment: the user's ends the authority
        authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
        user_info, at, host = authority.rpartition("@")
        host += rest[len(authority) :]
    user, colon, password = user_info.partition(":")
    if at and colon and "/" not in user:
        secrets.append(password)
        rest = f"{user}:{HIDDEN}@{host}"

    def hide(match: re.Match[str]) -> str:
        secrets.append(match["value"])
        return match["key"] + HIDDEN

    rest = _SECRET_PARAM.sub(hide, rest)
    return scheme + sep + rest, secrets


def hide_credentials(url: str) -> str:
    """`url` with its password (user:PASSWORD@host, or a password= query parameter) as ***; a path as given."""
    return _secrets(url)[0]


def hide_credentials_in(text: str, url: str) -> str:
    """`text` (another library's error message, say) with `url` as hide_credentials shows it, and with no
    password of `url` in it, as given or percent-decoded."""
    hidden, secrets = _secrets(url)
    text = text.replace(url, hidden)
    for secret in sorted({s for raw in secrets if raw for s in (raw, urllib.parse.unquote(raw))}, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text
