"""Output files written so that a reader never sees half of one: several search workers share one output
folder, and each writes the profile, the policy and the tables when it finishes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` on a temporary file in `path`'s folder, then rename it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)  # atomic on POSIX and Windows within one file system
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
