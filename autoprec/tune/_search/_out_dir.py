"""The output folder as a cache: refuse one that holds another model's results or cannot be written, hold it for
this model while a run writes there, and reuse what an earlier run of the same model left in it: its profile
(`reuse_or_profile`, where it serves this run; a sweep measures one of its own beside it, never over it) and a finished study's result (`earlier_result`). A full disk while
writing there is told apart (`disk_full`): the study resumes from its complete trials.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from autoprec.errors import UserError
from autoprec.files import OtherVersion, Taken, claim_folder, read_json
from autoprec.formats import device_name
from autoprec.policy import Policy, model_fingerprint
from autoprec.tune._core._budget import absolute_budget
from autoprec.tune._core._config import GROUP_SHARE, PROFILE_SHARE, Mode, ProfileConfig, SearchConfig
from autoprec.tune._core._names import BF16_GRAPHS
from autoprec.tune._core._records import Chosen, Finals, Measured, StudyRef
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._measure._metric import NoiseFloor
from autoprec.tune._measure._profile_data import PREDICTED, Profile, ruled_out
from autoprec.tune._measure._profiler import profile
from autoprec.tune._measure._task import Workload
from autoprec.tune._measure._timing import Stopwatch
from autoprec.tune._report._plots import PROFILE_FIGURES
from autoprec.tune._report._results import SavedProfile

log = logging.getLogger("autoprec")

FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # a full disk, or the user's quota


def disk_full(exc: BaseException | None) -> OSError | None:
    """The full-disk OSError behind `exc`, if any: Optuna, failing to record a trial, raises an AssertionError of its
    own from inside the OSError's handling."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in FULL:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def check_not_a_file(out_dir: Path) -> None:
    """Refuse an output folder that is a file (the command line asks before model.py is built)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: a file, not a folder; give a folder for the results")


def check_out_dir(workload: Workload, out_dir: Path) -> None:
    """Refuse, before anything is written, an output folder that holds another model's results (its saved
    profile or policy file names another model or structure), or whose policy.json cannot be written."""
    out_dir = Path(out_dir)
    check_not_a_file(out_dir)
    mine = (workload.task.name, model_fingerprint(workload.model))
    for name, read in (
        ("profile.json", lambda d: (d.get("model"), d.get("fingerprint"))),
        ("policy.json", lambda d: (d.get("measured", {}).get("model"), d.get("measured", {}).get("fingerprint"))),
    ):
        path = out_dir / name
        if path.is_dir():
            raise UserError(f"{path}: a folder is in the way of the results file; move it or pick another --out")
        try:
            theirs = read(read_json(path)) if path.is_file() else None
        except (ValueError, AttributeError, OSError):
            continue  # unreadable: the profile is measured again, the policy written anew
        if theirs is None:
            continue
        model, fingerprint = theirs
        if fingerprint is not None and fingerprint != mine[1] or (model is not None and model != mine[0] and fingerprint is None):
            raise UserError(
                f"--out {out_dir} holds results of another model structure ({name}: {model or 'a model'} {fingerprint}; "
                f"{workload.task.path} is {mine[0]} {mine[1]}): pick another --out, or remove profile.*, policy.json and "
                "study.journal there to start over; nothing was written"
            )
    try:  # writable, before minutes of profiling and trials
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot write results there ({exc.strerror or exc}); pick another --out") from None


@contextlib.contextmanager
def claim_out_dir(workload: Workload, out_dir: Path) -> Iterator[None]:
    """check_out_dir, and the folder held for this model until the block ends (files.claim_folder): a run of another
    model started at the same moment is refused, where both passed the check before either wrote, and one's results
    replaced the other's. Other workers and reruns of the same model (its fingerprint) share the folder."""
    out_dir = Path(out_dir)
    check_out_dir(workload, out_dir)  # makes the folder: the claim lives in it
    mine = {"model": workload.task.name, "fingerprint": model_fingerprint(workload.model), "path": str(workload.task.path)}
    try:
        with claim_folder(out_dir, mine, key="fingerprint", check=lambda: check_out_dir(workload, out_dir)):
            yield
    except Taken as taken:
        theirs = taken.owner
        who = f"{theirs.get('model', 'a model')} {theirs.get('fingerprint', '')}, from {theirs.get('path', '?')}, process {theirs.get('pid', '?')}"
        raise UserError(
            f"--out {out_dir}: a run for another model is writing there now ({who}; {workload.task.path} is {mine['model']} "
            f"{mine['fingerprint']}): pick another --out, or wait for that run to end; nothing was written"
        ) from None


SWEEP_PROFILE = "sweep_profile"  # a sweep's own profile, where the output folder's does not serve it (docs/sweep.md)
PROFILE_FILES = ("profile.csv", "profile.json", "grad_ranges.csv", "profile.png", "grad_ranges.png")
REUSED = "profile: reused the one saved in the output folder"


def load_or_profile(
    workload: Workload,
    space: SearchSpace,
    out_dir: Path,
    config: SearchConfig,
    *,
    watch: Stopwatch | None = None,
    budget: float | None = None,
) -> Profile:
    """reuse_or_profile's profile, for a run that keeps it in out_dir itself (a search)."""
    return reuse_or_profile(workload, space, out_dir, config, watch=watch, budget=budget).profile


def reuse_or_profile(
    workload: Workload,
    space: SearchSpace,
    out_dir: Path,
    config: SearchConfig,
    *,
    watch: Stopwatch | None = None,
    budget: float | None = None,
    own: str | None = None,
) -> SavedProfile:
    """Reuse the profile a previous run of the same model on the same device, with settings that serve this one, saved
    in out_dir (or in out_dir / `own`); else measure, and save it in out_dir, or, with `own` (a sweep), in out_dir /
    `own` where out_dir holds a profile already: another run's files are never written over. `watch` receives the
    profiling stages, or a count when a saved profile was reused. `budget`: the smallest budget its drops serve
    (default config.budget where absolute: the pipeline passes its resolved one), a tenth of which is the group
    tolerance (GROUP_SHARE)."""
    watch = watch or Stopwatch()
    settings = config.profile_settings
    if settings.group_tolerance is None and settings.group_testing:
        smallest = absolute_budget(config.budget) if budget is None else budget
        settings = dataclasses.replace(settings, group_tolerance=GROUP_SHARE * smallest)
    if config.time_budget is not None and settings.deadline_s is None:  # the profile scaled to fit the budget
        settings = dataclasses.replace(settings, deadline_s=PROFILE_SHARE * config.time_budget)
    held = any((out_dir / name).exists() for name in PROFILE_FILES)
    why_not = None
    for folder in [out_dir, *([out_dir / own] if own else [])]:
        cached = _saved(folder)
        why = _unfit(cached, workload, space, config, settings) if cached is not None else None
        if cached is not None and why is None:
            log.info("reusing the profile in %s", folder)
            watch.count(REUSED)
            return SavedProfile(profile=cached, folder=folder, measured=False, own=folder != out_dir, why_not=why_not)
        if folder == out_dir and held:
            why_not = why or "unreadable or incomplete"
    target = out_dir / own if own and held else out_dir
    if target != out_dir:
        log.info("the profile in %s does not serve this run (%s): profiling into %s", out_dir, why_not, target)
    prof = profile(workload, space, settings, progress=config.progress)
    watch.merge(prof.cost)
    # the figures drawn from the profile this one replaces go with it: a run refused or stopped before it draws its
    # own (a study of other settings, Ctrl-C) left the old heat maps beside the new profile's files
    for name in PROFILE_FIGURES:
        (target / name).unlink(missing_ok=True)
    prof.save(target)
    return SavedProfile(profile=prof, folder=target, measured=True, own=target != out_dir, why_not=why_not)


def _saved(folder: Path) -> Profile | None:
    """The profile saved in `folder`, or None (none there, or unreadable: measuring again is the repair)."""
    if not ((folder / "profile.csv").is_file() and (folder / "profile.json").is_file()):
        return None
    try:
        return Profile.load(folder)
    except OtherVersion as exc:  # its numbers may mean something else here: measured again, not read
        log.warning("%s; profiling again", exc)
    except Exception as exc:  # a torn or hand-edited file: measuring again is the repair
        log.warning("%s: the saved profile cannot be read (%s: %s); profiling again", folder, type(exc).__name__, exc)
    return None


def _unfit(cached: Profile, workload: Workload, space: SearchSpace, config: SearchConfig, settings: ProfileConfig) -> str | None:
    """Why a saved profile does not serve this run, or None where it does."""
    if cached.fingerprint != model_fingerprint(workload.model):
        return "another model structure"
    cut_at = cached.deadline_s if cached.deadline_s is not None else 0.0
    if not cached.complete and (settings.deadline_s is None or settings.deadline_s > cut_at):
        return "cut short by a time budget"  # a run with more time profiles every layer; one with as little reuses it
    if cached.weights != workload.weights:  # other weights (a retrained model): other sensitivities
        return "other weights"
    if cached.device != device_name(str(workload.device)):
        return f"measured on {cached.device}"
    if cached.compiled != config.compile:
        return f"timed {'compiled' if cached.compiled else 'eager'}"
    # a cell whose metric was skipped as ruled out must still be ruled out under this space's prune rule
    skipped = [r for r in cached.rows if r.metric_source.startswith("not measured")]
    if not all(ruled_out(row, None, space.prune_slower_than) is not None for row in skipped):
        return "a format it ruled out is in play under this space's prune rule"
    # drops it predicted from groups are as precise as its tolerance: no coarser than this run's
    predicted = any(r.metric_source.startswith(PREDICTED) for r in cached.rows)
    wanted = settings.group_tolerance if settings.group_testing else None
    if predicted and not (cached.group_tolerance is not None and wanted is not None and cached.group_tolerance <= wanted):
        theirs = "from groups" if cached.group_tolerance is None else f"within {cached.group_tolerance:g}"
        return f"its drops are predicted {theirs}; this run needs {'each layer alone' if wanted is None else f'{wanted:g}'}"
    # numerics asked of every format: a profile that left some unmeasured ("offered") does not serve
    if cached.numerics != "all" and settings.numerics != "offered":
        return "numerics of the offered formats only"
    tunable = space.tunable_layers(workload.model).items()
    offered = {(n, f.value) for n, fs in tunable for f in fs if n not in cached.uncalled}
    if offered != {(r.layer, r.format) for r in cached.rows}:
        return "other layers or formats"
    return None


@dataclasses.dataclass(frozen=True)
class Earlier:
    """A finished study's result as an earlier run wrote it to the output folder: each budget's policy file (`chosen`),
    the re-measured finalists, the noise floor they were judged against (train mode), and where the time went."""

    chosen: list[Chosen]
    finals: Finals
    noise: NoiseFloor | None
    cost: dict[str, Any]


def earlier_result(
    policy_files: Mapping[float, Path], finalists_file: Path, study: StudyRef, config: SearchConfig
) -> Earlier | None:
    """The result an earlier run of this finished study wrote (`policy_files`: budget -> its policy file), when every
    file of it is there and it was chosen from the study as it stands (`study`: its name, storage and as many complete
    trials: no worker added one since); else None, and the finalists are re-measured. Rerunning the same command must
    not swap a policy on new noise."""
    chosen, noise = [], None
    for b, path in policy_files.items():
        try:
            policy = Policy.from_dict(read_json(path))
        except (OSError, ValueError):  # a UserError from read_json too: unreadable, so measured again
            return None
        m = Measured.of(policy)
        if config.mode is Mode.TRAIN:  # the noise floor it was judged against: this study's own, or measure again
            noise = NoiseFloor.from_dict(m.noise)
            if noise is None or noise.steps != config.train_steps or len(noise.metrics) != config.noise_runs:
                return None
        written = (m.budget, m.study.name, m.study.storage, m.study.complete)
        if written != (b, study.name, study.storage, study.complete) or m.greedy is None or m.chosen is None:
            return None
        chosen.append(Chosen(budget=b, name=m.chosen, why=m.why or "", policy=policy, file=path, greedy=m.greedy))
    try:
        finals = Finals.read_csv(finalists_file)
    except OtherVersion as exc:
        log.warning("%s; re-measuring the finalists", exc)
        return None
    except (OSError, ValueError):
        return None
    if not {c.name for c in chosen} | {c.greedy for c in chosen} <= set(finals.names):
        return None
    if config.cuda_graphs and BF16_GRAPHS not in finals.names:  # asked for a row the earlier run did not measure
        return None
    return Earlier(chosen=chosen, finals=finals, noise=noise, cost=dict(Measured.of(chosen[0].policy).cost))
