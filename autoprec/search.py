"""The Optuna study: per-layer formats and loss-scale settings, maximising measured training throughput
subject to the metric dropping by no more than the budget."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import torch
from tqdm.auto import tqdm

from autoprec.apply import fp8_backend
from autoprec.errors import UserError
from autoprec.formats import Format, autocast_supported, device_name
from autoprec.measure import TimingConfig, Trainer, evaluate_metric, interleaved_times, time_steps
from autoprec.policy import ROOT, LossScale, Policy, model_fingerprint
from autoprec.profile import Profile, ProfileConfig, profile
from autoprec.space import SearchSpace
from autoprec.task import Workload

log = logging.getLogger("autoprec")

INFEASIBLE = 1e9  # constraint value of a candidate whose loss or metric is not finite
DEFAULT_PARAM = "default"
LAYER_PARAM = "layer:"


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """How to search. `trials` counts every trial in the study, so a rerun resumes up to it."""

    budget: float
    trials: int | None = None  # None: the search space's `trials`
    seed: int = 0
    storage: str | None = None  # an Optuna storage URL or a journal file path; None: out_dir/study.journal
    study_name: str | None = None  # None: the task's name
    timing: TimingConfig = TimingConfig()
    final_timing: TimingConfig = TimingConfig(rounds=11)
    finalists: int = 3
    profile: ProfileConfig = ProfileConfig()
    progress: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.budget, (int, float)) and math.isfinite(self.budget) and self.budget >= 0):
            raise ValueError(f"budget must be a finite number >= 0 (the largest allowed metric drop), but got {self.budget!r}")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials must be >= 1, but got {self.trials!r}")
        if self.finalists < 1:
            raise ValueError(f"finalists must be >= 1, but got {self.finalists!r}")


@dataclasses.dataclass(frozen=True)
class Choices:
    """What the study may pick: root formats, per-layer formats, and why the rest were ruled out."""

    default: tuple[str, ...]
    layers: Mapping[str, tuple[str, ...]]
    excluded: Mapping[str, Mapping[str, str]]

    def to_json(self) -> str:
        return json.dumps({"default": self.default, "layers": self.layers, "excluded": self.excluded}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Choices:
        data = json.loads(text)
        return cls(
            default=tuple(data["default"]),
            layers={k: tuple(v) for k, v in data["layers"].items()},
            excluded=data["excluded"],
        )


@dataclasses.dataclass
class SearchResult:
    policy: Policy
    profile: Profile
    choices: Choices
    trials: pd.DataFrame
    finals: pd.DataFrame  # one row per re-measured candidate: fp32, uniform bf16, finalists
    study_name: str
    storage: str


def _exclusion(row: Mapping[str, Any], budget: float, slower_than: float) -> str | None:
    if row["status"] != "ok":
        return str(row["reason"])
    if not bool(row["finite"]):
        return "non-finite output, gradient, loss or metric when lowered alone"
    if bool(row["overflow"]):
        return f"fp16 overflows: max |output| {float(row['max_abs']):.4g} > 65504 or inf when lowered"
    if float(row["metric_drop"]) > budget:
        return f"alone drops the metric by {float(row['metric_drop']):.4g} > budget {budget:g}"
    ratio = float(row["time_vs_fp32"])
    if math.isfinite(ratio) and ratio > slower_than:
        return f"measured {ratio:.2f}x the layer's fp32 time on this device"
    return None


def build_choices(prof: Profile, space: SearchSpace, budget: float, device: torch.device) -> Choices:
    """Per-layer choices: the offered formats the profile did not rule out; fp32 always stays."""
    layers: dict[str, tuple[str, ...]] = {}
    excluded: dict[str, dict[str, str]] = {}
    for name, rows in prof.table.groupby("layer", sort=False):
        allowed = []
        for _, row in rows.iterrows():
            reason = None if row["format"] == Format.FP32.value else _exclusion(row, budget, space.prune_slower_than)
            if reason is None:
                allowed.append(row["format"])
            else:
                excluded.setdefault(str(name), {})[row["format"]] = reason
        layers[str(name)] = tuple(allowed)
    default = tuple(f.value for f in space.default if autocast_supported(device, f))
    return Choices(default=default, layers=layers, excluded=excluded)


def policy_from_params(params: Mapping[str, Any], choices: Choices) -> Policy:
    """The policy a trial's params describe; a layer with a single choice is fixed to it."""
    layers = {ROOT: params.get(DEFAULT_PARAM, choices.default[0])}
    for name, options in choices.layers.items():
        layers[name] = params.get(LAYER_PARAM + name, options[0])
    loss_scale = LossScale()
    if Format.FP16.value in layers.values() and "loss_scale:init_scale_log2" in params:
        loss_scale = LossScale(
            init_scale=2.0 ** params["loss_scale:init_scale_log2"],
            growth_interval=int(params["loss_scale:growth_interval"]),
            dynamic=bool(params["loss_scale:dynamic"]),
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
        lo, hi = space.loss_scale.init_scale_log2
        params["loss_scale:init_scale_log2"] = trial.suggest_int("loss_scale:init_scale_log2", lo, hi)
        params["loss_scale:growth_interval"] = trial.suggest_categorical(
            "loss_scale:growth_interval", space.loss_scale.growth_interval
        )
        params["loss_scale:dynamic"] = trial.suggest_categorical("loss_scale:dynamic", space.loss_scale.dynamic)
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


def _storage(config: SearchConfig, out_dir: Path) -> tuple[Any, str]:
    url = config.storage
    if url is None or "://" not in url:
        path = Path(url) if url else out_dir / "study.journal"
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = optuna.storages.journal.JournalFileBackend(str(path))
        return optuna.storages.JournalStorage(backend), str(path)
    return url, url


def _sampler(space: SearchSpace, seed: int) -> optuna.samplers.BaseSampler:
    if space.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True)  # reads trial.constraints


def _study_key(workload: Workload, space: SearchSpace, budget: float) -> dict[str, str]:
    # What shapes the choices; not the file's path, sampler or trial count.
    shape = (space.layers, space.default, space.loss_scale, space.prune_slower_than)
    space_hash = hashlib.sha256(repr(shape).encode()).hexdigest()[:12]
    return {
        "budget": repr(float(budget)),
        "device": device_name(str(workload.device)),
        "model": model_fingerprint(workload.model),
        "space": space_hash,
    }


class _Objective:
    def __init__(self, workload: Workload, choices: Choices, space: SearchSpace, fp32_metric: float, config: SearchConfig):
        self.workload, self.choices, self.space = workload, choices, space
        self.fp32_metric, self.config = fp32_metric, config
        self.baseline = Trainer(workload, Policy(layers={ROOT: Format.FP32}))  # timed beside every candidate

    def __call__(self, trial: optuna.Trial) -> float:
        policy = _suggest(trial, self.choices, self.space)
        try:
            metric = evaluate_metric(self.workload, policy)
        except Exception as exc:  # e.g. the user's evaluate cannot run some format: infeasible, not fatal
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:300])
            metric = math.nan
        drop = self.fp32_metric - metric
        feasible = math.isfinite(metric) and drop <= self.config.budget
        trial.set_user_attr("metric", metric if math.isfinite(metric) else None)
        trial.set_user_attr("metric_drop", drop if math.isfinite(drop) else None)
        constraint = drop - self.config.budget if math.isfinite(drop) else INFEASIBLE
        if feasible:  # only candidates within budget are worth the time it takes to time them
            candidate = Trainer(self.workload, policy)
            t = interleaved_times({"fp32": self.baseline.step, "policy": candidate.step}, self.workload.device, self.config.timing)
            if not candidate.finite:
                constraint, feasible = INFEASIBLE, False
                trial.set_user_attr("error", "non-finite training loss")
            trial.set_user_attr("step_ms", t["policy"].median_ms)
            trial.set_user_attr("fp32_step_ms", t["fp32"].median_ms)
            trial.set_user_attr("spread", max(t["policy"].spread, t["fp32"].spread))
            trial.set_user_attr("speedup", t["fp32"].median_ms / t["policy"].median_ms)
        trial.set_user_attr("feasible", feasible)
        trial.set_constraint("metric_drop_over_budget", constraint)
        # Infeasible trials are not timed; the constraint, not this value, keeps them from winning.
        return trial.user_attrs["speedup"] if feasible else 0.0


def trials_table(study: optuna.Study, choices: Choices) -> pd.DataFrame:
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state != optuna.trial.TrialState.COMPLETE:
            rows.append({"trial": t.number, "state": t.state.name})
            continue
        policy = policy_from_params(t.params, choices)
        row = {"trial": t.number, "state": t.state.name}
        row.update({("(default)" if n == ROOT else n): f.value for n, f in policy.layers.items()})
        for key in ("metric", "metric_drop", "feasible", "step_ms", "fp32_step_ms", "speedup", "spread", "error"):
            row[key] = t.user_attrs.get(key)
        if policy.uses_fp16:
            row["init_scale"] = policy.loss_scale.init_scale
            row["growth_interval"] = policy.loss_scale.growth_interval
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
    workload: Workload, candidates: Mapping[str, Policy], fp32_metric: float, budget: float, timing: TimingConfig
) -> pd.DataFrame:
    """Metric and step time of each candidate, timed interleaved with the others; speedup vs fp32."""
    timings, finite = time_steps(workload, candidates, timing)
    rows = []
    for name, policy in candidates.items():
        try:
            metric = evaluate_metric(workload, policy)
        except Exception:
            metric = math.nan
        drop = fp32_metric - metric
        rows.append({
            "candidate": name,
            "metric": metric,
            "metric_drop": drop,
            "feasible": math.isfinite(metric) and drop <= budget and finite[name],
            "step_ms": timings[name].median_ms,
            "spread": timings[name].spread,
        })  # fmt: skip
    table = pd.DataFrame(rows)
    fp32_ms = float(table.loc[table["candidate"] == "fp32", "step_ms"].iloc[0])
    table["speedup"] = fp32_ms / table["step_ms"]
    return table


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "optuna": optuna.__version__}
    for dist in ("torchao", "autoprec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _load_or_profile(workload: Workload, space: SearchSpace, out_dir: Path, config: SearchConfig) -> Profile:
    """Reuse the profile a previous run of the same model on the same device wrote; else measure."""
    if (out_dir / "profile.csv").is_file() and (out_dir / "profile.json").is_file():
        cached = Profile.load(out_dir)
        same = cached.fingerprint == model_fingerprint(workload.model) and cached.device == device_name(str(workload.device))
        offered = {(n, f.value) for n, fs in space.tunable_layers(workload.model).items() for f in fs}
        if same and offered == set(zip(cached.table["layer"], cached.table["format"])):
            log.info("reusing the profile in %s", out_dir)
            return cached
    prof = profile(workload, space, config.profile, progress=config.progress)
    prof.save(out_dir)
    return prof


def open_study(workload: Workload, space: SearchSpace, choices: Choices, config: SearchConfig, out_dir: Path):
    storage, where = _storage(config, out_dir)
    name = config.study_name or workload.task.name
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="maximize", sampler=_sampler(space, config.seed), load_if_exists=True
    )
    key = _study_key(workload, space, config.budget)
    stored = study.user_attrs
    if stored.get("key"):
        diff = [k for k, v in key.items() if stored["key"].get(k) != v]
        if diff:
            was = ", ".join(f"{k} {stored['key'].get(k)}, now {key[k]}" for k in diff)
            raise UserError(
                f"study {name!r} in {where} was made with a different {' and '.join(diff)} ({was}); "
                "pass --study NEW_NAME to start another"
            )
        return study, Choices.from_json(stored["choices"]), where
    study.set_user_attr("key", key)
    study.set_user_attr("choices", choices.to_json())
    return study, choices, where


def search(
    workload: Workload, space: SearchSpace, config: SearchConfig, out_dir: str | Path
) -> SearchResult:
    """Profile, search, re-measure the finalists, and write policy.json, profile.csv, trials.csv to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prof = _load_or_profile(workload, space, out_dir, config)
    choices = build_choices(prof, space, config.budget, workload.device)
    study, choices, where = open_study(workload, space, choices, config, out_dir)
    if not study.trials:
        # Known points first: the baselines and the profile's greedy guess.
        for params in (_uniform_params(choices, "fp32"), _uniform_params(choices, "bf16"), greedy_params(prof, choices, config.budget)):
            study.enqueue_trial({k: v for k, v in params.items() if _is_param(k, choices)}, skip_if_exists=True)
    target = config.trials or space.trials
    remaining = max(0, target - len([t for t in study.trials if t.state.is_finished()]))
    objective = _Objective(workload, choices, space, prof.fp32_metric, config)
    with tqdm(total=remaining, desc="search trials", unit="trial", disable=not config.progress) as bar:
        def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            best = max((t.user_attrs.get("speedup", 0.0) for t in study.trials if t.user_attrs.get("feasible")), default=0.0)
            bar.set_postfix(best_speedup=f"{best:.3f}")
            bar.update(1)

        if remaining:
            study.optimize(objective, n_trials=remaining, callbacks=[callback])
    every = [ROOT, *choices.layers]
    candidates = {"fp32": Policy(layers=dict.fromkeys(every, "fp32")), "uniform bf16": Policy(layers=dict.fromkeys(every, "bf16"))}
    candidates.update(_finalist_policies(study, choices, config.finalists))
    finals = remeasure(workload, candidates, prof.fp32_metric, config.budget, config.final_timing)
    winner = finals[finals["feasible"]].sort_values("speedup", ascending=False)
    best_name = str(winner.iloc[0]["candidate"]) if len(winner) else "fp32"
    best = candidates[best_name]
    policy = Policy(layers=best.layers, loss_scale=best.loss_scale, measured=_measured(workload, prof, choices, config, finals, best_name, study, where))
    policy.save(out_dir / "policy.json")
    table = trials_table(study, choices)
    table.to_csv(out_dir / "trials.csv", index=False)
    finals.to_csv(out_dir / "finalists.csv", index=False)
    return SearchResult(policy=policy, profile=prof, choices=choices, trials=table, finals=finals, study_name=study.study_name, storage=where)


def _is_param(key: str, choices: Choices) -> bool:
    if key == DEFAULT_PARAM:
        return len(choices.default) > 1
    return len(choices.layers.get(key[len(LAYER_PARAM):], ())) > 1


def _measured(workload, prof, choices, config, finals, best_name, study, where) -> dict[str, Any]:
    def result(name: str) -> dict[str, float]:
        row = finals[finals["candidate"] == name].iloc[0]
        return {k: float(row[k]) for k in ("metric", "metric_drop", "step_ms", "spread", "speedup")}

    kept = {n: "; ".join(f"{f}: {r}" for f, r in choices.excluded.get(n, {}).items()) for n, o in choices.layers.items() if o == ("fp32",)}
    return {
        "device": device_name(str(workload.device)),
        "versions": _versions(),
        "model": workload.task.name,
        "fingerprint": model_fingerprint(workload.model),
        "budget": config.budget,
        "mode": "weights",
        "metric": prof.metric_name,
        "chosen": best_name,
        "results": {"fp32": result("fp32"), "uniform bf16": result("uniform bf16"), "policy": result(best_name)},
        "kept_fp32": kept,
        "excluded": {n: dict(r) for n, r in choices.excluded.items()},
        "fp8": fp8_backend(workload.device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "timing": f"median of {config.final_timing.rounds} interleaved rounds; spread = interquartile range / median",
        "study": {"name": study.study_name, "storage": where, "trials": len(study.trials)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
