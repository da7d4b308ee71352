"""The accuracy budget as a user gives it: absolute, in the metric's units (`0.01`), or relative to the fp32
metric's magnitude (`1%`), resolved to an absolute drop once the fp32 metric is measured."""

from __future__ import annotations

import dataclasses
import math

DEFAULT = "1%"  # what `autoprec search model.py` uses without --budget: 1% of the fp32 metric's magnitude


@dataclasses.dataclass(frozen=True)
class Budget:
    """`value`: the largest allowed metric drop, or with `relative` the fraction of |fp32 metric| it is."""

    value: float
    relative: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.value, bool)
            or not isinstance(self.value, (int, float))
            or not math.isfinite(self.value)
            or self.value < 0
        ):
            raise ValueError(f"a budget must be a finite number >= 0 (the largest allowed metric drop), but got {self.value!r}")
        # -0.0 passes `>= 0` but prints as "-0" and repr()s apart from 0.0, which names the study: the same budget
        object.__setattr__(self, "value", float(self.value) + 0.0)

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
        number = float(text[:-1] if relative else text) if not isinstance(value, (int, float)) else value
    except ValueError:
        raise ValueError(
            f"a budget must be a number in the metric's units (0.01) or a percentage of the fp32 metric (1%), but got {value!r}"
        ) from None
    if isinstance(number, bool) or not math.isfinite(number) or number < 0:
        raise ValueError(f"a budget must be a finite number >= 0 (the largest allowed metric drop), but got {value!r}")
    return Budget(number / 100 if relative else float(number), relative=relative)


def parse_budget_list(value: object) -> tuple[Budget, ...]:
    """Budgets from "0,0.5%,1%" (commas) or a sequence of numbers and strings."""
    items = [v for v in str(value).split(",") if v.strip()] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    if not items:
        raise ValueError(f"budgets must list at least one number, such as 0,0.005,0.01, but got {value!r}")
    return tuple(parse_budget(item) for item in items)
