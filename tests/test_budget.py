"""Budgets as users give them: absolute in the metric's units, or relative to the fp32 metric's magnitude."""

import pytest

from autoprec.tune._core._budget import (
    DEFAULT,
    Budget,
    Budgets,
    absolute_budget,
    check_ascending,
    parse_budget,
    parse_budget_list,
    parse_budgets,
    resolve_budgets,
)


def test_absolute_and_relative_budgets_parse_and_resolve_against_the_fp32_metric():
    assert parse_budget("0.01") == Budget(0.01) and parse_budget(0.02) == Budget(0.02) and parse_budget(0) == Budget(0.0)
    one = parse_budget(" 1% ")
    assert one == Budget(0.01, relative=True) and str(one) == "1%"
    assert one.resolve(-2.5) == pytest.approx(0.025)  # a loss-like metric (higher is better, so negative)
    assert parse_budget("0.01").resolve(123.0) == 0.01
    assert one.describe(0.9) == "1% of |fp32 metric 0.9| = 0.009"
    assert parse_budget(DEFAULT) == one and parse_budget(one) is one


@pytest.mark.parametrize("text", ["-0.1", "-1%", "nan", "inf", "1e999%", "x", "%", "1 %%"])
def test_a_budget_that_is_no_finite_non_negative_number_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="budget must be") as info:
        parse_budget(text)
    assert repr(text) in str(info.value)


def test_a_relative_budget_over_100_percent_stands_with_a_warning(caplog):
    """150% of an accuracy's magnitude passes every policy (digits: a drop of 1.458 from 0.972), likely a slip for
    1.5%; of a loss-based metric, -(mean eval loss), it is a real budget (a loss of 0.01 allowed to reach 0.025)."""
    with caplog.at_level("WARNING", logger="autoprec"):
        assert parse_budget("150%") == Budget(1.5, relative=True)
    assert "budget 150%: a drop of more than the fp32 metric's whole magnitude" in caplog.text
    assert "for a drop of 1.5%, write 1.5%" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="autoprec"):
        assert parse_budget("100%") == Budget(1.0, relative=True)
    assert caplog.text == ""


def test_budget_lists_take_commas_or_sequences_and_refuse_an_empty_one():
    assert parse_budget_list("0, 0.5%,0.01") == (Budget(0.0), Budget(0.005, relative=True), Budget(0.01))
    assert parse_budget_list([0, "2%"]) == (Budget(0.0), Budget(0.02, relative=True))
    with pytest.raises(ValueError, match="at least one number"):
        parse_budget_list(" , ")
    with pytest.raises(ValueError, match="finite number >= 0"):
        Budget(float("nan"))


@pytest.mark.parametrize("given", ["-0", "-0.0", "-0%", -0.0, " -0e5 "])
def test_minus_zero_is_the_budget_zero_with_its_sign_dropped(given):
    """`--budget=-0` passes the >= 0 check; with its sign kept it printed as "-0" and named another study than
    `--budget 0` (the study records repr(budget))."""
    import math

    from autoprec.tune._core._config import SearchConfig

    budget = parse_budget(given)
    assert budget.value == 0 and math.copysign(1.0, budget.value) == 1.0
    assert str(budget) in ("0", "0%") and repr(budget.resolve(1.0)) == "0.0"
    assert math.copysign(1.0, Budget(-0.0).value) == 1.0
    assert [repr(b) for b in parse_budgets([-0.0, 0.1])] == ["0.0", "0.1"] and parse_budgets("-0") == (0.0,)
    assert repr(parse_budgets("-0")[0]) == "0.0"
    assert repr(SearchConfig(budget=-0.0).budget) == "0.0"


def test_budgets_parse_sorted_without_repeats_and_refuse_bad_values():
    assert parse_budgets("0.02, 0,0.005,0.02") == (0.0, 0.005, 0.02)
    assert parse_budgets([0.1, 0]) == (0.0, 0.1)
    with pytest.raises(ValueError, match=r"numbers separated by commas, but got 'x'"):
        parse_budgets("0,x")
    with pytest.raises(ValueError, match=r"finite number >= 0.*'-0.1'"):
        parse_budgets("0,-0.1")
    with pytest.raises(ValueError, match="at least one number"):
        parse_budgets(" , ")


def test_one_rule_says_what_a_budget_is_wherever_it_is_given():
    """Budget, the configuration and an absolute budget list ask check_budget: True is no budget in any of them (the
    configuration once took it for 1.0), and a plan's budgets must ascend."""
    from autoprec.tune._core._config import SearchConfig

    for make in (Budget, lambda v: SearchConfig(budget=v), parse_budget):
        with pytest.raises(ValueError, match=r"budget must be a finite number >= 0 .*but got True"):
            make(True)
    with pytest.raises(ValueError, match=r"plan.budgets must be ascending and not empty, but got \(0.1, 0.0\)"):
        check_ascending((0.1, 0.0), what="plan.budgets")
    with pytest.raises(ValueError, match="must be ascending and not empty"):
        check_ascending(())


def test_budgets_resolve_once_into_one_record_sorted_without_repeats():
    """The record the pipeline builds: absolute budgets ascending and distinct, the study's bound the largest, and how
    each relative one was given; the fp32 metric is asked for only where a budget is relative."""
    asked = []

    def fp32():
        asked.append(1)
        return -2.0  # a loss-like metric: |fp32| scales the relative budgets

    absolute = resolve_budgets(parse_budget_list("0.02,0"), fp32)
    assert absolute == Budgets((0.0, 0.02)) and absolute.bound == 0.02 and absolute.smallest == 0.0 and not asked
    mixed = resolve_budgets(parse_budget_list("1%,0.02,0.5%,0.01"), fp32)
    assert len(asked) == 1 and mixed.absolute == (0.01, 0.02) and mixed.bound == 0.02
    # 0.5% of 2 is 0.01, given as a number too: the number says it; 1% of 2 is 0.02, given absolute too
    assert mixed.given == {}
    third = resolve_budgets(parse_budget_list("0,0.3333%"), lambda: 1.0)
    assert third.absolute == (0.0, 0.003333) and third.given == {0.003333: "0.3333% of |fp32 metric 1| = 0.003333"}
    with pytest.raises(ValueError, match="resolved budgets must be distinct"):
        Budgets((0.01, 0.01))
    with pytest.raises(ValueError, match="resolved budgets must be ascending and not empty"):
        Budgets(())


def test_a_relative_budget_against_an_fp32_metric_of_zero_allows_no_drop_and_says_so(caplog):
    with caplog.at_level("WARNING", logger="autoprec"):
        assert resolve_budgets((Budget(0.01, relative=True),), lambda: 0.0).absolute == (0.0,)
    assert "the fp32 metric is 0" in caplog.text


def test_an_absolute_budget_is_read_without_the_fp32_metric_and_a_relative_one_is_refused_there():
    assert absolute_budget(0.01) == 0.01 and absolute_budget(Budget(0.02)) == 0.02
    for value in (Budget(0.01, relative=True), None):
        with pytest.raises(ValueError, match=r"config.budget=.* is no absolute budget here: pass the absolute one"):
            absolute_budget(value)
