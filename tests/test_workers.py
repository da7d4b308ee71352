"""Several search workers on one study: concurrent start-up, a real PostgreSQL server, and a worker killed
mid-trial. Each worker is its own process (tests/search_worker.py) with the measurements cut short."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
import torch

from autoprec import UserError
from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune._core._config import RETRIES
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._measure._choices import Choices
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._search._storage import CHOICES_ATTR, open_study, study_storage

pytestmark = pytest.mark.slow  # real processes and servers, seconds each

WORKER = Path(__file__).parent / "search_worker.py"
HOLDING = "test:holding"  # search_worker.py marks a trial it holds with --sleep
TIMEOUT_S = 900  # per worker process: a hung worker fails the test instead of hanging the suite (load only slows one)
COMPLETE = (optuna.trial.TrialState.COMPLETE,)


def start_worker(out: Path, *args: str) -> subprocess.Popen:
    from timings import MODES

    from autoprec.tune._measure import _timing as timing

    timings = next((k for k, v in MODES.items() if v == getattr(timing.CLOCK, "factors", None)), "faster")  # the suite's
    cmd = [sys.executable, str(WORKER), "--out", str(out), "--timings", timings, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> dict:
    """Wait for a worker; its last stdout line is its JSON report."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"a search worker ran past {TIMEOUT_S} s")
    assert proc.returncode == 0, f"worker exited {proc.returncode}:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def workers(procs: list[subprocess.Popen]):
    """Kill whatever is still running when the test leaves, passed or not."""
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def journal_study(path: Path, name: str) -> optuna.Study:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    return optuna.load_study(study_name=name, storage=storage)


def first_choices(study: optuna.Study) -> str:
    return min((t for t in study.trials if CHOICES_ATTR in t.user_attrs), key=lambda t: t.number).user_attrs[CHOICES_ATTR]


def check_two_workers_share_one_study(study: optuna.Study, reports: list[dict], target: int) -> None:
    done = study.get_trials(states=COMPLETE)
    # MaxTrialsCallback stops each worker at the target; the other's trial in flight may still complete.
    assert target <= len(done) <= target + 1
    assert reports[0]["choices"] == reports[1]["choices"] == first_choices(study)
    assert reports[0]["study"] == reports[1]["study"] == study.study_name


def test_two_workers_on_the_default_journal_finish_one_study(tmp_path):
    out = tmp_path / "out"
    with workers([start_worker(out, "--trials", "5", "--sleep", "0.3") for _ in range(2)]) as procs:
        reports = [finish(p) for p in procs]
    assert reports[0]["storage"] == str(out / "study.journal")
    check_two_workers_share_one_study(journal_study(out / "study.journal", "workers"), reports, target=5)
    assert len(Profile.load(out).layers()) == 3  # both saved it, neither left it half-written
    assert not list(out.glob(".*.tmp"))


def test_workers_that_start_at_the_same_moment_search_the_first_stored_choices(tmp_path, monkeypatch):
    # Worker b reads the study before worker a's choices land, as when both start at once: both then write,
    # and both search a's, the first in the storage; only a queues the other warm starts.
    workload = prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), torch.device("cpu"))
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.1, study_name="race")
    mine = Choices(
        default=("fp32", "bf16"), layers={"fc1": ("fp32", "bf16"), "big": ("fp32",), "head": ("fp32", "bf16")}, excluded={}
    )
    theirs = Choices(default=("fp32", "bf16"), layers={"fc1": ("fp32",), "big": ("fp32",), "head": ("fp32", "bf16")}, excluded={})
    bf16 = [{"default": "bf16", "layer:fc1": "bf16", "layer:head": "bf16"}]
    study, got_a, _ = open_study(workload, space, mine, config, tmp_path, budget=0.1, warm_starts=lambda c: bf16)
    module = importlib.import_module("autoprec.tune._search._storage")
    real, calls = module._first_start, []

    def stale_first_read(study):
        calls.append(1)
        return None if len(calls) == 1 else real(study)

    monkeypatch.setattr(module, "_first_start", stale_first_read)
    _, got_b, _ = open_study(
        workload, space, theirs, config, tmp_path, budget=0.1, warm_starts=lambda c: pytest.fail("b queued warm starts")
    )
    assert got_a == got_b == mine
    trials = journal_study(tmp_path / "study.journal", "race").trials
    assert [t.number for t in trials if CHOICES_ATTR in t.user_attrs] == [0, 2]  # a's fp32, a's bf16, b's fp32
    assert Choices.from_json(first_choices(study)) == mine


def test_database_storages_record_heartbeats_and_retry_silent_trials(tmp_path):
    config = SearchConfig(budget=0.1, storage=f"sqlite:///{tmp_path / 'study.db'}", heartbeat_s=5)
    storage, where = study_storage(config, tmp_path)
    assert where == config.storage
    assert storage.get_heartbeat_interval() == 5 and storage.grace_period == 10
    assert storage.get_heartbeat_stale_trial_callback()._max_retry == RETRIES


def test_storage_and_heartbeat_mistakes_name_the_value(tmp_path):
    with pytest.raises(UserError, match=r"--storage foo://bar: not a storage URL .* sqlite:///PATH"):
        study_storage(SearchConfig(budget=0.1, storage="foo://bar"), tmp_path)
    if importlib.util.find_spec("pg8000") is None:  # a PostgreSQL driver nobody here installs
        with pytest.raises(UserError, match="--storage postgresql\\+pg8000://.*the pg8000 driver, which is not installed"):
            study_storage(SearchConfig(budget=0.1, storage="postgresql+pg8000://u@127.0.0.1:1/db"), tmp_path)
    with pytest.raises(ValueError, match="heartbeat_s must be an integer >= 1 .* got 0"):
        SearchConfig(budget=0.1, heartbeat_s=0)


def test_a_database_password_is_in_neither_the_storage_recorded_nor_any_storage_error(tmp_path, monkeypatch):
    """`where` is what the policy's measured.study.storage, the summary and the CLI's last line carry."""
    import sqlalchemy.exc

    url = "postgresql+psycopg2://alice:s3cret-pw@db.example:5432/autoprec"
    shown = "postgresql+psycopg2://alice:***@db.example:5432/autoprec"
    study_module = importlib.import_module("autoprec.tune._search._storage")
    monkeypatch.setattr(study_module.time, "sleep", lambda s: None)
    memory = optuna.storages.InMemoryStorage()
    monkeypatch.setattr(study_module, "_database", lambda *args: memory)
    workload = prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), torch.device("cpu"))
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}})
    choices = Choices(
        default=("fp32", "bf16"), layers={"fc1": ("fp32", "bf16"), "big": ("fp32",), "head": ("fp32",)}, excluded={}
    )
    _, _, where = open_study(
        workload, space, choices, SearchConfig(budget=0.1, storage=url, study_name="s"), tmp_path, budget=0.1
    )
    assert where == shown
    with pytest.raises(UserError) as info:  # the same study with another budget: the refusal names the storage
        open_study(workload, space, choices, SearchConfig(budget=0.2, storage=url, study_name="s"), tmp_path, budget=0.2)
    assert shown in str(info.value) and "s3cret" not in str(info.value)
    errors = [ImportError("No module named 'psycopg2'"), sqlalchemy.exc.ArgumentError(f"Could not parse SQLAlchemy URL from string '{url}'"),
              RuntimeError(f"connection to {url} failed: password s3cret-pw refused")]  # fmt: skip
    monkeypatch.undo()
    monkeypatch.setattr(study_module.time, "sleep", lambda s: None)
    for error in errors:

        class Failing(optuna.storages.RDBStorage):
            def __init__(self, *args, error=error, **kwargs):
                raise error

        monkeypatch.setattr(optuna.storages, "RDBStorage", Failing)
        with pytest.raises(UserError) as info:
            study_storage(SearchConfig(budget=0.1, storage=url), tmp_path)
        assert shown in str(info.value) and "s3cret" not in str(info.value), str(info.value)


# --- PostgreSQL on loopback --------------------------------------------------------------------------------


def _pg_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return candidates[-1].parent if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A throwaway PostgreSQL server on 127.0.0.1 (trust auth, fsync off), stopped and removed afterwards.
    As root the server runs as the `postgres` user: PostgreSQL refuses to run as root."""
    pytest.importorskip("psycopg2", reason="the PostgreSQL driver psycopg2 is not installed (pip install -e '.[test]')")
    bin_dir = _pg_bin()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (Debian: apt-get install postgresql; .ci/run does)")
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="autoprec-pg-"))  # under /tmp: the postgres user must reach it
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            pytest.skip("running as root without runuser: cannot start PostgreSQL as the postgres user")
        shutil.chown(root, user="postgres")
        as_user = [runuser, "-u", "postgres", "--"]
    data, port = root / "data", _free_port()

    def run(*cmd: str) -> None:
        done = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=600)  # a hang guard
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")

    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        opts = f"-p {port} -k {root} -h 127.0.0.1 -F"
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-o", opts, "-w", "-t", "30", "start")
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                           capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_on_postgresql_finish_one_study(tmp_path, postgres_url):
    # Different output folders: as on two machines, each profiles on its own device.
    args = ("--storage", postgres_url, "--study", "pg-two", "--trials", "5", "--sleep", "0.3")
    with workers([start_worker(tmp_path / f"w{i}", *args) for i in range(2)]) as procs:
        reports = [finish(p) for p in procs]
    check_two_workers_share_one_study(optuna.load_study(study_name="pg-two", storage=postgres_url), reports, target=5)


def test_rerunning_a_finished_study_on_postgresql_keeps_its_result(tmp_path, postgres_url):
    """Issue 12's rerun case through a database storage: nothing re-measured, the policy file left as it was."""
    args = ("--storage", postgres_url, "--study", "pg-rerun", "--trials", "3")
    finish(start_worker(tmp_path / "out", *args))
    first = (tmp_path / "out" / "policy.json").read_bytes()
    finish(start_worker(tmp_path / "out", *args))
    assert (tmp_path / "out" / "policy.json").read_bytes() == first


@pytest.fixture
def heartbeat_url(request, tmp_path):
    """A database storage (Optuna's heartbeat needs one): the PostgreSQL server, or SQLite where it is missing."""
    try:
        return request.getfixturevalue("postgres_url")
    except pytest.skip.Exception:
        return f"sqlite:///{tmp_path / 'study.db'}"


def _wait_for_running(url: str, name: str, proc: subprocess.Popen, timeout_s: float = 60) -> optuna.trial.FrozenTrial:
    """Poll the storage until the worker has completed a trial and holds another, its params stored."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the worker ended before it could be killed:\n{proc.communicate()[1][-3000:]}"
        with contextlib.suppress(KeyError):  # the study does not exist yet
            trials = optuna.load_study(study_name=name, storage=url).trials
            running = [t for t in trials if t.state is optuna.trial.TrialState.RUNNING and t.user_attrs.get(HOLDING)]
            if running and any(t.state is optuna.trial.TrialState.COMPLETE for t in trials):
                return running[0]
        time.sleep(0.1)
    pytest.fail(f"no trial was RUNNING within {timeout_s} s")


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_worker_killed_mid_trial_is_failed_retried_and_the_study_finishes(tmp_path, heartbeat_url):
    args = ("--storage", heartbeat_url, "--study", "pg-killed", "--trials", "5", "--heartbeat", "1")
    with workers([start_worker(tmp_path / "a", *args, "--sleep", "2")]) as procs:
        dead = _wait_for_running(heartbeat_url, "pg-killed", procs[0])
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        study = optuna.load_study(study_name="pg-killed", storage=heartbeat_url)
        before = {t.number: (t.params, t.values) for t in study.get_trials(states=COMPLETE)}
        procs.append(start_worker(tmp_path / "b", *args))  # joins the study, same storage
        finish(procs[1])
    trials = {t.number: t for t in optuna.load_study(study_name="pg-killed", storage=heartbeat_url).trials}
    assert trials[dead.number].state is optuna.trial.TrialState.FAIL  # its heartbeat stopped
    retried = [
        t for t in trials.values() if optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == dead.number
    ]
    assert retried and retried[0].state is optuna.trial.TrialState.COMPLETE
    assert retried[0].params == dead.params and dead.params  # the same policy, measured again
    assert {n: (trials[n].params, trials[n].values) for n in before} == before  # completed trials intact
    assert len([t for t in trials.values() if t.state is optuna.trial.TrialState.COMPLETE]) >= 5


def test_a_study_on_postgresql_refuses_another_budget_model_or_memory_limit_before_any_trial(tmp_path, postgres_url):
    """Issue 12's siblings through a database storage: joining a study with other settings is one clear error,
    as with a journal file, and the study keeps only its own trials."""
    from search_worker import MODEL, SPACE
    from short_timing import FAST_PROFILE, TINY

    from autoprec.tune._search._pipeline import search

    fast = dict(trials=2, storage=postgres_url, study_name="pg-key", timing=TINY, final_timing=TINY, finalists=1,
                progress=False, profile=FAST_PROFILE)  # fmt: skip
    space = space_from_dict(SPACE)
    mlp = prepare(load_task(MODEL), "cpu")
    search(mlp, space, SearchConfig(budget=0.5, **fast), tmp_path / "a")
    with pytest.raises(UserError, match=r"study 'pg-key' in postgresql.* different budget .*--study NEW_NAME"):
        search(mlp, space, SearchConfig(budget=0.2, **fast), tmp_path / "a")
    with pytest.raises(UserError, match=r"different max_memory \(max_memory none, now 1000000000\)"):
        search(mlp, space, SearchConfig(budget=0.5, max_memory=10**9, **fast), tmp_path / "a")
    other = prepare(load_task(Path(__file__).parent / "models" / "underflow_mlp.py"), "cpu")
    with pytest.raises(UserError, match=r"different (model|space)"):
        search(other, space, SearchConfig(budget=0.5, **fast), tmp_path / "b")
    study = optuna.load_study(study_name="pg-key", storage=postgres_url)
    assert len(study.get_trials(states=COMPLETE)) == 2  # nothing was added by the refused runs
