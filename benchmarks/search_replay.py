"""The search's cost and answer on recorded device behaviour: `autoprec search` run for real (profile, metric, Optuna,
re-measure, choice) with every step time it reads served from a recorded trace, with the trace's spreads.

A trace (benchmarks/traces/<device>/<model>/: profile.csv, trials.csv, finalists.csv, policy.json, as a search on that
device wrote them) holds each layer's step time per format and the whole-step times of the policies it timed. The
ReplayClock below stands in for autoprec.tune._measure._timing.CLOCK and prices each timed call by what it runs:

- a profile layer step (its model: the profiler's holder of one layer): the trace's time_ms for that layer's shape and
  format, times noise of the row's time_spread;
- a whole training step (its model: the user's model with a policy applied): the policy's TRUE step time times noise
  drawn from its recorded spread. TRUE, as a ratio to the trace's fp32 step (the final re-measure's): for a policy the
  final re-measure timed (22 interleaved rounds), its recorded step / fp32 step; for any other, the ground-truth model

      1 - step / fp32 step  =  a * (sum over layers of the profile's fp32 ms - format ms)  +  b[root format]
                               - e * (layers lowered under an fp32 root)

  fitted once by least squares to ALL the recorded timings (every timed trial and every finalist, weighted by their
  rounds). It is the replay's device, fitted to everything recorded, not the search's own prediction
  (autoprec/tune/_measure/_speed.py), which fits only the trials it has timed, and has no e term: the trace shows that on this
  CPU an fp32 root with lowered layers runs slower than fp32 (each lowered layer casts back), however much they save.
  A single trial's median is not served as it is by default (`--recorded all` does): 7 rounds beside an fp32 step
  that moved from 221 to 1113 ms under the load make a jagged device (one trial of 3 rounds would be the optimum,
  2.4x) whose needles no prediction can see; the final re-measure's 22 rounds, one interleaved run, are served.

Noise: each call's price times exp(N(0, sigma)), sigma = spread / 1.349 (a lognormal whose IQR / median is the
recorded spread; spread = IQR / median), from a numpy Generator seeded per run; independent per call (the recorded
load moved fp32 and policy alike within a round, which interleaving cancels: independent noise is the harsher case).
A policy with no recorded spread takes the median of the recorded whole-step spreads; every spread is capped at
--max-spread (1.05, the re-measure's widest): the profile's 5-round spreads reach 3.3.

The clock runs the work before pricing it (the model trains, its losses are checked, the GradScaler counts skipped
steps: step_stats needs them), so the real part (metric evaluations, numerics, Optuna) costs this CPU's time, and
the replayed part is summed here: autoprec's "where the time went" (timing.Stopwatch) reads the real perf_counter.
Counted per run: whole steps the clock timed and their replayed seconds; every whole training step run
(Trainer.step, warm-ups, builds and the peak-memory steps included, priced noiseless); profile layer steps timed.

    python benchmarks/search_replay.py --trace benchmarks/traces/xeon-amx-2core/digits \
        --out results/replay-xeon-amx-2core/digits [--seeds 5] [--trials 30]

Each seed runs the search as it is (predict_speed on: trials predicted too slow are left untimed) and the "time
every trial" reference (SearchConfig(predict_speed=False)) on the same sampler seed and noise seed. Writes
<out>/runs.csv and <out>/summary.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_header  # noqa: E402

from autoprec.apply import applied_policy  # noqa: E402
from autoprec.formats import Format  # noqa: E402
from autoprec.policy import ROOT  # noqa: E402
from autoprec.tune import SearchConfig, load_space, load_task, prepare  # noqa: E402
from autoprec.tune._core._records import Measured  # noqa: E402
from autoprec.tune._core._space import SearchSpace  # noqa: E402
from autoprec.tune._core._tables import markdown_table  # noqa: E402
from autoprec.tune._measure import _timing as timing  # noqa: E402
from autoprec.tune._measure._speed import format_of  # noqa: E402
from autoprec.tune._measure._trainer import Trainer, policy_model  # noqa: E402
from autoprec.tune._search import _pipeline as pipeline  # noqa: E402

IQR_PER_SIGMA = 1.349  # a normal's interquartile range in sigmas
MAX_SPREAD = 1.05  # --max-spread's default: the final re-measure's widest recorded spread (1.03), rounded up
MIN_RATIO = 0.05  # the ground-truth model's floor on step / fp32 step (a fit extrapolated that far means nothing)
# the trace's model.py where the trace folder does not hold one (trace folder name -> path)
MODELS = {"digits": ROOT_DIR / "examples" / "digits" / "model.py"}


# ---- the recorded device -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    """One recorded whole-step timing: the policy's step / the fp32 step timed beside it, its spread, its rounds."""

    ratio: float
    spread: float
    rounds: int


@dataclasses.dataclass(frozen=True)
class Trace:
    """A trace's step times: per layer shape and format the profile's (ms, spread); per policy key (root format, then
    each layer's, in `layers` order) its trial timings and its final re-measure's; the fp32 step ms (re-measured)."""

    layers: tuple[str, ...]
    layer_ms: Mapping[tuple[str, str], tuple[float, float]]  # (shape, format) -> (ms, spread)
    shape_of: Mapping[str, str]
    trials: Mapping[tuple[str, ...], tuple[Point, ...]]  # each timed trial (repeats, which reuse one, not again)
    finalists: Mapping[tuple[str, ...], Point]  # the final re-measure: one interleaved run, more rounds
    fp32_ms: float
    budget: float
    n_trials: int
    profile_formats: tuple[str, ...] = ()  # every format profile.csv has a row for

    @classmethod
    def load(cls, folder: Path) -> Trace:
        prof = pd.read_csv(folder / "profile.csv")
        trials = pd.read_csv(folder / "trials.csv")
        finals = pd.read_csv(folder / "finalists.csv")
        measured = json.loads((folder / "policy.json").read_text(encoding="utf-8"))["measured"]
        layers = tuple(dict.fromkeys(prof["layer"]))
        shape_of = {str(r.layer): str(r.shape) for r in prof.itertuples()}
        layer_ms = {}
        for r in prof.itertuples():
            if isinstance(r.time_ms, float) and math.isfinite(r.time_ms):
                spread = r.time_spread if math.isfinite(r.time_spread) else 0.0  # probed only (grossly slow): one number
                layer_ms[(str(r.shape), str(r.format))] = (float(r.time_ms), float(spread))
        columns = ["(default)", *layers]
        timed: dict[tuple[str, ...], list[Point]] = {}
        for r in trials.to_dict("records"):
            fresh = not (isinstance(r.get("reused_from"), float) and math.isfinite(r["reused_from"]))
            step, fp32, rounds = r.get("step_ms", math.nan), r.get("fp32_step_ms", math.nan), r.get("rounds") or 0
            if fresh and rounds > 0 and math.isfinite(step) and math.isfinite(fp32):
                timed.setdefault(tuple(str(r[c]) for c in columns), []).append(Point(step / fp32, r["spread"], int(rounds)))
        fp32_ms = float(finals[finals["candidate"] == "fp32"].iloc[0]["step_ms"])
        by_trial = {
            int(r["trial"]): tuple(str(r[c]) for c in columns) for r in trials.to_dict("records") if r["state"] == "COMPLETE"
        }
        finalists = {}
        for r in finals.itertuples():
            key = _finalist_key(str(r.candidate), layers, by_trial, prof)
            if key is not None:
                finalists[key] = Point(float(r.step_ms) / fp32_ms, float(r.spread), int(r.rounds))
        return cls(layers, layer_ms, shape_of, {k: tuple(v) for k, v in timed.items()}, finalists, fp32_ms,
                   float(measured["budget"]), len(trials), tuple(dict.fromkeys(map(str, prof["format"]))))  # fmt: skip

    @property
    def formats(self) -> set[str]:
        """Every format the trace names: the profile's (timed or not) and the policies'."""
        named = {f for _, f in self.layer_ms} | {f for k in [*self.trials, *self.finalists] for f in k}
        return named | set(self.profile_formats)

    def points(self) -> list[tuple[tuple[str, ...], Point]]:
        return [(k, p) for k, ps in self.trials.items() for p in ps] + list(self.finalists.items())


def _finalist_key(name: str, layers: tuple[str, ...], by_trial: Mapping[int, tuple[str, ...]], prof: pd.DataFrame):
    """finalists.csv's candidate name as a policy key (None where it cannot be read back)."""
    if name == "fp32":
        return ("fp32",) * (len(layers) + 1)
    if name == "uniform bf16":
        return ("bf16",) * (len(layers) + 1)
    if (
        name == "profile greedy"
    ):  # _choices.greedy_policy as a speed search prices it: a bf16 root, each layer's fastest format kept (no drop here)
        kept = prof[prof["metric_source"].fillna("").str.match("measured|predicted") & prof["time_ms"].notna()]
        fastest = {layer: str(rows.loc[rows["time_ms"].idxmin(), "format"]) for layer, rows in kept.groupby("layer")}
        return ("bf16", *(fastest.get(n, "fp32") for n in layers))
    if name.startswith("trial "):
        number, _, change = name[len("trial ") :].partition(", ")
        key = by_trial.get(int(number))
        if key is None:
            return None
        if change == "fp16/fp8 -> bf16":
            key = tuple("bf16" if f == "fp16" or f.startswith("fp8") else f for f in key)
        elif change:
            return None
        return key
    return None


RECORDED = ("finalists", "all", "none")  # --recorded: whose recorded medians are served as they are


@dataclasses.dataclass(frozen=True)
class Truth:
    """The replayed device's noiseless step times: a recorded median where `recorded` says so, else the fitted model

        1 - step / fp32 step = per_ms * saving + root[root format] - per_fp32_root_layer * (layers lowered under an fp32 root)

    (saving: the profile's summed layer saving in ms), fitted by least squares to every recorded timing, each weighted
    by its rounds. The last term is what the trace shows on a CPU: under an fp32 root every lowered layer casts its
    output back to fp32, and those trials ran slower than fp32 however much the layers saved."""

    trace: Trace
    per_ms: float
    root: Mapping[str, float]
    per_fp32_root_layer: float
    fallback_spread: float
    recorded: Mapping[tuple[str, ...], Point]

    @classmethod
    def fit(cls, trace: Trace, recorded: str = "finalists") -> Truth:
        if recorded not in RECORDED:
            raise ValueError(f"recorded must be one of {', '.join(RECORDED)}, but got {recorded!r}")
        points = trace.points()
        roots = sorted({k[0] for k, _ in points} - {"fp32"})
        x = np.array([cls.features(trace, k, roots) for k, _ in points])
        y = np.array([1.0 - p.ratio for _, p in points])
        w = np.sqrt(np.array([p.rounds for _, p in points], dtype=float))
        coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        spreads = [p.spread for _, p in points if math.isfinite(p.spread)]
        served: dict[tuple[str, ...], Point] = {}
        if recorded == "all":
            for k, ps in trace.trials.items():  # the median over its trials
                served[k] = Point(statistics.median(p.ratio for p in ps), statistics.median(p.spread for p in ps),
                                  sum(p.rounds for p in ps))  # fmt: skip
        if recorded != "none":
            served.update(trace.finalists)
        return cls(trace, float(coef[0]), {"fp32": 0.0, **dict(zip(roots, map(float, coef[1:-1])))}, -float(coef[-1]),
                   statistics.median(spreads), served)  # fmt: skip

    @staticmethod
    def saving(trace: Trace, key: tuple[str, ...]) -> float:
        """The profile's summed layer saving over fp32 in ms (per-layer fp32 time - format time)."""
        total = 0.0
        for name, fmt in zip(trace.layers, key[1:]):
            shape = trace.shape_of[name]
            base, this = trace.layer_ms.get((shape, "fp32")), trace.layer_ms.get((shape, fmt))
            if base is not None and this is not None:
                total += base[0] - this[0]
        return total

    @classmethod
    def features(cls, trace: Trace, key: tuple[str, ...], roots: list[str]) -> list[float]:
        lowered_fp32_root = sum(f != "fp32" for f in key[1:]) if key[0] == "fp32" else 0
        return [cls.saving(trace, key), *(1.0 if key[0] == r else 0.0 for r in roots), float(lowered_fp32_root)]

    def modelled_ratio(self, key: tuple[str, ...]) -> float:
        lowered_fp32_root = sum(f != "fp32" for f in key[1:]) if key[0] == "fp32" else 0
        gain = (
            self.per_ms * self.saving(self.trace, key) + self.root.get(key[0], 0.0) - self.per_fp32_root_layer * lowered_fp32_root
        )
        return max(MIN_RATIO, 1.0 - gain)

    def ratio(self, key: tuple[str, ...]) -> float:
        found = self.recorded.get(key)
        return found.ratio if found is not None else self.modelled_ratio(key)

    def step_ms(self, key: tuple[str, ...]) -> float:
        return self.trace.fp32_ms * self.ratio(key)

    def spread(self, key: tuple[str, ...]) -> float:
        """Its recorded spread (the final re-measure's, else the median over its trials), else the median of all."""
        found = self.trace.finalists.get(key)
        if found is not None:
            return found.spread
        timed = self.trace.trials.get(key)
        return statistics.median(p.spread for p in timed) if timed else self.fallback_spread


# ---- the clock ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    whole_timed: int = 0  # whole training steps the clock timed
    whole_timed_s: float = 0.0  # their replayed seconds (with noise)
    final_timed: int = 0  # of them, in the final re-measure (pipeline.final_remeasure)
    final_timed_s: float = 0.0
    whole_run: int = 0  # every whole training step run (Trainer.step): warm-ups, builds, peak memory too
    whole_run_s: float = 0.0  # their replayed seconds (noiseless for the ones the clock did not time)
    layer_timed: int = 0  # profile layer steps the clock timed
    layer_timed_s: float = 0.0
    other: int = 0  # calls whose model was neither (priced 0)


class ReplayClock:
    """A timing.Clock that runs the work and prices it by the trace (see the module's docstring)."""

    def __init__(self, truth: Truth, user_model: type, *, seed: int, noise: float = 1.0, max_spread: float = MAX_SPREAD):
        self.truth, self.user_model, self.noise, self.max_spread = truth, user_model, noise, max_spread
        self.rng = np.random.default_rng(seed)
        self.tally = Tally()
        self.timing = False  # inside time(): Trainer.step's count leaves these to the clock's own
        self.final = False  # inside the final re-measure

    def key(self, model: torch.nn.Module) -> tuple[str, ...]:
        policy = applied_policy(model)
        if policy is None:
            return ("fp32",) * (len(self.truth.trace.layers) + 1)
        root = policy.layers.get(ROOT, Format.FP32).value
        return (root, *(format_of(policy, name).value for name in self.truth.trace.layers))

    def price_ms(self, model: torch.nn.Module | None) -> tuple[str, float, float]:
        """(kind, noiseless ms, spread) of one call on `model`."""
        if model is not None and isinstance(model, self.user_model):
            key = self.key(model)
            return "whole", self.truth.step_ms(key), self.truth.spread(key)
        layer = getattr(model, "layer", None) if model is not None else None
        weight = getattr(layer, "weight", None)
        if model is not None and isinstance(weight, torch.Tensor):
            policy = applied_policy(model)
            fmt = format_of(policy, "layer").value if policy is not None else "fp32"
            shape = "x".join(map(str, weight.shape))
            found = self.truth.trace.layer_ms.get((shape, fmt)) or self.truth.trace.layer_ms.get((shape, "fp32"))
            if found is not None:
                return "layer", found[0], found[1]
        return "other", 0.0, 0.0

    def time(self, work: Callable[[], object], calls: int, device: torch.device) -> float:
        self.timing = True
        try:
            for _ in range(calls):
                work()
        finally:
            self.timing = False
        kind, ms, spread = self.price_ms(getattr(work, "model", None))
        sigma = self.noise * min(spread, self.max_spread) / IQR_PER_SIGMA
        seconds = float(np.sum(ms * np.exp(self.rng.normal(0.0, sigma, calls)))) / 1e3 if sigma > 0 else ms * calls / 1e3
        if kind == "whole":
            self.tally.whole_timed += calls
            self.tally.whole_timed_s += seconds
            if self.final:
                self.tally.final_timed += calls
                self.tally.final_timed_s += seconds
            self.tally.whole_run_s += seconds
        elif kind == "layer":
            self.tally.layer_timed += calls
            self.tally.layer_timed_s += seconds
        else:
            self.tally.other += calls
        return seconds

    def step_run(self, trainer: Trainer) -> None:
        """Trainer.step's count: every whole step; those outside time() are priced noiseless."""
        self.tally.whole_run += 1
        if not self.timing:
            self.tally.whole_run_s += self.price_ms(trainer.model)[1] / 1e3


@contextlib.contextmanager
def replaying(clock: ReplayClock) -> Iterator[None]:
    """timing.CLOCK is `clock`, every Trainer.step is counted by it, and it knows when the final re-measure runs
    (pipeline.final_remeasure), inside; all restored after."""
    before, step, final = timing.CLOCK, Trainer.step, pipeline.final_remeasure

    def counted(self: Trainer, batch_index: int | None = None) -> torch.Tensor:
        clock.step_run(self)
        return step(self, batch_index)

    def final_phase(*args: Any, **kwargs: Any) -> Any:
        clock.final = True
        try:
            return final(*args, **kwargs)
        finally:
            clock.final = False

    timing.CLOCK, Trainer.step, pipeline.final_remeasure = clock, counted, final_phase  # type: ignore[method-assign]
    try:
        yield
    finally:
        timing.CLOCK, Trainer.step, pipeline.final_remeasure = before, step, final  # type: ignore[method-assign]


# ---- the runs -------------------------------------------------------------------------------------------------------


def replay_space(trace: Trace) -> SearchSpace:
    """This repository's default space (its own file: an editable install may resolve the package's to another
    checkout), narrowed to the formats the trace recorded: one it never timed has no price on the replayed device."""
    space = load_space(ROOT_DIR / "search_spaces" / "default.yaml")
    traced = set(trace.formats)
    layers = {t: tuple(f for f in fs if f.value in traced) for t, fs in space.layers.items()}
    dropped = sorted({f.value for fs in space.layers.values() for f in fs} - traced)
    if dropped:
        print(f"the replay offers no {', '.join(dropped)}: the trace did not record them", file=sys.stderr)
    return dataclasses.replace(space, layers=layers, default=tuple(f for f in space.default if f.value in traced))


def run_one(
    model_py: Path,
    truth: Truth,
    *,
    seed: int,
    every: bool,
    trials: int,
    noise: float,
    max_spread: float,
    keep: Path | None = None,
) -> dict:
    """One search under the replay; its answer, its cost and the trial counts. `keep`: a folder for its files."""
    workload = prepare(load_task(model_py), torch.device("cpu"))
    clock = ReplayClock(truth, type(workload.model), seed=seed, noise=noise, max_spread=max_spread)
    config = SearchConfig(budget=truth.trace.budget, trials=trials, seed=seed, progress=False, predict_speed=not every)
    with tempfile.TemporaryDirectory(prefix="autoprec-replay-") as folder, replaying(clock):
        start = time.perf_counter()
        result = pipeline.search(workload, replay_space(truth.trace), config, keep or folder)
        wall = time.perf_counter() - start
    m = Measured.of(result.policy)
    key = clock.key(policy_model(workload, result.policy))
    t = result.trials
    done = t[t["state"] == "COMPLETE"]
    fresh = done[done["reused_from"].isna()] if "reused_from" in done else done
    timed = int((fresh["rounds"].fillna(0) > 0).sum())
    untimed = int(fresh["untimed"].notna().sum()) if "untimed" in fresh else 0
    tally = clock.tally
    return {
        "seed": seed, "search": "time every trial" if every else "as is", "chosen": m.chosen,
        "formats": " ".join(key), "true_step_ms": truth.step_ms(key), "true_speedup": 1 / truth.ratio(key),
        "recorded": key in truth.recorded, "spread": truth.spread(key),
        "measured_speedup": m.results["policy"].speedup if "policy" in m.results else math.nan,
        "whole_steps_timed": tally.whole_timed, "replayed_s_timed": tally.whole_timed_s,
        "trial_steps_timed": tally.whole_timed - tally.final_timed, "final_steps_timed": tally.final_timed,
        "replayed_s_final": tally.final_timed_s,
        "whole_steps_run": tally.whole_run, "replayed_s_run": tally.whole_run_s,
        "layer_steps_timed": tally.layer_timed, "replayed_s_layers": tally.layer_timed_s, "other_calls": tally.other,
        "trials": len(done), "trials_timed": timed, "trials_untimed": untimed, "trials_reused": len(done) - len(fresh),
        "real_s": wall,
    }  # fmt: skip


def optimum(truth: Truth, formats: Mapping[str, list[str]], roots: list[str]) -> tuple[tuple[str, ...], float]:
    """The truly fastest policy of the space (every one assumed within budget) and its step ms."""
    keys = [(root, *combo) for root in roots for combo in itertools.product(*(formats[n] for n in truth.trace.layers))]
    best = min(keys, key=truth.step_ms)
    return best, truth.step_ms(best)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="a trace folder, e.g. benchmarks/traces/xeon-amx-2core/digits")
    parser.add_argument("--out", type=Path, required=True, help="output folder, e.g. results/replay-xeon-amx-2core/digits")
    parser.add_argument("--model", type=Path, default=None, help="the traced model.py (default: the trace folder's, or "
                                                                 f"for {', '.join(MODELS)} the bundled example)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1: the sampler's and the noise's (default 5)")
    parser.add_argument("--seed-list", default=None, help="these seeds instead (comma-separated), e.g. to finish a cut run")
    parser.add_argument("--append", action="store_true", help="add to <out>/runs.csv's runs instead of replacing them")
    parser.add_argument("--trials", type=int, default=None, help="default: as many as the trace ran")
    parser.add_argument("--noise", type=float, default=1.0, help="the recorded spreads times this (0: noiseless)")
    parser.add_argument(
        "--max-spread",
        type=float,
        default=MAX_SPREAD,
        help=f"a recorded spread is capped at this (default {MAX_SPREAD}): the profile's 5-round IQRs reach "
        "3.3 (±165%%), which says more about 5 rounds than about the device",
    )
    parser.add_argument("--keep", action="store_true", help="keep each search's files under <out>/runs/")
    parser.add_argument(
        "--recorded",
        default="finalists",
        choices=RECORDED,
        help="whose recorded medians the replay serves as they are (the rest: the fitted model): the final "
        "re-measure's (default: 22 interleaved rounds), also each trial's (7 rounds beside an fp32 step that "
        "moved 5x under the load), or none",
    )
    parser.add_argument("--summary-only", action="store_true", help="rewrite <out>/summary.md from <out>/runs.csv, run nothing")
    parser.add_argument("--searches", default="as is,every", help="'as is' (the search), 'every' (time every trial), or both")
    args = parser.parse_args()
    model_py = args.model or (args.trace / "model.py" if (args.trace / "model.py").is_file() else MODELS.get(args.trace.name))
    if model_py is None or not Path(model_py).is_file():
        parser.error(f"--model: the trace {args.trace} holds no model.py and none is bundled for it; give the traced model.py")
    kinds = [k.strip() for k in args.searches.split(",") if k.strip()]
    if not kinds or any(k not in ("as is", "every") for k in kinds):
        parser.error(f"--searches: {args.searches!r}; valid: 'as is', 'every', or both comma-separated")
    truth = Truth.fit(Trace.load(args.trace), args.recorded)
    trials = args.trials or truth.trace.n_trials
    if args.summary_only:
        text = summarize(pd.read_csv(args.out / "runs.csv"), truth, args, trials, Path(model_py))
        (args.out / "summary.md").write_text(text, encoding="utf-8")
        print(text)
        return 0
    print_header("search replay: cost and answer on a recorded device", torch.device("cpu"))
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for x in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
    earlier = pd.read_csv(args.out / "runs.csv").to_dict("records") if args.append and (args.out / "runs.csv").is_file() else []
    rows: list[dict] = list(earlier)
    for seed in seeds:
        for kind in kinds:
            keep = args.out / "runs" / f"seed{seed}-{kind.replace(' ', '-')}" if args.keep else None
            r = run_one(
                Path(model_py),
                truth,
                seed=seed,
                every=kind == "every",
                trials=trials,
                noise=args.noise,
                max_spread=args.max_spread,
                keep=keep,
            )
            rows.append(r)
            pd.DataFrame(rows).to_csv(args.out / "runs.csv", index=False)  # each run as it ends: a long run cut short keeps them
            print(f"seed {seed}, {r['search']}: {r['chosen']} [{r['formats']}] true {r['true_step_ms']:.0f} ms, "
                  f"{r['whole_steps_timed']} whole steps timed, {r['real_s']:.0f} s real", file=sys.stderr)  # fmt: skip
    text = summarize(pd.DataFrame(rows), truth, args, trials, Path(model_py))
    (args.out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


def summarize(runs: pd.DataFrame, truth: Truth, args: argparse.Namespace, trials: int, model_py: Path) -> str:
    trace = truth.trace
    formats = {
        n: sorted({f for (s, f) in trace.layer_ms if s == trace.shape_of[n]} & {"fp32", "bf16", "fp16"}) for n in trace.layers
    }
    best, best_ms = optimum(truth, formats, ["fp32", "bf16"])
    ref = runs[runs["search"] == "time every trial"].set_index("seed")
    table = []
    for r in runs.to_dict("records"):
        same = "-"
        if r["search"] == "as is" and r["seed"] in ref.index:
            ref_ms, ref_spread = ref.loc[r["seed"], "true_step_ms"], ref.loc[r["seed"], "spread"]
            diff = f"{100 * (r['true_step_ms'] / ref_ms - 1):+.1f}%"
            if r["true_step_ms"] == ref_ms:
                same = "yes (same time)"
            elif abs(r["true_step_ms"] - ref_ms) <= ref_spread / 2 * ref_ms:
                same = f"within ±{50 * ref_spread:.0f}% ({diff})"
            else:
                same = f"no ({diff})"
        table.append([
            r["seed"], r["search"], r["chosen"], r["formats"], f"{r['true_step_ms']:.1f}", f"{r['true_speedup']:.3f}",
            f"{r['whole_steps_timed']} ({r['trial_steps_timed']} + {r['final_steps_timed']})", f"{r['replayed_s_timed']:.0f}",
            r["whole_steps_run"], f"{r['replayed_s_run']:.0f}",
            f"{r['trials_timed']}/{r['trials_untimed']}/{r['trials_reused']}", f"{r['real_s']:.0f}", same,
        ])  # fmt: skip
    means = []
    for kind, group in runs.groupby("search", sort=False):
        means.append([kind, len(group), f"{group['whole_steps_timed'].mean():.0f}",
                      f"{group['trial_steps_timed'].mean():.0f} + {group['final_steps_timed'].mean():.0f}",
                      f"{group['replayed_s_timed'].mean():.0f}",
                      f"{group['whole_steps_run'].mean():.0f}", f"{group['replayed_s_run'].mean():.0f}",
                      f"{group['true_step_ms'].mean():.1f}", f"{group['real_s'].mean():.0f}"])  # fmt: skip
    verdict = ""
    as_is, every = runs[runs["search"] == "as is"], runs[runs["search"] == "time every trial"]
    if len(as_is) and len(every):
        agree = sum(str(row[-1]).startswith(("yes", "within")) for row in table if row[1] == "as is")
        exact = sum(str(row[-1]).startswith("yes") for row in table if row[1] == "as is")
        steps = as_is["whole_steps_timed"].mean() / every["whole_steps_timed"].mean()
        verdict = (
            f"\n\nAs is against timing every trial: the same answer in {agree} of {len(as_is)} seeds ({exact} the same true "
            f"step time, the rest within the reference's spread); whole steps timed {steps:.2f}x the reference's "
            f"({as_is['whole_steps_timed'].mean():.0f} against {every['whole_steps_timed'].mean():.0f} on average), replayed "
            f"seconds in them {as_is['replayed_s_timed'].mean() / every['replayed_s_timed'].mean():.2f}x."
        )
    roots = ", ".join(f"{f} {100 * v:+.1f}%" for f, v in truth.root.items() if f != "fp32")
    noise = ("" if args.noise == 1.0 else f" --noise {args.noise:g}") + (
        "" if args.max_spread == MAX_SPREAD else f" --max-spread {args.max_spread:g}"
    )
    cmd = (f"python benchmarks/search_replay.py --trace {args.trace} --out {args.out} --seeds {runs['seed'].nunique()} "
           f"--trials {trials}{noise}" + (f" --recorded {args.recorded}" if args.recorded != "finalists" else ""))  # fmt: skip
    return (
        f"# Search replay: {trace.layers and args.trace.name}\n\n`{cmd}`\n\n"
        f"Model {model_py.relative_to(ROOT_DIR) if model_py.is_relative_to(ROOT_DIR) else model_py}, budget "
        f"{trace.budget:g}, {trials} trials. Step times replayed from `{args.trace}` (the recorded device); the real "
        f"part (profile numerics, metric evaluations, Optuna, the steps themselves, executed but priced by the trace) ran "
        f"on this machine: {measure_device()}, shared with other work (its real seconds vary with that load).\n\n"
        f"Replayed device: fp32 step {trace.fp32_ms:.1f} ms; {len(truth.recorded)} policies served as recorded "
        f"(--recorded {args.recorded}); the rest from 1 - step/fp32 = {truth.per_ms:.5f} x (summed layer saving, ms) + "
        f"root term ({roots}) - {truth.per_fp32_root_layer:.3f} x (layers lowered under an fp32 root), fitted to all "
        f"{len(trace.points())} recorded timings weighted by rounds; spreads capped at {args.max_spread:g}; unrecorded spread "
        f"{truth.fallback_spread:.2f}. True optimum of the space (every policy assumed within budget): "
        f"[{' '.join(best)}] {best_ms:.1f} ms ({trace.fp32_ms / best_ms:.3f}x).\n\n"
        + markdown_table(
            [
                "seed",
                "search",
                "chosen",
                "formats (root, layers)",
                "true step ms",
                "true speedup",
                "whole steps timed (trials + final)",
                "replayed s (timed)",
                "whole steps run",
                "replayed s (all steps)",
                "trials timed/untimed/reused",
                "real s",
                "same answer as timing every trial",
            ],
            table,
        )  # fmt: skip
        + "\n\n"
        + markdown_table(
            [
                "search",
                "runs",
                "mean whole steps timed",
                "of which trials + final",
                "mean replayed s (timed)",
                "mean whole steps run",
                "mean replayed s (all steps)",
                "mean true step ms",
                "mean real s",
            ],
            means,
        )  # fmt: skip
        + verdict
        + "\n\nwhole steps timed: training steps of the user's model the clock priced (the trials' and the final re-measure's "
        "rounds and block-sizing calls); whole steps run: every Trainer.step (warm-ups, the first step that builds a "
        "candidate, peak memory), the untimed ones priced without noise; same answer: the chosen policy's true step time "
        "equals the reference's (the same seed timing every trial), or is within the reference's recorded spread (±spread/2).\n"
    )


def measure_device() -> str:
    """This CPU, with the bf16 instructions that decide its real steps' speed (Linux: /proc/cpuinfo's flags)."""
    from autoprec.formats import device_name

    flags: set[str] = set()
    with contextlib.suppress(OSError):
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
    bf16 = ", ".join(f for f in ("amx_bf16", "avx512_bf16", "amx_fp16") if f in flags) or "no bf16 instructions listed"
    return f"{device_name('cpu')} ({bf16}), {torch.get_num_threads()} threads, torch {torch.__version__}"


if __name__ == "__main__":
    raise SystemExit(main())
