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
        # mkstemp makes the file private (0600); an output file gets the mode open() would give it
        os.chmod(tmp, 0o666 & ~_umask())
        write(Path(tmp))
        os.replace(tmp, path)  # atomic on POSIX and Windows within one file system
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def write_text(path: str | Path, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
