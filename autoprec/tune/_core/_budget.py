"""The accuracy budget as a user gives it: absolute, in the metric's units (`0.01`), or relative to the fp32
metric's magnitude (`1%`), resolved to an absolute drop once the fp32 metric is measured.

What a valid budget is, and a valid list of them, is said here only (`check_budget`, `parse_budgets`,
`check_ascending`): the configuration, the sweep and the pipeline ask this module. The budgets as the user gave them
live in one place (a search's `SearchConfig.budget`, a sweep's `Plan.budgets`); the pipeline resolves them once
(`resolve_budgets`) into the one record (`Budgets`) everything after it reads."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from autoprec.tune._core._numbers import parse_decimal

log = logging.getLogger("autoprec")

DEFAULT = "1%"  # what `autoprec search model.py` uses without --budget: 1% of the fp32 metric's magnitude


def check_budget(value: object, *, what: str = "a budget", shown: object = None) -> float:
    """`value` as an absolute budget: a finite number >= 0 (True is no number), -0.0 as 0.0, since -0.0 prints as
    "-0" and repr()s apart from 0.0, which names the study. Else a ValueError: `what` must be ..., naming `shown`
    (default `value`), as the user gave it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        got = value if shown is None else shown
        raise ValueError(f"{what} must be a finite number >= 0 (the largest allowed metric drop), but got {got!r}")
    return float(value) + 0.0


def check_ascending(budgets: Sequence[float], *, what: str = "budgets") -> None:
    """Budgets in the order a plan needs them: ascending, at least one."""
    if not budgets or list(budgets) != sorted(budgets):
        raise ValueError(f"{what} must be ascending and not empty, but got {budgets!r}")


def _none_listed(value: object) -> ValueError:
    return ValueError(f"budgets must list at least one number, such as 0,0.005,0.01, but got {value!r}")


@dataclasses.dataclass(frozen=True)
class Budget:
    """`value`: the largest allowed metric drop, or with `relative` the fraction of |fp32 metric| it is."""

    value: float
    relative: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", check_budget(self.value))  # a float, -0.0 as 0.0

    def resolve(self, fp32_metric: float) -> float:
        return self.value * abs(fp32_metric) if self.relative else float(self.value)

    def __str__(self) -> str:
        return f"{100 * self.value:g}%" if self.relative else f"{self.value:g}"

    def describe(self, fp32_metric: float) -> str:
        """How the absolute budget came about, for the output: `1% of |fp32 metric 0.953| = 0.00953`."""
        if not self.relative:
            return f"{self.value:g} (absolute, in the metric's units)"
        return f"{self} of |fp32 metric {fp32_metric:.6g}| = {self.resolve(fp32_metric):.4g}"


def parse_budget(value: object) -> Budget:
    """`0.01` or "0.01" (absolute), "1%" (relative to the fp32 metric), or a Budget."""
    if isinstance(value, Budget):
        return value
    text = str(value).strip()
    relative = text.endswith("%")
    try:
        number = parse_decimal(text[:-1] if relative else text) if not isinstance(value, (int, float)) else value
    except ValueError:
        raise ValueError(
            f"a budget must be a number in the metric's units (0.01) or a percentage of the fp32 metric (1%), but got "
            f"{value!r} (ASCII digits, without '_')"
        ) from None
    number = check_budget(number, shown=value)
    if relative and number > 100:  # past an accuracy's whole value every policy passes: likely a slip for 1.5%;
        # a loss-based metric (-(mean eval loss)) can drop that far, so it stands
        log.warning(
            "budget %s: a drop of more than the fp32 metric's whole magnitude; for an accuracy or another metric "
            "bounded at 0 every policy passes it (for a drop of %g%%, write %g%%)",
            value,
            number / 100,
            number / 100,
        )
    return Budget(number / 100 if relative else number, relative=relative)


def parse_budget_list(value: object) -> tuple[Budget, ...]:
    """Budgets from "0,0.5%,1%" (commas) or a sequence of numbers and strings."""
    items = [v for v in str(value).split(",") if v.strip()] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    if not items:
        raise _none_listed(value)
    return tuple(parse_budget(item) for item in items)


def parse_budgets(value: str | Iterable[float]) -> tuple[float, ...]:
    """Absolute budgets from "0,0.002,0.01" or numbers: finite, >= 0, sorted, duplicates dropped."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
    budgets = []
    for item in items:
        try:
            number = parse_decimal(item) if isinstance(item, str) else float(item)
        except (TypeError, ValueError):
            raise ValueError(
                f"budgets must be numbers separated by commas, but got {item!r} in {value!r} (ASCII digits, such as "
                "0.01 or 1e-3, without '_')"
            ) from None
        budgets.append(check_budget(number, what="every budget", shown=item))  # -0.0 is 0.0: one budget, one file name
    if not budgets:
        raise _none_listed(value)
    return tuple(sorted(set(budgets)))


@dataclasses.dataclass(frozen=True)
class Budgets:
    """The budgets a run judges against, resolved once (pipeline.run) from what the user gave: `absolute`, ascending
    and distinct, in the metric's units; `given`: absolute budget -> how the user gave it where relative
    (Budget.describe), for the policy's `budget_given` and the output. The objective, the choices, the finalists and
    the reports read this record, never the configuration's budget as given."""

    absolute: tuple[float, ...]
    given: Mapping[float, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_ascending(self.absolute, what="resolved budgets")
        if len(set(self.absolute)) != len(self.absolute):  # one policy file per budget: a repeat would overwrite one
            raise ValueError(f"resolved budgets must be distinct, but got {self.absolute!r}")

    @property
    def bound(self) -> float:
        """The study's constraint: a trial over the largest budget is infeasible (and not timed)."""
        return self.absolute[-1]

    @property
    def smallest(self) -> float:
        """What the profile's predicted drops must be precise for (out_dir.reuse_or_profile)."""
        return self.absolute[0]


def resolve_budgets(budgets: Sequence[Budget], fp32_metric: Callable[[], float]) -> Budgets:
    """The budgets as absolute metric drops, sorted, repeats dropped; `fp32_metric` is called only where one is
    relative (_metric.workload_fp32_metric: the one evaluation the profile reads too). A relative budget is rounded to 4
    significant digits: a rerun whose fp32 evaluation differs in the last bits is the same budget, so the same study."""
    if not any(b.relative for b in budgets):
        return Budgets(parse_budgets(b.value for b in budgets))
    fp32 = fp32_metric()
    if fp32 == 0:
        log.warning("the fp32 metric is 0, so a relative budget allows no drop at all; give an absolute budget instead")
    resolved = [float(f"{b.resolve(fp32):.4g}") if b.relative else b.value for b in budgets]
    absolute = {r for r, b in zip(resolved, budgets) if not b.relative}  # given as a number too: say nothing more
    given = {r: b.describe(fp32) for r, b in zip(resolved, budgets) if b.relative and r not in absolute}
    return Budgets(parse_budgets(resolved), given)


def absolute_budget(value: float | Budget | None, *, what: str = "config.budget") -> float:
    """`value` where it needs no fp32 metric (a number, an absolute Budget); else a ValueError naming it and the fix."""
    if isinstance(value, Budget) and not value.relative:
        return value.value
    if isinstance(value, Budget) or value is None:
        raise ValueError(
            f"{what}={value if value is None else str(value)!r} is no absolute budget here: pass the absolute one "
            "(budget=0.01), or the smallest of the resolved record: budget=resolve_budgets(...).smallest"
        )
    return check_budget(value, what=what)
