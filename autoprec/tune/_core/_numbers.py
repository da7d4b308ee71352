"""Numbers and choices as a person types them (a command-line option, a budget string): numbers in ASCII only, a
choice of words in any case.

Python's float() and int() also read "1_0" as 10 and Arabic-Indic or full-width digits as numbers, so a typo or a
pasted value could run as a number nobody meant. The forms accepted here are the ones the help and the docs show;
what is read from a file keeps its own format's rules (YAML, JSON, CSV).
"""

from __future__ import annotations

import argparse
import enum
import re
from typing import TypeVar

DECIMAL_FORMS = "a number in ASCII digits, such as 0.01, 5, -2 or 1e-3 (inf and nan are words, not digits)"
INTEGER_FORMS = "a whole number in ASCII digits, such as 20 or -1"

# float()'s grammar less its "_" between digits and its non-ASCII digits and spaces; inf and nan are read so the
# option's own check can say why it wants a finite number
_DECIMAL = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?|inf|infinity|nan)", re.ASCII | re.IGNORECASE)
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)
_SPACE = " \t"


class NotANumber(argparse.ArgumentTypeError, ValueError):
    """A ValueError to the library's callers; to argparse, a type error whose message it prints as it is."""


def parse_decimal(text: str) -> float:
    """`text` (spaces around it allowed) as a float, where it is DECIMAL_FORMS; NotANumber naming it otherwise."""
    stripped = text.strip(_SPACE) if isinstance(text, str) else None
    if stripped is None or not _DECIMAL.fullmatch(stripped):
        raise NotANumber(f"{text!r} is not {DECIMAL_FORMS}")
    return float(stripped)


def parse_integer(text: str) -> int:
    """`text` (spaces around it allowed) as an int, where it is INTEGER_FORMS; NotANumber naming it otherwise."""
    stripped = text.strip(_SPACE) if isinstance(text, str) else None
    if stripped is None or not _INTEGER.fullmatch(stripped):
        raise NotANumber(f"{text!r} is not {INTEGER_FORMS}")
    try:
        return int(stripped)
    except ValueError:  # past sys.get_int_max_str_digits()
        raise NotANumber(f"{text[:20]!r}... ({len(text)} characters) is too long a number") from None


E = TypeVar("E", bound=enum.Enum)


def parse_option(kind: type[E], value: object, name: str) -> E:
    """One of a string enum's values (a member, or its text in any case), or a ValueError naming the choices."""
    try:
        return kind(str(getattr(value, "value", value)).strip().lower())
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(x.value for x in kind)}, but got {value!r}") from None
