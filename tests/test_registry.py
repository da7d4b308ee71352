"""The one kind of table devices, goals and export targets are registered in."""

import pytest

from autoprec.registry import Registry


class Member:
    pass


def test_a_name_taken_is_refused_naming_its_holder_and_what_to_do_and_the_order_is_kept():
    table: Registry[Member] = Registry("widget")
    table["b"], table["a"] = Member(), Member()
    table.refuse_taken("c", "never said")  # free: nothing raised
    with pytest.raises(ValueError, match=r"^widget 'a' is already registered \(by test_registry\.Member\); rename it$"):
        table.refuse_taken("a", "rename it")
    assert list(table) == ["b", "a"] and table.kind == "widget"
