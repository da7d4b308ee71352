"""A trial's speedup predicted from the profile's layer timings, so a search need not time a candidate that cannot be
among its answers, and knows when no untried policy can be.

The profile times each layer alone in each format. On one device, what a whole step saves over fp32 follows the
sum of its layers' savings, but not one to one and not alike for every format (the casts between formats, what
autocast lowers outside the layers, the optimizer's share; a layer's casts, whose cost an isolated layer shows
badly), and lowering the model root (everything outside the layers) to a format adds about a constant.
Fitted by least squares on the trials the search has timed so far:

    fp32 step ms - step ms  =  sum over terms t of c[t] * (the policy's summed layer saving in t)  +  r[root]

with one term for every lowered format, one per root format, or one per lowered format (MODELS): the one that
predicts the trials left out of it best, the simpler on a near tie (config.MODEL_TIE). A trial far slower than the fit (a
load spike during its timing) is left out of every model alike (config.OUTLIER, _outliers). A
format or lowered root format seen in fewer than two timed trials has its term rest on one: such trials stay out of
the fit and a policy using it is not predicted (SpeedFit.covers). The fit's error is the most a trial left out of
the fit ran FASTER than predicted (at least config.MARGIN): a prediction raised by it is what no candidate is expected to
beat.

A candidate is left untimed (objective.Objective) where, raised by that error, it is still below the k-th fastest
timed trial: k faster candidates are re-measured at the end (trials.finalist_mark). The search stops (`ceiling`)
once no untried policy, raised so, can beat the best timed trial beyond that trial's own half-spread (and, on a
device too noisy for a trial's timing to rank policies, once that noise is read: objective.Objective.should_stop).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._core._config import MARGIN, MIN_FIT, MODEL_TIE, OUTLIER, OUTLIER_SHARE
from autoprec.tune._measure._timing import may_beat, spread_text

if TYPE_CHECKING:
    from autoprec.tune._core._profile_row import ProfileRow

ALL = "all"  # the one term of Features made without a split per format


@dataclasses.dataclass(frozen=True)
class Features:
    """What a policy's step time is predicted from: its layers' summed saving over fp32 in ms, its root's format,
    and the saving split per lowered format (empty: one term for all of it)."""

    saving_ms: float
    root: Format
    by_format: tuple[tuple[Format, float], ...] = ()

    def terms(self) -> dict[str, float]:
        """The saving per fitted term: per lowered format in the policy (a layer saving nothing still names its
        format: the fit must have seen it), else ALL."""
        if self.by_format:
            return {f.value: ms for f, ms in self.by_format}
        return {ALL: self.saving_ms} if self.saving_ms != 0 else {}


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Per profiled layer and format, the milliseconds the format saves over fp32 in the layer's isolated step."""

    saving_ms: Mapping[str, Mapping[Format, float]]

    @classmethod
    def from_rows(cls, rows: Iterable[ProfileRow]) -> LayerTimes:
        """From a profile's rows (layer, format, time_ms); a format without a finite time has no entry."""
        times: dict[str, dict[Format, float]] = {}
        for row in rows:
            if math.isfinite(row.time_ms):
                times.setdefault(row.layer, {})[Format(row.format)] = float(row.time_ms)
        return cls({name: {f: t[Format.FP32] - ms for f, ms in t.items()} for name, t in times.items() if Format.FP32 in t})

    def features(self, policy: Policy) -> Features | None:
        """`policy`'s Features; None where a layer it lists runs in a format the profile has no time for. A layer
        that only inherits such a format is counted as saving nothing: mostly a root format autocast does not lower
        it to, so it runs fp32 (where its timing failed instead, the fit's error absorbs the difference)."""
        total, by_format = 0.0, dict[Format, float]()
        for name, savings in self.saving_ms.items():
            fmt = format_of(policy, name)
            saving = savings.get(fmt)
            if saving is None and name in policy.layers:
                return None
            if saving is not None and fmt is not Format.FP32:
                by_format[fmt] = by_format.get(fmt, 0.0) + saving
            total += saving or 0.0
        return Features(total, policy.layers.get(ROOT, Format.FP32), tuple(sorted(by_format.items(), key=lambda i: i[0].value)))


def format_of(policy: Policy, name: str) -> Format:
    """The format `name` runs in under `policy`: its own entry, else its nearest listed parent's, else the root's
    (fp32 where the policy has none). By name, where apply_policy goes by module object: a search's policies list
    every searched layer by its own name."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        fmt = policy.layers.get(".".join(parts[:cut]))
        if fmt is not None:
            return fmt
    return policy.layers.get(ROOT, Format.FP32)


@dataclasses.dataclass(frozen=True)
class Timed:
    """A trial as timed: its Features, the fp32 baseline's and its own step ms."""

    features: Features
    fp32_ms: float
    step_ms: float


@dataclasses.dataclass(frozen=True)
class SpeedFit:
    """The fitted saving per ms of summed layer saving, per term of its `model` (`per_ms`: see _columns) and per
    lowered root format (`root_ms`); the fp32 step (the trials' median); the worst relative amount by which a
    trial left out of the fit ran faster than predicted; the trials left out as outliers; the terms (lowered formats)
    the fit has seen timed twice, which alone it predicts for (`seen`; default per_ms's)."""

    per_ms: Mapping[str, float]
    root_ms: Mapping[Format, float]
    fp32_ms: float
    error: float
    outliers: int = 0
    model: Model = "format"
    seen: frozenset[str] | None = None

    def covers(self, features: Features) -> bool:
        """Whether the fit has seen this root format and every lowered format timed (each twice): it says nothing
        of another."""
        seen = self.seen if self.seen is not None else frozenset(self.per_ms)
        return (
            features.root in self.root_ms
            and all(term in seen for term in features.terms())
            and all(term in self.per_ms for term in _columns(features, self.model))
        )

    def speedup(self, features: Features, fp32_ms: float | None = None) -> float:
        """The predicted speedup over fp32 (of a step of `fp32_ms`, default the trials' median)."""
        base = self.fp32_ms if fp32_ms is None else fp32_ms
        saved = sum(self.per_ms.get(term, 0.0) * ms for term, ms in _columns(features, self.model).items())
        step = base - saved - self.root_ms.get(features.root, 0.0)
        return base / step if step > 0 else math.inf

    @property
    def margin(self) -> float:
        return max(MARGIN, self.error)


def _covered(points: Sequence[Timed]) -> list[Timed]:
    """The points whose every term (lowered format, lowered root) is seen in at least two of them, repeatedly
    (leaving one out may leave another term alone)."""
    while True:
        counts = Counter(term for t in points for term in (*t.features.terms(), ("root", t.features.root)))
        kept = [
            t
            for t in points
            if all(counts[term] >= 2 for term in t.features.terms())
            and (t.features.root is Format.FP32 or counts[("root", t.features.root)] >= 2)
        ]
        if len(kept) == len(points):
            return kept
        points = kept


Model = Literal["all", "root", "format"]
MODELS: tuple[Model, ...] = ("all", "root", "format")  # fit's models, simplest first (MODEL_TIE)


def _columns(features: Features, model: Model) -> dict[str, float]:
    """A policy's savings per fitted term under `model`: "format", one per lowered format (Features.terms); "all",
    one for all of them; "root", one for all of them per root format (under an fp32 root each lowered layer casts its
    inputs and outputs, under a lowered root they are in its format already)."""
    terms = features.terms()
    if model == "format" or not terms:
        return terms
    return {ALL if model == "all" else f"{ALL} under {features.root.value}": features.saving_ms}


def _design(points: Sequence[Timed], model: Model) -> tuple[np.ndarray, np.ndarray, list[str], list[Format]]:
    """The least-squares problem: a column per term's saving (_columns) and one per lowered root format; the
    savings."""
    columns = [_columns(t.features, model) for t in points]
    terms = sorted({term for c in columns for term in c})
    lowered = sorted({t.features.root for t in points} - {Format.FP32}, key=lambda f: f.value)
    rows = [
        [c.get(term, 0.0) for term in terms] + [float(t.features.root is f) for f in lowered] for t, c in zip(points, columns)
    ]
    x = np.array(rows, dtype=float).reshape(len(points), len(terms) + len(lowered))
    return x, np.array([t.fp32_ms - t.step_ms for t in points], dtype=float), terms, lowered


def _solve(points: Sequence[Timed], model: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[Format]] | None:
    """(x, y, coefficients, terms, lowered roots), or None where the points cannot determine them."""
    x, y, terms, lowered = _design(points, model)
    if not terms or np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    return x, y, np.linalg.lstsq(x, y, rcond=None)[0], terms, lowered


def fit(timed: Sequence[Timed]) -> SpeedFit | None:
    """Least squares on the timed trials, outliers left out (_outliers), judged by leaving each one out in turn
    (closed form: the fit without trial i misses it by e_i / (1 - h_ii)); its error is the most a trial left out
    ran faster than its prediction, as actual over predicted speedup. Of three models (MODELS: one term for every
    lowered format, one per root format, one per lowered format), the one that predicts the trials left out best,
    the simpler on a near tie, each fitted and judged on the same trials: on a noisy device a term per format follows
    the noise, and its predictions for the policies between the trials swing far. None with fewer than MIN_FIT finite
    trials that lower a layer, or where the trials, or all but one of them, cannot determine any model (fewer than
    two distinct savings, a root format's term not separable from the layers')."""
    points = [t for t in timed if t.fp32_ms > 0 and t.step_ms > 0 and math.isfinite(t.fp32_ms) and math.isfinite(t.step_ms)]
    points = _covered(points)
    if sum(bool(t.features.terms()) for t in points) < MIN_FIT:
        return None
    # with one format, a term per format is the one for all
    models: tuple[Model, ...] = MODELS if len({term for t in points for term in t.features.terms()}) > 1 else ("format", "root")
    kept, outliers = _outliers(points, models)
    fits = [found for found in (_fit(kept, model) for model in models) if found is not None]
    if not fits and outliers:  # none fits the rest: every trial stays in
        kept, outliers = points, 0
        fits = [found for found in (_fit(kept, model) for model in models) if found is not None]
    if not fits:
        return None
    best = min(accuracy for _, accuracy in fits)
    # the simplest whose accuracy is about the best's (as cross-validation's one-standard-error rule prefers)
    speed_fit = next(f for f, accuracy in fits if accuracy <= best * (1 + MODEL_TIE) + 1e-12)
    seen = frozenset(term for t in kept for term in t.features.terms())  # the formats the fit has seen, twice
    return dataclasses.replace(speed_fit, outliers=outliers, seen=seen)


def _outliers(points: Sequence[Timed], models: Sequence[Model]) -> tuple[list[Timed], int]:
    """The trials every model is fitted on, and how many were left out: those that ran slower than the model predicting
    the trials best (the median of its leave-one-out misses, which a spike barely moves; the simpler on a tie)
    predicts them without them, by OUTLIER robust standard deviations (a load spike), unless they are more than
    OUTLIER_SHARE of the trials or too few are left (fit keeps them all where no model fits the rest). Left out of
    every model alike, each is judged on the same trials; left out by its leave-one-out miss, a spike a model with a
    term to spare would absorb is found too."""
    best: tuple[float, set[int]] | None = None
    for model in models:
        solved = _solve(points, model)
        if solved is None:
            continue
        x, y, coef, _, _ = solved
        leverage = _leverage(x)
        if leverage.max() > 1 - 1e-9:  # the others cannot determine the fit
            continue
        miss = (y - x @ coef) / (1 - leverage)  # the saving measured minus the one predicted without the trial
        score = float(np.median(np.abs(miss)))
        if best is not None and score >= best[0]:
            continue
        scale = 1.4826 * float(np.median(np.abs(miss - np.median(miss))))
        # only a trial that ran slower: load slows a step down, never up, and one that ran faster is the fit's error
        best = (score, {i for i in range(len(points)) if scale > 0 and miss[i] < -OUTLIER * scale})
    if best is None or not best[1] or len(best[1]) > OUTLIER_SHARE * len(points):
        return list(points), 0
    kept = _covered([t for i, t in enumerate(points) if i not in best[1]])
    if sum(bool(t.features.terms()) for t in kept) < MIN_FIT:
        return list(points), 0
    return kept, len(points) - len(kept)


def _leverage(x: np.ndarray) -> np.ndarray:
    """Each row's leverage in the least-squares fit of x (the diagonal of the hat matrix)."""
    return np.einsum("ij,jk,ik->i", x, np.linalg.pinv(x.T @ x), x)


def _fit(points: Sequence[Timed], model: Model) -> tuple[SpeedFit, float] | None:
    """fit's `model` on `points` and its leave-one-out accuracy (the root mean square of the log of predicted over
    actual step); None where the points cannot determine it."""
    solved = _solve(points, model)
    if solved is None:
        return None
    x, y, coef, terms, lowered = solved
    residual = y - x @ coef
    leverage = _leverage(x)
    misses, logs = [], []
    for i, t in enumerate(points):
        if leverage[i] > 1 - 1e-9:  # the others cannot determine the fit
            return None
        predicted_step = t.fp32_ms - (y[i] - residual[i] / (1 - leverage[i]))
        if predicted_step <= 0:
            return None
        misses.append(max(0.0, predicted_step / t.step_ms - 1))  # actual speedup / predicted - 1, where it ran faster
        logs.append(math.log(predicted_step / t.step_ms))
    if not misses or not all(math.isfinite(m) for m in misses):
        return None
    root_ms = {Format.FP32: 0.0} if any(t.features.root is Format.FP32 for t in points) else {}
    root_ms.update({f: float(c) for f, c in zip(lowered, coef[len(terms) :])})
    per_ms = {term: float(c) for term, c in zip(terms, coef)}
    fp32_ms = float(np.median([t.fp32_ms for t in points]))
    accuracy = math.sqrt(sum(v * v for v in logs) / len(logs))
    return SpeedFit(per_ms, root_ms, fp32_ms, max(misses), model=model), accuracy


def too_slow(timed: Sequence[Timed], features: Features | None, mark: float | None) -> tuple[float, SpeedFit] | None:
    """(predicted speedup, the fit) of a candidate not worth timing: `timed` fitted (fit), its formats covered
    (SpeedFit.covers), and even raised by the fit's margin it stays below `mark` (the k-th fastest timed trial's speedup);
    None where it must be timed (no features, no mark or fit yet, or it might be among the answers)."""
    if features is None or mark is None:
        return None
    speed_fit = fit(timed)
    if speed_fit is None or not speed_fit.covers(features):
        return None
    predicted = speed_fit.speedup(features)
    return (predicted, speed_fit) if predicted * (1 + speed_fit.margin) < mark else None


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """Why the search may stop: no untried policy's predicted speedup, raised by the fit's margin (as too_slow raises
    a candidate), is beyond the best timed trial's raised by its half-spread."""

    predicted: float
    margin: float
    best: float
    noise: float
    untried: int

    def describe(self) -> str:
        return (
            f"none of the {self.untried} untried policies can beat the best timed trial ({self.best:.3f}x, spread "
            f"{spread_text(2 * self.noise)}) beyond half its spread: the fastest is predicted {self.predicted:.3f}x, "
            f"+{self.margin:.0%} the fit's error"
        )


def ceiling(timed: Sequence[Timed], untried: Iterable[Features | None], best: tuple[float, float]) -> Ceiling | None:
    """A Ceiling where no untried policy, its prediction from the fit of `timed` raised by the fit's margin, can beat
    `best` (the best timed trial within budget: its speedup and spread) raised by its half-spread; None where one
    might (or the fit, or a prediction for one of them, is missing: a policy the fit cannot predict might be the
    fastest, and with none untried there is nothing to rule on)."""
    speed_fit = fit(timed)
    if speed_fit is None:
        return None
    best_speedup, spread = best
    noise = spread / 2 if math.isfinite(spread) else 0.0
    fastest, count = 0.0, 0
    for features in untried:
        if features is None or not speed_fit.covers(features):
            return None
        fastest, count = max(fastest, speed_fit.speedup(features)), count + 1
    if not count or may_beat(fastest, speed_fit.margin, best_speedup, noise):
        return None
    return Ceiling(fastest, speed_fit.margin, best_speedup, noise, count)
