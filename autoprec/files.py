"""Output files written so that a reader never sees half of one: several search workers share one output
folder, and each writes the profile, the policy and the tables when it finishes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path


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
