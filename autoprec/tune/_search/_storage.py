"""Where a study lives and how workers share it: the Optuna storage (a journal file, checked and its torn tail repaired, or
a database with heartbeats), the study's identity key and version, and opening (or joining) the study; and the storage
URL as it may be written or printed, its secrets hidden (`hide_credentials`)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import stat
import tempfile
import time
import urllib.parse
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import optuna
import optuna.storages.journal  # `import optuna` loads it too, but mypy sees a submodule only where it is imported

from autoprec.errors import UserError, describe, printable
from autoprec.formats import device_name
from autoprec.policy import model_fingerprint
from autoprec.tune._core._config import RETRIES, Mode, SearchConfig
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._measure._choices import Choices, is_param, uniform_params
from autoprec.tune._measure._task import Workload

if TYPE_CHECKING:
    from autoprec.tune._core._goal import Goal

log = logging.getLogger("autoprec")


def study_storage(config: SearchConfig, out_dir: Path) -> tuple[Any, str]:
    url = config.storage
    if url is None or "://" not in url:
        # Optuna's recommended storage for several processes on one machine: a journal file behind a file
        # lock, no server. It has no heartbeat (optuna 5), so a killed worker's trial stays RUNNING.
        path = Path(url) if url else out_dir / "study.journal"
        label = _journal_label(config, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _drop_torn_tail(path, label)  # first refuses, unchanged, what is not an Optuna journal (_check_journal)
            backend = optuna.storages.journal.JournalFileBackend(str(path))  # creates the file when missing
        except OSError as exc:
            raise UserError(f"{label}: cannot make or open it ({exc.strerror or exc}); {_CANNOT_MAKE}") from None
        return optuna.storages.JournalStorage(backend), str(path)
    check_storage(config)
    return _database(url, config.heartbeat_s), hide_credentials(url)  # what is written and printed: no password


def _journal_label(config: SearchConfig, path: Path) -> str:
    return f"--storage {path}" if config.storage else str(path)


def check_storage(config: SearchConfig, out_dir: Path | None = None) -> None:
    """What can be told about --storage before profiling, without changing it: a folder, a device or a FIFO, an
    in-memory database, a file that is not an Optuna journal or holds a line that is not one of its records, a
    journal that cannot be written (with `out_dir`, the default out_dir/study.journal is checked too)."""
    url = config.storage
    if url is None and out_dir is not None:
        journal = Path(out_dir) / "study.journal"
        _check_journal(journal, _journal_label(config, journal))
        _check_writable(journal, _journal_label(config, journal))
    if url is None:
        return
    if "://" not in url:
        _check_journal(Path(url), _journal_label(config, Path(url)))
        _check_writable(Path(url), _journal_label(config, Path(url)))
    if url.startswith("sqlite://") and url.removeprefix("sqlite://") in ("", "/", "/:memory:"):
        raise UserError(
            f"--storage {url}: an in-memory database dies with this process and no other worker can reach it; "
            "give a file (sqlite:///study.db) or leave --storage out for <out>/study.journal"
        )


_CANNOT_MAKE = "give a journal file's path in a folder that can be written, or a database URL such as sqlite:///study.db"


def _check_writable(path: Path, label: str) -> None:
    """Optuna appends to the journal, makes it (and study_storage its folders) when missing, and locks it with a
    symlink beside it: a folder that cannot be written, a read-only filesystem or a file where a folder should
    be would fail the study's first write, after the whole profile. Tried here, leaving nothing behind: the
    journal opened to append (nothing written) and a nameless temporary file in the nearest folder that exists.
    Call after _check_journal, which refuses what is not a regular file (opening a FIFO would block)."""
    try:
        folder = next(p for p in path.absolute().parents if p.exists())  # "/" at the latest
        if not folder.is_dir():
            raise UserError(f"{label}: cannot make it: {folder} is a file, not a folder; {_CANNOT_MAKE}")
        if path.is_file():
            with open(path, "ab"):
                pass
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UserError(f"{label}: cannot write there ({exc.strerror or exc}); {_CANNOT_MAKE}") from None


# Optuna's journal (optuna.storages.journal, checked against optuna 5): one JSON object per line, written whole
# by one append of json.dumps(record, separators=(",", ":")) + "\n", whose first keys are an int "op_code" and a
# str "worker_id". A line without its newline is one Optuna has not finished writing and does not read.
RECORD_START = b'{"op_code":'


def _is_record(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError included (a binary file); nesting past Python's depth
        return None
    if not isinstance(record, dict) or type(record.get("op_code")) is not int or not isinstance(record.get("worker_id"), str):
        return None
    return record


def _journal_tail(path: Path, label: str, data: bytes) -> int:
    """How many bytes at the end of `data` (the journal file's content) are a torn record: the start of one
    Optuna did not finish writing, after its last complete line. Refuses (UserError, the file unchanged) a file
    that is not an Optuna journal, or one with a line that is not a record Optuna can read back."""
    if data.startswith(b"SQLite format 3\0"):
        raise UserError(f"{label}: an SQLite database, not a journal file; pass it as sqlite:///{path}")
    end = data.rfind(b"\n") + 1
    tail = data[end:]
    records: list[dict[str, Any]] = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        record = _is_record(line)
        if record is None:
            _refuse_line(path, label, number)
        records.append(record)
    # after complete records, any start of one (a write cut a few bytes in); alone in the file (a disk full at the
    # study's first write), no less than its opening key, which no file but Optuna's journal starts with
    torn = tail.startswith(RECORD_START) or bool(records) and RECORD_START.startswith(tail)
    if tail and not torn:
        _refuse_line(path, label, len(records) + 1)
    _replay(records, label)
    return len(tail)


def _refuse_line(path: Path, label: str, number: int) -> NoReturn:
    if number == 1:
        raise UserError(
            f"{label}: not an Optuna journal file (its first line is not a journal record); nothing was changed: "
            "give a journal file's path (a new one is made) or a database URL such as sqlite:///study.db"
        )
    raise UserError(
        f"{label}: line {number} is not an Optuna journal record (a stray write or a hand edit); nothing was changed: "
        f"remove that line if Optuna did not write it (or restore the file), or give another journal file's path"
    )


class _Lines(optuna.storages.journal.BaseJournalBackend):
    """Records already read, served to Optuna's own replay one at a time, so that the one it cannot apply is known."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        self.records, self.line = records, 0

    def read_logs(self, log_number_from: int):
        for line, record in enumerate(self.records[log_number_from:], start=log_number_from + 1):
            self.line = line
            yield record

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        raise AssertionError("a replay to check a journal writes nothing")


def _replay(records: Sequence[dict[str, Any]], label: str) -> None:
    """Replay the records as Optuna will (a hand-edited field, an op_code it does not know), naming the line."""
    lines = _Lines(records)
    try:
        optuna.storages.JournalStorage(lines)
    except Exception as exc:
        raise UserError(
            f"{label}: line {lines.line} is not an Optuna journal record Optuna can replay ({describe(exc, 120)}; a hand "
            "edit?); nothing was changed: restore the file, or give another journal file's path"
        ) from None


def _check_journal(path: Path, label: str) -> int:
    """Refuse, unchanged, a path that is not an Optuna journal file (see _journal_tail), or not a regular file (a
    folder, /dev/null, a FIFO, whose reads would block). Returns the size of a torn tail (0: none, or no file)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return 0  # made when the study is opened
    except OSError as exc:
        raise UserError(f"{label}: cannot read it ({exc.strerror or exc}); give a journal file's path") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"{label}: a folder; give a journal file's path (or a database URL)")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise UserError(
            f"{label}: not a regular file ({kind}); Optuna's journal is a file it appends to and reads back: give a "
            "journal file's path or a database URL such as sqlite:///study.db"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{label}: cannot read it ({exc.strerror or exc}); give a journal file's path") from None
    return _journal_tail(path, label, data)


def _drop_torn_tail(path: Path, label: str) -> None:
    """A journal whose last line was cut short (a killed process, a full disk) ends without a newline: Optuna
    would append the next record onto it and every later run would fail to parse the file. Under the journal's
    own lock (so no worker is mid-write), cut the torn tail off and say so; every complete record stays. Only
    the start of a record after the last complete one is ever cut (_journal_tail)."""
    if not _check_journal(path, label):
        return
    lock = optuna.storages.journal.JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        with open(path, "rb+") as fh:
            data = fh.read()
            torn = _journal_tail(path, label, data)  # again: a worker may have finished the line meanwhile
            if not torn:
                return
            fh.truncate(len(data) - torn)
        log.warning(
            "%s: its last line was cut short (%d bytes, a write interrupted by a kill or a full disk) and is dropped; "
            "every complete trial before it is kept",
            path,
            torn,
        )
    finally:
        lock.release()


def _database(url: str, heartbeat_s: int) -> optuna.storages.RDBStorage:
    """A database storage with Optuna's heartbeat: each running trial records a beat every `heartbeat_s`;
    a worker starting a trial fails those silent for twice that and queues them again (RETRIES times)."""
    import sqlalchemy.exc  # optuna's own dependency

    shown = hide_credentials(url)  # no message carries the password
    for attempt in range(3):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in optuna 5, and what we need
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=RETRIES)
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=heartbeat_s, grace_period=2 * heartbeat_s, heartbeat_stale_trial_callback=retry
                )
        except ImportError as exc:
            raise UserError(f"--storage {shown}: {_missing_driver(url, exc)}") from None
        except sqlalchemy.exc.ArgumentError as exc:
            raise UserError(
                f"--storage {shown}: not a storage URL Optuna can open ({hide_credentials_in(str(exc), url)}); use a journal file path, "
                "sqlite:///PATH or postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE"
            ) from None
        except Exception as exc:
            # Workers creating a new database's tables at the same moment collide once; the next try finds them.
            if attempt == 2:
                raise UserError(f"--storage {shown}: cannot open it: {hide_credentials_in(describe(exc, None), url)}") from None
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


def _missing_driver(url: str, exc: ImportError) -> str:
    """Which driver SQLAlchemy looked for, for `url`, and the fix: the drivers of its dialect that are installed
    (named in the URL, as dialect+driver), or installing this one. A URL without +driver gets the dialect's default,
    which differs between SQLAlchemy versions (postgresql:// is psycopg2 in 2.0, psycopg in 2.1)."""
    import sqlalchemy  # optuna's own dependency
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    backend, wanted = parsed.get_backend_name(), parsed.get_dialect().driver
    how = "" if "+" in parsed.drivername else f"reads {backend}:// as {backend}+{wanted} and "
    cause: BaseException | None = exc  # optuna re-raises the driver's own ImportError with a message of its own
    while cause is not None and not (isinstance(cause, ImportError) and cause.name):
        cause = cause.__cause__ or cause.__context__
    module = f" (no module {cause.name!r})" if isinstance(cause, ImportError) else ""
    said = f"SQLAlchemy {sqlalchemy.__version__} {how}needs the {wanted} driver, which is not installed{module}"
    others = [d for d in _installed_drivers(backend) if d != wanted]
    if others:
        urls = " or ".join(f"{backend}+{d}://..." for d in others)
        return f"{said}; name an installed one in the URL ({urls}) or install {wanted}"
    return f"{said}; install {wanted}, or name another driver you have installed in the URL ({backend}+DRIVER://...)"


def _installed_drivers(backend: str) -> list[str]:
    """The synchronous drivers SQLAlchemy has for `backend` whose Python module imports here (on the error path
    only: each one is imported to know)."""
    import importlib
    import pkgutil

    try:
        package = importlib.import_module(f"sqlalchemy.dialects.{backend}")
    except ImportError:
        return []
    found = []
    for module in pkgutil.iter_modules(getattr(package, "__path__", [])):
        try:
            dialect = getattr(importlib.import_module(f"{package.__name__}.{module.name}"), "dialect", None)
            if dialect is None or getattr(dialect, "is_async", False) or not isinstance(getattr(dialect, "driver", None), str):
                continue
            dialect.import_dbapi()
        except Exception:  # a driver not installed, or a module that is no dialect: not one to name
            continue
        if dialect.driver not in found:
            found.append(dialect.driver)
    return found


def sampler_for(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    if space.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True)  # reads trial.constraints


# The study key's "version": the format of what a study holds (its key, the choices on its first trial, the parameters
# and user attributes of its trials). Raise it when any of them changes; a study of another version is refused. A
# parameter only new studies may hold adds an entry to the key where they hold it instead (FP8_ALL_GATHER_KEY): a
# study from before reads as it did, and one that would now hold it is refused by name (_check_key).
STUDY_VERSION = 1
FP8_ALL_GATHER_KEY = "fp8 all-gather"  # the study's trials may hold FSDP2's fp8 all-gather (Choices.fp8_all_gather)


def _study_key(
    workload: Workload,
    space: SearchSpace,
    config: SearchConfig,
    budget: float,
    objectives: int,
    profile_complete: bool = True,
    fp8_all_gather: bool = False,
) -> dict[str, str]:
    # What shapes the choices, the measurements and which trials are feasible; not the file's path, sampler or
    # trial count.
    shape = (space.layers, space.default, space.loss_scale, space.prune_slower_than) + ((space.exclude,) if space.exclude else ())
    space_hash = hashlib.sha256(repr(shape).encode()).hexdigest()[:12]
    target = {"target": config.target} if config.target else {}  # a targeted goal's values are the target's
    return (
        target
        | {
            "version": str(STUDY_VERSION),
            "budget": repr(float(budget)),  # the resolved bound: a relative budget's study is its absolute one
            "device": device_name(str(workload.device)),
            "model": model_fingerprint(workload.model),
            # a rebuilt model with other weights (retrained, or build_model() without a seed) is another study
            "model weights": workload.weights,
            "space": space_hash,
            "mode": config.mode.value if config.mode is Mode.WEIGHTS else f"{config.mode.value}, {config.train_steps} steps",
            "layout": f"{space.layout.value}, max_params {space.max_params}",
            "objectives": objective_names(objectives, config.objective),
            "compile": "compiled" if config.compile else "eager",
            "max_memory": str(config.max_memory) if config.max_memory else "none",
        }
        | ({} if profile_complete else {"profile": "cut short by a time budget"})  # its choices hold layers at fp32
        | _sharded_key(workload)
        | ({FP8_ALL_GATHER_KEY: "searched"} if fp8_all_gather else {})
    )


def _sharded_key(workload: Workload) -> dict[str, str]:
    """A sharded search's layout (_ranks.Layout), part of its study's identity: its trials were timed on it, so a
    rerun on another world size or mesh is another study. Nothing on one device (as in a study from before)."""
    if workload.sharding is None:
        return {}
    layout = workload.sharding.layout()
    return {"sharding": f"over {layout['world_size']} ranks, mesh {layout['mesh']}, {layout['parallelize']}"}


OBJECTIVES = {1: "speedup", 2: "speedup, metric drop"}


def objective_names(objectives: int, goal: Goal) -> str:
    """The study's objectives in words (the goal's label first): `speedup`, `peak memory, metric drop`."""
    return OBJECTIVES[objectives].replace("speedup", goal.label)


def directions(objectives: int, goal: Goal) -> list[Literal["minimize", "maximize"]]:
    """The study's directions: the goal's, then (a sweep) the metric drop's."""
    return [goal.direction, "minimize"][:objectives]


KEY_ATTR, CHOICES_ATTR, WORKER_ATTR = "autoprec:key", "autoprec:choices", "autoprec:worker"


def _check_key(stored: Mapping[str, Any], key: Mapping[str, str], name: str, where: str) -> None:
    if stored.get("version") != key["version"]:  # its trials may mean something else here: never resumed
        was = printable(str(stored["version"]))[:20] if "version" in stored else "none"
        start_over = f"delete the study from {where}" if "://" in where else f"delete {where}"  # a database, or a journal
        raise UserError(
            f"study {name!r} in {where} was made by another autoprec version (study format version {was}; this version "
            f"makes {key['version']}): pass --study NEW_NAME to start another, or {start_over} to start over"
        )
    if "model weights" in key and "model weights" not in stored:  # a study from before the weights digest
        raise UserError(
            f"study {name!r} in {where} was made by an older autoprec that did not record the model's weights, so it "
            "cannot be told whether they are these: pass --study NEW_NAME to start another"
        )
    if FP8_ALL_GATHER_KEY in key and FP8_ALL_GATHER_KEY not in stored:  # its trials never held it: not resumed as if
        raise UserError(
            f"study {name!r} in {where} was made by an autoprec that did not search FSDP2's fp8 all-gather beside the "
            "formats, which this search does: pass --study NEW_NAME to start another"
        )
    diff = [k for k in dict.fromkeys([*key, *stored]) if stored.get(k) != key.get(k)]  # a key either side lacks too
    if diff:
        was = ", ".join(f"{k} {stored.get(k, 'none')}, now {key.get(k, 'none')}" for k in diff)
        raise UserError(
            f"study {name!r} in {where} was made with a different {' and '.join(diff)} ({was}); "
            "pass --study NEW_NAME to start another"
        )


def _first_start(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The lowest-numbered trial that carries a worker's choices: the first one any worker wrote. Trial numbers
    follow the storage's own order of creation (the journal's log; the database locks the study row), and a
    worker reads after it writes, so every worker finds the same one."""
    carrying = (t for t in study.get_trials(deepcopy=False) if CHOICES_ATTR in t.user_attrs)
    return min(carrying, key=lambda t: t.number, default=None)


def open_study(
    workload: Workload,
    space: SearchSpace,
    choices: Choices,
    config: SearchConfig,
    out_dir: Path,
    warm_starts: Callable[[Choices], list[dict[str, Any]]] = lambda choices: [],
    *,
    budget: float,
    objectives: int = 1,
    profile_complete: bool = True,
):
    """Create or join the study (the goal's direction: maximise the speedup, minimise the peak memory; with
    `objectives=2`, also minimise the metric drop). Every worker proposes its choices on the all-fp32 warm-start trial; the first
    proposal in the storage wins, and only its worker queues the other warm starts (`warm_starts(choices)`).
    Two workers starting at the same moment may both queue the fp32 trial: it is then measured twice. `budget`: the
    study's constraint, resolved (budget.Budgets.bound), part of its identity."""
    storage, where = study_storage(config, out_dir)
    name = config.study_name or workload.task.name
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        directions=directions(objectives, config.objective),
        sampler=sampler_for(space, config.seed),
        load_if_exists=True,
    )
    key = _study_key(workload, space, config, budget, objectives, profile_complete, choices.fp8_all_gather)
    first = _first_start(study)
    worker = uuid.uuid4().hex
    # Every study this version makes has its key on its first trial: one holding anything but none that carries it
    # is another version's. Read again first: another worker may have written its first trial since.
    if first is None and (study.user_attrs or study.get_trials(deepcopy=False)) and _first_start(study) is None:
        _check_key({}, key, name, where)
    if first is None:
        attrs = {KEY_ATTR: key, CHOICES_ATTR: choices.to_json(), WORKER_ATTR: worker}
        study.enqueue_trial(_warm_params(uniform_params(choices, "fp32"), choices), user_attrs=attrs)
        first = _first_start(study)
        assert first is not None, "a trial this worker queued is missing from the storage"
        if first.user_attrs[WORKER_ATTR] == worker:
            for params in warm_starts(choices):
                study.enqueue_trial(_warm_params(params, choices), skip_if_exists=True)
    _check_key(first.user_attrs[KEY_ATTR], key, name, where)
    if first.user_attrs[WORKER_ATTR] != worker:
        # Workers with one seed would suggest the same policies side by side: `seed` stays with the worker that
        # started the study, and one that joins (or resumes it) mixes in its own id.
        seed = (config.seed + int(worker[:8], 16)) % 2**32
        log.info("joining study %r as another worker; sampler seed %d", name, seed)
        study.sampler = sampler_for(space, seed)
    return study, Choices.from_json(first.user_attrs[CHOICES_ATTR]), where


def _warm_params(params: Mapping[str, Any], choices: Choices) -> dict[str, Any]:
    return {k: v for k, v in params.items() if is_param(k, choices)}


# A storage URL as it may be written (the policy's measured.study.storage, summary.md) or printed (the last line of a
# search, a storage error): a database password never leaves the process. The one place that says how.

HIDDEN = "***"
# a query parameter's name a driver takes a secret from: password, sslpassword, passwd, pwd, a token or a secret
_SECRET_NAME = re.compile(r"pass|pwd|secret|token", re.IGNORECASE)
# the same inside a value that is itself a connection string (odbc_connect=DRIVER=..;PWD=..; a libpq conninfo):
# its value braced ({a;b}) or up to the next ';' (past a space too: hiding more is the safe side)
_SECRET_PAIR = re.compile(
    r"(?P<key>[\w.-]*(?:pass|pwd|secret|token)[\w.-]*\s*=\s*)(?P<value>\{(?:[^}]|\}\})*\}?|[^;]*)", re.IGNORECASE
)
# stands for a hidden value while SQLAlchemy renders the URL (which percent-encodes query values), then becomes ***
_PLACEHOLDER = "autoprecHIDDENvalue"


def _secrets(url: str) -> tuple[str, list[str]]:
    """(`url` with its secrets hidden, the secrets). A file path (no ://) is kept as it is: it is not sent to a
    server. A URL is read as SQLAlchemy reads it (what it and the driver connect with); one it cannot parse, which
    Optuna cannot open either, is hidden by _unparsed."""
    if "://" not in url:
        return url, []
    from sqlalchemy.engine import make_url  # optuna's own dependency; imported where a URL is given

    try:
        parsed = make_url(url)
    except Exception:  # ArgumentError, or a port that is not a number (ValueError)
        return _unparsed(url)
    secrets: list[str] = []
    if parsed.password is not None:
        secrets.append(str(parsed.password))
        # its raw text as given (SQLAlchemy's user part holds no ':' or '/', its password runs to the first '@')
        secrets.append(url.partition("://")[2].partition(":")[2].partition("@")[0])
    if parsed.host and "@" in parsed.host:
        # a password with an unencoded '@' (u:p@ss@h): SQLAlchemy ends it at the first, and the rest of it would
        # show as the host's start; all of it up to the last '@' is hidden
        tail, _, host = parsed.host.rpartition("@")
        secrets += [tail, f"{parsed.password}@{tail}"]
        parsed = parsed.set(host=host)

    def hide_pairs(value: str) -> str:
        def hide(match: re.Match[str]) -> str:
            secrets.append(match["value"])
            return match["key"] + _PLACEHOLDER

        return _SECRET_PAIR.sub(hide, value)

    query: dict[str, str | tuple[str, ...]] = {}
    for key, value in parsed.query.items():
        values = (value,) if isinstance(value, str) else tuple(value)
        if _SECRET_NAME.search(key):
            secrets += values
            values = tuple(_PLACEHOLDER for _ in values)
        values = tuple(hide_pairs(v) for v in values)
        query[key] = values[0] if len(values) == 1 else values
    database = hide_pairs(parsed.database) if parsed.database else parsed.database
    for raw in url.partition("?")[2].split("&"):  # a secret's raw text as given, for hide_credentials_in
        name, _, value = raw.partition("=")
        if _SECRET_NAME.search(urllib.parse.unquote_plus(name)):
            secrets.append(value)
    if not secrets:
        return url, []  # nothing to hide: as given (SQLAlchemy's rendering would percent-encode a path's ':' and '@')
    parsed = parsed.set(query=query, database=database)
    return parsed.render_as_string(hide_password=True).replace(_PLACEHOLDER, HIDDEN), secrets


def _unparsed(url: str) -> tuple[str, list[str]]:
    """A URL SQLAlchemy cannot parse: everything from the user's ':' to the last '@', wherever that '@' is, and
    all of a query that names a secret are hidden. More than a password may go; nothing like user:password@ stays."""
    scheme, sep, rest = url.partition("://")
    secrets = []
    user_info, at, host = rest.rpartition("@")
    if at and ":" in user_info:
        user, _, password = user_info.partition(":")
        secrets.append(password)
        rest = f"{user}:{HIDDEN}@{host}"
    path, question, query = rest.partition("?")
    if _SECRET_NAME.search(urllib.parse.unquote_plus(query)):
        secrets.append(query)
        rest = f"{path}?{HIDDEN}"
    return scheme + sep + rest, secrets


def hide_credentials(url: str) -> str:
    """`url` with its secrets as ***: a password (user:PASSWORD@host), a query parameter naming one (password=),
    one inside a query value that is a connection string (odbc_connect=...PWD=...); a file path as given."""
    return _secrets(url)[0]


def _forms(secret: str) -> set[str]:
    """`secret` as it may be quoted in a message: as given, percent-decoded or percent-encoded."""
    forms = {secret, urllib.parse.unquote(secret), urllib.parse.unquote_plus(secret)}
    forms |= {urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret), urllib.parse.quote(secret)}
    return {form for form in forms if form}


def hide_credentials_in(text: str, url: str) -> str:
    """`text` (another library's error message, say) with `url` as hide_credentials shows it, and with no
    secret of `url` in it, as given, percent-decoded or percent-encoded."""
    hidden, secrets = _secrets(url)
    text = text.replace(url, hidden)
    for secret in sorted({form for raw in secrets for form in _forms(raw)}, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text
