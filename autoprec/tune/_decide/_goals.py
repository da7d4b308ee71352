"""What a search optimises within the budget (and --max-memory): a goal, as a type, and the registry
`--objective` and `SearchConfig(objective=...)` read it from.

A goal is an instance of a Goal subclass, handed to the study as Optuna hands it a sampler: the tuner asks it what
it needs (the study's direction, a trial's value, the order of the finalists, the choice among the re-measured
candidates, the sweep's Pareto column and plot, words for the study key, the reports and the progress bar) and
branches on no goal by name. `register_goal` makes one a choice of `--objective`; `goal_named` finds it.
Three are built in: SPEED (the training-step speedup over fp32, maximised: the default), MEMORY (one training
step's peak memory, minimised: for a model or batch that must fit) and flops.FLOPS (the predicted step speedup on a
named --target device, the step-time predictor's: for planning where the formats' kernels are not on this machine). docs/measuring.md, "Adding a goal", lists what
a goal implements.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import optuna

from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import MEMORY_TIE
from autoprec.tune._core._goal import INFEASIBLE, Axis, Goal, Ranked, register_goal, speedup_of
from autoprec.tune._core._names import ALTERNATIVES
from autoprec.tune._core._records import Finals, Measurement, TrialRecord
from autoprec.tune._decide._choose import choose, choose_smallest, not_separated
from autoprec.tune._decide._trials import best_speedup, smallest_peak
from autoprec.tune._measure._timing import beaten, separated

if TYPE_CHECKING:
    from autoprec.policy import Policy
    from autoprec.tune._core._profile_row import ProfileRow
    from autoprec.tune._core._records import Candidate

# ---- the built-in goals ------------------------------------------------------------------------------------------


def _beaten(trial: TrialRecord, best: TrialRecord) -> bool:
    """Whether the trial's timing is separated below the best's (timing.beaten): it cannot win the final
    re-measure, so it is not timed there."""

    def spread(r: TrialRecord) -> float:
        return r.spread if r.spread is not None and math.isfinite(r.spread) else 0.0

    return beaten(speedup_of(trial), spread(trial), speedup_of(best), spread(best))


class Speed(Goal):
    """The training-step speedup over fp32, maximised (the default): choose.choose picks among the re-measured."""

    name = "speed"
    label = "speedup"
    direction = "maximize"
    summary = "training-step speed"
    infeasible = 0.0
    axis = Axis(column="speedup", title="training-step speedup over fp32", best="the fastest", fp32=1.0)
    ranks_by_speed = True

    def value(self, record: TrialRecord, policy: Policy) -> float | None:
        # a trial within budget always has a speedup: measured, predicted, copied, or fp32's 1.0
        return record.speedup

    def finalists(self, good: Ranked) -> Ranked:
        """The fastest first; none whose timing is separated below the fastest trial's (_beaten)."""
        order = sorted(good, key=lambda tr: -speedup_of(tr[1]))
        return [(t, r) for t, r in order if not _beaten(r, order[0][1])]

    def choose(
        self, finals: Finals, candidates: Mapping[str, Policy | Candidate], alternatives: Collection[str] = ALTERNATIVES
    ) -> tuple[str, str]:
        return choose(finals, candidates, alternatives)

    def kept(self, before: Measurement, pick: Measurement, candidates: Mapping[str, Policy | Candidate]) -> str | None:
        # beyond the tie `choose` allows, or a larger budget would undo its own rule and decide otherwise than a
        # search of that budget on the same measurements
        worse = pick.speedup < before.speedup and separated(pick, before)
        return "faster, beyond the noise," if worse else None

    def ties(self, finals: Finals, name: str) -> tuple[str, ...]:
        return tuple(not_separated(finals, name))

    def progress(self, study: optuna.Study) -> dict[str, str]:
        # a trial's own short timing: the final re-measure, not this, is what the policy reports
        return {"best_trial_before_remeasure": f"{best_speedup(study):.3f}x"}


class Memory(Goal):
    """One training step's peak memory, minimised (for a model or batch that must fit): choose.choose_smallest."""

    name = "memory"
    label = "peak memory"
    direction = "minimize"
    summary = "the smallest peak memory (for a model or batch that must fit)"
    infeasible = INFEASIBLE
    axis = Axis(
        column="peak_bytes",
        title="peak memory per training step (MiB)",
        best="the smallest peak",
        unit=float(memory.MIB),
        fp32_label="fp32's peak",
    )
    chosen_for = "the smallest peak memory within budget"
    needs_peak = True

    def layer_cost(self, row: ProfileRow) -> float:
        """The most the live bytes rose over the layer's own step in the row's format (its profile's
        step_rise_bytes; NaN where the device has no measurement): the greedy policy lowers what saves memory."""
        return row.step_rise_bytes

    def value(self, record: TrialRecord, policy: Policy) -> float | None:
        return record.peak_bytes / memory.MIB if record.peak_bytes is not None else None

    def finalists(self, good: Ranked) -> Ranked:
        """The smallest peak first (the faster among equal peaks); none without a measured peak."""
        peaks = [(t, r) for t, r in good if r.peak_bytes is not None]
        return sorted(peaks, key=lambda tr: (tr[1].peak_bytes or 0, -speedup_of(tr[1])))

    def choose(
        self, finals: Finals, candidates: Mapping[str, Policy | Candidate], alternatives: Collection[str] = ALTERNATIVES
    ) -> tuple[str, str]:
        return choose_smallest(finals, candidates, alternatives)

    def kept(self, before: Measurement, pick: Measurement, candidates: Mapping[str, Policy | Candidate]) -> str | None:
        if pick.peak_bytes is None or before.peak_bytes is None or pick.peak_bytes <= before.peak_bytes * (1 + MEMORY_TIE):
            return None  # within the tie choose_smallest allows: this budget's choice stands
        return f"smaller, beyond the {MEMORY_TIE:.0%} tie,"

    def progress(self, study: optuna.Study) -> dict[str, str]:
        return {"smallest_peak": memory.human_bytes(smallest_peak(study))}


SPEED = register_goal(Speed())
MEMORY = register_goal(Memory())

# the FLOP-count goal for a target device this machine is not (_flops.py), registered there after these two
from autoprec.tune._decide import _flops as _flops  # noqa: E402, F401
