"""A trial's speedup predicted from the profile's layer timings, so a search need not time a candidate that cannot be
among its answers.

The profile times each layer alone in each format. On one device, what a whole step saves over fp32 follows the
sum of its layers' savings closely but not one to one (the casts between formats, what autocast lowers outside
the layers, the optimizer's share), and lowering the model root (everything outside the layers) to a format adds
about a constant. Fitted by least squares on the trials the search has timed so far:

    fp32 step ms - step ms  =  c * sum over layers of (fp32 ms - format ms)  +  r[root format]  (r[fp32] = 0)

A candidate is left untimed (study.Objective) only where its root format was among the timed trials' and its
predicted speedup, raised by the fit's error (the worst leave-one-out miss on those trials, at least MARGIN), is
still below the k-th fastest timed trial: k faster candidates are re-measured at the end (study._finalist_mark).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from autoprec.formats import Format
from autoprec.policy import ROOT, Policy

MARGIN = 0.10  # the least relative error a prediction is granted, however well the fit went
MIN_FIT = 4  # timed trials with a layer lowered before a prediction is made


@dataclasses.dataclass(frozen=True)
class Features:
    """What a policy's step time is predicted from: its layers' summed saving over fp32 in ms, and its root's format."""

    saving_ms: float
    root: Format


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Per profiled layer and format, the milliseconds the format saves over fp32 in the layer's isolated step."""

    saving_ms: Mapping[str, Mapping[Format, float]]

    @classmethod
    def from_table(cls, rows: Sequence[Mapping[str, object]]) -> LayerTimes:
        """From the profile table's rows (layer, format, time_ms); a format without a finite time has no entry."""
        times: dict[str, dict[Format, float]] = {}
        for row in rows:
            ms = row.get("time_ms")
            if isinstance(ms, (int, float)) and math.isfinite(ms):
                times.setdefault(str(row["layer"]), {})[Format(str(row["format"]))] = float(ms)
        return cls({name: {f: t[Format.FP32] - ms for f, ms in t.items()} for name, t in times.items() if Format.FP32 in t})

    def features(self, policy: Policy) -> Features | None:
        """`policy`'s Features; None where a layer it lists runs in a format the profile has no time for. A layer
        that only inherits such a format (a root format autocast does not lower it to) runs in fp32: saves 0."""
        total = 0.0
        for name, savings in self.saving_ms.items():
            saving = savings.get(format_of(policy, name))
            if saving is None and name in policy.layers:
                return None
            total += saving or 0.0
        return Features(total, policy.layers.get(ROOT, Format.FP32))


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
    """The fitted saving per ms of summed layer saving (`per_ms`) and per lowered root format (`root_ms`); the fp32
    step (the trials' median); the worst relative miss of a speedup predicted for a trial left out of the fit."""

    per_ms: float
    root_ms: Mapping[Format, float]
    fp32_ms: float
    error: float

    def covers(self, features: Features) -> bool:
        """Whether the fit has seen this root format timed (a lowered one twice): it says nothing of another."""
        return features.root in self.root_ms

    def speedup(self, features: Features, fp32_ms: float | None = None) -> float:
        """The predicted speedup over fp32 (of a step of `fp32_ms`, default the trials' median)."""
        base = self.fp32_ms if fp32_ms is None else fp32_ms
        step = base - self.per_ms * features.saving_ms - self.root_ms.get(features.root, 0.0)
        return base / step if step > 0 else math.inf

    @property
    def margin(self) -> float:
        return max(MARGIN, self.error)


def _solve(points: Sequence[Timed]) -> SpeedFit | None:
    """The least-squares fit (error 0: not yet judged); None where the points cannot determine it (fewer distinct
    savings than two, a root format's term not separable from the saving's) or lowering layers saves nothing."""
    roots = sorted({t.features.root for t in points}, key=lambda f: f.value)
    lowered = [f for f in roots if f is not Format.FP32]
    x = np.array([[t.features.saving_ms] + [float(t.features.root is f) for f in lowered] for t in points], dtype=float)
    y = np.array([t.fp32_ms - t.step_ms for t in points], dtype=float)
    if len({t.features.saving_ms for t in points}) < 2 or np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    if not coef[0] > 0:
        return None
    root_ms = {Format.FP32: 0.0} if Format.FP32 in roots else {}
    root_ms.update({f: float(c) for f, c in zip(lowered, coef[1:])})
    return SpeedFit(float(coef[0]), root_ms, float(np.median([t.fp32_ms for t in points])), 0.0)


def fit(timed: Sequence[Timed]) -> SpeedFit | None:
    """Least squares on the timed trials, judged by leaving each one out in turn (the worst relative miss of its
    predicted speedup is the fit's error); None with fewer than MIN_FIT finite trials that lower a layer, or where
    the fit, or a fit without one of them, is not determined (_solve). A lowered root format timed once has its
    term rest on that trial alone: it is not judged, and not covered."""
    points = [t for t in timed if t.fp32_ms > 0 and t.step_ms > 0 and math.isfinite(t.fp32_ms) and math.isfinite(t.step_ms)]
    if sum(t.features.saving_ms != 0 for t in points) < MIN_FIT:
        return None
    whole = _solve(points)
    if whole is None:
        return None
    counts = Counter(t.features.root for t in points)
    judged = [i for i, t in enumerate(points) if t.features.root is Format.FP32 or counts[t.features.root] > 1]
    misses = []
    for i in judged:
        rest = _solve(points[:i] + points[i + 1 :])
        if rest is None:
            return None
        left_out = points[i]
        misses.append(abs(rest.speedup(left_out.features, left_out.fp32_ms) * left_out.step_ms / left_out.fp32_ms - 1))
    error = max(misses, default=math.inf)
    if not math.isfinite(error):
        return None
    covered = {f: ms for f, ms in whole.root_ms.items() if f is Format.FP32 or counts[f] > 1}
    return dataclasses.replace(whole, root_ms=covered, error=error)


def too_slow(timed: Sequence[Timed], features: Features | None, mark: float | None) -> tuple[float, SpeedFit] | None:
    """(predicted speedup, the fit) of a candidate not worth timing: `timed` fitted (fit), its root format among
    theirs, and even raised by the fit's margin it stays below `mark` (the k-th fastest timed trial's speedup);
    None where it must be timed (no features, no mark or fit yet, or it might be among the answers)."""
    if features is None or mark is None:
        return None
    speed_fit = fit(timed)
    if speed_fit is None or not speed_fit.covers(features):
        return None
    predicted = speed_fit.speedup(features)
    return (predicted, speed_fit) if predicted * (1 + speed_fit.margin) < mark else None
