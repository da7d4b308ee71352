"""autoprec/tune/_core/_numbers.py: the numbers a person types are ASCII digits, never what else float() and int() read."""

import argparse

import pytest

from autoprec.tune._core._numbers import NotANumber, parse_decimal, parse_integer

# float() and int() read all of these as numbers: "_" between digits, Arabic-Indic, full-width and Devanagari digits,
# a non-breaking space around them
NOT_ASCII = ["1_0", "\u0661\u0660", "\uff11\uff10", "\u0967", "\u00a010", "0.0_1"]


@pytest.mark.parametrize("text", NOT_ASCII + ["", "x", "1.2.3", "0x10", "1e", "--1"])
def test_a_decimal_is_ascii_digits_only_and_the_error_names_it_and_the_forms(text):
    with pytest.raises(ValueError, match=r"is not a number in ASCII digits, such as 0\.01, 5, -2 or 1e-3") as info:
        parse_decimal(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", NOT_ASCII[:-1] + ["", "1.0", "1e3", "+"])
def test_an_integer_is_ascii_digits_only(text):
    with pytest.raises(ValueError, match=r"is not a whole number in ASCII digits, such as 20 or -1"):
        parse_integer(text)


def test_what_it_reads_it_reads_as_python_does():
    assert [parse_decimal(t) for t in ("0.01", " 5 ", "-2", "1e-3", ".5", "5.", "1E3", "+0")] == [
        0.01,
        5,
        -2,
        1e-3,
        0.5,
        5,
        1e3,
        0,
    ]
    assert all(parse_decimal(t) != parse_decimal(t) for t in ("nan", "NaN"))  # words the caller's own check refuses
    assert parse_decimal("-inf") == float("-inf") and parse_decimal("Infinity") == float("inf")
    assert [parse_integer(t) for t in ("20", "-1", " +3 ", "007")] == [20, -1, 3, 7]
    with pytest.raises(ValueError, match="too long a number"):
        parse_integer("9" * 5000)


def test_argparse_prints_its_message_as_it_is():
    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--trials", type=parse_integer)
    with pytest.raises(argparse.ArgumentError, match=r"argument --trials: '1_0' is not a whole number in ASCII digits"):
        parser.parse_args(["--trials", "1_0"])
    assert issubclass(NotANumber, ValueError)
