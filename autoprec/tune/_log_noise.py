"""The command line's log and warning output: autoprec's own lines with its prefix (log_setup), and libraries'
warnings and log lines below ERROR kept out of a command's output (LibraryNoise; --debug shows them). Process-wide,
so the command line's alone: the library never calls these.
"""

from __future__ import annotations

import csv
import functools
import logging
import os
import site
import sys
import sysconfig
import warnings


class Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (as Python's last-resort handler does)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def log_setup(debug: bool) -> None:
    """autoprec's own log lines, and only those, carry its prefix: torchao's or transformers' lines keep
    theirs (the root logger gets no handler, so Python's last-resort one prints their warnings as they are).
    Process-wide, so the CLI's job, not the library's."""
    logger = logging.getLogger("autoprec")
    handler = Stderr()
    handler.setFormatter(logging.Formatter("autoprec: %(message)s"))
    logger.handlers[:] = [h for h in logger.handlers if not isinstance(h, Stderr)] + [handler]
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)


@functools.lru_cache(maxsize=1)
def library_roots() -> tuple[tuple[str, ...], str]:
    """(where installed packages and the standard library live, where autoprec lives), each ending in a separator."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(getattr(site, "getsitepackages", list)())
    roots.add(site.getusersitepackages())
    own = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots), os.path.join(own, "")


@functools.lru_cache(maxsize=256)
def installed_tops(folder: str) -> frozenset[str]:
    """The top-level names (packages, modules) that distributions installed into `folder` put there, from each
    `*.dist-info`'s RECORD: what `pip install --target DIR` leaves beside the user's own files, if DIR is theirs."""
    try:
        infos = [n for n in os.listdir(folder) if n.endswith(".dist-info")]
    except OSError:
        return frozenset()
    tops: set[str] = set()
    for info in infos:
        try:
            with open(os.path.join(folder, info, "RECORD"), encoding="utf-8", newline="") as record:
                for row in csv.reader(record):  # pip writes RECORD with csv, quoting a path that holds a comma
                    path = row[0].replace("\\", "/") if row else ""
                    top = path.split("/", 1)[0]
                    # Python files only: a wheel's scripts (bin/) and data are no package a warning comes from
                    if path.endswith(CODE) and top not in ("", "..") and not top.endswith(".dist-info"):
                        tops.add(top)
        except (OSError, csv.Error):
            continue
    return frozenset(tops)


CODE = (".py", ".pyi", ".pyd", ".so")  # what an installed distribution's Python code ends in


def installed_on_path(real: str) -> bool:
    """Whether `real` (a resolved path) is a file a distribution installed into a folder on sys.path outside
    site-packages (`pip install --target DIR` with PYTHONPATH=DIR, as on a cluster or a container image); the
    user's own files beside it (model.py in that folder, say) are not."""
    for entry in sys.path:
        folder = os.path.join(os.path.realpath(entry or "."), "")
        if real.startswith(folder) and real[len(folder) :].split(os.sep, 1)[0] in installed_tops(folder):
            return True
    return False


@functools.lru_cache(maxsize=4096)
def from_library(path: str) -> bool:
    """Whether a warning or log record from the file `path` is a library's: a file of an installed package or of
    the standard library, not autoprec's own (installed too) and not the user's (model.py and their modules)."""
    if path.startswith("<"):
        return path.startswith("<frozen")  # importlib's frames: an extension module's import
    roots, own = library_roots()
    real = os.path.realpath(path)
    return not real.startswith(own) and (real.startswith(roots) or installed_on_path(real))


class LibraryNoise(logging.Filter):
    """Libraries' warnings and log lines below ERROR kept out of the output for the command's duration (--debug shows
    them): torch's pytree deprecation notices when model.py imports transformers or torchao, say, are for those
    libraries' maintainers, not about the user's run, and nothing the user can act on. Process-wide, so the CLI's."""

    def __init__(self) -> None:
        super().__init__()
        self._covered: list[logging.Handler] = []
        self._shown = warnings.showwarning

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not from_library(record.pathname)

    def cover(self) -> None:
        """Filter every log handler there is now: the last-resort one (the root has none), torch's, and those a
        library that model.py imported set up (transformers'). One set up later prints as it would."""
        handlers = [logging.lastResort, *logging.getLogger().handlers]
        for logger in list(logging.Logger.manager.loggerDict.values()):
            if isinstance(logger, logging.Logger):
                handlers.extend(logger.handlers)
        for handler in handlers:
            if handler is not None and self not in handler.filters:
                handler.addFilter(self)
                self._covered.append(handler)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not from_library(filename):
            self._shown(message, category, filename, lineno, file, line)

    def __enter__(self) -> LibraryNoise:
        self.cover()
        self._shown = warnings.showwarning  # inside main's warnings.catch_warnings(), which puts it back
        warnings.showwarning = self._show
        return self

    def __exit__(self, *exc: object) -> None:
        for handler in self._covered:
            handler.removeFilter(self)
        self._covered.clear()
