"""A trial's speedup predicted from the profile's layer timings, so a search need not time a candidate that cannot be
a finalist.

The profile times each layer alone in each format. On one device, what a whole step saves over fp32 follows the
sum of its layers' savings closely but not one to one (the casts between formats, what autocast lowers outside
the layers, the optimizer's share), and lowering the model root (everything outside the layers) adds about a
constant. Fitted by least squares on the trials the search has timed so far:

    fp32 step ms - step ms  =  c * sum over layers of (fp32 ms - format ms)  +  r * (root lowered)

A candidate is left untimed (study.Objective) only where its root setting was timed and its predicted speedup, raised
by the fit's worst relative error on those trials (at least MARGIN), is still below the k-th fastest timed trial: k
faster candidates are re-measured at the end (study._finalist_mark).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from autoprec.formats import Format
from autoprec.policy import ROOT, Policy

MARGIN = 0.10  # the least relative error a prediction is granted, however well the fit went
MIN_FIT = 4  # timed trials with a layer lowered before a prediction is made


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

    def features(self, policy: Policy) -> tuple[float, float] | None:
        """(the layers' summed saving in ms, 1 if the root is lowered else 0) for `policy`; None where one of its
        layers runs in a format the profile has no time for."""
        total = 0.0
        for name, savings in self.saving_ms.items():
            saving = savings.get(format_of(policy, name))
            if saving is None:
                return None
            total += saving
        return total, float(policy.layers.get(ROOT, Format.FP32) is not Format.FP32)


def format_of(policy: Policy, name: str) -> Format:
    """The format `name` runs in under `policy`: its own entry, else its nearest listed parent's, else the root's
    (fp32 where the policy has none)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        fmt = policy.layers.get(".".join(parts[:cut]))
        if fmt is not None:
            return fmt
    return policy.layers.get(ROOT, Format.FP32)


@dataclasses.dataclass(frozen=True)
class Timed:
    """A trial as timed: its features (LayerTimes.features), the fp32 baseline's and its own step ms."""

    features: tuple[float, float]
    fp32_ms: float
    step_ms: float


@dataclasses.dataclass(frozen=True)
class SpeedFit:
    """The fitted saving per ms of summed layer saving (`per_ms`) and for a lowered root (`root_ms`); the fp32 step
    (median of the trials' baselines); the worst relative error of the fitted speedups on those trials."""

    per_ms: float
    root_ms: float
    fp32_ms: float
    error: float
    roots: frozenset[float] = frozenset({0.0, 1.0})  # the root settings timed: the fit says nothing of another

    def covers(self, features: tuple[float, float]) -> bool:
        return features[1] in self.roots

    def speedup(self, features: tuple[float, float], fp32_ms: float | None = None) -> float:
        """The predicted speedup over fp32 (of a step of `fp32_ms`, default the trials' median)."""
        base = self.fp32_ms if fp32_ms is None else fp32_ms
        step = base - self.per_ms * features[0] - self.root_ms * features[1]
        return base / step if step > 0 else math.inf

    @property
    def margin(self) -> float:
        return max(MARGIN, self.error)


def fit(timed: Sequence[Timed]) -> SpeedFit | None:
    """Least squares on the timed trials (the root term wherever a lowered root was timed: with only such trials it is
    the constant part); None with fewer than MIN_FIT trials that lower a layer, or where the fit says lowering layers
    does not save time (nothing to predict)."""
    points = [t for t in timed if t.fp32_ms > 0 and t.step_ms > 0 and math.isfinite(t.step_ms)]
    if sum(t.features[0] != 0 for t in points) < MIN_FIT:
        return None
    roots = frozenset(t.features[1] for t in points)
    x = np.array([t.features if 1.0 in roots else t.features[:1] for t in points], dtype=float)
    y = np.array([t.fp32_ms - t.step_ms for t in points], dtype=float)
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    per_ms, root_ms = float(coef[0]), float(coef[1]) if len(coef) > 1 else 0.0
    if not per_ms > 0:
        return None
    fp32_ms = float(np.median([t.fp32_ms for t in points]))
    partial = SpeedFit(per_ms, root_ms, fp32_ms, 0.0, roots)
    errors = [partial.speedup(t.features, t.fp32_ms) / (t.fp32_ms / t.step_ms) - 1 for t in points]
    return dataclasses.replace(partial, error=max(abs(e) for e in errors))


def too_slow(timed: Sequence[Timed], features: tuple[float, float] | None, mark: float | None) -> tuple[float, SpeedFit] | None:
    """(predicted speedup, the fit) of a candidate not worth timing: `timed` fitted (fit), its root setting among
    theirs, and even raised by the fit's margin it stays below `mark` (the k-th fastest timed trial's speedup);
    None where it must be timed (no features, no mark or fit yet, or it might be a finalist)."""
    if features is None or mark is None:
        return None
    speed_fit = fit(timed)
    if speed_fit is None or not speed_fit.covers(features):
        return None
    predicted = speed_fit.speedup(features)
    return (predicted, speed_fit) if predicted * (1 + speed_fit.margin) < mark else None
