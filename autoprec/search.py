"""The Optuna study: per-layer formats and loss-scale settings, maximising measured training throughput
subject to the metric dropping by no more than the budget.

The budget applies to one of two measurements (`Mode`): the metric of the given weights with the policy
applied (`weights`, cheap), or the metric after K training steps with the policy and its GradScaler,
against K steps of fp32 from the same weights in the same batch order (`train`), whose noise floor (the
fp32 result's own spread over seeds) is measured and reported beside the budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import hashlib
import importlib.metadata
import json
import logging
import math
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import torch
from tqdm.auto import tqdm

from autoprec.apply import fp8_backend
from autoprec.cost import Stopwatch
from autoprec.errors import UserError
from autoprec.files import write_atomically
from autoprec.formats import Format, autocast_supported, device_name
from autoprec.measure import (
    NoiseFloor,
    StepStats,
    TimingConfig,
    Trainer,
    evaluate_metric,
    interleaved_times,
    measure_steps,
    noise_floor,
    train_and_evaluate,
)
from autoprec.policy import ROOT, LossScale, Policy, model_fingerprint
from autoprec.profile import Profile, ProfileConfig, profile
from autoprec.space import SearchSpace
from autoprec.task import Workload

log = logging.getLogger("autoprec")

INFEASIBLE = 1e9  # constraint value of a candidate whose loss or metric is not finite
DEFAULT_PARAM = "default"
LAYER_PARAM = "layer:"
LS_PARAM = "loss_scale:"


class Mode(str, enum.Enum):
    """What the budget is measured on."""

    WEIGHTS = "weights"  # the metric of the given weights with the policy applied
    TRAIN = "train"  # the metric after K training steps with the policy (and its GradScaler), vs fp32's

    def __str__(self) -> str:
        return self.value


def parse_mode(value: object) -> Mode:
    try:
        return Mode(str(getattr(value, "value", value)).strip().lower())
    except ValueError:
        raise ValueError(f"mode must be one of {', '.join(m.value for m in Mode)}, but got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """How to search. `trials` counts every trial in the study, so a rerun resumes up to it.

    `mode`: what the budget applies to (see Mode); in train mode, `train_steps` is K and `noise_runs` the
    number of fp32 seeds whose spread is the noise floor.
    """

    budget: float
    trials: int | None = None  # None: the search space's `trials`
    seed: int = 0
    storage: str | None = None  # an Optuna storage URL or a journal file path; None: out_dir/study.journal
    heartbeat_s: int = 60  # database storages: a trial whose worker is silent for 2x this is failed and retried
    study_name: str | None = None  # None: the task's name
    timing: TimingConfig = TimingConfig()
    final_timing: TimingConfig = TimingConfig(rounds=11)
    finalists: int = 3
    profile: ProfileConfig = ProfileConfig()
    progress: bool = True
    mode: Mode = Mode.WEIGHTS
    train_steps: int = 50
    noise_runs: int = 3

    def __post_init__(self) -> None:
        if not (isinstance(self.budget, (int, float)) and math.isfinite(self.budget) and self.budget >= 0):
            raise ValueError(f"budget must be a finite number >= 0 (the largest allowed metric drop), but got {self.budget!r}")
        object.__setattr__(self, "mode", parse_mode(self.mode))
        for name in ("train_steps", "noise_runs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, but got {value!r}")
        if isinstance(self.heartbeat_s, bool) or not isinstance(self.heartbeat_s, int) or self.heartbeat_s < 1:
            raise ValueError(f"heartbeat_s must be an integer >= 1 (seconds), but got {self.heartbeat_s!r}")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials must be >= 1, but got {self.trials!r}")
        if self.finalists < 1:
            raise ValueError(f"finalists must be >= 1, but got {self.finalists!r}")


@dataclasses.dataclass(frozen=True)
class Choices:
    """What the study may pick: root formats, per-layer formats, and why the rest were ruled out.
    `loss_scale`: the initial-scale range (log2) searched for fp16 trials and where it came from."""

    default: tuple[str, ...]
    layers: Mapping[str, tuple[str, ...]]
    excluded: Mapping[str, Mapping[str, str]]
    loss_scale: Mapping[str, Any] | None = None

    def to_json(self) -> str:
        data = {"default": self.default, "layers": self.layers, "excluded": self.excluded, "loss_scale": self.loss_scale}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Choices:
        data = json.loads(text)
        return cls(
            default=tuple(data["default"]),
            layers={k: tuple(v) for k, v in data["layers"].items()},
            excluded=data["excluded"],
            loss_scale=data.get("loss_scale"),
        )

    @property
    def fp16_layers(self) -> list[str]:
        return [name for name, options in self.layers.items() if Format.FP16.value in options]


@dataclasses.dataclass
class SearchResult:
    policy: Policy
    profile: Profile
    choices: Choices
    trials: pd.DataFrame
    finals: pd.DataFrame  # one row per re-measured candidate: fp32, uniform bf16, finalists
    study_name: str
    storage: str
    noise: NoiseFloor | None = None  # train mode: the fp32 result's spread over seeds
    cost: dict[str, Any] | None = None  # cost.Stopwatch.to_dict(): where this search's time went


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _exclusion(row: Mapping[str, Any], budget: float | None, slower_than: float) -> str | None:
    """Why the profile rules a format out for a layer, or None. `budget` None: do not judge the
    single-layer drop (train mode, whose budget is on another measurement)."""
    if row["status"] != "ok":
        return str(row["reason"])
    if not bool(row["finite"]):
        return "non-finite output, gradient, loss or metric when lowered alone"
    if bool(row["overflow"]):
        return f"fp16 overflows: max |output| {float(row['max_abs']):.4g} > 65504 or inf when lowered"
    grad_overflow = _number(row.get("grad_overflow"))
    if row["format"] == Format.FP16.value and grad_overflow > 0:
        return f"fp16 gradients overflow even at loss scale 1 ({100 * grad_overflow:.2g}% of elements above 65504)"
    if budget is not None and float(row["metric_drop"]) > budget:
        return f"alone drops the metric by {float(row['metric_drop']):.4g} > budget {budget:g}"
    ratio = float(row["time_vs_fp32"])
    if math.isfinite(ratio) and ratio > slower_than:
        return f"measured {ratio:.2f}x the layer's fp32 time on this device"
    return None


def build_choices(
    prof: Profile, space: SearchSpace, budget: float, device: torch.device, *, mode: Mode = Mode.WEIGHTS
) -> Choices:
    """Per-layer choices: the offered formats the profile did not rule out; fp32 always stays. In train
    mode a single layer's drop of the given weights' metric rules nothing out: the budget is on training."""
    layers: dict[str, tuple[str, ...]] = {}
    excluded: dict[str, dict[str, str]] = {}
    judged = budget if parse_mode(mode) is Mode.WEIGHTS else None
    for name, rows in prof.table.groupby("layer", sort=False):
        allowed = []
        for _, row in rows.iterrows():
            reason = None if row["format"] == Format.FP32.value else _exclusion(row, judged, space.prune_slower_than)
            if reason is None:
                allowed.append(row["format"])
            else:
                excluded.setdefault(str(name), {})[row["format"]] = reason
        layers[str(name)] = tuple(allowed)
    default = tuple(f.value for f in space.default if autocast_supported(device, f))
    choices = Choices(default=default, layers=layers, excluded=excluded)
    return dataclasses.replace(choices, loss_scale=loss_scale_choice(prof, choices, space))


def loss_scale_choice(prof: Profile, choices: Choices, space: SearchSpace) -> dict[str, Any]:
    """The initial-scale range to search: the space's, narrowed to the profile's recommendation for the
    layers that may be fp16. Where the two do not overlap the measurement wins over the file's guess."""
    lo, hi = space.loss_scale.init_scale_log2
    advice = prof.advice(choices.fp16_layers) if choices.fp16_layers else None
    out: dict[str, Any] = {"space": [lo, hi], "recommended": None, "advice": advice.describe() if advice else None}
    recommended = advice.search_range if advice else None
    if recommended is None:
        out["init_scale_log2"] = [lo, hi]
        return out
    out["recommended"] = list(recommended)
    narrowed = (max(lo, recommended[0]), min(hi, recommended[1]))
    if narrowed[0] > narrowed[1]:
        log.warning(
            "the profile recommends loss scales 2^%d..2^%d, outside the search space's init_scale_log2 [%d, %d]; "
            "searching the recommended range", *recommended, lo, hi,
        )  # fmt: skip
        narrowed = recommended
    out["init_scale_log2"] = list(narrowed)
    return out


def policy_from_params(params: Mapping[str, Any], choices: Choices) -> Policy:
    """The policy a trial's params describe; a layer with a single choice is fixed to it."""
    layers = {ROOT: params.get(DEFAULT_PARAM, choices.default[0])}
    for name, options in choices.layers.items():
        layers[name] = params.get(LAYER_PARAM + name, options[0])
    loss_scale = LossScale()
    if Format.FP16.value in layers.values() and LS_PARAM + "init_scale_log2" in params:
        defaults = LossScale()
        loss_scale = LossScale(
            init_scale=2.0 ** params[LS_PARAM + "init_scale_log2"],
            growth_interval=int(params[LS_PARAM + "growth_interval"]),
            growth_factor=float(params.get(LS_PARAM + "growth_factor", defaults.growth_factor)),
            backoff_factor=float(params.get(LS_PARAM + "backoff_factor", defaults.backoff_factor)),
            dynamic=bool(params[LS_PARAM + "dynamic"]),
        )
    return Policy(layers=layers, loss_scale=loss_scale)


def _suggest(trial: optuna.Trial, choices: Choices, space: SearchSpace) -> Policy:
    params: dict[str, Any] = {}
    if len(choices.default) > 1:
        params[DEFAULT_PARAM] = trial.suggest_categorical(DEFAULT_PARAM, choices.default)
    for name, options in choices.layers.items():
        if len(options) > 1:
            params[LAYER_PARAM + name] = trial.suggest_categorical(LAYER_PARAM + name, options)
    if Format.FP16.value in params.values():  # loss scaling matters only with an fp16 layer
        ls = space.loss_scale
        lo, hi = (choices.loss_scale or {}).get("init_scale_log2", ls.init_scale_log2)
        params[LS_PARAM + "init_scale_log2"] = trial.suggest_int(LS_PARAM + "init_scale_log2", lo, hi)
        for name, options in (("growth_interval", ls.growth_interval), ("growth_factor", ls.growth_factor),
                              ("backoff_factor", ls.backoff_factor), ("dynamic", ls.dynamic)):  # fmt: skip
            params[LS_PARAM + name] = trial.suggest_categorical(LS_PARAM + name, options)
    return policy_from_params(params, choices)


def _uniform_params(choices: Choices, fmt: str) -> dict[str, str]:
    params = {DEFAULT_PARAM: fmt if fmt in choices.default else "fp32"}
    for name, options in choices.layers.items():
        params[LAYER_PARAM + name] = fmt if fmt in options else "fp32"
    return params


def greedy_params(prof: Profile, choices: Choices, budget: float) -> dict[str, str]:
    """A warm start from the profile: each layer's fastest allowed format, biggest time saving first,
    while the sum of single-layer metric drops stays within the budget (an estimate; the trial measures)."""
    params = _uniform_params(choices, "bf16")
    params.update({LAYER_PARAM + n: "fp32" for n in choices.layers})
    moves = []
    for name, rows in prof.table.groupby("layer", sort=False):
        fp32_ms = float(rows.loc[rows["format"] == "fp32", "time_ms"].iloc[0])
        allowed = rows[rows["format"].isin(choices.layers[str(name)]) & (rows["format"] != "fp32")]
        if len(allowed):
            best = allowed.sort_values("time_ms").iloc[0]
            if float(best["time_ms"]) < fp32_ms:
                moves.append((fp32_ms - float(best["time_ms"]), str(name), best["format"], max(0.0, float(best["metric_drop"]))))
    spent = 0.0
    for _saving, name, fmt, drop in sorted(moves, reverse=True):
        if spent + drop <= budget:
            params[LAYER_PARAM + name] = fmt
            spent += drop
    return params


RETRIES = 3  # how often a trial whose worker died is run again before it stays failed


def _storage(config: SearchConfig, out_dir: Path) -> tuple[Any, str]:
    url = config.storage
    if url is None or "://" not in url:
        # Optuna's recommended storage for several processes on one machine: a journal file behind a file
        # lock, no server. It has no heartbeat (optuna 5), so a killed worker's trial stays RUNNING.
        path = Path(url) if url else out_dir / "study.journal"
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = optuna.storages.journal.JournalFileBackend(str(path))
        return optuna.storages.JournalStorage(backend), str(path)
    return _database(url, config.heartbeat_s), url


def _database(url: str, heartbeat_s: int) -> optuna.storages.RDBStorage:
    """A database storage with Optuna's heartbeat: each running trial records a beat every `heartbeat_s`;
    a worker starting a trial fails those silent for twice that and queues them again (RETRIES times)."""
    import sqlalchemy.exc  # optuna's own dependency

    for attempt in range(3):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in optuna 5, and what we need
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=RETRIES)
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=heartbeat_s, grace_period=2 * heartbeat_s, heartbeat_stale_trial_callback=retry
                )
        except ImportError:
            hint = "PostgreSQL: pip install psycopg2-binary"
            raise UserError(f"--storage {url}: its database driver is not installed ({hint})") from None
        except sqlalchemy.exc.ArgumentError as exc:
            raise UserError(
                f"--storage {url}: not a storage URL Optuna can open ({exc}); use a journal file path, "
                "sqlite:///PATH or postgresql+psycopg2://USER:PASSWORD@HOST:PORT/DATABASE"
            ) from None
        except Exception as exc:
            # Workers creating a new database's tables at the same moment collide once; the next try finds them.
            if attempt == 2:
                first = (str(exc).strip().splitlines() or [""])[0]
                raise UserError(f"--storage {url}: cannot open it: {type(exc).__name__}: {first}") from None
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


def _sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    if space.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True)  # reads trial.constraints


def _study_key(workload: Workload, space: SearchSpace, config: SearchConfig) -> dict[str, str]:
    # What shapes the choices and the measurements; not the file's path, sampler or trial count.
    shape = (space.layers, space.default, space.loss_scale, space.prune_slower_than)
    space_hash = hashlib.sha256(repr(shape).encode()).hexdigest()[:12]
    return {
        "budget": repr(float(config.budget)),
        "device": device_name(str(workload.device)),
        "model": model_fingerprint(workload.model),
        "space": space_hash,
        "mode": config.mode.value if config.mode is Mode.WEIGHTS else f"{config.mode.value}, {config.train_steps} steps",
    }


_KEY_DEFAULTS = {"mode": Mode.WEIGHTS.value}  # studies made before a key existed


class Judge:
    """The metric a candidate is held to and the fp32 result it is compared with: the given weights'
    (weights mode), or after K training steps from them (train mode, with the noise floor measured)."""

    def __init__(self, workload: Workload, config: SearchConfig, weights_fp32_metric: float):
        self.workload, self.config = workload, config
        self.noise: NoiseFloor | None = None
        self.fp32_metric = weights_fp32_metric
        if config.mode is Mode.TRAIN:
            self.noise = noise_floor(workload, config.train_steps, config.noise_runs)
            self.fp32_metric = self.noise.reference
            if not math.isfinite(self.fp32_metric):
                raise UserError(
                    f"{workload.task.path}: after {config.train_steps} fp32 training steps the metric is "
                    f"{self.fp32_metric}; train mode needs a finite one"
                )

    def metric(self, policy: Policy) -> tuple[float, dict[str, Any]]:
        """The candidate's metric (NaN when anything went non-finite) and what else was measured on the way."""
        if self.config.mode is Mode.TRAIN:
            out = train_and_evaluate(self.workload, policy, self.config.train_steps)
            return (out.metric if out.finite else math.nan), {"train_skipped": out.skipped}
        return evaluate_metric(self.workload, policy), {}

    def safe_metric(self, policy: Policy) -> tuple[float, dict[str, Any]]:
        try:
            return self.metric(policy)
        except UserError:
            raise
        except Exception as exc:  # e.g. the user's evaluate cannot run some format: infeasible, not fatal
            return math.nan, {"error": f"{type(exc).__name__}: {exc}"[:300]}


class _Objective:
    def __init__(self, workload: Workload, choices: Choices, space: SearchSpace, judge: Judge, config: SearchConfig):
        self.workload, self.choices, self.space = workload, choices, space
        self.judge, self.config = judge, config
        self.baseline = Trainer(workload, Policy(layers={ROOT: Format.FP32}))  # timed beside every candidate

    def __call__(self, trial: optuna.Trial) -> float:
        policy = _suggest(trial, self.choices, self.space)
        earlier = _same_policy(trial)
        if earlier is not None:  # samplers propose a policy again: its measurements stand, and cost nothing
            return self._reuse(trial, earlier)
        start = time.perf_counter()
        if self.config.mode is Mode.WEIGHTS and _all_fp32(policy):
            metric, extra = self.judge.fp32_metric, {}  # the profile measured exactly this model
        else:
            metric, extra = self.judge.safe_metric(policy)
        trial.set_user_attr("evaluate_s", time.perf_counter() - start)
        for key, value in extra.items():
            trial.set_user_attr(key, value)
        drop = self.judge.fp32_metric - metric
        feasible = math.isfinite(metric) and drop <= self.config.budget
        trial.set_user_attr("metric", metric if math.isfinite(metric) else None)
        trial.set_user_attr("metric_drop", drop if math.isfinite(drop) else None)
        constraint = drop - self.config.budget if math.isfinite(drop) else INFEASIBLE
        if feasible:  # only candidates within budget are worth the time it takes to time them
            start = time.perf_counter()
            feasible, constraint = self._time(trial, policy, constraint)
            trial.set_user_attr("measure_s", time.perf_counter() - start)
        trial.set_user_attr("feasible", feasible)
        trial.set_constraint("metric_drop_over_budget", constraint)
        # Infeasible trials are not timed; the constraint, not this value, keeps them from winning.
        return trial.user_attrs["speedup"] if feasible else 0.0

    def _reuse(self, trial: optuna.Trial, earlier: optuna.trial.FrozenTrial) -> float:
        for key in TRIAL_ATTRS:
            if key in earlier.user_attrs:
                trial.set_user_attr(key, earlier.user_attrs[key])
        trial.set_user_attr("reused_from", earlier.number)
        for key, value in earlier.system_attrs.items():
            if key.startswith("constraints:"):
                trial.set_constraint(key.split(":", 1)[1], value)
        return trial.user_attrs["speedup"] if trial.user_attrs.get("feasible") else 0.0

    def _time(self, trial: optuna.Trial, policy: Policy, constraint: float) -> tuple[bool, float]:
        try:
            candidate = Trainer(self.workload, policy)
            t = interleaved_times({"fp32": self.baseline.step, "policy": candidate.step}, self.workload.device, self.config.timing)
        except UserError:
            raise
        except Exception as exc:  # a step the user's code cannot take in this format: infeasible, not fatal
            trial.set_user_attr("error", f"training step failed: {type(exc).__name__}: {exc}"[:300])
            return False, INFEASIBLE
        stats = StepStats(t["policy"], candidate.finite, candidate.steps, candidate.skipped)
        trial.set_user_attr("step_ms", t["policy"].median_ms)
        trial.set_user_attr("fp32_step_ms", t["fp32"].median_ms)
        trial.set_user_attr("spread", max(t["policy"].spread, t["fp32"].spread))
        trial.set_user_attr("skipped", stats.skipped)
        trial.set_user_attr("steps", stats.steps)
        if not stats.finite or not math.isfinite(stats.effective_ms):
            trial.set_user_attr("error", "non-finite training loss" if not stats.finite else "the GradScaler skipped every step")
            return False, INFEASIBLE
        trial.set_user_attr("effective_step_ms", stats.effective_ms)
        trial.set_user_attr("speedup", t["fp32"].median_ms / stats.effective_ms)
        return True, constraint


TRIAL_ATTRS = ("metric", "metric_drop", "feasible", "step_ms", "skipped", "steps", "effective_step_ms",
               "fp32_step_ms", "speedup", "spread", "train_skipped", "error")  # fmt: skip
COST_ATTRS = ("evaluate_s", "measure_s", "reused_from")


def _all_fp32(policy: Policy) -> bool:
    return all(fmt is Format.FP32 for fmt in policy.layers.values())


def _same_policy(trial: optuna.Trial) -> optuna.trial.FrozenTrial | None:
    """A completed trial of the study (any worker's) with exactly these params, or None."""
    params = trial.params
    done = trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return next((t for t in done if t.params == params and "feasible" in t.user_attrs), None)


def trials_table(study: optuna.Study, choices: Choices, prof: Profile | None = None) -> pd.DataFrame:
    """One row per trial: its formats, loss scale, what it measured, and (with the profile) the drop the
    sum of single-layer drops predicted for it."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state != optuna.trial.TrialState.COMPLETE:
            rows.append({"trial": t.number, "state": t.state.name})
            continue
        policy = policy_from_params(t.params, choices)
        row = {"trial": t.number, "state": t.state.name}
        row.update({("(default)" if n == ROOT else n): f.value for n, f in policy.layers.items()})
        if prof is not None:
            row["predicted_drop"] = prof.predicted_drop(policy.layers)
        for key in (*TRIAL_ATTRS, *COST_ATTRS):
            row[key] = t.user_attrs.get(key)
        if policy.uses_fp16:
            ls = policy.loss_scale
            row.update(init_scale=ls.init_scale, growth_interval=ls.growth_interval, growth_factor=ls.growth_factor,
                       backoff_factor=ls.backoff_factor, dynamic=ls.dynamic)  # fmt: skip
        row["duration_s"] = t.duration.total_seconds() if t.duration else None
        rows.append(row)
    return pd.DataFrame(rows)


def _finalist_policies(study: optuna.Study, choices: Choices, k: int) -> dict[str, Policy]:
    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    good = sorted((t for t in done if t.user_attrs.get("feasible")), key=lambda t: -t.user_attrs["speedup"])
    picked: dict[str, Policy] = {}
    seen = set()
    for t in good:
        policy = policy_from_params(t.params, choices)
        key = json.dumps(policy.to_dict(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            picked[f"trial {t.number}"] = policy
        if len(picked) == k:
            break
    return picked


def remeasure(
    workload: Workload, candidates: Mapping[str, Policy], judge: Judge, budget: float, timing: TimingConfig
) -> pd.DataFrame:
    """Metric and step time of each candidate, timed interleaved with the others; speedup vs fp32 in
    effective steps (those the GradScaler did not skip)."""
    stats = measure_steps(workload, candidates, timing)
    rows = []
    for name, policy in candidates.items():
        metric, extra = judge.safe_metric(policy)
        drop = judge.fp32_metric - metric
        s = stats[name]
        rows.append({
            "candidate": name,
            "metric": metric,
            "metric_drop": drop,
            "feasible": math.isfinite(metric) and drop <= budget and s.finite and math.isfinite(s.effective_ms),
            "step_ms": s.timing.median_ms,
            "skipped": s.skipped,
            "steps": s.steps,
            "effective_step_ms": s.effective_ms,
            "spread": s.timing.spread,
            "train_skipped": extra.get("train_skipped"),
        })  # fmt: skip
    table = pd.DataFrame(rows)
    fp32_ms = float(table.loc[table["candidate"] == "fp32", "effective_step_ms"].iloc[0])
    table["speedup"] = fp32_ms / table["effective_step_ms"]
    return table


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "optuna": optuna.__version__}
    for dist in ("torchao", "autoprec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _load_or_profile(
    workload: Workload, space: SearchSpace, out_dir: Path, config: SearchConfig, *, watch: Stopwatch | None = None
) -> Profile:
    """Reuse the profile a previous run of the same model on the same device wrote; else measure. `watch`
    receives the profiling stages, or a count when the saved profile was reused."""
    watch = watch or Stopwatch()
    if (out_dir / "profile.csv").is_file() and (out_dir / "profile.json").is_file():
        cached = Profile.load(out_dir)
        same = cached.fingerprint == model_fingerprint(workload.model) and cached.device == device_name(str(workload.device))
        offered = {(n, f.value) for n, fs in space.tunable_layers(workload.model).items() for f in fs}
        complete = cached.grad_ranges is not None  # written before gradient ranges existed: measure again
        if same and complete and offered == set(zip(cached.table["layer"], cached.table["format"])):
            log.info("reusing the profile in %s", out_dir)
            watch.count("profile: reused the one saved in the output folder")
            return cached
    prof = profile(workload, space, config.profile, progress=config.progress)
    watch.merge(prof.cost)
    prof.save(out_dir)
    return prof


KEY_ATTR, CHOICES_ATTR, WORKER_ATTR = "autoprec:key", "autoprec:choices", "autoprec:worker"


def _check_key(stored: Mapping[str, Any], key: Mapping[str, str], name: str, where: str) -> None:
    before = {k: stored.get(k, _KEY_DEFAULTS.get(k)) for k in key}
    diff = [k for k, v in key.items() if before[k] != v]
    if diff:
        was = ", ".join(f"{k} {before[k]}, now {key[k]}" for k in diff)
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
):
    """Create or join the study. Every worker proposes its choices on the all-fp32 warm-start trial; the first
    proposal in the storage wins, and only its worker queues the other warm starts (`warm_starts(choices)`).
    Two workers starting at the same moment may both queue the fp32 trial: it is then measured twice."""
    storage, where = _storage(config, out_dir)
    name = config.study_name or workload.task.name
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="maximize", sampler=_sampler(space, config.seed), load_if_exists=True
    )
    key = _study_key(workload, space, config)
    first = _first_start(study)
    worker = uuid.uuid4().hex
    if first is None and study.user_attrs.get("key"):  # made before the choices moved from the study onto its first trial
        _check_key(study.user_attrs["key"], key, name, where)
        return study, Choices.from_json(study.user_attrs["choices"]), where
    if first is None:
        attrs = {KEY_ATTR: key, CHOICES_ATTR: choices.to_json(), WORKER_ATTR: worker}
        study.enqueue_trial(_warm_params(_uniform_params(choices, "fp32"), choices), user_attrs=attrs)
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
        study.sampler = _sampler(space, seed)
    return study, Choices.from_json(first.user_attrs[CHOICES_ATTR]), where


def _warm_params(params: Mapping[str, Any], choices: Choices) -> dict[str, Any]:
    return {k: v for k, v in params.items() if _is_param(k, choices)}


def search(
    workload: Workload, space: SearchSpace, config: SearchConfig, out_dir: str | Path
) -> SearchResult:
    """Profile, search, re-measure the finalists, and write policy.json, profile.csv, trials.csv to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    watch = Stopwatch()
    prof = _load_or_profile(workload, space, out_dir, config, watch=watch)
    choices = build_choices(prof, space, config.budget, workload.device, mode=config.mode)

    def warm_starts(agreed: Choices) -> list[dict[str, Any]]:  # after all-fp32: known points first
        return [_uniform_params(agreed, "bf16"), greedy_params(prof, agreed, config.budget)]

    study, choices, where = open_study(workload, space, choices, config, out_dir, warm_starts)
    with watch.section("noise floor: fp32 trained over seeds") if config.mode is Mode.TRAIN else contextlib.nullcontext():
        judge = Judge(workload, config, prof.fp32_metric)
    if judge.noise is not None and config.budget < judge.noise.spread:
        log.warning(
            "budget %g is below the noise floor %.4g (the fp32 metric's spread over %d seeds after %d training "
            "steps): the search cannot tell a real loss from noise there",
            config.budget, judge.noise.spread, config.noise_runs, config.train_steps,
        )  # fmt: skip
    target = config.trials or space.trials
    # Completed trials count, in the whole study; one cut short (Ctrl-C, a crash) is run again on resume.
    complete = (optuna.trial.TrialState.COMPLETE,)
    remaining = max(0, target - len(study.get_trials(deepcopy=False, states=complete)))
    objective = _Objective(workload, choices, space, judge, config)
    with tqdm(total=remaining, desc="search trials", unit="trial", disable=not config.progress) as bar:
        def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            best = max((t.user_attrs.get("speedup", 0.0) for t in study.trials if t.user_attrs.get("feasible")), default=0.0)
            bar.set_postfix(best_speedup=f"{best:.3f}")
            bar.update(1)

        if remaining:
            # Other workers complete trials too: stop once the study holds the target. A trial another worker
            # is still running then also completes, so N workers may overshoot by up to N - 1 trials.
            stop = optuna.study.MaxTrialsCallback(target, states=complete)
            study.optimize(objective, n_trials=remaining, callbacks=[stop, callback])
    _trial_costs(study, watch)
    every = [ROOT, *choices.layers]
    candidates = {"fp32": Policy(layers=dict.fromkeys(every, "fp32")), "uniform bf16": Policy(layers=dict.fromkeys(every, "bf16"))}
    finalists = _finalist_policies(study, choices, config.finalists)
    candidates.update(finalists)
    if finalists:
        top_name, top = next(iter(finalists.items()))
        safer = safer_variant(top, choices)
        if safer is not None and all(safer.layers != c.layers for c in candidates.values()):
            candidates[f"{top_name}, fp16/fp8 -> bf16"] = safer
    with watch.section(f"final re-measure of {len(candidates)} candidates"):
        finals = remeasure(workload, candidates, judge, config.budget, config.final_timing)
    best_name, why = choose(finals, candidates)
    best = candidates[best_name]
    measured = _measured(workload, prof, choices, config, finals, best_name, study, where, judge)
    measured["why"] = why
    measured["cost"] = watch.to_dict()
    policy = Policy(layers=best.layers, loss_scale=best.loss_scale, measured=measured)
    policy.save(out_dir / "policy.json")
    table = trials_table(study, choices, prof)
    write_atomically(out_dir / "trials.csv", lambda tmp: table.to_csv(tmp, index=False))
    write_atomically(out_dir / "finalists.csv", lambda tmp: finals.to_csv(tmp, index=False))
    return SearchResult(
        policy=policy, profile=prof, choices=choices, trials=table, finals=finals, study_name=study.study_name,
        storage=where, noise=judge.noise, cost=watch.to_dict(),
    )  # fmt: skip


def _trial_costs(study: optuna.Study, watch: Stopwatch) -> None:
    """The study's completed trials (every worker's, every run's), split into evaluating the metric, measuring
    step times, and the rest of each trial's wall time: sampling, the storage, building the candidate."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    evaluate = sum(t.user_attrs.get("evaluate_s", 0.0) for t in done)
    measure = sum(t.user_attrs.get("measure_s", 0.0) for t in done)
    wall = sum(t.duration.total_seconds() for t in done if t.duration)
    fresh = [t for t in done if "reused_from" not in t.user_attrs]
    watch.add("trials: evaluating the metric", evaluate, sum("evaluate_s" in t.user_attrs for t in fresh))
    watch.add("trials: measuring step times", measure, sum("measure_s" in t.user_attrs for t in fresh))
    watch.add("trials: sampling, storage, the rest", max(0.0, wall - evaluate - measure), len(done))
    watch.count("trials: a repeated policy, its measurements reused", len(done) - len(fresh))


_RISKY = (Format.FP16, Format.FP8)


def _risk(policy: Policy) -> int:
    """Layers in fp16 (overflow, loss scaling) or fp8 (4 mantissa bits): worth it only for a measured gain."""
    return sum(fmt in _RISKY for fmt in policy.layers.values())


def safer_variant(policy: Policy, choices: Choices) -> Policy | None:
    """The policy with every fp16/fp8 layer in bf16 where the layer may be bf16, else fp32; None if none."""
    if not _risk(policy):
        return None
    layers = {}
    for name, fmt in policy.layers.items():
        if fmt in _RISKY:
            options = choices.default if name == ROOT else choices.layers.get(name, ())
            fmt = Format.BF16 if Format.BF16.value in options else Format.FP32
        layers[name] = fmt
    return Policy(layers=layers)


def choose(finals: pd.DataFrame, candidates: Mapping[str, Policy]) -> tuple[str, str]:
    """The fastest candidate within budget, unless its lead over one with fewer fp16/fp8 layers is inside
    the measured spread: then the safer one, since the measurement cannot tell them apart."""
    feasible = finals[finals["feasible"]].sort_values("speedup", ascending=False)
    if not len(feasible):
        return "fp32", "no candidate stayed within budget when re-measured: fp32"
    top = feasible.iloc[0]
    tied = [r for _, r in feasible.iterrows() if top["speedup"] / r["speedup"] - 1 < (top["spread"] + r["spread"]) / 2]
    pick = min(tied, key=lambda r: (_risk(candidates[r["candidate"]]), -r["speedup"]))
    if pick["candidate"] == top["candidate"]:
        return str(top["candidate"]), "the fastest within budget"
    lead = 100 * (top["speedup"] / pick["speedup"] - 1)
    return str(pick["candidate"]), (
        f"{top['candidate']} measured {lead:.1f}% faster, inside the spread, with more fp16/fp8 layers "
        f"({_risk(candidates[top['candidate']])} against {_risk(candidates[pick['candidate']])}): the safer one"
    )


def _is_param(key: str, choices: Choices) -> bool:
    if key == DEFAULT_PARAM:
        return len(choices.default) > 1
    return len(choices.layers.get(key[len(LAYER_PARAM):], ())) > 1


def _measured(workload, prof, choices, config, finals, best_name, study, where, judge) -> dict[str, Any]:
    def result(name: str) -> dict[str, float]:
        row = finals[finals["candidate"] == name].iloc[0]
        out = {k: float(row[k]) for k in ("metric", "metric_drop", "step_ms", "effective_step_ms", "spread", "speedup")}
        out.update(skipped_steps=int(row["skipped"]), steps=int(row["steps"]))
        if config.mode is Mode.TRAIN:
            out["train_skipped_steps"] = int(row["train_skipped"])
        return out

    kept = {n: "; ".join(f"{f}: {r}" for f, r in choices.excluded.get(n, {}).items()) for n, o in choices.layers.items() if o == ("fp32",)}
    return {
        "device": device_name(str(workload.device)),
        "versions": _versions(),
        "model": workload.task.name,
        "fingerprint": model_fingerprint(workload.model),
        "budget": config.budget,
        "mode": config.mode.value,
        "train_steps": config.train_steps if config.mode is Mode.TRAIN else None,
        "noise_floor": judge.noise.spread if judge.noise else None,
        "noise": judge.noise.to_dict() if judge.noise else None,
        "fp32_metric": judge.fp32_metric,
        "metric": prof.metric_name,
        "chosen": best_name,
        "results": {"fp32": result("fp32"), "uniform bf16": result("uniform bf16"), "policy": result(best_name)},
        "kept_fp32": kept,
        "excluded": {n: dict(r) for n, r in choices.excluded.items()},
        "fp8": fp8_backend(workload.device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "timing": (
            f"median of {config.final_timing.rounds} interleaved rounds; spread = interquartile range / median; "
            "effective_step_ms = step_ms / (1 - skipped / steps): steps the GradScaler skipped update nothing"
        ),
        "loss_scale_search": dict(choices.loss_scale or {}),
        "study": {"name": study.study_name, "storage": where, "trials": len(study.trials)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
