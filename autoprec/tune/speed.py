"""A trial's speedup predicted from the profile's layer timings, so a search need not time a candidate that cannot be
among its answers.

The profile times each layer alone in each format. On one device, what a whole step saves over fp32 follows the
sum of its layers' savings closely but not one to one (the casts between formats, what autocast lowers outside
the layers, the optimizer's share), and lowering the model root (everything outside the layers) to a format adds
about a constant. Fitted by least squares on the trials the search has timed so far:

    fp32 step ms - step ms  =  c * sum over layers of (fp32 ms - format ms)  +  r[root format]  (r[fp32] = 0)

A candidate is left untimed (objective.Objective) only where its root format was among the timed trials' (a lowered one
twice) and its predicted speedup, raised by the fit's error (the most a trial left out of the fit ran faster or
slower than predicted, at least MARGIN), is still below the k-th fastest timed trial: k faster candidates are
re-measured at the end (study._finalist_mark).
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
        that only inherits such a format is counted as saving nothing: mostly a root format autocast does not lower
        it to, so it runs fp32 (where its timing failed instead, the fit's error absorbs the difference)."""
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


def _design(points: Sequence[Timed]) -> tuple[np.ndarray, np.ndarray, list[Format]]:
    """The least-squares problem: a column for the summed saving and one per lowered root format; the savings."""
    lowered = sorted({t.features.root for t in points} - {Format.FP32}, key=lambda f: f.value)
    x = np.array([[t.features.saving_ms] + [float(t.features.root is f) for f in lowered] for t in points], dtype=float)
    return x, np.array([t.fp32_ms - t.step_ms for t in points], dtype=float), lowered


def fit(timed: Sequence[Timed]) -> SpeedFit | None:
    """Least squares on the timed trials, judged by leaving each one out in turn (closed form: the fit without
    trial i misses it by e_i / (1 - h_ii)); its error is the worst of those misses, as actual over predicted speedup,
    so a prediction raised by it covers the fastest a trial ran beyond its prediction. None with fewer than MIN_FIT
    finite trials that lower a layer, or where the trials, or all but one of them, cannot determine the fit (fewer
    than two distinct summed savings, a root format's term not separable from the saving's) or say lowering layers
    saves nothing. A lowered root format timed once has its term rest on that trial alone: it is not judged, and not
    covered."""
    points = [t for t in timed if t.fp32_ms > 0 and t.step_ms > 0 and math.isfinite(t.fp32_ms) and math.isfinite(t.step_ms)]
    if sum(t.features.saving_ms != 0 for t in points) < MIN_FIT:
        return None
    savings = Counter(t.features.saving_ms for t in points)
    if len(savings) < 2 or len(savings) == 2 and min(savings.values()) == 1:  # one left out leaves a single saving
        return None
    x, y, lowered = _design(points)
    if np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    inverse = np.linalg.inv(x.T @ x)
    coef = inverse @ x.T @ y
    residual = y - x @ coef
    leverage = np.einsum("ij,jk,ik->i", x, inverse, x)
    counts = Counter(t.features.root for t in points)
    misses = []
    for i, t in enumerate(points):
        if t.features.root is not Format.FP32 and counts[t.features.root] < 2:
            continue  # its root's term rests on it alone
        if leverage[i] > 1 - 1e-9:  # the others cannot determine the fit
            return None
        without = coef - inverse @ x[i] * residual[i] / (1 - leverage[i])
        if not without[0] > 0:
            return None
        predicted_step = t.fp32_ms - (y[i] - residual[i] / (1 - leverage[i]))
        if predicted_step <= 0:
            return None
        misses.append(abs(predicted_step / t.step_ms - 1))  # actual speedup / predicted - 1
    if not coef[0] > 0 or not misses or not all(math.isfinite(m) for m in misses):
        return None
    root_ms = {Format.FP32: 0.0} if Format.FP32 in counts else {}
    root_ms.update({f: float(c) for f, c in zip(lowered, coef[1:]) if counts[f] > 1})
    return SpeedFit(float(coef[0]), root_ms, float(np.median([t.fp32_ms for t in points])), max(misses))


def too_slow(timed: Sequence[Timed], features: Features | None, mark: float | None) -> tuple[float, SpeedFit] | None:
    """(predicted speedup, the fit) of a candidate not worth timing: `timed` fitted (fit), its root format covered
    (SpeedFit.covers), and even raised by the fit's margin it stays below `mark` (the k-th fastest timed trial's speedup);
    None where it must be timed (no features, no mark or fit yet, or it might be among the answers)."""
    if features is None or mark is None:
        return None
    speed_fit = fit(timed)
    if speed_fit is None or not speed_fit.covers(features):
        return None
    predicted = speed_fit.speedup(features)
    return (predicted, speed_fit) if predicted * (1 + speed_fit.margin) < mark else None
