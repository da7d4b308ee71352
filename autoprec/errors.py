"""The one exception type for a user's mistake: the CLI prints it as one line and exits 2."""


class UserError(ValueError):
    """A problem with what the user gave us (a model.py, a policy file, an option), not a bug."""
