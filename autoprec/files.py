"""Output files written so that a reader never sees half of one: several search workers share one output
folder, and each writes the profile, the policy and the tables when it finishes. And a JSON file read so that
whatever it holds is a one-line error naming it, not a traceback."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from autoprec.errors import UserError


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` on a temporary file in `path`'s folder, then rename it over `path`."""
    path = Path(path)
    # Created as open() would create it (mode 0666 less the umask; mkstemp's would be private, 0600), under a
    # name no other writer picks.
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(Path(tmp))
        os.replace(tmp, path)  # atomic on POSIX and Windows within one file system
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def read_json(path: str | Path) -> object:
    """A JSON file's value; UserError naming the file for anything but readable JSON (a file that is not UTF-8,
    malformed JSON, nesting deeper than Python recurses, a number longer than Python reads), never a traceback."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not valid JSON: the file is not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise UserError(f"{path}: not readable JSON: it nests too deeply to read") from None
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits(), a guard against slow conversion
        digits = sys.get_int_max_str_digits()
        raise UserError(f"{path}: not readable JSON: it holds a number of more than {digits} digits, which no field takes") from None
