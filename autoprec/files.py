"""Output files written so that a reader never sees half of one: several search workers share one output
folder, and each writes the profile, the policy and the tables when it finishes. A JSON file read so that
whatever it holds is a one-line error naming it, not a traceback. The format version a machine-written file
carries, checked as it is read (`check_version`). And the folder claimed for one owner (one model) while its runs
write there."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from autoprec.errors import UserError, shown

try:
    import fcntl
except ImportError:  # Windows has no flock: a folder is then guarded only by the results already in it
    fcntl = None  # type: ignore[assignment]


def write_atomically(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` on a temporary file in `path`'s folder, then rename it over `path`. A write that fails
    (a full disk, a folder that cannot be written) is a UserError naming `path`, which is left as it was."""
    path = Path(path)
    # Created as open() would create it (mode 0666 less the umask; mkstemp's would be private, 0600), under a
    # name no other writer picks.
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        try:
            write(Path(tmp))
            os.replace(tmp, path)  # atomic on POSIX and Windows within one file system
        except BaseException:
            with contextlib.suppress(OSError):
                Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise UserError(
            f"{path}: cannot write it ({exc.strerror or exc}); nothing was written there: free some space or fix the "
            "folder's permissions (or pick another folder), and run again"
        ) from exc
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
        raise UserError(
            f"{path}: not readable JSON: it holds a number of more than {digits} digits, which no field takes"
        ) from None


class OtherVersion(ValueError):
    """A file another autoprec version wrote: its format version is not the one this version reads (or it has
    none). Never read field by field: the pipeline measures such a profile or finalists file again."""


def check_version(path: str | Path, found: object, expected: int) -> None:
    """Raise OtherVersion naming `path` unless the format version it holds, `found`, is `expected`."""
    if found != expected or isinstance(found, bool):
        was = "none" if found is None else shown(found, 20)
        raise OtherVersion(f"{path}: written by another autoprec version (format version {was}; this version reads {expected})")


CLAIM = ".autoprec.claim"  # the owner holding the folder (JSON); each live run keeps a shared flock on it
GATE = ".autoprec.claim.lock"  # serialises claiming: each claimer holds it for a moment


class Taken(Exception):
    """The folder is held, by a process still running, for another owner: `owner` is what that claim wrote."""

    def __init__(self, owner: Mapping[str, Any]) -> None:
        super().__init__(f"held for {dict(owner)}")
        self.owner = dict(owner)


@contextlib.contextmanager
def claim_folder(
    folder: str | Path, owner: Mapping[str, Any], *, key: str, check: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Hold `folder` (which must exist) for `owner` until the block ends. Raises Taken when a live process holds
    it for an owner whose `key` differs; one with the same `key` (another worker, a resume) shares it. `check`
    runs, under the claim, only when no one holds the folder: what a finished run left there is judged by it
    (its results), and nothing written in between can slip past it. A claim is a flock, which the OS drops when
    its process dies: a killed run never blocks the folder."""
    folder = Path(folder)
    if fcntl is None:
        check()
        yield
        return
    mine = {**owner, "pid": os.getpid()}
    with open(folder / GATE, "ab") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)  # released when `gate` closes, once this claim is settled
        fd = os.open(folder / CLAIM, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no live run holds the folder
            except BlockingIOError:
                theirs = _read_claim(fd)
                if theirs.get(key) != owner.get(key):
                    raise Taken(theirs) from None
            else:
                check()
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(mine).encode("utf-8"), 0)
            # Shared for as long as the run: others of this owner join; the exclusive try above fails for any
            # other. (Turning exclusive into shared is not atomic, which the gate covers.)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
    try:
        yield
    finally:
        os.close(fd)


def _read_claim(fd: int) -> dict[str, Any]:
    try:
        owner = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}
