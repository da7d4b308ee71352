"""What a goal is (Goal, the type every goal subclasses) and the registry `--objective` and
`SearchConfig(objective=...)` read goals from: at the bottom of the tuner, beside the config that names one, so that
neither imports the goals' implementations (_goals.py: speed and memory; _flops.py: flops), which import the
choice's rules. The built-in goals register when autoprec.tune is imported.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import optuna
import torch

from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.registry import Registry
from autoprec.tune._core._names import ALTERNATIVES
from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._records import Candidate, Finals, Measurement, TrialRecord
from autoprec.tune._core._space import SearchSpace


class GoalSettings(Protocol):
    """What a goal's checks (check_space, check_formats, bound) read of the search's settings: a SearchConfig is one.
    Named by what it holds, not by the config's type, which holds its goal: so this module imports no config."""

    @property
    def target(self) -> str | None:
        """The registered target (_targets.py) a goal that plans for a named device requires (Goal.targeted)."""
        ...


DEFAULT_GOAL = "speed"  # SearchConfig's objective when none is given, listed first by --objective's help

INFEASIBLE = 1e9  # constraint value of a candidate whose loss or metric is not finite; a minimised goal's worst value

Ranked = list[tuple[optuna.trial.FrozenTrial, TrialRecord]]  # completed trials with their records


@dataclasses.dataclass(frozen=True)
class Axis:
    """Where a goal's value is a column of the trials table (trials.csv, sweep_trials.csv) and a field of each
    re-measured candidate (records.Measurement) and budget row (_results.BudgetRow): the sweep's Pareto front over it
    and metric drop (sweeper.pareto_front), and pareto.png's y axis (plots.pareto_figure)."""

    column: str  # "speedup", "peak_bytes"
    title: str  # the y axis: "training-step speedup over fp32"
    best: str  # what the front is where every drop is 0, in the legend: "the fastest"
    unit: float = 1.0  # the plot divides the column by it (bytes -> MiB)
    # fp32's place on the axis where it is known by definition (a speedup's 1.0): a plain line there; None: at
    # fp32's re-measured value, labelled `fp32_label`
    fp32: float | None = None
    fp32_label: str = "fp32"


class Goal(abc.ABC):
    """One `--objective` choice. Subclass it, set the class attributes, implement `value` and `choose` (and
    override what else differs), and register an instance with `register_goal`."""

    name: ClassVar[str]  # --objective's value, SearchConfig(objective=...), a policy's measured.objective
    # the value in words: the study key's objectives ("speedup", "peak memory, metric drop"), the plot's title
    label: ClassVar[str]
    direction: ClassVar[Literal["maximize", "minimize"]]  # the study's first direction (a sweep's second: the drop)
    summary: ClassVar[str]  # for --objective's help: "training-step speed"
    # the value of a trial over budget, or with no value measured (`value` None): the worst there is; the default
    # for a maximised goal is 0.0 (a value never below 0), for a minimised one INFEASIBLE
    infeasible: ClassVar[float | None] = None
    axis: ClassVar[Axis | None] = None  # the sweep's Pareto column and plot; None: no front, the plot by speed
    chosen_for: ClassVar[str | None] = None  # the report's "chosen for ..." ("the smallest peak memory within budget")
    # The value is the measured speedup: a trial the profile's layer times predict out of the running is left
    # untimed (_speed.py), a trial's timing stops against the finalists' marks (objective.Objective._settled), and
    # the re-measured candidates the timing cannot separate from the choice are recorded as ties and reported.
    ranks_by_speed: ClassVar[bool] = False
    needs_peak: ClassVar[bool] = False  # a trial without a measured peak memory is infeasible (_memory.py)
    # A trial within budget is timed and its peak memory measured. False: its value needs neither (an estimate from
    # the policy and the profile: _flops.py), so a trial is its metric alone, and --max-memory is refused.
    timed: ClassVar[bool] = True
    # It plans for a named target device (--target, SearchConfig.target: _targets.py), which it then requires.
    targeted: ClassVar[bool] = False
    # The formats a search space's list (a layer type's, or `default`, the root's) may hold as its fallback, preferred
    # first: what a layer keeps where no lower format fits the budget (the profile never rules it out), what the
    # profile-greedy policy starts from and what the choice falls back to when nothing else is within budget. fp32 for
    # a measured goal, whose budget and speedups are against all-fp32; the FLOP goal also takes bf16, its estimate's
    # baseline, so a space for it may list bf16 instead of fp32.
    fallbacks: ClassVar[tuple[str, ...]] = ("fp32",)

    def fallback(self, formats: Collection[Format]) -> Format | None:
        """A list's fallback under this goal: the first of `fallbacks` it holds, else None (check_space refuses it)."""
        return next((Format(f) for f in self.fallbacks if Format(f) in formats), None)

    def check_space(self, space: SearchSpace, config: GoalSettings) -> Goal:
        """Refuse, before anything is measured, a search space this goal cannot search, and return the goal for it:
        each list must hold one of `fallbacks` (check_fallbacks: a ValueError naming the list, what it holds and the
        fix), and `check_formats` must accept its formats. Returns itself by default; a goal that needs the space's
        fallback later (the FLOP goal's choice) returns an instance that holds it."""
        self.check_fallbacks(space)
        self.check_formats(list(dict.fromkeys(f for fs in (space.default, *space.layers.values()) for f in fs)), config)
        return self

    def check_fallbacks(self, space: SearchSpace) -> None:
        """Refuse (ValueError naming the list, what it holds and the fix) a list of `space` without one of
        `fallbacks` (fp32; for the FLOP goal fp32 or bf16): the format a layer keeps where nothing lower fits."""
        for field, formats in space.lists():
            if self.fallback(formats) is None:
                names = [f.value for f in formats]
                if self.fallbacks == ("fp32",):  # as space files were refused before goals chose their fallbacks
                    raise ValueError(f"{space.source}: {field} must include fp32 (the fallback every layer needs), got {names}")
                raise ValueError(
                    f"{space.source}: {field} must include {' or '.join(self.fallbacks)} (the fallback every layer "
                    f"needs under --objective {self.name}), got {names}; add {self.fallbacks[0]} to it"
                )

    def layer_fallbacks(self, space: SearchSpace, model: torch.nn.Module) -> dict[str, Format]:
        """Each of `model`'s tunable layers under `space`, by name, with its fallback under this goal (`fallback` of
        its list): the format it keeps where nothing lower fits the budget."""
        out: dict[str, Format] = {}
        for name, formats in space.tunable_layers(model).items():
            found = self.fallback(formats)
            if found is None:
                self.check_fallbacks(space)  # names the list
            out[name] = found or Format.FP32
        return out

    def check_formats(self, formats: Collection[Format], config: GoalSettings) -> None:
        """Refuse, before any measurement, a search space whose `formats` the goal cannot plan with (ValueError
        naming them and the fix); the default accepts any. The flops goal refuses formats its target does not run,
        which it would otherwise find only once the profile is measured."""
        return None

    def bound(self, rows: Sequence[ProfileRow], config: GoalSettings) -> Goal:
        """The goal for one search, given its profile's rows and its config (the pipeline calls it once the profile is
        measured; the study's trials and the choice then use what it returns): itself by default. A goal whose value
        is computed from the profile (_flops.py: each Linear's FLOPs) returns an instance that holds it; ValueError
        where the search cannot be planned (a format the target does not run)."""
        return self

    def layer_cost(self, row: ProfileRow) -> float:
        """One layer in one format (a profile row) by this goal's measure of cost, lower better, NaN where unknown: the
        order of the profile-greedy policy's moves (choices.greedy_layers). The default: the layer's own step time
        its profile measured on this device. A goal that plans for another device prices it there."""
        return row.time_ms

    def estimated(self, policy: Policy) -> float | None:
        """A candidate's value computed from its policy alone, not measured (the FLOP goal's estimate), or None (the
        default: the value is measured). The policy file records it beside each result."""
        return None

    def estimate_record(self, policy: Policy, candidates: Mapping[str, Policy | Candidate]) -> dict[str, Any] | None:
        """What the policy file's measured.estimate records of the chosen `policy`'s estimate (its goal, target, that
        it is an estimate, the words reports show, `candidates`' estimates by name), or None: nothing estimated."""
        return None

    @abc.abstractmethod
    def value(self, record: TrialRecord, policy: Policy) -> float | None:
        """A trial within budget's value, from what it measured (and its policy); None where it was not measured
        (the trial is then infeasible)."""

    @abc.abstractmethod
    def choose(
        self, finals: Finals, candidates: Mapping[str, Policy | Candidate], alternatives: Collection[str] = ALTERNATIVES
    ) -> tuple[str, str]:
        """(candidate, why): the choice among the re-measured candidates within one budget (`finals`), never worse
        than the best of `alternatives` where the goal compares them (_choose.py's rules)."""

    @property
    def worst(self) -> float:
        """A trial's value when infeasible (`infeasible`)."""
        if self.infeasible is not None:
            return self.infeasible
        return 0.0 if self.direction == "maximize" else INFEASIBLE

    def trial_value(self, record: TrialRecord, policy: Policy) -> float:
        """The study's first value for a trial: `value` where it is feasible and measured, else `worst`. The
        constraints, not this value, keep an infeasible trial from winning."""
        found = self.value(record, policy) if record.feasible else None
        return self.worst if found is None else found

    def finalists(self, good: Ranked) -> Ranked:
        """The study's feasible trials (within the budget at hand) in the order they become finalists, best first;
        those left out are never finalists. By default: by the trial's first value in the study's direction, the
        faster first among equals."""
        sign = 1.0 if self.direction == "minimize" else -1.0
        valued = [(t, r) for t, r in good if t.values]
        return sorted(valued, key=lambda tr: (sign * tr[0].values[0], -speedup_of(tr[1])))

    def kept(self, before: Measurement, pick: Measurement, candidates: Mapping[str, Policy | Candidate]) -> str | None:
        """Where a larger budget's `pick` measured worse than the smaller budget's choice `before`, beyond the tie
        `choose` allows, how (it completes "`before` measured ... than `pick`": "faster, beyond the noise,"): the
        smaller budget's choice then stands. None (the default): each budget's choice stands."""
        return None

    def ties(self, finals: Finals, name: str) -> tuple[str, ...]:
        """The candidates within budget the measurement cannot tell from the chosen `name` (the policy's
        measured.not_separated; the summary reports the tie). None by default."""
        return ()

    def progress(self, study: optuna.Study) -> dict[str, str]:
        """What the progress bar shows after each trial: by default the best feasible trial's value so far."""
        values = [
            t.values[0]
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.values and TrialRecord.of(t).feasible
        ]
        best = (max if self.direction == "maximize" else min)(values, default=None)
        return {f"best_{re.sub(r'[^a-z0-9]+', '_', self.label.lower())}": "-" if best is None else f"{best:.4g}"}

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<goal {self.name!r}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # a registered goal pickles (and deep-copies) as its name: a worker's SearchConfig holds the same instance
        if _REGISTRY.get(getattr(self, "name", None) or "") is self:
            return goal_named, (self.name,)
        return super().__reduce_ex__(protocol)


# ---- the registry ------------------------------------------------------------------------------------------------

_REGISTRY: Registry[Goal] = Registry("goal")  # name -> goal, in registration order (the order --objective lists them)
G = TypeVar("G", bound="Goal | type[Goal]")


def register_goal(goal: G) -> G:
    """Make `goal` (an instance, or a Goal subclass, then instantiated: a class decorator) a choice of
    --objective and SearchConfig(objective=...). Refuses (ValueError) a name already taken, a name that is not
    lowercase letters, digits, '-' and '_', and a direction that is neither "maximize" nor "minimize"."""
    instance = goal() if isinstance(goal, type) else goal
    if not isinstance(instance, Goal):
        raise ValueError(f"register_goal takes a Goal or a Goal subclass, but got {goal!r}")
    what = type(instance).__qualname__
    # the name rule (registry.NAME) is every registry's: an --objective value and part of the study key
    name = _REGISTRY.check_name(getattr(instance, "name", None), what)
    _REGISTRY.refuse_taken(name, f"unregister_goal({name!r}) first to replace it, or give {what} another name")
    if getattr(instance, "direction", None) not in ("maximize", "minimize"):
        raise ValueError(f"goal {name!r}: direction must be 'maximize' or 'minimize', but got {instance.direction!r}")
    for attr in ("label", "summary"):
        if not isinstance(getattr(instance, attr, None), str):
            raise ValueError(f"goal {name!r}: {attr} must be a few words (see Goal)")
    same = next((g for g in _REGISTRY.values() if g.label == instance.label), None)
    if same is not None:  # the study key records the label: two goals under one would share (and clash in) a study
        raise ValueError(f"goal {name!r}: label {instance.label!r} is goal {same.name!r}'s; give it a label of its own")
    _REGISTRY[name] = instance
    return goal


def unregister_goal(name: str) -> Goal:
    """Remove the goal `name` and return it (KeyError if none is registered)."""
    return _REGISTRY.pop(name)


def goals() -> tuple[Goal, ...]:
    """The registered goals, in registration order."""
    return tuple(_REGISTRY.values())


def goal_named(value: object) -> Goal:
    """The registered goal of that name (in any case; a Goal is returned as it is); a ValueError listing the
    registered names otherwise, as SearchConfig(objective=...) and --objective report it."""
    if isinstance(value, Goal):
        return value
    found = _REGISTRY.get(str(value).strip().lower()) if isinstance(value, str) else None
    if found is None:
        raise ValueError(f"objective must be one of {', '.join(_REGISTRY)}, but got {value!r}")
    return found


def recorded_goal(name: str | None) -> Goal | None:
    """The goal a policy file's measured.objective names, where it is registered here; None otherwise (a goal of a
    module not imported now): a report then says nothing that depends on the goal."""
    return _REGISTRY.get(name) if name else None


def objective_help() -> str:
    """--objective's help: every registered goal's summary, the default (DEFAULT_GOAL, SearchConfig's) first."""
    first = sorted(goals(), key=lambda g: g.name != DEFAULT_GOAL)
    parts = [f"{g.summary} (default)" if g.name == DEFAULT_GOAL else g.summary for g in first]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + ", or " + parts[-1]
    return f"what to optimise within the budget: {listed}"


def objective_metavar() -> str:
    return "{" + ",".join(_REGISTRY) + "}"


def speedup_of(record: TrialRecord) -> float:
    return record.speedup if record.speedup is not None else 0.0  # every trial within budget has one
