"""The one exception type for a user's mistake: the CLI prints it as one line and exits 2; and how a value read
from a file is shown in a message or a printed line."""

from __future__ import annotations


class UserError(ValueError):
    """A problem with what the user gave us (a model.py, a policy file, an option), not a bug."""


class RankFailed(KeyboardInterrupt):
    """A job of ranks working together (a sharded search under torchrun) cannot go on: a rank did not answer within
    the timeout, or a collective broke (the message names the ranks and what they said). A KeyboardInterrupt, as
    SIGTERM's is in the CLI: it passes every handler of a candidate's failure (`except Exception`), since no trial
    can follow, and Optuna marks the running trial failed before it re-raises one, so the study stays consistent
    and a rerun resumes. The CLI prints it as one line."""


def describe(exc: BaseException, limit: int | None = 300) -> str:
    """`Type: first line of the message`, cut at `limit` characters: another library's error inside one of ours."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:limit] if limit else first}"


def printable(text: str) -> str:
    """`text` with every character a terminal or an editor could act on (C0 and C1 controls such as ESC, CR and
    BEL, line separators, bidi overrides) written as its escape (\\x1b, \\r, \\u202e): text from a received file
    printed, or written into a comment, can then neither set the title, clear the screen nor start a line."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def shown(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters, for a value read from a file inside a one-line message."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits(), made in code
        return f"an integer of {value.bit_length() if isinstance(value, int) else '?'} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
