"""A storage URL as it may be written (the policy's measured.study.storage, summary.md) or printed (the last line
of a search, a storage error): a database password never leaves the process. The one place that says how."""

from __future__ import annotations

import re
import urllib.parse

HIDDEN = "***"
# a query parameter's name a driver takes a secret from: password, sslpassword, passwd, pwd, a token or a secret
_SECRET_NAME = re.compile(r"pass|pwd|secret|token", re.IGNORECASE)
# the same inside a value that is itself a connection string (odbc_connect=DRIVER=..;PWD=..; a libpq conninfo):
# its value braced ({a;b}) or up to the next ';' (past a space too: hiding more is the safe side)
_SECRET_PAIR = re.compile(
    r"(?P<key>[\w.-]*(?:pass|pwd|secret|token)[\w.-]*\s*=\s*)(?P<value>\{(?:[^}]|\}\})*\}?|[^;]*)", re.IGNORECASE
)
# stands for a hidden value while SQLAlchemy renders the URL (which percent-encodes query values), then becomes ***
_PLACEHOLDER = "autoprecHIDDENvalue"


def _secrets(url: str) -> tuple[str, list[str]]:
    """(`url` with its secrets hidden, the secrets). A file path (no ://) is kept as it is: it is not sent to a
    server. A URL is read as SQLAlchemy reads it (what it and the driver connect with); one it cannot parse, which
    Optuna cannot open either, is hidden by _unparsed."""
    if "://" not in url:
        return url, []
    from sqlalchemy.engine import make_url  # optuna's own dependency; imported where a URL is given

    try:
        parsed = make_url(url)
    except Exception:  # ArgumentError, or a port that is not a number (ValueError)
        return _unparsed(url)
    secrets: list[str] = []
    if parsed.password is not None:
        secrets.append(str(parsed.password))
        # its raw text as given (SQLAlchemy's user part holds no ':' or '/', its password runs to the first '@')
        secrets.append(url.partition("://")[2].partition(":")[2].partition("@")[0])
    if parsed.host and "@" in parsed.host:
        # a password with an unencoded '@' (u:p@ss@h): SQLAlchemy ends it at the first, and the rest of it would
        # show as the host's start; all of it up to the last '@' is hidden
        tail, _, host = parsed.host.rpartition("@")
        secrets += [tail, f"{parsed.password}@{tail}"]
        parsed = parsed.set(host=host)

    def hide_pairs(value: str) -> str:
        def hide(match: re.Match[str]) -> str:
            secrets.append(match["value"])
            return match["key"] + _PLACEHOLDER

        return _SECRET_PAIR.sub(hide, value)

    query: dict[str, str | tuple[str, ...]] = {}
    for key, value in parsed.query.items():
        values = (value,) if isinstance(value, str) else tuple(value)
        if _SECRET_NAME.search(key):
            secrets += values
            values = tuple(_PLACEHOLDER for _ in values)
        values = tuple(hide_pairs(v) for v in values)
        query[key] = values[0] if len(values) == 1 else values
    database = hide_pairs(parsed.database) if parsed.database else parsed.database
    for raw in url.partition("?")[2].split("&"):  # a secret's raw text as given, for hide_credentials_in
        name, _, value = raw.partition("=")
        if _SECRET_NAME.search(urllib.parse.unquote_plus(name)):
            secrets.append(value)
    if not secrets:
        return url, []  # nothing to hide: as given (SQLAlchemy's rendering would percent-encode a path's ':' and '@')
    parsed = parsed.set(query=query, database=database)
    return parsed.render_as_string(hide_password=True).replace(_PLACEHOLDER, HIDDEN), secrets


def _unparsed(url: str) -> tuple[str, list[str]]:
    """A URL SQLAlchemy cannot parse: everything from the user's ':' to the last '@', wherever that '@' is, and
    all of a query that names a secret are hidden. More than a password may go; nothing like user:password@ stays."""
    scheme, sep, rest = url.partition("://")
    secrets = []
    user_info, at, host = rest.rpartition("@")
    if at and ":" in user_info:
        user, _, password = user_info.partition(":")
        secrets.append(password)
        rest = f"{user}:{HIDDEN}@{host}"
    path, question, query = rest.partition("?")
    if _SECRET_NAME.search(urllib.parse.unquote_plus(query)):
        secrets.append(query)
        rest = f"{path}?{HIDDEN}"
    return scheme + sep + rest, secrets


def hide_credentials(url: str) -> str:
    """`url` with its secrets as ***: a password (user:PASSWORD@host), a query parameter naming one (password=),
    one inside a query value that is a connection string (odbc_connect=...PWD=...); a file path as given."""
    return _secrets(url)[0]


def _forms(secret: str) -> set[str]:
    """`secret` as it may be quoted in a message: as given, percent-decoded or percent-encoded."""
    forms = {secret, urllib.parse.unquote(secret), urllib.parse.unquote_plus(secret)}
    forms |= {urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret), urllib.parse.quote(secret)}
    return {form for form in forms if form}


def hide_credentials_in(text: str, url: str) -> str:
    """`text` (another library's error message, say) with `url` as hide_credentials shows it, and with no
    secret of `url` in it, as given, percent-decoded or percent-encoded."""
    hidden, secrets = _secrets(url)
    text = text.replace(url, hidden)
    for secret in sorted({form for raw in secrets for form in _forms(raw)}, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text
