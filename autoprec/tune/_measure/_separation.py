"""When one speedup is told apart from another beyond the timing noise: the three rules, named apart and kept together.

Three decisions ask it, of numbers measured with different care, and err on different sides:

- `separated` (the final re-measure; _choose.py): two candidates timed interleaved over many rounds, each with its
  spread (timing.Timing.spread). Told apart where the faster one's lead is beyond their mean spread. Candidates not
  told apart are ties: the safer is chosen, and the policy file lists them (choose.not_separated).
- `beaten` (which trials the final re-measure times; goals.Speed.finalists): a trial's few rounds understate the
  noise, so the wider of the two spreads counts, at least SETTLED, as a factor on both sides. Only a trial whose fast
  end is under the best trial's slow end is left out: leaving out one that might win would cost the answer,
  re-measuring one too many costs only rounds.
- `may_beat` (when the search stops; speed.ceiling): a predicted speedup, raised by the fit's error, against the best
  timed trial's, raised by its half-spread; the search goes on while an untried policy may beat it.
"""

from __future__ import annotations

from typing import Protocol

from autoprec.tune._core._config import SETTLED


class Rated(Protocol):
    """A re-measured candidate's speedup and its spread (records.Measurement)."""

    @property
    def speedup(self) -> float: ...

    @property
    def spread(self) -> float: ...


def separated(a: Rated, b: Rated) -> bool:
    """Whether the step times tell a and b apart: the faster one's lead is beyond their mean spread."""
    fast, slow = (a, b) if a.speedup >= b.speedup else (b, a)
    return fast.speedup / slow.speedup - 1 > (fast.spread + slow.spread) / 2


def beaten(speedup: float, spread: float, best: float, best_spread: float) -> bool:
    """Whether a trial's timing (`speedup`, `spread`) is separated below the best trial's: its fast end under the
    best's slow end, each by a factor of 1 + half the wider spread, at least SETTLED."""
    # a few rounds' spread understates the noise: the wider of the two, and at least SETTLED, on both sides; as a
    # factor each way (a spread past 2 would put 1 - half below zero, and beat nothing however far apart they ran)
    half = max(spread, best_spread, SETTLED) / 2
    return speedup * (1 + half) < best / (1 + half)


def may_beat(predicted: float, margin: float, best: float, noise: float) -> bool:
    """Whether a `predicted` speedup, raised by the fit's `margin`, is beyond `best` raised by its `noise` (the best
    timed trial's half-spread)."""
    return predicted * (1 + margin) > best * (1 + noise)
