"""The one exception type for a user's mistake: the CLI prints it as one line and exits 2."""


class UserError(ValueError):
    """A problem with what the user gave us (a model.py, a policy file, an option), not a bug."""


def describe(exc: BaseException, limit: int | None = 300) -> str:
    """`Type: first line of the message`, cut at `limit` characters: another library's error inside one of ours."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:limit] if limit else first}"
