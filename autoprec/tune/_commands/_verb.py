"""What a verb of the command line is (`Verb`: its name, its help, its own arguments and what runs it), and what
every verb shares: the global flags named under it, a progress line, the --json result."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

GLOBAL_FLAGS = (
    ("--debug", "show tracebacks and debug logs"),
    ("--quiet", "no progress bars and no tables: warnings, errors and the exit code only"),
    ("--json", "print the result as one JSON object on stdout (progress stays on stderr)"),
)


def global_flags(p: argparse.ArgumentParser) -> None:
    """The top-level flags, accepted after the verb too (`autoprec search m.py --json`), and named under the verb's
    --help (a user reading `autoprec predict --help` would not find --json otherwise)."""
    for flag, _ in GLOBAL_FLAGS:
        p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.epilog = "also here: " + "; ".join(f"{flag}: {text}" for flag, text in GLOBAL_FLAGS)


@dataclasses.dataclass(frozen=True)
class Verb:
    """One verb: `arguments` adds its own options to its parser, `run` does it and returns the exit code."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None  # its --help's text (default: `help`)

    def add_to(self, verbs: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Its parser among the command line's verbs, with the global flags named under it."""
        p = verbs.add_parser(self.name, help=self.help, description=self.description or self.help)
        self.arguments(p)
        global_flags(p)
        p.set_defaults(func=self.run)
        return p


def say(args: argparse.Namespace, line: str) -> None:
    """A progress line on stderr, unless --quiet or --json (stdout then holds only the result)."""
    if not (args.quiet or args.json):
        print(line, file=sys.stderr)


def print_json(args: argparse.Namespace, result: object, **options) -> None:
    """--json's one result object, on the stdout main was given: the user's own prints went to stderr meanwhile."""
    print(json.dumps(result, **options), file=getattr(args, "result_stdout", None) or sys.stdout)
